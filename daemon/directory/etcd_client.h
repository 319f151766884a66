#ifndef RDMA_AGENTD_DAEMON_DIRECTORY_ETCD_CLIENT_H_
#define RDMA_AGENTD_DAEMON_DIRECTORY_ETCD_CLIENT_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "etcd/etcdserverpb/rpc.grpc.pb.h"

namespace rdma_agent {

// The few etcd v3 calls the directory makes (KV, Lease, Auth), over gRPC
// with etcd's own wire contract (proto/etcd). Endpoints are tried in order:
// a call that finds one unreachable moves on to the next (with several,
// round after round until its deadline: a cluster electing a new leader
// answers UNAVAILABLE meanwhile), and later calls start from the one that
// answered. With a user, the client authenticates
// once and again whenever etcd says the token is no longer valid.
//
// Thread-safe.
class EtcdClient {
 public:
  struct Options {
    std::vector<std::string> endpoints;  // "host:port"
    // PEM contents (not paths); TLS when ca_pem is set.
    std::string ca_pem;
    std::string cert_pem;
    std::string key_pem;
    std::string user;
    std::string password;
    absl::Duration call_timeout = absl::Seconds(2);
  };

  explicit EtcdClient(Options options);

  // A lease of `ttl` (whole seconds); its id.
  absl::StatusOr<int64_t> GrantLease(absl::Duration ttl);
  // Renews `lease`; its remaining TTL, zero when etcd no longer has it.
  absl::StatusOr<absl::Duration> KeepAlive(int64_t lease);
  // Revokes `lease`, deleting every key under it.
  absl::Status RevokeLease(int64_t lease);
  // Puts `key` = `value` under `lease` (0: none).
  absl::Status Put(const std::string& key, const std::string& value,
                   int64_t lease);
  // The keys that start with `prefix`, in key order, at most `limit`
  // (`more` says whether there were others).
  absl::StatusOr<etcdserverpb::RangeResponse> RangePrefix(
      const std::string& prefix, int64_t limit, absl::Time deadline);
  absl::Status Delete(const std::string& key);
  // A transaction: `request`'s compares decide which ops run.
  absl::StatusOr<etcdserverpb::TxnResponse> Txn(
      const etcdserverpb::TxnRequest& request);
  // The value of exactly `key`, if it exists; `revision`, when given, gets
  // the store's revision the answer was read at.
  absl::StatusOr<std::optional<mvccpb::KeyValue>> Get(
      const std::string& key, absl::Time deadline, int64_t* revision = nullptr);

  // A Watch stream on the endpoint calls start from, logged in; no
  // deadline: `context` (which must outlive it) ends it with TryCancel.
  using WatchStream =
      grpc::ClientReaderWriterInterface<etcdserverpb::WatchRequest,
                                        etcdserverpb::WatchResponse>;
  absl::StatusOr<std::unique_ptr<WatchStream>> OpenWatch(
      grpc::ClientContext* context);
  // A Watch stream ended with `status`: the next one starts from the next
  // endpoint when this one was unreachable, with a new login when the
  // token was refused.
  void WatchEnded(const grpc::Status& status);

  // "host:port" of the endpoint calls start from.
  std::string current_endpoint() const;

  // Calls made since the start and those that failed, by operation
  // ("get", "transaction", "lease_keep_alive", ...; a Watch stream opened
  // is one "watch" call, failed when it ended other than cancelled). Every
  // operation is listed, at zero until used.
  struct OperationCount {
    std::string operation;
    uint64_t calls = 0;
    uint64_t errors = 0;
  };
  std::vector<OperationCount> Counts() const;

 private:
  struct Endpoint {
    std::string address;
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<etcdserverpb::KV::Stub> kv;
    std::unique_ptr<etcdserverpb::Lease::Stub> lease;
    std::unique_ptr<etcdserverpb::Auth::Stub> auth;
    std::unique_ptr<etcdserverpb::Watch::Stub> watch;
  };

  // Runs `call(endpoint, context)` on each endpoint in turn from the
  // current one until one answers (anything but UNAVAILABLE) or `deadline`
  // passes; re-authenticates once on an invalid token.
  // Counted as one call of `what` (one of the operations Counts lists).
  template <typename Call>
  absl::Status WithFailover(absl::Time deadline, const char* what, Call call);
  template <typename Call>
  absl::Status CallWithFailover(absl::Time deadline, const char* what,
                                Call call);
  // Fills `context` with the deadline and the auth token.
  absl::Status Prepare(Endpoint& endpoint, grpc::ClientContext& context,
                       absl::Time deadline);
  absl::Status Authenticate(Endpoint& endpoint, absl::Time deadline);

  // The counters of the operation WithFailover's `what` names.
  struct Counter {
    std::atomic<uint64_t> calls{0};
    std::atomic<uint64_t> errors{0};
  };
  Counter& CounterOf(const char* what);

  const Options options_;
  std::array<Counter, 9> counters_;  // by operation, as Counts lists them
  std::vector<std::unique_ptr<Endpoint>> endpoints_;
  mutable absl::Mutex mu_;
  size_t current_ ABSL_GUARDED_BY(mu_) = 0;
  std::string token_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_DIRECTORY_ETCD_CLIENT_H_

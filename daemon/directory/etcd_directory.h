#ifndef RDMA_AGENTD_DAEMON_DIRECTORY_ETCD_DIRECTORY_H_
#define RDMA_AGENTD_DAEMON_DIRECTORY_ETCD_DIRECTORY_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "common/rate_limited_log.h"
#include "daemon/directory/directory.h"
#include "daemon/directory/etcd_client.h"
#include "daemon/directory/name_subscribers.h"
#include "daemon/directory/resolve_cache.h"

namespace rdma_agent {

// Agents in an etcd v3 cluster: each agent's record is the key
// <prefix>/agents/<agent id>, under a lease of its own. A keeper thread
// renews the lease every third of its TTL; when the lease is lost (etcd
// restarted without it, or the agent was cut off for longer than the TTL)
// or etcd was unreachable, it grants a new one and puts the record again,
// retrying every second until etcd answers. Withdraw revokes the lease,
// which deletes the record at once; after a crash it expires with the TTL.
// One Watch stream on the names feeds WatchNames subscribers and the
// resolve cache.
class EtcdDirectory final : public Directory {
 public:
  EtcdDirectory(DirectoryOptions options, std::unique_ptr<EtcdClient> client);
  ~EtcdDirectory() override;

  absl::Status PublishAgent(const v1::AgentRecord& record) override;
  void Withdraw() override;
  absl::StatusOr<v1::ListAgentsResponse> ListAgents(
      absl::Time deadline) override;
  std::string name() const override { return options_.address; }
  DirectoryStats Stats() override;
  absl::Status PublishName(const v1::NameRecord& record) override;
  absl::Status UnpublishName(const std::string& name, uint32_t uid) override;
  absl::StatusOr<v1::NameRecord> ResolveName(const std::string& name,
                                             absl::Time deadline) override;
  absl::StatusOr<std::unique_ptr<Subscription>> WatchNames(
      const std::string& prefix, NameEventCallback on_event,
      EndCallback on_end) override;

 private:
  // Follows <prefix>/names/ with one etcd Watch stream, from the revision
  // after the last delivered, reconnecting every second while etcd is away;
  // hands each change to the subscribers.
  void WatcherLoop();
  // Starts WatcherLoop unless it runs.
  void StartWatcher() ABSL_EXCLUSIVE_LOCKS_REQUIRED(subscribers_.mu());
  void StopWatcher();
  // Ends a Watch stream that has not become current within the call
  // timeout (a connection etcd accepted before it served can leave it
  // waiting for good); the watcher then opens another. Called by the
  // keeper at each turn.
  void CancelStuckWatch();
  bool cache_enabled() const { return options_.resolve_cache_entries > 0; }
  // UNAVAILABLE when `record` is this agent's and its lease could not be
  // renewed within its TTL (etcd has dropped it, or will at any moment).
  absl::Status CheckClaimed(const v1::NameRecord& record);
  // The NameEvent of one etcd event; nullopt for an unreadable record.
  std::optional<v1::NameEvent> ToNameEvent(const mvccpb::Event& event) const;
  // Puts `record` under the current lease unless another owner holds its
  // name: ALREADY_EXISTS then.
  absl::Status PutName(const v1::NameRecord& record)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(keeper_mu_);
  // After a new lease: every name this agent holds, put again under it.
  void PutNamesAgain() ABSL_EXCLUSIVE_LOCKS_REQUIRED(keeper_mu_);
  // Puts the record under the lease, granting one first if there is none.
  absl::Status PutRecord() ABSL_EXCLUSIVE_LOCKS_REQUIRED(keeper_mu_);
  // One turn of the keeper: renew, or publish again.
  absl::Status KeepPublished() ABSL_EXCLUSIVE_LOCKS_REQUIRED(keeper_mu_);
  void KeeperLoop();
  void StopKeeper();

  const DirectoryOptions options_;
  const std::unique_ptr<EtcdClient> client_;
  LogRateLimiter failure_log_{absl::Seconds(10)};

  // Serialises etcd calls about this agent's record (keeper and callers).
  absl::Mutex keeper_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  int64_t lease_ ABSL_GUARDED_BY(keeper_mu_) = 0;
  // False until the record has been put under the current lease.
  bool published_ ABSL_GUARDED_BY(keeper_mu_) = false;
  // The names this agent publishes, kept to put them again under a new
  // lease (BufferNames bounds how many).
  absl::flat_hash_map<std::string, v1::NameRecord> names_
      ABSL_GUARDED_BY(keeper_mu_);
  // Some name could not be put again under a new lease: the keeper retries.
  bool names_dirty_ ABSL_GUARDED_BY(keeper_mu_) = false;

  NameSubscribers subscribers_;
  // The last revision handed to the subscribers (0: the watch starts at
  // etcd's current revision).
  int64_t watched_revision_ ABSL_GUARDED_BY(subscribers_.mu()) = 0;
  // Resolved records, kept true by the watch.
  ResolveCache cache_ ABSL_GUARDED_BY(subscribers_.mu());
  // The watch stream is open and current (so the cache is).
  bool watch_synced_ ABSL_GUARDED_BY(subscribers_.mu()) = false;
  // No endpoint has given a current stream for a call timeout (etcd
  // unreachable): the cache is served as it stands, misses fail fast.
  bool watch_lost_ ABSL_GUARDED_BY(subscribers_.mu()) = false;
  absl::Mutex watch_mu_;
  grpc::ClientContext* watch_context_ ABSL_GUARDED_BY(watch_mu_) = nullptr;
  absl::Time watch_opened_ ABSL_GUARDED_BY(watch_mu_);
  bool watch_current_ ABSL_GUARDED_BY(watch_mu_) = false;
  bool watch_stopping_ ABSL_GUARDED_BY(watch_mu_) = false;
  std::thread watcher_;  // started by the first WatchNames

  std::atomic<uint64_t> renewals_ok_{0};
  std::atomic<uint64_t> renewals_failed_{0};

  absl::Mutex mu_;
  std::optional<v1::AgentRecord> record_ ABSL_GUARDED_BY(mu_);
  // Until when etcd keeps this agent's lease for sure: the last grant or
  // renewal's start plus the TTL it answered.
  absl::Time lease_held_until_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread keeper_;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_DIRECTORY_ETCD_DIRECTORY_H_

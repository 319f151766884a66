#ifndef RDMA_AGENTD_DAEMON_DIRECTORY_DIRECTORY_H_
#define RDMA_AGENTD_DAEMON_DIRECTORY_DIRECTORY_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/directory/directory_options.h"
#include "rdma/agent/v1/agent.pb.h"

namespace rdma_agent {

namespace v1 = ::rdma::agent::v1;

// What a directory counts, for the agent's metrics: totals since the start
// (counts never decrease) and current sizes.
struct DirectoryStats {
  uint64_t resolve_cache_hits = 0;
  uint64_t resolve_cache_misses = 0;
  size_t resolve_cache_entries = 0;
  size_t resolve_cache_bytes = 0;
  uint64_t lease_renewals_ok = 0;
  uint64_t lease_renewals_failed = 0;
  size_t watch_streams = 0;  // WatchNames subscribers
  // etcd calls and failures by operation (empty for the local directory).
  struct EtcdOperation {
    std::string operation;
    uint64_t calls = 0;
    uint64_t errors = 0;
  };
  std::vector<EtcdOperation> etcd;
};

// Where agents find each other. Two kinds behind one interface: the local
// directory, which knows this agent alone and needs nothing else to run,
// and an etcd v3 cluster shared by every agent under one key prefix. The
// directory is optional by design: an agent whose directory is down keeps
// serving contexts handed over by other means, and publishes itself again
// when the directory is back.
//
// Thread-safe.
class Directory {
 public:
  virtual ~Directory() = default;

  // Publishes this agent's record (replacing the previous one) and keeps it
  // published until Withdraw, renewing its lease and putting it again after
  // an outage or a lost lease. Answers the first attempt; a failure is
  // retried in the background.
  virtual absl::Status PublishAgent(const v1::AgentRecord& record) = 0;

  // Removes this agent's record now (clean shutdown) and stops renewing.
  // Idempotent; best effort within the call timeout (a record left behind
  // expires with its lease).
  virtual void Withdraw() = 0;

  // Every published agent, ordered by agent id, at most max_listed_agents
  // (then `truncated`). UNAVAILABLE naming the directory when it cannot be
  // reached by `deadline`.
  virtual absl::StatusOr<v1::ListAgentsResponse> ListAgents(
      absl::Time deadline) = 0;

  // "local" or "etcd://host:port,...", for logs and answers.
  virtual std::string name() const = 0;

  // Its counts now.
  virtual DirectoryStats Stats() = 0;

  // Publishes `record` under its name, owned by (agent_id, owner_uid):
  // ALREADY_EXISTS when another owner holds the name; the same owner's
  // earlier record (of an earlier epoch too) is replaced. The name lives as
  // long as this agent's record unless withdrawn; UNAVAILABLE while this
  // agent is not published (the directory unreachable).
  virtual absl::Status PublishName(const v1::NameRecord& record) = 0;

  // Withdraws `name` if this agent published it for `uid`; NOT_FOUND
  // otherwise.
  virtual absl::Status UnpublishName(const std::string& name, uint32_t uid) = 0;

  // The record `name` stands for; NOT_FOUND when nobody holds it. The etcd
  // directory answers from its resolve cache when it can (kept true by its
  // watch, and still served while etcd is away); a miss asks etcd, and
  // fails UNAVAILABLE at once while the watch has lost etcd. A name of this
  // agent's is UNAVAILABLE once its lease could not be renewed within its
  // TTL: the agent no longer claims it.
  virtual absl::StatusOr<v1::NameRecord> ResolveName(const std::string& name,
                                                     absl::Time deadline) = 0;

  // Follows the names under `prefix`: `on_event` gets each name published
  // now, then a SYNCED event, then every PUBLISHED and WITHDRAWN as it
  // happens; `on_end` is called once if the directory can no longer follow
  // (nothing comes after it). Both are called from the directory's thread
  // (or this one, during the call), briefly, and must not call the
  // directory. Destroying the subscription stops the calls; it must not be
  // destroyed from inside them.
  class Subscription {
   public:
    virtual ~Subscription() = default;
  };
  using NameEventCallback = std::function<void(const v1::NameEvent&)>;
  using EndCallback = std::function<void(const absl::Status&)>;
  virtual absl::StatusOr<std::unique_ptr<Subscription>> WatchNames(
      const std::string& prefix, NameEventCallback on_event,
      EndCallback on_end) = 0;
};

// Whether `uid` (a local caller of any agent) may find `record`: its owner
// always, anyone when it is published for any user.
bool VisibleTo(const v1::NameRecord& record, uint32_t uid);
// NOT_FOUND for `name`, the same whether nobody publishes it or the caller
// may not see it.
absl::Status NameNotPublished(const std::string& name);

// The most names a WatchNames starts with; past it RESOURCE_EXHAUSTED
// (SnapshotTooLarge): watch a narrower prefix.
inline constexpr size_t kMaxWatchSnapshot = 4096;
absl::Status SnapshotTooLarge(const std::string& prefix);

// INVALID_ARGUMENT unless `name` is 1 to kMaxNameBytes of letters, digits
// and . _ - : /, not starting with /, with no empty, "." or ".." segment.
absl::Status ValidateName(const std::string& name);
inline constexpr size_t kMaxNameBytes = 256;

// The directory `options` name; INVALID_ARGUMENT for malformed options or
// an unreadable password or certificate file. Nothing is contacted yet.
absl::StatusOr<std::unique_ptr<Directory>> OpenDirectory(
    const DirectoryOptions& options);

// The key of an agent's record: <prefix>/agents/<agent id>.
std::string AgentRecordKey(const DirectoryOptions& options,
                           const std::string& agent_id);
// The key of a name: <prefix>/names/<name>.
std::string NameKey(const DirectoryOptions& options, const std::string& name);

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_DIRECTORY_DIRECTORY_H_

#ifndef RDMA_AGENTD_DAEMON_DIRECTORY_ETCD_DIRECTORY_H_
#define RDMA_AGENTD_DAEMON_DIRECTORY_ETCD_DIRECTORY_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/rate_limited_log.h"
#include "daemon/directory/directory.h"
#include "daemon/directory/etcd_client.h"

namespace rdma_agent {

// Agents in an etcd v3 cluster: each agent's record is the key
// <prefix>/agents/<agent id>, under a lease of its own. A keeper thread
// renews the lease every third of its TTL; when the lease is lost (etcd
// restarted without it, or the agent was cut off for longer than the TTL)
// or etcd was unreachable, it grants a new one and puts the record again,
// retrying every second until etcd answers. Withdraw revokes the lease,
// which deletes the record at once; after a crash it expires with the TTL.
class EtcdDirectory final : public Directory {
 public:
  EtcdDirectory(DirectoryOptions options, std::unique_ptr<EtcdClient> client);
  ~EtcdDirectory() override;

  absl::Status PublishAgent(const v1::AgentRecord& record) override;
  void Withdraw() override;
  absl::StatusOr<v1::ListAgentsResponse> ListAgents(
      absl::Time deadline) override;
  std::string name() const override { return options_.address; }

 private:
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

  absl::Mutex mu_;
  std::optional<v1::AgentRecord> record_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread keeper_;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_DIRECTORY_ETCD_DIRECTORY_H_

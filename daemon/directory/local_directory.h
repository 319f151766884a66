#ifndef RDMA_AGENTD_DAEMON_DIRECTORY_LOCAL_DIRECTORY_H_
#define RDMA_AGENTD_DAEMON_DIRECTORY_LOCAL_DIRECTORY_H_

#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "daemon/directory/directory.h"
#include "daemon/directory/name_subscribers.h"

namespace rdma_agent {

// The embedded default: it knows this agent and nothing else, so a single
// host runs with no directory service at all.
class LocalDirectory final : public Directory {
 public:
  absl::Status PublishAgent(const v1::AgentRecord& record) override;
  void Withdraw() override;
  absl::StatusOr<v1::ListAgentsResponse> ListAgents(
      absl::Time deadline) override;
  std::string name() const override { return "local"; }
  DirectoryStats Stats() override;
  absl::Status PublishName(const v1::NameRecord& record) override;
  absl::Status UnpublishName(const std::string& name, uint32_t uid) override;
  absl::StatusOr<v1::NameRecord> ResolveName(const std::string& name,
                                             absl::Time deadline) override;
  absl::StatusOr<std::unique_ptr<Subscription>> WatchNames(
      const std::string& prefix, NameEventCallback on_event,
      EndCallback on_end) override;

 private:
  // Taken before mu_: changes are delivered in the order they are made.
  NameSubscribers subscribers_;
  int64_t revision_ ABSL_GUARDED_BY(subscribers_.mu()) = 0;
  absl::Mutex mu_;
  std::optional<v1::AgentRecord> self_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, v1::NameRecord> names_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_DIRECTORY_LOCAL_DIRECTORY_H_

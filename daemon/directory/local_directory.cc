#include "daemon/directory/local_directory.h"

namespace rdma_agent {

absl::Status LocalDirectory::PublishAgent(const v1::AgentRecord& record) {
  absl::MutexLock lock(&mu_);
  self_ = record;
  return absl::OkStatus();
}

void LocalDirectory::Withdraw() {
  absl::MutexLock lock(&mu_);
  self_.reset();
}

absl::StatusOr<v1::ListAgentsResponse> LocalDirectory::ListAgents(absl::Time) {
  v1::ListAgentsResponse response;
  response.set_directory(name());
  absl::MutexLock lock(&mu_);
  if (self_.has_value()) *response.add_agents() = *self_;
  return response;
}

}  // namespace rdma_agent

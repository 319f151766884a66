#include "daemon/directory/local_directory.h"

#include "absl/strings/str_cat.h"

namespace rdma_agent {

absl::Status LocalDirectory::PublishAgent(const v1::AgentRecord& record) {
  absl::MutexLock lock(&mu_);
  self_ = record;
  return absl::OkStatus();
}

void LocalDirectory::Withdraw() {
  absl::MutexLock lock(&mu_);
  self_.reset();
  names_.clear();
}

absl::Status LocalDirectory::PublishName(const v1::NameRecord& record) {
  absl::MutexLock lock(&mu_);
  auto [it, added] = names_.try_emplace(record.name(), record);
  if (!added) {
    if (it->second.owner_uid() != record.owner_uid()) {
      return absl::AlreadyExistsError(absl::StrCat(
          "name \"", record.name(), "\" is published by another user"));
    }
    it->second = record;
  }
  return absl::OkStatus();
}

absl::Status LocalDirectory::UnpublishName(const std::string& name,
                                           uint32_t uid) {
  absl::MutexLock lock(&mu_);
  auto it = names_.find(name);
  if (it == names_.end() || it->second.owner_uid() != uid) {
    return absl::NotFoundError(
        absl::StrCat("you have published no name \"", name, "\" here"));
  }
  names_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<v1::NameRecord> LocalDirectory::ResolveName(
    const std::string& name, absl::Time) {
  absl::MutexLock lock(&mu_);
  auto it = names_.find(name);
  if (it == names_.end()) {
    return absl::NotFoundError(
        absl::StrCat("no agent publishes the name \"", name, "\""));
  }
  return it->second;
}

absl::StatusOr<v1::ListAgentsResponse> LocalDirectory::ListAgents(absl::Time) {
  v1::ListAgentsResponse response;
  response.set_directory(name());
  absl::MutexLock lock(&mu_);
  if (self_.has_value()) *response.add_agents() = *self_;
  return response;
}

}  // namespace rdma_agent

#include "daemon/directory/local_directory.h"

#include "absl/strings/match.h"
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
  absl::MutexLock order(&subscribers_.mu());
  {
    absl::MutexLock lock(&mu_);
    auto [it, added] = names_.try_emplace(record.name(), record);
    if (!added) {
      if (it->second.owner_uid() != record.owner_uid()) {
        return absl::AlreadyExistsError(absl::StrCat(
            "name \"", record.name(), "\" is published by another user"));
      }
      it->second = record;
    }
  }
  v1::NameEvent event;
  event.set_kind(v1::NameEvent::PUBLISHED);
  *event.mutable_record() = record;
  subscribers_.Deliver(event, ++revision_);
  return absl::OkStatus();
}

absl::Status LocalDirectory::UnpublishName(const std::string& name,
                                           uint32_t uid) {
  absl::MutexLock order(&subscribers_.mu());
  v1::NameRecord withdrawn;
  {
    absl::MutexLock lock(&mu_);
    auto it = names_.find(name);
    if (it == names_.end() || it->second.owner_uid() != uid) {
      return absl::NotFoundError(
          absl::StrCat("you have published no name \"", name, "\" here"));
    }
    withdrawn = std::move(it->second);
    names_.erase(it);
  }
  withdrawn.clear_remote_context();
  v1::NameEvent event;
  event.set_kind(v1::NameEvent::WITHDRAWN);
  *event.mutable_record() = std::move(withdrawn);
  subscribers_.Deliver(event, ++revision_);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Directory::Subscription>>
LocalDirectory::WatchNames(const std::string& prefix,
                           NameEventCallback on_event, EndCallback on_end) {
  absl::MutexLock order(&subscribers_.mu());
  {
    absl::MutexLock lock(&mu_);
    if (names_.size() > kMaxWatchSnapshot) {
      size_t matching = 0;
      for (const auto& [name, record] : names_) {
        matching += absl::StartsWith(name, prefix) ? 1 : 0;
      }
      if (matching > kMaxWatchSnapshot) return SnapshotTooLarge(prefix);
    }
    v1::NameEvent event;
    event.set_kind(v1::NameEvent::PUBLISHED);
    for (const auto& [name, record] : names_) {
      if (!absl::StartsWith(name, prefix)) continue;
      *event.mutable_record() = record;
      on_event(event);
    }
  }
  v1::NameEvent synced;
  synced.set_kind(v1::NameEvent::SYNCED);
  on_event(synced);
  return subscribers_.Add(prefix, revision_, std::move(on_event),
                          std::move(on_end));
}

absl::StatusOr<v1::NameRecord> LocalDirectory::ResolveName(
    const std::string& name, absl::Time) {
  absl::MutexLock lock(&mu_);
  auto it = names_.find(name);
  if (it == names_.end()) {
    return NameNotPublished(name);
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

DirectoryStats LocalDirectory::Stats() {
  DirectoryStats stats;
  absl::MutexLock lock(&subscribers_.mu());
  stats.watch_streams = subscribers_.size();
  return stats;
}

}  // namespace rdma_agent

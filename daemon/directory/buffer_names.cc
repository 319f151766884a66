#include "daemon/directory/buffer_names.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace rdma_agent {

BufferNames::BufferNames(Directory* directory, size_t max_per_user,
                         size_t max_total)
    : directory_(directory),
      max_per_user_(max_per_user),
      max_total_(max_total),
      worker_([this] { Run(); }) {}

BufferNames::~BufferNames() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  worker_.join();
}

void BufferNames::Forget(const std::string& name) {
  auto it = names_.find(name);
  if (it == names_.end()) return;
  if (--per_user_[it->second.uid] == 0) per_user_.erase(it->second.uid);
  names_.erase(it);
}

absl::Status BufferNames::Publish(const v1::NameRecord& record) {
  absl::Status valid = ValidateName(record.name());
  if (!valid.ok()) return valid;
  const uid_t uid = record.owner_uid();
  absl::MutexLock publish(&publish_mu_);
  {
    absl::MutexLock lock(&mu_);
    auto it = names_.find(record.name());
    const bool held = it != names_.end() && it->second.uid == uid;
    if (!held) {
      if (per_user_[uid] >= max_per_user_) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "you publish ", per_user_[uid],
            " names through this agent, the most --max_names_per_user "
            "allows"));
      }
      if (names_.size() >= max_total_) {
        return absl::ResourceExhaustedError(
            absl::StrCat("this agent publishes ", names_.size(),
                         " names, the most --max_names_total allows"));
      }
    }
  }
  absl::Status status = directory_->PublishName(record);
  if (!status.ok()) return status;
  absl::MutexLock lock(&mu_);
  auto [it, added] =
      names_.try_emplace(record.name(), Held{uid, record.buffer_id()});
  if (added) {
    ++per_user_[uid];
  } else {
    it->second.buffer_id = record.buffer_id();
  }
  return absl::OkStatus();
}

absl::Status BufferNames::Unpublish(uid_t uid, const std::string& name) {
  absl::MutexLock publish(&publish_mu_);
  {
    absl::MutexLock lock(&mu_);
    auto it = names_.find(name);
    if (it == names_.end() || it->second.uid != uid) {
      return absl::NotFoundError(
          absl::StrCat("you have published no name \"", name, "\" here"));
    }
    Forget(name);
  }
  return directory_->UnpublishName(name, uid);
}

void BufferNames::Released(uint64_t id) {
  absl::MutexLock lock(&mu_);
  released_.push_back(id);
}

void BufferNames::Flush() {
  absl::MutexLock lock(&mu_);
  auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return released_.empty() && !busy_;
  };
  mu_.Await(absl::Condition(&done));
}

void BufferNames::Run() {
  for (;;) {
    uint64_t id;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !released_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (stopping_) return;
      id = released_.front();
      released_.pop_front();
      busy_ = true;
    }
    absl::MutexLock publish(&publish_mu_);
    std::vector<std::pair<std::string, uid_t>> gone;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& [name, held] : names_) {
        if (held.buffer_id == id) gone.emplace_back(name, held.uid);
      }
      for (const auto& [name, uid] : gone) Forget(name);
    }
    for (const auto& [name, uid] : gone) {
      absl::Status status = directory_->UnpublishName(name, uid);
      if (!status.ok()) {
        spdlog::warn(
            "directory {}: withdrawing name \"{}\" of released buffer {}: {}",
            directory_->name(), name, id, std::string(status.message()));
      }
    }
    absl::MutexLock lock(&mu_);
    busy_ = false;
  }
}

}  // namespace rdma_agent

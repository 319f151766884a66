#include "backends/buffer_table.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace rdma_agent {

uint64_t BufferTable::NextId() {
  absl::MutexLock lock(&mu_);
  return next_id_++;
}

void BufferTable::Add(std::shared_ptr<Registration> registration) {
  absl::MutexLock lock(&mu_);
  const uint64_t id = registration->id();
  buffers_.emplace(id, std::move(registration));
}

absl::StatusOr<std::shared_ptr<Registration>> BufferTable::Find(
    uint64_t id, uid_t caller) const {
  absl::MutexLock lock(&mu_);
  auto it = buffers_.find(id);
  if (it == buffers_.end() || !MayUse(*it->second, caller)) {
    return absl::NotFoundError(absl::StrCat("no buffer with id ", id));
  }
  return it->second;
}

absl::Status BufferTable::Remove(uint64_t id, uid_t caller) {
  std::shared_ptr<Registration> removed;
  {
    absl::MutexLock lock(&mu_);
    auto it = buffers_.find(id);
    if (it == buffers_.end() || !MayUse(*it->second, caller)) {
      return absl::NotFoundError(absl::StrCat("no buffer with id ", id));
    }
    removed = std::move(it->second);
    buffers_.erase(it);
    // Under the lock: once Remove returns, no op that begins can use it.
    removed->MarkReleased();
    if (removal_listener_) removal_listener_(id);
  }
  // `removed` may be the last reference: unmap outside the lock.
  return absl::OkStatus();
}

void BufferTable::SetRemovalListener(
    std::function<void(uint64_t id)> listener) {
  absl::MutexLock lock(&mu_);
  removal_listener_ = std::move(listener);
}

template <typename Predicate>
std::vector<std::shared_ptr<Registration>> BufferTable::ListIf(
    Predicate keep) const {
  std::vector<std::shared_ptr<Registration>> kept;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, registration] : buffers_) {
      if (keep(*registration)) kept.push_back(registration);
    }
  }
  std::sort(kept.begin(), kept.end(),
            [](const auto& a, const auto& b) { return a->id() < b->id(); });
  return kept;
}

std::vector<std::shared_ptr<Registration>> BufferTable::ListOwnedBy(
    uid_t owner) const {
  return ListIf([owner](const Registration& registration) {
    return registration.owner() == owner;
  });
}

std::vector<std::shared_ptr<Registration>> BufferTable::ListAll() const {
  return ListIf([](const Registration&) { return true; });
}

void BufferTable::Clear() {
  absl::flat_hash_map<uint64_t, std::shared_ptr<Registration>> dropped;
  {
    absl::MutexLock lock(&mu_);
    dropped.swap(buffers_);
    for (auto& [id, registration] : dropped) registration->MarkReleased();
  }
}

absl::StatusOr<std::shared_ptr<Registration>> BufferTable::ResolveForPeer(
    const ServeRequest& request) const {
  auto resolved = Resolve(request, &CheckServeRequest);
  if (!resolved.ok()) Observe(request, resolved.status());
  return resolved;
}

absl::StatusOr<std::shared_ptr<Registration>>
BufferTable::ResolveForNotification(const ServeRequest& target) const {
  auto resolved = Resolve(target, &CheckNotificationTarget);
  if (!resolved.ok()) Observe(target, resolved.status());
  return resolved;
}

void BufferTable::Observe(const ServeRequest& request,
                          const absl::Status& status) const {
  if (refusal_observer_ && !request.requester.empty()) {
    refusal_observer_(request, status);
  }
}

absl::StatusOr<std::shared_ptr<Registration>> BufferTable::Resolve(
    const ServeRequest& request, Check check) const {
  // Token first: nothing a requester without the token is told depends on
  // this agent's epoch or on which ids exist.
  if (request.agent_epoch != epoch_) return StaleContextError();
  std::shared_ptr<Registration> registration;
  {
    absl::MutexLock lock(&mu_);
    auto it = buffers_.find(request.buffer_id);
    if (it == buffers_.end()) return NotRegisteredError();
    registration = it->second;
  }
  absl::Status status = check(*registration, request);
  if (!status.ok()) return status;
  registration->MarkUsed();
  return registration;
}

}  // namespace rdma_agent

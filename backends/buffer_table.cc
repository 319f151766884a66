#include "backends/buffer_table.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/random.h"

namespace rdma_agent {
namespace {

uint32_t RotateRight(uint32_t x, int bits) {
  return (x >> bits) | (x << (32 - bits));
}
uint32_t RotateLeft(uint32_t x, int bits) {
  return (x << bits) | (x >> (32 - bits));
}

// One Speck64 round (alpha 8, beta 3) of words x, y under round key k.
void SpeckRound(uint32_t& x, uint32_t& y, uint32_t k) {
  x = (RotateRight(x, 8) + y) ^ k;
  y = RotateLeft(y, 3) ^ x;
}

std::array<uint32_t, 4> RandomKey() {
  const std::string bytes = RandomBytes(16);
  std::array<uint32_t, 4> key;
  std::memcpy(key.data(), bytes.data(), sizeof(key));
  return key;
}

}  // namespace

BufferIdSequence::BufferIdSequence() : BufferIdSequence(RandomKey()) {}

BufferIdSequence::BufferIdSequence(const std::array<uint32_t, 4>& key) {
  // Speck64/128's key schedule: the round function over the key words,
  // with the round number as key.
  uint32_t k = key[0];
  std::array<uint32_t, 3> l = {key[1], key[2], key[3]};
  for (int i = 0; i < kRounds; ++i) {
    round_keys_[i] = k;
    uint32_t& word = l[i % 3];
    SpeckRound(word, k, static_cast<uint32_t>(i));
  }
}

uint64_t BufferIdSequence::Encrypt(uint64_t block) const {
  uint32_t x = static_cast<uint32_t>(block >> 32);
  uint32_t y = static_cast<uint32_t>(block);
  for (uint32_t k : round_keys_) SpeckRound(x, y, k);
  return (uint64_t{x} << 32) | y;
}

uint64_t BufferIdSequence::Next() {
  uint64_t id = 0;
  while (id == 0) id = Encrypt(counter_++);
  return id;
}

uint64_t BufferTable::NextId() {
  absl::MutexLock lock(&mu_);
  return ids_.Next();
}

void BufferTable::Add(std::shared_ptr<Registration> registration) {
  absl::MutexLock lock(&mu_);
  const uint64_t id = registration->id();
  buffers_.emplace(id, Entry{std::move(registration), added_++});
}

absl::StatusOr<std::shared_ptr<Registration>> BufferTable::Find(
    uint64_t id, uid_t caller) const {
  absl::MutexLock lock(&mu_);
  auto it = buffers_.find(id);
  if (it == buffers_.end() || !MayUse(*it->second.registration, caller)) {
    return absl::NotFoundError(absl::StrCat("no buffer with id ", id));
  }
  return it->second.registration;
}

absl::Status BufferTable::Remove(uint64_t id, uid_t caller) {
  std::shared_ptr<Registration> removed;
  {
    absl::MutexLock lock(&mu_);
    auto it = buffers_.find(id);
    if (it == buffers_.end() || !MayUse(*it->second.registration, caller)) {
      return absl::NotFoundError(absl::StrCat("no buffer with id ", id));
    }
    removed = std::move(it->second.registration);
    buffers_.erase(it);
    // Under the lock: once Remove returns, no op that begins can use it.
    removed->MarkReleased();
    for (const auto& [handle, listener] : removal_listeners_) listener(id);
  }
  // `removed` may be the last reference: unmap outside the lock.
  return absl::OkStatus();
}

int BufferTable::AddRemovalListener(std::function<void(uint64_t id)> listener) {
  absl::MutexLock lock(&mu_);
  removal_listeners_.emplace_back(next_listener_, std::move(listener));
  return next_listener_++;
}

void BufferTable::RemoveRemovalListener(int handle) {
  absl::MutexLock lock(&mu_);
  removal_listeners_.erase(
      std::remove_if(
          removal_listeners_.begin(), removal_listeners_.end(),
          [handle](const auto& entry) { return entry.first == handle; }),
      removal_listeners_.end());
}

template <typename Predicate>
std::vector<std::shared_ptr<Registration>> BufferTable::ListIf(
    Predicate keep) const {
  std::vector<Entry> entries;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, entry] : buffers_) {
      if (keep(*entry.registration)) entries.push_back(entry);
    }
  }
  // Sorted outside the lock the data path takes.
  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return a.added < b.added; });
  std::vector<std::shared_ptr<Registration>> kept;
  kept.reserve(entries.size());
  for (Entry& entry : entries) kept.push_back(std::move(entry.registration));
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
  absl::flat_hash_map<uint64_t, Entry> dropped;
  {
    absl::MutexLock lock(&mu_);
    dropped.swap(buffers_);
    for (auto& [id, entry] : dropped) entry.registration->MarkReleased();
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
    registration = it->second.registration;
  }
  absl::Status status = check(*registration, request);
  if (!status.ok()) return status;
  registration->MarkUsed();
  return registration;
}

}  // namespace rdma_agent

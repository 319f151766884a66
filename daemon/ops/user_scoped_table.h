#ifndef RDMA_AGENTD_DAEMON_OPS_USER_SCOPED_TABLE_H_
#define RDMA_AGENTD_DAEMON_OPS_USER_SCOPED_TABLE_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "common/random.h"

namespace rdma_agent {

// Immutable entries a local user asked the agent to keep (imported remotes,
// prepared transfers), under ids that name them to their owner only: an id
// is random (63 bits, never 0), so it says nothing of other users' entries,
// and another user's id reads exactly like an unknown one.
//
// Entries are shared: a reader keeps what it found after the entry is
// removed, and whatever the entry owns (its quota charges) goes with the
// last reference. Thread-safe.
template <typename T>
class UserScopedTable {
 public:
  // Keeps `value` for `owner`; returns its new id.
  uint64_t Add(uid_t owner, std::shared_ptr<const T> value) {
    absl::MutexLock lock(&mu_);
    for (;;) {
      const uint64_t id = RandomNonZeroU64() >> 1;
      if (id == 0) continue;
      if (entries_.try_emplace(id, Entry{owner, value}).second) return id;
    }
  }

  // `owner`'s entry `id`, or nullptr (unknown, or another user's).
  std::shared_ptr<const T> Find(uid_t owner, uint64_t id) const {
    absl::ReaderMutexLock lock(&mu_);
    auto it = entries_.find(id);
    if (it == entries_.end() || it->second.owner != owner) return nullptr;
    return it->second.value;
  }

  // Removes `owner`'s entry `id`; false when there is none.
  bool Remove(uid_t owner, uint64_t id) {
    std::shared_ptr<const T> removed;  // dropped after the lock
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(id);
    if (it == entries_.end() || it->second.owner != owner) return false;
    removed = std::move(it->second.value);
    entries_.erase(it);
    return true;
  }

  // `owner`'s entries with their ids, in no particular order.
  std::vector<std::pair<uint64_t, std::shared_ptr<const T>>> ListOwnedBy(
      uid_t owner) const {
    std::vector<std::pair<uint64_t, std::shared_ptr<const T>>> owned;
    absl::ReaderMutexLock lock(&mu_);
    for (const auto& [id, entry] : entries_) {
      if (entry.owner == owner) owned.emplace_back(id, entry.value);
    }
    return owned;
  }

  size_t size() const {
    absl::ReaderMutexLock lock(&mu_);
    return entries_.size();
  }

 private:
  struct Entry {
    uid_t owner;
    std::shared_ptr<const T> value;
  };
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Entry> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_OPS_USER_SCOPED_TABLE_H_

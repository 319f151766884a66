#include "daemon/directory/resolve_cache.h"

#include <utility>

namespace rdma_agent {

std::optional<v1::NameRecord> ResolveCache::Lookup(const std::string& name) {
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    ++misses_;
    return std::nullopt;
  }
  ++hits_;
  recency_.splice(recency_.begin(), recency_, it->second.recency);
  return it->second.record;
}

void ResolveCache::Erase(absl::flat_hash_map<std::string, Entry>::iterator it) {
  bytes_ -= it->second.bytes;
  recency_.erase(it->second.recency);
  entries_.erase(it);
}

void ResolveCache::Fill(const v1::NameRecord& record, int64_t revision) {
  if (!enabled()) return;
  const size_t bytes = record.name().size() + record.ByteSizeLong();
  auto it = entries_.find(record.name());
  if (it != entries_.end()) {
    if (it->second.revision >= revision) return;
    Erase(it);
  }
  if (bytes > max_bytes_) return;
  while (!entries_.empty() &&
         (entries_.size() >= max_entries_ || bytes_ + bytes > max_bytes_)) {
    Erase(entries_.find(recency_.back()));
  }
  recency_.push_front(record.name());
  entries_.emplace(record.name(),
                   Entry{record, revision, bytes, recency_.begin()});
  bytes_ += bytes;
}

void ResolveCache::Published(const v1::NameRecord& record, int64_t revision) {
  auto it = entries_.find(record.name());
  if (it == entries_.end() || it->second.revision >= revision) return;
  Erase(it);
  Fill(record, revision);
}

void ResolveCache::Withdrawn(const std::string& name, int64_t revision) {
  auto it = entries_.find(name);
  if (it == entries_.end() || it->second.revision >= revision) return;
  Erase(it);
}

void ResolveCache::Clear() {
  entries_.clear();
  recency_.clear();
  bytes_ = 0;
}

}  // namespace rdma_agent

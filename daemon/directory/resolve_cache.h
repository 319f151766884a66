#ifndef RDMA_AGENTD_DAEMON_DIRECTORY_RESOLVE_CACHE_H_
#define RDMA_AGENTD_DAEMON_DIRECTORY_RESOLVE_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <list>
#include <optional>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "rdma/agent/v1/agent.pb.h"

namespace rdma_agent {

namespace v1 = ::rdma::agent::v1;

// Name records this agent resolved, kept true by the directory's watch:
// each entry carries the directory revision it was last written at, so a
// change older than the entry never overwrites it. Bounded by entries and
// by bytes (name plus serialized record); the least recently used entry
// goes first. A cache with max_entries 0 keeps nothing.
//
// Not thread-safe: the directory holds its watch lock around every call.
class ResolveCache {
 public:
  ResolveCache(size_t max_entries, size_t max_bytes)
      : max_entries_(max_entries), max_bytes_(max_bytes) {}
  ResolveCache(const ResolveCache&) = delete;
  ResolveCache& operator=(const ResolveCache&) = delete;

  // The cached record of `name`, counted as a hit or a miss.
  std::optional<v1::NameRecord> Lookup(const std::string& name);
  // `record` read from the directory, its key last written at `revision`.
  // An entry over max_bytes on its own is not kept.
  void Fill(const v1::NameRecord& record, int64_t revision);
  // A watched change at `revision`: a cached name published again takes
  // the new record; a withdrawn one is dropped. Names not cached are left
  // alone (the cache holds what this agent's callers resolve).
  void Published(const v1::NameRecord& record, int64_t revision);
  void Withdrawn(const std::string& name, int64_t revision);
  // Forgets everything (the watch missed changes).
  void Clear();

  size_t entries() const { return entries_.size(); }
  size_t bytes() const { return bytes_; }
  uint64_t hits() const { return hits_; }
  uint64_t misses() const { return misses_; }
  bool enabled() const { return max_entries_ > 0; }

 private:
  struct Entry {
    v1::NameRecord record;
    int64_t revision;
    size_t bytes;
    std::list<std::string>::iterator recency;
  };
  void Erase(absl::flat_hash_map<std::string, Entry>::iterator it);

  const size_t max_entries_;
  const size_t max_bytes_;
  absl::flat_hash_map<std::string, Entry> entries_;
  std::list<std::string> recency_;  // most recently used first
  size_t bytes_ = 0;
  uint64_t hits_ = 0;
  uint64_t misses_ = 0;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_DIRECTORY_RESOLVE_CACHE_H_

#ifndef RDMA_AGENTD_DAEMON_DIRECTORY_BUFFER_NAMES_H_
#define RDMA_AGENTD_DAEMON_DIRECTORY_BUFFER_NAMES_H_

#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "daemon/directory/directory.h"

namespace rdma_agent {

// The names this agent's users publish, by buffer: bounded per user and in
// total, withdrawn when their buffer goes. Buffer removals are heard under
// the buffer table's lock (Released), so the directory is told on a thread
// of this class's own.
class BufferNames {
 public:
  BufferNames(Directory* directory, size_t max_per_user, size_t max_total);
  ~BufferNames();

  // Publishes `record` (its name, owner uid and buffer id filled in) in the
  // directory: INVALID_ARGUMENT for a malformed name, RESOURCE_EXHAUSTED
  // naming the flag past the caller's or the agent's bound, and the
  // directory's answer otherwise. A name the caller already holds for
  // another buffer moves to this one.
  absl::Status Publish(const v1::NameRecord& record);
  // Withdraws one of `uid`'s names: NOT_FOUND when it holds none such.
  absl::Status Unpublish(uid_t uid, const std::string& name);
  // Buffer `id` was released: its names are withdrawn soon. Quick, no call
  // into the buffer table (a removal listener).
  void Released(uint64_t id);
  // Blocks until every release heard so far has been handled (tests).
  void Flush();
  // Names published through this agent now.
  size_t size() {
    absl::MutexLock lock(&mu_);
    return names_.size();
  }

 private:
  struct Held {
    uid_t uid;
    uint64_t buffer_id;
  };
  void Run();
  void Forget(const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Directory* const directory_;
  const size_t max_per_user_;
  const size_t max_total_;
  // Serialises Publish and Unpublish of one name against each other.
  absl::Mutex publish_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, Held> names_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uid_t, size_t> per_user_ ABSL_GUARDED_BY(mu_);
  std::deque<uint64_t> released_ ABSL_GUARDED_BY(mu_);
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread worker_;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_DIRECTORY_BUFFER_NAMES_H_

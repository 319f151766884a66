#ifndef RDMA_AGENTD_DAEMON_DIRECTORY_NAME_SUBSCRIBERS_H_
#define RDMA_AGENTD_DAEMON_DIRECTORY_NAME_SUBSCRIBERS_H_

#include <cstdint>
#include <list>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "daemon/directory/directory.h"

namespace rdma_agent {

// The WatchNames subscribers of one directory. Events carry the directory's
// revision of the change; a subscriber gets only those after the revision
// of the snapshot it started from. Callbacks run under `mu`, which a
// directory also holds while it takes a snapshot and subscribes, so that no
// change falls between the two.
class NameSubscribers {
 public:
  NameSubscribers() = default;
  NameSubscribers(const NameSubscribers&) = delete;
  NameSubscribers& operator=(const NameSubscribers&) = delete;
  ~NameSubscribers();

  absl::Mutex& mu() ABSL_LOCK_RETURNED(mu_) { return mu_; }

  // Subscribes to changes after `revision` of names under `prefix`; the
  // subscription removes itself when destroyed.
  std::unique_ptr<Directory::Subscription> Add(
      std::string prefix, int64_t revision,
      Directory::NameEventCallback on_event, Directory::EndCallback on_end)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Hands `event`, the change at `revision`, to each subscriber it concerns.
  void Deliver(const v1::NameEvent& event, int64_t revision)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Ends every subscription with `status` (they get nothing more).
  void EndAll(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  bool empty() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return entries_.empty();
  }
  size_t size() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return entries_.size();
  }

 private:
  struct Entry {
    std::string prefix;
    int64_t revision;
    Directory::NameEventCallback on_event;
    Directory::EndCallback on_end;
    bool ended = false;
  };
  class Handle;

  absl::Mutex mu_;
  std::list<Entry> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_DIRECTORY_NAME_SUBSCRIBERS_H_

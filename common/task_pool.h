#ifndef RDMA_AGENTD_COMMON_TASK_POOL_H_
#define RDMA_AGENTD_COMMON_TASK_POOL_H_

#include <cstddef>
#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"

namespace rdma_agent {

// A fixed set of long-lived threads that run the parts of one call at once
// (a batch spanning several backends, or several queue pairs), so that no
// thread is created on the path of a Submit.
//
// RunAll runs the first task on the calling thread and offers the others to
// the pool; whatever no pool thread has started by the time the caller is
// free, the caller runs itself. So RunAll never waits for work nobody will
// do: a saturated pool, or one shared by many callers, only makes the
// caller do more of its own work. Thread-safe.
class TaskPool {
 public:
  // Starts `threads` threads (0: RunAll runs everything on the caller).
  explicit TaskPool(size_t threads);
  // Joins the threads. No RunAll may be in progress.
  ~TaskPool();
  TaskPool(const TaskPool&) = delete;
  TaskPool& operator=(const TaskPool&) = delete;

  // Runs every task and returns when all have returned.
  void RunAll(absl::Span<const std::function<void()>> tasks);

  size_t threads() const { return threads_.size(); }

 private:
  // The tasks of one RunAll call, until every one has returned.
  struct Round;
  struct Item {
    Round* round;
    const std::function<void()>* task;
  };

  void Loop();
  void Finish(Round& round) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  std::deque<Item> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_COMMON_TASK_POOL_H_

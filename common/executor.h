#ifndef RDMA_AGENTD_COMMON_EXECUTOR_H_
#define RDMA_AGENTD_COMMON_EXECUTOR_H_

#include <cstddef>
#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"

namespace rdma_agent {

// A fixed set of long-lived threads that run fire-and-forget tasks in the
// order they were posted: work handed off by a call that must not wait for
// it (a backend's Post). No thread is started per task.
//
// Bounded: at most `max_queued` tasks wait for a thread, in slots made at
// construction (posting allocates nothing of its own); TryPost refuses more
// (the caller then does the work itself, or fails it) instead of waiting
// for room. Post is for the little work that must not be refused
// (releasing what ended work held): past the slots it waits in a list of
// its own, behind them. The owner joins the threads by destroying the
// executor, which first runs every task already queued: a task, once
// accepted, always runs. Thread-safe.
class Executor {
 public:
  using Task = absl::AnyInvocable<void() &&>;

  // Starts `threads` threads (at least 1) named `name` (at most 15
  // characters show, e.g. in top -H).
  Executor(size_t threads, size_t max_queued, const std::string& name);
  // Runs the queued tasks, then joins the threads. No TryPost may be in
  // progress or follow.
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Queues `task` for the next free thread and returns at once: true. False
  // (and `task` untouched, for the caller to run or fail) when `max_queued`
  // tasks already wait.
  [[nodiscard]] bool TryPost(Task& task);
  // Queues `task` whatever waits already (after it, in order): never
  // refused, so not bounded by `max_queued`; the caller bounds how many
  // such tasks there can be (e.g. one per batch in flight). Allocates when
  // the slots are full.
  void Post(Task task);

  size_t threads() const { return threads_.size(); }
  size_t max_queued() const { return max_queued_; }

 private:
  void Loop();

  const size_t max_queued_;
  absl::Mutex mu_;
  // A ring of max_queued_ slots: the `queued_` tasks from `next_` on
  // (wrapping) wait, in order.
  std::vector<Task> slots_ ABSL_GUARDED_BY(mu_);
  size_t next_ ABSL_GUARDED_BY(mu_) = 0;
  size_t queued_ ABSL_GUARDED_BY(mu_) = 0;
  // Tasks Post queued while every slot was taken, in order, behind the
  // slots' (each moves into the slot a thread frees): not empty only while
  // the slots are full.
  std::deque<Task> overflow_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_COMMON_EXECUTOR_H_

#ifndef RDMA_AGENTD_BACKENDS_IBVERBS_WORK_QUEUE_H_
#define RDMA_AGENTD_BACKENDS_IBVERBS_WORK_QUEUE_H_

#include <cstddef>
#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"

namespace rdma_agent::ibverbs {

// A fixed set of long-lived threads taking the tasks handed to them, first
// in first out, while whoever handed them goes on: the part of a posted
// batch that may block (a queue-pair handshake, a full send queue) leaves
// the caller's thread. Thread-safe.
class WorkQueue {
 public:
  using Task = absl::AnyInvocable<void() &&>;

  // Starts `threads` threads (at least one), named `name` (at most 15
  // characters, for ps and debuggers).
  WorkQueue(size_t threads, const std::string& name);
  // Runs the tasks still queued, then joins the threads. No Run may be in
  // progress or follow.
  ~WorkQueue();
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  // Queues `task` to run on one of the threads; never waits.
  void Run(Task task);

  size_t threads() const { return threads_.size(); }

 private:
  void Loop();

  absl::Mutex mu_;
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace rdma_agent::ibverbs

#endif  // RDMA_AGENTD_BACKENDS_IBVERBS_WORK_QUEUE_H_

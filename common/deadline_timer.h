#ifndef RDMA_AGENTD_COMMON_DEADLINE_TIMER_H_
#define RDMA_AGENTD_COMMON_DEADLINE_TIMER_H_

#include <cstdint>
#include <map>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace rdma_agent {

// One thread running tasks at given times: what ends a backend's posted
// batches at their deadline (or soon after their cancellation) without a
// thread waiting on each. Tasks run one at a time, in time order, on that
// thread; they may block briefly (e.g. an ibverbs queue pair's drain),
// which delays the others. Thread-safe.
class DeadlineTimer {
 public:
  using Task = absl::AnyInvocable<void() &&>;
  // Names a scheduled task for Cancel.
  struct Handle {
    absl::Time when;
    uint64_t id = 0;
  };

  // Starts the thread, named `name` (at most 15 characters).
  explicit DeadlineTimer(const std::string& name);
  // Drops the tasks not run yet and joins the thread.
  ~DeadlineTimer();
  DeadlineTimer(const DeadlineTimer&) = delete;
  DeadlineTimer& operator=(const DeadlineTimer&) = delete;

  // Runs `task` at `when` (at once when it has passed).
  Handle At(absl::Time when, Task task);
  // Drops the task of `handle` unless it has started; does not wait for
  // one that is running (Cancel may be called from inside it).
  void Cancel(const Handle& handle);

 private:
  void Loop();

  absl::Mutex mu_;
  absl::CondVar changed_;
  std::map<std::pair<absl::Time, uint64_t>, Task> tasks_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_COMMON_DEADLINE_TIMER_H_

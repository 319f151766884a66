#include "common/executor.h"

#include <algorithm>
#include <utility>

#include "common/thread_name.h"

namespace rdma_agent {

Executor::Executor(size_t threads, size_t max_queued, const std::string& name)
    : max_queued_(max_queued), slots_(max_queued) {
  threads = std::max<size_t>(threads, 1);
  threads_.reserve(threads);
  for (size_t i = 0; i < threads; ++i) {
    threads_.emplace_back([this] { Loop(); });
    NameThread(threads_.back(), name);
  }
}

Executor::~Executor() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& thread : threads_) thread.join();
}

bool Executor::TryPost(Task& task) {
  absl::MutexLock lock(&mu_);
  if (queued_ == max_queued_) return false;
  slots_[(next_ + queued_) % max_queued_] = std::move(task);
  ++queued_;
  return true;
}

void Executor::Post(Task task) {
  absl::MutexLock lock(&mu_);
  if (queued_ == max_queued_) {
    overflow_.push_back(std::move(task));
    return;
  }
  slots_[(next_ + queued_) % max_queued_] = std::move(task);
  ++queued_;
}

void Executor::Loop() {
  absl::MutexLock lock(&mu_);
  while (true) {
    mu_.Await(absl::Condition(
        +[](Executor* executor) ABSL_NO_THREAD_SAFETY_ANALYSIS {
          return executor->stopping_ || executor->queued_ > 0 ||
                 !executor->overflow_.empty();
        },
        this));
    // Stopping drains the queue first: an accepted task always runs.
    if (queued_ == 0 && overflow_.empty()) return;
    Task task;
    if (queued_ == 0) {  // no slots at all (max_queued 0)
      task = std::move(overflow_.front());
      overflow_.pop_front();
    } else {
      task = std::move(slots_[next_]);
      slots_[next_] = nullptr;
      next_ = (next_ + 1) % max_queued_;
      --queued_;
      // The oldest overflowing task takes the slot freed, at the back: the
      // order stays that of posting.
      if (!overflow_.empty()) {
        slots_[(next_ + queued_) % max_queued_] = std::move(overflow_.front());
        overflow_.pop_front();
        ++queued_;
      }
    }
    mu_.Unlock();
    std::move(task)();
    // Destroyed without the lock: what it captured may take locks.
    task = nullptr;
    mu_.Lock();
  }
}

}  // namespace rdma_agent

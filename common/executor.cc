#include "common/executor.h"

#include <pthread.h>

#include <algorithm>
#include <utility>

namespace rdma_agent {

Executor::Executor(size_t threads, size_t max_queued, const std::string& name)
    : max_queued_(max_queued), slots_(max_queued) {
  threads = std::max<size_t>(threads, 1);
  threads_.reserve(threads);
  const std::string short_name = name.substr(0, 15);
  for (size_t i = 0; i < threads; ++i) {
    threads_.emplace_back([this] { Loop(); });
    pthread_setname_np(threads_.back().native_handle(), short_name.c_str());
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

void Executor::Loop() {
  absl::MutexLock lock(&mu_);
  while (true) {
    mu_.Await(absl::Condition(
        +[](Executor* executor) ABSL_NO_THREAD_SAFETY_ANALYSIS {
          return executor->stopping_ || executor->queued_ > 0;
        },
        this));
    // Stopping drains the queue first: an accepted task always runs.
    if (queued_ == 0) return;
    Task task = std::move(slots_[next_]);
    slots_[next_] = nullptr;
    next_ = (next_ + 1) % max_queued_;
    --queued_;
    mu_.Unlock();
    std::move(task)();
    // Destroyed without the lock: what it captured may take locks.
    task = nullptr;
    mu_.Lock();
  }
}

}  // namespace rdma_agent

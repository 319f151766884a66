#include "backends/ibverbs/work_queue.h"

#include <pthread.h>

#include <utility>

namespace rdma_agent::ibverbs {

WorkQueue::WorkQueue(size_t threads, const std::string& name) {
  threads_.reserve(threads == 0 ? 1 : threads);
  for (size_t i = 0; i < (threads == 0 ? 1 : threads); ++i) {
    threads_.emplace_back([this] { Loop(); });
    pthread_setname_np(threads_.back().native_handle(),
                       name.substr(0, 15).c_str());
  }
}

WorkQueue::~WorkQueue() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& thread : threads_) thread.join();
}

void WorkQueue::Run(Task task) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(task));
}

void WorkQueue::Loop() {
  absl::MutexLock lock(&mu_);
  const auto ready = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return !queue_.empty() || stopping_;
  };
  while (true) {
    mu_.Await(absl::Condition(&ready));
    if (queue_.empty()) return;  // stopping, and nothing left to run
    Task task = std::move(queue_.front());
    queue_.pop_front();
    mu_.Unlock();
    std::move(task)();
    // What the task captured goes before the lock is taken again.
    task = nullptr;
    mu_.Lock();
  }
}

}  // namespace rdma_agent::ibverbs

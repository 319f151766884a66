#include "common/task_pool.h"

#include <algorithm>

namespace rdma_agent {

struct TaskPool::Round {
  // Tasks not yet returned, the caller's own included.
  size_t unfinished ABSL_GUARDED_BY(TaskPool::mu_) = 0;
};

TaskPool::TaskPool(size_t threads) {
  threads_.reserve(threads);
  for (size_t i = 0; i < threads; ++i) {
    threads_.emplace_back([this] { Loop(); });
  }
}

TaskPool::~TaskPool() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& thread : threads_) thread.join();
}

void TaskPool::RunAll(absl::Span<const std::function<void()>> tasks) {
  if (tasks.empty()) return;
  if (tasks.size() == 1 || threads_.empty()) {
    for (const auto& task : tasks) task();
    return;
  }
  Round round;
  {
    absl::MutexLock lock(&mu_);
    round.unfinished = tasks.size();
    for (size_t i = 1; i < tasks.size(); ++i) {
      queue_.push_back(Item{&round, &tasks[i]});
    }
  }
  tasks[0]();
  absl::MutexLock lock(&mu_);
  Finish(round);
  // Take back what no thread has started, and run it here.
  while (true) {
    auto mine =
        std::find_if(queue_.begin(), queue_.end(),
                     [&](const Item& item) { return item.round == &round; });
    if (mine == queue_.end()) break;
    const std::function<void()>* task = mine->task;
    queue_.erase(mine);
    mu_.Unlock();
    (*task)();
    mu_.Lock();
    Finish(round);
  }
  // Only tasks running on pool threads are left.
  mu_.Await(absl::Condition(
      +[](Round* r)
           ABSL_NO_THREAD_SAFETY_ANALYSIS { return r->unfinished == 0; },
      &round));
}

void TaskPool::Finish(Round& round) { --round.unfinished; }

void TaskPool::Loop() {
  absl::MutexLock lock(&mu_);
  while (true) {
    mu_.Await(absl::Condition(
        +[](TaskPool* pool) ABSL_NO_THREAD_SAFETY_ANALYSIS {
          return pool->stopping_ || !pool->queue_.empty();
        },
        this));
    if (stopping_) return;
    const Item item = queue_.front();
    queue_.pop_front();
    mu_.Unlock();
    (*item.task)();
    mu_.Lock();
    Finish(*item.round);
  }
}

}  // namespace rdma_agent

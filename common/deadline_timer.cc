#include "common/deadline_timer.h"

#include "common/thread_name.h"

namespace rdma_agent {

DeadlineTimer::DeadlineTimer(const std::string& name)
    : thread_([this] { Loop(); }) {
  NameThread(thread_, name);
}

DeadlineTimer::~DeadlineTimer() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    changed_.Signal();
  }
  thread_.join();
  // Tasks never run are dropped here, outside the thread.
}

DeadlineTimer::Handle DeadlineTimer::At(absl::Time when, Task task) {
  absl::MutexLock lock(&mu_);
  const Handle handle{when, next_id_++};
  auto it = tasks_.emplace(std::pair{when, handle.id}, std::move(task)).first;
  // Only a new earliest task changes how long the thread sleeps.
  if (it == tasks_.begin()) changed_.Signal();
  return handle;
}

void DeadlineTimer::Cancel(const Handle& handle) {
  Task dropped;  // destroyed unlocked: it may hold the last reference
  absl::MutexLock lock(&mu_);
  auto it = tasks_.find(std::pair{handle.when, handle.id});
  if (it == tasks_.end()) return;
  dropped = std::move(it->second);
  tasks_.erase(it);
}

void DeadlineTimer::Loop() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    if (tasks_.empty()) {
      changed_.Wait(&mu_);
      continue;
    }
    auto first = tasks_.begin();
    if (first->first.first > absl::Now()) {
      changed_.WaitWithDeadline(&mu_, first->first.first);
      continue;
    }
    Task task = std::move(first->second);
    tasks_.erase(first);
    mu_.Unlock();
    std::move(task)();
    task = nullptr;
    mu_.Lock();
  }
}

}  // namespace rdma_agent

#include "common/task_pool.h"

#include <atomic>
#include <functional>
#include <set>
#include <thread>
#include <vector>

#include "absl/synchronization/barrier.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace rdma_agent {
namespace {

TEST(TaskPoolTest, RunsEveryTaskOnceAndTheFirstOnTheCaller) {
  TaskPool pool(2);
  std::atomic<int> runs[5] = {};
  std::thread::id first;
  std::vector<std::function<void()>> tasks;
  for (int i = 0; i < 5; ++i) {
    tasks.push_back([&, i] {
      if (i == 0) first = std::this_thread::get_id();
      ++runs[i];
    });
  }
  pool.RunAll(tasks);
  for (const auto& count : runs) EXPECT_EQ(count.load(), 1);
  EXPECT_EQ(first, std::this_thread::get_id());
}

TEST(TaskPoolTest, TasksRunAtOnceOnThePoolThreads) {
  TaskPool pool(2);
  // Three tasks that each wait for all three: they must run concurrently
  // (the caller and both threads), or this never returns.
  absl::Barrier* barrier = new absl::Barrier(3);
  std::vector<std::function<void()>> tasks(3, [&] {
    if (barrier->Block()) delete barrier;
  });
  pool.RunAll(tasks);
}

TEST(TaskPoolTest, ASaturatedPoolMakesTheCallerRunItsOwnTasks) {
  TaskPool pool(1);
  // The only thread is held by another caller's task until we finish: that
  // caller's first task waits until its second one runs, which only the
  // pool's thread can then be doing.
  absl::Notification release;
  absl::Notification held_started;
  std::thread other([&] {
    std::vector<std::function<void()>> held = {
        [&] { held_started.WaitForNotification(); },
        [&] {
          held_started.Notify();
          release.WaitForNotification();
        }};
    pool.RunAll(held);
  });
  held_started.WaitForNotification();
  std::set<std::thread::id> where;
  absl::Mutex mu;
  std::vector<std::function<void()>> tasks(4, [&] {
    absl::MutexLock lock(&mu);
    where.insert(std::this_thread::get_id());
  });
  pool.RunAll(tasks);  // returns although the pool's thread is busy
  EXPECT_EQ(where.size(), 1u);
  EXPECT_EQ(*where.begin(), std::this_thread::get_id());
  release.Notify();
  other.join();
}

TEST(TaskPoolTest, NoThreadsMeansTheCallerRunsEverything) {
  TaskPool pool(0);
  int runs = 0;
  std::vector<std::function<void()>> tasks(3, [&] { ++runs; });
  pool.RunAll(tasks);
  EXPECT_EQ(runs, 3);
}

}  // namespace
}  // namespace rdma_agent

#include "common/executor.h"

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace rdma_agent {
namespace {

TEST(ExecutorTest, RunsTasksOnItsOwnThreadsAndTryPostReturnsAtOnce) {
  Executor executor(2, 16, "test-exec");
  EXPECT_EQ(executor.threads(), 2u);
  absl::Notification release;
  absl::Notification ran;
  std::thread::id ran_on;
  Executor::Task task = [&] {
    release.WaitForNotification();
    ran_on = std::this_thread::get_id();
    ran.Notify();
  };
  // The task blocks until released: TryPost does not wait for it.
  ASSERT_TRUE(executor.TryPost(task));
  EXPECT_FALSE(ran.HasBeenNotified());
  release.Notify();
  ran.WaitForNotification();
  EXPECT_NE(ran_on, std::this_thread::get_id());
}

TEST(ExecutorTest, RefusesPastItsQueueBoundAndKeepsTheRefusedTask) {
  Executor executor(1, 2, "test-exec");
  absl::Notification release;
  absl::Notification started;
  Executor::Task hold = [&] {
    started.Notify();
    release.WaitForNotification();
  };
  ASSERT_TRUE(executor.TryPost(hold));
  started.WaitForNotification();  // the one thread is busy, the queue empty
  std::atomic<int> ran{0};
  for (int i = 0; i < 2; ++i) {
    Executor::Task queued = [&] { ++ran; };
    ASSERT_TRUE(executor.TryPost(queued)) << i;
  }
  bool refused_ran = false;
  Executor::Task refused = [&] { refused_ran = true; };
  EXPECT_FALSE(executor.TryPost(refused));
  // Still the caller's to run.
  ASSERT_TRUE(static_cast<bool>(refused));
  std::move(refused)();
  EXPECT_TRUE(refused_ran);
  release.Notify();
  // Room again once the queue drains.
  absl::Notification later;
  Executor::Task again = [&] { later.Notify(); };
  while (!executor.TryPost(again)) absl::SleepFor(absl::Milliseconds(1));
  later.WaitForNotification();
  EXPECT_EQ(ran.load(), 2);
}

TEST(ExecutorTest, RunsTasksInOrderOnOneThread) {
  absl::Mutex mu;
  std::vector<int> order;
  {
    Executor executor(1, 100, "test-exec");
    for (int i = 0; i < 50; ++i) {
      Executor::Task task = [&, i] {
        absl::MutexLock lock(&mu);
        order.push_back(i);
      };
      ASSERT_TRUE(executor.TryPost(task));
    }
  }
  ASSERT_EQ(order.size(), 50u);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(order[i], i);
}

// Destruction runs what was accepted: a task posted is never dropped.
TEST(ExecutorTest, DestructionRunsEveryQueuedTaskThenJoins) {
  std::atomic<int> ran{0};
  auto executor = std::make_unique<Executor>(2, 1000, "test-exec");
  for (int i = 0; i < 500; ++i) {
    Executor::Task task = [&] {
      absl::SleepFor(absl::Microseconds(10));
      ++ran;
    };
    ASSERT_TRUE(executor->TryPost(task));
  }
  executor.reset();
  EXPECT_EQ(ran.load(), 500);
}

// What a task captured is destroyed once it has run, before the executor
// goes (a backend's done callback releases what it holds).
TEST(ExecutorTest, DestroysATasksCapturesAfterItRuns) {
  Executor executor(1, 4, "test-exec");
  auto held = std::make_shared<int>(7);
  std::weak_ptr<int> watch = held;
  absl::Notification ran;
  Executor::Task task = [held = std::move(held), &ran] { ran.Notify(); };
  ASSERT_TRUE(executor.TryPost(task));
  ran.WaitForNotification();
  for (int i = 0; i < 1000 && !watch.expired(); ++i) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_TRUE(watch.expired());
}

}  // namespace
}  // namespace rdma_agent

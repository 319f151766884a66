#include "common/executor.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/thread_name.h"
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

TEST(ExecutorTest, ItsThreadsCarryItsName) {
  Executor executor(2, 4, "test-exec");
  absl::Notification ran;
  std::string name;
  Executor::Task task = [&] {
    name = CurrentThreadName();
    ran.Notify();
  };
  ASSERT_TRUE(executor.TryPost(task));
  ran.WaitForNotification();
  EXPECT_EQ(name, "test-exec");
}

// Post is for work that must run: past the bound it still queues, behind
// what waits already, while TryPost is still refused.
TEST(ExecutorTest, PostIsNeverRefusedAndKeepsTheOrder) {
  absl::Mutex mu;
  std::vector<int> order;
  const auto record = [&](int i) {
    return [&, i] {
      absl::MutexLock lock(&mu);
      order.push_back(i);
    };
  };
  absl::Notification release;
  absl::Notification started;
  {
    Executor executor(1, 2, "test-exec");
    Executor::Task hold = [&] {
      started.Notify();
      release.WaitForNotification();
    };
    ASSERT_TRUE(executor.TryPost(hold));
    started.WaitForNotification();
    for (int i = 0; i < 2; ++i) {
      Executor::Task task = record(i);
      ASSERT_TRUE(executor.TryPost(task)) << i;
    }
    for (int i = 2; i < 5; ++i) executor.Post(record(i));
    Executor::Task refused = record(-1);
    EXPECT_FALSE(executor.TryPost(refused));
    release.Notify();
    // Room comes back once the overflow has moved into the slots and run.
    Executor::Task last = record(5);
    while (!executor.TryPost(last)) absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4, 5}));
}

// Without slots, TryPost refuses everything and Post still runs.
TEST(ExecutorTest, PostRunsWithoutSlots) {
  std::atomic<int> ran{0};
  {
    Executor executor(1, 0, "test-exec");
    Executor::Task refused = [&] { ran += 100; };
    EXPECT_FALSE(executor.TryPost(refused));
    for (int i = 0; i < 3; ++i) executor.Post([&] { ++ran; });
  }
  EXPECT_EQ(ran.load(), 3);
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

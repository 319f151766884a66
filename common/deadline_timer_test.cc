// DeadlineTimer: the thread ending posted batches at their deadline or
// cancellation.
#include "common/deadline_timer.h"

#include <atomic>
#include <string>
#include <vector>

#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/thread_name.h"
#include "gtest/gtest.h"

namespace rdma_agent {
namespace {

TEST(DeadlineTimerTest, RunsTasksAtTheirTimeInTimeOrderOnItsThread) {
  DeadlineTimer timer("test-timer");
  absl::Mutex mu;
  std::vector<int> order;
  std::vector<absl::Duration> late;
  absl::BlockingCounter ran(3);
  const absl::Time start = absl::Now();
  for (int i : {3, 1, 2}) {
    const absl::Time when = start + absl::Milliseconds(100 * i);
    timer.At(when, [&, i, when] {
      absl::MutexLock lock(&mu);
      EXPECT_EQ(CurrentThreadName(), "test-timer");
      order.push_back(i);
      late.push_back(absl::Now() - when);
      ran.DecrementCount();
    });
  }
  ran.Wait();
  absl::MutexLock lock(&mu);
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3}));
  for (absl::Duration d : late) {
    EXPECT_GE(d, absl::ZeroDuration());
    EXPECT_LT(d, absl::Seconds(1));
  }
}

TEST(DeadlineTimerTest, ATimePassedRunsAtOnce) {
  DeadlineTimer timer("test-timer");
  absl::Notification ran;
  timer.At(absl::InfinitePast(), [&] { ran.Notify(); });
  EXPECT_TRUE(ran.WaitForNotificationWithTimeout(absl::Seconds(5)));
}

TEST(DeadlineTimerTest, CancelDropsATaskNotStarted) {
  DeadlineTimer timer("test-timer");
  std::atomic<bool> cancelled_ran{false};
  const DeadlineTimer::Handle handle = timer.At(
      absl::Now() + absl::Milliseconds(200), [&] { cancelled_ran = true; });
  absl::Notification later;
  timer.At(absl::Now() + absl::Milliseconds(400), [&] { later.Notify(); });
  timer.Cancel(handle);
  EXPECT_TRUE(later.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_FALSE(cancelled_ran.load());
}

TEST(DeadlineTimerTest, ATaskMayCancelItselfAndScheduleMore) {
  DeadlineTimer timer("test-timer");
  DeadlineTimer::Handle self;
  absl::Notification scheduled;
  absl::Notification again;
  self = timer.At(absl::Now() + absl::Milliseconds(50), [&] {
    scheduled.WaitForNotification();
    timer.Cancel(self);  // running already: nothing to drop, no wait
    timer.At(absl::InfinitePast(), [&] { again.Notify(); });
  });
  scheduled.Notify();
  EXPECT_TRUE(again.WaitForNotificationWithTimeout(absl::Seconds(5)));
}

}  // namespace
}  // namespace rdma_agent

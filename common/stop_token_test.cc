#include "common/stop_token.h"

#include <atomic>
#include <thread>

#include "gtest/gtest.h"

namespace rdma_agent {
namespace {

TEST(CancellationTest, RunsCallbacksOnceWithTheFirstReason) {
  Cancellation cancellation;
  int runs = 0;
  auto handle = cancellation.OnCancel([&] { ++runs; });
  EXPECT_FALSE(cancellation.cancelled());
  EXPECT_TRUE(cancellation.reason().ok());
  cancellation.Cancel(absl::UnavailableError("shutting down"));
  cancellation.Cancel(absl::CancelledError("second"));
  EXPECT_EQ(runs, 1);
  EXPECT_TRUE(cancellation.cancelled());
  EXPECT_EQ(cancellation.reason(), absl::UnavailableError("shutting down"));
}

TEST(CancellationTest, OkReasonBecomesCancelled) {
  Cancellation cancellation;
  cancellation.Cancel(absl::OkStatus());
  EXPECT_TRUE(absl::IsCancelled(cancellation.reason()));
}

TEST(CancellationTest, CallbackRegisteredAfterCancelRunsAtOnce) {
  Cancellation cancellation;
  cancellation.Cancel(absl::CancelledError("gone"));
  bool ran = false;
  auto handle = cancellation.OnCancel([&] { ran = true; });
  EXPECT_TRUE(ran);
}

TEST(CancellationTest, UnregisteredCallbackNeverRuns) {
  Cancellation cancellation;
  bool ran = false;
  cancellation.OnCancel([&] { ran = true; }).reset();
  cancellation.Cancel(absl::CancelledError("gone"));
  EXPECT_FALSE(ran);
}

TEST(CancellationTest, UnregisterWaitsForARunningCallback) {
  Cancellation cancellation;
  std::atomic<bool> entered{false};
  std::atomic<bool> release{false};
  std::atomic<bool> finished{false};
  auto handle = cancellation.OnCancel([&] {
    entered = true;
    while (!release) std::this_thread::yield();
    finished = true;
  });
  std::thread canceller(
      [&] { cancellation.Cancel(absl::CancelledError("gone")); });
  while (!entered) std::this_thread::yield();
  std::thread releaser([&] {
    absl::SleepFor(absl::Milliseconds(50));
    release = true;
  });
  handle.reset();  // must wait for the callback
  EXPECT_TRUE(finished);
  canceller.join();
  releaser.join();
}

// cancelled() reads no lock: a thread that sees it true must still find the
// reason Cancel() set.
TEST(CancellationTest, SeenCancelledFromAnotherThreadCarriesTheReason) {
  for (int round = 0; round < 100; ++round) {
    Cancellation cancellation;
    std::thread watcher([&] {
      while (!cancellation.cancelled()) {
      }
      EXPECT_EQ(cancellation.reason(), absl::UnavailableError("stopping"));
    });
    cancellation.Cancel(absl::UnavailableError("stopping"));
    watcher.join();
  }
}

TEST(StopTokenTest, DeadlineOnly) {
  StopToken future(absl::Now() + absl::Hours(1));
  EXPECT_FALSE(future.stopped());
  EXPECT_TRUE(future.Check("x").ok());
  EXPECT_EQ(future.OnCancel([] {}), nullptr);
  StopToken past(absl::Now() - absl::Seconds(1));
  EXPECT_TRUE(past.stopped());
  EXPECT_EQ(past.Check("before sending"),
            absl::DeadlineExceededError("deadline passed before sending"));
}

TEST(StopTokenTest, CancellationWinsOverTheDeadline) {
  Cancellation cancellation;
  StopToken token(absl::Now() - absl::Seconds(1), &cancellation);
  EXPECT_TRUE(absl::IsDeadlineExceeded(token.StopStatus("x")));
  cancellation.Cancel(absl::CancelledError("client went away"));
  EXPECT_TRUE(token.cancelled());
  EXPECT_EQ(token.Check("x"), absl::CancelledError("client went away"));
}

}  // namespace
}  // namespace rdma_agent

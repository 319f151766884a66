#include "daemon/limits/active_calls.h"

#include <thread>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace rdma_agent {
namespace {

InFlightLimits Limits(size_t total, size_t per_user) {
  InFlightLimits limits;
  limits.max_ops = total;
  limits.max_ops_per_user = per_user;
  return limits;
}

TEST(ActiveCallsTest, AdmitsOpsUpToEachUsersShare) {
  ActiveCalls calls(Limits(100, 10));
  auto first = calls.Start(nullptr, 1000, 6);
  ASSERT_TRUE(first.ok()) << first.status();
  auto too_many = calls.Start(nullptr, 1000, 5);
  EXPECT_TRUE(absl::IsResourceExhausted(too_many.status()));
  EXPECT_NE(too_many.status().message().find("--max_ops_in_flight_per_user"),
            absl::string_view::npos)
      << too_many.status();
  // Another user is not held back by the first one's share.
  auto other = calls.Start(nullptr, 1001, 10);
  EXPECT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(calls.ops_in_flight(1000), 6u);
  EXPECT_EQ(calls.ops_in_flight(), 16u);
  // Ending a call gives its ops back.
  first->reset();
  EXPECT_EQ(calls.ops_in_flight(1000), 0u);
  EXPECT_TRUE(calls.Start(nullptr, 1000, 10).ok());
}

TEST(ActiveCallsTest, TotalBoundHoldsAcrossUsers) {
  ActiveCalls calls(Limits(10, 8));
  auto a = calls.Start(nullptr, 1, 8);
  ASSERT_TRUE(a.ok());
  auto b = calls.Start(nullptr, 2, 3);
  EXPECT_TRUE(absl::IsResourceExhausted(b.status()));
  EXPECT_NE(b.status().message().find("--max_ops_in_flight)"),
            absl::string_view::npos)
      << b.status();
  EXPECT_TRUE(calls.Start(nullptr, 2, 2).ok());
}

TEST(ActiveCallsTest, CancelAllStopsRunningCallsAndRefusesNewOnes) {
  ActiveCalls calls(Limits(100, 100));
  auto running = calls.Start(nullptr, 1, 1);
  ASSERT_TRUE(running.ok());
  const StopToken stop = (*running)->stop_token(absl::InfiniteFuture());
  EXPECT_FALSE(stop.stopped());
  calls.CancelAll(absl::UnavailableError("the agent is shutting down"));
  EXPECT_TRUE(stop.cancelled());
  EXPECT_EQ(stop.Check("x"),
            absl::UnavailableError("the agent is shutting down"));
  auto late = calls.Start(nullptr, 1, 1);
  EXPECT_TRUE(absl::IsUnavailable(late.status())) << late.status();
}

TEST(ActiveCallsTest, WaitUntilIdleReturnsWhenTheLastCallEnds) {
  ActiveCalls calls(Limits(100, 100));
  EXPECT_TRUE(calls.WaitUntilIdle(absl::Now()));
  auto running = calls.Start(nullptr, 1, 1);
  ASSERT_TRUE(running.ok());
  EXPECT_EQ(calls.calls(), 1u);
  EXPECT_FALSE(calls.WaitUntilIdle(absl::Now() + absl::Milliseconds(20)));
  std::thread ender([&] {
    absl::SleepFor(absl::Milliseconds(50));
    running->reset();
  });
  EXPECT_TRUE(calls.WaitUntilIdle(absl::InfiniteFuture()));
  EXPECT_EQ(calls.calls(), 0u);
  ender.join();
}

TEST(ActiveCallsTest, OpsChargesShareTheOpsBoundsButTakeNoCallSlot) {
  InFlightLimits limits = Limits(100, 10);
  limits.max_calls_per_user = 1;
  ActiveCalls calls(limits);
  auto charged = calls.ChargeOps(1000, 6);
  ASSERT_TRUE(charged.ok()) << charged.status();
  EXPECT_EQ(calls.ops_in_flight(1000), 6u);
  EXPECT_EQ(calls.calls(), 0u);
  // A Submit of the same user sees the charged ops, with Start's message...
  auto submit = calls.Start(nullptr, 1000, 5);
  EXPECT_TRUE(absl::IsResourceExhausted(submit.status()));
  EXPECT_NE(submit.status().message().find("--max_ops_in_flight_per_user"),
            absl::string_view::npos)
      << submit.status();
  // ...and a charge sees a Submit's ops, with the same message.
  auto call = calls.Start(nullptr, 1000, 4);
  ASSERT_TRUE(call.ok()) << call.status();
  auto more = calls.ChargeOps(1000, 1);
  EXPECT_EQ(more.status(),
            absl::ResourceExhaustedError(
                "user 1000 has 10 ops in flight; 1 more would pass the limit "
                "of 10 (--max_ops_in_flight_per_user)"));
  // The one call slot is the Submit's: charges never took it.
  EXPECT_TRUE(
      absl::IsResourceExhausted(calls.Start(nullptr, 1000, 0).status()));
  call->reset();
  EXPECT_TRUE(calls.Start(nullptr, 1000, 0).ok());
  // Destroying the charge gives its ops back.
  charged->reset();
  EXPECT_EQ(calls.ops_in_flight(1000), 0u);
  EXPECT_EQ(calls.ops_in_flight(), 0u);
  EXPECT_TRUE(calls.ChargeOps(1000, 10).ok());
}

TEST(ActiveCallsTest, ChargesAreRefusedAfterCancelAll) {
  ActiveCalls calls(Limits(100, 100));
  calls.CancelAll(absl::UnavailableError("the agent is shutting down"));
  auto late = calls.ChargeOps(1, 1);
  EXPECT_EQ(late.status(),
            absl::UnavailableError("the agent is shutting down"));
}

TEST(ActiveCallsTest, WaitingCallsHaveTheirOwnBoundsAndNoCallSlot) {
  InFlightLimits limits = Limits(100, 100);
  limits.max_calls_per_user = 1;
  limits.max_waiting_per_user = 2;
  limits.max_waiting = 3;
  ActiveCalls calls(limits);
  auto first = calls.StartWaiting(1000);
  auto second = calls.StartWaiting(1000);
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_EQ(calls.waiting(), 2u);
  auto third = calls.StartWaiting(1000);
  EXPECT_TRUE(absl::IsResourceExhausted(third.status()));
  EXPECT_NE(third.status().message().find("--max_waiting_rpcs_per_user"),
            absl::string_view::npos)
      << third.status();
  // The user's one call slot is still free: waiting calls hold no thread.
  auto sync = calls.Start(nullptr, 1000, 0);
  EXPECT_TRUE(sync.ok()) << sync.status();
  // The total holds across users.
  auto other = calls.StartWaiting(1001);
  ASSERT_TRUE(other.ok()) << other.status();
  auto over = calls.StartWaiting(1002);
  EXPECT_TRUE(absl::IsResourceExhausted(over.status()));
  EXPECT_NE(over.status().message().find("--max_waiting_rpcs)"),
            absl::string_view::npos)
      << over.status();
  // Ending one gives its slot back.
  first->reset();
  EXPECT_EQ(calls.waiting(), 2u);
  EXPECT_TRUE(calls.StartWaiting(1000).ok());
}

TEST(ActiveCallsTest, CancelAllStopsWaitingCallsAndIdleWaitsForThem) {
  ActiveCalls calls(Limits(100, 100));
  auto waiting = calls.StartWaiting(1);
  ASSERT_TRUE(waiting.ok()) << waiting.status();
  bool told = false;
  auto on_cancel = (*waiting)->cancellation().OnCancel([&] { told = true; });
  EXPECT_FALSE(calls.WaitUntilIdle(absl::Now()));
  calls.CancelAll(absl::UnavailableError("the agent is shutting down"));
  EXPECT_TRUE(told);
  EXPECT_TRUE(absl::IsUnavailable((*waiting)->cancellation().reason()));
  EXPECT_TRUE(absl::IsUnavailable(calls.StartWaiting(1).status()));
  EXPECT_FALSE(calls.WaitUntilIdle(absl::Now()));
  on_cancel.reset();
  waiting->reset();
  EXPECT_TRUE(calls.WaitUntilIdle(absl::Now()));
}

}  // namespace
}  // namespace rdma_agent

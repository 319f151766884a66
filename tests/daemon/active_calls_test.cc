#include "daemon/active_calls.h"

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

}  // namespace
}  // namespace rdma_agent

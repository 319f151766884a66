#include "common/rate_limited_log.h"

#include "gtest/gtest.h"

namespace rdma_agent {
namespace {

TEST(LogRateLimiterTest, FirstLinePassesThenOnePerInterval) {
  LogRateLimiter limiter(absl::Seconds(10));
  const absl::Time start = absl::FromUnixSeconds(1000);
  ASSERT_EQ(limiter.Allow(start), 0u);
  for (int i = 1; i <= 5; ++i) {
    EXPECT_FALSE(limiter.Allow(start + absl::Seconds(i)).has_value());
  }
  // The next line that passes says how many were held back.
  EXPECT_EQ(limiter.Allow(start + absl::Seconds(10)), 5u);
  EXPECT_FALSE(limiter.Allow(start + absl::Seconds(19)).has_value());
  EXPECT_EQ(limiter.Allow(start + absl::Seconds(25)), 1u);
}

TEST(LogRateLimiterTest, AMillionAttemptsInOneIntervalLogOnce) {
  LogRateLimiter limiter(absl::Seconds(1));
  const absl::Time now = absl::FromUnixSeconds(1);
  int passed = 0;
  for (int i = 0; i < 1000000; ++i) {
    if (limiter.Allow(now).has_value()) ++passed;
  }
  EXPECT_EQ(passed, 1);
  EXPECT_EQ(limiter.Allow(now + absl::Seconds(1)), 999999u);
}

TEST(LogRateLimiterTest, BurstPassesThenOnePerIntervalAndRefillsWhenQuiet) {
  LogRateLimiter limiter(absl::Seconds(1), 3);
  const absl::Time start = absl::FromUnixSeconds(100);
  EXPECT_EQ(limiter.Allow(start), 0u);
  EXPECT_EQ(limiter.Allow(start), 0u);
  EXPECT_EQ(limiter.Allow(start), 0u);
  EXPECT_FALSE(limiter.Allow(start).has_value());
  EXPECT_FALSE(limiter.Allow(start + absl::Milliseconds(999)).has_value());
  // One line per interval once the burst is spent.
  EXPECT_EQ(limiter.Allow(start + absl::Seconds(1)), 2u);
  EXPECT_FALSE(limiter.Allow(start + absl::Milliseconds(1500)).has_value());
  // After a quiet spell the whole burst is back, no more.
  const absl::Time later = start + absl::Seconds(60);
  EXPECT_EQ(limiter.Allow(later), 1u);
  EXPECT_EQ(limiter.Allow(later), 0u);
  EXPECT_EQ(limiter.Allow(later), 0u);
  EXPECT_FALSE(limiter.Allow(later).has_value());
}

}  // namespace
}  // namespace rdma_agent

#include "backends/tcp/log_limiter.h"

#include "gtest/gtest.h"

namespace rdma_agent::tcp {
namespace {

TEST(LogLimiterTest, OneLinePerIntervalWithTheCountHeldBack) {
  LogLimiter limiter(absl::Seconds(1));
  const absl::Time start = absl::FromUnixSeconds(1000);
  uint64_t suppressed = 99;
  ASSERT_TRUE(limiter.Allow(start, &suppressed));
  EXPECT_EQ(suppressed, 0u);
  for (int i = 0; i < 500; ++i) {
    EXPECT_FALSE(limiter.Allow(start + absl::Milliseconds(i), &suppressed));
  }
  EXPECT_FALSE(limiter.Allow(start + absl::Milliseconds(999), &suppressed));
  ASSERT_TRUE(limiter.Allow(start + absl::Seconds(1), &suppressed));
  EXPECT_EQ(suppressed, 501u);
  // The next interval starts at the line let through, not at the first one.
  EXPECT_FALSE(limiter.Allow(start + absl::Milliseconds(1999), &suppressed));
  ASSERT_TRUE(limiter.Allow(start + absl::Seconds(2), &suppressed));
  EXPECT_EQ(suppressed, 1u);
}

}  // namespace
}  // namespace rdma_agent::tcp

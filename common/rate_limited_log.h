#ifndef RDMA_AGENTD_COMMON_RATE_LIMITED_LOG_H_
#define RDMA_AGENTD_COMMON_RATE_LIMITED_LOG_H_

#include <cstdint>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace rdma_agent {

// Lets a recurring log line through at most `burst` times and then once per
// `interval` (a token bucket refilled one line per interval), for lines that
// can repeat in a tight loop (accept failing with EMFILE, a peer hammering a
// port, a client retrying a failing op): the log stays readable and cannot
// fill the disk or the journal. Thread-safe.
//
//   static LogRateLimiter limiter(absl::Seconds(10));
//   if (auto suppressed = limiter.Allow()) {
//     spdlog::warn("accept failed: {} ({} not logged)", why, *suppressed);
//   }
class LogRateLimiter {
 public:
  explicit LogRateLimiter(absl::Duration interval, uint64_t burst = 1)
      : interval_(interval), burst_(burst == 0 ? 1 : burst) {}

  // When a line may be logged now: how many were held back since the last
  // one that was. Otherwise nullopt (and this one is counted as held back).
  std::optional<uint64_t> Allow(absl::Time now = absl::Now());

 private:
  const absl::Duration interval_;
  const uint64_t burst_;
  absl::Mutex mu_;
  // Lines that may pass now, and when the bucket last gained one.
  uint64_t tokens_ ABSL_GUARDED_BY(mu_) = burst_;
  absl::Time refilled_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  uint64_t suppressed_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_COMMON_RATE_LIMITED_LOG_H_

#ifndef RDMA_AGENTD_COMMON_RATE_LIMITED_LOG_H_
#define RDMA_AGENTD_COMMON_RATE_LIMITED_LOG_H_

#include <cstdint>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace rdma_agent {

// Lets a recurring log line through at most once per `interval`, for errors
// that can repeat in a tight loop (accept failing with EMFILE, a peer
// hammering a port): the log stays readable and cannot fill the disk.
// Thread-safe.
//
//   static LogRateLimiter limiter(absl::Seconds(10));
//   if (auto suppressed = limiter.Allow()) {
//     spdlog::warn("accept failed: {} ({} not logged)", why, *suppressed);
//   }
class LogRateLimiter {
 public:
  explicit LogRateLimiter(absl::Duration interval) : interval_(interval) {}

  // When a line may be logged now: how many were held back since the last
  // one that was. Otherwise nullopt (and this one is counted as held back).
  std::optional<uint64_t> Allow(absl::Time now = absl::Now());

 private:
  const absl::Duration interval_;
  absl::Mutex mu_;
  absl::Time next_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  uint64_t suppressed_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_COMMON_RATE_LIMITED_LOG_H_

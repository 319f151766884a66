#include "common/rate_limited_log.h"

#include <utility>

namespace rdma_agent {

std::optional<uint64_t> LogRateLimiter::Allow(absl::Time now) {
  absl::MutexLock lock(&mu_);
  if (now < next_) {
    ++suppressed_;
    return std::nullopt;
  }
  next_ = now + interval_;
  return std::exchange(suppressed_, 0);
}

}  // namespace rdma_agent

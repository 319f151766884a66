#include "common/rate_limited_log.h"

#include <algorithm>
#include <utility>

namespace rdma_agent {

std::optional<uint64_t> LogRateLimiter::Allow(absl::Time now) {
  absl::MutexLock lock(&mu_);
  if (refilled_ == absl::InfinitePast()) {
    refilled_ = now;
  } else if (tokens_ < burst_ && now >= refilled_ + interval_) {
    absl::Duration remainder;  // IDivDuration needs somewhere to put it
    const int64_t gained =
        interval_ > absl::ZeroDuration()
            ? absl::IDivDuration(now - refilled_, interval_, &remainder)
            : static_cast<int64_t>(burst_);
    tokens_ =
        std::min<uint64_t>(burst_, tokens_ + static_cast<uint64_t>(gained));
    refilled_ = tokens_ == burst_ ? now : refilled_ + interval_ * gained;
  } else if (tokens_ == burst_) {
    refilled_ = now;
  }
  if (tokens_ == 0) {
    ++suppressed_;
    return std::nullopt;
  }
  --tokens_;
  return std::exchange(suppressed_, 0);
}

}  // namespace rdma_agent

#include "backends/tcp/log_limiter.h"

namespace rdma_agent::tcp {

bool LogLimiter::Allow(absl::Time now, uint64_t* suppressed) {
  absl::MutexLock lock(&mu_);
  if (now < next_) {
    ++suppressed_;
    return false;
  }
  next_ = now + interval_;
  *suppressed = suppressed_;
  suppressed_ = 0;
  return true;
}

}  // namespace rdma_agent::tcp

#ifndef RDMA_AGENTD_BACKENDS_TCP_LOG_LIMITER_H_
#define RDMA_AGENTD_BACKENDS_TCP_LOG_LIMITER_H_

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace rdma_agent::tcp {

// Lets one log line of a kind through per interval, so that what a stranger
// can trigger at will (refused connections, accept failures under fd
// exhaustion) costs at most a line per interval however fast it happens.
// The lines it holds back are counted and reported with the next one let
// through. Thread-safe.
//
//   uint64_t suppressed = 0;
//   if (limiter.Allow(&suppressed)) spdlog::warn("... ({} more)", suppressed);
class LogLimiter {
 public:
  explicit LogLimiter(absl::Duration interval) : interval_(interval) {}

  // True when a line may be logged now (the first call, then at most once
  // per interval). When true, `*suppressed` is the number of calls refused
  // since the previous line.
  bool Allow(uint64_t* suppressed) { return Allow(absl::Now(), suppressed); }
  // The same at a given time (for tests).
  bool Allow(absl::Time now, uint64_t* suppressed);

 private:
  const absl::Duration interval_;
  absl::Mutex mu_;
  absl::Time next_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  uint64_t suppressed_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace rdma_agent::tcp

#endif  // RDMA_AGENTD_BACKENDS_TCP_LOG_LIMITER_H_

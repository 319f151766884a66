#ifndef RDMA_AGENTD_TESTS_TESTING_EVENTUALLY_H_
#define RDMA_AGENTD_TESTS_TESTING_EVENTUALLY_H_

#include <functional>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace rdma_agent::testing {

// Polls `condition` every 10 ms until it holds (true) or `timeout` passes
// (false): a bounded wait for something another process or thread does.
inline bool Eventually(const std::function<bool()>& condition,
                       absl::Duration timeout = absl::Seconds(10)) {
  const absl::Time give_up = absl::Now() + timeout;
  while (!condition()) {
    if (absl::Now() > give_up) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

}  // namespace rdma_agent::testing

#endif  // RDMA_AGENTD_TESTS_TESTING_EVENTUALLY_H_

#ifndef RDMA_AGENTD_CLIENT_INTERNAL_PROGRESS_H_
#define RDMA_AGENTD_CLIENT_INTERNAL_PROGRESS_H_

// rdma-agentctl's progress line for bytes it moves itself (read, write):
// "12.0 MiB / 64.0 MiB  118.3 MiB/s  ETA 0s", redrawn in place on stderr.

#include <cstdint>
#include <cstdio>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace rdma_agent::client::internal {

// "1.5 GiB" (binary units, one decimal; bytes below 1 KiB as "512 B").
std::string HumanBytes(double bytes);

// The line for `done` of `total` bytes after `elapsed`: sizes, rate and ETA
// (rate and ETA once there is one to give).
std::string ProgressText(uint64_t done, uint64_t total, absl::Duration elapsed);

// Draws ProgressText on `out` with a carriage return, at most ten times a
// second, once the work has run `delay` (a second: short work shows
// nothing), or from the start when forced; Finish ends the line with the
// total time and rate. Disabled, it draws nothing.
class ProgressLine {
 public:
  ProgressLine(uint64_t total, bool enabled, bool forced, FILE* out,
               absl::Time start = absl::Now());
  void Update(uint64_t done, absl::Time now = absl::Now());
  void Finish(uint64_t done, absl::Time now = absl::Now());
  // Whether it may draw at all (a TTY, or forced).
  bool enabled() const { return enabled_; }

 private:
  const uint64_t total_;
  const bool enabled_;
  const bool forced_;
  FILE* const out_;
  const absl::Time start_;
  absl::Time last_draw_ = absl::InfinitePast();
  bool drawn_ = false;
};

}  // namespace rdma_agent::client::internal

#endif  // RDMA_AGENTD_CLIENT_INTERNAL_PROGRESS_H_

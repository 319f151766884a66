#ifndef RDMA_AGENTD_CLIENT_INTERNAL_UNITS_H_
#define RDMA_AGENTD_CLIENT_INTERNAL_UNITS_H_

// Sizes and durations as people type them on a command line.

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace rdma_agent::client::internal {

// A byte count: digits with an optional binary suffix, k/K/Ki/KiB (2^10),
// M/Mi/MiB, G/Gi/GiB, T/Ti/TiB, P/Pi/PiB (case-insensitive letters; "B"
// alone is bytes). Decimal-looking suffixes ("kB", "MB") and fractions are
// refused rather than guessed at. INVALID_ARGUMENT naming the text when it
// is negative, not a size, or more than 2^64-1 bytes.
absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text);

// A duration: a number of seconds ("5", "2.5") or absl's form ("500ms",
// "1m30s"). INVALID_ARGUMENT naming the text when it is not one, or is
// negative or infinite.
absl::StatusOr<absl::Duration> ParseDuration(absl::string_view text);

}  // namespace rdma_agent::client::internal

#endif  // RDMA_AGENTD_CLIENT_INTERNAL_UNITS_H_

#ifndef RDMA_AGENTD_COMMON_STATUS_UTIL_H_
#define RDMA_AGENTD_COMMON_STATUS_UTIL_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace rdma_agent {

// `status` with "prefix: " in front of its message and the same code; OK
// stays OK. For saying which step or which peer an error came from.
absl::Status Prefixed(const absl::Status& status, absl::string_view prefix);

// Like Prefixed, but with `code` instead of the cause's (for callers whose
// contract names one code for a whole class of failures). `cause` must not
// be OK.
absl::Status Prefixed(absl::StatusCode code, const absl::Status& cause,
                      absl::string_view prefix);

// "what: strerror(error)" with `code`, for a failed system call.
absl::Status ErrnoStatus(absl::StatusCode code, absl::string_view what,
                         int error);

// A status code received as a number (a wire field, a proto int32). absl and
// gRPC share the numbering 0..16; anything else means nothing to a caller
// and becomes UNKNOWN.
absl::StatusCode StatusCodeFromInt(int64_t code);

// absl::Status(StatusCodeFromInt(code), message): OK when `code` is 0 (the
// message is then dropped).
absl::Status StatusFromInt(int64_t code, absl::string_view message);

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_COMMON_STATUS_UTIL_H_

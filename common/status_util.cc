#include "common/status_util.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace rdma_agent {

absl::Status Prefixed(const absl::Status& status, absl::string_view prefix) {
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat(prefix, ": ", status.message()));
}

absl::Status Prefixed(absl::StatusCode code, const absl::Status& cause,
                      absl::string_view prefix) {
  return absl::Status(code, absl::StrCat(prefix, ": ", cause.message()));
}

absl::Status ErrnoStatus(absl::StatusCode code, absl::string_view what,
                         int error) {
  return absl::Status(code, absl::StrCat(what, ": ", std::strerror(error)));
}

absl::StatusCode StatusCodeFromInt(int64_t code) {
  constexpr int64_t kLast =
      static_cast<int64_t>(absl::StatusCode::kUnauthenticated);
  if (code < 0 || code > kLast) return absl::StatusCode::kUnknown;
  return static_cast<absl::StatusCode>(code);
}

absl::Status StatusFromInt(int64_t code, absl::string_view message) {
  return absl::Status(StatusCodeFromInt(code), message);
}

}  // namespace rdma_agent

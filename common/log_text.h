#ifndef RDMA_AGENTD_COMMON_LOG_TEXT_H_
#define RDMA_AGENTD_COMMON_LOG_TEXT_H_

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace rdma_agent {

// `text` made safe to put in a log line: control characters, quotes,
// backslashes and non-ASCII bytes are C-escaped (a newline becomes "\n"), so a
// caller-chosen string (a label, a device name, a peer's message) can neither
// forge a log line nor smuggle terminal escapes; longer than `max_bytes`, it is
// cut and ends in "...". Use it for every string that came from outside the
// agent.
std::string LogSafe(absl::string_view text, size_t max_bytes = 256);

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_COMMON_LOG_TEXT_H_

#ifndef RDMA_AGENTD_DAEMON_METRICS_HTTP_REQUEST_H_
#define RDMA_AGENTD_DAEMON_METRICS_HTTP_REQUEST_H_

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace rdma_agent {

// The head of an HTTP/1.x request as far as the metrics endpoint cares: its
// method and path. Bytes come from anyone who reaches the port, so the
// parser is strict, copies nothing it does not keep and never reads past
// `max_head_bytes`.
struct HttpRequestHead {
  enum class State {
    kIncomplete,  // no blank line yet: read more
    kComplete,    // method and path are set
    kBad,         // not an HTTP/1.x request line: answer 400
    kTooLarge,    // no blank line within max_head_bytes: answer 431
  };
  State state = State::kIncomplete;
  std::string method;     // "GET", "HEAD", ... (any token)
  std::string path;       // "/metrics"; the query string is dropped
  size_t head_bytes = 0;  // up to and including the blank line (kComplete)
};

// Parses the head at the start of `bytes` (what a connection sent so far).
// Leading empty lines are skipped (RFC 9112 2.2); header fields are checked
// only for line endings and control characters, never interpreted.
HttpRequestHead ParseHttpRequestHead(absl::string_view bytes,
                                     size_t max_head_bytes);

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_METRICS_HTTP_REQUEST_H_

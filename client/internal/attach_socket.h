#ifndef RDMA_AGENTD_CLIENT_INTERNAL_ATTACH_SOCKET_H_
#define RDMA_AGENTD_CLIENT_INTERNAL_ATTACH_SOCKET_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/unique_fd.h"
#include "rdma/agent/v1/attach.pb.h"

namespace rdma_agent::client::internal {

// The attach socket path that sits next to the agent socket of a gRPC
// `target` ("unix:///run/x/agent.sock" -> "/run/x/attach.sock").
// INVALID_ARGUMENT when the target is not a unix: target.
absl::StatusOr<std::string> AttachSocketNextTo(absl::string_view target);

// What one exchange on the attach socket gave back.
struct AttachReply {
  rdma::agent::v1::AttachResponse response;
  UniqueFd fd;  // the fd that came with the response, if any
  // The connection itself, when the exchange was asked to keep it (a ring
  // session lives on it).
  UniqueFd connection;
};

// Connects to the attach socket at `path`, sends `request` (with `fd` attached
// when >= 0), and reads one response; every socket wait is bounded by
// `timeout` (DEADLINE_EXCEEDED past it). A non-OK `response.code` is returned
// as it is, not as an error: see ResponseStatus.
absl::StatusOr<AttachReply> ExchangeOnAttachSocket(
    const std::string& path, const rdma::agent::v1::AttachRequest& request,
    int fd, absl::Duration timeout, bool keep_connection = false);

// The status an AttachResponse carries: its code (UNKNOWN if it is not a gRPC
// code) and its message, unchanged.
absl::Status ResponseStatus(const rdma::agent::v1::AttachResponse& response);

}  // namespace rdma_agent::client::internal

#endif  // RDMA_AGENTD_CLIENT_INTERNAL_ATTACH_SOCKET_H_

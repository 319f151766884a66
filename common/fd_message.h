#ifndef RDMA_AGENTD_COMMON_FD_MESSAGE_H_
#define RDMA_AGENTD_COMMON_FD_MESSAGE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/unique_fd.h"
#include "google/protobuf/message_lite.h"

namespace rdma_agent {

// Framing of the attach socket: a 4-byte little-endian length, then a
// serialized proto. An fd, if any, rides as SCM_RIGHTS on the length prefix.

// Largest message accepted; attach messages are tiny.
inline constexpr uint32_t kMaxFdMessageBytes = 64 * 1024;

// Sends `message` on the stream socket `sock`, with `fd` attached if >= 0.
absl::Status SendFdMessage(int sock,
                           const google::protobuf::MessageLite& message,
                           int fd = -1);

// Receives one message into `message`. Returns the attached fd (invalid if
// none came). UNAVAILABLE when the peer closed the connection;
// INVALID_ARGUMENT for a malformed frame. Extra fds are closed.
absl::StatusOr<UniqueFd> ReceiveFdMessage(
    int sock, google::protobuf::MessageLite* message);

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_COMMON_FD_MESSAGE_H_

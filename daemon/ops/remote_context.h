#ifndef RDMA_AGENTD_DAEMON_OPS_REMOTE_CONTEXT_H_
#define RDMA_AGENTD_DAEMON_OPS_REMOTE_CONTEXT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "rdma/agent/v1/remote_buffer.pb.h"

namespace rdma_agent {

namespace v1 = ::rdma::agent::v1;

// Parses the remote context of an op (bytes a caller got from some peer, so
// untrusted) and checks that it could have been issued by an agent: agent id,
// epoch, size, token, a valid access and at least one endpoint.
// INVALID_ARGUMENT when it is empty, malformed, truncated or incomplete. Says
// nothing about whether its issuer, epoch, buffer or token are current: the
// issuing agent checks those when it serves the op.
absl::StatusOr<std::shared_ptr<const v1::RemoteBuffer>> ParseRemoteContext(
    const std::string& bytes);

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_OPS_REMOTE_CONTEXT_H_

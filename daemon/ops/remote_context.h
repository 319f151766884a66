#ifndef RDMA_AGENTD_DAEMON_OPS_REMOTE_CONTEXT_H_
#define RDMA_AGENTD_DAEMON_OPS_REMOTE_CONTEXT_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "rdma/agent/v1/remote_buffer.pb.h"

namespace rdma_agent {

namespace v1 = ::rdma::agent::v1;

// The default of --max_remote_context_bytes: what an agent issues is a few
// hundred bytes (ibverbs with eight rails, about 1 KiB).
inline constexpr size_t kDefaultMaxRemoteContextBytes = 16 << 10;
// Its largest value: what ParseRemoteContext takes at most by default.
inline constexpr size_t kMaxRemoteContextBytesLimit = 1 << 20;

// INVALID_ARGUMENT when `bytes` (a remote context) is longer than
// `max_bytes`, naming the flag; checked before anything is parsed, so that
// an op carrying megabytes of context costs no parse (a parsed context may
// take tens of times its wire size in memory).
absl::Status CheckRemoteContextSize(const std::string& bytes, size_t max_bytes);

// Parses the remote context of an op (bytes a caller got from some peer, so
// untrusted) and checks that it could have been issued by an agent: agent id,
// epoch, size, token, a valid access and at least one endpoint.
// INVALID_ARGUMENT when it is longer than `max_bytes` (not parsed then),
// empty, malformed, truncated or incomplete. Says nothing about whether its
// issuer, epoch, buffer or token are current: the issuing agent checks those
// when it serves the op.
absl::StatusOr<std::shared_ptr<const v1::RemoteBuffer>> ParseRemoteContext(
    const std::string& bytes, size_t max_bytes = kMaxRemoteContextBytesLimit);

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_OPS_REMOTE_CONTEXT_H_

#ifndef RDMA_AGENTD_DAEMON_API_API_LIMITS_H_
#define RDMA_AGENTD_DAEMON_API_API_LIMITS_H_

#include <cstddef>
#include <cstdint>

#include "absl/time/time.h"

namespace rdma_agent {

// What one RdmaAgent call may ask for (flags --max_ops_per_submit,
// --default_submit_timeout, --max_submit_timeout, --max_buffer_bytes,
// --max_transfer_bytes_per_rpc, --max_transfer_wait,
// --max_remote_context_bytes).
struct ApiLimits {
  // Ops in one Submit or SubmitAsync.
  size_t max_ops_per_submit = 65536;
  // The timeout of a Submit that sets none, and the largest one may ask for.
  absl::Duration default_submit_timeout = absl::Seconds(30);
  absl::Duration max_submit_timeout = absl::Hours(1);
  // Largest registration.
  uint64_t max_buffer_bytes = uint64_t{64} << 30;
  // Largest ReadBuffer or WriteBuffer. Its reply and framing must fit the
  // server's message limit (kMaxTransferBytesPerRpc).
  uint64_t max_transfer_bytes_per_rpc = uint64_t{32} << 20;
  // Longest label of a registration.
  size_t max_label_bytes = 256;
  // Longest remote context one op may carry (--max_remote_context_bytes;
  // daemon/ops/remote_context.h's kDefaultMaxRemoteContextBytes): a longer
  // one fails its op before it is parsed.
  size_t max_remote_context_bytes = 16 << 10;
  // Longest GetTransfers or GetNotifications long poll.
  absl::Duration max_transfer_wait = absl::Minutes(1);
};

// Bound of --max_transfer_bytes_per_rpc: a reply of that many bytes plus its
// framing fits the RdmaAgent server's 64 MiB message limit.
inline constexpr uint64_t kMaxTransferBytesPerRpc = uint64_t{60} << 20;

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_API_API_LIMITS_H_

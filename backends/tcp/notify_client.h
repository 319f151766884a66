#ifndef RDMA_AGENTD_BACKENDS_TCP_NOTIFY_CLIENT_H_
#define RDMA_AGENTD_BACKENDS_TCP_NOTIFY_CLIENT_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "backends/buffer_directory.h"
#include "common/net_address.h"
#include "common/stop_token.h"

namespace rdma_agent::tcp {

// Sends one kNotify request to the data server at `peer` on a connection of
// its own (dial, server hello, request, its answer, close) and returns the
// server's answer. Notifications are one per batch and per target buffer,
// so a fresh connection costs little next to the batch, and it cannot queue
// behind a pooled connection's pipelined payloads.
//
// Waits no later than `stop.deadline()` (and `connect_timeout` for the
// dial), gives up soon after `stop` is cancelled. A failure once the request
// was written says that the notification may have arrived all the same.
absl::Status SendNotification(const HostPort& peer, const ServeRequest& target,
                              absl::string_view from_agent_id,
                              absl::string_view data, const StopToken& stop,
                              absl::Duration connect_timeout);

}  // namespace rdma_agent::tcp

#endif  // RDMA_AGENTD_BACKENDS_TCP_NOTIFY_CLIENT_H_

#include "daemon/agent_options.h"

#include "absl/strings/str_cat.h"

namespace rdma_agent {

absl::Status AgentOptions::Validate() const {
  if (api.max_transfer_bytes_per_rpc == 0 ||
      api.max_transfer_bytes_per_rpc > kMaxTransferBytesPerRpc) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_transfer_bytes_per_rpc must be 1 to ",
                     kMaxTransferBytesPerRpc, " bytes"));
  }
  if (transfers.workers < 1 || transfers.max_in_flight_per_user < 1 ||
      transfers.max_in_flight < 1 || transfers.max_kept_per_user < 1 ||
      in_flight.max_waiting < 1 || in_flight.max_waiting_per_user < 1) {
    return absl::InvalidArgumentError(
        "--transfer_workers, --max_transfers_in_flight_per_user, "
        "--max_transfers_in_flight, --max_kept_transfers_per_user, "
        "--max_waiting_rpcs and --max_waiting_rpcs_per_user must be at "
        "least 1");
  }
  if (notifications.max_bytes > (size_t{1} << 20) ||
      notifications.max_queued_per_user < 1) {
    return absl::InvalidArgumentError(
        "--max_notification_bytes must be 0 to 1048576 and "
        "--max_notifications_per_user at least 1");
  }
  if (peer_listener.max_connections < 1 ||
      peer_listener.max_connections_per_source < 1 ||
      peer_listener.max_connections_per_source >
          peer_listener.max_connections) {
    return absl::InvalidArgumentError(
        "--peer_max_connections_per_source must be 1 to "
        "--peer_max_connections");
  }
  if (peer_listener.call_arrival_timeout < absl::Milliseconds(1) ||
      peer_listener.max_connection_age < absl::Seconds(1) ||
      peer_listener.max_connection_age > absl::Hours(24 * 24) ||
      peer_listener.call_arrival_timeout > absl::Hours(1)) {
    return absl::InvalidArgumentError(
        "--peer_call_arrival_timeout must be 1ms to 1h and "
        "--peer_max_connection_age 1s to 24 days");
  }
  return absl::OkStatus();
}

}  // namespace rdma_agent

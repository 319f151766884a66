#include "daemon/agent_options.h"

#include "absl/strings/str_cat.h"
#include "common/ring_protocol.h"
#include "daemon/ops/remote_context.h"

namespace rdma_agent {

// The flag's default is written once per side of the daemon/api boundary.
static_assert(ApiLimits().max_remote_context_bytes ==
              kDefaultMaxRemoteContextBytes);

absl::Status AgentOptions::Validate() const {
  if (absl::Status status = directory.Validate(); !status.ok()) {
    return status;
  }
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
  if (transfers.max_bytes_per_user < 1 ||
      transfers.max_bytes_per_user > transfers.max_bytes_total) {
    return absl::InvalidArgumentError(
        "--max_transfer_bytes_per_user must be 1 to "
        "--max_transfer_bytes_total");
  }
  if (remote_handles.max_per_user < 1 ||
      remote_handles.max_per_user > remote_handles.max_total ||
      remote_handles.max_bytes_per_user < 1 ||
      remote_handles.max_bytes_per_user > remote_handles.max_bytes_total) {
    return absl::InvalidArgumentError(
        "--max_remote_handles_per_user must be 1 to "
        "--max_remote_handles_total, and --max_remote_handle_bytes_per_user 1 "
        "to --max_remote_handle_bytes_total");
  }
  if (prepared_transfers.max_per_user < 1 ||
      prepared_transfers.max_per_user > prepared_transfers.max_total ||
      prepared_transfers.max_bytes_per_user < 1 ||
      prepared_transfers.max_bytes_per_user >
          prepared_transfers.max_bytes_total) {
    return absl::InvalidArgumentError(
        "--max_prepared_transfers_per_user must be 1 to "
        "--max_prepared_transfers_total, and "
        "--max_prepared_transfer_bytes_per_user 1 to "
        "--max_prepared_transfer_bytes_total");
  }
  if (rings.max_entries < 1 || rings.max_entries > ring::kMaxEntries ||
      (rings.max_entries & (rings.max_entries - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_ring_entries must be a power of two from 1 to ",
                     ring::kMaxEntries));
  }
  if (rings.max_sessions_per_user < 1 ||
      rings.max_sessions_per_user > rings.max_sessions) {
    return absl::InvalidArgumentError(
        "--max_ring_sessions_per_user must be 1 to --max_ring_sessions");
  }
  if (rings.threads < 1 || rings.threads > kMaxRingThreads) {
    return absl::InvalidArgumentError(
        absl::StrCat("--ring_threads must be 1 to ", kMaxRingThreads));
  }
  if (api.max_remote_context_bytes < 1 ||
      api.max_remote_context_bytes > kMaxRemoteContextBytesLimit) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_remote_context_bytes must be 1 to ",
                     kMaxRemoteContextBytesLimit));
  }
  if (notifications.max_bytes > (size_t{1} << 20) ||
      notifications.max_queued_per_user < 1 ||
      notifications.max_queued_total < notifications.max_queued_per_user) {
    return absl::InvalidArgumentError(
        "--max_notification_bytes must be 0 to 1048576, "
        "--max_notifications_per_user at least 1 and "
        "--max_notifications_total at least --max_notifications_per_user");
  }
  // Room for one notification of the longest kind (and its sender id) per
  // user, and for one user's budget in all.
  const size_t largest =
      notifications.max_bytes + 256 + NotificationLimits::kOverheadBytes;
  if (notifications.max_queued_bytes_per_user < largest ||
      notifications.max_queued_bytes_total <
          notifications.max_queued_bytes_per_user) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_notification_queue_bytes_per_user must be at least ", largest,
        " (--max_notification_bytes, a sender id and ",
        NotificationLimits::kOverheadBytes,
        " bytes of overhead) and --max_notification_queue_bytes_total at "
        "least --max_notification_queue_bytes_per_user"));
  }
  if (metrics.max_connections < 1 || metrics.max_connections > 4096 ||
      metrics.request_timeout < absl::Milliseconds(100) ||
      metrics.request_timeout > absl::Minutes(10) || metrics.max_peers > 4096) {
    return absl::InvalidArgumentError(
        "--metrics_max_connections must be 1 to 4096, "
        "--metrics_request_timeout 100ms to 10m and --metrics_max_peers 0 to "
        "4096");
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

#ifndef RDMA_AGENTD_DAEMON_AGENT_OPTIONS_H_
#define RDMA_AGENTD_DAEMON_AGENT_OPTIONS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "backends/backend.h"
#include "daemon/local/client_watcher.h"

namespace rdma_agent {

// Everything an Agent is configured with. The daemon fills it from flags;
// tests fill it directly (several agents per process).
struct AgentOptions {
  // Where the sockets live (removed by systemd when the agent stops).
  std::string runtime_dir = "/run/rdma-agentd";
  // Where the agent id is kept across restarts and reboots; empty = the
  // runtime dir. When it cannot be created or written, the runtime dir is
  // used instead, with a warning. Agent::options() says which one is used.
  std::string state_dir;
  // RdmaAgent socket; empty = <runtime_dir>/agent.sock.
  std::string socket_path;
  // Attach socket; empty = <runtime_dir>/attach.sock.
  std::string attach_socket_path;
  // Stable agent id; empty = read <state_dir>/agent-id, or create it.
  std::string agent_id;
  // TCP listener of the Peer gRPC service (backends' peer_services()).
  // Empty: <advertise_host>:7470.
  std::string peer_listen = "0.0.0.0:0";
  // Host peers dial; empty = DefaultAdvertiseHost().
  std::string advertise_host;
  // Mutual TLS for the Peer listener and for backends calling peers' Peer
  // services (LoadPeerTls()); not enabled = plaintext.
  PeerTls peer_tls;
  // Spawned in order; the registry orders them by transport level.
  std::vector<BackendFactory> backends;

  // Limits.
  size_t max_ops_per_submit = 65536;
  absl::Duration default_submit_timeout = absl::Seconds(30);
  absl::Duration max_submit_timeout = absl::Hours(1);
  uint64_t max_buffer_bytes = uint64_t{64} << 30;
  uint64_t max_transfer_bytes_per_rpc = uint64_t{32} << 20;
  size_t max_label_bytes = 256;
  absl::Duration attach_token_ttl = absl::Seconds(60);

  // Admission: what one local user, and all users together, may make the
  // agent hold. 0 = derived from the host at start (daemon/quota.h,
  // DeriveQuotaLimits); Agent::Start fills in the values in force.
  // Bytes mapped: registered plus parked on the attach socket.
  uint64_t max_registered_bytes_per_user = 0;
  uint64_t max_registered_bytes_total = 0;
  // Registrations (an fd and a mapping each, until unmapped).
  uint64_t max_buffers_per_user = 0;
  uint64_t max_buffers_total = 0;
  // Memfds attached but not yet registered (an fd and a mapping each).
  uint64_t max_pending_attach_per_user = 0;
  uint64_t max_pending_attach_total = 0;
  // Open attach-socket connections (an fd and a thread each).
  uint64_t max_attach_connections_per_user = 0;
  uint64_t max_attach_connections_total = 0;
  // Clients watched for lifetime-bound registrations (a pidfd each, or a
  // connection polled for closing).
  uint64_t max_watched_clients_per_user = 0;
  uint64_t max_watched_clients_total = 0;
  // Ops of running Submits, per user and in total.
  size_t max_ops_in_flight = 262144;
  size_t max_ops_in_flight_per_user = 65536;
  // RdmaAgent RPCs served at once (gRPC server threads), and per user.
  size_t max_rpcs = 256;
  size_t max_rpcs_per_user = 64;
  // RPCs that wait without a thread (WatchTransfers streams, GetTransfers
  // long polls) open at once, in total and per user.
  size_t max_waiting_rpcs = 4096;
  size_t max_waiting_rpcs_per_user = 128;
  // Connections to the RdmaAgent socket, in total and per user.
  size_t max_connections = 1024;
  size_t max_connections_per_user = 128;
  // Asynchronous transfers (daemon/transfers.h): worker threads, transfers
  // queued or running per user and in total, transfers one user keeps (in
  // flight or ended and unread), how long an ended transfer nobody has read
  // is kept, and the longest GetTransfers long poll.
  size_t transfer_workers = 4;
  size_t max_transfers_in_flight_per_user = 1024;
  size_t max_transfers_in_flight = 8192;
  size_t max_kept_transfers_per_user = 4096;
  absl::Duration transfer_retention = absl::Minutes(5);
  absl::Duration max_transfer_wait = absl::Minutes(1);
  // Notifications (daemon/notifications.h): the longest one sent or taken,
  // and how many are kept for one user (the oldest dropped beyond).
  size_t max_notification_bytes = 4096;
  size_t max_notifications_per_user = 1024;
  // Longest Shutdown() waits for RPCs once their work is cancelled.
  absl::Duration shutdown_grace = absl::Seconds(5);
  // host:port of the Prometheus endpoint (/metrics, /healthz); empty: none.
  std::string metrics_listen;

  // How clients of lifetime-bound registrations are watched: every method
  // the kernel has, unless a test turns some off; connections are checked
  // this often.
  ProcessWatchMethods process_watch;
  absl::Duration connection_poll_interval = absl::Seconds(1);
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_AGENT_OPTIONS_H_

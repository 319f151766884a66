#ifndef RDMA_AGENTD_DAEMON_AGENT_OPTIONS_H_
#define RDMA_AGENTD_DAEMON_AGENT_OPTIONS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "backends/backend.h"
#include "backends/peer_tls.h"
#include "daemon/api/api_limits.h"
#include "daemon/directory/directory_options.h"
#include "daemon/limits/active_calls.h"
#include "daemon/limits/quota.h"
#include "daemon/local/caller_identity.h"
#include "daemon/local/client_watcher.h"
#include "daemon/metrics/metrics.h"
#include "daemon/ops/notifications.h"
#include "daemon/ops/prepared_transfers.h"
#include "daemon/ops/remote_handles.h"
#include "daemon/ops/ring_sessions.h"
#include "daemon/ops/transfers.h"
#include "daemon/peer_gate.h"

namespace rdma_agent {

// Everything an Agent is configured with. The daemon fills it from flags
// (daemon/exe/flags.cc, whose defaults are these); tests fill it directly
// (several agents per process). Each component's bounds are its own options
// struct, nested here, so that every default is written once.
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
  // The RdmaAgent API again, for the agent's own user and root only (mode
  // 0600): health probes connect here (rdma-agentctl health does when it
  // may), so that no other user's connections queue ahead of them. Empty =
  // probe.sock next to the API socket.
  std::string probe_socket_path;
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
  // What the Peer listener lets strangers hold: connections per source and
  // in total, how long a connection has to deliver a request, and its age.
  PeerListenerLimits peer_listener;
  // Spawned in order; the registry orders them by transport level.
  std::vector<BackendFactory> backends;
  // host:port of the Prometheus endpoint (/metrics, /healthz); empty: none.
  std::string metrics_listen;
  // What the endpoint serves (per-user series or totals) and what it holds
  // for its clients.
  MetricsOptions metrics;
  // The source revision build_info reports ("unknown": an unstamped build).
  std::string build_revision = "unknown";

  // What one RdmaAgent call may ask for.
  ApiLimits api;
  // RPCs and ops in flight, per user and in total.
  InFlightLimits in_flight;
  // Connections to the RdmaAgent socket.
  ConnectionLimits connections;
  // What one local user, and all users together, may make the agent hold
  // (bytes, registrations, parked attachments, attach connections, watched
  // clients). 0 = derived from the host at start (DeriveQuotaLimits);
  // Agent::options() has the values in force.
  QuotaLimits quotas;
  // Where the agent publishes itself and finds other agents.
  DirectoryOptions directory;
  // Asynchronous transfers: workers, queue, what is kept.
  TransferLimits transfers;
  // Notifications: the longest one, and how many are kept per user.
  NotificationLimits notifications;
  // Imported remotes (ImportRemote) and prepared transfers
  // (PrepareTransfer) kept per user and in total, by count and bytes.
  RemoteHandleLimits remote_handles;
  PreparedTransferLimits prepared_transfers;
  // Shared-memory ring sessions (docs/RING.md); their batches' default and
  // largest timeouts are `api`'s.
  RingLimits rings;
  // How long an attach token stays valid.
  absl::Duration attach_token_ttl = absl::Seconds(60);
  // Longest Shutdown() waits for RPCs once their work is cancelled.
  absl::Duration shutdown_grace = absl::Seconds(5);

  // How clients of lifetime-bound registrations are watched: every method
  // the kernel has, unless a test turns some off; connections are checked
  // this often.
  ProcessWatchMethods process_watch;
  absl::Duration connection_poll_interval = absl::Seconds(1);

  // INVALID_ARGUMENT naming the flag of the first value out of its range.
  // Agent::Start calls it, so an agent built in a test is checked like the
  // daemon.
  absl::Status Validate() const;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_AGENT_OPTIONS_H_

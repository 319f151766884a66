#include "daemon/exe/flags.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "backends/peer_tls.h"
#include "daemon/exe/backend_factories.h"

namespace {
// Flags are signed so that a negative value is refused by name rather than
// wrapped around.
constexpr int64_t Int64(size_t value) { return static_cast<int64_t>(value); }
}  // namespace

// Every default comes from the options structs (daemon/agent_options.h and
// the component structs it nests), except where the daemon's differs from a
// library agent's on purpose (--state_dir, --peer_listen, --backends).
ABSL_FLAG(std::string, runtime_dir, rdma_agent::AgentOptions().runtime_dir,
          "Directory for the sockets.");
// Root (tools/run.sh, the systemd unit) keeps the id in /var/lib; anyone else
// falls back to the runtime dir. The test suite runs as root too, so tests
// pass a --state_dir of their own: the fallback would not keep them out.
ABSL_FLAG(std::string, state_dir, "/var/lib/rdma-agentd",
          "Directory keeping the agent id across restarts and reboots "
          "(systemd's StateDirectory=). When it cannot be created or written "
          "(e.g. not root, outside systemd), the runtime dir is used, with a "
          "warning.");
ABSL_FLAG(std::string, socket, "",
          "RdmaAgent Unix socket path (or unix:// URI); default "
          "<runtime_dir>/agent.sock.");
ABSL_FLAG(std::string, attach_socket, "",
          "Attach socket path; default <runtime_dir>/attach.sock.");
ABSL_FLAG(std::string, probe_socket, "",
          "RdmaAgent socket for health probes, mode 0600: only the agent's "
          "own user and root connect, so that no other user's connections "
          "queue ahead of a probe (rdma-agentctl health uses it when it "
          "can); default probe.sock next to --socket.");
ABSL_FLAG(std::string, agent_id, "",
          "Stable agent id; default: kept in <state_dir>/agent-id.");
ABSL_FLAG(std::vector<std::string>, backends,
          std::vector<std::string>({"memory", "tcp", "ibverbs"}),
          "Backends to spawn, comma separated (memory, tcp, ibverbs). "
          "Unavailable ones are reported by GetInfo and skipped.");
ABSL_FLAG(std::string, peer_listen, "",
          "host:port of the agent-to-agent Peer gRPC listener; default "
          "<advertise_host>:7470. 0.0.0.0:7470 serves every interface.");
ABSL_FLAG(int64_t, peer_max_connections,
          Int64(rdma_agent::PeerListenerLimits().max_connections),
          "Connections the Peer listener holds at once, all sources; more are "
          "closed at accept with nothing read or sent.");
ABSL_FLAG(int64_t, peer_max_connections_per_source,
          Int64(rdma_agent::PeerListenerLimits().max_connections_per_source),
          "Connections the Peer listener holds from one IP address; more are "
          "closed at accept.");
ABSL_FLAG(absl::Duration, peer_call_arrival_timeout,
          rdma_agent::PeerListenerLimits().call_arrival_timeout,
          "A Peer connection must deliver a complete request (TLS handshake, "
          "headers and message) within this long of connecting, or it is "
          "closed.");
ABSL_FLAG(absl::Duration, peer_max_connection_age,
          rdma_agent::PeerListenerLimits().max_connection_age,
          "Every Peer connection is closed this long after it connected "
          "(calls in flight get --peer_call_arrival_timeout to finish); "
          "peers reconnect on their next call.");
ABSL_FLAG(std::string, advertise_host, "",
          "Host peers dial to reach this agent; default: the address of the "
          "default-route interface.");
ABSL_FLAG(std::string, directory, rdma_agent::DirectoryOptions().address,
          "Where the agent publishes itself and finds other agents: local "
          "(this agent alone) or etcd://host:port[,host:port...] (an etcd v3 "
          "cluster, endpoints tried in order).");
ABSL_FLAG(std::string, directory_prefix, rdma_agent::DirectoryOptions().prefix,
          "Key prefix of everything the agent writes in the directory; agents "
          "see each other only under the same prefix.");
ABSL_FLAG(absl::Duration, directory_lease_ttl,
          rdma_agent::DirectoryOptions().lease_ttl,
          "Lease of the agent's directory record: renewed every third of it, "
          "and the record is gone this long after the agent dies.");
ABSL_FLAG(absl::Duration, directory_call_timeout,
          rdma_agent::DirectoryOptions().call_timeout,
          "Longest one call to the directory may take.");
ABSL_FLAG(std::string, directory_ca_file, "",
          "PEM CA certificate that signed the etcd servers' certificates; set: "
          "TLS to etcd.");
ABSL_FLAG(std::string, directory_cert_file, "",
          "PEM client certificate for etcd (with --directory_key_file).");
ABSL_FLAG(std::string, directory_key_file, "",
          "PEM private key of --directory_cert_file.");
ABSL_FLAG(std::string, directory_user, "",
          "etcd user the agent authenticates as (with "
          "--directory_password_file).");
ABSL_FLAG(std::string, directory_password_file, "",
          "File holding the etcd user's password (a file, so that it never "
          "shows in ps).");
ABSL_FLAG(int64_t, directory_max_listed_agents,
          rdma_agent::DirectoryOptions().max_listed_agents,
          "Most agent records one ListAgents answers.");
ABSL_FLAG(int64_t, max_names_per_user,
          Int64(rdma_agent::DirectoryOptions().max_names_per_user),
          "Names one local user may publish through this agent.");
ABSL_FLAG(int64_t, max_names_total,
          Int64(rdma_agent::DirectoryOptions().max_names_total),
          "Names all local users together may publish through this agent.");
ABSL_FLAG(int64_t, directory_resolve_cache_entries,
          Int64(rdma_agent::DirectoryOptions().resolve_cache_entries),
          "Name records Resolve and ops by name keep, kept true by the etcd "
          "watch; 0: every resolution asks etcd.");
ABSL_FLAG(int64_t, directory_resolve_cache_bytes,
          Int64(rdma_agent::DirectoryOptions().resolve_cache_bytes),
          "Bytes of names and records the resolve cache keeps at most.");
ABSL_FLAG(int64_t, max_name_watches_per_user,
          Int64(rdma_agent::DirectoryOptions().max_name_watches_per_user),
          "WatchNames streams one local user may have open.");
ABSL_FLAG(int64_t, max_name_watches,
          Int64(rdma_agent::DirectoryOptions().max_name_watches),
          "WatchNames streams open at once, all users.");
ABSL_FLAG(std::string, metrics_listen, "",
          "host:port serving Prometheus metrics at /metrics and health at "
          "/healthz (HTTP, no authentication: keep it on a trusted "
          "interface). Empty: no endpoint.");
ABSL_FLAG(bool, metrics_per_user, rdma_agent::MetricsOptions().per_user,
          "Label the per-user gauges (registrations, registered bytes, "
          "watched clients) with each local user's uid. Whoever reaches "
          "--metrics_listen then learns which users use the agent and how "
          "much; off, those gauges are totals.");
ABSL_FLAG(int64_t, metrics_max_connections,
          Int64(rdma_agent::MetricsOptions().max_connections),
          "Connections the metrics endpoint holds at once; a new one past "
          "this closes the oldest still sending its request (1 to 4096).");
ABSL_FLAG(absl::Duration, metrics_request_timeout,
          rdma_agent::MetricsOptions().request_timeout,
          "How long one metrics connection may take, request in and answer "
          "out (100ms to 10m).");
ABSL_FLAG(int64_t, metrics_max_peers,
          Int64(rdma_agent::MetricsOptions().max_peers),
          "Peers named in rdma_agentd_peer_links per backend and direction "
          "(those with the most links); the others are summed under "
          "peer=\"other\" (0 to 4096).");
ABSL_FLAG(std::string, log_level, "info",
          "trace, debug (every RPC), info, warn (failed ops, refused "
          "requests, client-visible errors), error, critical or off.");
ABSL_FLAG(std::string, log_format, "auto",
          "Logs go to stderr as: journal (<N> syslog priorities, no "
          "timestamps), terminal (colours), plain (UTC timestamps), json (one "
          "object a line: time, level, message, and method, uid and pid "
          "where a line is about an RPC), or auto: journal when journald "
          "reads stderr, terminal on a TTY, else plain.");
ABSL_FLAG(absl::Duration, default_submit_timeout,
          rdma_agent::ApiLimits().default_submit_timeout,
          "Timeout of a Submit that sets none.");
ABSL_FLAG(absl::Duration, max_submit_timeout,
          rdma_agent::ApiLimits().max_submit_timeout,
          "Largest timeout a Submit may ask for.");
ABSL_FLAG(int64_t, max_ops_per_submit,
          Int64(rdma_agent::ApiLimits().max_ops_per_submit),
          "Largest op batch.");
ABSL_FLAG(uint64_t, max_buffer_bytes, rdma_agent::ApiLimits().max_buffer_bytes,
          "Largest registration in bytes.");
ABSL_FLAG(uint64_t, max_transfer_bytes_per_rpc,
          rdma_agent::ApiLimits().max_transfer_bytes_per_rpc,
          "Largest ReadBuffer/WriteBuffer in bytes (1 B to 60 MiB: the reply "
          "must fit the agent's 64 MiB gRPC message limit).");
ABSL_FLAG(uint64_t, open_files_limit, 0,
          "Soft open-file limit (RLIMIT_NOFILE) the agent runs with; 0: raised "
          "to the hard limit. The admission defaults below are derived from "
          "it.");
// Admission limits: 0 derives a default from the host at start (logged).
ABSL_FLAG(uint64_t, max_registered_bytes_per_user,
          rdma_agent::QuotaLimits().bytes.per_user,
          "Bytes one local user may have registered or attached (not yet "
          "registered) at once, whoever allocated them; 0: a quarter of the "
          "total.");
ABSL_FLAG(uint64_t, max_registered_bytes_total,
          rdma_agent::QuotaLimits().bytes.total,
          "Bytes all users together may have registered or attached; 0: the "
          "host's physical memory, or RLIMIT_MEMLOCK when lower and a NIC "
          "pins (without CAP_IPC_LOCK). Never the agent's cgroup: a client's "
          "memory is charged to the client's.");
ABSL_FLAG(uint64_t, max_agent_allocated_bytes_per_user,
          rdma_agent::QuotaLimits().agent_allocated.per_user,
          "Of the registered bytes, those the agent allocated itself "
          "(allocate_bytes) one local user may hold; 0: a quarter of the "
          "total.");
ABSL_FLAG(uint64_t, max_agent_allocated_bytes_total,
          rdma_agent::QuotaLimits().agent_allocated.total,
          "Bytes the agent may allocate for all users together (charged to "
          "its own cgroup); 0: the host's physical memory, or 7/8 of the "
          "agent's cgroup memory limit (MemoryMax=, a container's limit) "
          "when lower.");
ABSL_FLAG(uint64_t, max_buffers_per_user,
          rdma_agent::QuotaLimits().registrations.per_user,
          "Registrations one local user may hold; 0: a quarter of the total.");
ABSL_FLAG(uint64_t, max_buffers_total,
          rdma_agent::QuotaLimits().registrations.total,
          "Registrations all users together may hold; 0: 3/4 of what the "
          "open-file limit and vm.max_map_count leave after a reserve.");
ABSL_FLAG(uint64_t, max_pending_attach_per_user,
          rdma_agent::QuotaLimits().pending_attach.per_user,
          "Attached memfds one local user may have waiting for Register; 0: "
          "a quarter of the total.");
ABSL_FLAG(uint64_t, max_pending_attach_total,
          rdma_agent::QuotaLimits().pending_attach.total,
          "Attached memfds all users together may have waiting for Register; "
          "0: 1/4 of what the open-file limit and vm.max_map_count leave "
          "after a reserve.");
ABSL_FLAG(uint64_t, max_attach_connections_per_user,
          rdma_agent::QuotaLimits().attach_connections.per_user,
          "Attach-socket connections one local user may hold open; 0: a "
          "quarter of the total.");
ABSL_FLAG(uint64_t, max_attach_connections_total,
          rdma_agent::QuotaLimits().attach_connections.total,
          "Attach-socket connections all users together may hold open; 0: "
          "256.");
ABSL_FLAG(uint64_t, max_watched_clients_per_user,
          rdma_agent::QuotaLimits().watched_clients.per_user,
          "Client processes (or connections) of one local user the agent "
          "watches to release their lifetime-bound registrations; 0: a "
          "quarter of the total.");
ABSL_FLAG(uint64_t, max_watched_clients_total,
          rdma_agent::QuotaLimits().watched_clients.total,
          "Client processes (or connections) of all users the agent watches "
          "(a pidfd each); 0: a quarter of the open-file reserve, at most "
          "1024.");
ABSL_FLAG(absl::Duration, attach_token_ttl,
          rdma_agent::AgentOptions().attach_token_ttl,
          "How long an attach token stays valid.");
ABSL_FLAG(int64_t, max_ops_in_flight,
          Int64(rdma_agent::InFlightLimits().max_ops),
          "Most ops of running Submits, over all users; beyond, Submit is "
          "refused with RESOURCE_EXHAUSTED.");
ABSL_FLAG(int64_t, max_ops_in_flight_per_user,
          Int64(rdma_agent::InFlightLimits().max_ops_per_user),
          "Most ops of running Submits for one local user.");
ABSL_FLAG(int64_t, max_rpcs, Int64(rdma_agent::InFlightLimits().max_calls),
          "RdmaAgent RPCs served at once (gRPC server threads).");
ABSL_FLAG(int64_t, max_rpcs_per_user,
          Int64(rdma_agent::InFlightLimits().max_calls_per_user),
          "RdmaAgent RPCs one local user may have running at once (not "
          "counting waiting ones: --max_waiting_rpcs_per_user).");
ABSL_FLAG(int64_t, max_waiting_rpcs,
          Int64(rdma_agent::InFlightLimits().max_waiting),
          "RPCs that wait without holding a thread (WatchTransfers streams, "
          "GetTransfers long polls) open at once, over all users.");
ABSL_FLAG(int64_t, max_waiting_rpcs_per_user,
          Int64(rdma_agent::InFlightLimits().max_waiting_per_user),
          "Waiting RPCs one local user may have open; beyond, they are "
          "refused with RESOURCE_EXHAUSTED.");
ABSL_FLAG(int64_t, max_connections,
          Int64(rdma_agent::ConnectionLimits().max_total),
          "Connections to the RdmaAgent socket, over all users.");
ABSL_FLAG(int64_t, max_connections_per_user,
          Int64(rdma_agent::ConnectionLimits().max_per_user),
          "Connections to the RdmaAgent socket one local user may hold.");
ABSL_FLAG(int64_t, transfer_workers,
          Int64(rdma_agent::TransferLimits().workers),
          "Threads that start asynchronous transfers (SubmitAsync and ring "
          "batches) and send the notifications of ended ones, started with "
          "the agent; a started transfer runs on the backends' threads.");
ABSL_FLAG(int64_t, max_running_transfers_per_user,
          Int64(rdma_agent::TransferLimits().max_running_per_user),
          "Asynchronous transfers of one local user started and not ended "
          "at once; the user's other transfers wait in the queue while "
          "other users' start. 0: half of --transfer_workers (at least 1).");
ABSL_FLAG(uint64_t, max_transfer_bytes_per_user,
          rdma_agent::TransferLimits().max_bytes_per_user,
          "Bytes of memory the agent may hold for one local user's "
          "asynchronous transfers: request copies of queued and running "
          "ones, results of ended ones not yet read, replies being sent. "
          "Beyond, SubmitAsync and GetTransfers are refused with "
          "RESOURCE_EXHAUSTED, and an end keeps only its ops' codes.");
ABSL_FLAG(uint64_t, max_transfer_bytes_total,
          rdma_agent::TransferLimits().max_bytes_total,
          "The same over all users.");
ABSL_FLAG(int64_t, max_remote_context_bytes,
          Int64(rdma_agent::ApiLimits().max_remote_context_bytes),
          "Longest remote context an op may carry (at most 1048576); a "
          "longer one fails its op with INVALID_ARGUMENT before it is "
          "parsed.");
ABSL_FLAG(int64_t, max_transfers_in_flight_per_user,
          Int64(rdma_agent::TransferLimits().max_in_flight_per_user),
          "Asynchronous transfers one local user may have queued or running; "
          "beyond, SubmitAsync is refused with RESOURCE_EXHAUSTED.");
ABSL_FLAG(int64_t, max_transfers_in_flight,
          Int64(rdma_agent::TransferLimits().max_in_flight),
          "Asynchronous transfers queued or running over all users.");
ABSL_FLAG(int64_t, max_kept_transfers_per_user,
          Int64(rdma_agent::TransferLimits().max_kept_per_user),
          "Asynchronous transfers one local user may have in the agent: in "
          "flight, or ended and not yet read by GetTransfers. Beyond, "
          "SubmitAsync drops the oldest end a WatchTransfers stream has "
          "delivered, or is refused with RESOURCE_EXHAUSTED when there is "
          "none. Also how far a WatchTransfers stream may fall behind.");
ABSL_FLAG(absl::Duration, transfer_retention,
          rdma_agent::TransferLimits().retention,
          "How long an ended transfer is kept for GetTransfers and new "
          "WatchTransfers streams when no GetTransfers has read it; then its "
          "id is NOT_FOUND.");
ABSL_FLAG(absl::Duration, max_transfer_wait,
          rdma_agent::ApiLimits().max_transfer_wait,
          "Longest GetTransfers long poll; longer waits are cut to it.");
ABSL_FLAG(int64_t, max_notification_bytes,
          Int64(rdma_agent::NotificationLimits().max_bytes),
          "Longest notification a Submit may carry and a peer may deliver "
          "here; longer is INVALID_ARGUMENT.");
ABSL_FLAG(int64_t, max_notifications_per_user,
          Int64(rdma_agent::NotificationLimits().max_queued_per_user),
          "Notifications kept for one local user until read (and for each "
          "of its WatchNotifications streams); beyond, the oldest is dropped "
          "and the drop reported to the user.");
ABSL_FLAG(int64_t, max_notification_queue_bytes_per_user,
          Int64(rdma_agent::NotificationLimits().max_queued_bytes_per_user),
          "Bytes of notifications kept for one local user until read, its "
          "queue and every copy its open WatchNotifications streams hold "
          "together; beyond, the oldest of its fullest queue are dropped and "
          "the drop reported. At least --max_notification_bytes.");
ABSL_FLAG(int64_t, max_notifications_total,
          Int64(rdma_agent::NotificationLimits().max_queued_total),
          "Notifications kept for all local users (streams' copies "
          "included); beyond, the oldest of the user holding the most bytes "
          "are dropped and the drop reported.");
ABSL_FLAG(int64_t, max_notification_queue_bytes_total,
          Int64(rdma_agent::NotificationLimits().max_queued_bytes_total),
          "Bytes of notifications kept for all local users (streams' copies "
          "included); beyond, the oldest of the user holding the most are "
          "dropped and the drop reported. At least "
          "--max_notification_queue_bytes_per_user.");
ABSL_FLAG(uint64_t, max_remote_handles_per_user,
          rdma_agent::RemoteHandleLimits().max_per_user,
          "Imported remotes (ImportRemote) one local user may hold; beyond, "
          "ImportRemote is refused with RESOURCE_EXHAUSTED.");
ABSL_FLAG(uint64_t, max_remote_handles_total,
          rdma_agent::RemoteHandleLimits().max_total,
          "Imported remotes over all local users.");
ABSL_FLAG(uint64_t, max_remote_handle_bytes_per_user,
          rdma_agent::RemoteHandleLimits().max_bytes_per_user,
          "Bytes of agent memory one local user's imported remotes may hold "
          "(parsed contexts and their records); beyond, ImportRemote is "
          "refused with RESOURCE_EXHAUSTED.");
ABSL_FLAG(uint64_t, max_remote_handle_bytes_total,
          rdma_agent::RemoteHandleLimits().max_bytes_total,
          "The same over all local users.");
ABSL_FLAG(uint64_t, max_prepared_transfers_per_user,
          rdma_agent::PreparedTransferLimits().max_per_user,
          "Prepared transfers (PrepareTransfer) one local user may hold; "
          "beyond, PrepareTransfer is refused with RESOURCE_EXHAUSTED.");
ABSL_FLAG(uint64_t, max_prepared_transfers_total,
          rdma_agent::PreparedTransferLimits().max_total,
          "Prepared transfers over all local users.");
ABSL_FLAG(uint64_t, max_prepared_transfer_bytes_per_user,
          rdma_agent::PreparedTransferLimits().max_bytes_per_user,
          "Bytes of agent memory one local user's prepared transfers may "
          "hold (their ops and parsed contexts); beyond, PrepareTransfer is "
          "refused with RESOURCE_EXHAUSTED.");
ABSL_FLAG(uint64_t, max_prepared_transfer_bytes_total,
          rdma_agent::PreparedTransferLimits().max_bytes_total,
          "The same over all local users.");
ABSL_FLAG(uint32_t, max_ring_entries, rdma_agent::RingLimits().max_entries,
          "Largest shared-memory ring a client may open on the attach "
          "socket (submission slots, a power of two); a ring of N slots "
          "maps 512 + 608 N bytes, charged to its user's registered "
          "bytes.");
ABSL_FLAG(uint64_t, max_ring_sessions_per_user,
          rdma_agent::RingLimits().max_sessions_per_user,
          "Shared-memory ring sessions one local user may have open at "
          "once; beyond, OpenRing is refused with RESOURCE_EXHAUSTED before "
          "its memory is created.");
ABSL_FLAG(uint64_t, max_ring_sessions, rdma_agent::RingLimits().max_sessions,
          "The same over all local users.");
ABSL_FLAG(int32_t, ring_threads, rdma_agent::RingLimits().threads,
          "Threads serving every shared-memory ring session (1 to 64), "
          "started with the agent: sessions are spread over them, the least "
          "loaded first; each spins briefly after work, then sleeps until a "
          "doorbell or a batch's end.");
ABSL_FLAG(absl::Duration, shutdown_grace,
          rdma_agent::AgentOptions().shutdown_grace,
          "At SIGTERM/SIGINT, transfers in flight are cancelled and the "
          "agent waits at most this long for RPCs to finish.");

// Mutual TLS for the agent-to-agent Peer gRPC service (listener and stubs).
ABSL_FLAG(std::string, peer_tls_cert, "",
          "PEM certificate chain this agent presents to peers; with "
          "--peer_tls_key and --peer_tls_ca it turns on mutual TLS for the "
          "Peer service. Default: plaintext.");
ABSL_FLAG(std::string, peer_tls_key, "", "PEM private key of --peer_tls_cert.");
ABSL_FLAG(std::string, peer_tls_ca, "",
          "PEM CA certificate(s) peers' certificates must chain to (both "
          "directions).");
ABSL_FLAG(std::string, peer_tls_server_name, "",
          "Name expected in peers' certificates instead of the host dialled "
          "(one name shared by every agent's certificate); default: the "
          "host dialled.");

namespace rdma_agent {
namespace {

// A size from a signed flag: INVALID_ARGUMENT naming it when negative.
absl::StatusOr<size_t> Size(const absl::Flag<int64_t>& flag,
                            absl::string_view name) {
  const int64_t value = absl::GetFlag(flag);
  if (value < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, " must not be negative"));
  }
  return static_cast<size_t>(value);
}

std::string SocketPath(std::string flag) {
  absl::string_view path = flag;
  absl::ConsumePrefix(&path, "unix://");
  return std::string(path);
}

}  // namespace

LoggingFlags LoggingFromFlags() {
  return LoggingFlags{absl::GetFlag(FLAGS_log_level),
                      absl::GetFlag(FLAGS_log_format),
                      absl::GetFlag(FLAGS_open_files_limit)};
}

absl::StatusOr<AgentOptions> AgentOptionsFromFlags() {
  AgentOptions options;
  options.runtime_dir = absl::GetFlag(FLAGS_runtime_dir);
  options.state_dir = absl::GetFlag(FLAGS_state_dir);
  options.socket_path = SocketPath(absl::GetFlag(FLAGS_socket));
  options.attach_socket_path = absl::GetFlag(FLAGS_attach_socket);
  options.probe_socket_path = absl::GetFlag(FLAGS_probe_socket);
  options.agent_id = absl::GetFlag(FLAGS_agent_id);
  options.peer_listen = absl::GetFlag(FLAGS_peer_listen);
  for (const auto& [flag, value, out] :
       {std::tuple{"peer_max_connections",
                   absl::GetFlag(FLAGS_peer_max_connections),
                   &options.peer_listener.max_connections},
        std::tuple{"peer_max_connections_per_source",
                   absl::GetFlag(FLAGS_peer_max_connections_per_source),
                   &options.peer_listener.max_connections_per_source}}) {
    if (value < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, "=", value, " must be at least 1"));
    }
    *out = static_cast<size_t>(value);
  }
  options.peer_listener.call_arrival_timeout =
      absl::GetFlag(FLAGS_peer_call_arrival_timeout);
  options.peer_listener.max_connection_age =
      absl::GetFlag(FLAGS_peer_max_connection_age);
  options.advertise_host = absl::GetFlag(FLAGS_advertise_host);
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  DirectoryOptions& directory = options.directory;
  directory.address = absl::GetFlag(FLAGS_directory);
  directory.prefix = absl::GetFlag(FLAGS_directory_prefix);
  directory.lease_ttl = absl::GetFlag(FLAGS_directory_lease_ttl);
  directory.call_timeout = absl::GetFlag(FLAGS_directory_call_timeout);
  directory.ca_file = absl::GetFlag(FLAGS_directory_ca_file);
  directory.cert_file = absl::GetFlag(FLAGS_directory_cert_file);
  directory.key_file = absl::GetFlag(FLAGS_directory_key_file);
  directory.user = absl::GetFlag(FLAGS_directory_user);
  directory.password_file = absl::GetFlag(FLAGS_directory_password_file);
  const int64_t max_listed = absl::GetFlag(FLAGS_directory_max_listed_agents);
  directory.max_listed_agents = static_cast<int>(
      std::clamp<int64_t>(max_listed, 0, std::numeric_limits<int>::max()));
  options.metrics.per_user = absl::GetFlag(FLAGS_metrics_per_user);
  options.metrics.request_timeout =
      absl::GetFlag(FLAGS_metrics_request_timeout);
  options.attach_token_ttl = absl::GetFlag(FLAGS_attach_token_ttl);
  options.shutdown_grace = absl::GetFlag(FLAGS_shutdown_grace);

  ApiLimits& api = options.api;
  api.default_submit_timeout = absl::GetFlag(FLAGS_default_submit_timeout);
  api.max_submit_timeout = absl::GetFlag(FLAGS_max_submit_timeout);
  api.max_buffer_bytes = absl::GetFlag(FLAGS_max_buffer_bytes);
  api.max_transfer_bytes_per_rpc =
      absl::GetFlag(FLAGS_max_transfer_bytes_per_rpc);
  api.max_transfer_wait = absl::GetFlag(FLAGS_max_transfer_wait);

  QuotaLimits& quotas = options.quotas;
  quotas.bytes = {absl::GetFlag(FLAGS_max_registered_bytes_per_user),
                  absl::GetFlag(FLAGS_max_registered_bytes_total)};
  quotas.agent_allocated = {
      absl::GetFlag(FLAGS_max_agent_allocated_bytes_per_user),
      absl::GetFlag(FLAGS_max_agent_allocated_bytes_total)};
  quotas.registrations = {absl::GetFlag(FLAGS_max_buffers_per_user),
                          absl::GetFlag(FLAGS_max_buffers_total)};
  quotas.pending_attach = {absl::GetFlag(FLAGS_max_pending_attach_per_user),
                           absl::GetFlag(FLAGS_max_pending_attach_total)};
  quotas.attach_connections = {
      absl::GetFlag(FLAGS_max_attach_connections_per_user),
      absl::GetFlag(FLAGS_max_attach_connections_total)};
  quotas.watched_clients = {absl::GetFlag(FLAGS_max_watched_clients_per_user),
                            absl::GetFlag(FLAGS_max_watched_clients_total)};

  // The signed flags, each refused by name when negative.
  const struct {
    const absl::Flag<int64_t>& flag;
    const char* name;
    size_t* field;
  } sizes[] = {
      {FLAGS_max_ops_per_submit, "max_ops_per_submit", &api.max_ops_per_submit},
      {FLAGS_max_ops_in_flight, "max_ops_in_flight",
       &options.in_flight.max_ops},
      {FLAGS_max_ops_in_flight_per_user, "max_ops_in_flight_per_user",
       &options.in_flight.max_ops_per_user},
      {FLAGS_max_rpcs, "max_rpcs", &options.in_flight.max_calls},
      {FLAGS_max_rpcs_per_user, "max_rpcs_per_user",
       &options.in_flight.max_calls_per_user},
      {FLAGS_max_waiting_rpcs, "max_waiting_rpcs",
       &options.in_flight.max_waiting},
      {FLAGS_max_waiting_rpcs_per_user, "max_waiting_rpcs_per_user",
       &options.in_flight.max_waiting_per_user},
      {FLAGS_max_connections, "max_connections",
       &options.connections.max_total},
      {FLAGS_max_connections_per_user, "max_connections_per_user",
       &options.connections.max_per_user},
      {FLAGS_max_remote_context_bytes, "max_remote_context_bytes",
       &api.max_remote_context_bytes},
      {FLAGS_transfer_workers, "transfer_workers", &options.transfers.workers},
      {FLAGS_max_running_transfers_per_user, "max_running_transfers_per_user",
       &options.transfers.max_running_per_user},
      {FLAGS_max_transfers_in_flight_per_user,
       "max_transfers_in_flight_per_user",
       &options.transfers.max_in_flight_per_user},
      {FLAGS_max_transfers_in_flight, "max_transfers_in_flight",
       &options.transfers.max_in_flight},
      {FLAGS_max_kept_transfers_per_user, "max_kept_transfers_per_user",
       &options.transfers.max_kept_per_user},
      {FLAGS_max_notification_bytes, "max_notification_bytes",
       &options.notifications.max_bytes},
      {FLAGS_max_notifications_per_user, "max_notifications_per_user",
       &options.notifications.max_queued_per_user},
      {FLAGS_metrics_max_connections, "metrics_max_connections",
       &options.metrics.max_connections},
      {FLAGS_metrics_max_peers, "metrics_max_peers",
       &options.metrics.max_peers},
      {FLAGS_max_names_per_user, "max_names_per_user",
       &options.directory.max_names_per_user},
      {FLAGS_max_names_total, "max_names_total",
       &options.directory.max_names_total},
      {FLAGS_directory_resolve_cache_entries, "directory_resolve_cache_entries",
       &options.directory.resolve_cache_entries},
      {FLAGS_directory_resolve_cache_bytes, "directory_resolve_cache_bytes",
       &options.directory.resolve_cache_bytes},
      {FLAGS_max_name_watches_per_user, "max_name_watches_per_user",
       &options.directory.max_name_watches_per_user},
      {FLAGS_max_name_watches, "max_name_watches",
       &options.directory.max_name_watches},
      {FLAGS_max_notification_queue_bytes_per_user,
       "max_notification_queue_bytes_per_user",
       &options.notifications.max_queued_bytes_per_user},
      {FLAGS_max_notifications_total, "max_notifications_total",
       &options.notifications.max_queued_total},
      {FLAGS_max_notification_queue_bytes_total,
       "max_notification_queue_bytes_total",
       &options.notifications.max_queued_bytes_total},
  };
  for (const auto& size : sizes) {
    auto value = Size(size.flag, size.name);
    if (!value.ok()) return value.status();
    *size.field = *value;
  }
  options.transfers.retention = absl::GetFlag(FLAGS_transfer_retention);
  options.remote_handles.max_per_user =
      absl::GetFlag(FLAGS_max_remote_handles_per_user);
  options.remote_handles.max_total =
      absl::GetFlag(FLAGS_max_remote_handles_total);
  options.remote_handles.max_bytes_per_user =
      absl::GetFlag(FLAGS_max_remote_handle_bytes_per_user);
  options.remote_handles.max_bytes_total =
      absl::GetFlag(FLAGS_max_remote_handle_bytes_total);
  options.rings.max_entries = absl::GetFlag(FLAGS_max_ring_entries);
  options.rings.max_sessions_per_user =
      absl::GetFlag(FLAGS_max_ring_sessions_per_user);
  options.rings.max_sessions = absl::GetFlag(FLAGS_max_ring_sessions);
  options.rings.threads = absl::GetFlag(FLAGS_ring_threads);
  options.prepared_transfers.max_per_user =
      absl::GetFlag(FLAGS_max_prepared_transfers_per_user);
  options.prepared_transfers.max_total =
      absl::GetFlag(FLAGS_max_prepared_transfers_total);
  options.prepared_transfers.max_bytes_per_user =
      absl::GetFlag(FLAGS_max_prepared_transfer_bytes_per_user);
  options.prepared_transfers.max_bytes_total =
      absl::GetFlag(FLAGS_max_prepared_transfer_bytes_total);
  options.transfers.max_bytes_per_user =
      absl::GetFlag(FLAGS_max_transfer_bytes_per_user);
  options.transfers.max_bytes_total =
      absl::GetFlag(FLAGS_max_transfer_bytes_total);

  auto peer_tls = LoadPeerTls(absl::GetFlag(FLAGS_peer_tls_cert),
                              absl::GetFlag(FLAGS_peer_tls_key),
                              absl::GetFlag(FLAGS_peer_tls_ca),
                              absl::GetFlag(FLAGS_peer_tls_server_name));
  if (!peer_tls.ok()) return peer_tls.status();
  options.peer_tls = std::move(*peer_tls);
  for (const std::string& name : absl::GetFlag(FLAGS_backends)) {
    auto factory = BackendFactoryFromFlags(name);
    if (!factory.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--backends: ", factory.status().ToString()));
    }
    options.backends.push_back(std::move(*factory));
  }
  // Checked here too, so that the daemon refuses bad flags before it
  // touches anything; Agent::Start checks again for library users.
  absl::Status valid = options.Validate();
  if (!valid.ok()) return valid;
  return options;
}

}  // namespace rdma_agent

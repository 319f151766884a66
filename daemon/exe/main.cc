// rdma-agentd: the per-host RDMA transfer agent.
#include <signal.h>
#include <string.h>

#include <algorithm>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/synchronization/mutex.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "backends/memory/memory_backend.h"
#include "backends/peer_tls.h"
#include "common/log_text.h"
#include "daemon/agent.h"
#include "daemon/exe/backend_factories.h"
#include "daemon/exe/command_line.h"
#include "daemon/exe/logging.h"
#include "daemon/exe/main_loop.h"
#include "daemon/limits/quota.h"
#include "daemon/exe/systemd_notifier.h"
#include "daemon/api/version.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(std::string, runtime_dir, "/run/rdma-agentd",
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
ABSL_FLAG(std::string, agent_id, "",
          "Stable agent id; default: kept in <state_dir>/agent-id.");
ABSL_FLAG(std::vector<std::string>, backends,
          std::vector<std::string>({"memory", "tcp", "ibverbs"}),
          "Backends to spawn, comma separated (memory, tcp, ibverbs). "
          "Unavailable ones are reported by GetInfo and skipped.");
ABSL_FLAG(std::string, peer_listen, "",
          "host:port of the agent-to-agent Peer gRPC listener; default "
          "<advertise_host>:7470. 0.0.0.0:7470 serves every interface.");
ABSL_FLAG(std::string, advertise_host, "",
          "Host peers dial to reach this agent; default: the address of the "
          "default-route interface.");
ABSL_FLAG(std::string, metrics_listen, "",
          "host:port serving Prometheus metrics at /metrics and health at "
          "/healthz (HTTP, no authentication: keep it on a trusted "
          "interface). Empty: no endpoint.");
ABSL_FLAG(std::string, log_level, "info",
          "trace, debug (every RPC), info, warn (failed ops, refused "
          "requests, client-visible errors), error, critical or off.");
ABSL_FLAG(std::string, log_format, "auto",
          "Logs go to stderr as: journal (<N> syslog priorities, no "
          "timestamps), terminal (colours), plain (UTC timestamps), or auto: "
          "journal when journald reads stderr, terminal on a TTY, else "
          "plain.");
ABSL_FLAG(absl::Duration, default_submit_timeout, absl::Seconds(30),
          "Timeout of a Submit that sets none.");
ABSL_FLAG(absl::Duration, max_submit_timeout, absl::Hours(1),
          "Largest timeout a Submit may ask for.");
ABSL_FLAG(int64_t, max_ops_per_submit, 65536, "Largest op batch.");
ABSL_FLAG(uint64_t, max_buffer_bytes, uint64_t{64} << 30,
          "Largest registration in bytes.");
ABSL_FLAG(uint64_t, max_transfer_bytes_per_rpc, uint64_t{32} << 20,
          "Largest ReadBuffer/WriteBuffer in bytes (1 B to 60 MiB: the reply "
          "must fit the agent's 64 MiB gRPC message limit).");
ABSL_FLAG(uint64_t, open_files_limit, 0,
          "Soft open-file limit (RLIMIT_NOFILE) the agent runs with; 0: raised "
          "to the hard limit. The admission defaults below are derived from "
          "it.");
// Admission limits: 0 derives a default from the host at start (logged).
ABSL_FLAG(uint64_t, max_registered_bytes_per_user, 0,
          "Bytes one local user may have registered or attached (not yet "
          "registered) at once; 0: a quarter of the total.");
ABSL_FLAG(uint64_t, max_registered_bytes_total, 0,
          "Bytes all users together may have registered or attached; 0: the "
          "host's physical memory, or 7/8 of the agent's cgroup memory limit "
          "(MemoryMax=, a container's limit) when lower.");
ABSL_FLAG(uint64_t, max_buffers_per_user, 0,
          "Registrations one local user may hold; 0: a quarter of the total.");
ABSL_FLAG(uint64_t, max_buffers_total, 0,
          "Registrations all users together may hold; 0: 3/4 of what the "
          "open-file limit and vm.max_map_count leave after a reserve.");
ABSL_FLAG(uint64_t, max_pending_attach_per_user, 0,
          "Attached memfds one local user may have waiting for Register; 0: "
          "a quarter of the total.");
ABSL_FLAG(uint64_t, max_pending_attach_total, 0,
          "Attached memfds all users together may have waiting for Register; "
          "0: 1/4 of what the open-file limit and vm.max_map_count leave "
          "after a reserve.");
ABSL_FLAG(uint64_t, max_attach_connections_per_user, 0,
          "Attach-socket connections one local user may hold open; 0: a "
          "quarter of the total.");
ABSL_FLAG(uint64_t, max_attach_connections_total, 0,
          "Attach-socket connections all users together may hold open; 0: "
          "256.");
ABSL_FLAG(uint64_t, max_watched_clients_per_user, 0,
          "Client processes (or connections) of one local user the agent "
          "watches to release their lifetime-bound registrations; 0: a "
          "quarter of the total.");
ABSL_FLAG(uint64_t, max_watched_clients_total, 0,
          "Client processes (or connections) of all users the agent watches "
          "(a pidfd each); 0: a quarter of the open-file reserve, at most "
          "1024.");
ABSL_FLAG(absl::Duration, attach_token_ttl, absl::Seconds(60),
          "How long an attach token stays valid.");
ABSL_FLAG(int64_t, max_ops_in_flight, 262144,
          "Most ops of running Submits, over all users; beyond, Submit is "
          "refused with RESOURCE_EXHAUSTED.");
ABSL_FLAG(int64_t, max_ops_in_flight_per_user, 65536,
          "Most ops of running Submits for one local user.");
ABSL_FLAG(int64_t, max_rpcs, 256,
          "RdmaAgent RPCs served at once (gRPC server threads).");
ABSL_FLAG(int64_t, max_rpcs_per_user, 64,
          "RdmaAgent RPCs one local user may have running at once (not "
          "counting waiting ones: --max_waiting_rpcs_per_user).");
ABSL_FLAG(int64_t, max_waiting_rpcs, 4096,
          "RPCs that wait without holding a thread (WatchTransfers streams, "
          "GetTransfers long polls) open at once, over all users.");
ABSL_FLAG(int64_t, max_waiting_rpcs_per_user, 128,
          "Waiting RPCs one local user may have open; beyond, they are "
          "refused with RESOURCE_EXHAUSTED.");
ABSL_FLAG(int64_t, max_connections, 1024,
          "Connections to the RdmaAgent socket, over all users.");
ABSL_FLAG(int64_t, max_connections_per_user, 128,
          "Connections to the RdmaAgent socket one local user may hold.");
ABSL_FLAG(int64_t, transfer_workers, 4,
          "Threads running asynchronous transfers (SubmitAsync), started "
          "with the agent; transfers beyond them wait in a queue.");
ABSL_FLAG(int64_t, max_transfers_in_flight_per_user, 1024,
          "Asynchronous transfers one local user may have queued or running; "
          "beyond, SubmitAsync is refused with RESOURCE_EXHAUSTED.");
ABSL_FLAG(int64_t, max_transfers_in_flight, 8192,
          "Asynchronous transfers queued or running over all users.");
ABSL_FLAG(int64_t, max_kept_transfers_per_user, 4096,
          "Asynchronous transfers one local user may have in the agent: in "
          "flight, or ended and not yet read by GetTransfers. Beyond, "
          "SubmitAsync drops the oldest end a WatchTransfers stream has "
          "delivered, or is refused with RESOURCE_EXHAUSTED when there is "
          "none. Also how far a WatchTransfers stream may fall behind.");
ABSL_FLAG(absl::Duration, transfer_retention, absl::Minutes(5),
          "How long an ended transfer is kept for GetTransfers and new "
          "WatchTransfers streams when no GetTransfers has read it; then its "
          "id is NOT_FOUND.");
ABSL_FLAG(absl::Duration, max_transfer_wait, absl::Minutes(1),
          "Longest GetTransfers long poll; longer waits are cut to it.");
ABSL_FLAG(int64_t, max_notification_bytes, 4096,
          "Longest notification a Submit may carry and a peer may deliver "
          "here; longer is INVALID_ARGUMENT.");
ABSL_FLAG(int64_t, max_notifications_per_user, 1024,
          "Notifications kept for one local user until read (and for each "
          "of its WatchNotifications streams); beyond, the oldest is dropped "
          "and the drop reported to the user.");
ABSL_FLAG(absl::Duration, shutdown_grace, absl::Seconds(5),
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

// Largest --max_transfer_bytes_per_rpc: a reply of that many bytes plus its
// framing must fit the RdmaAgent server's 64 MiB message limit.
constexpr uint64_t kMaxTransferBytesPerRpc = uint64_t{60} << 20;

// "--name=value" of every flag whose value is not its default, so that the
// startup line says how this agent differs from a stock one.
std::string NonDefaultFlags() {
  std::vector<std::string> changed;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (flag->CurrentValue() != flag->DefaultValue()) {
      changed.push_back(absl::StrCat("--", name, "=", flag->CurrentValue()));
    }
  }
  if (changed.empty()) return "defaults";
  std::sort(changed.begin(), changed.end());
  return LogSafe(absl::StrJoin(changed, " "));
}

std::string SocketPath(std::string flag) {
  absl::string_view path = flag;
  absl::ConsumePrefix(&path, "unix://");
  return std::string(path);
}

int Run() {
  // First, so that every later refusal is seen.
  auto log_format = ParseLogFormat(absl::GetFlag(FLAGS_log_format));
  auto log_level = ParseLogLevel(absl::GetFlag(FLAGS_log_level));
  if (!log_level.ok() || !log_format.ok()) {
    ConfigureLogging(spdlog::level::info,
                     log_format.ok() ? *log_format : LogFormat::kPlain);
    spdlog::critical("{}", std::string(!log_level.ok()
                                           ? log_level.status().message()
                                           : log_format.status().message()));
    return 2;
  }
  ConfigureLogging(*log_level, *log_format);
  // Every registration and parked attachment holds an fd: take what the
  // hard limit allows. The admission defaults are derived from the result.
  spdlog::info("open-file limit {}",
               SetOpenFileLimit(absl::GetFlag(FLAGS_open_files_limit)));

  AgentOptions options;
  options.runtime_dir = absl::GetFlag(FLAGS_runtime_dir);
  options.state_dir = absl::GetFlag(FLAGS_state_dir);
  options.socket_path = SocketPath(absl::GetFlag(FLAGS_socket));
  options.attach_socket_path = absl::GetFlag(FLAGS_attach_socket);
  options.agent_id = absl::GetFlag(FLAGS_agent_id);
  options.peer_listen = absl::GetFlag(FLAGS_peer_listen);
  options.advertise_host = absl::GetFlag(FLAGS_advertise_host);
  options.default_submit_timeout = absl::GetFlag(FLAGS_default_submit_timeout);
  options.max_submit_timeout = absl::GetFlag(FLAGS_max_submit_timeout);
  options.max_ops_per_submit =
      static_cast<size_t>(absl::GetFlag(FLAGS_max_ops_per_submit));
  options.max_buffer_bytes = absl::GetFlag(FLAGS_max_buffer_bytes);
  options.max_transfer_bytes_per_rpc =
      absl::GetFlag(FLAGS_max_transfer_bytes_per_rpc);
  if (options.max_transfer_bytes_per_rpc == 0 ||
      options.max_transfer_bytes_per_rpc > kMaxTransferBytesPerRpc) {
    spdlog::critical("--max_transfer_bytes_per_rpc must be 1 to {} bytes",
                     kMaxTransferBytesPerRpc);
    return 2;
  }
  options.attach_token_ttl = absl::GetFlag(FLAGS_attach_token_ttl);
  options.max_registered_bytes_per_user =
      absl::GetFlag(FLAGS_max_registered_bytes_per_user);
  options.max_registered_bytes_total =
      absl::GetFlag(FLAGS_max_registered_bytes_total);
  options.max_buffers_per_user = absl::GetFlag(FLAGS_max_buffers_per_user);
  options.max_buffers_total = absl::GetFlag(FLAGS_max_buffers_total);
  options.max_pending_attach_per_user =
      absl::GetFlag(FLAGS_max_pending_attach_per_user);
  options.max_pending_attach_total =
      absl::GetFlag(FLAGS_max_pending_attach_total);
  options.max_attach_connections_per_user =
      absl::GetFlag(FLAGS_max_attach_connections_per_user);
  options.max_attach_connections_total =
      absl::GetFlag(FLAGS_max_attach_connections_total);
  options.max_watched_clients_per_user =
      absl::GetFlag(FLAGS_max_watched_clients_per_user);
  options.max_watched_clients_total =
      absl::GetFlag(FLAGS_max_watched_clients_total);
  options.max_ops_in_flight =
      static_cast<size_t>(absl::GetFlag(FLAGS_max_ops_in_flight));
  options.max_ops_in_flight_per_user =
      static_cast<size_t>(absl::GetFlag(FLAGS_max_ops_in_flight_per_user));
  if (absl::GetFlag(FLAGS_transfer_workers) < 1 ||
      absl::GetFlag(FLAGS_max_transfers_in_flight_per_user) < 1 ||
      absl::GetFlag(FLAGS_max_transfers_in_flight) < 1 ||
      absl::GetFlag(FLAGS_max_kept_transfers_per_user) < 1 ||
      absl::GetFlag(FLAGS_max_waiting_rpcs) < 1 ||
      absl::GetFlag(FLAGS_max_waiting_rpcs_per_user) < 1) {
    spdlog::critical(
        "--transfer_workers, --max_transfers_in_flight_per_user, "
        "--max_transfers_in_flight, --max_kept_transfers_per_user, "
        "--max_waiting_rpcs and --max_waiting_rpcs_per_user must be at "
        "least 1");
    return 2;
  }
  options.transfer_workers =
      static_cast<size_t>(absl::GetFlag(FLAGS_transfer_workers));
  options.max_transfers_in_flight_per_user = static_cast<size_t>(
      absl::GetFlag(FLAGS_max_transfers_in_flight_per_user));
  options.max_transfers_in_flight =
      static_cast<size_t>(absl::GetFlag(FLAGS_max_transfers_in_flight));
  options.max_kept_transfers_per_user =
      static_cast<size_t>(absl::GetFlag(FLAGS_max_kept_transfers_per_user));
  options.transfer_retention = absl::GetFlag(FLAGS_transfer_retention);
  options.max_transfer_wait = absl::GetFlag(FLAGS_max_transfer_wait);
  if (absl::GetFlag(FLAGS_max_notification_bytes) < 0 ||
      absl::GetFlag(FLAGS_max_notification_bytes) > (1 << 20) ||
      absl::GetFlag(FLAGS_max_notifications_per_user) < 1) {
    spdlog::critical(
        "--max_notification_bytes must be 0 to 1048576 and "
        "--max_notifications_per_user at least 1");
    return 2;
  }
  options.max_notification_bytes =
      static_cast<size_t>(absl::GetFlag(FLAGS_max_notification_bytes));
  options.max_notifications_per_user =
      static_cast<size_t>(absl::GetFlag(FLAGS_max_notifications_per_user));
  options.shutdown_grace = absl::GetFlag(FLAGS_shutdown_grace);
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  options.max_rpcs = static_cast<size_t>(absl::GetFlag(FLAGS_max_rpcs));
  options.max_rpcs_per_user =
      static_cast<size_t>(absl::GetFlag(FLAGS_max_rpcs_per_user));
  options.max_waiting_rpcs =
      static_cast<size_t>(absl::GetFlag(FLAGS_max_waiting_rpcs));
  options.max_waiting_rpcs_per_user =
      static_cast<size_t>(absl::GetFlag(FLAGS_max_waiting_rpcs_per_user));
  options.max_connections =
      static_cast<size_t>(absl::GetFlag(FLAGS_max_connections));
  options.max_connections_per_user =
      static_cast<size_t>(absl::GetFlag(FLAGS_max_connections_per_user));
  auto peer_tls = LoadPeerTls(absl::GetFlag(FLAGS_peer_tls_cert),
                              absl::GetFlag(FLAGS_peer_tls_key),
                              absl::GetFlag(FLAGS_peer_tls_ca),
                              absl::GetFlag(FLAGS_peer_tls_server_name));
  if (!peer_tls.ok()) {
    spdlog::critical("{}", peer_tls.status().ToString());
    return 2;
  }
  options.peer_tls = std::move(*peer_tls);
  for (const std::string& name : absl::GetFlag(FLAGS_backends)) {
    auto factory = BackendFactoryFromFlags(name);
    if (!factory.ok()) {
      spdlog::critical("--backends: {}", factory.status().ToString());
      return 2;
    }
    options.backends.push_back(std::move(*factory));
  }

  // Before Agent::Start creates threads, so that they inherit the mask.
  const sigset_t signals = BlockAgentSignals();
  signal(SIGPIPE, SIG_IGN);
  const SystemdNotifier notifier;
  notifier.Status("starting");

  auto agent = Agent::Start(std::move(options));
  if (!agent.ok()) {
    spdlog::critical("rdma-agentd cannot start: {}", agent.status().ToString());
    notifier.Status(absl::StrCat("cannot start: ", agent.status().message()));
    return 1;
  }
  // The line operators (and tests, and tools/run.sh) wait for.
  spdlog::info("rdma-agentd {} {}; flags: {}", kAgentVersion,
               (*agent)->Describe(), NonDefaultFlags());
  // Every socket listens: units ordered after this one may start now.
  notifier.Ready(ServingStatus(**agent));
  const int signal_number = ServeUntilStopSignal(signals, notifier);
  spdlog::info("signal {} received, shutting down", signal_number);
  notifier.Stopping(absl::StrCat("stopping: ", strsignal(signal_number)));
  (*agent)->Shutdown();
  spdlog::info("rdma-agentd stopped");
  return 0;
}

}  // namespace
}  // namespace rdma_agent

int main(int argc, char** argv) {
  // Debian builds abseil with lock-order (deadlock) detection on: every
  // lock and unlock then costs ~10x (measured 140-200 ns against 12-20 ns).
  // Tests keep it on (they run the agent as a library); the daemon turns it
  // off.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  rdma_agent::ParseCommandLineOrExit(argc, argv);
  return rdma_agent::Run();
}

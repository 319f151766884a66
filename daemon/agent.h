#ifndef RDMA_AGENTD_DAEMON_AGENT_H_
#define RDMA_AGENTD_DAEMON_AGENT_H_

#include <atomic>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "backends/backend.h"
#include "backends/registry.h"
#include "common/rate_limited_log.h"
#include "common/unique_fd.h"
#include "daemon/agent_options.h"
#include "daemon/limits/quota.h"
#include "daemon/ops/notifications.h"
#include "daemon/ops/prepared_transfers.h"
#include "daemon/ops/remote_handles.h"
#include "daemon/ops/ring_sessions.h"

namespace grpc {
class Server;
}

namespace rdma_agent {

class ActiveCalls;
class AgentMetrics;
class AttachServer;
class AttachTokens;
class BufferTable;
class CallerTable;
class MetricsServer;
class ClientWatcher;
class BufferNames;
class Directory;
class RdmaAgentService;
class TransferTable;
class UnixListener;

// One rdma-agentd: its registrations, its backends and the servers in front
// of them (the RdmaAgent Unix socket, the attach socket and the Peer TCP
// listener). Several can run in one process (tests).
class Agent {
 public:
  // Spawns the backends, starts every server and returns a running agent.
  static absl::StatusOr<std::unique_ptr<Agent>> Start(AgentOptions options);

  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;
  ~Agent();

  // Stops serving, removes the socket files and drops every registration.
  // Idempotent.
  void Shutdown();

  const AgentIdentity& identity() const { return identity_; }
  // One line for the log: id, epoch, sockets, the Peer address and each
  // backend with the addresses or devices it actually uses.
  std::string Describe() const;
  // "unix:///path/agent.sock", for grpc::CreateChannel.
  std::string target() const { return "unix://" + options_.socket_path; }
  const std::string& socket_path() const { return options_.socket_path; }
  const std::string& attach_socket_path() const {
    return options_.attach_socket_path;
  }
  const std::string& probe_socket_path() const {
    return options_.probe_socket_path;
  }
  // "host:port" of the Peer listener (empty when no backend serves peers).
  const std::string& peer_address() const { return peer_address_; }
  const BackendRegistry& registry() const { return *registry_; }
  // "host:port" of the metrics endpoint actually bound; empty without one.
  const std::string& metrics_address() const { return metrics_address_; }
  // The options in force: socket paths and admission limits filled in.
  const AgentOptions& options() const { return options_; }
  // The asynchronous transfers (for tests: watchers, transfers kept).
  const TransferTable& transfers() const { return *transfers_; }
  // Imported remotes and prepared transfers (for tests: what is kept).
  const RemoteHandleTable& remote_handles() const { return *remote_handles_; }
  const PreparedTransferTable& prepared_transfers() const {
    return *prepared_transfers_;
  }
  // Ring sessions (for tests: how many are open).
  const RingSessions& rings() const { return *rings_; }

 private:
  explicit Agent(AgentOptions options);
  // Runs the steps below in order; the first error aborts the start (the
  // destructor then stops whatever was started).
  absl::Status Init();
  // Creates the runtime directory and fills in the options it implies
  // (socket paths, advertised host, agent id); picks this life's epoch.
  absl::Status PrepareRuntimeDir();
  // Fills in the agent id, unless given, from the state dir (or the runtime
  // dir when the state dir is unusable), which it locks: one agent per id.
  absl::Status LoadAgentId();
  // Builds every backend from its factory into the backend registry.
  absl::Status SpawnBackends();
  // Serves the backends' Peer services on one TCP listener, if any has one,
  // and learns the address peers are told to dial.
  absl::Status StartPeerListener();
  // Starts every available backend with the Peer address.
  absl::Status StartBackends();
  // The RdmaAgent gRPC server (no port: connections come from the listener).
  absl::Status StartApiServer();
  // Accepts the RdmaAgent Unix socket, admits each caller, hands it to gRPC.
  absl::Status StartApiListener();
  // The attach socket (memfd hand-over for Register and OpenBuffer).
  absl::Status StartAttachServer();
  // The Prometheus endpoint, if --metrics_listen asks for one.
  absl::Status StartMetricsServer();
  // Opens the directory (--directory); nothing is contacted yet.
  absl::Status OpenDirectory();
  // Publishes this agent's record, once it serves. A directory that cannot
  // be reached is retried in the background: the agent serves anyway.
  void PublishSelf();
  // Gauges read at scrape time from state the agent keeps anyway.
  void AddGauges();
  // The directory's counters and gauges (rdma_agentd_directory_*).
  void AddDirectoryMetrics();
  // Logs and counts peer requests the buffer table refused.
  void ObservePeerRefusals();
  // Fills the admission limits left at 0 from the host, logs them and makes
  // the quotas.
  void SetUpQuotas();

  AgentOptions options_;
  AgentIdentity identity_;
  const absl::Time start_time_ = absl::Now();
  std::string peer_address_;
  std::string metrics_address_;
  bool advertise_host_explicit_ = false;  // --advertise_host was given
  AgentQuotas quotas_;
  LogRateLimiter refused_connection_log_{absl::Seconds(10)};
  LogRateLimiter refused_peer_log_{absl::Seconds(1), 20};
  // False from the start of shutdown (/healthz answers 503).
  std::atomic<bool> serving_{false};
  // Declaration order is teardown order in reverse: servers stop before the
  // registries and backends they call into are destroyed.
  std::unique_ptr<AgentMetrics> metrics_;
  std::unique_ptr<BufferTable> buffers_;
  // Backends deliver into it: it outlives them.
  std::unique_ptr<NotificationInbox> notifications_;
  std::unique_ptr<ClientWatcher> client_watcher_;
  std::unique_ptr<AttachTokens> attach_tokens_;
  std::unique_ptr<BackendRegistry> registry_;
  std::unique_ptr<CallerTable> callers_;
  std::unique_ptr<ActiveCalls> calls_;
  // Before the service, which answers ListAgents from it.
  std::unique_ptr<Directory> directory_;
  // Names published for buffers; after the directory it tells (destroyed
  // first), listening to the buffer table from OpenDirectory to Shutdown.
  std::unique_ptr<BufferNames> names_;
  int names_listener_ = -1;
  // Before the service, whose RPCs and batches use them.
  std::unique_ptr<RemoteHandleTable> remote_handles_;
  std::unique_ptr<PreparedTransferTable> prepared_transfers_;
  std::unique_ptr<RdmaAgentService> service_;
  // After the service whose batches its workers run, and after the calls
  // whose ops charges those batches hold: its workers are joined before
  // either goes, and before the backends do.
  std::unique_ptr<TransferTable> transfers_;
  // The Peer listener's front (daemon/peer_gate.h); it outlives the Peer
  // server, whose calls tell it which connections delivered a request.
  std::unique_ptr<PeerGate> peer_gate_;
  std::unique_ptr<grpc::Server> peer_server_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<UnixListener> listener_;
  std::unique_ptr<UnixListener> probe_listener_;  // mode 0600
  // Ring sessions run on attach connections' threads: declared before the
  // attach server, which joins them, so that it goes first. Made with the
  // service (ListRingSessions), whose server is shut down before either
  // goes.
  FailedOpLog ring_failures_;
  std::unique_ptr<RingSessions> rings_;
  std::unique_ptr<AttachServer> attach_server_;
  std::unique_ptr<MetricsServer> metrics_server_;
  bool shut_down_ = false;
  // flock on <runtime_dir>/rdma-agentd.lock, held while the agent lives.
  // Declared last: released only after every server and socket is gone.
  UniqueFd runtime_dir_lock_;
  // flock on <state_dir>/rdma-agentd.lock when the id comes from a state dir
  // of its own.
  UniqueFd state_dir_lock_;
};

// Takes <runtime_dir>/rdma-agentd.lock (flock) for this process:
// FAILED_PRECONDITION naming the holder's pid when another agent serves the
// directory. The lock goes with the fd (or the process).
absl::StatusOr<UniqueFd> LockRuntimeDir(const std::string& runtime_dir);

// The same for <state_dir>/rdma-agentd.lock: two agents sharing a state dir
// would share an agent id.
absl::StatusOr<UniqueFd> LockStateDir(const std::string& state_dir);

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_AGENT_H_

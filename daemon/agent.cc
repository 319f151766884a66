#include "daemon/agent.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "backends/buffer_table.h"
#include "backends/peer_tls.h"
#include "common/log_text.h"
#include "common/net_address.h"
#include "common/random.h"
#include "common/rate_limited_log.h"
#include "common/status_util.h"
#include "common/unique_fd.h"
#include "daemon/api/rpc_observer.h"
#include "daemon/api/service.h"
#include "daemon/api/version.h"
#include "daemon/directory/buffer_names.h"
#include "daemon/directory/directory.h"
#include "daemon/limits/active_calls.h"
#include "daemon/local/attach_server.h"
#include "daemon/local/attach_tokens.h"
#include "daemon/local/caller_identity.h"
#include "daemon/local/client_watcher.h"
#include "daemon/local/unix_socket.h"
#include "daemon/metrics/metrics.h"
#include "daemon/metrics/metrics_server.h"
#include "daemon/ops/transfers.h"
#include "daemon/peer_gate.h"
#include "daemon/state_dir.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/util/time_util.h"
#include "grpc/health/v1/health.pb.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/resource_quota.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/server_posix.h"
#include "spdlog/spdlog.h"

namespace rdma_agent {
namespace {

// Large enough for ReadBuffer/WriteBuffer at the per-call limit.
constexpr int kMaxMessageBytes = 64 << 20;

// The Peer listener: port when --peer_listen names none, and its bounds.
constexpr uint16_t kDefaultPeerPort = 7470;
constexpr int kPeerMaxThreads = 32;
constexpr int kPeerMaxMessageBytes = 64 << 10;
constexpr int kPeerMaxStreamsPerConnection = 8;
constexpr int kPeerMaxIdleMs = 5 * 60 * 1000;

absl::Status MakeDirectory(const std::string& path) {
  if (::mkdir(path.c_str(), 0755) != 0 && errno != EEXIST) {
    return ErrnoStatus(absl::StatusCode::kInternal,
                       absl::StrCat("cannot create ", path), errno);
  }
  return absl::OkStatus();
}

// Takes <dir>/rdma-agentd.lock (flock) for this process: FAILED_PRECONDITION
// naming the holder's pid when another agent holds it ("another rdma-agentd
// (pid N) already <holds> <dir>; ... its own <flag>").
absl::StatusOr<UniqueFd> LockAgentDir(const std::string& dir,
                                      absl::string_view holds,
                                      absl::string_view flag) {
  const std::string path = dir + "/rdma-agentd.lock";
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
  if (!fd) {
    return ErrnoStatus(absl::StatusCode::kInternal, absl::StrCat("open ", path),
                       errno);
  }
  if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK) {
      return ErrnoStatus(absl::StatusCode::kInternal,
                         absl::StrCat("flock ", path), errno);
    }
    char pid[32] = {};
    const ssize_t n = ::pread(fd.get(), pid, sizeof(pid) - 1, 0);
    return absl::FailedPreconditionError(absl::StrCat(
        "another rdma-agentd (pid ",
        n > 0 ? std::string(absl::StripAsciiWhitespace(pid)) : "unknown",
        ") already ", holds, " ", dir,
        "; stop it first, or give this one its own ", flag));
  }
  // Who holds it, for the message above; the lock itself dies with us.
  const std::string pid = absl::StrCat(::getpid(), "\n");
  if (::ftruncate(fd.get(), 0) != 0 ||
      ::pwrite(fd.get(), pid.data(), pid.size(), 0) !=
          static_cast<ssize_t>(pid.size())) {
    return ErrnoStatus(absl::StatusCode::kInternal,
                       absl::StrCat("write ", path), errno);
  }
  return fd;
}

}  // namespace

absl::StatusOr<UniqueFd> LockRuntimeDir(const std::string& runtime_dir) {
  return LockAgentDir(runtime_dir, "serves", "--runtime_dir");
}

absl::StatusOr<UniqueFd> LockStateDir(const std::string& state_dir) {
  return LockAgentDir(state_dir, "keeps its agent id in", "--state_dir");
}

absl::StatusOr<std::unique_ptr<Agent>> Agent::Start(AgentOptions options) {
  absl::Status valid = options.Validate();
  if (!valid.ok()) return valid;
  std::unique_ptr<Agent> agent(new Agent(std::move(options)));
  absl::Status status = agent->Init();
  if (!status.ok()) return status;
  return agent;
}

Agent::Agent(AgentOptions options) : options_(std::move(options)) {}

Agent::~Agent() { Shutdown(); }

absl::Status Agent::Init() {
  absl::Status status = PrepareRuntimeDir();
  if (!status.ok()) return status;
  metrics_ =
      std::make_unique<AgentMetrics>(kAgentVersion, options_.build_revision);
  buffers_ = std::make_unique<BufferTable>(identity_.epoch);
  notifications_ = std::make_unique<NotificationInbox>(buffers_.get(),
                                                       options_.notifications);
  ObservePeerRefusals();
  // Before the quotas: whether a NIC pins registered memory bounds them.
  status = SpawnBackends();
  if (!status.ok()) return status;
  std::vector<std::string> backend_names;
  for (const auto& backend : registry_->backends()) {
    backend_names.push_back(backend->name());
  }
  metrics_->DeclareBackends(backend_names);
  // Every method of the services the agent serves (the API, Peer, health).
  std::vector<std::string> methods;
  for (const char* service : {"rdma.agent.v1.RdmaAgent", "rdma.agent.v1.Peer",
                              "grpc.health.v1.Health"}) {
    const google::protobuf::ServiceDescriptor* descriptor =
        google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
            service);
    for (int i = 0; descriptor != nullptr && i < descriptor->method_count();
         ++i) {
      methods.push_back(
          absl::StrCat(service, "/", descriptor->method(i)->name()));
    }
  }
  metrics_->DeclareRpcMethods(methods);
  SetUpQuotas();
  ClientWatcher::Options watch_options;
  watch_options.methods = options_.process_watch;
  watch_options.connection_poll_interval = options_.connection_poll_interval;
  auto client_watcher = ClientWatcher::Start(watch_options, buffers_.get(),
                                             quotas_.watched_clients);
  if (!client_watcher.ok()) return client_watcher.status();
  client_watcher_ = std::move(*client_watcher);
  attach_tokens_ = std::make_unique<AttachTokens>(options_.attach_token_ttl);
  // In order: backends must exist before the Peer listener serves their
  // services, and must be started (knowing the Peer address) before any
  // client can reach the API.
  for (absl::Status (Agent::*step)() :
       {&Agent::StartPeerListener, &Agent::StartBackends,
        &Agent::StartMetricsServer, &Agent::OpenDirectory,
        &Agent::StartApiServer, &Agent::StartApiListener,
        &Agent::StartAttachServer}) {
    status = (this->*step)();
    if (!status.ok()) return status;
  }
  AddGauges();
  serving_ = true;
  PublishSelf();
  return absl::OkStatus();
}

absl::Status Agent::OpenDirectory() {
  auto directory = rdma_agent::OpenDirectory(options_.directory);
  if (!directory.ok()) return directory.status();
  directory_ = std::move(*directory);
  names_ = std::make_unique<BufferNames>(directory_.get(),
                                         options_.directory.max_names_per_user,
                                         options_.directory.max_names_total);
  names_listener_ = buffers_->AddRemovalListener(
      [names = names_.get()](uint64_t id) { names->Released(id); });
  return absl::OkStatus();
}

void Agent::PublishSelf() {
  v1::AgentRecord record;
  *record.mutable_info() = service_->Info();
  *record.mutable_start_time() =
      google::protobuf::util::TimeUtil::NanosecondsToTimestamp(
          absl::ToUnixNanos(start_time_));
  record.set_peer_address(peer_address_);
  absl::Status status = directory_->PublishAgent(record);
  if (status.ok()) {
    spdlog::info("directory {}: published agent {}", directory_->name(),
                 identity_.agent_id);
  } else {
    spdlog::warn(
        "directory {}: cannot publish agent {} yet ({}); serving anyway and "
        "retrying",
        directory_->name(), identity_.agent_id, std::string(status.message()));
  }
}

std::string Agent::Describe() const {
  std::vector<std::string> backends;
  for (const auto& backend : registry_->backends()) {
    if (!backend->available()) {
      backends.push_back(absl::StrCat(backend->name(), " unavailable (",
                                      LogSafe(backend->unavailable_reason()),
                                      ")"));
      continue;
    }
    const v1::TransportInfo info = backend->transport_info();
    std::vector<std::string> where(info.addresses().begin(),
                                   info.addresses().end());
    for (const auto& device : info.devices()) {
      where.push_back(absl::StrCat(device.name(), ":", device.port()));
    }
    backends.push_back(where.empty() ? backend->name()
                                     : absl::StrCat(backend->name(), " at ",
                                                    absl::StrJoin(where, " ")));
  }
  // The epoch in decimal, as GetInfo, remote contexts and errors give it.
  return absl::StrCat(
      "agent ", identity_.agent_id, " epoch ", identity_.epoch,
      " serving unix://", options_.socket_path, " (attach ",
      options_.attach_socket_path, ")",
      peer_address_.empty() ? "" : ", peers at " + peer_address_,
      metrics_address_.empty() ? "" : ", metrics at http://" + metrics_address_,
      "; backends: ", absl::StrJoin(backends, ", "));
}

absl::Status Agent::PrepareRuntimeDir() {
  absl::Status status = MakeDirectory(options_.runtime_dir);
  if (!status.ok()) return status;
  auto lock = LockRuntimeDir(options_.runtime_dir);
  if (!lock.ok()) return lock.status();
  runtime_dir_lock_ = std::move(*lock);
  if (options_.socket_path.empty()) {
    options_.socket_path = options_.runtime_dir + "/agent.sock";
  }
  // The attach and probe sockets are next to the API socket, where clients
  // look for them.
  const size_t slash = options_.socket_path.rfind('/');
  const std::string dir = slash == std::string::npos
                              ? std::string()
                              : options_.socket_path.substr(0, slash + 1);
  if (options_.attach_socket_path.empty()) {
    options_.attach_socket_path = dir + "attach.sock";
  }
  if (options_.probe_socket_path.empty()) {
    options_.probe_socket_path = dir + "probe.sock";
  }
  advertise_host_explicit_ = !options_.advertise_host.empty();
  if (!advertise_host_explicit_) {
    options_.advertise_host = DefaultAdvertiseHost();
  }
  status = LoadAgentId();
  if (!status.ok()) return status;
  identity_.agent_id = options_.agent_id;
  identity_.epoch = RandomNonZeroU64();
  return absl::OkStatus();
}

absl::Status Agent::LoadAgentId() {
  if (!options_.agent_id.empty()) return absl::OkStatus();
  std::string& state_dir = options_.state_dir;
  if (state_dir.empty()) state_dir = options_.runtime_dir;
  if (absl::Status usable = PrepareStateDir(state_dir); !usable.ok()) {
    // E.g. a user's shell, not root and not under systemd: the id then lasts
    // only as long as the runtime dir.
    spdlog::warn(
        "state dir unusable ({}); keeping the agent id in the runtime dir {} "
        "instead, where it does not survive its removal (pass a writable "
        "--state_dir)",
        std::string(usable.message()), options_.runtime_dir);
    state_dir = options_.runtime_dir;
  }
  const bool own_state_dir = !IsSameDirectory(state_dir, options_.runtime_dir);
  if (own_state_dir) {
    auto lock = LockStateDir(state_dir);
    if (!lock.ok()) return lock.status();
    state_dir_lock_ = std::move(*lock);
  }
  // Earlier versions kept the id in the runtime dir.
  auto id =
      LoadOrCreateAgentId(state_dir, own_state_dir ? options_.runtime_dir : "");
  if (!id.ok()) return id.status();
  options_.agent_id = *id;
  return absl::OkStatus();
}

absl::Status Agent::SpawnBackends() {
  BackendEnvironment env;
  env.identity = identity_;
  env.directory = buffers_.get();
  env.advertise_host = options_.advertise_host;
  env.advertise_host_explicit = advertise_host_explicit_;
  env.peer_tls = options_.peer_tls;
  env.notifications = notifications_.get();
  std::vector<std::unique_ptr<Backend>> backends;
  for (const BackendFactory& factory : options_.backends) {
    auto backend = factory(env);
    if (!backend.ok()) {
      return Prefixed(backend.status(), "spawning a backend");
    }
    backends.push_back(std::move(*backend));
  }
  registry_ = std::make_unique<BackendRegistry>(std::move(backends));
  return absl::OkStatus();
}

absl::Status Agent::StartPeerListener() {
  // Only when some backend serves peers.
  std::vector<grpc::Service*> peer_services;
  for (const auto& backend : registry_->backends()) {
    if (!backend->available()) continue;
    for (grpc::Service* service : backend->peer_services()) {
      peer_services.push_back(service);
    }
  }
  if (peer_services.empty()) return absl::OkStatus();
  if (options_.peer_listen.empty()) {
    // Where peers are told to dial, and nowhere else.
    options_.peer_listen =
        JoinHostPort(options_.advertise_host, kDefaultPeerPort);
  }
  auto listen = ParseHostPort(options_.peer_listen);
  if (!listen.ok()) return listen.status();
  grpc::ServerBuilder builder;
  // Anyone on the network may connect here: Peer requests are small and
  // few, so threads, streams, message size and idle connections are bound
  // tightly (a stranger holds nothing for long).
  grpc::ResourceQuota peer_quota("rdma-agentd-peer");
  peer_quota.SetMaxThreads(kPeerMaxThreads);
  builder.SetResourceQuota(peer_quota);
  builder.SetMaxReceiveMessageSize(kPeerMaxMessageBytes);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS,
                             kPeerMaxStreamsPerConnection);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, kPeerMaxIdleMs);
  const PeerListenerLimits& limits = options_.peer_listener;
  // Every connection ends, so a half-sent call on one that once delivered
  // a request holds nothing for long either.
  builder.AddChannelArgument(
      GRPC_ARG_MAX_CONNECTION_AGE_MS,
      static_cast<int>(absl::ToInt64Milliseconds(limits.max_connection_age)));
  builder.AddChannelArgument(
      GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS,
      static_cast<int>(absl::ToInt64Milliseconds(limits.call_arrival_timeout)));
  builder.AddChannelArgument(
      GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
      static_cast<int>(absl::ToInt64Milliseconds(limits.call_arrival_timeout)));
  // gRPC serves on a Unix socket only this agent can reach; the PeerGate
  // takes the network's connections, caps them per source and in total,
  // cuts those that deliver no request in time, and splices the rest to it
  // (gRPC's own listener has no per-source cap, and cannot take accepted
  // fds under TLS).
  const std::string private_dir = options_.runtime_dir + "/peer";
  if (::mkdir(private_dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return ErrnoStatus(absl::StatusCode::kInternal,
                       absl::StrCat("cannot create ", private_dir), errno);
  }
  if (::chmod(private_dir.c_str(), 0700) != 0) {
    return ErrnoStatus(absl::StatusCode::kInternal,
                       absl::StrCat("chmod ", private_dir), errno);
  }
  const std::string grpc_socket = private_dir + "/grpc.sock";
  // With TLS material, peers must present a certificate from the CA.
  builder.AddListeningPort("unix:" + grpc_socket,
                           PeerServerCredentials(options_.peer_tls));
  for (grpc::Service* service : peer_services) {
    builder.RegisterService(service);
  }
  std::vector<
      std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
      interceptors;
  interceptors.push_back(std::make_unique<RpcObserverFactory>(metrics_.get()));
  // Calls arrive only through the gate, which exists before any does.
  interceptors.push_back(MakeArrivalInterceptor([this](absl::string_view peer) {
    if (peer_gate_ != nullptr) peer_gate_->RequestArrived(peer);
  }));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  peer_server_ = builder.BuildAndStart();
  if (peer_server_ == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve peers on ", grpc_socket));
  }
  auto gate = PeerGate::Start(options_.peer_listen, grpc_socket, limits);
  if (!gate.ok()) return gate.status();
  peer_gate_ = std::move(*gate);
  const uint16_t port = peer_gate_->port();
  // The port actually bound, at the host peers can reach it at.
  peer_address_ = JoinHostPort(
      AdvertisedHost(listen->host,
                     advertise_host_explicit_ ? options_.advertise_host : "",
                     options_.advertise_host),
      static_cast<uint16_t>(port));
  if (options_.peer_tls.enabled()) {
    spdlog::info("Peer listener {} requires client certificates (mTLS)",
                 options_.peer_listen);
  } else {
    spdlog::warn(
        "Peer listener {} is plaintext: any host reaching it may call the "
        "Peer service (set --peer_tls_cert/--peer_tls_key/--peer_tls_ca)",
        options_.peer_listen);
  }
  return absl::OkStatus();
}

absl::Status Agent::StartBackends() {
  for (const auto& backend : registry_->backends()) {
    if (!backend->available()) continue;
    absl::Status status = backend->Start(peer_address_);
    if (!status.ok()) {
      return Prefixed(status,
                      absl::StrCat("starting backend ", backend->name()));
    }
  }
  return absl::OkStatus();
}

absl::Status Agent::StartApiServer() {
  callers_ = std::make_unique<CallerTable>();
  calls_ = std::make_unique<ActiveCalls>(options_.in_flight);
  transfers_ = std::make_unique<TransferTable>(options_.transfers);
  remote_handles_ =
      std::make_unique<RemoteHandleTable>(options_.remote_handles);
  prepared_transfers_ =
      std::make_unique<PreparedTransferTable>(options_.prepared_transfers);
  // Before the service, which lists their sessions; opened on the attach
  // server (StartAttachServer), served by their own ring threads.
  RingLimits ring_limits = options_.rings;
  ring_limits.default_timeout = options_.api.default_submit_timeout;
  ring_limits.max_timeout = options_.api.max_submit_timeout;
  ring_limits.max_notification_bytes = options_.notifications.max_bytes;
  OpBatchEnvironment ring_env{registry_.get(),
                              buffers_.get(),
                              metrics_.get(),
                              &ring_failures_,
                              options_.api.max_remote_context_bytes,
                              remote_handles_.get()};
  auto rings =
      RingSessions::Start(ring_limits, ring_env, calls_.get(), quotas_.bytes,
                          transfers_.get(), prepared_transfers_.get());
  if (!rings.ok()) return rings.status();
  rings_ = std::move(*rings);
  service_ = std::make_unique<RdmaAgentService>(
      options_.api, identity_, registry_.get(), buffers_.get(),
      attach_tokens_.get(), callers_.get(), calls_.get(), quotas_,
      client_watcher_.get(), transfers_.get(), notifications_.get(),
      metrics_.get(), metrics_address_, directory_.get(), names_.get(),
      options_.directory, remote_handles_.get(), prepared_transfers_.get(),
      rings_.get());
  grpc::EnableDefaultHealthCheckService(true);
  // gRPC's health service carries no protobuf descriptor of its own; linking
  // ours lets reflection resolve grpc.health.v1.Health (grpcurl, grpcui).
  (void)grpc::health::v1::HealthCheckRequest::descriptor();
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.RegisterService(service_.get());
  // Every sync RPC holds a thread: bounded here (RESOURCE_EXHAUSTED beyond),
  // and per user by ActiveCalls well below this bound. The waiting RPCs
  // (callback API) hold none; ActiveCalls bounds them on their own.
  grpc::ResourceQuota quota("rdma-agentd");
  quota.SetMaxThreads(static_cast<int>(options_.in_flight.max_calls));
  builder.SetResourceQuota(quota);
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  ObserveRpcs(builder, std::make_unique<RpcObserverFactory>(callers_.get(),
                                                            metrics_.get()));
  server_ = builder.BuildAndStart();
  if (server_ == nullptr) {
    return absl::InternalError("cannot start the RdmaAgent gRPC server");
  }
  // Probes may ask for the API by name; it turns NOT_SERVING at shutdown.
  server_->GetHealthCheckService()->SetServingStatus(
      v1::RdmaAgent::service_full_name(), true);
  return absl::OkStatus();
}

absl::Status Agent::StartApiListener() {
  // The agent accepts its Unix socket itself to learn each caller's
  // credentials (SO_PEERCRED), then lets gRPC serve the connection.
  const auto serve = [this](UniqueFd fd, const PeerCredentials& peer) {
    const absl::Status admitted = AdmitApiConnection(
        fd.get(), peer, callers_.get(), options_.connections.max_per_user,
        options_.connections.max_total);
    if (!admitted.ok()) {
      // Closing is the answer: the client sees its connection refused.
      // Rate-limited: a flood of refused connections is one line per
      // interval, not one per connection.
      if (auto suppressed = refused_connection_log_.Allow()) {
        spdlog::warn(
            "refusing a connection from uid {} pid {}: {} ({} more "
            "refusals not logged)",
            peer.uid, peer.pid, std::string(admitted.message()), *suppressed);
      }
      return;
    }
    grpc::AddInsecureChannelFromFd(server_.get(), fd.release());
  };
  auto listener = UnixListener::Start(options_.socket_path, serve);
  if (!listener.ok()) return listener.status();
  listener_ = std::move(*listener);
  // The same server for probes, on a socket no other user can connect to:
  // a user flooding the API socket fills its accept queue (the kernel then
  // refuses new connections, and gRPC clients back off for seconds), but
  // never this one's.
  auto probe_listener =
      UnixListener::Start(options_.probe_socket_path, serve, 0600);
  if (!probe_listener.ok()) return probe_listener.status();
  probe_listener_ = std::move(*probe_listener);
  return absl::OkStatus();
}

absl::Status Agent::StartAttachServer() {
  AttachServer::Options attach_options;
  attach_options.path = options_.attach_socket_path;
  attach_options.max_buffer_bytes = options_.api.max_buffer_bytes;
  attach_options.quotas = quotas_;
  attach_options.open_ring = [rings = rings_.get()](
                                 UniqueFd connection, QuotaCharge charge,
                                 const PeerCredentials& peer,
                                 const v1::OpenRing& request) {
    rings->Open(std::move(connection), std::move(charge), peer, request);
  };
  auto attach =
      AttachServer::Start(attach_options, attach_tokens_.get(), buffers_.get());
  if (!attach.ok()) return attach.status();
  attach_server_ = std::move(*attach);
  return absl::OkStatus();
}

void Agent::SetUpQuotas() {
  HostLimits host = ReadHostLimits();
  for (const auto& backend : registry_->backends()) {
    host.memory_pinned = host.memory_pinned ||
                         (backend->available() && backend->transport_level() ==
                                                      v1::TRANSPORT_LEVEL_NIC);
  }
  const MemoryLimitOrigins origins =
      DescribeMemoryLimits(options_.quotas, host);
  // From here on, options() says the limits in force.
  options_.quotas = DeriveQuotaLimits(options_.quotas, host);
  const QuotaLimits& limits = options_.quotas;
  spdlog::info(
      "memory limits (per user / total): registered bytes {} / {} ({}), "
      "agent-allocated bytes {} / {} ({})",
      limits.bytes.per_user, limits.bytes.total, origins.registered,
      limits.agent_allocated.per_user, limits.agent_allocated.total,
      origins.agent_allocated);
  // A node that holds a KV cache needs most of its memory registrable: say
  // so at start rather than at the first refusal.
  const auto warn_if_far_below = [&](uint64_t total, const char* what,
                                     const std::string& origin,
                                     const char* remedy) {
    if (total >= host.memory_bytes / 2) return;
    spdlog::warn(
        "the {} total of {} bytes ({}) is far below the host's {} bytes of "
        "memory: {}",
        what, total, origin, host.memory_bytes, remedy);
  };
  warn_if_far_below(limits.bytes.total, "registered bytes", origins.registered,
                    "raise RLIMIT_MEMLOCK (LimitMEMLOCK=infinity) or grant "
                    "CAP_IPC_LOCK, or set --max_registered_bytes_total");
  warn_if_far_below(
      limits.agent_allocated.total, "agent-allocated bytes",
      origins.agent_allocated,
      "memory clients attach (memfds) is not bound by it; for memory the "
      "agent allocates, raise the agent's memory limit or set "
      "--max_agent_allocated_bytes_total");
  spdlog::info(
      "admission limits (per user / total), from {} open files, "
      "vm.max_map_count {}, {} bytes of memory: registered bytes {} / {}, "
      "registrations {} / {}, parked attachments {} / {}, attach connections "
      "{} / {}, watched clients {} / {}",
      host.open_files, host.max_map_count, host.memory_bytes,
      limits.bytes.per_user, limits.bytes.total, limits.registrations.per_user,
      limits.registrations.total, limits.pending_attach.per_user,
      limits.pending_attach.total, limits.attach_connections.per_user,
      limits.attach_connections.total, limits.watched_clients.per_user,
      limits.watched_clients.total);
  quotas_ = MakeAgentQuotas(limits);
}

void Agent::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  serving_ = false;
  // Peers stop finding this agent (and its names) before it stops
  // answering them.
  if (names_listener_ >= 0) buffers_->RemoveRemovalListener(names_listener_);
  names_listener_ = -1;
  if (directory_ != nullptr) directory_->Withdraw();
  // Health checks on open connections say so during the grace below.
  if (server_ != nullptr)
    server_->GetHealthCheckService()->SetServingStatus(false);
  // Ring sessions end (their running batches cancelled, their completions
  // posted) and the ring threads are joined, before the transfers they
  // started are ended below.
  if (rings_ != nullptr) {
    rings_->Shutdown(absl::UnavailableError("the agent is shutting down"));
  }
  attach_server_.reset();
  listener_.reset();
  probe_listener_.reset();
  // Submits in flight stop now (their ops end UNAVAILABLE), and open
  // WatchTransfers streams and GetTransfers long polls end UNAVAILABLE, so
  // the grace below is spent only on RPCs that are already finishing.
  if (calls_ != nullptr) {
    calls_->CancelAll(absl::UnavailableError("the agent is shutting down"));
  }
  // Likewise every asynchronous transfer: queued ones never start, running
  // ones stop, and the workers are joined, so none is left touching memory
  // or backends torn down below.
  if (transfers_ != nullptr) {
    transfers_->Shutdown(absl::UnavailableError("the agent is shutting down"));
  }
  // Notification readers (long polls, streams) end now too.
  if (notifications_ != nullptr) notifications_->Close();
  const absl::Time grace = absl::Now() + options_.shutdown_grace;
  if (server_ != nullptr) {
    // gRPC's Shutdown would spend the whole grace on connections that are
    // merely open (clients that keep a channel). The agent knows its RPCs:
    // once they have ended, a short margin lets their replies go out.
    if (calls_ != nullptr && calls_->WaitUntilIdle(grace)) {
      server_->Shutdown(absl::ToChronoTime(
          std::min(grace, absl::Now() + absl::Milliseconds(200))));
    } else {
      server_->Shutdown(absl::ToChronoTime(grace));
    }
  }
  if (peer_server_ != nullptr)
    peer_server_->Shutdown(absl::ToChronoTime(grace));
  // Every registration goes below; none is released for a client first.
  client_watcher_.reset();
  if (buffers_ != nullptr) buffers_->Clear();
  server_.reset();
  peer_server_.reset();
  metrics_server_.reset();
}

absl::Status Agent::StartMetricsServer() {
  if (options_.metrics_listen.empty()) return absl::OkStatus();
  auto server =
      MetricsServer::Start(options_.metrics_listen, options_.metrics,
                           metrics_.get(), [this] { return serving_.load(); });
  if (!server.ok()) return server.status();
  metrics_server_ = std::move(*server);
  // The port bound, on the host asked for (a wildcard is reached locally).
  auto listen = ParseHostPort(options_.metrics_listen);
  metrics_address_ =
      JoinHostPort(AdvertisedHost(listen.ok() ? listen->host : "", "", ""),
                   metrics_server_->port());
  return absl::OkStatus();
}

void Agent::AddDirectoryMetrics() {
  Directory* const directory = directory_.get();
  auto pair = [directory](const char* label, const char* first,
                          uint64_t DirectoryStats::*first_value,
                          const char* second,
                          uint64_t DirectoryStats::*second_value) {
    return [=] {
      const DirectoryStats stats = directory->Stats();
      return std::vector<GaugeSample>{
          {{{label, first}}, static_cast<double>(stats.*first_value)},
          {{{label, second}}, static_cast<double>(stats.*second_value)}};
    };
  };
  metrics_->AddCounter(
      "rdma_agentd_directory_resolve_cache_lookups_total",
      "Resolutions (Resolve, ops by name) answered from the resolve cache "
      "(hit) and those that asked etcd (miss)",
      pair("result", "hit", &DirectoryStats::resolve_cache_hits, "miss",
           &DirectoryStats::resolve_cache_misses));
  metrics_->AddCounter(
      "rdma_agentd_directory_lease_renewals_total",
      "Renewals of this agent's directory lease, by result (ok, failed)",
      pair("result", "ok", &DirectoryStats::lease_renewals_ok, "failed",
           &DirectoryStats::lease_renewals_failed));
  auto etcd = [directory](bool errors) {
    return [directory, errors] {
      std::vector<GaugeSample> samples;
      for (const auto& operation : directory->Stats().etcd) {
        samples.push_back(
            {{{"operation", operation.operation}},
             static_cast<double>(errors ? operation.errors : operation.calls)});
      }
      return samples;
    };
  };
  metrics_->AddCounter("rdma_agentd_directory_etcd_calls_total",
                       "Calls to etcd by operation (none with the local "
                       "directory)",
                       etcd(/*errors=*/false));
  metrics_->AddCounter("rdma_agentd_directory_etcd_errors_total",
                       "Calls to etcd that failed, by operation",
                       etcd(/*errors=*/true));
  auto size = [directory](size_t DirectoryStats::*value) {
    return [directory, value] {
      return std::vector<GaugeSample>{
          {{}, static_cast<double>(directory->Stats().*value)}};
    };
  };
  metrics_->AddGauge("rdma_agentd_directory_resolve_cache_entries",
                     "Name records in the resolve cache",
                     size(&DirectoryStats::resolve_cache_entries));
  metrics_->AddGauge("rdma_agentd_directory_resolve_cache_bytes",
                     "Bytes of names and records in the resolve cache",
                     size(&DirectoryStats::resolve_cache_bytes));
  metrics_->AddGauge("rdma_agentd_directory_watch_streams",
                     "WatchNames streams open",
                     size(&DirectoryStats::watch_streams));
  metrics_->AddGauge("rdma_agentd_directory_names_published",
                     "Names this agent's users publish through it",
                     [names = names_.get()] {
                       return std::vector<GaugeSample>{
                           {{}, static_cast<double>(names->size())}};
                     });
}

void Agent::AddGauges() {
  AddDirectoryMetrics();
  metrics_->AddGauge(
      "rdma_agentd_rpcs_in_flight",
      "API RPCs running now, waiting ones included (rdma_agentd_waiting_rpcs "
      "counts those apart)",
      [calls = calls_.get()] {
        return std::vector<GaugeSample>{
            {{}, static_cast<double>(calls->calls())}};
      });
  metrics_->AddGauge(
      "rdma_agentd_waiting_rpcs",
      "API RPCs waiting without a thread now (WatchTransfers streams, "
      "GetTransfers long polls)",
      [calls = calls_.get()] {
        return std::vector<GaugeSample>{
            {{}, static_cast<double>(calls->waiting())}};
      });
  metrics_->AddGauge("rdma_agentd_ops_in_flight",
                     "Ops of Submits and asynchronous transfers in flight now",
                     [calls = calls_.get()] {
                       return std::vector<GaugeSample>{
                           {{}, static_cast<double>(calls->ops_in_flight())}};
                     });
  metrics_->AddGauge("rdma_agentd_transfers_in_flight",
                     "Asynchronous transfers queued or running now",
                     [transfers = transfers_.get()] {
                       return std::vector<GaugeSample>{
                           {{}, static_cast<double>(transfers->in_flight())}};
                     });
  metrics_->AddGauge("rdma_agentd_remote_handles",
                     "Imported remotes (ImportRemote) kept now, all users",
                     [handles = remote_handles_.get()] {
                       return std::vector<GaugeSample>{
                           {{}, static_cast<double>(handles->size())}};
                     });
  metrics_->AddGauge("rdma_agentd_remote_handle_bytes",
                     "Bytes charged for the imported remotes kept now",
                     [handles = remote_handles_.get()] {
                       return std::vector<GaugeSample>{
                           {{}, static_cast<double>(handles->bytes())}};
                     });
  metrics_->AddGauge("rdma_agentd_prepared_transfers",
                     "Prepared transfers (PrepareTransfer) kept now, all users",
                     [prepared = prepared_transfers_.get()] {
                       return std::vector<GaugeSample>{
                           {{}, static_cast<double>(prepared->size())}};
                     });
  metrics_->AddGauge("rdma_agentd_prepared_transfer_bytes",
                     "Bytes charged for the prepared transfers kept now",
                     [prepared = prepared_transfers_.get()] {
                       return std::vector<GaugeSample>{
                           {{}, static_cast<double>(prepared->bytes())}};
                     });
  metrics_->AddGauge("rdma_agentd_ring_sessions",
                     "Shared-memory ring sessions open now",
                     [rings = rings_.get()] {
                       return std::vector<GaugeSample>{
                           {{}, static_cast<double>(rings->open())}};
                     });
  // The serving side of ops: what requesters did to this agent's buffers.
  const auto served = [backends = registry_.get()](bool bytes) {
    return [backends, bytes] {
      std::vector<GaugeSample> samples;
      for (const auto& backend : backends->backends()) {
        const ServedTotals totals = backend->served();
        samples.push_back(
            {{{"backend", backend->name()}, {"op", "read"}},
             static_cast<double>(bytes ? totals.read_bytes : totals.read_ops)});
        samples.push_back({{{"backend", backend->name()}, {"op", "write"}},
                           static_cast<double>(bytes ? totals.write_bytes
                                                     : totals.write_ops)});
      }
      return samples;
    };
  };
  metrics_->AddCounter(
      "rdma_agentd_served_ops_total",
      "Ops requesters ran against this agent's buffers and it served in "
      "full, by backend and what the requester did (op)",
      served(/*bytes=*/false));
  metrics_->AddCounter("rdma_agentd_served_bytes_total",
                       "Bytes of the ops in rdma_agentd_served_ops_total",
                       served(/*bytes=*/true));
  metrics_->AddCounter(
      "rdma_agentd_notifications_received_total",
      "Notifications peers delivered here, and those dropped because their "
      "owner's queue or a notification budget was full (kind)",
      [inbox = notifications_.get()] {
        return std::vector<GaugeSample>{
            {{{"kind", "delivered"}},
             static_cast<double>(inbox->delivered_total())},
            {{{"kind", "dropped"}},
             static_cast<double>(inbox->dropped_total())}};
      });
  metrics_->AddGauge(
      "rdma_agentd_notifications_held_bytes",
      "Bytes of notifications kept for local owners until read, copies held "
      "for WatchNotifications streams included",
      [inbox = notifications_.get()] {
        return std::vector<GaugeSample>{
            {{}, static_cast<double>(inbox->held_bytes())}};
      });
  // Whoever reaches the endpoint reads these: by uid only when the operator
  // asked (--metrics_per_user), totals otherwise.
  const bool per_user = options_.metrics.per_user;
  const auto usage = [per_user](std::shared_ptr<ResourceQuota> quota) {
    return [quota, per_user] {
      if (!per_user) {
        return std::vector<GaugeSample>{
            {{}, static_cast<double>(quota->used_total())}};
      }
      std::vector<GaugeSample> samples;
      for (const auto& [uid, used] : quota->used_by_user()) {
        samples.push_back(
            {{{"uid", absl::StrCat(uid)}}, static_cast<double>(used)});
      }
      return samples;
    };
  };
  const std::string by_user = per_user ? ", by local user" : "";
  metrics_->AddGauge("rdma_agentd_registrations",
                     "Registrations held" + by_user,
                     usage(quotas_.registrations));
  metrics_->AddGauge("rdma_agentd_registered_bytes",
                     "Bytes registered or attached for registration" + by_user,
                     usage(quotas_.bytes));
  // The limits in force, for "near its limit" alerts.
  const auto limit = [](std::shared_ptr<ResourceQuota> quota) {
    return [quota] {
      return std::vector<GaugeSample>{
          {{}, static_cast<double>(quota->limits().total)}};
    };
  };
  metrics_->AddGauge("rdma_agentd_registrations_limit",
                     "Registrations all users together may hold "
                     "(--max_buffers_total, or derived at start)",
                     limit(quotas_.registrations));
  metrics_->AddGauge("rdma_agentd_registered_bytes_limit",
                     "Bytes all users together may have registered or "
                     "attached (--max_registered_bytes_total, or derived at "
                     "start)",
                     limit(quotas_.bytes));
  // A rail is a NIC port; 0 when its port is not ACTIVE (cable pulled).
  metrics_->AddGauge(
      "rdma_agentd_device_port_up",
      "1 while an RDMA device port a backend uses is ACTIVE, else 0, by "
      "backend, device and port",
      [backends = registry_.get()] {
        std::vector<GaugeSample> samples;
        for (const auto& backend : backends->backends()) {
          for (const v1::DeviceInfo& device :
               backend->transport_info().devices()) {
            samples.push_back({{{"backend", backend->name()},
                                {"device", device.name()},
                                {"port", absl::StrCat(device.port())}},
                               device.state() == "ACTIVE" ? 1.0 : 0.0});
          }
        }
        return samples;
      });
  metrics_->AddGauge("rdma_agentd_watched_clients",
                     "Client processes watched for lifetime-bound "
                     "registrations" +
                         by_user,
                     usage(quotas_.watched_clients));
  metrics_->AddGauge(
      "rdma_agentd_peer_links",
      "Connections (tcp) and queue pairs (ibverbs) held with each peer, by "
      "backend and direction (out: this agent connected); past "
      "--metrics_max_peers per backend and direction, the peers with the "
      "fewest links are summed under peer=\"other\"",
      [backends = registry_.get(), max_peers = options_.metrics.max_peers] {
        std::vector<GaugeSample> samples;
        for (const auto& backend : backends->backends()) {
          if (!backend->available()) continue;
          for (const auto& link : backend->peer_links()) {
            samples.push_back({{{"backend", backend->name()},
                                {"peer", link.peer},
                                {"direction", link.direction}},
                               static_cast<double>(link.count)});
          }
        }
        // Peers are whoever connects, or whatever contexts name: bounded.
        return CapLabelValues(std::move(samples), "peer", max_peers);
      });
}

void Agent::ObservePeerRefusals() {
  buffers_->set_refusal_observer(
      [this](const ServeRequest& request, const absl::Status& status) {
        std::string reason =
            absl::AsciiStrToLower(absl::StatusCodeToString(status.code()));
        metrics_->RecordRefusal(absl::StrCat("peer_", reason));
        if (const auto suppressed = refused_peer_log_.Allow()) {
          // The message never says more than the requester was told.
          spdlog::warn(
              "refused a request from {} for buffer {}: {} ({} similar "
              "suppressed)",
              LogSafe(request.requester), request.buffer_id, status.ToString(),
              *suppressed);
        }
      });
}

}  // namespace rdma_agent

#include "backends/ibverbs/ibverbs_backend.h"

#include <grpc/grpc.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cassert>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/grpc_status.h"
#include "common/log_text.h"
#include "common/random.h"
#include "common/status_util.h"
#include "common/task_pool.h"
#include "spdlog/spdlog.h"

namespace rdma_agent::ibverbs {

// Serves ConnectQueuePair on the agent's Peer listener.
class IbverbsBackend::PeerService : public v1::Peer::Service {
 public:
  explicit PeerService(IbverbsBackend* backend) : backend_(backend) {}

  grpc::Status ConnectQueuePair(
      grpc::ServerContext* context,
      const v1::ConnectQueuePairRequest* request,
      v1::ConnectQueuePairResponse* response) override {
    auto answer = backend_->AcceptQueuePair(*request, context->peer());
    if (!answer.ok()) {
      return ToGrpcStatus(answer.status());
    }
    *response = std::move(*answer);
    return grpc::Status::OK;
  }

  grpc::Status GrantBuffer(grpc::ServerContext* context,
                           const v1::GrantBufferRequest* request,
                           v1::GrantBufferResponse* response) override {
    auto answer = backend_->GrantBuffer(*request, context->peer());
    if (!answer.ok()) {
      return ToGrpcStatus(answer.status());
    }
    *response = std::move(*answer);
    return grpc::Status::OK;
  }

  grpc::Status Notify(grpc::ServerContext* context,
                      const v1::NotifyRequest* request,
                      v1::NotifyResponse*) override {
    return ToGrpcStatus(
        backend_->AcceptNotification(*request, context->peer()));
  }

 private:
  IbverbsBackend* const backend_;
};

namespace {

// Why this backend, and not its owner, initializes gRPC for the process: the
// library shuts itself down when its last object goes, and that shutdown
// waits (up to ~10 s, in iomgr) for a channel to a dead peer that is still
// in reconnect backoff. This backend is the one piece of the agent that
// opens client channels to arbitrary peers (the handshake stubs), and
// several agents come and go in one test process, so the last object to die
// is often one of its stubs. Holding one grpc_init() for the process from
// the first backend created means shutdown never happens mid-process, at
// the cost of gRPC's threads living until exit, which an agent process pays
// anyway. The Agent and main do not need to know about it; a process that
// creates no ibverbs backend never pays for it.
void KeepGrpcAlive() {
  static const bool initialized = [] {
    grpc_init();
    return true;
  }();
  (void)initialized;
}

// One registration's MR in one peer session's PD.
struct Grant {
  // Declared first: the MR is deregistered before its PD can go.
  std::shared_ptr<verbs::ProtectionDomain> pd;
  std::unique_ptr<verbs::MemoryRegion> mr;
};

// The grants of one registration, by session serial. The registration owns
// it; sessions hold it weakly, so either side going drops the grants.
struct GrantTable {
  absl::Mutex mu;
  std::map<uint64_t, Grant> by_session ABSL_GUARDED_BY(mu);
};

// What the backend keeps for one registration: its MR in the main PD (local
// access only: the lkey of this agent's own WRs) and the per-peer grants.
// ibv_dereg_mr of all of them when the registration goes.
class IbverbsRegistration : public BackendRegistration {
 public:
  explicit IbverbsRegistration(std::unique_ptr<verbs::MemoryRegion> mr)
      : mr_(std::move(mr)), grants_(std::make_shared<GrantTable>()) {}
  ~IbverbsRegistration() override {
    // Revokes every peer's access before the memory is unmapped.
    std::map<uint64_t, Grant> dropped;
    absl::MutexLock lock(&grants_->mu);
    dropped.swap(grants_->by_session);
  }
  const verbs::MemoryRegion& mr() const { return *mr_; }
  const std::shared_ptr<GrantTable>& grants() const { return grants_; }

 private:
  std::unique_ptr<verbs::MemoryRegion> mr_;
  std::shared_ptr<GrantTable> grants_;
};

std::string GidBytes(const ibv_gid& gid) {
  return std::string(reinterpret_cast<const char*>(gid.raw), sizeof(gid.raw));
}

const char* PortStateName(ibv_port_state state) {
  switch (state) {
    case IBV_PORT_DOWN:
      return "DOWN";
    case IBV_PORT_INIT:
      return "INIT";
    case IBV_PORT_ARMED:
      return "ARMED";
    case IBV_PORT_ACTIVE:
      return "ACTIVE";
    case IBV_PORT_ACTIVE_DEFER:
      return "ACTIVE_DEFER";
    default:
      return "NOP";
  }
}

v1::BufferGrant MakeGrant(const Registration& registration, uint32_t rkey) {
  v1::BufferGrant grant;
  grant.set_buffer_id(registration.id());
  grant.set_rkey(rkey);
  grant.set_address(reinterpret_cast<uint64_t>(registration.data()));
  grant.set_size_bytes(registration.size());
  return grant;
}

}  // namespace

// One requesting agent's device as this agent serves it: a protection domain
// of its own, the responder QP in it, and an MR in it for each registration
// the peer proved (grants). The QP reaches nothing else: MRs of other
// sessions and of the main PD are in other PDs.
class IbverbsBackend::PeerSession {
 public:
  PeerSession(uint64_t serial, std::string id,
              std::shared_ptr<verbs::ProtectionDomain> pd)
      : serial_(serial), id_(std::move(id)), pd_(std::move(pd)) {}
  ~PeerSession() { Close(); }  // grants, then the QP, then the PD
  PeerSession(const PeerSession&) = delete;
  PeerSession& operator=(const PeerSession&) = delete;

  const std::string& id() const { return id_; }
  verbs::ProtectionDomain* pd() const { return pd_.get(); }
  void set_responder(std::unique_ptr<QueuePairConnection> responder) {
    responder_ = std::move(responder);
  }

  // Registers `registration` in this session's PD with exactly the remote
  // access it allows (once; later calls answer the same rkey).
  // RESOURCE_EXHAUSTED past `limit` grants; UNAVAILABLE once closed.
  absl::StatusOr<v1::BufferGrant> GrantAccess(const Registration& registration,
                                              const IbverbsRegistration& state,
                                              size_t limit) {
    const std::shared_ptr<GrantTable>& table = state.grants();
    absl::MutexLock lock(&mu_);
    if (closed_) {
      return absl::UnavailableError(
          "the queue-pair session was replaced; reconnect");
    }
    {
      absl::MutexLock table_lock(&table->mu);
      auto it = table->by_session.find(serial_);
      if (it != table->by_session.end()) {
        return MakeGrant(registration, it->second.mr->rkey());
      }
    }
    tables_.erase(std::remove_if(tables_.begin(), tables_.end(),
                                 [](const std::weak_ptr<GrantTable>& t) {
                                   return t.expired();
                                 }),
                  tables_.end());
    if (tables_.size() >= limit) {
      return absl::ResourceExhaustedError(
          absl::StrCat("this peer already holds ", tables_.size(),
                       " buffer grants (--ibverbs_max_grants_per_peer)"));
    }
    int access = 0;
    if (registration.readable()) access |= IBV_ACCESS_REMOTE_READ;
    if (registration.writable()) {
      access |= IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
    }
    auto mr =
        pd_->RegisterMemory(registration.data(), registration.size(), access);
    if (!mr.ok()) return mr.status();
    const uint32_t rkey = (*mr)->rkey();
    {
      absl::MutexLock table_lock(&table->mu);
      table->by_session[serial_] = Grant{pd_, std::move(*mr)};
    }
    tables_.push_back(table);
    return MakeGrant(registration, rkey);
  }

  // Live grants.
  size_t grant_count() const {
    absl::MutexLock lock(&mu_);
    size_t live = 0;
    for (const auto& table : tables_) live += !table.expired();
    return live;
  }

  // Drops every grant (their MRs are deregistered); no grant is added after.
  void Close() {
    std::vector<std::weak_ptr<GrantTable>> tables;
    {
      absl::MutexLock lock(&mu_);
      closed_ = true;
      tables.swap(tables_);
    }
    for (const auto& weak : tables) {
      const std::shared_ptr<GrantTable> table = weak.lock();
      if (table == nullptr) continue;  // the registration went first
      Grant dropped;                   // deregistered outside the lock
      absl::MutexLock lock(&table->mu);
      auto it = table->by_session.find(serial_);
      if (it == table->by_session.end()) continue;
      dropped = std::move(it->second);
      table->by_session.erase(it);
    }
  }

 private:
  const uint64_t serial_;
  const std::string id_;
  // Declared before responder_: the QP is destroyed before its PD.
  const std::shared_ptr<verbs::ProtectionDomain> pd_;
  std::unique_ptr<QueuePairConnection> responder_;
  mutable absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  // The grant tables this session has an entry in (lock order: mu_, then a
  // table's mu).
  std::vector<std::weak_ptr<GrantTable>> tables_ ABSL_GUARDED_BY(mu_);
};

// A requester QP just connected, with what the handshake granted.
struct IbverbsBackend::Handshaken {
  std::shared_ptr<QueuePairConnection> connection;
  std::string session;
  uint64_t buffer_id = 0;
  RemoteGrant grant;
};

absl::StatusOr<std::unique_ptr<IbverbsBackend>> IbverbsBackend::Create(
    BackendEnvironment env, IbverbsOptions options,
    std::unique_ptr<verbs::Verbs> verbs) {
  if (options.profile != "auto") {
    auto profile = ProfileByName(options.profile);
    if (!profile.ok()) return profile.status();
  }
  if (options.qp.mtu_bytes) {
    auto mtu = verbs::MtuFromBytes(*options.qp.mtu_bytes);
    if (!mtu.ok()) return mtu.status();
  }
  if (options.qp.sq_depth && *options.qp.sq_depth == 0) {
    return absl::InvalidArgumentError("ibverbs send-queue depth must be > 0");
  }
  std::unique_ptr<IbverbsBackend> backend(
      new IbverbsBackend(std::move(env), std::move(options), std::move(verbs)));
  absl::Status status = backend->Discover();
  if (!status.ok()) {
    backend->unavailable_reason_ = std::string(status.message());
    backend->pd_.reset();
    backend->device_.reset();
  }
  return backend;
}

IbverbsBackend::IbverbsBackend(BackendEnvironment env, IbverbsOptions options,
                               std::unique_ptr<verbs::Verbs> verbs)
    : env_(std::move(env)),
      options_(std::move(options)),
      verbs_(std::move(verbs)),
      service_(std::make_unique<PeerService>(this)),
      posting_pool_(std::make_unique<TaskPool>(kPostingThreads)) {
  KeepGrpcAlive();
}

IbverbsBackend::~IbverbsBackend() {
  // Connections drain and stop their pollers, and sessions drop their
  // grants, before the PD and device go.
  std::map<std::string, std::shared_ptr<QueuePairConnection>> requesters;
  std::map<std::string, std::shared_ptr<PeerSession>> responders;
  {
    absl::MutexLock lock(&mu_);
    requesters.swap(requesters_);
    responders.swap(responders_);
    links_.clear();
  }
}

absl::Status IbverbsBackend::Discover() {
  if (!options_.enabled) {
    return absl::FailedPreconditionError(
        "disabled by configuration (--ibverbs_enable=false)");
  }
  auto names = verbs_->ListDevices();
  if (!names.ok()) return names.status();
  if (names->empty()) {
    return absl::NotFoundError(
        "no RDMA device found (ibv_get_device_list returned none)");
  }
  std::vector<std::string> candidates = *names;
  if (!options_.device.empty()) {
    if (std::find(names->begin(), names->end(), options_.device) ==
        names->end()) {
      return absl::NotFoundError(
          absl::StrCat("RDMA device ", options_.device, " not found (have ",
                       absl::StrJoin(*names, ", "), ")"));
    }
    candidates = {options_.device};
  }
  std::vector<std::string> why;
  for (const std::string& name : candidates) {
    auto device = verbs_->OpenDevice(name);
    if (!device.ok()) {
      why.push_back(std::string(device.status().message()));
      continue;
    }
    auto attr = (*device)->Query();
    if (!attr.ok()) {
      why.push_back(std::string(attr.status().message()));
      continue;
    }
    const int first = options_.port != 0 ? options_.port : 1;
    const int last = options_.port != 0 ? options_.port : attr->phys_port_cnt;
    for (int port = first; port <= last; ++port) {
      auto port_attr = (*device)->QueryPort(static_cast<uint8_t>(port));
      if (!port_attr.ok()) {
        why.push_back(std::string(port_attr.status().message()));
        continue;
      }
      if (port_attr->state != IBV_PORT_ACTIVE) {
        why.push_back(absl::StrCat(name, " port ", port, " is ",
                                   PortStateName(port_attr->state)));
        continue;
      }
      if (options_.profile == "auto") {
        profile_ = DetectProfile(name, *attr);
      } else {
        profile_ = *ProfileByName(options_.profile);
      }
      if (!profile_.unsupported_reason.empty()) {
        return absl::FailedPreconditionError(
            absl::StrCat(name, ": ", profile_.unsupported_reason));
      }
      params_ =
          ResolveParams(profile_.defaults, options_.qp, *attr, *port_attr);
      auto gid =
          (*device)->QueryGid(static_cast<uint8_t>(port), params_.gid_index);
      if (!gid.ok()) {
        return absl::FailedPreconditionError(
            absl::StrCat(name, " port ", port, ": no GID at index ",
                         params_.gid_index, ": ", gid.status().message()));
      }
      auto pd = (*device)->AllocateProtectionDomain();
      if (!pd.ok()) return pd.status();
      device_ = std::move(*device);
      pd_ = std::move(*pd);
      port_attr_ = *port_attr;
      local_.device = device_.get();
      local_.pd = pd_.get();
      local_.port = static_cast<uint8_t>(port);
      local_.lid = port_attr->lid;
      local_.gid = *gid;
      local_.global_routing =
          port_attr->link_layer != IBV_LINK_LAYER_INFINIBAND;
      return absl::OkStatus();
    }
  }
  return absl::NotFoundError(
      absl::StrCat("no usable RDMA port: ", absl::StrJoin(why, "; ")));
}

v1::TransportInfo IbverbsBackend::transport_info() const {
  v1::TransportInfo info;
  if (!available()) return info;
  v1::DeviceInfo* device = info.add_devices();
  device->set_name(device_->name());
  device->set_port(local_.port);
  device->set_link_layer(port_attr_.link_layer == IBV_LINK_LAYER_INFINIBAND
                             ? "InfiniBand"
                             : "Ethernet");
  device->set_state(PortStateName(port_attr_.state));
  device->set_mtu_bytes(verbs::MtuBytes(port_attr_.active_mtu));
  device->set_speed_gbps(verbs::PortSpeedGbps(port_attr_));
  device->set_lid(port_attr_.lid);
  const int gids = std::min<int>(port_attr_.gid_tbl_len, 16);
  for (int i = 0; i < gids; ++i) {
    auto gid = device_->QueryGid(local_.port, i);
    if (!gid.ok()) break;
    static const ibv_gid kZero = {};
    if (std::memcmp(gid->raw, kZero.raw, sizeof(kZero.raw)) == 0) continue;
    device->add_gids(absl::StrCat(i, ":", verbs::GidToString(*gid)));
  }
  device->set_profile(profile_.name);
  device->set_max_message_bytes(params_.max_message_bytes);
  auto& attributes = *info.mutable_attributes();
  attributes["profile"] = profile_.name;
  attributes["gid_index"] = absl::StrCat(params_.gid_index);
  attributes["path_mtu_bytes"] = absl::StrCat(params_.mtu_bytes);
  attributes["sq_depth"] = absl::StrCat(params_.sq_depth);
  attributes["timeout"] = absl::StrCat(params_.timeout);
  attributes["retry_cnt"] = absl::StrCat(params_.retry_cnt);
  attributes["rnr_retry"] = absl::StrCat(params_.rnr_retry);
  attributes["max_rd_atomic"] = absl::StrCat(params_.max_rd_atomic);
  attributes["peer_address"] = peer_address_;
  return info;
}

std::vector<grpc::Service*> IbverbsBackend::peer_services() {
  return {service_.get()};
}

absl::Status IbverbsBackend::Start(const std::string& peer_address) {
  if (available() && peer_address.empty()) {
    return absl::FailedPreconditionError(
        "the ibverbs backend needs a Peer listener serving its "
        "peer_services() for queue-pair handshakes");
  }
  peer_address_ = peer_address;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<BackendRegistration>> IbverbsBackend::Register(
    const Registration& registration, v1::BackendEndpoint* endpoint) {
  if (!available()) {
    return absl::FailedPreconditionError(
        absl::StrCat("ibverbs backend unavailable: ", unavailable_reason_));
  }
  // Local access only: peers reach the memory through MRs in their own
  // session's PD (GrantAccess), never through this one, so nothing that
  // answers this agent's handshakes can use it.
  auto mr = pd_->RegisterMemory(registration.data(), registration.size(),
                                IBV_ACCESS_LOCAL_WRITE);
  if (!mr.ok()) return mr.status();
  v1::IbverbsEndpoint* ib = endpoint->mutable_ibverbs();
  ib->set_device(device_->name());
  ib->set_port(local_.port);
  ib->set_lid(local_.lid);
  ib->set_gid(GidBytes(local_.gid));
  // No rkey: a peer gets one for its own PD in return for the token.
  ib->set_address(reinterpret_cast<uint64_t>(registration.data()));
  ib->set_peer_address(peer_address_);
  ib->set_max_message_bytes(params_.max_message_bytes);
  return std::unique_ptr<BackendRegistration>(
      new IbverbsRegistration(std::move(*mr)));
}

bool IbverbsBackend::CanReach(const v1::RemoteBuffer& remote) const {
  if (!available()) return false;
  const v1::BackendEndpoint* endpoint = FindEndpoint(remote, name_);
  return endpoint != nullptr && endpoint->has_ibverbs() &&
         !endpoint->ibverbs().peer_address().empty() &&
         endpoint->ibverbs().gid().size() == sizeof(ibv_gid);
}

std::shared_ptr<v1::Peer::Stub> IbverbsBackend::StubFor(
    const std::string& address) {
  absl::MutexLock lock(&mu_);
  auto& stub = stubs_[address];
  if (stub == nullptr) {
    grpc::ChannelArguments args;
    std::shared_ptr<grpc::ChannelCredentials> credentials =
        PeerChannelCredentials(env_.peer_tls, &args);
    stub = v1::Peer::NewStub(
        grpc::CreateCustomChannel(address, credentials, args));
  }
  return stub;
}

std::string IbverbsBackend::ConnectionKey(const v1::RemoteBuffer& remote,
                                          const v1::IbverbsEndpoint& endpoint) {
  return absl::StrCat(remote.agent_id(), "/", remote.agent_epoch(), "/",
                      endpoint.device());
}

absl::StatusOr<std::shared_ptr<QueuePairConnection>>
IbverbsBackend::GetConnection(const v1::RemoteBuffer& remote,
                              const v1::IbverbsEndpoint& endpoint,
                              absl::Time deadline) {
  const std::string key = ConnectionKey(remote, endpoint);
  std::shared_ptr<QueuePairConnection>
      stale;  // destroyed (drained) outside mu_
  std::shared_ptr<absl::Mutex> connect_lock;
  {
    absl::MutexLock lock(&mu_);
    auto it = requesters_.find(key);
    if (it != requesters_.end()) {
      if (!it->second->broken()) return it->second;
      stale = std::move(it->second);
      requesters_.erase(it);
      links_.erase(key);
    }
    auto& slot = connect_locks_[key];
    if (slot == nullptr) slot = std::make_shared<absl::Mutex>();
    connect_lock = slot;
  }
  stale.reset();
  absl::MutexLock connecting(connect_lock.get());
  {
    absl::MutexLock lock(&mu_);
    auto it = requesters_.find(key);
    if (it != requesters_.end() && !it->second->broken()) return it->second;
  }
  auto handshaken = Handshake(remote, endpoint, deadline);
  if (!handshaken.ok()) {
    spdlog::warn("ibverbs: connecting to agent {} device {} at {}: {}",
                 LogSafe(remote.agent_id()), LogSafe(endpoint.device()),
                 LogSafe(endpoint.peer_address()),
                 LogSafe(handshaken.status().ToString()));
    return handshaken.status();
  }
  std::shared_ptr<QueuePairConnection> connection = handshaken->connection;
  spdlog::info(
      "ibverbs: connected QP {} to agent {} (epoch {:016x}) device "
      "{} at {}",
      connection->qp_num(), LogSafe(remote.agent_id()), remote.agent_epoch(),
      LogSafe(endpoint.device()), LogSafe(endpoint.peer_address()));
  // The agent answered with this epoch, so QPs to its earlier lives are
  // dead: drop them (destroyed outside mu_).
  std::vector<std::shared_ptr<QueuePairConnection>> dead;
  {
    absl::MutexLock lock(&mu_);
    const std::string agent_prefix = absl::StrCat(remote.agent_id(), "/");
    const std::string epoch_prefix =
        absl::StrCat(agent_prefix, remote.agent_epoch(), "/");
    for (auto it = requesters_.lower_bound(agent_prefix);
         it != requesters_.end() &&
         absl::StartsWith(it->first, agent_prefix);) {
      if (absl::StartsWith(it->first, epoch_prefix)) {
        ++it;
        continue;
      }
      dead.push_back(std::move(it->second));
      connect_locks_.erase(it->first);
      links_.erase(it->first);
      it = requesters_.erase(it);
    }
    requesters_[key] = connection;
    RequesterLink& link = links_[key];
    link.connection = connection;
    link.session = handshaken->session;
    link.grants.clear();
    link.grants[handshaken->buffer_id] = handshaken->grant;
    ++connections_established_;
  }
  dead.clear();
  return connection;
}

absl::StatusOr<IbverbsBackend::Handshaken> IbverbsBackend::Handshake(
    const v1::RemoteBuffer& remote, const v1::IbverbsEndpoint& endpoint,
    absl::Time deadline) {
  // Inbound RDMA refused: whoever answers cannot reach this agent's memory
  // through this QP.
  auto created = QueuePairConnection::Create(
      local_, params_, options_.busy_poll, options_.drain_timeout,
      QueuePairConnection::Inbound::kRefuse);
  if (!created.ok()) return created.status();
  Handshaken result;
  result.connection = std::move(*created);

  v1::ConnectQueuePairRequest request;
  request.set_agent_id(env_.identity.agent_id);
  request.set_agent_epoch(env_.identity.epoch);
  request.set_expected_epoch(remote.agent_epoch());
  request.set_remote_device(endpoint.device());
  *request.mutable_requester() = result.connection->local_endpoint();
  request.set_buffer_id(remote.buffer_id());
  request.set_token(remote.token());
  v1::ConnectQueuePairResponse response;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(
      std::min(deadline, absl::Now() + options_.connect_timeout)));
  const grpc::Status status =
      StubFor(endpoint.peer_address())
          ->ConnectQueuePair(&context, request, &response);
  if (!status.ok()) {
    return Prefixed(
        FromGrpcStatus(status),
        absl::StrCat("queue-pair handshake with agent ", remote.agent_id(),
                     " at ", endpoint.peer_address()));
  }
  if (response.session().empty() ||
      response.grant().buffer_id() != remote.buffer_id()) {
    return absl::UnavailableError(absl::StrCat(
        "queue-pair handshake with agent ", remote.agent_id(), " at ",
        endpoint.peer_address(), ": the answer has no session or grant"));
  }
  absl::Status connected = result.connection->ConnectTo(response.responder());
  if (!connected.ok()) {
    return Prefixed(
        absl::StatusCode::kUnavailable, connected,
        absl::StrCat("connecting the queue pair to ", endpoint.peer_address()));
  }
  result.session = response.session();
  result.buffer_id = remote.buffer_id();
  result.grant.token = remote.token();
  result.grant.rkey = response.grant().rkey();
  result.grant.address = response.grant().address();
  result.grant.size_bytes = response.grant().size_bytes();
  return result;
}

absl::StatusOr<std::shared_ptr<QueuePairConnection>>
IbverbsBackend::ConnectForGroup(absl::Span<const Op> ops,
                                const std::vector<size_t>& indices,
                                absl::Time deadline) {
  // Bounds the handshakes one batch can cost when its proofs are refused.
  constexpr size_t kMaxProofs = 4;
  std::vector<const Op*> tried;
  absl::StatusOr<std::shared_ptr<QueuePairConnection>> connection =
      absl::NotFoundError("no op to connect for");
  for (size_t i : indices) {
    const Op& op = ops[i];
    const bool seen =
        std::any_of(tried.begin(), tried.end(), [&](const Op* other) {
          return other->remote->buffer_id() == op.remote->buffer_id() &&
                 other->remote->token() == op.remote->token();
        });
    if (seen) continue;
    tried.push_back(&op);
    connection = GetConnection(*op.remote, op.endpoint->ibverbs(), deadline);
    // Only a refused proof is worth another op's proof.
    if (connection.ok() ||
        connection.status().code() != absl::StatusCode::kNotFound ||
        tried.size() >= kMaxProofs) {
      break;
    }
  }
  return connection;
}

absl::StatusOr<IbverbsBackend::RemoteGrant> IbverbsBackend::GrantFor(
    const Op& op, const QueuePairConnection& connection,
    const StopToken& stop) {
  const v1::RemoteBuffer& remote = *op.remote;
  const v1::IbverbsEndpoint& endpoint = op.endpoint->ibverbs();
  const std::string key = ConnectionKey(remote, endpoint);
  std::string session;
  {
    absl::MutexLock lock(&mu_);
    auto it = links_.find(key);
    if (it == links_.end() ||
        it->second.connection.lock().get() != &connection) {
      return absl::UnavailableError(
          "the queue pair was replaced while the op was being posted");
    }
    auto grant = it->second.grants.find(remote.buffer_id());
    // The token too: another local user's forged context naming the same
    // buffer id must not ride on a grant earned by a real one.
    if (grant != it->second.grants.end() &&
        TokensEqual(grant->second.token, remote.token())) {
      return grant->second;
    }
    session = it->second.session;
  }
  v1::GrantBufferRequest request;
  request.set_agent_id(env_.identity.agent_id);
  request.set_expected_epoch(remote.agent_epoch());
  request.set_session(session);
  request.set_buffer_id(remote.buffer_id());
  request.set_token(remote.token());
  v1::GrantBufferResponse response;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(
      std::min(stop.deadline(), absl::Now() + options_.connect_timeout)));
  // A cancelled Submit does not wait for a slow peer's answer.
  const auto on_cancel = stop.OnCancel([&context] { context.TryCancel(); });
  const grpc::Status status = StubFor(endpoint.peer_address())
                                  ->GrantBuffer(&context, request, &response);
  if (!status.ok() && stop.cancelled()) {
    return stop.StopStatus("while asking the peer for buffer access");
  }
  if (!status.ok()) {
    return Prefixed(
        FromGrpcStatus(status),
        absl::StrCat("access to a buffer of agent ", remote.agent_id(), " at ",
                     endpoint.peer_address()));
  }
  RemoteGrant grant;
  grant.token = remote.token();
  grant.rkey = response.grant().rkey();
  grant.address = response.grant().address();
  grant.size_bytes = response.grant().size_bytes();
  absl::MutexLock lock(&mu_);
  auto it = links_.find(key);
  if (it != links_.end() && it->second.connection.lock().get() == &connection) {
    it->second.grants[remote.buffer_id()] = grant;
  }
  return grant;
}

absl::StatusOr<v1::ConnectQueuePairResponse> IbverbsBackend::AcceptQueuePair(
    const v1::ConnectQueuePairRequest& request, absl::string_view peer) {
  if (!available()) {
    return absl::UnavailableError(
        absl::StrCat("ibverbs backend unavailable on agent ",
                     env_.identity.agent_id, ": ", unavailable_reason_));
  }
  const v1::QueuePairEndpoint& requester = request.requester();
  if (request.agent_id().empty() || requester.qp_num() == 0 ||
      requester.gid().size() != sizeof(ibv_gid)) {
    return absl::InvalidArgumentError(
        "malformed queue-pair request (agent id, QP number and a 16-byte "
        "GID are required)");
  }
  // Token first: until the proof holds, nothing is allocated and nothing
  // said depends on this agent's epoch, ids or devices.
  ServeRequest proof;
  proof.agent_epoch = request.expected_epoch();
  proof.buffer_id = request.buffer_id();
  proof.token = request.token();
  proof.proof_only = true;
  proof.requester = absl::StrCat("agent ", LogSafe(request.agent_id()),
                                 peer.empty() ? "" : " at ",
                                 LogSafe(peer));
  auto registration = env_.directory->ResolveForPeer(proof);
  // Refusals are logged by the directory's observer, with `peer`.
  if (!registration.ok()) return registration.status();
  if (request.remote_device() != device_->name()) {
    return absl::NotFoundError(absl::StrCat(
        "agent ", env_.identity.agent_id, " has no RDMA device ",
        request.remote_device(), " (it uses ", device_->name(), ")"));
  }
  const auto* state = dynamic_cast<const IbverbsRegistration*>(
      (*registration)->backend_state(name_));
  if (state == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("buffer ", request.buffer_id(),
                     " is not registered with the ibverbs backend"));
  }
  // One session per requester device: a reconnect replaces it.
  const std::string key =
      absl::StrCat(request.agent_id(), "/", requester.device());
  const auto over_bound = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return responders_.count(key) == 0 &&
           responders_.size() >= options_.max_responders;
  };
  const auto exhausted = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    // Bounds the PDs and QPs peers can make this agent allocate.
    return absl::ResourceExhaustedError(absl::StrCat(
        "agent ", env_.identity.agent_id, " already serves ",
        responders_.size(), " peer queue pairs (--ibverbs_max_responders)"));
  };
  uint64_t serial;
  {
    absl::MutexLock lock(&mu_);
    if (over_bound()) return exhausted();
    serial = next_session_serial_++;
  }
  auto pd = device_->AllocateProtectionDomain();
  if (!pd.ok()) return pd.status();
  auto session = std::make_shared<PeerSession>(
      serial, RandomBytes(16),
      std::shared_ptr<verbs::ProtectionDomain>(std::move(*pd)));
  LocalPort port = local_;
  port.pd = session->pd();
  auto created = QueuePairConnection::Create(
      port, params_, options_.busy_poll, options_.drain_timeout,
      QueuePairConnection::Inbound::kAccept);
  if (!created.ok()) return created.status();
  absl::Status connected = (*created)->ConnectTo(requester);
  if (!connected.ok()) return connected;
  v1::ConnectQueuePairResponse response;
  *response.mutable_responder() = (*created)->local_endpoint();
  session->set_responder(std::move(*created));
  auto grant = session->GrantAccess(**registration, *state,
                                    options_.max_grants_per_peer);
  if (!grant.ok()) return grant.status();
  *response.mutable_grant() = *grant;
  response.set_session(session->id());
  std::shared_ptr<PeerSession> replaced = session;
  {
    absl::MutexLock lock(&mu_);
    if (over_bound()) return exhausted();
    responders_[key].swap(replaced);
  }
  spdlog::info("ibverbs: serving agent {} device {} (QP {})",
               LogSafe(request.agent_id()), LogSafe(requester.device()),
               response.responder().qp_num());
  // `replaced` (the peer's previous session) drops its grants, QP and PD.
  return response;
}

std::shared_ptr<IbverbsBackend::PeerSession> IbverbsBackend::FindSession(
    const std::string& id) const {
  absl::MutexLock lock(&mu_);
  std::shared_ptr<PeerSession> found;
  // Compared in constant time and over every session: the handle is the
  // secret that binds grants to a session.
  for (const auto& [key, session] : responders_) {
    if (TokensEqual(session->id(), id)) found = session;
  }
  return found;
}

absl::StatusOr<v1::GrantBufferResponse> IbverbsBackend::GrantBuffer(
    const v1::GrantBufferRequest& request, absl::string_view peer) {
  if (!available()) {
    return absl::UnavailableError(
        absl::StrCat("ibverbs backend unavailable on agent ",
                     env_.identity.agent_id, ": ", unavailable_reason_));
  }
  ServeRequest proof;
  proof.agent_epoch = request.expected_epoch();
  proof.buffer_id = request.buffer_id();
  proof.token = request.token();
  proof.proof_only = true;
  proof.requester = absl::StrCat("peer at ", LogSafe(peer));
  auto registration = env_.directory->ResolveForPeer(proof);
  if (!registration.ok()) return registration.status();
  std::shared_ptr<PeerSession> session =
      request.session().empty() ? nullptr : FindSession(request.session());
  if (session == nullptr) {
    return absl::NotFoundError(
        "no such queue-pair session (replaced or never connected): "
        "reconnect");
  }
  const auto* state = dynamic_cast<const IbverbsRegistration*>(
      (*registration)->backend_state(name_));
  if (state == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("buffer ", request.buffer_id(),
                     " is not registered with the ibverbs backend"));
  }
  auto grant = session->GrantAccess(**registration, *state,
                                    options_.max_grants_per_peer);
  if (!grant.ok()) return grant.status();
  v1::GrantBufferResponse response;
  *response.mutable_grant() = *grant;
  return response;
}

absl::Status IbverbsBackend::Notify(const v1::RemoteBuffer& remote,
                                    const v1::BackendEndpoint& endpoint,
                                    absl::string_view data,
                                    const StopToken& stop) {
  absl::Status stopped = stop.Check("before the notification was sent");
  if (!stopped.ok()) return stopped;
  v1::NotifyRequest request;
  request.set_agent_id(env_.identity.agent_id);
  request.set_expected_epoch(remote.agent_epoch());
  request.set_buffer_id(remote.buffer_id());
  request.set_token(remote.token());
  request.set_data(std::string(data));
  v1::NotifyResponse response;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(
      std::min(stop.deadline(), absl::Now() + options_.connect_timeout)));
  const auto on_cancel = stop.OnCancel([&context] { context.TryCancel(); });
  const std::string& address = endpoint.ibverbs().peer_address();
  const grpc::Status status =
      StubFor(address)->Notify(&context, request, &response);
  if (status.ok()) return absl::OkStatus();
  // Sent, maybe received: the answer is what went missing.
  const bool maybe_delivered =
      status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
      status.error_code() == grpc::StatusCode::CANCELLED ||
      status.error_code() == grpc::StatusCode::UNAVAILABLE;
  absl::Status failed = stop.cancelled()
                            ? stop.StopStatus("while notifying the peer")
                            : FromGrpcStatus(status);
  return Prefixed(
      failed,
      absl::StrCat("notification to agent ", remote.agent_id(), " at ",
                   address,
                   maybe_delivered ? " (it may have arrived all the same)"
                                   : ""));
}

absl::Status IbverbsBackend::AcceptNotification(
    const v1::NotifyRequest& request, absl::string_view peer) {
  if (env_.notifications == nullptr) {
    return absl::UnimplementedError("this agent takes no notifications");
  }
  ServeRequest target;
  target.agent_epoch = request.expected_epoch();
  target.buffer_id = request.buffer_id();
  target.token = request.token();
  target.proof_only = true;
  target.requester = absl::StrCat("agent ", LogSafe(request.agent_id()),
                                  " at ", LogSafe(peer));
  return env_.notifications->Deliver(target, request.agent_id(),
                                     request.data());
}

absl::Status IbverbsBackend::CheckOp(const Op& op) const {
  // Routed here by the registry, which checked CanReach, with both ranges
  // validated (backend.h): nothing of the context is checked again.
  assert(op.endpoint != nullptr && op.endpoint->has_ibverbs());
  // What the posting path casts to: one lookup, so that a registration that
  // bypassed BackendRegistry::RegisterWithAll fails instead of crashing.
  if (dynamic_cast<const IbverbsRegistration*>(
          op.local->backend_state(name_)) == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("local buffer ", op.local->id(),
                     " is not registered with the ibverbs backend"));
  }
  return absl::OkStatus();
}

absl::Status IbverbsBackend::PostOp(const Op& op, size_t index,
                                    QueuePairConnection& connection,
                                    const std::shared_ptr<OpTracker>& tracker,
                                    const StopToken& stop) {
  const v1::IbverbsEndpoint& ib = op.endpoint->ibverbs();
  auto grant = GrantFor(op, connection, stop);
  if (!grant.ok()) return grant.status();
  // The grant is the remote's word on the buffer's real size, which a
  // forged context may overstate: the contract's code rather than the NIC's
  // access error (the remote NIC refuses the WR either way).
  if (absl::Status range =
          CheckRange(op.remote_offset, op.length, grant->size_bytes, "remote");
      !range.ok()) {
    return range;
  }
  const auto& local =
      dynamic_cast<const IbverbsRegistration&>(*op.local->backend_state(name_));
  uint64_t wr_bytes = params_.max_message_bytes;
  if (ib.max_message_bytes() > 0) {
    wr_bytes = std::min<uint64_t>(wr_bytes, ib.max_message_bytes());
  }
  absl::Status posted;
  for (uint64_t done = 0; done < op.length && posted.ok();) {
    const uint64_t n = std::min(wr_bytes, op.length - done);
    ibv_sge sge = {};
    sge.addr =
        reinterpret_cast<uint64_t>(op.local->data() + op.local_offset + done);
    sge.length = static_cast<uint32_t>(n);
    sge.lkey = local.mr().lkey();
    ibv_send_wr wr = {};
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = op.reads_into_local() ? IBV_WR_RDMA_READ : IBV_WR_RDMA_WRITE;
    wr.wr.rdma.remote_addr = grant->address + op.remote_offset + done;
    wr.wr.rdma.rkey = grant->rkey;
    posted = connection.Post(wr, tracker, index, op.local, stop);
    done += n;
  }
  return posted;
}

std::vector<absl::Status> IbverbsBackend::Submit(absl::Span<const Op> ops,
                                                 const StopToken& stop) {
  const absl::Time deadline = stop.deadline();
  auto tracker = std::make_shared<OpTracker>(ops.size());
  // A cancellation ends the wait for completions below; the QPs are then
  // moved to ERR and drained exactly as at the deadline.
  const auto on_cancel = stop.OnCancel([tracker] { tracker->Interrupt(); });
  // Ops grouped by the QP they go through, each group in batch order.
  std::map<std::string, std::vector<size_t>> groups;
  for (size_t i = 0; i < ops.size(); ++i) {
    absl::Status checked = stop.Check("before posting");
    if (checked.ok()) checked = CheckOp(ops[i]);
    if (!checked.ok()) {
      tracker->PostingFinished(i, checked);
      continue;
    }
    groups[ConnectionKey(*ops[i].remote, ops[i].endpoint->ibverbs())].push_back(
        i);
  }

  absl::Mutex used_mu;
  std::vector<std::shared_ptr<QueuePairConnection>> used;
  // Connects (if needed) and posts one group. Groups run concurrently, so
  // a full send queue or a slow handshake with one peer does not hold up
  // the others.
  const auto run_group = [&](const std::vector<size_t>& indices) {
    auto connection = ConnectForGroup(ops, indices, deadline);
    if (!connection.ok()) {
      for (size_t i : indices) tracker->PostingFinished(i, connection.status());
      return;
    }
    {
      absl::MutexLock lock(&used_mu);
      used.push_back(*connection);
    }
    for (size_t i : indices) {
      tracker->PostingFinished(
          i, stop.cancelled() ? stop.StopStatus("before posting")
                              : PostOp(ops[i], i, **connection, tracker, stop));
    }
  };
  std::vector<std::function<void()>> postings;
  for (const auto& [key, indices] : groups) {
    postings.push_back([&run_group, &indices = indices] { run_group(indices); });
  }
  posting_pool_->RunAll(postings);

  if (!tracker->WaitAllDone(deadline)) {
    // Out of time (or cancelled) with WRs on the wire: the QPs carrying them
    // go to ERR and are drained, so no WR of this batch touches memory after
    // we return.
    const std::vector<size_t> late = tracker->NotDone();
    bool drained = true;
    for (const auto& connection : used) {
      if (connection->outstanding() == 0) continue;
      drained &= connection->MoveToErrorAndDrain(options_.drain_timeout);
    }
    if (drained) drained = tracker->WaitAllDone(absl::Now());
    if (!drained) {
      // Not seen with a working device. The WRs still pin their local
      // registrations, so memory stays mapped whatever the NIC does.
      spdlog::error(
          "ibverbs: a queue pair moved to ERROR did not flush "
          "within {}",
          absl::FormatDuration(options_.drain_timeout));
    }
    const bool cancelled = stop.cancelled();
    spdlog::warn(
        "ibverbs: {} with {} op(s) in flight; queue pair(s) moved to ERROR "
        "and drained",
        cancelled ? "batch cancelled" : "deadline passed", late.size());
    const std::string what =
        drained ? "with RDMA work requests in flight; the queue pair was "
                  "moved to ERROR and drained"
                : "with RDMA work requests in flight; the queue pair was "
                  "moved to ERROR but did not drain";
    const absl::Status cut = stop.StopStatus(what);
    for (size_t i : late) {
      tracker->Override(
          i, cancelled ? absl::Status(cut.code(),
                                      absl::StrCat(cut.message(), " ", what))
                       : cut);
    }
  }
  std::vector<absl::Status> results = tracker->Results();
  for (size_t i = 0; i < ops.size(); ++i) {
    if (results[i].ok()) {
      ops[i].local->CountMoved(ops[i].length);
    }
  }
  return results;
}

uint64_t IbverbsBackend::connections_established() const {
  absl::MutexLock lock(&mu_);
  return connections_established_;
}

size_t IbverbsBackend::requester_count() const {
  absl::MutexLock lock(&mu_);
  return requesters_.size();
}

std::vector<Backend::PeerLinks> IbverbsBackend::peer_links() const {
  absl::MutexLock lock(&mu_);
  // Keys are "agent/epoch/device" (out) and "agent/device" (in); a peer's
  // epoch is no label worth a new time series per restart.
  std::map<std::string, size_t> out;
  for (const auto& [key, connection] : requesters_) {
    const size_t first = key.find('/');
    const size_t last = key.rfind('/');
    ++out[first == std::string::npos || first == last
              ? key
              : key.substr(0, first) + key.substr(last)];
  }
  std::vector<PeerLinks> links;
  for (const auto& [peer, count] : out) links.push_back({peer, "out", count});
  for (const auto& [key, session] : responders_) {
    links.push_back({key, "in", 1});
  }
  return links;
}

size_t IbverbsBackend::responder_count() const {
  absl::MutexLock lock(&mu_);
  return responders_.size();
}

size_t IbverbsBackend::grant_count() const {
  absl::MutexLock lock(&mu_);
  size_t grants = 0;
  for (const auto& [key, session] : responders_) {
    grants += session->grant_count();
  }
  return grants;
}

uint32_t IbverbsBackend::local_key(const Registration& registration) const {
  const auto* state = dynamic_cast<const IbverbsRegistration*>(
      registration.backend_state(name_));
  return state == nullptr ? 0 : state->mr().lkey();
}

}  // namespace rdma_agent::ibverbs

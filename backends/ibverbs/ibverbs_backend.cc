#include "backends/ibverbs/ibverbs_backend.h"

#include <grpc/grpc.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/net_address.h"
#include "spdlog/spdlog.h"

namespace rdma_agent {

// Serves ConnectQueuePair on the agent's Peer listener.
class IbverbsBackend::PeerService : public v1::Peer::Service {
 public:
  explicit PeerService(IbverbsBackend* backend) : backend_(backend) {}

  grpc::Status ConnectQueuePair(
      grpc::ServerContext* /*context*/,
      const v1::ConnectQueuePairRequest* request,
      v1::ConnectQueuePairResponse* response) override {
    auto answer = backend_->AcceptQueuePair(*request);
    if (!answer.ok()) {
      return grpc::Status(static_cast<grpc::StatusCode>(answer.status().code()),
                          std::string(answer.status().message()));
    }
    *response = std::move(*answer);
    return grpc::Status::OK;
  }

 private:
  IbverbsBackend* const backend_;
};

namespace {

// gRPC shuts itself down when its last object goes, and that shutdown
// blocks for seconds while a channel to a dead peer is in reconnect backoff
// (seen as ~10 s agent shutdowns). Backends come and go (tests run many
// agents per process), so the library is kept up for the process's life.
void KeepGrpcAlive() {
  static const bool initialized = [] {
    grpc_init();
    return true;
  }();
  (void)initialized;
}

// The MR of one registration; ibv_dereg_mr when the registration goes.
class IbverbsRegistration : public BackendRegistration {
 public:
  explicit IbverbsRegistration(std::unique_ptr<verbs::MemoryRegion> mr)
      : mr_(std::move(mr)) {}
  const verbs::MemoryRegion& mr() const { return *mr_; }

 private:
  std::unique_ptr<verbs::MemoryRegion> mr_;
};

std::string GidBytes(const ibv_gid& gid) {
  return std::string(reinterpret_cast<const char*>(gid.raw), sizeof(gid.raw));
}

absl::Status FromGrpc(const grpc::Status& status, absl::string_view what) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat(what, ": ", status.error_message()));
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

}  // namespace

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
      service_(std::make_unique<PeerService>(this)) {
  KeepGrpcAlive();
}

IbverbsBackend::~IbverbsBackend() {
  // No handshake may run into a backend being destroyed.
  if (own_server_ != nullptr) own_server_->Shutdown();
  // Connections drain and stop their pollers before the PD and device go.
  std::map<std::string, std::shared_ptr<Connection>> requesters;
  std::map<std::string, std::unique_ptr<Connection>> responders;
  {
    absl::MutexLock lock(&mu_);
    requesters.swap(requesters_);
    responders.swap(responders_);
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
  if (!peer_address.empty()) peer_address_ = peer_address;
  if (!available() || !peer_address_.empty()) return absl::OkStatus();
  const std::string host =
      env_.advertise_host.empty() || IsWildcardHost(env_.advertise_host)
          ? "127.0.0.1"
          : env_.advertise_host;
  own_service_ = std::make_unique<PeerService>(this);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(JoinHostPort(host, 0),
                           grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(own_service_.get());
  own_server_ = builder.BuildAndStart();
  if (own_server_ == nullptr || port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen for queue-pair handshakes on ", host));
  }
  peer_address_ = JoinHostPort(host, static_cast<uint16_t>(port));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<BackendRegistration>> IbverbsBackend::Register(
    const Registration& registration, v1::BackendEndpoint* endpoint) {
  if (!available()) {
    return absl::FailedPreconditionError(
        absl::StrCat("ibverbs backend unavailable: ", unavailable_reason_));
  }
  int access = IBV_ACCESS_LOCAL_WRITE;
  if (registration.readable()) access |= IBV_ACCESS_REMOTE_READ;
  if (registration.writable()) access |= IBV_ACCESS_REMOTE_WRITE;
  auto mr =
      pd_->RegisterMemory(registration.data(), registration.size(), access);
  if (!mr.ok()) return mr.status();
  v1::IbverbsEndpoint* ib = endpoint->mutable_ibverbs();
  ib->set_device(device_->name());
  ib->set_port(local_.port);
  ib->set_lid(local_.lid);
  ib->set_gid(GidBytes(local_.gid));
  ib->set_rkey((*mr)->rkey());
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
    stub = v1::Peer::NewStub(
        grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  }
  return stub;
}

std::string IbverbsBackend::ConnectionKey(const v1::RemoteBuffer& remote,
                                          const v1::IbverbsEndpoint& endpoint) {
  return absl::StrCat(remote.agent_id(), "/", remote.agent_epoch(), "/",
                      endpoint.device());
}

absl::StatusOr<std::shared_ptr<Connection>> IbverbsBackend::GetConnection(
    const v1::RemoteBuffer& remote, const v1::IbverbsEndpoint& endpoint,
    absl::Time deadline) {
  const std::string key = ConnectionKey(remote, endpoint);
  std::shared_ptr<Connection> stale;  // destroyed (drained) outside mu_
  std::shared_ptr<absl::Mutex> connect_lock;
  {
    absl::MutexLock lock(&mu_);
    auto it = requesters_.find(key);
    if (it != requesters_.end()) {
      if (!it->second->broken()) return it->second;
      stale = std::move(it->second);
      requesters_.erase(it);
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
  auto connection = Handshake(remote, endpoint, deadline);
  if (!connection.ok()) {
    spdlog::warn("ibverbs: connecting to agent {} device {} at {}: {}",
                 remote.agent_id(), endpoint.device(), endpoint.peer_address(),
                 connection.status().ToString());
    return connection.status();
  }
  spdlog::info(
      "ibverbs: connected QP {} to agent {} (epoch {:016x}) device "
      "{} at {}",
      (*connection)->qp_num(), remote.agent_id(), remote.agent_epoch(),
      endpoint.device(), endpoint.peer_address());
  // The agent answered with this epoch, so QPs to its earlier lives are
  // dead: drop them (destroyed outside mu_).
  std::vector<std::shared_ptr<Connection>> dead;
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
      it = requesters_.erase(it);
    }
    requesters_[key] = *connection;
    ++connections_established_;
  }
  dead.clear();
  return connection;
}

absl::StatusOr<std::shared_ptr<Connection>> IbverbsBackend::Handshake(
    const v1::RemoteBuffer& remote, const v1::IbverbsEndpoint& endpoint,
    absl::Time deadline) {
  auto created = Connection::Create(local_, params_, options_.busy_poll,
                                    options_.drain_timeout);
  if (!created.ok()) return created.status();
  std::shared_ptr<Connection> connection = std::move(*created);

  v1::ConnectQueuePairRequest request;
  request.set_agent_id(env_.identity.agent_id);
  request.set_agent_epoch(env_.identity.epoch);
  request.set_expected_epoch(remote.agent_epoch());
  request.set_remote_device(endpoint.device());
  *request.mutable_requester() = connection->local_endpoint();
  v1::ConnectQueuePairResponse response;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(
      std::min(deadline, absl::Now() + options_.connect_timeout)));
  const grpc::Status status =
      StubFor(endpoint.peer_address())
          ->ConnectQueuePair(&context, request, &response);
  if (!status.ok()) {
    return FromGrpc(status, absl::StrCat("queue-pair handshake with agent ",
                                         remote.agent_id(), " at ",
                                         endpoint.peer_address()));
  }
  absl::Status connected = connection->ConnectTo(response.responder());
  if (!connected.ok()) {
    return absl::UnavailableError(absl::StrCat("connecting the queue pair to ",
                                               endpoint.peer_address(), ": ",
                                               connected.message()));
  }
  return connection;
}

absl::StatusOr<v1::ConnectQueuePairResponse> IbverbsBackend::AcceptQueuePair(
    const v1::ConnectQueuePairRequest& request) {
  if (!available()) {
    return absl::UnavailableError(
        absl::StrCat("ibverbs backend unavailable on agent ",
                     env_.identity.agent_id, ": ", unavailable_reason_));
  }
  // Never the current epoch: a stranger must not learn it.
  if (request.expected_epoch() != env_.identity.epoch) {
    return StaleContextError();
  }
  if (request.remote_device() != device_->name()) {
    return absl::NotFoundError(absl::StrCat(
        "agent ", env_.identity.agent_id, " has no RDMA device ",
        request.remote_device(), " (it uses ", device_->name(), ")"));
  }
  const v1::QueuePairEndpoint& requester = request.requester();
  if (request.agent_id().empty() || requester.qp_num() == 0 ||
      requester.gid().size() != sizeof(ibv_gid)) {
    return absl::InvalidArgumentError(
        "malformed queue-pair request (agent id, QP number and a 16-byte "
        "GID are required)");
  }
  auto created = Connection::Create(local_, params_, options_.busy_poll,
                                    options_.drain_timeout);
  if (!created.ok()) return created.status();
  absl::Status connected = (*created)->ConnectTo(requester);
  if (!connected.ok()) return connected;
  v1::ConnectQueuePairResponse response;
  *response.mutable_responder() = (*created)->local_endpoint();
  // One responder QP per requester QP source: a reconnect replaces it.
  const std::string key =
      absl::StrCat(request.agent_id(), "/", requester.device());
  std::unique_ptr<Connection> replaced = std::move(*created);
  {
    absl::MutexLock lock(&mu_);
    if (responders_.count(key) == 0 &&
        responders_.size() >= options_.max_responders) {
      // Bounds what unauthenticated peers can make this agent allocate.
      return absl::ResourceExhaustedError(absl::StrCat(
          "agent ", env_.identity.agent_id, " already serves ",
          responders_.size(), " queue pairs (--ibverbs_max_responders)"));
    }
    responders_[key].swap(replaced);
  }
  return response;
}

absl::Status IbverbsBackend::CheckOp(const Op& op) const {
  const v1::BackendEndpoint* endpoint = FindEndpoint(*op.remote, name_);
  if (endpoint == nullptr || !endpoint->has_ibverbs()) {
    return absl::InvalidArgumentError("remote context has no ibverbs endpoint");
  }
  if (dynamic_cast<const IbverbsRegistration*>(
          op.local->backend_state(name_)) == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("local buffer ", op.local->id(),
                     " is not registered with the ibverbs backend"));
  }
  // One-sided ops bypass the remote CPU: check here what the context tells
  // (the remote NIC checks keys and bounds again).
  absl::Status range = CheckRange(op.remote_offset, op.length,
                                  op.remote->size_bytes(), "remote");
  if (range.ok()) {
    range = CheckRange(op.local_offset, op.length, op.local->size(), "local");
  }
  const uint64_t address = endpoint->ibverbs().address();
  if (range.ok() && address + op.remote_offset < address) {
    range = absl::OutOfRangeError("remote address overflows");
  }
  return range;
}

absl::Status IbverbsBackend::PostOp(const Op& op, size_t index,
                                    Connection& connection,
                                    const std::shared_ptr<OpTracker>& tracker,
                                    const StopToken& stop) const {
  const v1::IbverbsEndpoint& ib = FindEndpoint(*op.remote, name_)->ibverbs();
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
    wr.wr.rdma.remote_addr = ib.address() + op.remote_offset + done;
    wr.wr.rdma.rkey = ib.rkey();
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
    groups[ConnectionKey(*ops[i].remote,
                         FindEndpoint(*ops[i].remote, name_)->ibverbs())]
        .push_back(i);
  }

  absl::Mutex used_mu;
  std::vector<std::shared_ptr<Connection>> used;
  // Connects (if needed) and posts one group. Groups run concurrently, so
  // a full send queue or a slow handshake with one peer does not hold up
  // the others.
  const auto run_group = [&](const std::vector<size_t>& indices) {
    const Op& first = ops[indices.front()];
    auto connection = GetConnection(
        *first.remote, FindEndpoint(*first.remote, name_)->ibverbs(), deadline);
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
  if (groups.size() == 1) {
    run_group(groups.begin()->second);
  } else if (groups.size() > 1) {
    std::vector<std::thread> posters;
    for (const auto& [key, indices] : groups) {
      posters.emplace_back(
          [&run_group, &indices = indices] { run_group(indices); });
    }
    for (std::thread& poster : posters) poster.join();
  }

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

size_t IbverbsBackend::responder_count() const {
  absl::MutexLock lock(&mu_);
  return responders_.size();
}

}  // namespace rdma_agent

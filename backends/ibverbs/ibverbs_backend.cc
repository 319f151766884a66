#include "backends/ibverbs/ibverbs_backend.h"

#include <grpc/grpc.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <cassert>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "backends/ibverbs/registration_state.h"
#include "backends/ibverbs/requester.h"
#include "backends/peer_tls.h"
#include "common/grpc_status.h"
#include "common/log_text.h"
#include "common/random.h"
#include "common/status_util.h"
#include "spdlog/spdlog.h"

namespace rdma_agent::ibverbs {

// Serves ConnectQueuePair on the agent's Peer listener.
class IbverbsBackend::PeerService : public v1::Peer::Service {
 public:
  explicit PeerService(IbverbsBackend* backend) : backend_(backend) {}

  grpc::Status ConnectQueuePair(
      grpc::ServerContext* context, const v1::ConnectQueuePairRequest* request,
      v1::ConnectQueuePairResponse* response) override {
    if (absl::Status claimed = CheckClaim(*context, request->agent_id());
        !claimed.ok()) {
      return ToGrpcStatus(claimed);
    }
    auto answer =
        backend_->AcceptQueuePair(*request, PeerCallerAddress(context->peer()));
    if (!answer.ok()) {
      return ToGrpcStatus(answer.status());
    }
    *response = std::move(*answer);
    return grpc::Status::OK;
  }

  grpc::Status GrantBuffer(grpc::ServerContext* context,
                           const v1::GrantBufferRequest* request,
                           v1::GrantBufferResponse* response) override {
    if (absl::Status claimed = CheckClaim(*context, request->agent_id());
        !claimed.ok()) {
      return ToGrpcStatus(claimed);
    }
    auto answer =
        backend_->GrantBuffer(*request, PeerCallerAddress(context->peer()));
    if (!answer.ok()) {
      return ToGrpcStatus(answer.status());
    }
    *response = std::move(*answer);
    return grpc::Status::OK;
  }

  grpc::Status Notify(grpc::ServerContext* context,
                      const v1::NotifyRequest* request,
                      v1::NotifyResponse*) override {
    if (absl::Status claimed = CheckClaim(*context, request->agent_id());
        !claimed.ok()) {
      return ToGrpcStatus(claimed);
    }
    return ToGrpcStatus(backend_->AcceptNotification(
        *request, PeerCallerAddress(context->peer())));
  }

 private:
  // Under mutual TLS the caller is the agent its certificate names, before
  // anything else is looked at; the refusal is logged here, once.
  absl::Status CheckClaim(const grpc::ServerContext& context,
                          const std::string& agent_id) const {
    absl::Status claimed = CheckPeerAgentId(backend_->env_.peer_tls,
                                            *context.auth_context(), agent_id);
    if (!claimed.ok()) {
      spdlog::warn("ibverbs: refused a Peer call from {}: {}",
                   LogSafe(PeerCallerAddress(context.peer())),
                   LogSafe(claimed.message()));
    }
    return claimed;
  }

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

// Writes `affinity` into a context listing `advertised` rails: which of
// them are near (indices into the context's rails) only when some are not
// (a context without affinity is what it was before), the node when it is
// known. When no advertised rail is near (the near ones are down), none is
// named: the peer uses them all.
void AdvertiseAffinity(const RailAffinity& affinity,
                       const std::vector<const Rail*>& advertised,
                       v1::IbverbsEndpoint& ib) {
  if (affinity.numa_node >= 0) ib.set_numa_node(affinity.numa_node);
  if (ib.rails_size() < 2) return;
  std::vector<uint32_t> near;
  for (size_t i = 0; i < advertised.size(); ++i) {
    if (affinity.near_rails[advertised[i]->index]) {
      near.push_back(static_cast<uint32_t>(i));
    }
  }
  if (near.size() == advertised.size()) return;
  for (uint32_t index : near) ib.add_near_rails(index);
  if (affinity.near_rails_only) ib.set_near_rails_only(true);
}

std::string GidBytes(const ibv_gid& gid) {
  return std::string(reinterpret_cast<const char*>(gid.raw), sizeof(gid.raw));
}

v1::BufferGrant MakeGrant(const Registration& registration, uint32_t rkey) {
  v1::BufferGrant grant;
  grant.set_buffer_id(registration.id());
  grant.set_rkey(rkey);
  grant.set_address(MrAddress(registration));
  grant.set_size_bytes(registration.size());
  return grant;
}

}  // namespace

// One requesting agent's rail as one rail of this agent serves it: a
// protection domain of its own on this agent's device, the responder QP in
// it, and an MR in it for each registration the peer proved (grants). The
// QP reaches nothing else: MRs of other sessions and of the main PD are in
// other PDs. Named by `secret`, the handle this agent issued: whoever
// presents it is the session's peer, whatever agent id it claims.
class IbverbsBackend::PeerSession {
 public:
  PeerSession(uint64_t serial, std::string secret, std::string source,
              std::string peer, std::shared_ptr<verbs::ProtectionDomain> pd)
      : serial_(serial),
        secret_(std::move(secret)),
        source_(std::move(source)),
        peer_(std::move(peer)),
        pd_(std::move(pd)) {
    Touch();
  }
  ~PeerSession() { Close(); }  // grants, then the QP, then the PD
  PeerSession(const PeerSession&) = delete;
  PeerSession& operator=(const PeerSession&) = delete;

  const std::string& secret() const { return secret_; }
  // The caller's address without its port (PeerSourceAddress).
  const std::string& source() const { return source_; }
  // "agent/device" the requesting rail claimed, for metrics.
  const std::string& peer() const { return peer_; }
  verbs::ProtectionDomain* pd() const { return pd_.get(); }
  void set_responder(std::unique_ptr<QueuePairConnection> responder) {
    responder_ = std::move(responder);
  }

  // A Peer call named the session now.
  void Touch() { last_used_ = absl::ToUnixNanos(absl::Now()); }
  // Unused for longer than `timeout` (never, when it is zero) at `now`, or
  // admitted by no live registration any more.
  bool Expired(absl::Time now, absl::Duration timeout) const {
    if (timeout > absl::ZeroDuration() &&
        now - absl::FromUnixNanos(last_used_.load()) > timeout) {
      return true;
    }
    return grant_count() == 0;
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
    auto mr = RegisterIn(*pd_, registration, access);
    if (!mr.ok()) return mr.status();
    const uint32_t rkey = (*mr)->rkey();
    {
      absl::MutexLock table_lock(&table->mu);
      table->by_session[serial_] = Grant{pd_, std::move(*mr)};
    }
    tables_.push_back(table);
    return MakeGrant(registration, rkey);
  }

  // Live grants: one per registration proven for the session and still
  // registered.
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
  const std::string secret_;
  const std::string source_;
  const std::string peer_;
  // Unix nanoseconds of the last Peer call naming the session.
  std::atomic<int64_t> last_used_{0};
  // Declared before responder_: the QP is destroyed before its PD.
  const std::shared_ptr<verbs::ProtectionDomain> pd_;
  std::unique_ptr<QueuePairConnection> responder_;
  mutable absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  // The grant tables this session has an entry in (lock order: mu_, then a
  // table's mu).
  std::vector<std::weak_ptr<GrantTable>> tables_ ABSL_GUARDED_BY(mu_);
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
    backend->rails_.clear();
    backend->devices_.clear();
  } else {
    backend->WatchPorts();
    backend->StartSweeper();
  }
  return backend;
}

IbverbsBackend::IbverbsBackend(BackendEnvironment env, IbverbsOptions options,
                               std::unique_ptr<verbs::Verbs> verbs)
    : env_(std::move(env)),
      options_(std::move(options)),
      verbs_(std::move(verbs)),
      topology_(NumaTopology::Load(options_.sysfs_root)),
      memory_locator_(options_.memory_locator != nullptr
                          ? options_.memory_locator
                          : MakeKernelMemoryNodeLocator()),
      service_(std::make_unique<PeerService>(this)),
      requester_(std::make_unique<Requester>(env_, options_, rails_, name_)) {
  KeepGrpcAlive();
}

IbverbsBackend::~IbverbsBackend() {
  StopSweeper();
  // Port events update rails: their threads go before the rails do (all
  // asked first, so that they stop together).
  for (const auto& device : devices_) {
    if (device->port_watcher != nullptr) device->port_watcher->RequestStop();
  }
  for (const auto& device : devices_) device->port_watcher.reset();
  // Lanes' connections drain and stop their pollers, and sessions drop their
  // grants, before the PDs and devices go.
  requester_.reset();
  std::map<std::string, std::shared_ptr<PeerSession>> responders;
  {
    absl::MutexLock lock(&mu_);
    responders.swap(responders_);
  }
  responders.clear();
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
  std::vector<std::string> selected = *names;
  if (!options_.devices.empty()) {
    for (const std::string& name : options_.devices) {
      if (std::find(names->begin(), names->end(), name) == names->end()) {
        return absl::NotFoundError(
            absl::StrCat("RDMA device ", name, " not found (have ",
                         absl::StrJoin(*names, ", "), ")"));
      }
    }
    selected = options_.devices;
  }
  std::vector<std::string> why;
  for (const std::string& name : selected) {
    auto device = verbs_->OpenDevice(name);
    if (!device.ok()) {
      why.push_back(std::string(device.status().message()));
      continue;
    }
    absl::Status added = AddRails(std::move(*device), why);
    if (!added.ok()) return added;
  }
  // Available when a port is ACTIVE now: contexts need a rail peers can
  // reach. The others join when they come up.
  const bool any_active =
      std::any_of(rails_.begin(), rails_.end(), [](const auto& rail) {
        absl::MutexLock lock(&rail->mu);
        return rail->port_active;
      });
  if (!any_active) {
    return absl::NotFoundError(
        absl::StrCat("no usable RDMA port: ", absl::StrJoin(why, "; ")));
  }
  return absl::OkStatus();
}

void IbverbsBackend::WatchPorts() {
  for (const auto& device : devices_) {
    RailDevice* holder = device.get();
    holder->port_watcher = std::make_unique<PortWatcher>(
        holder->device.get(), [this, holder](uint8_t port, bool active) {
          OnPortEvent(*holder, port, active);
        });
  }
}

void IbverbsBackend::OnPortEvent(const RailDevice& device, uint8_t port,
                                 bool active) {
  const absl::Time now = absl::Now();
  for (const auto& rail : rails_) {
    if (rail->device != &device || rail->local.port != port) continue;
    absl::MutexLock lock(&rail->mu);
    rail->port_checked = now;
    if (active) {
      // In use again at once when it never failed (a port that came up
      // after the start); after a failure, once its cooldown ran out, so a
      // flapping link keeps backing off.
      rail->port_active = true;
      spdlog::info("ibverbs: rail {} port is ACTIVE (port event): {}",
                   rail->name,
                   rail->health.cooling(now) ? "in use once its cooldown ends"
                                             : "in use");
      continue;
    }
    rail->port_active = false;
    if (!rail->health.cooling(now)) {
      rail->health.Fail(now, options_.rail_cooldown, options_.rail_max_cooldown,
                        "port went down (IBV_EVENT_PORT_ERR)");
    }
    spdlog::warn("ibverbs: rail {} port went down (port event): left out",
                 rail->name);
  }
}

absl::Status IbverbsBackend::AddRails(std::unique_ptr<verbs::Device> device,
                                      std::vector<std::string>& why) {
  const std::string name = device->name();
  auto attr = device->Query();
  if (!attr.ok()) {
    why.push_back(std::string(attr.status().message()));
    return absl::OkStatus();
  }
  const DeviceProfile profile = options_.profile == "auto"
                                    ? DetectProfile(name, *attr)
                                    : *ProfileByName(options_.profile);
  if (!profile.unsupported_reason.empty()) {
    why.push_back(absl::StrCat(name, ": ", profile.unsupported_reason));
    return absl::OkStatus();
  }
  auto holder = std::make_unique<RailDevice>();
  const int first = options_.port != 0 ? options_.port : 1;
  const int last = options_.port != 0 ? options_.port : attr->phys_port_cnt;
  std::vector<std::unique_ptr<Rail>> rails;
  for (int port = first; port <= last; ++port) {
    auto port_attr = device->QueryPort(static_cast<uint8_t>(port));
    if (!port_attr.ok()) {
      why.push_back(std::string(port_attr.status().message()));
      continue;
    }
    // A port that is not ACTIVE is a rail all the same: it carries bytes
    // once its port comes up (a port event, or a look at planning).
    const bool active = port_attr->state == IBV_PORT_ACTIVE;
    if (!active) {
      why.push_back(absl::StrCat(name, " port ", port, " is ",
                                 verbs::PortStateName(port_attr->state)));
    }
    auto rail = std::make_unique<Rail>();
    rail->name = absl::StrCat(name, ":", port);
    rail->device = holder.get();
    rail->profile = profile;
    rail->params =
        ResolveParams(profile.defaults, options_.qp, *attr, *port_attr);
    auto gid =
        device->QueryGid(static_cast<uint8_t>(port), rail->params.gid_index);
    if (!gid.ok()) {
      why.push_back(absl::StrCat(name, " port ", port, ": no GID at index ",
                                 rail->params.gid_index, ": ",
                                 gid.status().message()));
      continue;
    }
    rail->port_attr = *port_attr;
    rail->speed_gbps = verbs::PortSpeedGbps(*port_attr);
    // The sysfs root's word (a test's tree, or /sys), else the device's.
    rail->numa_node = topology_.RdmaDeviceNode(name);
    if (rail->numa_node < 0) rail->numa_node = device->NumaNode();
    rail->pci_path = topology_.RdmaDevicePciPath(name);
    rail->local.port = static_cast<uint8_t>(port);
    rail->local.lid = port_attr->lid;
    rail->local.gid = *gid;
    rail->local.global_routing =
        port_attr->link_layer != IBV_LINK_LAYER_INFINIBAND;
    {
      absl::MutexLock lock(&rail->mu);
      rail->port_active = active;
    }
    rails.push_back(std::move(rail));
  }
  if (rails.empty()) return absl::OkStatus();
  // One PD for the device's ports: an MR of it serves WRs on any of them.
  auto pd = device->AllocateProtectionDomain();
  if (!pd.ok()) return pd.status();
  holder->index = devices_.size();
  holder->device = std::move(device);
  holder->pd = std::move(*pd);
  // One polling thread per CQ of kCqEntries (fewer if the device's CQs are
  // smaller): 256 requester QPs of the generic profile, 64 of mlx5's, or
  // that many thousand responder QPs (1 entry each), per thread.
  constexpr int kCqEntries = 1 << 16;
  holder->pollers = std::make_unique<CompletionPollers>(
      holder->device.get(),
      static_cast<uint32_t>(
          attr->max_cqe > 0 ? std::min(attr->max_cqe, kCqEntries) : kCqEntries),
      options_.busy_poll);
  for (auto& rail : rails) {
    rail->index = rails_.size();
    rail->local.device = holder->device.get();
    rail->local.pd = holder->pd.get();
    rail->local.pollers = holder->pollers.get();
    rails_.push_back(std::move(rail));
  }
  devices_.push_back(std::move(holder));
  return absl::OkStatus();
}

Rail* IbverbsBackend::FindRail(const std::string& device, uint32_t port) const {
  for (const auto& rail : rails_) {
    if (rail->device->device->name() == device &&
        (port == 0 || rail->local.port == port)) {
      return rail.get();
    }
  }
  return nullptr;
}

const QueuePairParams& IbverbsBackend::params() const {
  static const QueuePairParams kNone;
  return rails_.empty() ? kNone : rails_.front()->params;
}

const std::string& IbverbsBackend::profile_name() const {
  static const std::string kNone;
  return rails_.empty() ? kNone : rails_.front()->profile.name;
}

std::vector<std::string> IbverbsBackend::rail_names() const {
  std::vector<std::string> names;
  for (const auto& rail : rails_) names.push_back(rail->name);
  return names;
}

uint64_t IbverbsBackend::rail_bytes(const std::string& name) const {
  for (const auto& rail : rails_) {
    if (rail->name == name) return rail->counters.bytes;
  }
  return 0;
}

size_t IbverbsBackend::completion_threads() const {
  size_t threads = 0;
  for (const auto& device : devices_) threads += device->pollers->size();
  return threads;
}

v1::TransportInfo IbverbsBackend::transport_info() const {
  v1::TransportInfo info;
  if (!available()) return info;
  auto& attributes = *info.mutable_attributes();
  const absl::Time now = absl::Now();
  std::map<const Rail*, size_t> lanes_cooling =
      requester_->LanesCoolingDown(now);
  for (const auto& rail : rails_) {
    verbs::Device& dev = *rail->device->device;
    // The port as it is now: a rail whose cable was pulled says DOWN.
    ibv_port_attr port = rail->port_attr;
    if (auto now_attr = dev.QueryPort(rail->local.port); now_attr.ok()) {
      port = *now_attr;
    } else {
      port.state = IBV_PORT_NOP;
    }
    v1::DeviceInfo* device = info.add_devices();
    device->set_name(dev.name());
    device->set_port(rail->local.port);
    device->set_link_layer(port.link_layer == IBV_LINK_LAYER_INFINIBAND
                               ? "InfiniBand"
                               : "Ethernet");
    device->set_state(verbs::PortStateName(port.state));
    device->set_mtu_bytes(verbs::MtuBytes(port.active_mtu));
    device->set_speed_gbps(verbs::PortSpeedGbps(port));
    device->set_lid(port.lid);
    const int gids = std::min<int>(port.gid_tbl_len, 16);
    for (int i = 0; i < gids; ++i) {
      auto gid = dev.QueryGid(rail->local.port, i);
      if (!gid.ok()) break;
      static const ibv_gid kZero = {};
      if (std::memcmp(gid->raw, kZero.raw, sizeof(kZero.raw)) == 0) continue;
      device->add_gids(absl::StrCat(i, ":", verbs::GidToString(*gid)));
    }
    device->set_profile(rail->profile.name);
    device->set_max_message_bytes(rail->params.max_message_bytes);
    // Per rail: what it carried, whether it is left out, where it sits.
    const std::string prefix = absl::StrCat("rail.", rail->name, ".");
    attributes[prefix + "bytes"] = absl::StrCat(rail->counters.bytes.load());
    attributes[prefix + "work_requests"] =
        absl::StrCat(rail->counters.work_requests.load());
    attributes[prefix + "errors"] = absl::StrCat(rail->counters.errors.load());
    attributes[prefix + "reposted_bytes"] =
        absl::StrCat(rail->counters.reposted_bytes.load());
    {
      absl::MutexLock lock(&rail->mu);
      attributes[prefix + "health"] =
          rail->health.cooling(now)
              ? absl::StrCat(
                    "cooling down for ",
                    absl::FormatDuration(absl::Ceil(rail->health.until() - now,
                                                    absl::Milliseconds(1))),
                    ": ", rail->health.why())
              : "ok";
    }
    attributes[prefix + "lanes_cooling_down"] =
        absl::StrCat(lanes_cooling[rail.get()]);
    attributes[prefix + "numa_node"] = absl::StrCat(rail->numa_node);
    attributes[prefix + "speed_gbps"] = absl::StrCat(rail->speed_gbps);
  }
  const Rail& first = *rails_.front();
  attributes["rails"] = absl::StrCat(rails_.size());
  attributes["completion_threads"] = absl::StrCat(completion_threads());
  attributes["stripe_threshold_bytes"] =
      absl::StrCat(options_.stripe_threshold_bytes);
  attributes["numa_policy"] =
      options_.numa_policy == IbverbsOptions::NumaPolicy::kAll ? "all"
                                                               : "nearest";
  attributes["numa_near_share"] = absl::StrCat(options_.numa_near_share);
  // "10 21; 21 10": row i is node nodes[i]'s distance to each node.
  std::vector<std::string> rows;
  for (int from : topology_.nodes()) {
    std::vector<int> row;
    for (int to : topology_.nodes())
      row.push_back(topology_.Distance(from, to));
    rows.push_back(absl::StrJoin(row, " "));
  }
  attributes["numa_nodes"] = absl::StrJoin(topology_.nodes(), ",");
  attributes["numa_distances"] = absl::StrJoin(rows, "; ");
  attributes["profile"] = first.profile.name;
  attributes["gid_index"] = absl::StrCat(first.params.gid_index);
  attributes["path_mtu_bytes"] = absl::StrCat(first.params.mtu_bytes);
  attributes["sq_depth"] = absl::StrCat(first.params.sq_depth);
  attributes["timeout"] = absl::StrCat(first.params.timeout);
  attributes["retry_cnt"] = absl::StrCat(first.params.retry_cnt);
  attributes["rnr_retry"] = absl::StrCat(first.params.rnr_retry);
  attributes["max_rd_atomic"] = absl::StrCat(first.params.max_rd_atomic);
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
  // session's PD (GrantAccess), never through these, so nothing that
  // answers this agent's handshakes can use them. One per device: an lkey
  // is good on every port of its device.
  std::vector<std::unique_ptr<verbs::MemoryRegion>> mrs;
  for (const auto& device : devices_) {
    auto mr = RegisterIn(*device->pd, registration, IBV_ACCESS_LOCAL_WRITE);
    if (!mr.ok()) {
      return Prefixed(mr.status(),
                      absl::StrCat("registering buffer ", registration.id(),
                                   " on ", device->device->name()));
    }
    mrs.push_back(std::move(*mr));
  }
  // Rails whose port is ACTIVE now (peers would only find the others
  // failing); every rail when none is, rather than no context at all.
  std::vector<const Rail*> advertised;
  for (const auto& rail : rails_) {
    absl::MutexLock lock(&rail->mu);
    if (rail->port_active) advertised.push_back(rail.get());
  }
  if (advertised.empty()) {
    for (const auto& rail : rails_) advertised.push_back(rail.get());
  }
  // The first rail in the single-rail fields, so that agents knowing of
  // one port per agent reach this one through it.
  const Rail& first = *advertised.front();
  v1::IbverbsEndpoint* ib = endpoint->mutable_ibverbs();
  ib->set_device(first.device->device->name());
  ib->set_port(first.local.port);
  ib->set_lid(first.local.lid);
  ib->set_gid(GidBytes(first.local.gid));
  // No rkey: a peer gets one for its own PD in return for the token.
  ib->set_address(MrAddress(registration));
  ib->set_peer_address(peer_address_);
  ib->set_max_message_bytes(first.params.max_message_bytes);
  // Listed only when there is more than one: a single-rail context stays
  // what it always was.
  if (advertised.size() > 1) {
    for (const Rail* rail : advertised) {
      v1::IbverbsRail* entry = ib->add_rails();
      entry->set_device(rail->device->device->name());
      entry->set_port(rail->local.port);
      entry->set_lid(rail->local.lid);
      entry->set_gid(GidBytes(rail->local.gid));
      entry->set_max_message_bytes(rail->params.max_message_bytes);
      entry->set_speed_gbps(rail->speed_gbps);
    }
  }
  auto state = std::make_unique<IbverbsRegistration>(std::move(mrs));
  state->set_affinity(AffinityOf(registration));
  AdvertiseAffinity(state->affinity(), advertised, *ib);
  return std::unique_ptr<BackendRegistration>(std::move(state));
}

RailAffinity IbverbsBackend::AffinityOf(
    const Registration& registration) const {
  RailAffinity affinity;
  affinity.near_rails.assign(rails_.size(), true);
  if (options_.numa_policy == IbverbsOptions::NumaPolicy::kAll) {
    return affinity;
  }
  std::vector<int> nodes;
  for (const auto& rail : rails_) nodes.push_back(rail->numa_node);
  const DeviceMemory* device = registration.device_memory();
  if (device == nullptr) {
    affinity.numa_node =
        memory_locator_->NodeOf(registration.data(), registration.size());
    affinity.near_rails = NearestRails(topology_, affinity.numa_node, nodes);
    return affinity;
  }
  // Device memory: the agent has no mapping of it, and host NUMA placement
  // says nothing of where a GPU's memory is. Its device's PCI address does:
  // the device's node, then the NICs sharing its PCIe switch (peer-to-peer
  // traffic that never crosses the CPU). Without one, every rail is near.
  if (device->pci_bus_id().empty()) return affinity;
  affinity.numa_node = topology_.PciDeviceNode(device->pci_bus_id());
  std::vector<NumaTopology::PciPath> paths;
  for (const auto& rail : rails_) paths.push_back(rail->pci_path);
  affinity.near_rails =
      NearestInPciTree(topology_.PciDevicePciPath(device->pci_bus_id()), paths,
                       NearestRails(topology_, affinity.numa_node, nodes),
                       &affinity.near_rails_only);
  return affinity;
}

bool IbverbsBackend::CanReach(const v1::RemoteBuffer& remote) const {
  if (!available()) return false;
  const v1::BackendEndpoint* endpoint = FindEndpoint(remote, name_);
  if (endpoint == nullptr || !endpoint->has_ibverbs() ||
      endpoint->ibverbs().peer_address().empty() ||
      endpoint->ibverbs().gid().size() != sizeof(ibv_gid)) {
    return false;
  }
  for (const v1::IbverbsRail& rail : endpoint->ibverbs().rails()) {
    if (rail.gid().size() != sizeof(ibv_gid)) return false;
  }
  return true;
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
                                 peer.empty() ? "" : " at ", LogSafe(peer));
  auto registration = env_.directory->ResolveForPeer(proof);
  // Refusals are logged by the directory's observer, with `peer`.
  if (!registration.ok()) return registration.status();
  Rail* rail = FindRail(request.remote_device(), request.remote_port());
  if (rail == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("agent ", env_.identity.agent_id, " has no RDMA rail ",
                     request.remote_device(), ":", request.remote_port(),
                     " (it uses ", absl::StrJoin(rail_names(), ", "), ")"));
  }
  const auto* state = dynamic_cast<const IbverbsRegistration*>(
      (*registration)->backend_state(name_));
  if (state == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("buffer ", request.buffer_id(),
                     " is not registered with the ibverbs backend"));
  }
  const std::string source = PeerSourceAddress(peer);
  // Only the handle this agent issued names a session: a reconnect
  // presenting it replaces that session; anything else (none, a guess, one
  // that expired) is a new session, which never touches another's.
  std::shared_ptr<PeerSession> previous =
      request.session().empty() ? nullptr : FindSession(request.session());
  std::vector<std::shared_ptr<PeerSession>> expired;  // destroyed unlocked
  uint64_t serial;
  {
    absl::MutexLock lock(&mu_);
    if (previous == nullptr) {
      absl::Status admitted = AdmitSession(source, "", expired);
      if (!admitted.ok()) return admitted;
    }
    serial = next_session_serial_++;
  }
  expired.clear();
  auto pd = rail->device->device->AllocateProtectionDomain();
  if (!pd.ok()) return pd.status();
  auto session = std::make_shared<PeerSession>(
      serial, previous != nullptr ? previous->secret() : RandomBytes(16),
      source, absl::StrCat(request.agent_id(), "/", requester.device()),
      std::shared_ptr<verbs::ProtectionDomain>(std::move(*pd)));
  LocalPort port = rail->local;
  port.pd = session->pd();
  // A responder QP only answers (the peer's NIC drives one-sided ops): it
  // posts nothing, so one send-queue slot, and one entry of the device's
  // shared CQ, is all it takes.
  QueuePairParams params = rail->params;
  params.sq_depth = 1;
  auto created = QueuePairConnection::Create(
      port, params, options_.busy_poll, options_.drain_timeout,
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
  response.set_session(session->secret());
  response.set_session_idle_timeout_ms(static_cast<uint64_t>(
      absl::ToInt64Milliseconds(options_.responder_idle_timeout)));
  std::shared_ptr<PeerSession> replaced = session;
  {
    absl::MutexLock lock(&mu_);
    // Checked again: others may have been admitted meanwhile, or the
    // session reconnected may have expired.
    absl::Status admitted = AdmitSession(source, session->secret(), expired);
    if (!admitted.ok()) return admitted;
    responders_[session->secret()].swap(replaced);
  }
  expired.clear();
  spdlog::info(
      "ibverbs: serving agent {} device {} from {} on rail {} (QP {}{})",
      LogSafe(request.agent_id()), LogSafe(requester.device()), LogSafe(source),
      rail->name, response.responder().qp_num(),
      replaced != nullptr ? ", reconnected" : "");
  // `replaced` (the session's previous QP) drops its grants, QP and PD.
  return response;
}

absl::Status IbverbsBackend::AdmitSession(
    const std::string& source, const std::string& replacing,
    std::vector<std::shared_ptr<PeerSession>>& expired) {
  if (!replacing.empty() && responders_.count(replacing) != 0) {
    return absl::OkStatus();  // one session for another
  }
  const auto over = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    size_t from_source = 0;
    for (const auto& [secret, session] : responders_) {
      from_source += session->source() == source;
    }
    if (from_source >= options_.max_responders_per_source) {
      return absl::ResourceExhaustedError(
          absl::StrCat("agent ", env_.identity.agent_id, " already serves ",
                       from_source, " peer sessions for ", LogSafe(source),
                       " (--ibverbs_max_responders_per_source)"));
    }
    if (responders_.size() >= options_.max_responders) {
      // Bounds the PDs and QPs peers can make this agent allocate.
      return absl::ResourceExhaustedError(absl::StrCat(
          "agent ", env_.identity.agent_id, " already serves ",
          responders_.size(), " peer sessions (--ibverbs_max_responders)"));
    }
    return absl::OkStatus();
  };
  absl::Status status = over();
  if (status.ok()) return status;
  // Full: sessions the sweeper has not reached yet make room first.
  TakeExpiredSessions(absl::Now(), expired);
  return over();
}

void IbverbsBackend::TakeExpiredSessions(
    absl::Time now, std::vector<std::shared_ptr<PeerSession>>& expired) {
  for (auto it = responders_.begin(); it != responders_.end();) {
    if (!it->second->Expired(now, options_.responder_idle_timeout)) {
      ++it;
      continue;
    }
    spdlog::info("ibverbs: dropped the session of {} from {} ({})",
                 LogSafe(it->second->peer()), LogSafe(it->second->source()),
                 it->second->grant_count() == 0
                     ? "every buffer it was granted is released"
                     : "idle");
    expired.push_back(std::move(it->second));
    it = responders_.erase(it);
  }
}

void IbverbsBackend::Sweep() {
  std::vector<std::shared_ptr<PeerSession>> expired;
  {
    absl::MutexLock lock(&mu_);
    TakeExpiredSessions(absl::Now(), expired);
  }
  expired.clear();  // QPs and PDs destroyed outside mu_
  requester_->ExpireIdle(absl::Now());
}

absl::Duration IbverbsBackend::SweepInterval() const {
  absl::Duration shortest = absl::Seconds(1);
  for (const absl::Duration timeout :
       {options_.responder_idle_timeout, options_.requester_idle_timeout}) {
    if (timeout > absl::ZeroDuration()) {
      shortest = std::min(shortest, timeout / 4);
    }
  }
  return std::max(shortest, absl::Milliseconds(10));
}

void IbverbsBackend::StartSweeper() {
  sweeper_ = std::thread([this] {
    const absl::Duration interval = SweepInterval();
    absl::MutexLock lock(&sweep_mu_);
    while (!stopping_) {
      sweep_mu_.AwaitWithTimeout(absl::Condition(&stopping_), interval);
      if (stopping_) break;
      sweep_mu_.Unlock();
      Sweep();
      sweep_mu_.Lock();
    }
  });
}

void IbverbsBackend::StopSweeper() {
  {
    absl::MutexLock lock(&sweep_mu_);
    stopping_ = true;
  }
  if (sweeper_.joinable()) sweeper_.join();
}

std::shared_ptr<IbverbsBackend::PeerSession> IbverbsBackend::FindSession(
    const std::string& secret) const {
  absl::MutexLock lock(&mu_);
  std::shared_ptr<PeerSession> found;
  // Compared in constant time and over every session: the handle is the
  // secret that names the session.
  for (const auto& [key, session] : responders_) {
    if (TokensEqual(session->secret(), secret)) found = session;
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
        "no such queue-pair session (expired, its buffers released, or never "
        "connected): reconnect");
  }
  session->Touch();
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
      requester_->StubFor(address)->Notify(&context, request, &response);
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
      absl::StrCat(
          "notification to agent ", remote.agent_id(), " at ", address,
          maybe_delivered ? " (it may have arrived all the same)" : ""));
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
  target.requester = absl::StrCat("agent ", LogSafe(request.agent_id()), " at ",
                                  LogSafe(peer));
  return env_.notifications->Deliver(target, request.agent_id(),
                                     request.data());
}

void IbverbsBackend::Post(absl::Span<const Op> ops, const StopToken& stop,
                          OpsDone done) {
  requester_->Post(ops, stop, std::move(done));
}

uint64_t IbverbsBackend::connections_established() const {
  return requester_->connections_established();
}

size_t IbverbsBackend::requester_count() const {
  return requester_->connections();
}

namespace {

// `counts` as links of `direction`, at most `cap` labels: the peers with
// the most links by name, the rest summed under "other". Labels come from
// contexts and requests, so their number and text are bounded here.
void AppendLinks(const std::map<std::string, size_t>& counts,
                 const std::string& direction, size_t cap,
                 std::vector<Backend::PeerLinks>& links) {
  std::vector<std::pair<std::string, size_t>> sorted(counts.begin(),
                                                     counts.end());
  const size_t kept = sorted.size() <= cap ? sorted.size() : cap - 1;
  std::partial_sort(sorted.begin(), sorted.begin() + kept, sorted.end(),
                    [](const auto& a, const auto& b) {
                      return a.second != b.second ? a.second > b.second
                                                  : a.first < b.first;
                    });
  size_t other = 0;
  for (size_t i = 0; i < sorted.size(); ++i) {
    if (i < kept) {
      links.push_back({LogSafe(sorted[i].first), direction, sorted[i].second});
    } else {
      other += sorted[i].second;
    }
  }
  if (kept < sorted.size()) links.push_back({"other", direction, other});
}

}  // namespace

std::vector<Backend::PeerLinks> IbverbsBackend::peer_links() const {
  const std::map<std::string, size_t> out = requester_->ConnectionsByPeer();
  std::map<std::string, size_t> in;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, session] : responders_) ++in[session->peer()];
  }
  const size_t cap = std::max<size_t>(options_.max_peer_link_labels, 1);
  std::vector<PeerLinks> links;
  AppendLinks(out, "out", cap, links);
  AppendLinks(in, "in", cap, links);
  return links;
}

size_t IbverbsBackend::requester_peers() const { return requester_->peers(); }

size_t IbverbsBackend::peer_channels() const { return requester_->channels(); }

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
  return state == nullptr || devices_.empty() ? 0 : state->mr(0).lkey();
}

}  // namespace rdma_agent::ibverbs

#ifndef RDMA_AGENTD_BACKENDS_IBVERBS_IBVERBS_BACKEND_H_
#define RDMA_AGENTD_BACKENDS_IBVERBS_IBVERBS_BACKEND_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "backends/backend.h"
#include "backends/ibverbs/connection.h"
#include "backends/ibverbs/profiles.h"
#include "backends/ibverbs/verbs.h"
#include "rdma/agent/v1/peer.grpc.pb.h"

namespace grpc {
class Server;
}

namespace rdma_agent {

// Configuration of the ibverbs backend (flags.cc fills it from --ibverbs_*).
struct IbverbsOptions {
  // False: the backend reports itself unavailable.
  bool enabled = true;
  // Device to use; empty = the first one with an ACTIVE port.
  std::string device;
  // 1-based port; 0 = the first ACTIVE port.
  uint8_t port = 0;
  // "auto" (from the device's vendor and name), "generic", "mlx5", "efa".
  std::string profile = "auto";
  // Overrides of the profile's queue-pair defaults.
  QueuePairOverrides qp;
  // Bound on one queue-pair handshake (also bounded by the op's deadline).
  absl::Duration connect_timeout = absl::Seconds(5);
  // How long the completion poller spins before blocking on the channel.
  absl::Duration busy_poll = absl::Microseconds(50);
  // Bound on waiting for a QP in ERR to flush its WRs.
  absl::Duration drain_timeout = absl::Seconds(10);
  // Responder QPs kept for peers at most (one per peer agent and device).
  size_t max_responders = 1024;
};

// One-sided RDMA READ/WRITE through a NIC ("ibverbs", level NIC).
//
// Register() registers the whole mapping as an MR (LOCAL_WRITE, plus
// REMOTE_READ / REMOTE_WRITE as the registration's access allows, so the NIC
// itself enforces access) and advertises device, port, LID, GID, rkey,
// address, max message size and the agent's Peer address. The MR lives in
// the BackendRegistration, so it is deregistered only once the registration
// and every op pinning it are gone.
//
// Submit() connects an RC QP per (remote agent + epoch, remote device) on
// first use through the Peer service (ConnectQueuePair, which checks the
// epoch), splits each op into WRs of at most the smaller max message size of
// both sides, posts them under send-queue credits, and reports each op when
// all its WRs completed, with the first error. At the deadline every QP
// still holding WRs of the batch is moved to ERR and drained, so no WR
// touches memory after Submit returns; the next Submit reconnects.
class IbverbsBackend : public Backend {
 public:
  // Never fails for a missing device or port: the backend is then
  // unavailable, with a reason. INVALID_ARGUMENT for bad options.
  static absl::StatusOr<std::unique_ptr<IbverbsBackend>> Create(
      BackendEnvironment env, IbverbsOptions options,
      std::unique_ptr<verbs::Verbs> verbs);
  ~IbverbsBackend() override;

  const std::string& name() const override { return name_; }
  v1::TransportLevel transport_level() const override {
    return v1::TRANSPORT_LEVEL_NIC;
  }
  bool available() const override { return unavailable_reason_.empty(); }
  std::string unavailable_reason() const override {
    return unavailable_reason_;
  }
  v1::TransportInfo transport_info() const override;
  std::vector<grpc::Service*> peer_services() override;
  // Advertises the agent's Peer listener (`peer_address`) for the handshake.
  // Without one (a backend used on its own, as in tests), serves the Peer
  // service on a listener of its own at env.advertise_host:0 (127.0.0.1 when
  // that is empty), so that contexts always carry a reachable address.
  absl::Status Start(const std::string& peer_address) override;
  // "host:port" peers dial for the queue-pair handshake.
  const std::string& peer_address() const { return peer_address_; }
  absl::StatusOr<std::unique_ptr<BackendRegistration>> Register(
      const Registration& registration, v1::BackendEndpoint* endpoint) override;
  bool CanReach(const v1::RemoteBuffer& remote) const override;
  std::vector<absl::Status> Submit(absl::Span<const Op> ops,
                                   const StopToken& stop) override;

  // The responder half of the handshake (what the Peer service calls).
  absl::StatusOr<v1::ConnectQueuePairResponse> AcceptQueuePair(
      const v1::ConnectQueuePairRequest& request);

  // Queue pairs this backend connected as requester, over its life.
  uint64_t connections_established() const;
  // Queue pairs this backend holds as requester now.
  size_t requester_count() const;
  // Queue pairs peers connected to this backend, alive now.
  size_t responder_count() const;
  // The queue-pair attributes in use.
  const QueuePairParams& params() const { return params_; }
  const std::string& profile_name() const { return profile_.name; }

 private:
  class PeerService;

  IbverbsBackend(BackendEnvironment env, IbverbsOptions options,
                 std::unique_ptr<verbs::Verbs> verbs);
  // Finds a device/port and sets up the PD; on failure sets the reason.
  absl::Status Discover();
  // "agent_id/epoch/device": the requester QP an op needs.
  static std::string ConnectionKey(const v1::RemoteBuffer& remote,
                                   const v1::IbverbsEndpoint& endpoint);
  // What can be checked before posting: endpoint, local MR, ranges.
  absl::Status CheckOp(const Op& op) const;
  // Posts `op` (checked) as WRs of at most the smaller max message size;
  // returns the first posting error.
  absl::Status PostOp(const Op& op, size_t index, Connection& connection,
                      const std::shared_ptr<OpTracker>& tracker,
                      const StopToken& stop) const;
  absl::StatusOr<std::shared_ptr<Connection>> GetConnection(
      const v1::RemoteBuffer& remote, const v1::IbverbsEndpoint& endpoint,
      absl::Time deadline);
  absl::StatusOr<std::shared_ptr<Connection>> Handshake(
      const v1::RemoteBuffer& remote, const v1::IbverbsEndpoint& endpoint,
      absl::Time deadline);
  std::shared_ptr<v1::Peer::Stub> StubFor(const std::string& address);

  const std::string name_ = "ibverbs";
  const BackendEnvironment env_;
  const IbverbsOptions options_;
  std::unique_ptr<verbs::Verbs> verbs_;
  std::string unavailable_reason_;
  DeviceProfile profile_;
  QueuePairParams params_;
  // Set by Discover() when available; never changed afterwards.
  std::unique_ptr<verbs::Device> device_;
  std::unique_ptr<verbs::ProtectionDomain> pd_;
  ibv_port_attr port_attr_ = {};
  LocalPort local_;
  std::unique_ptr<PeerService> service_;
  // Set at construction or by Start(); read-only once registrations exist.
  std::string peer_address_;
  // The fallback listener (see Start()), with its own service instance: a
  // grpc::Service can be registered with one server only.
  std::unique_ptr<PeerService> own_service_;
  std::unique_ptr<grpc::Server> own_server_;

  mutable absl::Mutex mu_;
  // One per requester key: serialises handshakes to the same peer device,
  // so concurrent Submits connect it once, while a slow peer does not hold
  // up handshakes with others.
  std::map<std::string, std::shared_ptr<absl::Mutex>> connect_locks_
      ABSL_GUARDED_BY(mu_);
  // Requester QPs by "agent_id/epoch/device".
  std::map<std::string, std::shared_ptr<Connection>> requesters_
      ABSL_GUARDED_BY(mu_);
  // Responder QPs by "agent_id/device" of the requester.
  std::map<std::string, std::unique_ptr<Connection>> responders_
      ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<v1::Peer::Stub>> stubs_
      ABSL_GUARDED_BY(mu_);
  uint64_t connections_established_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_BACKENDS_IBVERBS_IBVERBS_BACKEND_H_

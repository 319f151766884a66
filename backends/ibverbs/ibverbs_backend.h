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

namespace rdma_agent::testing {
class IbverbsBackendProbe;
}  // namespace rdma_agent::testing

namespace rdma_agent {
class TaskPool;
}  // namespace rdma_agent

namespace rdma_agent::ibverbs {

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
  // Peer sessions kept at most (one per peer agent and device, each with its
  // own protection domain and responder QP).
  size_t max_responders = 1024;
  // Registrations one peer session may be granted (one MR each in its PD).
  size_t max_grants_per_peer = 4096;
};

// One-sided RDMA READ/WRITE through a NIC ("ibverbs", level NIC).
//
// Register() registers the whole mapping as an MR in the agent's main PD
// with local access only (the lkey of this agent's own WRs) and advertises
// device, port, LID, GID, address, max message size and the agent's Peer
// address; no rkey. The MR lives in the BackendRegistration, so it is
// deregistered only once the registration and every op pinning it are gone.
//
// Peers reach a registration only through a session: ConnectQueuePair
// (proof of one registration: epoch, buffer id, token) gives the requesting
// agent a protection domain of its own holding its responder QP and an MR
// for each registration it proved (GrantBuffer adds more), with exactly the
// remote access the registration allows. Grants hang off the registration's
// BackendRegistration (gone with it) and off the session (gone when it is
// replaced). This agent's own requester QPs refuse inbound RDMA.
//
// Submit() connects an RC QP per (remote agent + epoch, remote device) on
// first use through the Peer service, asks for a grant on first use of each
// remote buffer over it (cached per connection, with the token that earned
// it), splits each op into WRs of at most the smaller max message size of
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
  // Advertises `peer_address`, where whoever runs this backend serves its
  // peer_services(), for the handshake. The backend opens no listener of its
  // own: FAILED_PRECONDITION when it is available and `peer_address` is
  // empty (contexts must carry a reachable address).
  absl::Status Start(const std::string& peer_address) override;
  // "host:port" peers dial for the queue-pair handshake.
  const std::string& peer_address() const { return peer_address_; }
  absl::StatusOr<std::unique_ptr<BackendRegistration>> Register(
      const Registration& registration, v1::BackendEndpoint* endpoint) override;
  bool CanReach(const v1::RemoteBuffer& remote) const override;
  std::vector<absl::Status> Submit(absl::Span<const Op> ops,
                                   const StopToken& stop) override;
  // Peer.Notify to the target agent's Peer listener (the address its
  // context advertises), once the ops' completions are in: RC completions
  // mean the bytes are in the target's memory.
  absl::Status Notify(const v1::RemoteBuffer& remote,
                      const v1::BackendEndpoint& endpoint,
                      absl::string_view data, const StopToken& stop) override;

  // The responder half of the handshake (what the Peer service calls).
  // `peer` (the caller's address, for logs) is empty when unknown.
  absl::StatusOr<v1::ConnectQueuePairResponse> AcceptQueuePair(
      const v1::ConnectQueuePairRequest& request, absl::string_view peer = "");
  // Grants a session one more registration (what the Peer service calls).
  absl::StatusOr<v1::GrantBufferResponse> GrantBuffer(
      const v1::GrantBufferRequest& request, absl::string_view peer = "");
  // Hands a peer's notification to the agent's NotificationSink (what the
  // Peer service calls).
  absl::Status AcceptNotification(const v1::NotifyRequest& request,
                                  absl::string_view peer = "");

  // Requester QPs by peer "agent/device" ("out") and responder QPs by the
  // requesting agent's "agent/device" ("in").
  std::vector<PeerLinks> peer_links() const override;

  // Queue pairs this backend connected as requester, over its life.
  uint64_t connections_established() const;
  // Queue pairs this backend holds as requester now.
  size_t requester_count() const;
  // Queue pairs peers connected to this backend, alive now (one per peer
  // session, each in a PD of its own).
  size_t responder_count() const;
  // Registrations granted to peer sessions, alive now, over all sessions.
  size_t grant_count() const;
  // The queue-pair attributes in use.
  const QueuePairParams& params() const { return params_; }
  const std::string& profile_name() const { return profile_.name; }

 private:
  // Tests that play a rogue peer read local keys through it.
  friend class ::rdma_agent::testing::IbverbsBackendProbe;
  class PeerService;
  class PeerSession;
  struct Handshaken;

  // What a peer granted this agent for one of its buffers over one
  // connection.
  struct RemoteGrant {
    std::string token;  // the token that earned it: a cache hit needs it too
    uint32_t rkey = 0;
    uint64_t address = 0;
    uint64_t size_bytes = 0;
  };
  // A requester QP's session on the peer, and what it was granted.
  struct RequesterLink {
    std::weak_ptr<QueuePairConnection> connection;
    std::string session;
    std::map<uint64_t, RemoteGrant> grants;  // by remote buffer id
  };

  IbverbsBackend(BackendEnvironment env, IbverbsOptions options,
                 std::unique_ptr<verbs::Verbs> verbs);
  // Finds a device/port and sets up the PD; on failure sets the reason.
  absl::Status Discover();
  // "agent_id/epoch/device": the requester QP an op needs.
  static std::string ConnectionKey(const v1::RemoteBuffer& remote,
                                   const v1::IbverbsEndpoint& endpoint);
  // What the contract does not cover before posting: the local MR.
  absl::Status CheckOp(const Op& op) const;
  // Posts `op` (checked) as WRs of at most the smaller max message size,
  // with the rkey and address granted for its remote buffer over
  // `connection`; returns the first posting error.
  absl::Status PostOp(const Op& op, size_t index,
                      QueuePairConnection& connection,
                      const std::shared_ptr<OpTracker>& tracker,
                      const StopToken& stop);
  // The connection a group of ops (same remote agent, epoch and device)
  // goes through. The handshake needs the proof of one buffer: those of the
  // group's ops are tried in turn (a few at most), so that one forged or
  // released context does not fail the others.
  absl::StatusOr<std::shared_ptr<QueuePairConnection>> ConnectForGroup(
      absl::Span<const Op> ops, const std::vector<size_t>& indices,
      absl::Time deadline);
  absl::StatusOr<std::shared_ptr<QueuePairConnection>> GetConnection(
      const v1::RemoteBuffer& remote, const v1::IbverbsEndpoint& endpoint,
      absl::Time deadline);
  absl::StatusOr<Handshaken> Handshake(const v1::RemoteBuffer& remote,
                                       const v1::IbverbsEndpoint& endpoint,
                                       absl::Time deadline);
  // The grant for op's remote buffer over `connection`: cached, or asked
  // for with GrantBuffer (cut short by `stop`).
  absl::StatusOr<RemoteGrant> GrantFor(const Op& op,
                                       const QueuePairConnection& connection,
                                       const StopToken& stop);
  std::shared_ptr<v1::Peer::Stub> StubFor(const std::string& address);
  // The session `id` names, or nullptr.
  std::shared_ptr<PeerSession> FindSession(const std::string& id) const;
  // The lkey of `registration`'s MR in the main PD (0 when it has none).
  uint32_t local_key(const Registration& registration) const;

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
  // A batch for several queue pairs connects and posts to them at once: the
  // caller and these threads (more groups than threads: the caller runs the
  // rest in turn).
  static constexpr size_t kPostingThreads = 3;
  std::unique_ptr<TaskPool> posting_pool_;
  // Set by Start(); read-only once registrations exist.
  std::string peer_address_;

  mutable absl::Mutex mu_;
  // One per requester key: serialises handshakes to the same peer device,
  // so concurrent Submits connect it once, while a slow peer does not hold
  // up handshakes with others.
  std::map<std::string, std::shared_ptr<absl::Mutex>> connect_locks_
      ABSL_GUARDED_BY(mu_);
  // Requester QPs by "agent_id/epoch/device".
  std::map<std::string, std::shared_ptr<QueuePairConnection>> requesters_
      ABSL_GUARDED_BY(mu_);
  // What each requester QP was granted, by the same key as requesters_.
  std::map<std::string, RequesterLink> links_ ABSL_GUARDED_BY(mu_);
  // Peer sessions (PD + responder QP + grants) by "agent_id/device" of the
  // requester.
  std::map<std::string, std::shared_ptr<PeerSession>> responders_
      ABSL_GUARDED_BY(mu_);
  uint64_t next_session_serial_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<std::string, std::shared_ptr<v1::Peer::Stub>> stubs_
      ABSL_GUARDED_BY(mu_);
  uint64_t connections_established_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace rdma_agent::ibverbs

#endif  // RDMA_AGENTD_BACKENDS_IBVERBS_IBVERBS_BACKEND_H_

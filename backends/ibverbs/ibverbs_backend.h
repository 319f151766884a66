#ifndef RDMA_AGENTD_BACKENDS_IBVERBS_IBVERBS_BACKEND_H_
#define RDMA_AGENTD_BACKENDS_IBVERBS_IBVERBS_BACKEND_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "backends/backend.h"
#include "backends/ibverbs/connection.h"
#include "backends/ibverbs/memory_node.h"
#include "backends/ibverbs/numa_topology.h"
#include "backends/ibverbs/options.h"
#include "backends/ibverbs/profiles.h"
#include "backends/ibverbs/rails.h"
#include "backends/ibverbs/verbs.h"
#include "rdma/agent/v1/peer.grpc.pb.h"

namespace rdma_agent::testing {
class IbverbsBackendProbe;
}  // namespace rdma_agent::testing

namespace rdma_agent::ibverbs {

class Requester;

// One-sided RDMA READ/WRITE through the host's NICs ("ibverbs", level NIC).
//
// Every port of every device used is a rail (README.md, "Rails"), carrying
// bytes while its port is ACTIVE (port events and looks say when).
// Register() registers the whole mapping as an MR in the agent's main PD of
// each device, with local access only (the lkeys of this agent's own WRs),
// and advertises every rail (device, port, LID, GID, max message size,
// speed), the address and the agent's Peer address; no rkey. The MRs live
// in the BackendRegistration, so they are deregistered only once the
// registration and every op pinning it are gone. Device memory (a dma-buf,
// Registration::device_memory()) is registered the same way with
// ibv_reg_dmabuf_mr, addressed from kDeviceMemoryIova (registration_state.h)
// rather than a virtual address; ops on it run like any other, and this is
// the only backend that carries them (README.md, "Device memory").
//
// Peers reach a registration only through a session: ConnectQueuePair
// (proof of one registration: epoch, buffer id, token) gives the requesting
// agent's rail a protection domain of its own on one of this agent's rails,
// holding its responder QP and an MR for each registration it proved
// (GrantBuffer adds more), with exactly the remote access the registration
// allows. Grants hang off the registration's BackendRegistration (gone with
// it) and off the session (gone when it is replaced). This agent's own
// requester QPs refuse inbound RDMA.
//
// Post() (its Requester, requester.h) pairs this agent's rails with the
// peer's (striping.h), connects an RC QP per pair (lane) on first use
// through the Peer service, asks for a grant on first use of each remote
// buffer over it (cached per lane, with the token that earned it), splits
// ops of at least stripe_threshold_bytes over the lanes in proportion to
// link speed and puts smaller ones on the least loaded lane, cuts each
// piece into WRs of at most the smaller max message size of both rails,
// posts them under send-queue credits, and reports each op when all its
// bytes moved, with the first error. Bytes whose WRs fail because a rail
// failed (retry exceeded, flushed) are posted again over the other lanes,
// and the failed pair (or rail, when its port is down) cools down; only
// when no lane is left does the op fail UNAVAILABLE (the registry then
// retries it on tcp). At the deadline, or when cancelled, every QP still
// holding WRs of the batch is moved to ERR and drained, so no WR touches
// memory once done is called; the next batch reconnects. No thread waits on
// a posted batch: WRs of lanes already connected go out on the caller's
// thread, handshakes, grants and full send queues on posting threads, and
// the batch ends on the thread that settles its last byte (usually a
// completion poller) or, at its deadline or cancellation, on the timer
// thread. Submit is Backend's: Post, then wait.
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
  // Host and device memory alike: the NIC reaches both.
  bool CanRegister(const Registration&) const override { return true; }
  absl::StatusOr<std::unique_ptr<BackendRegistration>> Register(
      const Registration& registration, v1::BackendEndpoint* endpoint) override;
  bool CanReach(const v1::RemoteBuffer& remote) const override;
  void Post(absl::Span<const Op> ops, const StopToken& stop,
            OpsDone done) override;
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
  // requesting agent's "agent/device" ("in"): at most
  // options.max_peer_link_labels labels per direction, the peers with
  // fewer links summed under "other".
  std::vector<PeerLinks> peer_links() const override;
  // Peer agents the requesting side holds state for (lanes, handshakes),
  // and the Peer channels it keeps open.
  size_t requester_peers() const;
  size_t peer_channels() const;

  // Queue pairs this backend connected as requester, over its life.
  uint64_t connections_established() const;
  // Queue pairs this backend holds as requester now (one per lane in use).
  size_t requester_count() const;
  // Queue pairs peers connected to this backend, alive now (one per peer
  // session, each in a PD of its own).
  size_t responder_count() const;
  // Registrations granted to peer sessions, alive now, over all sessions.
  size_t grant_count() const;
  // The queue-pair attributes of the first rail.
  const QueuePairParams& params() const;
  const std::string& profile_name() const;
  // Rails ("mlx5_0:1"), in the order contexts list them.
  std::vector<std::string> rail_names() const;
  // Bytes that WRs of `rail` moved successfully; 0 for an unknown rail.
  uint64_t rail_bytes(const std::string& rail) const;
  // Threads polling completion queues now (shared by every QP of a device:
  // one per device, more only for very many QPs).
  size_t completion_threads() const;

 private:
  // Tests that play a rogue peer read local keys through it.
  friend class ::rdma_agent::testing::IbverbsBackendProbe;
  class PeerService;
  class PeerSession;

  IbverbsBackend(BackendEnvironment env, IbverbsOptions options,
                 std::unique_ptr<verbs::Verbs> verbs);
  // Opens the devices and sets up a rail per port; on failure (no port is
  // ACTIVE) the backend is unavailable for the reason returned.
  absl::Status Discover();
  // Sets up the rails of one opened device (none when it has no usable
  // port; `why` says why).
  absl::Status AddRails(std::unique_ptr<verbs::Device> device,
                        std::vector<std::string>& why);
  // Starts a PortWatcher per device (after Discover succeeded).
  void WatchPorts();
  // A port event of `device`: its rail is in use again (ACTIVE) or left
  // out (down) at once.
  void OnPortEvent(const RailDevice& device, uint8_t port, bool active);
  // The rail `device`:`port` of this agent (port 0: its first rail on
  // `device`), or nullptr.
  Rail* FindRail(const std::string& device, uint32_t port) const;
  // Where `registration`'s memory is and which rails are nearest to it
  // (every rail under NumaPolicy::kAll or when nodes are unknown). Host
  // memory: the node the locator finds. Device memory: its device's node
  // and PCIe switch, by its PCI address (none given: every rail).
  RailAffinity AffinityOf(const Registration& registration) const;

  // The session the handle `secret` names, or nullptr.
  std::shared_ptr<PeerSession> FindSession(const std::string& secret) const;
  // OK when a new session from `source` fits the bounds (per source, in
  // total), making room from expired sessions (into `expired`, for the
  // caller to destroy outside mu_) when full. A session replacing the one
  // `replacing` names still held fits.
  absl::Status AdmitSession(const std::string& source,
                            const std::string& replacing,
                            std::vector<std::shared_ptr<PeerSession>>& expired)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves sessions idle past the timeout, or admitted by no live
  // registration, out of the table into `expired`.
  void TakeExpiredSessions(absl::Time now,
                           std::vector<std::shared_ptr<PeerSession>>& expired)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The sweeper: a thread dropping expired sessions and idle requester
  // state every SweepInterval() (a quarter of the shortest idle timeout, at
  // most 1 s), so that they go without waiting for the next Peer call.
  void StartSweeper();
  void StopSweeper();
  void Sweep();
  absl::Duration SweepInterval() const;
  // The lkey of `registration`'s MR in the first device's main PD (0 when
  // it has none).
  uint32_t local_key(const Registration& registration) const;

  const std::string name_ = "ibverbs";
  const BackendEnvironment env_;
  const IbverbsOptions options_;
  std::unique_ptr<verbs::Verbs> verbs_;
  std::string unavailable_reason_;
  // Set by Discover() when available; never changed afterwards. Declared
  // before the lanes and sessions: their queue pairs go first.
  std::vector<std::unique_ptr<RailDevice>> devices_;
  std::vector<std::unique_ptr<Rail>> rails_;
  // The host's NUMA layout (options_.sysfs_root) and where memory is.
  const NumaTopology topology_;
  const std::shared_ptr<const MemoryNodeLocator> memory_locator_;
  std::unique_ptr<PeerService> service_;
  // Submit: lanes to peers over the rails above (reset before them).
  std::unique_ptr<Requester> requester_;
  // Set by Start(); read-only once registrations exist.
  std::string peer_address_;

  mutable absl::Mutex mu_;
  // Peer sessions (PD + responder QP + grants) by the handle this agent
  // issued for each (looked up in constant time: FindSession).
  std::map<std::string, std::shared_ptr<PeerSession>> responders_
      ABSL_GUARDED_BY(mu_);
  uint64_t next_session_serial_ ABSL_GUARDED_BY(mu_) = 1;

  absl::Mutex sweep_mu_;
  bool stopping_ ABSL_GUARDED_BY(sweep_mu_) = false;
  std::thread sweeper_;
};

}  // namespace rdma_agent::ibverbs

#endif  // RDMA_AGENTD_BACKENDS_IBVERBS_IBVERBS_BACKEND_H_

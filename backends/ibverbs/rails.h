#ifndef RDMA_AGENTD_BACKENDS_IBVERBS_RAILS_H_
#define RDMA_AGENTD_BACKENDS_IBVERBS_RAILS_H_

// The ibverbs backend's rails (every port of every device it uses)
// and lanes (a local rail paired with a remote one, toward one life of one
// peer agent), with what they count and how healthy they are.

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "backends/ibverbs/connection.h"
#include "backends/ibverbs/port_watcher.h"
#include "backends/ibverbs/profiles.h"
#include "backends/ibverbs/verbs.h"
#include "rdma/agent/v1/remote_buffer.pb.h"

namespace rdma_agent::ibverbs {

// Health of a rail or lane: usable, or left out after a failure until a
// time that doubles with each failure in a row (from `initial` up to
// `max`), so that a dead rail costs a transport timeout now and then rather
// than on every op. Not thread-safe: its owner guards it.
class Cooldown {
 public:
  // Left out from `now` for the next backoff.
  void Fail(absl::Time now, absl::Duration initial, absl::Duration max,
            std::string why);
  // Usable again; the next failure starts from `initial`.
  void Recover();
  // Left out at `now`.
  bool cooling(absl::Time now) const { return now < until_; }
  // Failed since it last recovered (cooling, or its cooldown ran out and
  // it has not been shown to work since).
  bool failed() const { return failures_ > 0; }
  absl::Time until() const { return until_; }
  const std::string& why() const { return why_; }
  // Failures in a row.
  uint64_t failures() const { return failures_; }

 private:
  absl::Time until_ = absl::InfinitePast();
  absl::Duration backoff_ = absl::ZeroDuration();
  std::string why_;
  uint64_t failures_ = 0;
};

// One opened device and the agent's main protection domain on it (where
// each registration's local-only MR is), shared by the device's ports.
struct RailDevice {
  // Into the backend's devices, and into a registration's MRs.
  size_t index = 0;
  std::unique_ptr<verbs::Device> device;
  std::unique_ptr<verbs::ProtectionDomain> pd;
  // The CQs and polling threads every QP of the device (requester or
  // responder, on any of its ports) shares.
  std::unique_ptr<CompletionPollers> pollers;
  // Marks the device's rails up and down from its port events. Declared
  // last: stopped first. The backend stops it before its rails go.
  std::unique_ptr<PortWatcher> port_watcher;
};

// What a rail has carried, for GetInfo. Atomics: completions are counted on
// the pollers' threads.
struct RailCounters {
  std::atomic<uint64_t> bytes{0};           // moved by successful WRs
  std::atomic<uint64_t> work_requests{0};   // WRs completed successfully
  std::atomic<uint64_t> errors{0};          // WRs completed with an error
  std::atomic<uint64_t> reposted_bytes{0};  // moved to other rails after one
};

// A port of a device the backend uses: one rail, with its own queue-pair
// attributes (devices may differ), counters and health. A port that is not
// ACTIVE (at start, or since) is a rail that carries nothing until it is.
// Lives as long as the backend.
struct Rail {
  size_t index = 0;
  std::string name;  // "mlx5_0:1"
  RailDevice* device = nullptr;
  // The main PD of the device; sessions use a PD of their own.
  LocalPort local;
  DeviceProfile profile;
  QueuePairParams params;
  ibv_port_attr port_attr = {};  // as found at start
  double speed_gbps = 0;
  int numa_node = -1;
  // Its NIC's place in the PCI tree (NumaTopology::RdmaDevicePciPath);
  // empty when unknown.
  std::vector<std::string> pci_path;
  RailCounters counters;

  mutable absl::Mutex mu;
  // Its port is ACTIVE, as last told by a port event or a look
  // (ibv_query_port); a rail whose port is not is left out until it is.
  bool port_active ABSL_GUARDED_BY(mu) = false;
  // Cooling down while its port is not ACTIVE (found when its completions
  // failed, or by a periodic look); checked again with ibv_query_port when
  // the cooldown runs out.
  Cooldown health ABSL_GUARDED_BY(mu);
  // When a healthy rail's port was last looked at.
  absl::Time port_checked ABSL_GUARDED_BY(mu) = absl::InfinitePast();
};

// Where a registration's memory is (NUMA node), and the rails of this
// agent nearest to it.
struct RailAffinity {
  int numa_node = -1;  // -1: unknown
  // By Rail::index; every rail when the policy or the nodes say nothing.
  std::vector<bool> near_rails;
  // The near rails share a PCIe switch with the memory's device: the others
  // reach it only through the CPU, so they do not join large ops (they still
  // take over when no near rail works).
  bool near_rails_only = false;
};

// A rail of a peer agent, as its remote context advertises it.
struct RemoteRail {
  std::string device;
  uint32_t port = 1;
  uint32_t lid = 0;
  std::string gid;                 // 16 bytes
  uint64_t max_message_bytes = 0;  // 0 = not said
  double speed_gbps = 0;           // 0 = not said
  // "nic_b:1".
  std::string name() const;
};

// Rails of a context taken into account at most: more than any host has,
// and a bound on the queue pairs one (forged) context can make this agent
// create.
inline constexpr size_t kMaxRemoteRails = 32;

// The rails `endpoint` advertises: its `rails` (the first kMaxRemoteRails),
// or its single-rail fields when it has none (a context from an agent with
// one rail).
std::vector<RemoteRail> RemoteRailsOf(const v1::IbverbsEndpoint& endpoint);

// Which of the RemoteRailsOf(`endpoint`) are near the buffer, by index:
// those its `near_rails` name; every rail when it names none that exists
// (a context without affinity: old agents, one rail, nodes unknown).
std::vector<bool> RemoteNearRailsOf(const v1::IbverbsEndpoint& endpoint);
// The same into `near` (resized), reusing its storage: once per op.
void RemoteNearRailsOf(const v1::IbverbsEndpoint& endpoint,
                       std::vector<bool>& near);

// Where a granted buffer is for this agent's WRs: what posting needs of a
// grant (plain values, copied per op without allocating).
struct GrantedBuffer {
  uint32_t rkey = 0;
  uint64_t address = 0;
  uint64_t size_bytes = 0;
};

// What a peer granted this agent for one of its buffers over one session.
struct RemoteGrant {
  std::string token;  // the token that earned it: a cache hit needs it too
  GrantedBuffer buffer;
};

// What a lane's WRs carry to their completions: the lane's name (for their
// errors), and the bytes it carries that have not completed yet (posted,
// or planned by a Submit that is posting them), for placing small ops.
// Apart from the Lane so that completions use it without keeping the lane
// (and its queue pair) alive; shared, so that a WR copies no string.
struct LaneLoad {
  explicit LaneLoad(std::string lane_name) : lane_name(std::move(lane_name)) {}
  const std::string lane_name;  // "nic_a:1->nic_b:1"
  std::atomic<uint64_t> bytes{0};
};

// Health of a lane, shared with its probe (which outlives nothing but
// itself).
struct LaneHealth {
  absl::Mutex mu;
  Cooldown cooldown ABSL_GUARDED_BY(mu);
  // A probe of the lane is in flight.
  bool probing ABSL_GUARDED_BY(mu) = false;
};

// A local rail paired with a remote rail, toward one life (epoch) of one
// peer agent: its requester queue pair, its session on the peer (a PD there
// with what the peer granted it), its load and its health. Owned by the
// Requester's lane table (requester.h) and by the Submits using it.
struct Lane {
  Lane(std::string key, std::string peer, Rail* rail, RemoteRail remote);

  // "nic_a:1->nic_b:1" (the peer is said apart).
  const std::string& name() const { return load->lane_name; }

  const std::string key;   // "agent/epoch/nic_a:1>nic_b:1"
  const std::string peer;  // "agent/epoch"
  Rail* const rail;
  const RemoteRail remote;
  const std::shared_ptr<LaneLoad> load;
  const std::shared_ptr<LaneHealth> health = std::make_shared<LaneHealth>();

  // Guarded by the Requester's mutex: the queue pair (when connected), its
  // session and what it was granted (by remote buffer id). Replaced
  // together when the lane reconnects.
  std::shared_ptr<QueuePairConnection> connection;
  // The peer's handle of the session (kept across reconnects, which
  // present it), when it was last named in a Peer call, and how long the
  // peer keeps it unnamed (zero: for ever).
  std::string session;
  absl::Time session_refreshed;
  absl::Duration session_idle_timeout;
  std::map<uint64_t, RemoteGrant> grants;
};

}  // namespace rdma_agent::ibverbs

#endif  // RDMA_AGENTD_BACKENDS_IBVERBS_RAILS_H_

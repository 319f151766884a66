#ifndef RDMA_AGENTD_BACKENDS_IBVERBS_OPTIONS_H_
#define RDMA_AGENTD_BACKENDS_IBVERBS_OPTIONS_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "backends/ibverbs/memory_node.h"
#include "backends/ibverbs/profiles.h"

namespace rdma_agent::ibverbs {

// Configuration of the ibverbs backend (flags.cc fills it from --ibverbs_*).
struct IbverbsOptions {
  // False: the backend reports itself unavailable.
  bool enabled = true;
  // Devices to use, each port of each one a rail; empty = every
  // device.
  std::vector<std::string> devices;
  // 1-based port used on each device; 0 = every port.
  uint8_t port = 0;
  // "auto" (from each device's vendor and name), "generic", "mlx5", "efa".
  std::string profile = "auto";
  // Overrides of the profile's queue-pair defaults (on every rail).
  QueuePairOverrides qp;
  // Bound on one queue-pair handshake (also bounded by the op's deadline).
  absl::Duration connect_timeout = absl::Seconds(5);
  // How long the completion poller spins before blocking on the channel.
  absl::Duration busy_poll = absl::Microseconds(50);
  // Bound on waiting for a QP in ERR to flush its WRs.
  absl::Duration drain_timeout = absl::Seconds(10);
  // Peer sessions kept at most, in total (each a protection domain of its
  // own with one responder QP), and per caller address (the IP the Peer
  // call came from), so that one source cannot take them all.
  size_t max_responders = 1024;
  size_t max_responders_per_source = 128;
  // A session no ConnectQueuePair or GrantBuffer named for this long is
  // dropped (QP, PD, grants); requesters using one refresh it well before.
  // Sessions also go once every registration proven for them is released.
  absl::Duration responder_idle_timeout = absl::Minutes(10);
  // Registrations one peer session may be granted (one MR each in its PD).
  size_t max_grants_per_peer = 4096;
  // Tasks waiting for the posting threads (what in a posted batch may
  // block: a lane's handshake, grant or full send queue, a probe, a
  // repost), in slots made at start. Past it a lane's ops fail at once
  // with RESOURCE_EXHAUSTED (a probe waits for a later batch) rather than
  // queue without bound. Fixed: no flag.
  size_t max_queued_posting_tasks = 1024;
  // Peer agents (agent id and epoch, as contexts name them) the requesting
  // side keeps lanes, QPs and handshake state for, and Peer channels
  // (addresses) it keeps open; past it the least recently used idle one
  // makes room. State of a peer unused for requester_idle_timeout goes.
  size_t max_requester_peers = 1024;
  absl::Duration requester_idle_timeout = absl::Minutes(5);
  // Distinct peer labels peer_links() reports per direction; the peers
  // with fewer links are summed under "other".
  size_t max_peer_link_labels = 64;
  // Ops of at least this many bytes are split over every rail pair to
  // their peer, in proportion to link speed; smaller ones go whole to the
  // least loaded pair.
  uint64_t stripe_threshold_bytes = 64 << 10;
  // How long a rail pair (or a rail whose port went down) is left out after
  // its completions failed; each further failure in a row doubles it, up to
  // rail_max_cooldown. When it runs out the pair is probed (a zero-length
  // RDMA WRITE) while the others carry the ops, and used again once the
  // probe completes.
  absl::Duration rail_cooldown = absl::Seconds(1);
  absl::Duration rail_max_cooldown = absl::Seconds(30);
  // NUMA affinity (README.md, "Affinity"). kNearest: an op goes over the
  // rails nearest to its buffers on both sides, and over the others only
  // when no near one works or, for striped ops, when the near rails' link
  // speed is below numa_near_share of all rails'. kAll: every rail, as if
  // the host had one node.
  enum class NumaPolicy { kNearest, kAll };
  NumaPolicy numa_policy = NumaPolicy::kNearest;
  double numa_near_share = 0.5;
  // Where the NUMA nodes, their distances and the devices' nodes are read
  // ("/sys" on a host; a test's tree otherwise).
  std::string sysfs_root = "/sys";
  // Where registrations' memory is; nullptr: the kernel's answer
  // (MakeKernelMemoryNodeLocator).
  std::shared_ptr<const MemoryNodeLocator> memory_locator;
};

}  // namespace rdma_agent::ibverbs

#endif  // RDMA_AGENTD_BACKENDS_IBVERBS_OPTIONS_H_

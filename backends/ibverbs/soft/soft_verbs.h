#ifndef RDMA_AGENTD_BACKENDS_IBVERBS_SOFT_SOFT_VERBS_H_
#define RDMA_AGENTD_BACKENDS_IBVERBS_SOFT_SOFT_VERBS_H_

// A software RC NIC: the Verbs interface implemented in process, so that the
// ibverbs backend's logic runs where no RDMA hardware exists.
//
// Devices live on a SoftFabric; every device of a fabric reaches every other
// one (also across backends and agents in one process). It behaves like an RC
// NIC as far as a verbs consumer can tell:
//  - PDs; MRs (ibv_reg_mr, and ibv_reg_dmabuf_mr with any mmap-able fd --
//    a memfd in tests -- standing in for a dma-buf: the soft NIC maps the
//    range itself, MAP_SHARED, as a real NIC reaches device memory by DMA,
//    and WRs address it by its iova; an fd mmap refuses fails with EINVAL
//    or EBADF as the real call does) with lkey/rkey and IBV_ACCESS_* flags,
//    checked on both sides
//    (local key/PD/bounds/LOCAL_WRITE -> IBV_WC_LOC_PROT_ERR, remote key/
//    PD/bounds/REMOTE_READ|WRITE -> IBV_WC_REM_ACCESS_ERR, and the target
//    QP's qp_access_flags -> IBV_WC_REM_ACCESS_ERR, message longer than
//    the port's max_msg_sz -> IBV_WC_LOC_LEN_ERR);
//  - QPs with the RESET -> INIT -> RTR -> RTS -> ERR state machine and the
//    attribute masks ibv_modify_qp requires; ibv_post_send fails with EINVAL
//    below RTS and with ENOMEM when max_send_wr WRs are outstanding (a WR's
//    slot is freed when its completion is polled); WRs posted in, or pending
//    at, ERR complete with IBV_WC_WR_FLUSH_ERR;
//  - RDMA READ/WRITE executed asynchronously, in order per QP, by a worker
//    thread per QP; completions on the CQ with the completion-channel
//    semantics of ibv_req_notify_cq / ibv_get_cq_event;
//  - a requester whose peer QP is gone, not connected back, or on an
//    unreachable device gets IBV_WC_RETRY_EXC_ERR after the transport timeout
//    (4.096 us * 2^timeout * (retry_cnt + 1)), as a real RC QP does; with
//    timeout 0 (infinite) it waits until the QP is moved to ERR;
//  - any error completion moves the QP to ERR (a remote access error moves
//    the responder's QP to ERR too).
// Destroying a QP waits for the WR it is executing, and deregistering an MR
// waits for every copy touching it: after either returns, no byte is moved.
// Fault injection: drop WRs (the requester retry-exceeds or times out), fail
// WRs with a given status, or delay them.
//
// Several devices make a multi-rail host: each has its own link, which can
// be throttled (a token bucket per device applied to the bytes of every WR
// that crosses it, as requester or responder, so that how an agent spreads
// bytes over its rails shows in time and in per-device counters), unplugged
// and replugged (the port goes DOWN: WRs in flight on its QPs and WRs posted
// afterwards retry-exceed after the transport timeout, later ones flush, as
// on hardware; replugged, it is ACTIVE again and new QPs work; port changes
// are told as asynchronous events, IBV_EVENT_PORT_ERR / _ACTIVE), and placed
// on a NUMA node (Device::NumaNode(), where real devices read sysfs).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "backends/ibverbs/verbs.h"

namespace rdma_agent {
namespace verbs {

// One emulated device (one port).
struct SoftDeviceConfig {
  std::string name;
  // 0x02c9 is Mellanox (mlx5 profile), 0x1d0f Amazon (EFA profile).
  uint32_t vendor_id = 0;
  uint32_t vendor_part_id = 0;
  ibv_port_state port_state = IBV_PORT_ACTIVE;
  uint8_t link_layer = IBV_LINK_LAYER_ETHERNET;
  ibv_mtu active_mtu = IBV_MTU_4096;
  uint32_t max_msg_sz = 1u << 30;
  int max_qp_wr = 16384;
  int max_sge = 30;
  int max_cqe = 1 << 20;
  // Link speed as ibv_query_port reports it (see ibv_query_port(3)):
  // active_speed 32 = EDR (25.78125 Gb/s per lane), active_width 2 = 4x,
  // so 103.125 Gb/s by default. verbs::PortSpeedGbps() reads them.
  uint8_t active_speed = 32;
  uint8_t active_width = 2;
  // Bytes per second the device's link carries, over every WR crossing it
  // (as requester or responder); 0 = as fast as memmove.
  uint64_t bytes_per_second = 0;
  // What the link may carry at once after being idle; 0 = 1 ms at
  // bytes_per_second.
  uint64_t burst_bytes = 0;
  // What Device::NumaNode() answers (-1: unknown, like a device without a
  // sysfs numa_node).
  int numa_node = -1;
  // Whether port changes are told to opened contexts as asynchronous events
  // (IBV_EVENT_PORT_ACTIVE / IBV_EVENT_PORT_ERR); false: a device whose
  // changes only ibv_query_port shows.
  bool async_events = true;
};

// A fault applied to WRs as they are posted.
struct SoftFault {
  enum class Action {
    // The WR is lost: never executed; the requester gets
    // IBV_WC_RETRY_EXC_ERR after the transport timeout (or a flush on ERR).
    kDrop,
    // The WR is not executed and completes with `status`.
    kFail,
    // The WR is executed `delay` after it was posted (later WRs of the QP
    // wait behind it, RC is ordered).
    kDelay,
  };
  Action action = Action::kDrop;
  ibv_wc_status status = IBV_WC_GENERAL_ERR;
  absl::Duration delay = absl::ZeroDuration();
  // Requester device it applies to; empty = any.
  std::string device;
  // How many WRs it applies to; negative = every WR until ClearFaults().
  int count = 1;
};

namespace soft_internal {
struct FabricState;
}

// The wire between soft devices. Verbs made from it, and every object made
// from those, keep its state alive, so it may be destroyed first.
class SoftFabric {
 public:
  SoftFabric();
  ~SoftFabric();
  SoftFabric(const SoftFabric&) = delete;
  SoftFabric& operator=(const SoftFabric&) = delete;

  // Adds a device. ALREADY_EXISTS for a duplicate name.
  absl::Status AddDevice(const SoftDeviceConfig& config);
  // A Verbs that sees `devices` of this fabric (all when empty), e.g. one
  // per agent in a test.
  std::unique_ptr<Verbs> MakeVerbs(std::vector<std::string> devices = {});

  // Cuts (false) or restores the path beyond a device's port, which stays
  // ACTIVE (a switch or cable further away): nobody reaches its QPs
  // (requesters retry-exceed) and its own WRs do not get through.
  void SetReachable(const std::string& device, bool reachable);
  // Pulls the device's cable: its port goes DOWN (QueryPort says so), the
  // WR each of its QPs is executing or throttling and every WR after it
  // fail as on hardware (IBV_WC_RETRY_EXC_ERR after the transport timeout,
  // then IBV_WC_WR_FLUSH_ERR: the QP is in ERR), and so do WRs of peers'
  // QPs connected to it. NOT_FOUND for an unknown device.
  absl::Status Unplug(const std::string& device);
  // Plugs it back: the port is ACTIVE again. QPs that went to ERR stay
  // there (as on hardware: their owner reconnects); new QPs, and QPs that
  // carried nothing meanwhile, work. NOT_FOUND for an unknown device.
  absl::Status Replug(const std::string& device);
  // Sets the port's state as the link or the subnet manager would: a port
  // that started DOWN or INIT comes up with IBV_PORT_ACTIVE (what Replug
  // does), and one that stops being ACTIVE is as unplugged for WRs. Every
  // context opened on the device gets IBV_EVENT_PORT_ACTIVE when the port
  // becomes ACTIVE and IBV_EVENT_PORT_ERR when it stops being ACTIVE
  // (Unplug and Replug too), unless its config says no async_events.
  // NOT_FOUND for an unknown device.
  absl::Status SetPortState(const std::string& device, ibv_port_state state);

  void InjectFault(const SoftFault& fault);
  void ClearFaults();

  // WRs that moved bytes successfully, over the fabric's life.
  uint64_t wrs_completed_ok() const;
  // Bytes moved by WRs posted on `device`'s QPs (as requester), over the
  // fabric's life; 0 for an unknown device.
  uint64_t bytes_moved(const std::string& device) const;
  // Bytes moved by peers' WRs through `device`'s QPs (as responder).
  uint64_t bytes_served(const std::string& device) const;
  // Highest number of WRs ever outstanding on one QP.
  int max_outstanding_seen() const;
  // Queue pairs that exist now, over every device.
  size_t live_queue_pairs() const;

 private:
  std::shared_ptr<soft_internal::FabricState> state_;
};

}  // namespace verbs
}  // namespace rdma_agent

#endif  // RDMA_AGENTD_BACKENDS_IBVERBS_SOFT_SOFT_VERBS_H_

#ifndef RDMA_AGENTD_BACKENDS_IBVERBS_VERBS_H_
#define RDMA_AGENTD_BACKENDS_IBVERBS_VERBS_H_

// The device interface the ibverbs backend is written against, shaped after
// the libibverbs calls so that a reader who knows ibv_post_send knows ours.
// Structs and enums are libibverbs' own (ibv_qp_attr, ibv_send_wr, ibv_wc,
// IBV_WC_REM_ACCESS_ERR...). Two implementations: real_verbs.h (libibverbs)
// and soft/soft_verbs.h (a software RC NIC that runs in process).
//
// Every object has exactly one owner (the unique_ptr a factory returns) and
// is released by its destructor (ibv_dereg_mr, ibv_destroy_qp...). Children
// keep what they were created from alive, so destruction order never matters.
// All methods are thread-safe.

#include <infiniband/verbs.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace rdma_agent {
namespace verbs {

// ibv_reg_mr: a registered memory region.
class MemoryRegion {
 public:
  virtual ~MemoryRegion() = default;  // ibv_dereg_mr
  virtual uint32_t lkey() const = 0;
  virtual uint32_t rkey() const = 0;
  virtual void* addr() const = 0;
  virtual size_t length() const = 0;
};

// ibv_create_cq with its own completion channel (ibv_create_comp_channel).
class CompletionQueue {
 public:
  virtual ~CompletionQueue() = default;  // ibv_destroy_cq + channel
  // ibv_poll_cq: moves up to wc.size() completions into `wc`; returns how
  // many.
  virtual absl::StatusOr<int> Poll(absl::Span<ibv_wc> wc) = 0;
  // ibv_req_notify_cq(cq, 0): arms the channel for the next completion.
  virtual absl::Status RequestNotify() = 0;
  // ibv_get_cq_event + ibv_ack_cq_events: waits at most `timeout` for an
  // event of an armed CQ. True when one came, false on timeout.
  virtual absl::StatusOr<bool> WaitForEvent(absl::Duration timeout) = 0;
};

// What ibv_create_qp needs (ibv_qp_init_attr without the raw CQ pointers).
struct QueuePairInit {
  CompletionQueue* send_cq = nullptr;  // must outlive the QP
  CompletionQueue* recv_cq = nullptr;  // must outlive the QP
  ibv_qp_cap cap = {};
  ibv_qp_type qp_type = IBV_QPT_RC;
  bool sq_sig_all = false;
};

// ibv_create_qp: a queue pair.
class QueuePair {
 public:
  virtual ~QueuePair() = default;  // ibv_destroy_qp
  virtual uint32_t qp_num() const = 0;
  // ibv_modify_qp. Fails (INVALID_ARGUMENT, with the errno in the message)
  // on an illegal transition or missing attributes, like the real call.
  virtual absl::Status Modify(ibv_qp_attr& attr, int attr_mask) = 0;
  // ibv_query_qp(IBV_QP_STATE).
  virtual absl::StatusOr<ibv_qp_state> QueryState() = 0;
  // ibv_post_send: returns 0 or an errno (EINVAL in a state that cannot
  // send, ENOMEM when the send queue is full) and sets *bad_wr to the first
  // WR not posted.
  virtual int PostSend(ibv_send_wr* wr, ibv_send_wr** bad_wr) = 0;
};

// ibv_alloc_pd: a protection domain.
class ProtectionDomain {
 public:
  virtual ~ProtectionDomain() = default;  // ibv_dealloc_pd
  // ibv_reg_mr with IBV_ACCESS_* flags.
  virtual absl::StatusOr<std::unique_ptr<MemoryRegion>> RegisterMemory(
      void* addr, size_t length, int access) = 0;
  // ibv_reg_dmabuf_mr: registers [offset, offset + length) of the dma-buf
  // `fd` (device memory; never mapped by the caller), which WRs then
  // address as [iova, iova + length): local SGEs and remote addresses alike.
  // The MR keeps the dma-buf itself; `fd` stays the caller's. Fails
  // (INVALID_ARGUMENT with the errno) for an fd that is no dma-buf or a
  // range outside it, like the real call.
  virtual absl::StatusOr<std::unique_ptr<MemoryRegion>> RegisterDmaBuf(
      uint64_t offset, size_t length, uint64_t iova, int fd, int access) = 0;
  // ibv_create_qp.
  virtual absl::StatusOr<std::unique_ptr<QueuePair>> CreateQueuePair(
      const QueuePairInit& init) = 0;
};

// An asynchronous event of a device (ibv_get_async_event): its type and,
// for port events (IBV_EVENT_PORT_ACTIVE, IBV_EVENT_PORT_ERR, ...), the
// port it is about.
struct AsyncEvent {
  ibv_event_type type = IBV_EVENT_DEVICE_FATAL;
  uint8_t port = 0;  // 0 for events that are not about a port
};

// ibv_open_device: an opened device context.
class Device {
 public:
  virtual ~Device() = default;  // ibv_close_device
  virtual const std::string& name() const = 0;
  // ibv_query_device.
  virtual absl::StatusOr<ibv_device_attr> Query() = 0;
  // ibv_query_port (1-based port).
  virtual absl::StatusOr<ibv_port_attr> QueryPort(uint8_t port) = 0;
  // ibv_query_gid.
  virtual absl::StatusOr<ibv_gid> QueryGid(uint8_t port, int index) = 0;
  // NUMA node the device is attached to, as sysfs tells
  // (/sys/class/infiniband/<name>/device/numa_node); -1 when unknown (no
  // NUMA, or a virtual device).
  virtual int NumaNode() const = 0;
  // ibv_get_async_event + ibv_ack_async_event: the device's next
  // asynchronous event, waiting at most `timeout` for it (poll(2) on the
  // context's async_fd); nullopt when none came. Events of this context
  // only, each reported once, in order; one caller at a time.
  virtual absl::StatusOr<std::optional<AsyncEvent>> GetAsyncEvent(
      absl::Duration timeout) = 0;
  virtual absl::StatusOr<std::unique_ptr<ProtectionDomain>>
  AllocateProtectionDomain() = 0;
  // ibv_create_cq with at least `cqe` entries and a completion channel.
  virtual absl::StatusOr<std::unique_ptr<CompletionQueue>>
  CreateCompletionQueue(int cqe) = 0;
};

// A provider of devices: ibv_get_device_list / ibv_open_device.
class Verbs {
 public:
  virtual ~Verbs() = default;
  // Names of the devices present (empty when there are none).
  virtual absl::StatusOr<std::vector<std::string>> ListDevices() = 0;
  // NOT_FOUND when no such device.
  virtual absl::StatusOr<std::unique_ptr<Device>> OpenDevice(
      const std::string& name) = 0;
};

// "IBV_WC_REM_ACCESS_ERR"-style names for messages.
std::string WcStatusName(ibv_wc_status status);
// "RTS", "ERR"...
std::string QpStateName(ibv_qp_state state);
// "ACTIVE", "DOWN"...
std::string PortStateName(ibv_port_state state);
// "IBV_EVENT_PORT_ACTIVE"-style names for logs.
std::string AsyncEventName(ibv_event_type type);
// IBV_MTU_1024 -> 1024; 0 for an unknown value.
uint32_t MtuBytes(ibv_mtu mtu);
// 1024 -> IBV_MTU_1024; INVALID_ARGUMENT unless one of 256..4096.
absl::StatusOr<ibv_mtu> MtuFromBytes(uint32_t bytes);
// Link speed of a port in Gbit/s, from active_speed and active_width.
double PortSpeedGbps(const ibv_port_attr& port);
// "fe80::..." form of a GID.
std::string GidToString(const ibv_gid& gid);

}  // namespace verbs
}  // namespace rdma_agent

#endif  // RDMA_AGENTD_BACKENDS_IBVERBS_VERBS_H_

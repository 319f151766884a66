#include "backends/ibverbs/soft/soft_verbs.h"

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"

namespace rdma_agent {
namespace verbs {
namespace soft_internal {

struct MrEntry {
  // What WRs address: [addr, addr + length). The virtual address for
  // ibv_reg_mr; the iova for ibv_reg_dmabuf_mr.
  uintptr_t addr = 0;
  size_t length = 0;
  // Where the bytes are in this process: addr itself for ibv_reg_mr, the
  // soft NIC's own mapping of the dma-buf range for ibv_reg_dmabuf_mr.
  uintptr_t host = 0;
  int access = 0;
  uint64_t pd_id = 0;
};

// A link's capacity: a token bucket that WRs crossing it draw on. Bytes
// are reserved when a WR starts (going into debt if needed), so WRs of
// every QP on the device share the rate in the order they start, and a
// steady stream gets exactly bytes_per_second.
class TokenBucket {
 public:
  void Configure(uint64_t bytes_per_second, uint64_t burst_bytes) {
    absl::MutexLock lock(&mu_);
    rate_ = static_cast<double>(bytes_per_second);
    if (bytes_per_second == 0) return;
    if (burst_bytes == 0) burst_bytes = bytes_per_second / 1000;  // 1 ms
    window_ = absl::Seconds(static_cast<double>(burst_bytes) / rate_);
  }

  // Takes `bytes`; returns when they may go (in the past: now).
  absl::Time Reserve(uint64_t bytes) {
    absl::MutexLock lock(&mu_);
    if (rate_ == 0) return absl::InfinitePast();
    // Never more than a burst of credit from idle time.
    zero_ = std::max(zero_, absl::Now() - window_) +
            absl::Seconds(static_cast<double>(bytes) / rate_);
    return zero_;
  }

 private:
  absl::Mutex mu_;
  double rate_ ABSL_GUARDED_BY(mu_) = 0;  // bytes per second; 0 = unlimited
  absl::Duration window_ ABSL_GUARDED_BY(mu_);
  // When the bucket is empty: it holds (now - zero_) * rate_ bytes, at most
  // a burst.
  absl::Time zero_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

// One opened context's asynchronous events, in order.
struct AsyncEventQueue {
  absl::Mutex mu;
  std::deque<AsyncEvent> events ABSL_GUARDED_BY(mu);
};

struct DeviceState {
  SoftDeviceConfig config;
  uint16_t lid = 0;
  ibv_gid gid = {};
  // SetReachable: the path beyond the port.
  std::atomic<bool> reachable{true};
  // Unplug/Replug: what QueryPort reports.
  std::atomic<int> port_state{IBV_PORT_ACTIVE};
  TokenBucket link;
  std::atomic<uint64_t> bytes_moved{0};   // as requester
  std::atomic<uint64_t> bytes_served{0};  // as responder

  // Whether WRs get through this device's port.
  bool Up() const { return reachable && port_state == IBV_PORT_ACTIVE; }

  // The event queues of the contexts opened on it (as each ibv_context has
  // its own async_fd).
  absl::Mutex events_mu;
  std::vector<std::weak_ptr<AsyncEventQueue>> listeners
      ABSL_GUARDED_BY(events_mu);
  // Sets the port's state; when it becomes ACTIVE or stops being ACTIVE,
  // tells every opened context (IBV_EVENT_PORT_ACTIVE / IBV_EVENT_PORT_ERR),
  // unless the device is configured to send no events.
  void SetPortState(ibv_port_state state) {
    const bool was_active = port_state.exchange(state) == IBV_PORT_ACTIVE;
    const bool active = state == IBV_PORT_ACTIVE;
    if (was_active == active || !config.async_events) return;
    const AsyncEvent event = {
        active ? IBV_EVENT_PORT_ACTIVE : IBV_EVENT_PORT_ERR, 1};
    absl::MutexLock lock(&events_mu);
    for (const auto& weak : listeners) {
      if (auto queue = weak.lock()) {
        absl::MutexLock queue_lock(&queue->mu);
        queue->events.push_back(event);
      }
    }
  }
  // Copies hold it shared; MR (de)registration exclusive, so that a
  // deregistered MR is never touched again.
  absl::Mutex mr_mu;
  absl::flat_hash_map<uint32_t, MrEntry> mrs ABSL_GUARDED_BY(mr_mu);
};

struct QpState;

struct CqState {
  struct Entry {
    ibv_wc wc;
    std::weak_ptr<QpState> qp;
  };
  absl::Mutex mu;
  std::deque<Entry> entries ABSL_GUARDED_BY(mu);
  size_t capacity = 0;
  bool armed ABSL_GUARDED_BY(mu) = false;
  bool event ABSL_GUARDED_BY(mu) = false;
  bool overrun ABSL_GUARDED_BY(mu) = false;
};

struct SoftWr {
  uint64_t wr_id = 0;
  ibv_wr_opcode opcode = IBV_WR_RDMA_WRITE;
  bool signaled = false;
  // Inline: posting allocates nothing, as with a real provider.
  absl::InlinedVector<ibv_sge, 4> sges;
  uint64_t remote_addr = 0;
  uint32_t rkey = 0;
  absl::Time ready_at = absl::InfinitePast();
  enum class Fate { kExecute, kDrop, kFail } fate = Fate::kExecute;
  ibv_wc_status fail_status = IBV_WC_GENERAL_ERR;
};

// A QP's send queue: WRs posted and not executed yet, at most max_send_wr
// (PostSend refuses more), in slots made with the QP so that posting
// allocates nothing, as with a real provider.
class SendQueue {
 public:
  void Resize(size_t slots) { slots_.resize(slots); }
  bool empty() const { return size_ == 0; }
  bool full() const { return size_ == slots_.size(); }
  SoftWr& front() { return slots_[head_]; }
  void push_back(SoftWr wr) {
    slots_[(head_ + size_) % slots_.size()] = std::move(wr);
    ++size_;
  }
  void pop_front() {
    head_ = (head_ + 1) % slots_.size();
    --size_;
  }
  void clear() { head_ = size_ = 0; }

 private:
  std::vector<SoftWr> slots_;
  size_t head_ = 0;
  size_t size_ = 0;
};

struct FabricState;

struct QpState {
  uint32_t qpn = 0;
  std::shared_ptr<FabricState> fabric;
  std::shared_ptr<DeviceState> device;
  uint64_t pd_id = 0;
  std::shared_ptr<CqState> cq;
  std::weak_ptr<QpState> weak;  // itself, for completions
  int max_send_wr = 0;
  int max_send_sge = 0;
  bool sq_sig_all = false;

  absl::Mutex mu;
  ibv_qp_state state ABSL_GUARDED_BY(mu) = IBV_QPS_RESET;
  int access_flags ABSL_GUARDED_BY(mu) = 0;
  uint32_t dest_qpn ABSL_GUARDED_BY(mu) = 0;
  ibv_ah_attr ah ABSL_GUARDED_BY(mu) = {};
  uint8_t timeout ABSL_GUARDED_BY(mu) = 0;
  uint8_t retry_cnt ABSL_GUARDED_BY(mu) = 0;
  uint8_t max_dest_rd_atomic ABSL_GUARDED_BY(mu) = 0;
  int outstanding ABSL_GUARDED_BY(mu) = 0;
  SendQueue queue ABSL_GUARDED_BY(mu);
  bool stopping ABSL_GUARDED_BY(mu) = false;
};

struct FabricState {
  absl::Mutex mu;
  std::map<std::string, std::shared_ptr<DeviceState>> devices
      ABSL_GUARDED_BY(mu);
  std::map<uint32_t, std::weak_ptr<QpState>> qps ABSL_GUARDED_BY(mu);
  std::vector<SoftFault> faults ABSL_GUARDED_BY(mu);
  uint32_t next_qpn ABSL_GUARDED_BY(mu) = 0x11;
  uint32_t next_key ABSL_GUARDED_BY(mu) = 0x1000;
  uint16_t next_lid ABSL_GUARDED_BY(mu) = 1;
  uint64_t next_pd ABSL_GUARDED_BY(mu) = 1;
  std::atomic<uint64_t> ok_count{0};
  std::atomic<int> max_outstanding{0};
  // Changes whenever a port goes down or up or a path is cut or restored,
  // so that WRs waiting for their link look again.
  std::atomic<uint64_t> link_generation{0};

  // The fault that applies to the next WR posted on `device`, consumed.
  bool TakeFault(const std::string& device, SoftFault* out) {
    absl::MutexLock lock(&mu);
    for (auto it = faults.begin(); it != faults.end(); ++it) {
      if (!it->device.empty() && it->device != device) continue;
      *out = *it;
      if (it->count > 0 && --it->count == 0) faults.erase(it);
      return true;
    }
    return false;
  }
};

}  // namespace soft_internal

namespace {

using soft_internal::AsyncEventQueue;
using soft_internal::CqState;
using soft_internal::DeviceState;
using soft_internal::FabricState;
using soft_internal::MrEntry;
using soft_internal::QpState;
using soft_internal::SoftWr;

absl::Status Errno(absl::string_view call, int err, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat(call, ": ", std::strerror(err), " (", why, ")"));
}

// --- Completion queue -----------------------------------------------------

class SoftCompletionQueue : public CompletionQueue {
 public:
  SoftCompletionQueue(std::shared_ptr<DeviceState> device, size_t capacity)
      : device_(std::move(device)), state_(std::make_shared<CqState>()) {
    state_->capacity = capacity;
  }

  absl::StatusOr<int> Poll(absl::Span<ibv_wc> wc) override {
    // Inline for the poller's usual batch: polling allocates nothing.
    absl::InlinedVector<std::weak_ptr<QpState>, 32> freed;
    int n = 0;
    {
      absl::MutexLock lock(&state_->mu);
      if (state_->overrun) {
        return absl::InternalError("ibv_poll_cq: completion queue overrun");
      }
      while (n < static_cast<int>(wc.size()) && !state_->entries.empty()) {
        wc[n++] = state_->entries.front().wc;
        freed.push_back(std::move(state_->entries.front().qp));
        state_->entries.pop_front();
      }
    }
    // A send-queue slot is free once its completion has been polled.
    for (auto& weak : freed) {
      if (auto qp = weak.lock()) {
        absl::MutexLock lock(&qp->mu);
        if (qp->outstanding > 0) --qp->outstanding;
      }
    }
    return n;
  }

  absl::Status RequestNotify() override {
    absl::MutexLock lock(&state_->mu);
    state_->armed = true;
    return absl::OkStatus();
  }

  absl::StatusOr<bool> WaitForEvent(absl::Duration timeout) override {
    absl::MutexLock lock(&state_->mu);
    state_->mu.AwaitWithTimeout(absl::Condition(&state_->event), timeout);
    if (!state_->event) return false;
    state_->event = false;
    return true;
  }

  const std::shared_ptr<CqState>& state() const { return state_; }

 private:
  std::shared_ptr<DeviceState> device_;
  std::shared_ptr<CqState> state_;
};

void PushCompletion(CqState& cq, const ibv_wc& wc, std::weak_ptr<QpState> qp) {
  absl::MutexLock lock(&cq.mu);
  if (cq.entries.size() >= cq.capacity) {
    cq.overrun = true;
    return;
  }
  cq.entries.push_back({wc, std::move(qp)});
  if (cq.armed) {
    cq.armed = false;
    cq.event = true;
  }
}

// --- Memory region --------------------------------------------------------

// The soft NIC's mapping of a dma-buf range (what a real NIC reaches by
// DMA): MAP_SHARED, so bytes moved land in the memory the fd names.
class DmaBufMapping {
 public:
  // Maps [offset, offset + length) of `fd`; mmap needs a page-aligned file
  // offset, so the mapping starts at the page holding `offset`.
  static absl::StatusOr<DmaBufMapping> Map(int fd, uint64_t offset,
                                           size_t length) {
    const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    const uint64_t skip = offset % page;
    const size_t span = length + skip;
    void* base = ::mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                        static_cast<off_t>(offset - skip));
    if (base == MAP_FAILED) {
      const int err = errno;
      return Errno("ibv_reg_dmabuf_mr", err, "the fd cannot be mapped");
    }
    return DmaBufMapping(base, span, skip);
  }
  DmaBufMapping(DmaBufMapping&& other) noexcept
      : base_(std::exchange(other.base_, nullptr)),
        span_(other.span_),
        skip_(other.skip_) {}
  DmaBufMapping& operator=(DmaBufMapping&&) = delete;
  ~DmaBufMapping() {
    if (base_ != nullptr) ::munmap(base_, span_);
  }
  // The first byte of the registered range.
  uintptr_t start() const { return reinterpret_cast<uintptr_t>(base_) + skip_; }

 private:
  DmaBufMapping(void* base, size_t span, uint64_t skip)
      : base_(base), span_(span), skip_(skip) {}
  void* base_;
  size_t span_;
  uint64_t skip_;
};

class SoftMemoryRegion : public MemoryRegion {
 public:
  SoftMemoryRegion(std::shared_ptr<DeviceState> device, uint32_t key,
                   void* addr, size_t length,
                   std::optional<DmaBufMapping> mapping = std::nullopt)
      : device_(std::move(device)),
        key_(key),
        addr_(addr),
        length_(length),
        mapping_(std::move(mapping)) {}
  ~SoftMemoryRegion() override {
    // Exclusive: waits for copies in progress, and none starts after; the
    // dma-buf mapping (if any) goes after that.
    absl::WriterMutexLock lock(&device_->mr_mu);
    device_->mrs.erase(key_);
  }
  uint32_t lkey() const override { return key_; }
  uint32_t rkey() const override { return key_; }
  void* addr() const override { return addr_; }
  size_t length() const override { return length_; }

 private:
  std::shared_ptr<DeviceState> device_;
  const uint32_t key_;
  void* const addr_;
  const size_t length_;
  const std::optional<DmaBufMapping> mapping_;
};

// --- Queue pair -----------------------------------------------------------

absl::Duration TransportTimeout(uint8_t timeout, uint8_t retry_cnt) {
  if (timeout == 0) return absl::InfiniteDuration();  // IB: 0 = infinite
  return absl::Nanoseconds(4096) * (int64_t{1} << std::min<int>(timeout, 31)) *
         (retry_cnt + 1);
}

class SoftQueuePair : public QueuePair {
 public:
  explicit SoftQueuePair(std::shared_ptr<QpState> state)
      : state_(std::move(state)) {
    worker_ = std::thread([qp = state_.get()] { Run(*qp); });
    // The NIC's own thread, told apart from the backend's (which it would
    // otherwise be named after: threads inherit their creator's name).
    pthread_setname_np(worker_.native_handle(), "soft-nic-qp");
  }

  ~SoftQueuePair() override {
    {
      absl::MutexLock lock(&state_->mu);
      state_->stopping = true;
    }
    // Joined before returning: the WR being executed has finished copying.
    worker_.join();
    absl::MutexLock lock(&state_->fabric->mu);
    state_->fabric->qps.erase(state_->qpn);
  }

  uint32_t qp_num() const override { return state_->qpn; }

  absl::StatusOr<ibv_qp_state> QueryState() override {
    absl::MutexLock lock(&state_->mu);
    return state_->state;
  }

  absl::Status Modify(ibv_qp_attr& attr, int mask) override {
    QpState& qp = *state_;
    absl::MutexLock lock(&qp.mu);
    if (!(mask & IBV_QP_STATE)) {
      return Errno("ibv_modify_qp", EINVAL, "only state transitions");
    }
    if ((mask & IBV_QP_CUR_STATE) && attr.cur_qp_state != qp.state) {
      return Errno("ibv_modify_qp", EINVAL, "cur_qp_state mismatch");
    }
    const ibv_qp_state from = qp.state;
    const auto need = [&](int required, absl::string_view what) {
      return (mask & required) == required
                 ? absl::OkStatus()
                 : Errno("ibv_modify_qp", EINVAL,
                         absl::StrCat(QpStateName(from), "->",
                                      QpStateName(attr.qp_state), " needs ",
                                      what));
    };
    switch (attr.qp_state) {
      case IBV_QPS_RESET:
        qp.queue.clear();
        qp.outstanding = 0;
        qp.state = IBV_QPS_RESET;
        return absl::OkStatus();
      case IBV_QPS_ERR:
        qp.state = IBV_QPS_ERR;  // the worker flushes what is queued
        return absl::OkStatus();
      case IBV_QPS_INIT: {
        if (from != IBV_QPS_RESET && from != IBV_QPS_INIT) break;
        if (from == IBV_QPS_RESET) {
          absl::Status s =
              need(IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
                   "PKEY_INDEX|PORT|ACCESS_FLAGS");
          if (!s.ok()) return s;
        }
        if ((mask & IBV_QP_PORT) && attr.port_num != 1) {
          return Errno("ibv_modify_qp", EINVAL, "no such port");
        }
        if (mask & IBV_QP_ACCESS_FLAGS) {
          qp.access_flags = static_cast<int>(attr.qp_access_flags);
        }
        qp.state = IBV_QPS_INIT;
        return absl::OkStatus();
      }
      case IBV_QPS_RTR: {
        if (from != IBV_QPS_INIT) break;
        absl::Status s =
            need(IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                     IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER,
                 "AV|PATH_MTU|DEST_QPN|RQ_PSN|"
                 "MAX_DEST_RD_ATOMIC|MIN_RNR_TIMER");
        if (!s.ok()) return s;
        if (attr.path_mtu > qp.device->config.active_mtu) {
          return Errno("ibv_modify_qp", EINVAL,
                       "path_mtu above the port's active MTU");
        }
        if (!attr.ah_attr.is_global && attr.ah_attr.dlid == 0) {
          return Errno("ibv_modify_qp", EINVAL, "address has no GID or LID");
        }
        qp.dest_qpn = attr.dest_qp_num;
        qp.ah = attr.ah_attr;
        qp.max_dest_rd_atomic = attr.max_dest_rd_atomic;
        qp.state = IBV_QPS_RTR;
        return absl::OkStatus();
      }
      case IBV_QPS_RTS: {
        if (from != IBV_QPS_RTR && from != IBV_QPS_RTS) break;
        if (from == IBV_QPS_RTR) {
          absl::Status s =
              need(IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                       IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC,
                   "TIMEOUT|RETRY_CNT|RNR_RETRY|SQ_PSN|"
                   "MAX_QP_RD_ATOMIC");
          if (!s.ok()) return s;
        }
        if (mask & IBV_QP_TIMEOUT) qp.timeout = attr.timeout;
        if (mask & IBV_QP_RETRY_CNT) qp.retry_cnt = attr.retry_cnt;
        qp.state = IBV_QPS_RTS;
        return absl::OkStatus();
      }
      default:
        break;
    }
    return Errno("ibv_modify_qp", EINVAL,
                 absl::StrCat("illegal transition ", QpStateName(from), "->",
                              QpStateName(attr.qp_state)));
  }

  int PostSend(ibv_send_wr* wr, ibv_send_wr** bad_wr) override {
    QpState& qp = *state_;
    absl::MutexLock lock(&qp.mu);
    for (; wr != nullptr; wr = wr->next) {
      int err = 0;
      if (qp.state == IBV_QPS_RESET || qp.state == IBV_QPS_INIT ||
          qp.state == IBV_QPS_RTR) {
        err = EINVAL;
      } else if (wr->opcode != IBV_WR_RDMA_WRITE &&
                 wr->opcode != IBV_WR_RDMA_READ) {
        err = EINVAL;  // this NIC only does one-sided ops
      } else if (wr->num_sge < 0 || wr->num_sge > qp.max_send_sge) {
        err = EINVAL;
      } else if (qp.outstanding >= qp.max_send_wr || qp.queue.full()) {
        err = ENOMEM;
      }
      if (err != 0) {
        if (bad_wr != nullptr) *bad_wr = wr;
        return err;
      }
      SoftWr soft;
      soft.wr_id = wr->wr_id;
      soft.opcode = wr->opcode;
      soft.signaled = qp.sq_sig_all || (wr->send_flags & IBV_SEND_SIGNALED);
      soft.sges.assign(wr->sg_list, wr->sg_list + wr->num_sge);
      soft.remote_addr = wr->wr.rdma.remote_addr;
      soft.rkey = wr->wr.rdma.rkey;
      SoftFault fault;
      if (qp.fabric->TakeFault(qp.device->config.name, &fault)) {
        switch (fault.action) {
          case SoftFault::Action::kDrop:
            soft.fate = SoftWr::Fate::kDrop;
            break;
          case SoftFault::Action::kFail:
            soft.fate = SoftWr::Fate::kFail;
            soft.fail_status = fault.status;
            break;
          case SoftFault::Action::kDelay:
            soft.ready_at = absl::Now() + fault.delay;
            break;
        }
      }
      qp.queue.push_back(std::move(soft));
      ++qp.outstanding;
      int seen = qp.fabric->max_outstanding.load();
      while (qp.outstanding > seen &&
             !qp.fabric->max_outstanding.compare_exchange_weak(
                 seen, qp.outstanding)) {
      }
    }
    return 0;
  }

 private:
  // The per-QP "hardware": executes WRs in order, asynchronously.
  static void Run(QpState& qp) {
    while (true) {
      SoftWr wr;
      {
        absl::MutexLock lock(&qp.mu);
        while (true) {
          qp.mu.Await(absl::Condition(
              +[](QpState* q) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                return q->stopping || !q->queue.empty();
              },
              &qp));
          if (qp.stopping) return;
          const absl::Time ready = qp.queue.front().ready_at;
          if (qp.state == IBV_QPS_ERR || absl::Now() >= ready) break;
          // Delayed WR: wait, unless the QP errors (then it is flushed).
          qp.mu.AwaitWithDeadline(
              absl::Condition(
                  +[](QpState* q) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                    return q->stopping || q->queue.empty() ||
                           q->state == IBV_QPS_ERR;
                  },
                  &qp),
              ready);
        }
        wr = std::move(qp.queue.front());
        qp.queue.pop_front();
      }
      Complete(qp, wr, Execute(qp, wr));
    }
  }

  // Waits out the transport timeout of an unanswered WR.
  static ibv_wc_status RetryExceeded(QpState& qp) {
    absl::MutexLock lock(&qp.mu);
    qp.mu.AwaitWithTimeout(absl::Condition(
                               +[](QpState* q) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                 return q->stopping || q->state == IBV_QPS_ERR;
                               },
                               &qp),
                           TransportTimeout(qp.timeout, qp.retry_cnt));
    return qp.state == IBV_QPS_ERR ? IBV_WC_WR_FLUSH_ERR : IBV_WC_RETRY_EXC_ERR;
  }

  // The QP a WR of `qp` reaches and what it allows, or no qp when nobody
  // answers (gone, not addressed by us, unreachable, or not connected back).
  struct Responder {
    std::shared_ptr<QpState> qp;
    int access = 0;
    uint8_t rd_atomic = 0;
  };
  static Responder FindResponder(QpState& qp) {
    uint32_t dest_qpn;
    ibv_ah_attr ah;
    {
      absl::MutexLock lock(&qp.mu);
      dest_qpn = qp.dest_qpn;
      ah = qp.ah;
    }
    Responder found;
    // Looked up without holding our own QP's lock.
    std::shared_ptr<QpState> peer;
    {
      absl::MutexLock lock(&qp.fabric->mu);
      auto it = qp.fabric->qps.find(dest_qpn);
      if (it != qp.fabric->qps.end()) peer = it->second.lock();
    }
    const bool addressed =
        peer != nullptr &&
        (ah.is_global ? std::memcmp(ah.grh.dgid.raw, peer->device->gid.raw,
                                    sizeof(ibv_gid)) == 0
                      : ah.dlid == peer->device->lid);
    if (!addressed || !peer->device->Up()) return found;
    absl::MutexLock lock(&peer->mu);
    // A responder that is not connected back to us does not answer.
    const bool listening =
        (peer->state == IBV_QPS_RTR || peer->state == IBV_QPS_RTS) &&
        peer->dest_qpn == qp.qpn;
    if (!listening) return found;
    found.access = peer->access_flags;
    found.rd_atomic = peer->max_dest_rd_atomic;
    found.qp = std::move(peer);
    return found;
  }

  enum class LinkWait { kGo, kFlushed, kDown };

  // Waits until both links (ours and the responder's device) can carry
  // `bytes`: kFlushed when the QP went to ERR meanwhile, kDown when either
  // port went down or its path was cut.
  static LinkWait AwaitLinks(QpState& qp, DeviceState& far, uint64_t bytes) {
    absl::Time ready = qp.device->link.Reserve(bytes);
    // A loopback WR crosses its device's link once.
    if (&far != qp.device.get())
      ready = std::max(ready, far.link.Reserve(bytes));
    while (absl::Now() < ready) {
      const uint64_t generation = qp.fabric->link_generation;
      struct Wake {
        QpState* qp;
        uint64_t generation;
      } wake{&qp, generation};
      absl::MutexLock lock(&qp.mu);
      qp.mu.AwaitWithDeadline(
          absl::Condition(
              +[](Wake* w) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                return w->qp->stopping || w->qp->state == IBV_QPS_ERR ||
                       w->qp->fabric->link_generation != w->generation;
              },
              &wake),
          ready);
      if (qp.stopping || qp.state == IBV_QPS_ERR) return LinkWait::kFlushed;
      if (!qp.device->Up() || !far.Up()) return LinkWait::kDown;
    }
    return LinkWait::kGo;
  }

  static ibv_wc_status Execute(QpState& qp, const SoftWr& wr) {
    {
      absl::MutexLock lock(&qp.mu);
      if (qp.state == IBV_QPS_ERR) return IBV_WC_WR_FLUSH_ERR;
    }
    if (wr.fate == SoftWr::Fate::kFail) return wr.fail_status;
    if (wr.fate == SoftWr::Fate::kDrop || !qp.device->Up()) {
      return RetryExceeded(qp);
    }
    uint64_t total = 0;
    for (const ibv_sge& sge : wr.sges) total += sge.length;
    if (total > qp.device->config.max_msg_sz) return IBV_WC_LOC_LEN_ERR;

    Responder peer = FindResponder(qp);
    if (peer.qp == nullptr) return RetryExceeded(qp);
    if (total > 0) {
      switch (AwaitLinks(qp, *peer.qp->device, total)) {
        case LinkWait::kFlushed:
          return IBV_WC_WR_FLUSH_ERR;
        case LinkWait::kDown:
          return RetryExceeded(qp);
        case LinkWait::kGo:
          break;
      }
      // Whoever answers once the bytes go.
      peer = FindResponder(qp);
      if (peer.qp == nullptr) return RetryExceeded(qp);
    }

    const bool read = wr.opcode == IBV_WR_RDMA_READ;
    ibv_wc_status status = IBV_WC_SUCCESS;
    if (read && peer.rd_atomic == 0) {
      status = IBV_WC_REM_INV_REQ_ERR;
    } else if (!(peer.access &
                 (read ? IBV_ACCESS_REMOTE_READ : IBV_ACCESS_REMOTE_WRITE))) {
      status = IBV_WC_REM_ACCESS_ERR;
    } else {
      status = Copy(qp, *peer.qp, wr, read, total);
    }
    if (status == IBV_WC_REM_ACCESS_ERR || status == IBV_WC_REM_INV_REQ_ERR) {
      absl::MutexLock lock(&peer.qp->mu);
      peer.qp->state = IBV_QPS_ERR;  // the responder errors too
    }
    if (status == IBV_WC_SUCCESS) {
      qp.device->bytes_moved += total;
      peer.qp->device->bytes_served += total;
    }
    return status;
  }

  // Checks keys, PDs, bounds and access on both sides, then moves the bytes,
  // holding both MR tables so that no MR is deregistered mid-copy.
  static ibv_wc_status Copy(QpState& qp, QpState& peer, const SoftWr& wr,
                            bool read, uint64_t total) {
    DeviceState* a = qp.device.get();
    DeviceState* b = peer.device.get();
    if (b < a) std::swap(a, b);
    absl::ReaderMutexLock lock_a(&a->mr_mu);
    std::unique_ptr<absl::ReaderMutexLock> lock_b;
    if (b != a) lock_b = std::make_unique<absl::ReaderMutexLock>(&b->mr_mu);

    const auto& local_mrs = qp.device->mrs;
    // Where each SGE's bytes are (its MR's translation of sge.addr).
    absl::InlinedVector<uintptr_t, 4> local_bytes;
    for (const ibv_sge& sge : wr.sges) {
      auto it = local_mrs.find(sge.lkey);
      if (it == local_mrs.end()) return IBV_WC_LOC_PROT_ERR;
      const MrEntry& mr = it->second;
      if (mr.pd_id != qp.pd_id || sge.addr < mr.addr ||
          sge.length > mr.length ||
          sge.addr - mr.addr > mr.length - sge.length) {
        return IBV_WC_LOC_PROT_ERR;
      }
      if (read && !(mr.access & IBV_ACCESS_LOCAL_WRITE)) {
        return IBV_WC_LOC_PROT_ERR;
      }
      local_bytes.push_back(mr.host + (sge.addr - mr.addr));
    }
    // A zero-length RDMA op names no remote memory: as on hardware, its
    // rkey and address are not checked (a liveness probe uses one).
    if (total == 0) return IBV_WC_SUCCESS;
    const auto& remote_mrs = peer.device->mrs;
    auto it = remote_mrs.find(wr.rkey);
    if (it == remote_mrs.end()) return IBV_WC_REM_ACCESS_ERR;
    const MrEntry& rmr = it->second;
    if (rmr.pd_id != peer.pd_id || wr.remote_addr < rmr.addr ||
        total > rmr.length || wr.remote_addr - rmr.addr > rmr.length - total ||
        !(rmr.access &
          (read ? IBV_ACCESS_REMOTE_READ : IBV_ACCESS_REMOTE_WRITE))) {
      return IBV_WC_REM_ACCESS_ERR;
    }
    uintptr_t remote = rmr.host + (wr.remote_addr - rmr.addr);
    for (size_t i = 0; i < wr.sges.size(); ++i) {
      const ibv_sge& sge = wr.sges[i];
      void* local = reinterpret_cast<void*>(local_bytes[i]);
      void* far = reinterpret_cast<void*>(remote);
      if (read) {
        std::memmove(local, far, sge.length);
      } else {
        std::memmove(far, local, sge.length);
      }
      remote += sge.length;
    }
    return IBV_WC_SUCCESS;
  }

  static void Complete(QpState& qp, const SoftWr& wr, ibv_wc_status status) {
    bool report = wr.signaled || status != IBV_WC_SUCCESS;
    {
      absl::MutexLock lock(&qp.mu);
      if (status != IBV_WC_SUCCESS && qp.state != IBV_QPS_RESET) {
        qp.state = IBV_QPS_ERR;
      }
      if (!report && qp.outstanding > 0) --qp.outstanding;
    }
    if (status == IBV_WC_SUCCESS) ++qp.fabric->ok_count;
    if (!report) return;
    ibv_wc wc = {};
    wc.wr_id = wr.wr_id;
    wc.status = status;
    wc.opcode =
        wr.opcode == IBV_WR_RDMA_READ ? IBV_WC_RDMA_READ : IBV_WC_RDMA_WRITE;
    uint64_t total = 0;
    for (const ibv_sge& sge : wr.sges) total += sge.length;
    wc.byte_len = static_cast<uint32_t>(total);
    wc.qp_num = qp.qpn;
    wc.vendor_err = status == IBV_WC_SUCCESS ? 0 : 0x80 + status;
    PushCompletion(*qp.cq, wc, qp.weak);
  }

  std::shared_ptr<QpState> state_;
  std::thread worker_;
};

// --- Protection domain and device -----------------------------------------

class SoftProtectionDomain : public ProtectionDomain {
 public:
  SoftProtectionDomain(std::shared_ptr<FabricState> fabric,
                       std::shared_ptr<DeviceState> device, uint64_t id)
      : fabric_(std::move(fabric)), device_(std::move(device)), id_(id) {}

  absl::StatusOr<std::unique_ptr<MemoryRegion>> RegisterMemory(
      void* addr, size_t length, int access) override {
    if (addr == nullptr || length == 0) {
      return Errno("ibv_reg_mr", EINVAL, "empty range");
    }
    if ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) &&
        !(access & IBV_ACCESS_LOCAL_WRITE)) {
      return Errno("ibv_reg_mr", EINVAL, "REMOTE_WRITE requires LOCAL_WRITE");
    }
    uint32_t key;
    {
      absl::MutexLock lock(&fabric_->mu);
      // Keys are never reused, so a stale rkey never matches a new MR.
      key = fabric_->next_key++;
    }
    {
      absl::WriterMutexLock lock(&device_->mr_mu);
      device_->mrs[key] = {reinterpret_cast<uintptr_t>(addr), length,
                           reinterpret_cast<uintptr_t>(addr), access, id_};
    }
    return std::unique_ptr<MemoryRegion>(
        new SoftMemoryRegion(device_, key, addr, length));
  }

  // Any fd mmap accepts stands in for a dma-buf (tests hand it a memfd):
  // the soft NIC maps the range itself, as a real NIC reaches device
  // memory by DMA, and WRs address it by iova.
  absl::StatusOr<std::unique_ptr<MemoryRegion>> RegisterDmaBuf(
      uint64_t offset, size_t length, uint64_t iova, int fd,
      int access) override {
    if (length == 0 || offset > UINT64_MAX - length ||
        iova > UINTPTR_MAX - length) {
      return Errno("ibv_reg_dmabuf_mr", EINVAL, "empty or overflowing range");
    }
    if (fd < 0) return Errno("ibv_reg_dmabuf_mr", EBADF, "no fd");
    if ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) &&
        !(access & IBV_ACCESS_LOCAL_WRITE)) {
      return Errno("ibv_reg_dmabuf_mr", EINVAL,
                   "REMOTE_WRITE requires LOCAL_WRITE");
    }
    // A range past the end of the fd would map, then fault on first touch.
    const off_t end = ::lseek(fd, 0, SEEK_END);
    if (end < 0 || offset + length > static_cast<uint64_t>(end)) {
      return Errno("ibv_reg_dmabuf_mr", EINVAL, "range outside the dma-buf");
    }
    auto mapping = DmaBufMapping::Map(fd, offset, length);
    if (!mapping.ok()) return mapping.status();
    uint32_t key;
    {
      absl::MutexLock lock(&fabric_->mu);
      key = fabric_->next_key++;
    }
    {
      absl::WriterMutexLock lock(&device_->mr_mu);
      device_->mrs[key] = {static_cast<uintptr_t>(iova), length,
                           mapping->start(), access, id_};
    }
    return std::unique_ptr<MemoryRegion>(
        new SoftMemoryRegion(device_, key, reinterpret_cast<void*>(iova),
                             length, std::move(*mapping)));
  }

  absl::StatusOr<std::unique_ptr<QueuePair>> CreateQueuePair(
      const QueuePairInit& init) override {
    auto* cq = dynamic_cast<SoftCompletionQueue*>(init.send_cq);
    if (cq == nullptr || init.recv_cq == nullptr) {
      return Errno("ibv_create_qp", EINVAL, "needs soft CQs");
    }
    if (init.qp_type != IBV_QPT_RC) {
      return Errno("ibv_create_qp", EOPNOTSUPP, "only RC queue pairs");
    }
    if (init.cap.max_send_wr == 0 ||
        init.cap.max_send_wr >
            static_cast<uint32_t>(device_->config.max_qp_wr) ||
        init.cap.max_send_sge >
            static_cast<uint32_t>(device_->config.max_sge)) {
      return Errno("ibv_create_qp", EINVAL, "capabilities above the device's");
    }
    auto state = std::make_shared<QpState>();
    state->fabric = fabric_;
    state->device = device_;
    state->pd_id = id_;
    state->cq = cq->state();
    state->max_send_wr = static_cast<int>(init.cap.max_send_wr);
    {
      absl::MutexLock lock(&state->mu);
      state->queue.Resize(init.cap.max_send_wr);
    }
    state->max_send_sge = static_cast<int>(std::max(1u, init.cap.max_send_sge));
    state->sq_sig_all = init.sq_sig_all;
    state->weak = state;
    {
      absl::MutexLock lock(&fabric_->mu);
      state->qpn = fabric_->next_qpn++;
      fabric_->qps[state->qpn] = state;
    }
    return std::unique_ptr<QueuePair>(new SoftQueuePair(std::move(state)));
  }

 private:
  std::shared_ptr<FabricState> fabric_;
  std::shared_ptr<DeviceState> device_;
  const uint64_t id_;
};

class SoftDevice : public Device {
 public:
  SoftDevice(std::shared_ptr<FabricState> fabric,
             std::shared_ptr<DeviceState> device)
      : fabric_(std::move(fabric)), device_(std::move(device)) {
    absl::MutexLock lock(&device_->events_mu);
    auto& listeners = device_->listeners;
    listeners.erase(std::remove_if(listeners.begin(), listeners.end(),
                                   [](const std::weak_ptr<AsyncEventQueue>& q) {
                                     return q.expired();
                                   }),
                    listeners.end());
    listeners.push_back(events_);
  }

  absl::StatusOr<std::optional<AsyncEvent>> GetAsyncEvent(
      absl::Duration timeout) override {
    AsyncEventQueue& queue = *events_;
    absl::MutexLock lock(&queue.mu);
    const auto any = [&queue]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(queue.mu) {
      return !queue.events.empty();
    };
    if (!queue.mu.AwaitWithTimeout(absl::Condition(&any), timeout)) {
      return std::nullopt;
    }
    const AsyncEvent event = queue.events.front();
    queue.events.pop_front();
    return event;
  }

  const std::string& name() const override { return device_->config.name; }
  int NumaNode() const override { return device_->config.numa_node; }

  absl::StatusOr<ibv_device_attr> Query() override {
    ibv_device_attr attr = {};
    std::snprintf(attr.fw_ver, sizeof(attr.fw_ver), "soft-1.0");
    attr.vendor_id = device_->config.vendor_id;
    attr.vendor_part_id = device_->config.vendor_part_id;
    attr.max_mr_size = uint64_t{1} << 46;
    attr.max_qp = 1 << 16;
    attr.max_qp_wr = device_->config.max_qp_wr;
    attr.max_sge = device_->config.max_sge;
    attr.max_cq = 1 << 16;
    attr.max_cqe = device_->config.max_cqe;
    attr.max_mr = 1 << 20;
    attr.max_pd = 1 << 16;
    attr.max_qp_rd_atom = 16;
    attr.max_qp_init_rd_atom = 16;
    attr.phys_port_cnt = 1;
    return attr;
  }

  absl::StatusOr<ibv_port_attr> QueryPort(uint8_t port) override {
    if (port != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("ibv_query_port: ", name(), " has no port ", port));
    }
    ibv_port_attr attr = {};
    attr.state = static_cast<ibv_port_state>(device_->port_state.load());
    attr.max_mtu = IBV_MTU_4096;
    attr.active_mtu = device_->config.active_mtu;
    attr.gid_tbl_len = 1;
    attr.max_msg_sz = device_->config.max_msg_sz;
    attr.lid = device_->lid;
    attr.link_layer = device_->config.link_layer;
    attr.active_speed = device_->config.active_speed;
    attr.active_width = device_->config.active_width;
    return attr;
  }

  absl::StatusOr<ibv_gid> QueryGid(uint8_t port, int index) override {
    if (port != 1 || index != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ibv_query_gid: ", name(), " has no GID ", index, " on port ", port));
    }
    return device_->gid;
  }

  absl::StatusOr<std::unique_ptr<ProtectionDomain>> AllocateProtectionDomain()
      override {
    uint64_t id;
    {
      absl::MutexLock lock(&fabric_->mu);
      id = fabric_->next_pd++;
    }
    return std::unique_ptr<ProtectionDomain>(
        new SoftProtectionDomain(fabric_, device_, id));
  }

  absl::StatusOr<std::unique_ptr<CompletionQueue>> CreateCompletionQueue(
      int cqe) override {
    if (cqe <= 0 || cqe > device_->config.max_cqe) {
      return Errno("ibv_create_cq", EINVAL, "cqe out of the device's range");
    }
    return std::unique_ptr<CompletionQueue>(
        new SoftCompletionQueue(device_, static_cast<size_t>(cqe)));
  }

 private:
  std::shared_ptr<FabricState> fabric_;
  std::shared_ptr<DeviceState> device_;
  const std::shared_ptr<AsyncEventQueue> events_ =
      std::make_shared<AsyncEventQueue>();
};

class SoftVerbs : public Verbs {
 public:
  SoftVerbs(std::shared_ptr<FabricState> fabric,
            std::vector<std::string> devices)
      : fabric_(std::move(fabric)), devices_(std::move(devices)) {}

  absl::StatusOr<std::vector<std::string>> ListDevices() override {
    absl::MutexLock lock(&fabric_->mu);
    std::vector<std::string> names;
    for (const auto& [name, device] : fabric_->devices) {
      if (Visible(name)) names.push_back(name);
    }
    return names;
  }

  absl::StatusOr<std::unique_ptr<Device>> OpenDevice(
      const std::string& name) override {
    absl::MutexLock lock(&fabric_->mu);
    auto it = fabric_->devices.find(name);
    if (it == fabric_->devices.end() || !Visible(name)) {
      return absl::NotFoundError(absl::StrCat("no RDMA device ", name));
    }
    return std::unique_ptr<Device>(new SoftDevice(fabric_, it->second));
  }

 private:
  bool Visible(const std::string& name) const {
    return devices_.empty() ||
           std::find(devices_.begin(), devices_.end(), name) != devices_.end();
  }

  std::shared_ptr<FabricState> fabric_;
  const std::vector<std::string> devices_;
};

}  // namespace

SoftFabric::SoftFabric() : state_(std::make_shared<FabricState>()) {}
SoftFabric::~SoftFabric() = default;

absl::Status SoftFabric::AddDevice(const SoftDeviceConfig& config) {
  absl::MutexLock lock(&state_->mu);
  if (state_->devices.count(config.name) != 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("soft device ", config.name, " exists"));
  }
  auto device = std::make_shared<DeviceState>();
  device->config = config;
  device->port_state = config.port_state;
  device->link.Configure(config.bytes_per_second, config.burst_bytes);
  device->lid = state_->next_lid++;
  // fe80::<lid>: a link-local GID unique on this fabric.
  device->gid.raw[0] = 0xfe;
  device->gid.raw[1] = 0x80;
  device->gid.raw[14] = static_cast<uint8_t>(device->lid >> 8);
  device->gid.raw[15] = static_cast<uint8_t>(device->lid);
  state_->devices[config.name] = std::move(device);
  return absl::OkStatus();
}

std::unique_ptr<Verbs> SoftFabric::MakeVerbs(std::vector<std::string> devices) {
  return std::make_unique<SoftVerbs>(state_, std::move(devices));
}

namespace {

// Changes what `device`'s links carry (under the fabric's lock), then wakes
// every WR waiting for a link so that it looks again. NOT_FOUND for an
// unknown device.
absl::Status ChangeLink(FabricState& fabric, const std::string& device,
                        const std::function<void(DeviceState&)>& change) {
  std::vector<std::shared_ptr<QpState>> qps;
  {
    absl::MutexLock lock(&fabric.mu);
    auto it = fabric.devices.find(device);
    if (it == fabric.devices.end()) {
      return absl::NotFoundError(absl::StrCat("no soft device ", device));
    }
    change(*it->second);
    ++fabric.link_generation;
    for (const auto& [qpn, weak] : fabric.qps) {
      if (auto qp = weak.lock()) qps.push_back(std::move(qp));
    }
  }
  // Outside the fabric's lock (a QP's lock is taken before it elsewhere):
  // releasing a QP's lock re-evaluates the waits on it.
  for (const auto& qp : qps) {
    absl::MutexLock lock(&qp->mu);
  }
  return absl::OkStatus();
}

}  // namespace

void SoftFabric::SetReachable(const std::string& device, bool reachable) {
  (void)ChangeLink(*state_, device,
                   [reachable](DeviceState& d) { d.reachable = reachable; });
}

absl::Status SoftFabric::Unplug(const std::string& device) {
  return SetPortState(device, IBV_PORT_DOWN);
}

absl::Status SoftFabric::Replug(const std::string& device) {
  return SetPortState(device, IBV_PORT_ACTIVE);
}

absl::Status SoftFabric::SetPortState(const std::string& device,
                                      ibv_port_state state) {
  return ChangeLink(*state_, device,
                    [state](DeviceState& d) { d.SetPortState(state); });
}

void SoftFabric::InjectFault(const SoftFault& fault) {
  absl::MutexLock lock(&state_->mu);
  state_->faults.push_back(fault);
}

void SoftFabric::ClearFaults() {
  absl::MutexLock lock(&state_->mu);
  state_->faults.clear();
}

uint64_t SoftFabric::wrs_completed_ok() const { return state_->ok_count; }

uint64_t SoftFabric::bytes_moved(const std::string& device) const {
  absl::MutexLock lock(&state_->mu);
  auto it = state_->devices.find(device);
  return it == state_->devices.end() ? 0 : it->second->bytes_moved.load();
}

uint64_t SoftFabric::bytes_served(const std::string& device) const {
  absl::MutexLock lock(&state_->mu);
  auto it = state_->devices.find(device);
  return it == state_->devices.end() ? 0 : it->second->bytes_served.load();
}
int SoftFabric::max_outstanding_seen() const { return state_->max_outstanding; }

size_t SoftFabric::live_queue_pairs() const {
  absl::MutexLock lock(&state_->mu);
  return state_->qps.size();
}

}  // namespace verbs
}  // namespace rdma_agent

#include "backends/ibverbs/connection.h"

#include <pthread.h>

#include <array>
#include <cstring>
#include <random>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"

namespace rdma_agent::ibverbs {
namespace {

// How often a wait that nothing else wakes checks for cancellation.
constexpr absl::Duration kCancellationCheckInterval = absl::Milliseconds(50);

// Set on a CompletionPoller's thread.
thread_local bool on_poller_thread = false;

}  // namespace

bool OnCompletionPollerThread() { return on_poller_thread; }

// --- OpTracker ----------------------------------------------------------

OpTracker::OpTracker(size_t ops) : ops_(ops), not_done_(ops) {}

void OpTracker::WrPosted(size_t op) {
  absl::MutexLock lock(&mu_);
  ++ops_[op].pending;
}

void OpTracker::WrCompleted(size_t op, const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  Progress& p = ops_[op];
  if (p.status.ok() && !status.ok()) p.status = status;
  if (--p.pending == 0 && p.posting_done) --not_done_;
}

void OpTracker::PostingFinished(size_t op, const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  Progress& p = ops_[op];
  if (p.posting_done) return;
  if (p.status.ok() && !status.ok()) p.status = status;
  p.posting_done = true;
  if (p.pending == 0) --not_done_;
}

bool OpTracker::AllDone() const { return not_done_ == 0; }

bool OpTracker::DoneOrInterrupted() const {
  return not_done_ == 0 || interrupted_;
}

void OpTracker::Interrupt() {
  absl::MutexLock lock(&mu_);
  interrupted_ = true;
}

bool OpTracker::WaitAllDone(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  mu_.AwaitWithDeadline(absl::Condition(this, &OpTracker::DoneOrInterrupted),
                        deadline);
  return not_done_ == 0;
}

std::vector<size_t> OpTracker::NotDone() {
  absl::MutexLock lock(&mu_);
  std::vector<size_t> ops;
  for (size_t i = 0; i < ops_.size(); ++i) {
    if (!ops_[i].posting_done || ops_[i].pending > 0) ops.push_back(i);
  }
  return ops;
}

uint64_t OpTracker::OutstandingWrs() {
  absl::MutexLock lock(&mu_);
  uint64_t total = 0;
  for (const Progress& p : ops_) total += p.pending;
  return total;
}

std::vector<absl::Status> OpTracker::Results() {
  absl::MutexLock lock(&mu_);
  std::vector<absl::Status> results;
  results.reserve(ops_.size());
  for (const Progress& p : ops_) results.push_back(p.status);
  return results;
}

void OpTracker::Override(size_t op, absl::Status status) {
  absl::MutexLock lock(&mu_);
  ops_[op].status = std::move(status);
}

void OpTracker::OnCompletion(uint64_t cookie, const ibv_wc& wc) {
  WrCompleted(static_cast<size_t>(cookie), CompletionStatus(wc));
}

// --- Completion statuses --------------------------------------------------

absl::Status CompletionStatus(const ibv_wc& wc) {
  if (wc.status == IBV_WC_SUCCESS) return absl::OkStatus();
  const std::string what = absl::StrCat(
      "RDMA work request completed with ", verbs::WcStatusName(wc.status),
      " (vendor error 0x", absl::Hex(wc.vendor_err), ")");
  switch (wc.status) {
    case IBV_WC_REM_ACCESS_ERR:
      return absl::PermissionDeniedError(
          absl::StrCat(what,
                       ": the remote NIC refused the access (buffer released, "
                       "or not registered for this access)"));
    case IBV_WC_RETRY_EXC_ERR:
    case IBV_WC_RNR_RETRY_EXC_ERR:
      return absl::UnavailableError(
          absl::StrCat(what, ": the peer did not answer"));
    case IBV_WC_WR_FLUSH_ERR:
      return absl::UnavailableError(
          absl::StrCat(what, ": flushed because the queue pair failed"));
    case IBV_WC_REM_INV_REQ_ERR:
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": the remote NIC rejected the request"));
    default:
      return absl::InternalError(what);
  }
}

// --- QueuePairConnection
// -----------------------------------------------------------

namespace {

uint32_t RandomPsn() {
  std::random_device device;
  return device() & 0xffffff;
}

}  // namespace

// --- CompletionPoller ------------------------------------------------------

absl::StatusOr<std::shared_ptr<CompletionPoller>> CompletionPoller::Create(
    verbs::Device& device, uint32_t entries, absl::Duration busy_poll) {
  auto cq = device.CreateCompletionQueue(static_cast<int>(entries));
  if (!cq.ok()) return cq.status();
  return std::shared_ptr<CompletionPoller>(
      new CompletionPoller(std::move(*cq), entries, busy_poll));
}

CompletionPoller::CompletionPoller(std::unique_ptr<verbs::CompletionQueue> cq,
                                   uint32_t entries, absl::Duration busy_poll)
    : cq_(std::move(cq)), entries_(entries), busy_poll_(busy_poll) {
  thread_ = std::thread([this] { Run(); });
  // Named for ps and debuggers; the backend's tests also check that posted
  // batches end here.
  pthread_setname_np(thread_.native_handle(), "ibv-cq-poller");
}

CompletionPoller::~CompletionPoller() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

bool CompletionPoller::Reserve(uint32_t entries) {
  absl::MutexLock lock(&mu_);
  if (entries > entries_ - reserved_) return false;
  reserved_ += entries;
  return true;
}

void CompletionPoller::Unreserve(uint32_t entries) {
  absl::MutexLock lock(&mu_);
  reserved_ -= std::min(entries, reserved_);
}

void CompletionPoller::Attach(uint32_t qp_num,
                              QueuePairConnection* connection) {
  absl::MutexLock lock(&mu_);
  connections_[qp_num] = connection;
}

void CompletionPoller::Detach(uint32_t qp_num) {
  // Completions are handed over under mu_, so none is in progress once it
  // is taken.
  absl::MutexLock lock(&mu_);
  connections_.erase(qp_num);
}

void CompletionPoller::Dispatch(absl::Span<const ibv_wc> wcs) {
  absl::MutexLock lock(&mu_);
  for (const ibv_wc& wc : wcs) {
    auto it = connections_.find(wc.qp_num);
    if (it != connections_.end()) it->second->Reap(wc);
  }
}

void CompletionPoller::Run() {
  on_poller_thread = true;
  std::array<ibv_wc, 32> wcs;
  absl::Time last_completion = absl::Now();
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
    }
    absl::StatusOr<int> n = cq_->Poll(absl::MakeSpan(wcs));
    if (n.ok() && *n > 0) {
      Dispatch(absl::MakeConstSpan(wcs.data(), *n));
      last_completion = absl::Now();
      continue;
    }
    if (n.ok() && absl::Now() - last_completion < busy_poll_) {
      std::this_thread::yield();
      continue;
    }
    // Idle: arm the channel, catch completions that raced with arming, then
    // block. The wait is bounded so that stop_ is noticed.
    if (n.ok() && cq_->RequestNotify().ok()) {
      n = cq_->Poll(absl::MakeSpan(wcs));
      if (n.ok() && *n > 0) {
        Dispatch(absl::MakeConstSpan(wcs.data(), *n));
        last_completion = absl::Now();
        continue;
      }
    }
    (void)cq_->WaitForEvent(absl::Milliseconds(50));
    last_completion = absl::Now();
  }
}

CompletionPollers::CompletionPollers(verbs::Device* device,
                                     uint32_t entries_per_cq,
                                     absl::Duration busy_poll)
    : device_(device), entries_per_cq_(entries_per_cq), busy_poll_(busy_poll) {}

absl::StatusOr<std::shared_ptr<CompletionPoller>> CompletionPollers::Reserve(
    uint32_t entries) {
  absl::MutexLock lock(&mu_);
  for (const auto& poller : pollers_) {
    if (poller->Reserve(entries)) return poller;
  }
  auto poller = CompletionPoller::Create(
      *device_, std::max(entries_per_cq_, entries), busy_poll_);
  if (!poller.ok()) return poller.status();
  (*poller)->Reserve(entries);
  pollers_.push_back(*poller);
  return *poller;
}

size_t CompletionPollers::size() const {
  absl::MutexLock lock(&mu_);
  return pollers_.size();
}

// --- QueuePairConnection -----------------------------------------------------

absl::StatusOr<std::unique_ptr<QueuePairConnection>>
QueuePairConnection::Create(const LocalPort& local,
                            const QueuePairParams& params,
                            absl::Duration busy_poll,
                            absl::Duration drain_timeout, Inbound inbound) {
  // Every WR is signaled and the send queue holds at most sq_depth, so
  // reserving that many CQ entries means the CQ never overflows.
  absl::StatusOr<std::shared_ptr<CompletionPoller>> poller =
      local.pollers != nullptr
          ? local.pollers->Reserve(params.sq_depth)
          : CompletionPoller::Create(*local.device, params.sq_depth, busy_poll);
  if (!poller.ok()) return poller.status();
  if (local.pollers == nullptr) (*poller)->Reserve(params.sq_depth);
  // Given back when this function fails; the connection gives it back once
  // its QP is gone.
  std::shared_ptr<CompletionPoller> reserved = *poller;
  bool kept = false;
  const auto release = absl::MakeCleanup([&] {
    if (!kept) reserved->Unreserve(params.sq_depth);
  });
  verbs::QueuePairInit init;
  init.send_cq = reserved->cq();
  init.recv_cq = reserved->cq();
  init.cap.max_send_wr = params.sq_depth;
  init.cap.max_recv_wr = 1;
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  init.qp_type = IBV_QPT_RC;
  auto qp = local.pd->CreateQueuePair(init);
  if (!qp.ok()) return qp.status();

  ibv_qp_attr attr = {};
  attr.qp_state = IBV_QPS_INIT;
  attr.pkey_index = 0;
  attr.port_num = local.port;
  attr.qp_access_flags = IBV_ACCESS_LOCAL_WRITE;
  if (inbound == Inbound::kAccept) {
    attr.qp_access_flags |= IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
  }
  absl::Status status =
      (*qp)->Modify(attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                              IBV_QP_ACCESS_FLAGS);
  if (!status.ok()) return status;
  kept = true;
  std::unique_ptr<QueuePairConnection> connection(new QueuePairConnection(
      local, params, drain_timeout, std::move(reserved), std::move(*qp)));
  connection->poller_->Attach(connection->qp_num(), connection.get());
  return connection;
}

QueuePairConnection::QueuePairConnection(
    const LocalPort& local, const QueuePairParams& params,
    absl::Duration drain_timeout, std::shared_ptr<CompletionPoller> poller,
    std::unique_ptr<verbs::QueuePair> qp)
    : local_(local),
      params_(params),
      drain_timeout_(drain_timeout),
      psn_(RandomPsn()),
      poller_(std::move(poller)),
      qp_(std::move(qp)),
      credits_(params.sq_depth),
      in_flight_(params.sq_depth) {
  free_slots_.reserve(params.sq_depth);
  for (uint32_t slot = params.sq_depth; slot > 0; --slot) {
    free_slots_.push_back(slot - 1);
  }
}

QueuePairConnection::~QueuePairConnection() {
  MoveToErrorAndDrain(drain_timeout_);
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  // No completion reaches this object once detached; WRs that did not
  // drain keep their pins, which are released with in_flight_.
  poller_->Detach(qp_->qp_num());
  qp_.reset();
  poller_->Unreserve(params_.sq_depth);
}

v1::QueuePairEndpoint QueuePairConnection::local_endpoint() const {
  v1::QueuePairEndpoint endpoint;
  endpoint.set_device(local_.device->name());
  endpoint.set_port(local_.port);
  endpoint.set_lid(local_.lid);
  endpoint.set_gid(std::string(reinterpret_cast<const char*>(local_.gid.raw),
                               sizeof(local_.gid.raw)));
  endpoint.set_gid_index(static_cast<uint32_t>(params_.gid_index));
  endpoint.set_qp_num(qp_->qp_num());
  endpoint.set_psn(psn_);
  endpoint.set_mtu_bytes(params_.mtu_bytes);
  endpoint.set_max_rd_atomic(params_.max_rd_atomic);
  return endpoint;
}

absl::Status QueuePairConnection::ConnectTo(
    const v1::QueuePairEndpoint& remote) {
  if (remote.gid().size() != sizeof(ibv_gid)) {
    return absl::InvalidArgumentError(absl::StrCat("queue pair endpoint has a ",
                                                   remote.gid().size(),
                                                   "-byte GID, expected 16"));
  }
  auto mtu =
      verbs::MtuFromBytes(std::min(params_.mtu_bytes, remote.mtu_bytes()));
  if (!mtu.ok()) return mtu.status();

  ibv_qp_attr attr = {};
  attr.qp_state = IBV_QPS_RTR;
  attr.path_mtu = *mtu;
  attr.dest_qp_num = remote.qp_num();
  attr.rq_psn = remote.psn() & 0xffffff;
  // Accept as many concurrent READs as the other side issues.
  attr.max_dest_rd_atomic = static_cast<uint8_t>(std::min<uint32_t>(
      std::max<uint32_t>(remote.max_rd_atomic(), 1), params_.max_rd_atomic));
  attr.min_rnr_timer = 12;
  attr.ah_attr.port_num = local_.port;
  attr.ah_attr.dlid = static_cast<uint16_t>(remote.lid());
  attr.ah_attr.sl = params_.service_level;
  if (local_.global_routing || remote.lid() == 0) {
    attr.ah_attr.is_global = 1;
    std::memcpy(attr.ah_attr.grh.dgid.raw, remote.gid().data(),
                sizeof(ibv_gid));
    attr.ah_attr.grh.sgid_index = static_cast<uint8_t>(params_.gid_index);
    attr.ah_attr.grh.hop_limit = 64;
    attr.ah_attr.grh.traffic_class = params_.traffic_class;
  }
  absl::Status status =
      qp_->Modify(attr, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
                            IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                            IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
  if (!status.ok()) return status;

  attr = {};
  attr.qp_state = IBV_QPS_RTS;
  attr.timeout = params_.timeout;
  attr.retry_cnt = params_.retry_cnt;
  attr.rnr_retry = params_.rnr_retry;
  attr.sq_psn = psn_;
  attr.max_rd_atomic = params_.max_rd_atomic;
  return qp_->Modify(attr, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                               IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                               IBV_QP_MAX_QP_RD_ATOMIC);
}

absl::Status QueuePairConnection::Post(ibv_send_wr& wr,
                                       std::shared_ptr<CompletionSink> sink,
                                       uint64_t cookie,
                                       std::shared_ptr<Registration> pin,
                                       const StopToken& stop) {
  absl::MutexLock lock(&mu_);
  const auto ready = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return credits_ > 0 || broken_.load() || stop_;
  };
  // A cancellation does not touch mu_, so the wait is sliced to notice it.
  while (!mu_.AwaitWithDeadline(
             absl::Condition(&ready),
             std::min(stop.deadline(),
                      absl::Now() + kCancellationCheckInterval)) &&
         !stop.stopped()) {
  }
  if (broken_.load() || stop_) {
    return absl::UnavailableError(
        "the RDMA queue pair failed; the next submit reconnects");
  }
  if (credits_ == 0) {
    return stop.StopStatus("waiting for a send-queue slot");
  }
  return PostLocked(wr, std::move(sink), cookie, std::move(pin));
}

absl::Status QueuePairConnection::TryPost(ibv_send_wr& wr,
                                          std::shared_ptr<CompletionSink> sink,
                                          uint64_t cookie,
                                          std::shared_ptr<Registration> pin) {
  absl::MutexLock lock(&mu_);
  if (broken_.load() || stop_) {
    return absl::UnavailableError(
        "the RDMA queue pair failed; the next submit reconnects");
  }
  if (credits_ == 0) {
    return absl::ResourceExhaustedError("the send queue is full");
  }
  return PostLocked(wr, std::move(sink), cookie, std::move(pin));
}

absl::Status QueuePairConnection::PostLocked(
    ibv_send_wr& wr, std::shared_ptr<CompletionSink> sink, uint64_t cookie,
    std::shared_ptr<Registration> pin) {
  // A credit was free, so a slot is.
  const uint32_t slot = free_slots_.back();
  free_slots_.pop_back();
  const uint64_t id = (next_sequence_++ << 32) | slot;
  wr.wr_id = id;
  wr.next = nullptr;
  wr.send_flags |= IBV_SEND_SIGNALED;
  --credits_;
  in_flight_[slot] = InFlight{id, std::move(sink), cookie, std::move(pin)};
  ibv_send_wr* bad = nullptr;
  const int err = qp_->PostSend(&wr, &bad);
  if (err == 0) return absl::OkStatus();
  in_flight_[slot] = InFlight{};
  free_slots_.push_back(slot);
  ++credits_;
  return absl::InternalError(
      absl::StrCat("ibv_post_send: ", std::strerror(err)));
}

absl::Status QueuePairConnection::Post(
    ibv_send_wr& wr, const std::shared_ptr<OpTracker>& tracker, size_t op,
    std::shared_ptr<Registration> pin, const StopToken& stop) {
  // Counted before posting: the completion may arrive before Post returns.
  tracker->WrPosted(op);
  absl::Status status = Post(wr, std::shared_ptr<CompletionSink>(tracker), op,
                             std::move(pin), stop);
  if (!status.ok()) tracker->WrCompleted(op, status);
  return status;
}

bool QueuePairConnection::MoveToErrorAndDrain(absl::Duration limit) {
  {
    // Under mu_ so that credit waiters see it.
    absl::MutexLock lock(&mu_);
    broken_ = true;
  }
  ibv_qp_attr attr = {};
  attr.qp_state = IBV_QPS_ERR;
  (void)qp_->Modify(attr, IBV_QP_STATE);  // ERR is reachable from any state
  absl::MutexLock lock(&mu_);
  const auto drained = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return free_slots_.size() == in_flight_.size();
  };
  mu_.AwaitWithTimeout(absl::Condition(&drained), limit);
  return free_slots_.size() == in_flight_.size();
}

uint64_t QueuePairConnection::outstanding() const {
  absl::MutexLock lock(&mu_);
  return in_flight_.size() - free_slots_.size();
}

void QueuePairConnection::Reap(const ibv_wc& wc) {
  InFlight done;
  {
    absl::MutexLock lock(&mu_);
    const uint32_t slot = static_cast<uint32_t>(wc.wr_id & 0xffffffffu);
    if (slot >= in_flight_.size() || in_flight_[slot].wr_id != wc.wr_id ||
        wc.wr_id == 0) {
      return;
    }
    done = std::move(in_flight_[slot]);
    in_flight_[slot] = InFlight{};
    free_slots_.push_back(slot);
    ++credits_;
    if (wc.status != IBV_WC_SUCCESS) broken_ = true;
  }
  // Unpinned before the op is reported, so that a Submit returning has
  // no reference of ours left on its registrations.
  done.pin.reset();
  done.sink->OnCompletion(done.cookie, wc);
}

}  // namespace rdma_agent::ibverbs

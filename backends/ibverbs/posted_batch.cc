#include "backends/ibverbs/posted_batch.h"

#include <utility>

#include "common/status_util.h"

namespace rdma_agent::ibverbs {

PostedBatch::PostedBatch(absl::Span<const Op> ops) : ops_(ops.size()) {
  wrs_.reserve(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    ops_[i].unsettled = ops[i].length;
    ops_[i].landed = ops[i].landed;
    if (ops[i].length > 0) ++not_done_;
  }
}

void PostedBatch::SetListener(std::weak_ptr<Listener> listener) {
  listener_ = std::move(listener);
}

void PostedBatch::Wake() {
  if (std::shared_ptr<Listener> listener = listener_.lock()) {
    listener->OnBatchWoken();
  }
}

uint64_t PostedBatch::WrPosting(const Range& range, const Lane& lane) {
  lane.load->bytes += range.length;
  absl::MutexLock lock(&mu_);
  size_t slot = free_wr_;
  if (slot == kNoSlot) {
    slot = wrs_.size();
    wrs_.emplace_back();
  } else {
    free_wr_ = wrs_[slot].next_free;
  }
  Wr& wr = wrs_[slot];
  wr.range = range;
  wr.lane = &lane;
  wr.load = lane.load;
  wr.rail = lane.rail;
  wr.in_use = true;
  ++outstanding_wrs_;
  return slot;
}

PostedBatch::Wr* PostedBatch::WrOf(uint64_t cookie) {
  if (cookie >= wrs_.size() || !wrs_[cookie].in_use) return nullptr;
  return &wrs_[cookie];
}

void PostedBatch::FreeWr(Wr& wr) {
  wr.load->bytes -= wr.range.length;
  wr.load.reset();
  wr.in_use = false;
  wr.next_free = free_wr_;
  free_wr_ = static_cast<size_t>(&wr - wrs_.data());
  --outstanding_wrs_;
}

void PostedBatch::WrNotPosted(uint64_t cookie) {
  absl::MutexLock lock(&mu_);
  if (Wr* wr = WrOf(cookie)) FreeWr(*wr);
}

void PostedBatch::OnCompletion(uint64_t cookie, const ibv_wc& wc) {
  bool woken = false;
  {
    absl::MutexLock lock(&mu_);
    Wr* wr = WrOf(cookie);
    if (wr == nullptr) return;
    const Range range = wr->range;
    const Lane* const lane = wr->lane;
    RailCounters& counters = wr->rail->counters;
    absl::Status status;
    if (wc.status != IBV_WC_SUCCESS) {
      // Which rail pair failed is part of what went wrong.
      status = Prefixed(CompletionStatus(wc),
                        absl::StrCat("on rail ", wr->load->lane_name));
    }
    FreeWr(*wr);
    if (status.ok()) {
      counters.bytes += range.length;
      ++counters.work_requests;
      if (std::atomic<uint64_t>* landed = ops_[range.op].landed) {
        landed->fetch_add(range.length, std::memory_order_relaxed);
      }
      woken = SettleLocked(range.op, range.length, absl::OkStatus());
    } else {
      ++counters.errors;
      if (status.code() == absl::StatusCode::kUnavailable &&
          ops_[range.op].status.ok()) {
        const bool path = wc.status == IBV_WC_RETRY_EXC_ERR ||
                          wc.status == IBV_WC_RNR_RETRY_EXC_ERR;
        retries_.push_back(Retry{range, lane, std::move(status), path});
        woken = true;
      } else {
        woken = SettleLocked(range.op, range.length, status);
      }
    }
  }
  if (woken) Wake();
}

void PostedBatch::Settle(const Range& range, const absl::Status& status) {
  bool woken;
  {
    absl::MutexLock lock(&mu_);
    woken = SettleLocked(range.op, range.length, status);
  }
  if (woken) Wake();
}

void PostedBatch::Requeue(const Range& range, const Lane* lane,
                          absl::Status why) {
  bool woken = true;
  {
    absl::MutexLock lock(&mu_);
    if (!ops_[range.op].status.ok()) {
      woken = SettleLocked(range.op, range.length, why);
    } else {
      retries_.push_back(Retry{range, lane, std::move(why), false});
    }
  }
  if (woken) Wake();
}

std::vector<PostedBatch::Retry> PostedBatch::TakeRetries() {
  absl::MutexLock lock(&mu_);
  std::vector<Retry> taken;
  taken.swap(retries_);
  return taken;
}

bool PostedBatch::HasError(size_t op) {
  absl::MutexLock lock(&mu_);
  return !ops_[op].status.ok();
}

bool PostedBatch::SettleLocked(size_t op, uint64_t length,
                               const absl::Status& status) {
  OpState& state = ops_[op];
  if (state.status.ok() && !status.ok()) state.status = status;
  if (length == 0 || state.unsettled == 0) return false;
  state.unsettled -= std::min(length, state.unsettled);
  if (state.unsettled > 0) return false;
  --not_done_;
  return not_done_ == 0;
}

bool PostedBatch::AllDone() {
  absl::MutexLock lock(&mu_);
  return not_done_ == 0;
}

bool PostedBatch::HasRetries() {
  absl::MutexLock lock(&mu_);
  return !retries_.empty();
}

bool PostedBatch::AwaitNoWrs(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  const auto none = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return outstanding_wrs_ == 0;
  };
  mu_.AwaitWithDeadline(absl::Condition(&none), deadline);
  return outstanding_wrs_ == 0;
}

std::vector<size_t> PostedBatch::NotDone() {
  absl::MutexLock lock(&mu_);
  std::vector<size_t> ops;
  for (size_t i = 0; i < ops_.size(); ++i) {
    if (ops_[i].unsettled > 0) ops.push_back(i);
  }
  return ops;
}

uint64_t PostedBatch::OutstandingWrs() {
  absl::MutexLock lock(&mu_);
  return outstanding_wrs_;
}

std::vector<absl::Status> PostedBatch::Results() {
  absl::MutexLock lock(&mu_);
  std::vector<absl::Status> results;
  results.reserve(ops_.size());
  for (const OpState& op : ops_) results.push_back(op.status);
  return results;
}

void PostedBatch::Override(size_t op, absl::Status status) {
  absl::MutexLock lock(&mu_);
  ops_[op].status = std::move(status);
}

}  // namespace rdma_agent::ibverbs

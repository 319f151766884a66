#include "backends/ibverbs/posted_batch.h"

#include <utility>

#include "common/status_util.h"

namespace rdma_agent::ibverbs {

PostedBatch::PostedBatch(absl::Span<const Op> ops) : ops_(ops.size()) {
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
  const uint64_t cookie = next_cookie_++;
  wrs_[cookie] = Wr{range, &lane, lane.name(), lane.load, lane.rail};
  return cookie;
}

void PostedBatch::WrNotPosted(uint64_t cookie) {
  absl::MutexLock lock(&mu_);
  auto it = wrs_.find(cookie);
  if (it == wrs_.end()) return;
  it->second.load->bytes -= it->second.range.length;
  wrs_.erase(it);
}

void PostedBatch::OnCompletion(uint64_t cookie, const ibv_wc& wc) {
  bool woken = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = wrs_.find(cookie);
    if (it == wrs_.end()) return;
    Wr wr = std::move(it->second);
    wrs_.erase(it);
    wr.load->bytes -= wr.range.length;
    RailCounters& counters = wr.rail->counters;
    if (wc.status == IBV_WC_SUCCESS) {
      counters.bytes += wr.range.length;
      ++counters.work_requests;
      if (std::atomic<uint64_t>* landed = ops_[wr.range.op].landed) {
        landed->fetch_add(wr.range.length, std::memory_order_relaxed);
      }
      woken = SettleLocked(wr.range.op, wr.range.length, absl::OkStatus());
    } else {
      ++counters.errors;
      // Which rail pair failed is part of what went wrong.
      absl::Status status = Prefixed(CompletionStatus(wc),
                                     absl::StrCat("on rail ", wr.lane_name));
      if (status.code() == absl::StatusCode::kUnavailable &&
          ops_[wr.range.op].status.ok()) {
        const bool path = wc.status == IBV_WC_RETRY_EXC_ERR ||
                          wc.status == IBV_WC_RNR_RETRY_EXC_ERR;
        retries_.push_back(Retry{wr.range, wr.lane, std::move(status), path});
        woken = true;
      } else {
        woken = SettleLocked(wr.range.op, wr.range.length, status);
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
  const auto none = [this]()
                        ABSL_NO_THREAD_SAFETY_ANALYSIS { return wrs_.empty(); };
  mu_.AwaitWithDeadline(absl::Condition(&none), deadline);
  return wrs_.empty();
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
  return wrs_.size();
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

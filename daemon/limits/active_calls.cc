#include "daemon/limits/active_calls.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/server_context.h"

namespace rdma_agent {

ActiveCalls::Call::~Call() { owner_->End(this); }

ActiveCalls::ActiveCalls(InFlightLimits limits, absl::Duration poll_interval)
    : limits_(limits), poll_interval_(poll_interval) {
  watcher_ = std::thread([this] { WatchLoop(); });
}

ActiveCalls::~ActiveCalls() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  watcher_.join();
}

absl::Status ActiveCalls::CheckOps(uid_t uid, size_t ops) const {
  auto found = by_uid_.find(uid);
  const size_t mine = found == by_uid_.end() ? 0 : found->second.ops;
  if (mine + ops > limits_.max_ops_per_user) {
    return absl::ResourceExhaustedError(
        absl::StrCat("user ", uid, " has ", mine, " ops in flight; ", ops,
                     " more would pass the limit of ", limits_.max_ops_per_user,
                     " (--max_ops_in_flight_per_user)"));
  }
  if (ops_total_ + ops > limits_.max_ops) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the agent has ", ops_total_, " ops in flight; ", ops,
                     " more would pass the limit of ", limits_.max_ops,
                     " (--max_ops_in_flight)"));
  }
  return absl::OkStatus();
}

void ActiveCalls::Add(uid_t uid, size_t calls, size_t ops) {
  UserLoad& load = by_uid_[uid];
  load.calls += calls;
  load.ops += ops;
  ops_total_ += ops;
}

void ActiveCalls::Remove(uid_t uid, size_t calls, size_t ops) {
  auto it = by_uid_.find(uid);
  it->second.calls -= calls;
  it->second.ops -= ops;
  ops_total_ -= ops;
  if (it->second.calls == 0 && it->second.ops == 0 && it->second.waiting == 0) {
    by_uid_.erase(it);
  }
}

std::unique_ptr<ActiveCalls::Call> ActiveCalls::Track(
    std::unique_ptr<Call> call) {
  calls_.push_front(call.get());
  call->position_ = calls_.begin();
  return call;
}

absl::StatusOr<std::unique_ptr<ActiveCalls::Call>> ActiveCalls::Start(
    const grpc::ServerContext* context, uid_t uid, size_t ops) {
  absl::MutexLock lock(&mu_);
  if (closed_) return closed_reason_;
  auto found = by_uid_.find(uid);
  const size_t calls = found == by_uid_.end() ? 0 : found->second.calls;
  if (calls >= limits_.max_calls_per_user) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "user ", uid, " already has ", calls, " calls running (limit ",
        limits_.max_calls_per_user, ", --max_rpcs_per_user)"));
  }
  absl::Status fits = CheckOps(uid, ops);
  if (!fits.ok()) return fits;
  Add(uid, 1, ops);
  return Track(std::unique_ptr<Call>(
      new Call(this, context, uid, ops, /*waiting=*/false)));
}

absl::StatusOr<std::unique_ptr<ActiveCalls::Call>> ActiveCalls::StartWaiting(
    uid_t uid) {
  absl::MutexLock lock(&mu_);
  if (closed_) return closed_reason_;
  auto found = by_uid_.find(uid);
  const size_t mine = found == by_uid_.end() ? 0 : found->second.waiting;
  if (mine >= limits_.max_waiting_per_user) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "user ", uid, " already has ", mine,
        " waiting calls open (WatchTransfers streams, GetTransfers long "
        "polls; limit ",
        limits_.max_waiting_per_user, ", --max_waiting_rpcs_per_user)"));
  }
  if (waiting_total_ >= limits_.max_waiting) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the agent already has ", waiting_total_, " waiting calls open (limit ",
        limits_.max_waiting, ", --max_waiting_rpcs)"));
  }
  ++by_uid_[uid].waiting;
  ++waiting_total_;
  return Track(std::unique_ptr<Call>(
      new Call(this, /*context=*/nullptr, uid, 0, /*waiting=*/true)));
}

absl::StatusOr<std::unique_ptr<ActiveCalls::OpsCharge>> ActiveCalls::ChargeOps(
    uid_t uid, size_t ops) {
  absl::MutexLock lock(&mu_);
  if (closed_) return closed_reason_;
  absl::Status fits = CheckOps(uid, ops);
  if (!fits.ok()) return fits;
  Add(uid, 0, ops);
  return std::unique_ptr<OpsCharge>(new OpsCharge(this, uid, ops));
}

ActiveCalls::OpsCharge::~OpsCharge() {
  absl::MutexLock lock(&owner_->mu_);
  owner_->Remove(uid_, 0, ops_);
}

void ActiveCalls::End(Call* call) {
  absl::MutexLock lock(&mu_);
  calls_.erase(call->position_);
  if (call->waiting_) {
    --by_uid_[call->uid_].waiting;
    --waiting_total_;
    Remove(call->uid_, 0, 0);
  } else {
    Remove(call->uid_, 1, call->ops_);
  }
}

void ActiveCalls::CancelAll(const absl::Status& reason) {
  absl::MutexLock lock(&mu_);
  if (!closed_) {
    closed_ = true;
    closed_reason_ = reason;
  }
  // Cancel() runs short callbacks and never calls back into this class, so
  // it is safe under mu_; holding it keeps every Call alive meanwhile.
  for (Call* call : calls_) call->cancellation_.Cancel(reason);
}

bool ActiveCalls::WaitUntilIdle(absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  const auto idle = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return calls_.empty();
  };
  return mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
}

size_t ActiveCalls::calls() const {
  absl::MutexLock lock(&mu_);
  return calls_.size();
}

size_t ActiveCalls::waiting() const {
  absl::MutexLock lock(&mu_);
  return waiting_total_;
}

size_t ActiveCalls::ops_in_flight(uid_t uid) const {
  absl::MutexLock lock(&mu_);
  auto it = by_uid_.find(uid);
  return it == by_uid_.end() ? 0 : it->second.ops;
}

size_t ActiveCalls::ops_in_flight() const {
  absl::MutexLock lock(&mu_);
  return ops_total_;
}

void ActiveCalls::WatchLoop() {
  absl::MutexLock lock(&mu_);
  const auto stopping = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return stopping_;
  };
  while (!mu_.AwaitWithTimeout(absl::Condition(&stopping), poll_interval_)) {
    for (Call* call : calls_) {
      if (call->context_ != nullptr && !call->cancellation_.cancelled() &&
          call->context_->IsCancelled()) {
        call->cancellation_.Cancel(absl::CancelledError(
            "the client cancelled the call or disconnected"));
      }
    }
  }
}

}  // namespace rdma_agent

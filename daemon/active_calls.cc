#include "daemon/active_calls.h"

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

absl::StatusOr<std::unique_ptr<ActiveCalls::Call>> ActiveCalls::Start(
    const grpc::ServerContext* context, uid_t uid, size_t ops) {
  absl::MutexLock lock(&mu_);
  if (closed_) return closed_reason_;
  auto found = by_uid_.find(uid);
  const UserLoad load = found == by_uid_.end() ? UserLoad() : found->second;
  if (load.calls >= limits_.max_calls_per_user) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "user ", uid, " already has ", load.calls, " calls running (limit ",
        limits_.max_calls_per_user, ", --max_rpcs_per_user)"));
  }
  const size_t mine = load.ops;
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
  std::unique_ptr<Call> call(new Call(this, context, uid, ops));
  UserLoad& updated = by_uid_[uid];
  ++updated.calls;
  updated.ops += ops;
  ops_total_ += ops;
  calls_.push_front(call.get());
  call->position_ = calls_.begin();
  return call;
}

void ActiveCalls::End(Call* call) {
  absl::MutexLock lock(&mu_);
  calls_.erase(call->position_);
  ops_total_ -= call->ops_;
  auto it = by_uid_.find(call->uid_);
  --it->second.calls;
  it->second.ops -= call->ops_;
  if (it->second.calls == 0) by_uid_.erase(it);
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

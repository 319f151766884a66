#include "common/stop_token.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace rdma_agent {

void Cancellation::Cancel(absl::Status reason) {
  if (reason.ok()) reason = absl::CancelledError("cancelled");
  absl::MutexLock lock(&mu_);
  if (cancelled_) return;
  cancelled_ = true;
  reason_ = std::move(reason);
  cancelled_flag_.store(true, std::memory_order_release);
  // Run each callback without the lock (they may take other locks), one at
  // a time; Unregister waits while its callback is the one running.
  while (!callbacks_.empty()) {
    auto it = callbacks_.begin();
    running_ = it->first;
    std::function<void()> callback = std::move(it->second);
    callbacks_.erase(it);
    mu_.Unlock();
    callback();
    mu_.Lock();
    running_ = 0;
  }
}

absl::Status Cancellation::reason() const {
  absl::MutexLock lock(&mu_);
  return reason_;
}

std::unique_ptr<Cancellation::Callback> Cancellation::OnCancel(
    std::function<void()> callback) const {
  {
    absl::MutexLock lock(&mu_);
    if (!cancelled_) {
      const uint64_t id = next_id_++;
      callbacks_.emplace(id, std::move(callback));
      return std::make_unique<Callback>(this, id);
    }
  }
  callback();
  return std::make_unique<Callback>(nullptr, 0);
}

void Cancellation::Unregister(uint64_t id) const {
  absl::MutexLock lock(&mu_);
  callbacks_.erase(id);
  const auto not_running = [this, id]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return running_ != id;
  };
  mu_.Await(absl::Condition(&not_running));
}

absl::Status StopToken::StopStatus(absl::string_view what) const {
  if (cancelled()) return cancellation_->reason();
  return absl::DeadlineExceededError(absl::StrCat("deadline passed ", what));
}

absl::Status StopToken::Check(absl::string_view what) const {
  if (!stopped()) return absl::OkStatus();
  return StopStatus(what);
}

}  // namespace rdma_agent

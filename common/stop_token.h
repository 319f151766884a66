#ifndef RDMA_AGENTD_COMMON_STOP_TOKEN_H_
#define RDMA_AGENTD_COMMON_STOP_TOKEN_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace rdma_agent {

// A one-shot signal that work must stop early: the client of a Submit went
// away or cancelled, or the agent is shutting down. Whoever owns the work
// owns the Cancellation; the work watches it through a StopToken.
//
// Thread-safe. Callbacks run on the thread that calls Cancel(), so they must
// be short and non-blocking (close a socket, notify a condition variable).
class Cancellation {
 public:
  class Callback;

  Cancellation() = default;
  Cancellation(const Cancellation&) = delete;
  Cancellation& operator=(const Cancellation&) = delete;

  // Sets the reason (first call wins; CANCELLED when `reason` is OK) and runs
  // every registered callback once. Idempotent.
  void Cancel(absl::Status reason);

  // Lock-free: work polls it between small steps (every op of a batch).
  bool cancelled() const {
    return cancelled_flag_.load(std::memory_order_acquire);
  }
  // The reason given to Cancel(); OK while not cancelled.
  absl::Status reason() const;

  // Runs `callback` at Cancel(), or at once (on this thread) when already
  // cancelled. Destroying the returned handle unregisters the callback and,
  // if it is running on another thread, waits for it to return: after the
  // handle is gone the callback never runs again.
  [[nodiscard]] std::unique_ptr<Callback> OnCancel(
      std::function<void()> callback) const;

 private:
  void Unregister(uint64_t id) const;

  mutable absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  // cancelled_, for cancelled() without the lock; set (release) once
  // reason_ is, so a reader that sees it and then takes the lock finds the
  // reason.
  std::atomic<bool> cancelled_flag_{false};
  absl::Status reason_ ABSL_GUARDED_BY(mu_);
  mutable uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  mutable std::map<uint64_t, std::function<void()>> callbacks_
      ABSL_GUARDED_BY(mu_);
  // Id of the callback Cancel() is running right now (0: none).
  mutable uint64_t running_ ABSL_GUARDED_BY(mu_) = 0;
};

// Unregisters a Cancellation callback when destroyed.
class Cancellation::Callback {
 public:
  Callback(const Cancellation* owner, uint64_t id) : owner_(owner), id_(id) {}
  Callback(const Callback&) = delete;
  Callback& operator=(const Callback&) = delete;
  ~Callback() {
    if (owner_ != nullptr) owner_->Unregister(id_);
  }

 private:
  const Cancellation* const owner_;
  const uint64_t id_;
};

// When a piece of work must stop: at its deadline, or earlier when its
// Cancellation (if any) fires. Cheap to copy; the Cancellation must outlive
// every copy.
//
// Implicitly made from an absl::Time, so code that has only a deadline
// passes it where a StopToken is expected.
class StopToken {
 public:
  StopToken(absl::Time deadline)  // NOLINT(google-explicit-constructor)
      : deadline_(deadline) {}
  StopToken(absl::Time deadline, const Cancellation* cancellation)
      : deadline_(deadline), cancellation_(cancellation) {}

  absl::Time deadline() const { return deadline_; }
  bool cancelled() const {
    return cancellation_ != nullptr && cancellation_->cancelled();
  }
  // True when the work must stop now (cancelled or past the deadline).
  bool stopped() const { return cancelled() || absl::Now() >= deadline_; }

  // OK while the work may go on; otherwise the cancellation's reason, or
  // DEADLINE_EXCEEDED with `what` ("deadline passed <what>").
  absl::Status Check(absl::string_view what) const;
  // The status for work cut short by this token: the cancellation's reason
  // when cancelled, otherwise DEADLINE_EXCEEDED with `what`.
  absl::Status StopStatus(absl::string_view what) const;

  // Registers `callback` with the cancellation; nullptr without one.
  [[nodiscard]] std::unique_ptr<Cancellation::Callback> OnCancel(
      std::function<void()> callback) const {
    if (cancellation_ == nullptr) return nullptr;
    return cancellation_->OnCancel(std::move(callback));
  }

 private:
  absl::Time deadline_;
  const Cancellation* cancellation_ = nullptr;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_COMMON_STOP_TOKEN_H_

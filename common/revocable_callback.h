#ifndef RDMA_AGENTD_COMMON_REVOCABLE_CALLBACK_H_
#define RDMA_AGENTD_COMMON_REVOCABLE_CALLBACK_H_

#include <functional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace rdma_agent {

// A callback that one side runs (a table telling a waiting RPC that
// something happened) and the other side can revoke before it goes away.
// Run and Revoke exclude each other: once Revoke has returned, the callback
// is not running and never runs again, so its owner may be destroyed.
//
// Hold it by shared_ptr on both sides: whoever runs it takes a reference
// under its own lock and runs it after releasing that lock, so the
// callback may take other locks (and call back into the runner) freely.
// The callback must not Revoke its own RevocableCallback (it would wait for
// itself). Thread-safe.
class RevocableCallback {
 public:
  explicit RevocableCallback(std::function<void()> callback)
      : callback_(std::move(callback)) {}
  RevocableCallback(const RevocableCallback&) = delete;
  RevocableCallback& operator=(const RevocableCallback&) = delete;

  // Runs the callback, unless revoked; concurrent calls run it one at a
  // time.
  void Run() {
    absl::MutexLock lock(&mu_);
    if (callback_) callback_();
  }

  // Waits for a running callback to return; from then on Run does nothing.
  void Revoke() {
    std::function<void()> gone;
    {
      absl::MutexLock lock(&mu_);
      gone = std::move(callback_);
      callback_ = nullptr;
    }
    // Destroyed without the lock: what it captured may take locks too.
  }

 private:
  absl::Mutex mu_;
  std::function<void()> callback_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_COMMON_REVOCABLE_CALLBACK_H_

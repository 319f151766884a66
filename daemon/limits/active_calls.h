#ifndef RDMA_AGENTD_DAEMON_LIMITS_ACTIVE_CALLS_H_
#define RDMA_AGENTD_DAEMON_LIMITS_ACTIVE_CALLS_H_

#include <sys/types.h>

#include <cstddef>
#include <list>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/stop_token.h"

namespace grpc {
class ServerContext;
}

namespace rdma_agent {

// Bounds on RPCs and data-path work in flight (flags --max_ops_in_flight*,
// --max_rpcs*, --max_waiting_rpcs*).
struct InFlightLimits {
  // RPCs running at once over all users: the gRPC server's thread bound
  // (its ResourceQuota enforces it, not ActiveCalls).
  size_t max_calls = 256;
  // Ops of running Submits, over all users and for one user.
  size_t max_ops = 262144;
  size_t max_ops_per_user = 65536;
  // RPCs of one user running at once. Each holds a gRPC server thread, so
  // this stays well below the server's thread bound: one user cannot take
  // every thread.
  size_t max_calls_per_user = 64;
  // Waiting RPCs (StartWaiting) open at once, for one user and over all
  // users. They hold no thread, only memory (a reactor, a stream's queued
  // events), so they get bounds of their own instead of call slots.
  size_t max_waiting_per_user = 128;
  size_t max_waiting = 4096;
};

// The agent's running RPCs: what they may hold and how they are stopped.
//
// - Admission: a call is admitted only if the user has a call slot left and
//   its ops (Submit) fit under the per-user and total bounds; beyond,
//   RESOURCE_EXHAUSTED before anything is built for it.
// - Abandonment: one long-lived thread checks every `poll_interval` whether
//   each call's client has cancelled or disconnected
//   (grpc::ServerContext::IsCancelled) and cancels its work (CANCELLED).
// - Shutdown: CancelAll() stops every call at once (UNAVAILABLE), so that
//   the server's shutdown grace is never spent waiting for transfers.
// - Work no RPC holds (an asynchronous transfer, daemon/transfers.h) charges
//   its ops with ChargeOps: they count toward the same bounds as a Submit's,
//   but take no call slot (they hold no gRPC thread) and are not watched
//   (their owner cancels them).
// - Waiting RPCs (StartWaiting: served by gRPC's callback API, e.g. a
//   WatchTransfers stream or a GetTransfers long poll) hold no thread while
//   they wait, so they take no call slot either: a client's open watch does
//   not eat into what it may run. They count toward their own per-user and
//   total bounds instead, are not watched (their reactor hears of its
//   client's going from gRPC, at once), and are cancelled by CancelAll and
//   awaited by WaitUntilIdle like every call.
//
// Thread-safe.
class ActiveCalls {
 public:
  // A running call. Its Cancellation fires when the client goes away or at
  // CancelAll(); destroying the handle ends the call's admission.
  class Call {
   public:
    Call(const Call&) = delete;
    Call& operator=(const Call&) = delete;
    ~Call();

    const Cancellation& cancellation() const { return cancellation_; }
    StopToken stop_token(absl::Time deadline) const {
      return StopToken(deadline, &cancellation_);
    }

   private:
    friend class ActiveCalls;
    Call(ActiveCalls* owner, const grpc::ServerContext* context, uid_t uid,
         size_t ops, bool waiting)
        : owner_(owner),
          context_(context),
          uid_(uid),
          ops_(ops),
          waiting_(waiting) {}

    ActiveCalls* const owner_;
    const grpc::ServerContext* const context_;  // nullptr: not watched
    const uid_t uid_;
    const size_t ops_;
    const bool waiting_;  // StartWaiting: no call slot, a waiting one
    Cancellation cancellation_;
    std::list<Call*>::iterator position_;
  };

  // Ops admitted by ChargeOps; destroying the handle gives them back.
  class OpsCharge {
   public:
    OpsCharge(const OpsCharge&) = delete;
    OpsCharge& operator=(const OpsCharge&) = delete;
    ~OpsCharge();

   private:
    friend class ActiveCalls;
    OpsCharge(ActiveCalls* owner, uid_t uid, size_t ops)
        : owner_(owner), uid_(uid), ops_(ops) {}

    ActiveCalls* const owner_;
    const uid_t uid_;
    const size_t ops_;
  };

  explicit ActiveCalls(InFlightLimits limits,
                       absl::Duration poll_interval = absl::Milliseconds(100));
  ActiveCalls(const ActiveCalls&) = delete;
  ActiveCalls& operator=(const ActiveCalls&) = delete;
  // Cancels what is still running and stops the watcher thread. Every Call
  // must be gone first.
  ~ActiveCalls();

  // Admits a call of `ops` ops (0 for RPCs other than Submit) for `uid` and
  // starts watching `context`
  // (nullptr: never abandoned, e.g. in-process callers). RESOURCE_EXHAUSTED
  // when the ops would pass a bound; UNAVAILABLE after CancelAll().
  absl::StatusOr<std::unique_ptr<Call>> Start(
      const grpc::ServerContext* context, uid_t uid, size_t ops);

  // Admits a waiting RPC of `uid` (see the class comment): no call slot,
  // one of the user's --max_waiting_rpcs_per_user and of the agent's
  // --max_waiting_rpcs (RESOURCE_EXHAUSTED beyond); UNAVAILABLE after
  // CancelAll(). Its Cancellation fires at CancelAll() only.
  absl::StatusOr<std::unique_ptr<Call>> StartWaiting(uid_t uid);

  // Admits `ops` ops of `uid` that no call holds, within the same bounds and
  // with the same errors as Start; UNAVAILABLE after CancelAll().
  absl::StatusOr<std::unique_ptr<OpsCharge>> ChargeOps(uid_t uid, size_t ops);

  // Cancels every running call with `reason` and refuses new ones (and new
  // ops charges).
  void CancelAll(const absl::Status& reason);

  // Waits until no call is running or `deadline` passes; true when idle.
  bool WaitUntilIdle(absl::Time deadline) const;

  // Calls running now, waiting ones included (for shutdown, tests and
  // metrics).
  size_t calls() const;
  // Waiting calls open now (for tests and metrics).
  size_t waiting() const;
  // Ops in flight for `uid` / in total, calls' and charges' (for tests and
  // metrics).
  size_t ops_in_flight(uid_t uid) const;
  size_t ops_in_flight() const;

 private:
  // OK when `ops` more ops of `uid` fit under the bounds.
  absl::Status CheckOps(uid_t uid, size_t ops) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Registers `call` (admitted) for watching and CancelAll.
  std::unique_ptr<Call> Track(std::unique_ptr<Call> call)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Add(uid_t uid, size_t calls, size_t ops)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Remove(uid_t uid, size_t calls, size_t ops)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void End(Call* call);
  void WatchLoop();

  const InFlightLimits limits_;
  const absl::Duration poll_interval_;
  mutable absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status closed_reason_ ABSL_GUARDED_BY(mu_);
  std::list<Call*> calls_ ABSL_GUARDED_BY(mu_);
  size_t ops_total_ ABSL_GUARDED_BY(mu_) = 0;
  size_t waiting_total_ ABSL_GUARDED_BY(mu_) = 0;
  struct UserLoad {
    size_t calls = 0;
    size_t ops = 0;
    size_t waiting = 0;
  };
  absl::flat_hash_map<uid_t, UserLoad> by_uid_ ABSL_GUARDED_BY(mu_);
  std::thread watcher_;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_LIMITS_ACTIVE_CALLS_H_

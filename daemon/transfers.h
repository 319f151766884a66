#ifndef RDMA_AGENTD_DAEMON_TRANSFERS_H_
#define RDMA_AGENTD_DAEMON_TRANSFERS_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/stop_token.h"
#include "rdma/agent/v1/agent.pb.h"

namespace rdma_agent {

namespace v1 = ::rdma::agent::v1;

// What one transfer runs: a validated batch of ops. The submitter
// (RdmaAgentService) provides it; the table calls exactly one of Run and
// Skip, then destroys it before it reports the end, so whatever the work
// holds (pinned registrations, admitted ops) is given back by then.
class TransferWork {
 public:
  virtual ~TransferWork() = default;
  // Runs the ops until they end or `stop` fires: one result per op, in
  // order, and what became of the batch's notifications. Returns only when
  // nothing of the work touches local memory.
  virtual v1::SubmitResponse Run(const StopToken& stop) = 0;
  // The outcome of work that never runs: `reason` for each op that had not
  // already failed (and no notification sent).
  virtual v1::SubmitResponse Skip(const absl::Status& reason) = 0;
};

// Bounds of the transfer table (flags --transfer_workers,
// --max_transfers_in_flight*, --transfer_retention).
struct TransferLimits {
  // Worker threads running transfers, started with the table.
  size_t workers = 4;
  // Transfers queued or running, for one user and over all users.
  size_t max_in_flight_per_user = 1024;
  size_t max_in_flight = 8192;
  // How long an ended transfer nobody has read is kept.
  absl::Duration retention = absl::Minutes(5);
};

// The asynchronous transfers of the agent (SubmitAsync and friends): their
// ids, states and results, the queue, and the fixed set of worker threads
// that run them. No thread is created per transfer.
//
// - Ids are scoped to the submitting user: another user's id is NOT_FOUND,
//   with the message an unknown id gets.
// - A transfer is PENDING while queued or running, then DONE (every op OK),
//   CANCELLED (Cancel stopped at least one of its ops: that op's code is
//   CANCELLED) or FAILED. Its end is recorded once, under the table's lock,
//   so every reader sees the same final state, and the state never
//   contradicts the results (a transfer its deadline ended before Cancel
//   reached it is FAILED with DEADLINE_EXCEEDED).
// - Cancel fires the transfer's Cancellation (or takes it off the queue) and
//   returns only once its run has ended: TransferWork::Run's guarantee then
//   means nothing of it touches local memory.
// - An ended transfer is kept until its end has been reported to its user
//   (Get, or a watch with MarkReported) or for `retention`, whichever is
//   first. Expired transfers are dropped by the next call into the table; no
//   thread sweeps.
// - Shutdown skips what is queued and cancels what runs with the given
//   reason, refuses new transfers and joins the workers.
//
// Thread-safe.
class TransferTable {
 public:
  // A user's interest in the ends of its transfers (WatchTransfers), from
  // Watch until destroyed.
  class Watcher {
   public:
    Watcher(const Watcher&) = delete;
    Watcher& operator=(const Watcher&) = delete;
    ~Watcher();

   private:
    friend class TransferTable;
    Watcher(TransferTable* owner, uid_t uid) : owner_(owner), uid_(uid) {}

    TransferTable* const owner_;
    const uid_t uid_;
    // Ends up to this sequence number have been returned by NextEnded.
    uint64_t seen_ = 0;
  };

  // Starts `limits.workers` worker threads.
  explicit TransferTable(TransferLimits limits);
  TransferTable(const TransferTable&) = delete;
  TransferTable& operator=(const TransferTable&) = delete;
  // Shutdown() with UNAVAILABLE, if it has not run. Every Watcher must be
  // gone first.
  ~TransferTable();

  // Queues `work` for `uid`, to be stopped at `deadline` (DEADLINE_EXCEEDED
  // for ops still pending then, queued or not); returns its id.
  // RESOURCE_EXHAUSTED naming the flag when `uid`, or the agent, already
  // has its bound of transfers in flight; the shutdown reason after
  // Shutdown().
  absl::StatusOr<uint64_t> Submit(uid_t uid, std::unique_ptr<TransferWork> work,
                                  absl::Time deadline);

  // The transfers `ids` of `uid`, once all of them have ended or `deadline`
  // has passed or `stop` (if any) has fired, whichever comes first; one per
  // id, in order. Those that have ended are reported (dropped from the
  // table). NOT_FOUND for the first id that is not one of uid's kept
  // transfers; nothing is reported then.
  absl::StatusOr<std::vector<v1::Transfer>> Get(uid_t uid,
                                                absl::Span<const uint64_t> ids,
                                                absl::Time deadline,
                                                const Cancellation* stop);

  // Cancels transfer `id` of `uid` and waits until it has ended; returns its
  // final state (not reported: Get and watches still see it). A transfer
  // that had ended is returned as it ended. NOT_FOUND as Get.
  absl::StatusOr<v1::Transfer> Cancel(uid_t uid, uint64_t id);

  // Starts watching the ends of uid's transfers: the first NextEnded returns
  // those already ended and not yet reported.
  std::unique_ptr<Watcher> Watch(uid_t uid);
  // Waits until transfers of the watcher's user have ended that this watcher
  // has not returned yet, oldest end first. Empty when `stop` fires or at
  // Shutdown(). The caller reports each one it delivered with MarkReported.
  std::vector<v1::Transfer> NextEnded(Watcher& watcher,
                                      const Cancellation* stop);
  // Drops ended transfer `id` of `uid`: its end has been delivered.
  void MarkReported(uid_t uid, uint64_t id);

  // Ends every transfer with `reason` (queued ones never start, running ones
  // are cancelled), refuses new ones, wakes every waiter and joins the
  // workers. Idempotent; the first reason wins.
  void Shutdown(const absl::Status& reason);

  // For metrics and tests: transfers queued or running (for `uid`), kept
  // (every state, not yet reported or expired), and open watchers.
  size_t in_flight() const;
  size_t in_flight(uid_t uid) const;
  size_t kept() const;
  size_t watchers() const;

 private:
  struct Record;
  using RecordPtr = std::shared_ptr<Record>;

  void WorkLoop();
  // Takes the next queued transfer, marking it running; nullptr once
  // stopping and the queue is empty.
  RecordPtr NextQueued();
  // Runs (or skips, when `skip` is not OK or its deadline has passed) the
  // work of `record`, which the caller has taken off the queue, then records
  // its end. Called without the lock.
  void Finish(const RecordPtr& record, const absl::Status& skip);
  // Records the end of `record` with `results` and wakes waiters.
  void End(Record& record, v1::SubmitResponse outcome)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // uid's record `id`, or NOT_FOUND.
  absl::StatusOr<RecordPtr> Find(uid_t uid, uint64_t id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops ended records older than the retention.
  void DropExpired() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // While the handle lives, `stop` firing sets *stopped under mu_, so that a
  // wait on mu_ sees it. Take it before mu_ (the callback may run at once,
  // and takes mu_) and let it go after (declare it first). Null without a
  // `stop`.
  std::unique_ptr<Cancellation::Callback> WakeOnCancel(const Cancellation* stop,
                                                       bool* stopped)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Drops ended `record` from every index.
  void Drop(const Record& record) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::Transfer Describe(const Record& record) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const TransferLimits limits_;
  mutable absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status closed_reason_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;  // workers exit
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_end_ ABSL_GUARDED_BY(mu_) = 1;  // end sequence numbers
  absl::flat_hash_map<uint64_t, RecordPtr> records_ ABSL_GUARDED_BY(mu_);
  // Queued transfers, first submitted first.
  std::list<RecordPtr> queue_ ABSL_GUARDED_BY(mu_);
  // Transfers running on a worker (cancelled at Shutdown).
  absl::flat_hash_map<uint64_t, RecordPtr> running_ ABSL_GUARDED_BY(mu_);
  // Queued or running, by user and in total.
  absl::flat_hash_map<uid_t, size_t> in_flight_by_uid_ ABSL_GUARDED_BY(mu_);
  size_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  // Ended and kept transfers of each user by end sequence number (watchers
  // walk it), and every end in order with its time (expiry walks it).
  absl::flat_hash_map<uid_t, std::map<uint64_t, uint64_t>> ended_by_uid_
      ABSL_GUARDED_BY(mu_);
  std::list<std::pair<absl::Time, uint64_t>> ends_ ABSL_GUARDED_BY(mu_);
  size_t watchers_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::thread> workers_;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_TRANSFERS_H_

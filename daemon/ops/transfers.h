#ifndef RDMA_AGENTD_DAEMON_OPS_TRANSFERS_H_
#define RDMA_AGENTD_DAEMON_OPS_TRANSFERS_H_

#include <sys/types.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/revocable_callback.h"
#include "common/stop_token.h"
#include "daemon/limits/quota.h"
#include "rdma/agent/v1/agent.pb.h"

namespace rdma_agent {

namespace v1 = ::rdma::agent::v1;

// How far a transfer's bytes have got (Transfer.bytes_total and
// bytes_done): shared by its work, which counts, and the table's record,
// which reports, so it outlives whichever ends first.
struct TransferProgress {
  explicit TransferProgress(uint64_t total) : total_bytes(total) {}
  const uint64_t total_bytes;
  std::atomic<uint64_t> landed_bytes{0};
};

// Runs tasks that may block (a notification sent over the network) on
// threads kept for such work, never on the thread that hands them over (a
// backend's completion poller or event loop must not block). Every task
// given is run, also during shutdown.
class BlockingExecutor {
 public:
  using Task = absl::AnyInvocable<void() &&>;
  virtual ~BlockingExecutor() = default;
  virtual void Run(Task task) = 0;
};

// How a started transfer ends: what Run would have returned.
using TransferDone = absl::AnyInvocable<void(v1::SubmitResponse) &&>;

// What one transfer runs: a validated batch of ops. The submitter
// (RdmaAgentService) provides it; the table calls exactly one of Start and
// Skip, then destroys it before it reports the end, so whatever the work
// holds (pinned registrations, admitted ops) is given back by then.
class TransferWork {
 public:
  virtual ~TransferWork() = default;
  // Runs the ops until they end or `stop` fires: one result per op, in
  // order, and what became of the batch's notifications. Returns only when
  // nothing of the work touches local memory.
  virtual v1::SubmitResponse Run(const StopToken& stop) = 0;
  // Run without a thread waiting on it: starts the ops and returns; `done`
  // is called exactly once with what Run would return, once nothing of the
  // work touches local memory, on whichever thread ended it (possibly
  // inside Start). Work that may block (notifications) goes to `blocking`.
  // `done` may destroy the work: nothing of it is touched after `done`.
  // `stop`'s Cancellation outlives the call of `done`. The default, for
  // work with no asynchronous start, runs Run on the calling thread.
  virtual void Start(const StopToken& stop, BlockingExecutor& blocking,
                     TransferDone done) {
    (void)blocking;
    std::move(done)(Run(stop));
  }
  // True when Start returns without waiting for the work (it only posts):
  // the table may then start it on the submitting thread.
  virtual bool StartsWithoutBlocking() const { return false; }
  // The outcome of work that never runs: `reason` for each op that had not
  // already failed (and no notification sent).
  virtual v1::SubmitResponse Skip(const absl::Status& reason) = 0;
  // The work's progress, followed from now on; nullptr: none to report.
  // Called once, before Start or Skip.
  virtual std::shared_ptr<const TransferProgress> progress() { return nullptr; }
};

// Bounds of the transfer table (flags --transfer_workers,
// --max_running_transfers_per_user, --max_transfers_in_flight*,
// --max_kept_transfers_per_user, --max_transfer_bytes_*,
// --transfer_retention).
struct TransferLimits {
  // Worker threads, started with the table: they start queued transfers
  // (which then run without them) and send the notifications of ended
  // ones (network calls that may block).
  size_t workers = 4;
  // Transfers of one user started and not ended, at once; 0: half of
  // `workers` (at least 1). A user at its cap waits while other users'
  // queued transfers start, so one user's transfers stuck on a silent peer
  // hold at most this many transfers' memory and peer load, and never keep
  // another user's from starting.
  size_t max_running_per_user = 0;
  // Transfers queued or running, for one user and over all users.
  size_t max_in_flight_per_user = 1024;
  size_t max_in_flight = 8192;
  // Transfers one user has in the table at once: in flight, or ended and
  // kept for Get. Also how far a Stream may fall behind.
  size_t max_kept_per_user = 4096;
  // Bytes of memory the table may hold for one user and for all users: the
  // request copies and prepared batches of queued and running transfers,
  // the results of ended ones, and the copies of results being sent
  // (GetTransfers replies, WatchTransfers events). See TransferTable.
  uint64_t max_bytes_per_user = uint64_t{256} << 20;
  uint64_t max_bytes_total = uint64_t{1} << 30;
  // How long an ended transfer nobody has read is kept.
  absl::Duration retention = absl::Minutes(5);

  // max_running_per_user, with 0 resolved.
  size_t running_per_user() const {
    if (max_running_per_user > 0) return max_running_per_user;
    return std::max<size_t>(workers / 2, 1);
  }
};

// What a copy of `request` takes in memory, estimated from above (each
// message, string and repeated-field slot with its allocator overhead):
// what SubmitAsync reserves before it copies the request for a transfer.
uint64_t RequestCopyBytes(const v1::SubmitRequest& request);

// What `response` (a transfer's results) takes in memory, estimated from
// above like RequestCopyBytes.
uint64_t ResultsBytes(const v1::SubmitResponse& response);

// Bytes of the table's budget reserved for one transfer
// (TransferTable::Reserve) before SubmitAsync builds it: the copy of its
// request and what its prepared batch holds while it is queued or running,
// and a floor that stays with the transfer until it is dropped (its record
// and one code per result). Given back when destroyed. Move-only.
class TransferCharge {
 public:
  TransferCharge() = default;
  TransferCharge(TransferCharge&&) = default;
  TransferCharge& operator=(TransferCharge&&) = default;
  uint64_t bytes() const;

 private:
  friend class TransferTable;
  uid_t uid_ = 0;
  size_t ops_ = 0;
  QuotaCharge floor_;
  std::vector<QuotaCharge> held_;
};

// The asynchronous transfers of the agent (SubmitAsync and friends): their
// ids, states and results, the queue, and the fixed set of worker threads
// that run them. No thread is created per transfer, and nothing here makes
// a caller wait for an end: Polls and Streams are told by callbacks.
//
// - Ids are random (63 bits, never 0), so that they say nothing of other
//   users' transfers, and scoped to the submitting user: another user's id
//   is NOT_FOUND, with the message an unknown id gets.
// - A transfer is PENDING while queued or running, then DONE (every op OK),
//   CANCELLED (Cancel stopped at least one of its ops: that op's code is
//   CANCELLED) or FAILED. Its end is recorded once, under the table's lock,
//   so every reader sees the same final state, and the state never
//   contradicts the results (a transfer its deadline ended before Cancel
//   reached it is FAILED with DEADLINE_EXCEEDED).
// - Workers take queued transfers user by user in turn and start them
//   (TransferWork::Start): a worker returns to the queue at once, and the
//   transfer stays running until its done, which records the end on the
//   thread that ended it (a backend's completion thread, or a worker that
//   sent its notifications: the table is the work's BlockingExecutor). A
//   user with `running_per_user()` transfers running is skipped until one
//   ends, so one user's stuck transfers never hold more than that.
// - Cancel fires the transfer's Cancellation (or takes it off the queue) and
//   returns only once it has ended: TransferWork::Start's guarantee then
//   means nothing of it touches local memory.
// - Reading is acknowledging: an ended transfer is kept until a Poll has
//   reported it (Poll::Report), or for `retention`. Streams do not consume
//   ends: every open Stream of a user gets every end of that user's
//   transfers (first those kept when it opened), and what a Stream delivered
//   stays readable by Get, so a reader that dies with an end in flight loses
//   nothing.
// - A user keeps at most `max_kept_per_user` transfers (in flight plus
//   ended). Submit makes room by dropping the oldest end a Stream has
//   delivered (its client has it); when none has been delivered, Submit is
//   refused (RESOURCE_EXHAUSTED): an end nobody has seen is never dropped to
//   make room, only by its retention.
// - Bytes: everything a caller makes the table hold is charged to its user
//   and to the total (`max_bytes_per_user`, `max_bytes_total`, one
//   ResourceQuota) before it is allocated, and given back when the memory
//   goes: a queued or running transfer's request copy and prepared batch
//   (Reserve and Grow, by SubmitAsync), an ended transfer's results (charged
//   when its end is recorded, in place of its request), and each copy of
//   results being sent (a Poll's reply, a Stream's next event). A record
//   holds its charge until it is destroyed, wherever the last reference to
//   it was (a table index, a Stream's queue, a Poll). When the budget
//   refuses, delivered ends of the user are dropped first; then Reserve,
//   Grow and Report refuse (RESOURCE_EXHAUSTED naming the flag), a Stream
//   closes, and an end whose results do not fit keeps only each op's and
//   each notification's code (its floor, reserved with the transfer): its
//   first non-OK result (and notification) then carries
//   kDetailsDroppedPerUser or kDetailsDroppedTotal as its message, the
//   other non-OK ones kDetailsDropped (none has a backend, agent or
//   buffer).
// - Expired transfers are dropped by the next call into the table; no thread
//   sweeps. Dropped records are destroyed (their results freed) after the
//   table's lock is released; results are copied for readers without it.
// - Shutdown skips what is queued and cancels what runs with the given
//   reason, closes every Stream with it, refuses new transfers, waits for
//   the running ones to end and joins the workers.
//
// Callbacks given to StartPoll and Watch run on whichever thread records
// the end (a backend's completion thread, a worker, Cancel's or Shutdown's
// caller), without the table's
// lock; they must be short (hand the news to a gRPC reactor) and must not
// destroy their own Poll or Stream. Thread-safe.
class TransferTable final : private BlockingExecutor {
 public:
  // The message of the first non-OK result (and notification) of a
  // transfer whose results did not fit the byte budget when it ended: only
  // its codes were kept. Which budget refused is named. Every other non-OK
  // one says kDetailsDropped (short: no allocation of its own).
  static constexpr char kDetailsDroppedPerUser[] =
      "details dropped: this transfer's results did not fit its user's "
      "transfer byte budget (--max_transfer_bytes_per_user) when it ended; "
      "only each op's code was kept";
  static constexpr char kDetailsDroppedTotal[] =
      "details dropped: this transfer's results did not fit the agent's "
      "transfer byte budget (--max_transfer_bytes_total) when it ended; only "
      "each op's code was kept";
  static constexpr char kDetailsDropped[] = "details dropped";

  // A read of some of a user's transfers that may wait for them to end
  // (GetTransfers with `wait`). The transfers are held from StartPoll on, so
  // the Poll describes them even if another reader reports them first.
  class Poll {
   public:
    Poll(const Poll&) = delete;
    Poll& operator=(const Poll&) = delete;
    // Once it returns, the poll's callback is not running and never runs;
    // the reply's charge is given back.
    ~Poll();

    // True once every named transfer has ended.
    bool settled() const;
    // Each named transfer as it is now, one per distinct id, in the order
    // the ids were first named. Those that have ended are reported: dropped
    // from the table (their ids answer NOT_FOUND from then on). Report only
    // what is answered to the client, and at most once: a poll given up (its
    // client went away) is destroyed without it.
    //
    // The transfers' serialized size stays within `max_bytes` (a reply must
    // fit in a gRPC message; one batch may carry 65536 results), counted
    // from each record's kept sizes before anything is copied: once the
    // next ended transfer would pass it, that one and every later ended one
    // come without results and notifications, with `results_left_out` set,
    // and stay kept, to be named again. The first transfer is always whole.
    //
    // The reply is charged to the user's byte budget until the Poll is
    // destroyed: an end read by this poll alone (no Stream or other Poll
    // holds it) moves into the reply with its charge, uncopied; any other
    // is copied, outside the table's lock, and its copy charged.
    // RESOURCE_EXHAUSTED naming the budget, with nothing reported, when the
    // copies do not fit.
    absl::StatusOr<std::vector<v1::Transfer>> Report(
        size_t max_bytes = std::numeric_limits<size_t>::max());

   private:
    friend class TransferTable;
    struct State;
    Poll(TransferTable* owner, std::shared_ptr<State> state)
        : owner_(owner), state_(std::move(state)) {}

    TransferTable* const owner_;
    const std::shared_ptr<State> state_;
  };

  // The ends of one user's transfers, for one WatchTransfers stream: those
  // kept when it opened, then every end as it happens, each once, oldest
  // first. Independent of every other Stream.
  class Stream {
   public:
    Stream(const Stream&) = delete;
    Stream& operator=(const Stream&) = delete;
    // Once it returns, the stream's callback is not running and never runs.
    ~Stream();

    // The next end queued for this stream, taken off its queue (copied
    // without the table's lock; the copy stays charged until the next Next
    // or the stream's end); nullopt when none is queued, or once the stream
    // is closed.
    std::optional<v1::Transfer> Next();
    // End `id` (returned by Next) has reached the client's stream: from now
    // on it may be dropped to make room under max_kept_per_user and the
    // byte budget.
    void Delivered(uint64_t id);
    // OK while open; why it closed otherwise: RESOURCE_EXHAUSTED when more
    // than max_kept_per_user ends waited for it (its client does not read)
    // or the copy of its next end does not fit the byte budget (it closes
    // after the end in flight), the shutdown reason after Shutdown().
    absl::Status status() const;

   private:
    friend class TransferTable;
    struct State;
    Stream(TransferTable* owner, std::shared_ptr<State> state)
        : owner_(owner), state_(std::move(state)) {}

    TransferTable* const owner_;
    const std::shared_ptr<State> state_;
  };

  // Starts `limits.workers` worker threads.
  explicit TransferTable(TransferLimits limits);
  TransferTable(const TransferTable&) = delete;
  TransferTable& operator=(const TransferTable&) = delete;
  // Shutdown() with UNAVAILABLE, if it has not run. Every Poll and Stream
  // must be gone first.
  ~TransferTable();

  // Reserves the budget for a transfer of `ops` ops of `uid` whose request
  // copy takes `request_bytes` (RequestCopyBytes), before SubmitAsync copies
  // anything: those bytes plus the transfer's floor. Makes room by dropping
  // ends of `uid` a Stream delivered; then RESOURCE_EXHAUSTED naming
  // --max_transfer_bytes_per_user or --max_transfer_bytes_total.
  absl::StatusOr<TransferCharge> Reserve(uid_t uid, uint64_t request_bytes,
                                         size_t ops);
  // Adds `bytes` to `charge` (what the prepared batch holds besides the
  // request copy); RESOURCE_EXHAUSTED as Reserve, `charge` unchanged.
  absl::Status Grow(TransferCharge& charge, uint64_t bytes);

  // Queues `work` for `uid`, to be stopped at `deadline` (DEADLINE_EXCEEDED
  // for ops still pending then, queued or not); returns its id. `charge`
  // (from Reserve, for `uid`) stays with the transfer. RESOURCE_EXHAUSTED
  // naming the flag when `uid`, or the agent, already has its bound of
  // transfers in flight, or `uid` keeps its bound of transfers and none of
  // its ends has been delivered by a Stream; the shutdown reason after
  // Shutdown().
  //
  // When `work` starts without blocking (StartsWithoutBlocking), no
  // transfer waits for a worker and `uid` is below its cap of running
  // transfers, the transfer is started on the calling thread before Submit
  // returns, and may have ended by then.
  absl::StatusOr<uint64_t> Submit(uid_t uid, std::unique_ptr<TransferWork> work,
                                  absl::Time deadline, TransferCharge charge);

  // Starts reading the transfers `ids` of `uid` (a repeated id counts
  // once). NOT_FOUND for the first id that is not one of uid's kept
  // transfers (nothing is reported then). Unless the poll is settled when
  // this returns, `on_settled` is called once, when the last of them ends
  // (also at Shutdown, which ends them all). A poll that was already
  // settled, or settles as this returns, may or may not get the call: check
  // settled() after StartPoll. O(ids) under the table's lock.
  absl::StatusOr<std::unique_ptr<Poll>> StartPoll(
      uid_t uid, absl::Span<const uint64_t> ids,
      std::function<void()> on_settled);

  // StartPoll and Report at once: the transfers as they are now.
  absl::StatusOr<std::vector<v1::Transfer>> Get(uid_t uid,
                                                absl::Span<const uint64_t> ids);

  // Cancels transfer `id` of `uid` and waits until it has ended; returns its
  // final state (not reported: Get and streams still see it). A transfer
  // that had ended is returned as it ended. NOT_FOUND as StartPoll.
  absl::StatusOr<v1::Transfer> Cancel(uid_t uid, uint64_t id);
  // Cancels transfer `id` of `uid` as Cancel does, without waiting: its end
  // comes as any end does (Polls, Streams), soon after by the backends'
  // contract. NOT_FOUND as StartPoll.
  absl::Status StartCancel(uid_t uid, uint64_t id);

  // Opens a Stream of uid's ends. `on_ready` is called each time an end is
  // queued for it, and when it closes; the shutdown reason after Shutdown().
  absl::StatusOr<std::unique_ptr<Stream>> Watch(uid_t uid,
                                                std::function<void()> on_ready);

  // Ends every transfer with `reason` (queued ones never start, running ones
  // are cancelled), closes every Stream, refuses new transfers and streams,
  // waits for the running ones to end and joins the workers. Idempotent;
  // the first reason wins.
  void Shutdown(const absl::Status& reason);

  // For metrics and tests: transfers queued or running (for `uid`), running
  // on a worker for `uid`, kept (every state, not yet reported or expired),
  // open streams and polls waiting for ends, bytes charged (for `uid`).
  // `running(uid)` counts transfers started and not ended.
  size_t in_flight() const;
  size_t in_flight(uid_t uid) const;
  size_t running(uid_t uid) const;
  size_t kept() const;
  size_t watchers() const;
  size_t waiting_polls() const;
  uint64_t bytes() const;
  uint64_t bytes(uid_t uid) const;
  const TransferLimits& limits() const { return limits_; }

 private:
  struct Record;
  class Locked;
  using RecordPtr = std::shared_ptr<Record>;
  // Cancel's first half: the cancellation fired (or the transfer taken off
  // the queue and ended); the record, which may not have ended yet.
  absl::StatusOr<RecordPtr> FireCancel(uid_t uid, uint64_t id);
  using Wakeups = std::vector<std::shared_ptr<RevocableCallback>>;
  // What the table keeps for one user.
  struct User {
    size_t in_flight = 0;
    // Of those, taken by a worker and not ended.
    size_t running = 0;
    // Queued transfers of the user, first submitted first.
    std::list<RecordPtr> queued;
    // Its place in turns_ while `in_turns` (it has queued transfers), and
    // whether it is below its cap of running ones too (counted in
    // ready_users_).
    bool in_turns = false;
    std::list<uid_t>::iterator turn;
    bool ready = false;
    // Ended and kept, by end sequence number (a new Stream's backlog).
    std::map<uint64_t, RecordPtr> ended;
    // End sequence numbers of those in `ended` a Stream has delivered: what
    // may be dropped to make room, oldest first.
    std::set<uint64_t> delivered;
    std::vector<std::shared_ptr<Stream::State>> streams;
  };
  // What a Report does with one transfer it names.
  struct ReportPlan;

  // What a worker does next: a blocking task, or a queued transfer to
  // start; neither once stopping and nothing is left to start or finish.
  struct Job {
    Task task;
    RecordPtr record;
  };
  void WorkLoop();
  Job NextJob();
  // Submit's checks and bookkeeping, under the lock. Sets `start_now` to
  // the new record when the caller is to start it (see Submit).
  absl::StatusOr<uint64_t> Admit(
      uid_t uid, std::unique_ptr<TransferWork> work, absl::Time deadline,
      TransferCharge charge, std::shared_ptr<const TransferProgress> progress,
      RecordPtr& start_now);
  // BlockingExecutor: `task` runs on a worker, before any queued transfer
  // starts.
  void Run(Task task) override;
  // Starts (or skips, when `skip` is not OK or its deadline has passed) the
  // work of `record`, which the caller has taken off the queue and hands
  // over; its end is recorded by Finish when it is done. Called without
  // the lock.
  void Start(RecordPtr record, const absl::Status& skip);
  // Destroys the work of `record` and records its end with `response`.
  // Called without the lock, on the thread that ended it.
  void Finish(RecordPtr record, v1::SubmitResponse response);
  // What Finish worked out of an outcome without the lock.
  struct Outcome;
  // Records the end of `record` with `outcome`; returns the callbacks to
  // run once the lock is released (settled polls, streams it was queued
  // for).
  Wakeups End(const RecordPtr& record, Outcome& outcome)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queues `record` for `stream`, closing the stream instead when that
  // would pass max_kept_per_user, or when `record` becomes the head of its
  // queue and its copy does not fit the budget.
  void Queue(Stream::State& stream, const RecordPtr& record)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reserves the copy of the head of `stream`'s queue; closes the stream
  // when it does not fit.
  void ReserveHead(Stream::State& stream) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Closes `stream` with `why`; its queue goes to the graveyard.
  void Close(Stream::State& stream, const absl::Status& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // uid's record `id`, or NOT_FOUND.
  absl::StatusOr<RecordPtr> Find(uid_t uid, uint64_t id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops ended records older than the retention.
  void DropExpired() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes room for one more transfer of `user` (uid `uid`) under
  // max_kept_per_user by dropping delivered ends; RESOURCE_EXHAUSTED when
  // there are none left to drop.
  absl::Status MakeRoom(uid_t uid, User& user)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reserves `bytes` for `uid`, dropping ends of `uid` a Stream delivered
  // (oldest first) while the budget refuses; the budget's refusal when
  // none is left.
  absl::StatusOr<QuotaCharge> ReserveBytes(uid_t uid, uint64_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops ended `record` from every index (Streams and Polls that hold it
  // keep it); it is destroyed once the lock is released, if nothing else
  // holds it.
  void Drop(const Record& record) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Hands `record` to the graveyard (destroyed without the lock); when
  // nothing else holds it, its charges are given back at once.
  void Bury(RecordPtr record) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets `uid` when it has nothing left in the table.
  void ForgetIfIdle(uid_t uid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Puts `user` in turns_ (at the back) or takes it out, as it has queued
  // transfers or not, and counts it ready when it is below its cap of
  // running ones too.
  void UpdateTurn(uid_t uid, User& user) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A transfer as it is now, without results: what is guarded by the lock.
  v1::Transfer Header(const Record& record) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Header and results: for Describe's callers that hold the lock only for
  // the header (the results of an ended record do not change).
  static void AddResults(const Record& record, v1::Transfer& transfer);
  // A fresh random id no kept record has.
  uint64_t NewId() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Poll and Stream, when their handles go.
  void ForgetPoll(const std::shared_ptr<Poll::State>& poll)
      ABSL_LOCKS_EXCLUDED(mu_);
  void ForgetStream(const std::shared_ptr<Stream::State>& stream)
      ABSL_LOCKS_EXCLUDED(mu_);

  const TransferLimits limits_;
  const size_t running_per_user_;
  // The byte budget: per user and total.
  const std::shared_ptr<ResourceQuota> budget_;
  mutable absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status closed_reason_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;  // workers exit
  uint64_t next_end_ ABSL_GUARDED_BY(mu_) = 1;  // end sequence numbers
  absl::flat_hash_map<uint64_t, RecordPtr> records_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uid_t, User> users_ ABSL_GUARDED_BY(mu_);
  // Users with queued transfers, in turn: a free worker takes the first
  // queued transfer of the first user below its cap of running transfers,
  // who then goes to the back. One user's long queue thus delays another's
  // next transfer by at most one transfer per user ahead, not by the whole
  // queue, and a user at its cap is skipped (keeping its place) while
  // others' transfers run.
  std::list<uid_t> turns_ ABSL_GUARDED_BY(mu_);
  // Of those, below their cap: what workers wait for.
  size_t ready_users_ ABSL_GUARDED_BY(mu_) = 0;
  // Transfers started and not ended (cancelled at Shutdown, which waits
  // for them).
  absl::flat_hash_map<uint64_t, RecordPtr> running_ ABSL_GUARDED_BY(mu_);
  // Tasks handed to the workers (Run), first given first.
  std::deque<Task> tasks_ ABSL_GUARDED_BY(mu_);
  size_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  // Every kept end in order with its time (expiry walks it).
  std::list<std::pair<absl::Time, uint64_t>> ends_ ABSL_GUARDED_BY(mu_);
  size_t streams_ ABSL_GUARDED_BY(mu_) = 0;
  size_t waiting_polls_ ABSL_GUARDED_BY(mu_) = 0;
  // Records dropped under the lock, destroyed once it is released (Locked):
  // freeing a record's results is no work for the table's lock.
  std::vector<RecordPtr> graveyard_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> workers_;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_OPS_TRANSFERS_H_

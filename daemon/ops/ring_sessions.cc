#include "daemon/ops/ring_sessions.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/fd_message.h"
#include "common/log_text.h"
#include "common/ring_protocol.h"
#include "common/shared_memory.h"
#include "common/status_util.h"
#include "common/thread_name.h"
#include "spdlog/spdlog.h"

namespace rdma_agent {
namespace {

v1::AttachResponse Refusal(const absl::Status& status) {
  v1::AttachResponse response;
  response.set_code(static_cast<int>(status.code()));
  response.set_message(std::string(status.message()));
  return response;
}

// One doorbell byte; a full socket already holds one, which is enough.
void Ring(int fd) {
  const char byte = 1;
  (void)::send(fd, &byte, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
}

// A READ or WRITE entry (checked) as the preparer takes it.
OpSpec SpecOf(const ring::Submission& entry) {
  OpSpec spec;
  spec.type = static_cast<v1::OpType>(entry.opcode);
  spec.local_buffer_id = entry.local_buffer_id;
  spec.local_offset = entry.local_offset;
  spec.length = entry.length;
  spec.remote_handle = entry.remote_handle;
  spec.remote_offset = entry.remote_offset;
  return spec;
}

absl::Status StatusOf(int32_t code, const std::string& message) {
  if (code == 0) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(code), message);
}

void WriteEventFd(int fd) {
  const uint64_t one = 1;
  (void)!::write(fd, &one, sizeof(one));
}

}  // namespace

// One open ring: its connection and the charges it holds, its mapping (the
// agent's geometry, never read back from it), the agent's own head and
// completion tail, and the batches it has taken and not completed. Served
// by one ring thread, which alone calls its methods but Wake and Info (so
// only that thread posts completions).
class RingSessions::Session {
 public:
  // Whether a session may sleep (ArmWakeup).
  enum class Wakeup {
    kIdle,     // nothing published: it sleeps until woken
    kPending,  // work it cannot take yet (no room): it looks again soon
    kWork,     // published since its last turn: it does not sleep
  };

  Session(RingSessions* owner, UniqueFd fd, QuotaCharge connection_charge,
          QuotaCharge slot, const PeerCredentials& peer, SharedMemory memory,
          const ring::Geometry& geometry, int wakeup)
      : owner_(owner),
        connection_(std::move(fd)),
        fd_(connection_.get()),
        connection_charge_(std::move(connection_charge)),
        slot_(std::move(slot)),
        peer_(peer),
        memory_(std::move(memory)),
        geometry_(geometry),
        base_(memory_.data()),
        wakeup_(wakeup),
        opened_(absl::Now()),
        preparer_(owner->env_.buffers, peer.uid, owner->env_.handles,
                  owner->env_.names),
        tally_(owner->env_.metrics) {}

  int fd() const { return fd_; }
  // Wakes the serving thread (a batch ended, the agent stops).
  void Wake() const { WriteEventFd(wakeup_); }
  RingSessionInfo Info() const;

  // One turn: posts the batches that ended, then takes and starts at most
  // one batch. False when the session must end (stopped).
  bool Turn(bool* worked);
  // Reads doorbell bytes (a bounded number: a client that keeps ringing
  // costs only its own turns); false when the client closed the
  // connection.
  bool Drain();
  // Sets NEEDS_WAKEUP, then looks at the ring once more (RING.md,
  // wake-ups): whether the session may sleep.
  Wakeup ArmWakeup();
  void DisarmWakeup() {
    Word(ring::kAgentFlagsOffset).fetch_and(~ring::kAgentNeedsWakeup);
  }
  // Whether batches it took are running (their ends will wake the thread).
  bool running() const { return !running_.empty(); }
  // Begins the session's end: nothing more is taken, a batch waiting for
  // room is refused and running ones are cancelled; their ends are posted
  // by PostEnded as they come. Idempotent.
  void BeginEnd();
  bool ending() const { return ending_; }
  // Ending, and no batch of it is left: nothing of it touches local memory
  // or the ring any more, and it may be destroyed.
  bool ended() const { return ending_ && running_.empty() && cancels_.empty(); }
  // Posts the completions of every started batch that ended; true if any.
  bool PostEnded();

 private:
  // A batch taken and not yet completed: the copies of its entries, and
  // once started, what runs it. Reused from batch to batch, with its
  // vectors' room.
  struct Taken {
    std::vector<ring::Submission> entries;
    std::vector<absl::Status> checks;
    // Not yet started: what it will run.
    std::shared_ptr<const PreparedTransfer> prepared;
    std::string notification;
    absl::Time deadline;
    size_t ops = 0;
    // A batch with a notification runs as a transfer: its request, its
    // transfer and the poll that tells of its end.
    std::unique_ptr<v1::SubmitRequest> request;
    uint64_t transfer_id = 0;
    std::unique_ptr<TransferTable::Poll> poll;
    // Every other batch is posted natively: the admission of its ops, its
    // valid ops as posted (pinning their registrations), and the
    // Cancellation behind its stop, until its end.
    std::unique_ptr<ActiveCalls::OpsCharge> charge;
    std::vector<Op> posted;
    std::optional<Cancellation> cancel;
    // Set by the end of a native batch (any thread, under ends_mu_): the
    // outcomes of `posted`, in order.
    std::vector<OpOutcome> ran;
    bool in_post = false;  // PostInPlace has not returned yet
    std::atomic<bool> ended{false};
    // Ended: what became of each op (entry, or prepared op), and of the
    // notification.
    std::vector<OpOutcome> outcomes;
    absl::Status notified;
    // A CANCEL that found its batch: that batch, still running. The CANCEL
    // completes just before it, once it has ended.
    const Taken* cancelled = nullptr;
  };
  using TakenPtr = std::unique_ptr<Taken>;

  std::atomic<uint32_t>& Word(size_t offset) {
    return ring::Word(base_, offset);
  }
  // Starts a batch just taken (or answers it at once: CANCEL, refusals).
  void Start(TakenPtr taken);
  // Admits and starts `taken` (not a CANCEL), natively or as a transfer;
  // keeps it as waiting_ while its user's ops in flight leave no room.
  void Submit(TakenPtr taken);
  // Whether `taken` runs without a transfer: it has no notification.
  static bool RunsNatively(const Taken& taken);
  // Prepares the ops of `taken` (admitted: `charge`) and posts them; a
  // batch that ends inside PostInPlace (memory) completes at once.
  void Post(TakenPtr taken, std::unique_ptr<ActiveCalls::OpsCharge> charge);
  // The end of a native batch, on the thread that ended it: hands `ran` to
  // the session.
  void Ended(Taken* taken, std::vector<OpOutcome> ran);
  // Gives back what a native batch held and records its ops' ends (metrics,
  // failures), then completes it.
  void Conclude(TakenPtr taken);
  // Starts a batch with a notification as a transfer.
  void SubmitTransfer(TakenPtr taken,
                      std::unique_ptr<ActiveCalls::OpsCharge> charge);
  // CANCEL: starts cancelling the running batch holding the tag, without
  // waiting for it (the ring thread serves other sessions); the CANCEL's own
  // completion is posted when that batch has ended (CompleteCancels), or at
  // once when no batch holds the tag.
  void Cancel(TakenPtr taken);
  // Completes the CANCELs waiting for `ended`, which has just ended.
  void CompleteCancels(const Taken* ended);
  // Posts one completion per entry of `taken`: each entry's own check
  // first, then `refused` (every op), else (`ran`) its outcomes.
  void Complete(TakenPtr taken, const absl::Status& refused, bool ran);
  // Cancels every started batch, without waiting for their ends.
  void CancelAll();
  TakenPtr NewTaken();
  // The room for ops (or entries) `taken` keeps: its largest vector's.
  static size_t Room(const Taken& taken);
  // Stops the session: the reason for the client, STOPPED, a doorbell.
  void Stop(const absl::Status& reason);

  RingSessions* const owner_;
  const UniqueFd connection_;
  const int fd_;                   // connection_'s
  QuotaCharge connection_charge_;  // in the attach-connection quota
  QuotaCharge slot_;               // in the ring-session quota
  const PeerCredentials peer_;
  SharedMemory memory_;
  const ring::Geometry geometry_;
  std::byte* const base_;
  const int wakeup_;  // the ring thread's eventfd
  const absl::Time opened_;
  bool ending_ = false;
  uint32_t seen_tail_ = 0;  // sq_tail as the last turn read it
  uint32_t head_ = 0;       // next submission to take
  uint32_t cq_tail_ = 0;    // next completion slot
  uint32_t reserved_ = 0;   // completion slots of batches taken
  ring::Batch batch_;
  std::vector<TakenPtr> running_;  // in the order taken
  std::vector<TakenPtr> cancels_;  // CANCELs waiting for their batch's end
  TakenPtr waiting_;  // taken, waiting for room under the ops bound
  std::vector<TakenPtr> spare_;
  // Room the spare batches keep (Room), at most the ring's entries in all.
  size_t spare_room_ = 0;
  // Checks and resolves the ops of this session's native batches, batch
  // after batch (cleared between them).
  OpPreparer preparer_;
  OpEndTally tally_;
  // The ends of native batches (Taken::ran, in_post, ended).
  absl::Mutex ends_mu_;
  // For Info(), from other threads.
  std::atomic<uint64_t> batches_in_flight_{0};
  std::atomic<uint64_t> ops_in_flight_{0};
  std::atomic<uint64_t> ops_completed_{0};
  mutable absl::Mutex mu_;
  std::string stopped_reason_ ABSL_GUARDED_BY(mu_);
};

RingSessionInfo RingSessions::Session::Info() const {
  RingSessionInfo info;
  info.uid = peer_.uid;
  info.pid = peer_.pid;
  info.entries = geometry_.entries;
  info.opened = opened_;
  info.batches_in_flight = batches_in_flight_.load(std::memory_order_relaxed);
  info.ops_in_flight = ops_in_flight_.load(std::memory_order_relaxed);
  info.ops_completed = ops_completed_.load(std::memory_order_relaxed);
  absl::MutexLock lock(&mu_);
  info.stopped_reason = stopped_reason_;
  return info;
}

bool RingSessions::Session::Drain() {
  char bytes[256];
  // What is left is read at the next wake-up (the epoll set is level
  // triggered): the thread goes on to its other sessions meanwhile.
  for (int reads = 0; reads < 4; ++reads) {
    const ssize_t n = ::recv(fd_, bytes, sizeof(bytes), MSG_DONTWAIT);
    if (n > 0) continue;
    if (n == 0) return false;
    if (errno == EINTR) continue;
    return errno == EAGAIN || errno == EWOULDBLOCK;
  }
  return true;
}

RingSessions::Session::Wakeup RingSessions::Session::ArmWakeup() {
  // Sequentially consistent, as the client's store of sq_tail and load of
  // agent_flags: either it sees NEEDS_WAKEUP and rings, or the load below
  // sees its tail.
  Word(ring::kAgentFlagsOffset).fetch_or(ring::kAgentNeedsWakeup);
  // Room under the ops bound (or a client reaping completions) comes
  // without a doorbell: such a session is looked at again soon.
  if (waiting_ != nullptr) return Wakeup::kPending;
  const uint32_t tail = Word(ring::kSqTailOffset).load();
  if (tail != seen_tail_) return Wakeup::kWork;
  return tail == head_ ? Wakeup::kIdle : Wakeup::kPending;
}

void RingSessions::Session::BeginEnd() {
  if (ending_) return;
  ending_ = true;
  CancelAll();
}

void RingSessions::Session::Stop(const absl::Status& reason) {
  const std::string text = reason.ToString();
  // The message alone (clients report it as FAILED_PRECONDITION), cut to
  // its 64-byte field; the log keeps it whole.
  const absl::string_view message = reason.message();
  const size_t n = std::min<size_t>(message.size(), ring::kStopReasonBytes - 1);
  std::memcpy(base_ + ring::kStopReasonOffset, message.data(), n);
  base_[ring::kStopReasonOffset + n] = std::byte{0};
  Word(ring::kAgentFlagsOffset).fetch_or(ring::kAgentStopped);
  Ring(fd_);
  {
    absl::MutexLock lock(&mu_);
    stopped_reason_ = text;
  }
  spdlog::warn("ring session of uid {} pid {} stopped: {}", peer_.uid,
               peer_.pid, LogSafe(text));
}

size_t RingSessions::Session::Room(const Taken& taken) {
  return std::max({taken.entries.capacity(), taken.checks.capacity(),
                   taken.posted.capacity(), taken.outcomes.capacity()});
}

RingSessions::Session::TakenPtr RingSessions::Session::NewTaken() {
  if (spare_.empty()) return std::make_unique<Taken>();
  TakenPtr taken = std::move(spare_.back());
  spare_.pop_back();
  spare_room_ -= Room(*taken);
  return taken;
}

bool RingSessions::Session::Turn(bool* worked) {
  *worked = PostEnded();
  if (waiting_ != nullptr) {
    // Batches are started in the order taken: nothing more is taken until
    // the waiting one has room (or its deadline passes).
    Submit(std::move(waiting_));
    if (waiting_ != nullptr) return true;
    *worked = true;
  }
  const uint32_t tail =
      Word(ring::kSqTailOffset).load(std::memory_order_acquire);
  seen_tail_ = tail;
  const uint32_t cq_head =
      Word(ring::kCqHeadOffset).load(std::memory_order_acquire);
  auto free = ring::FreeCompletions(cq_head, cq_tail_, geometry_.entries);
  if (!free.ok()) {
    Stop(free.status());
    return false;
  }
  // Slots of batches taken and not completed are spoken for.
  const uint32_t room = *free > reserved_ ? *free - reserved_ : 0;
  auto taken = ring::TakeBatch(base_, geometry_, head_, tail, room,
                               owner_->limits_.max_notification_bytes, &batch_);
  if (!taken.ok()) {
    Stop(taken.status());
    return false;
  }
  if (*taken == 0) return true;
  head_ += *taken;
  // The entries (and the payload) are copied: the client may reuse them.
  Word(ring::kSqHeadOffset).store(head_, std::memory_order_release);
  reserved_ += *taken;
  TakenPtr next = NewTaken();
  next->entries.assign(batch_.entries.begin(), batch_.entries.end());
  next->checks.assign(batch_.checks.begin(), batch_.checks.end());
  next->notification.swap(batch_.notification);
  Start(std::move(next));
  *worked = true;
  return true;
}

void RingSessions::Session::Start(TakenPtr taken) {
  batches_in_flight_.fetch_add(1, std::memory_order_relaxed);
  const ring::Submission& last = taken->entries.back();
  if (taken->entries.size() == 1 && taken->checks[0].ok() &&
      last.opcode == ring::kOpCancel) {
    return Cancel(std::move(taken));
  }
  const absl::Duration timeout = last.timeout_ms == 0
                                     ? owner_->limits_.default_timeout
                                     : absl::Milliseconds(last.timeout_ms);
  if (timeout > owner_->limits_.max_timeout) {
    return Complete(std::move(taken),
                    absl::InvalidArgumentError(absl::StrCat(
                        "timeout ", absl::FormatDuration(timeout),
                        " exceeds the agent's limit of ",
                        absl::FormatDuration(owner_->limits_.max_timeout))),
                    false);
  }
  // Queueing included, as a SubmitAsync's.
  taken->deadline = absl::Now() + timeout;
  if (taken->entries.size() == 1 && taken->checks[0].ok() &&
      last.opcode == ring::kOpRunPrepared) {
    auto prepared = owner_->prepared_->Find(peer_.uid, last.remote_handle);
    if (!prepared.ok()) {
      return Complete(std::move(taken),
                      Prefixed(prepared.status(), "RUN_PREPARED"), false);
    }
    taken->prepared = std::move(*prepared);
    taken->ops = taken->prepared->ops.size();
    ops_in_flight_.fetch_add(taken->ops, std::memory_order_relaxed);
    return Submit(std::move(taken));
  }
  if (std::none_of(taken->checks.begin(), taken->checks.end(),
                   [](const absl::Status& check) { return check.ok(); })) {
    return Complete(std::move(taken), absl::OkStatus(), false);
  }
  taken->ops = taken->entries.size();
  ops_in_flight_.fetch_add(taken->ops, std::memory_order_relaxed);
  if (RunsNatively(*taken)) return Submit(std::move(taken));
  // One request per batch with a notification; an entry that failed its
  // checks is kept in place (as an op no check passes) so that every op's
  // index is its entry's.
  auto request = std::make_unique<v1::SubmitRequest>();
  request->mutable_ops()->Reserve(static_cast<int>(taken->entries.size()));
  for (size_t i = 0; i < taken->entries.size(); ++i) {
    const ring::Submission& entry = taken->entries[i];
    v1::Op* op = request->add_ops();
    if (!taken->checks[i].ok()) continue;
    op->set_type(static_cast<v1::OpType>(entry.opcode));
    op->set_local_buffer_id(entry.local_buffer_id);
    op->set_local_offset(entry.local_offset);
    op->set_length(entry.length);
    op->set_remote_handle(entry.remote_handle);
    op->set_remote_offset(entry.remote_offset);
  }
  request->set_notification(taken->notification);
  taken->request = std::move(request);
  Submit(std::move(taken));
}

bool RingSessions::Session::RunsNatively(const Taken& taken) {
  if (taken.prepared == nullptr) return taken.notification.empty();
  return !taken.entries[0].notify() &&
         taken.prepared->request.notification().empty();
}

void RingSessions::Session::Submit(TakenPtr taken) {
  auto charge = owner_->calls_->ChargeOps(peer_.uid, taken->ops);
  if (!charge.ok()) {
    // Over the user's ops in flight: the batch waits for room, within its
    // deadline, while the session keeps serving (and completing) the rest.
    if (absl::IsResourceExhausted(charge.status()) &&
        absl::Now() < taken->deadline && !owner_->stopping_.cancelled()) {
      waiting_ = std::move(taken);
      return;
    }
    return Complete(std::move(taken), charge.status(), false);
  }
  if (RunsNatively(*taken)) return Post(std::move(taken), std::move(*charge));
  SubmitTransfer(std::move(taken), std::move(*charge));
}

void RingSessions::Session::Post(
    TakenPtr taken, std::unique_ptr<ActiveCalls::OpsCharge> charge) {
  taken->charge = std::move(charge);
  const size_t count = taken->ops;
  taken->outcomes.resize(count);
  taken->posted.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    absl::StatusOr<Op> op;
    if (taken->prepared != nullptr) {
      // Checked again; its remote side was resolved when it was prepared.
      op = preparer_.Prepare(taken->prepared->ops[i], i);
    } else if (!taken->checks[i].ok()) {
      // Counted and logged as a refused op; its completion says why.
      taken->outcomes[i].status = AnnotateOp(taken->checks[i], i);
      continue;
    } else {
      op = preparer_.Prepare(SpecOf(taken->entries[i]), i);
    }
    if (!op.ok()) {
      taken->outcomes[i].status = AnnotateOp(op.status(), i);
      continue;
    }
    taken->posted.push_back(std::move(*op));
  }
  // What the lookups pinned is held by the ops alone.
  preparer_.Clear();
  if (taken->posted.empty()) return Conclude(std::move(taken));
  taken->cancel.emplace();
  taken->ended.store(false, std::memory_order_relaxed);
  {
    absl::MutexLock lock(&ends_mu_);
    taken->in_post = true;
  }
  Taken* const posting = taken.get();
  // The batch (its ops and Cancellation) stays until `Ended` has run: it is
  // in running_ until then, and a session is freed only once running_ is
  // empty (ended()).
  owner_->env_.registry->PostInPlace(
      absl::MakeSpan(posting->posted),
      StopToken(posting->deadline, &*posting->cancel),
      [this, posting](std::vector<OpOutcome> ran) {
        Ended(posting, std::move(ran));
      });
  bool ended;
  {
    absl::MutexLock lock(&ends_mu_);
    posting->in_post = false;
    ended = posting->ended.load(std::memory_order_relaxed);
  }
  // Ended inside PostInPlace (a small memory batch): completed on this turn,
  // with no wake-up.
  if (ended) return Conclude(std::move(taken));
  running_.push_back(std::move(taken));
}

void RingSessions::Session::Ended(Taken* taken, std::vector<OpOutcome> ran) {
  absl::MutexLock lock(&ends_mu_);
  taken->ran = std::move(ran);
  taken->ended.store(true, std::memory_order_release);
  // Under the lock: once PostEnded has seen the end and taken the lock in
  // turn, nothing here touches the session again.
  if (!taken->in_post) Wake();
}

void RingSessions::Session::Conclude(TakenPtr taken) {
  for (size_t k = 0; k < taken->ran.size() && k < taken->posted.size(); ++k) {
    taken->outcomes[taken->posted[k].index] = std::move(taken->ran[k]);
  }
  // Their registrations are unpinned and their admission given back before
  // the client hears of their end.
  taken->posted.clear();
  taken->ran = std::vector<OpOutcome>();
  taken->charge.reset();
  taken->cancel.reset();
  // Recorded as OpBatch records a batch's ops; an entry that failed its
  // checks counts as the op it could not be.
  const PreparedTransfer* prepared = taken->prepared.get();
  for (size_t i = 0; i < taken->outcomes.size(); ++i) {
    const OpOutcome& outcome = taken->outcomes[i];
    if (prepared != nullptr) {
      const OpSpec& spec = prepared->ops[i];
      tally_.Add(spec.type, spec.length, outcome);
      if (!outcome.status.ok()) {
        owner_->env_.failures->Op(peer_, "Ring", spec, outcome.backend,
                                  outcome.status);
      }
      continue;
    }
    const ring::Submission& entry = taken->entries[i];
    const bool valid = taken->checks[i].ok();
    tally_.Add(
        valid ? static_cast<v1::OpType>(entry.opcode) : v1::OP_TYPE_UNSPECIFIED,
        valid ? entry.length : 0, outcome);
    if (!outcome.status.ok()) {
      owner_->env_.failures->Op(peer_, "Ring", SpecOf(entry), outcome.backend,
                                outcome.status);
    }
  }
  tally_.Record();
  Complete(std::move(taken), absl::OkStatus(), true);
}

void RingSessions::Session::SubmitTransfer(
    TakenPtr taken, std::unique_ptr<ActiveCalls::OpsCharge> charge) {
  const uid_t uid = peer_.uid;
  TransferTable* transfers = owner_->transfers_;
  const uint64_t request_bytes = RequestCopyBytes(
      taken->request != nullptr ? *taken->request : v1::SubmitRequest());
  auto bytes = transfers->Reserve(uid, request_bytes, taken->ops);
  if (!bytes.ok()) return Complete(std::move(taken), bytes.status(), false);
  std::unique_ptr<OpBatch> batch;
  if (taken->prepared != nullptr) {
    batch = OpBatch::Prepare(owner_->env_, peer_, taken->prepared,
                             std::move(charge), "Ring");
    if (taken->entries[0].notify()) {
      batch->ReplaceNotification(taken->notification);
    }
  } else {
    batch = OpBatch::Prepare(owner_->env_, peer_, std::move(taken->request),
                             std::move(charge), "Ring");
  }
  if (absl::Status grown = transfers->Grow(*bytes, batch->PreparedBytes());
      !grown.ok()) {
    return Complete(std::move(taken), grown, false);
  }
  auto id = transfers->Submit(uid, std::move(batch), taken->deadline,
                              std::move(*bytes));
  if (!id.ok()) return Complete(std::move(taken), id.status(), false);
  taken->transfer_id = *id;
  auto poll = transfers->StartPoll(uid, absl::MakeConstSpan(&*id, 1),
                                   [this] { Wake(); });
  if (!poll.ok()) {
    // Not expected (the transfer is kept until reported); it must not run
    // untracked.
    (void)transfers->Cancel(uid, *id);
    return Complete(std::move(taken), poll.status(), false);
  }
  taken->poll = std::move(*poll);
  running_.push_back(std::move(taken));
}

void RingSessions::Session::Cancel(TakenPtr taken) {
  const uint64_t tag = taken->entries[0].remote_handle;
  for (const TakenPtr& running : running_) {
    const bool holds = std::any_of(
        running->entries.begin(), running->entries.end(),
        [tag](const ring::Submission& entry) { return entry.user_tag == tag; });
    if (!holds) continue;
    // Its ops that had not ended end CANCELLED; the CANCEL completes once the
    // batch has ended, so that, as on CancelTransfer's return, nothing of it
    // touches local memory by then.
    if (running->poll != nullptr) {
      (void)owner_->transfers_->StartCancel(peer_.uid, running->transfer_id);
    } else {
      running->cancel->Cancel(absl::CancelledError(absl::StrCat(
          "the batch holding tag ", tag, " was cancelled (CANCEL)")));
    }
    taken->cancelled = running.get();
    cancels_.push_back(std::move(taken));
    return;
  }
  Complete(std::move(taken),
           absl::NotFoundError(absl::StrCat(
               "CANCEL: no batch taken and not completed holds tag ", tag)),
           false);
}

void RingSessions::Session::CompleteCancels(const Taken* ended) {
  for (auto it = cancels_.begin(); it != cancels_.end();) {
    if ((*it)->cancelled != ended) {
      ++it;
      continue;
    }
    TakenPtr cancel = std::move(*it);
    it = cancels_.erase(it);
    cancel->cancelled = nullptr;
    Complete(std::move(cancel), absl::OkStatus(), false);
  }
}

bool RingSessions::Session::PostEnded() {
  bool posted = false;
  for (auto it = running_.begin(); it != running_.end();) {
    Taken& running = **it;
    const bool ended = running.poll != nullptr
                           ? running.poll->settled()
                           : running.ended.load(std::memory_order_acquire);
    if (!ended) {
      ++it;
      continue;
    }
    TakenPtr taken = std::move(*it);
    it = running_.erase(it);
    posted = true;
    // A CANCEL's completion comes before those of the batch it cancelled.
    if (!cancels_.empty()) CompleteCancels(taken.get());
    if (taken->poll == nullptr) {
      // Ended stored `ended` under ends_mu_, and still holds it (writing the
      // wake-up); once this thread has held it too, Ended is done with the
      // session, which may then go at any time.
      { absl::MutexLock lock(&ends_mu_); }
      Conclude(std::move(taken));
      continue;
    }
    auto report = taken->poll->Report();
    taken->poll.reset();
    if (!report.ok() || report->size() != 1) {
      Complete(std::move(taken),
               report.ok() ? absl::InternalError("the batch's end was lost")
                           : report.status(),
               false);
      continue;
    }
    const v1::Transfer& transfer = report->front();
    taken->outcomes.clear();
    for (const v1::OpResult& result : transfer.results()) {
      OpOutcome& outcome = taken->outcomes.emplace_back();
      outcome.status = StatusOf(result.code(), result.message());
      outcome.backend = result.backend();
    }
    for (const v1::NotificationResult& sent : transfer.notifications()) {
      if (sent.code() != 0) {
        taken->notified = StatusOf(
            sent.code(), absl::StrCat("notification: ", sent.message()));
        break;
      }
    }
    Complete(std::move(taken), absl::OkStatus(), true);
  }
  return posted;
}

void RingSessions::Session::Complete(TakenPtr taken,
                                     const absl::Status& refused, bool ran) {
  const size_t count = taken->entries.size();
  const bool prepared = taken->prepared != nullptr;
  const std::vector<OpOutcome>& outcomes = taken->outcomes;
  static const OpOutcome kMissing;
  bool all_ok = true;
  for (size_t i = 0; i < count; ++i) {
    ring::Completion completion;
    completion.user_tag = taken->entries[i].user_tag;
    absl::Status status;
    const std::string* backend = &kMissing.backend;
    if (!taken->checks[i].ok()) {
      status = AnnotateOp(taken->checks[i], i);
    } else if (!refused.ok() || !ran) {
      status = AnnotateOp(refused, i);
    } else if (prepared) {
      // One completion for every op of the prepared transfer: the first
      // failure (its message names its index there), else OK.
      for (const OpOutcome& outcome : outcomes) {
        if (backend->empty()) backend = &outcome.backend;
        if (!outcome.status.ok()) {
          status = outcome.status;
          backend = &outcome.backend;
          break;
        }
      }
    } else if (i < outcomes.size()) {
      status = outcomes[i].status;
      backend = &outcomes[i].backend;
    } else {
      status = absl::InternalError(absl::StrCat("op ", i, ": no result"));
    }
    all_ok = all_ok && status.ok();
    // The notification's outcome rides on the last entry, when every op
    // succeeded and it could not be sent.
    if (i + 1 == count && all_ok && ran && !taken->notified.ok()) {
      status = taken->notified;
    }
    completion.code = static_cast<int32_t>(status.code());
    completion.backend = ring::BackendCode(*backend);
    ring::WriteCompletion(base_, geometry_, cq_tail_ + static_cast<uint32_t>(i),
                          completion, std::string(status.message()));
  }
  cq_tail_ += static_cast<uint32_t>(count);
  reserved_ -= static_cast<uint32_t>(count);
  // Sequentially consistent, not just release: the load of client_flags
  // below must not pass this store, or a client that set WAITING and then
  // saw the old cq_tail would miss its doorbell (RING.md, wake-ups).
  Word(ring::kCqTailOffset).store(cq_tail_, std::memory_order_seq_cst);
  batches_in_flight_.fetch_sub(1, std::memory_order_relaxed);
  ops_in_flight_.fetch_sub(taken->ops, std::memory_order_relaxed);
  ops_completed_.fetch_add(count, std::memory_order_relaxed);
  // A client about to block is told; one that spins is not bothered.
  if ((Word(ring::kClientFlagsOffset).load() & ring::kClientWaiting) != 0) {
    Word(ring::kClientFlagsOffset).fetch_and(~ring::kClientWaiting);
    Ring(fd_);
  }
  // Kept for the next batch, with its vectors' room; the spare batches keep
  // room for no more ops (or entries) than the ring has entries in all.
  taken->request.reset();
  taken->prepared.reset();
  taken->notification.clear();
  taken->ops = 0;
  taken->transfer_id = 0;
  taken->outcomes.clear();
  taken->notified = absl::OkStatus();
  const size_t room = Room(*taken);
  if (spare_room_ + room > geometry_.entries) {
    taken->entries = std::vector<ring::Submission>();
    taken->checks = std::vector<absl::Status>();
    taken->posted = std::vector<Op>();
    taken->outcomes = std::vector<OpOutcome>();
  } else {
    spare_room_ += room;
  }
  spare_.push_back(std::move(taken));
}

void RingSessions::Session::CancelAll() {
  absl::Status reason = owner_->stopping_.reason();
  if (reason.ok()) reason = absl::CancelledError("the ring session ended");
  if (waiting_ != nullptr) Complete(std::move(waiting_), reason, false);
  // Running ops end CANCELLED, as a CANCEL would end them. Their ends wake
  // the ring thread, which posts them (PostEnded): it serves its other
  // sessions meanwhile.
  const absl::Status cancelled = absl::CancelledError(reason.message());
  for (const TakenPtr& running : running_) {
    if (running->poll != nullptr) {
      (void)owner_->transfers_->StartCancel(peer_.uid, running->transfer_id);
    } else {
      running->cancel->Cancel(cancelled);
    }
  }
  PostEnded();
}

// One ring thread: its sessions, the epoll set of their connections and of
// its eventfd, and the loop that turns them. Only this thread touches
// `sessions_` and calls into them (but Wake and Info).
class RingSessions::Thread {
 public:
  static absl::StatusOr<std::unique_ptr<Thread>> Start(RingSessions* owner,
                                                       int index) {
    UniqueFd epoll(::epoll_create1(EPOLL_CLOEXEC));
    UniqueFd wakeup(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!epoll.valid() || !wakeup.valid()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("ring thread ", index,
                       ": no epoll set or eventfd: ", std::strerror(errno)));
    }
    // The eventfd's events carry no session.
    struct epoll_event event = {};
    event.events = EPOLLIN;
    event.data.ptr = nullptr;
    if (::epoll_ctl(epoll.get(), EPOLL_CTL_ADD, wakeup.get(), &event) != 0) {
      return absl::InternalError(absl::StrCat(
          "ring thread ", index, ": epoll_ctl: ", std::strerror(errno)));
    }
    std::unique_ptr<Thread> thread(
        new Thread(owner, std::move(epoll), std::move(wakeup)));
    thread->thread_ = std::thread([raw = thread.get()] { raw->Run(); });
    NameThread(thread->thread_, absl::StrCat("rdma-ring-", index));
    return thread;
  }
  Thread(const Thread&) = delete;
  Thread& operator=(const Thread&) = delete;
  ~Thread() { Join(); }

  int wakeup_fd() const { return wakeup_.get(); }
  // Sessions handed to this thread and not yet ended.
  size_t load() const { return load_.load(std::memory_order_relaxed); }

  // Hands `session` (answered, listed) to this thread.
  void Adopt(std::unique_ptr<Session> session) {
    load_.fetch_add(1, std::memory_order_relaxed);
    {
      absl::MutexLock lock(&mu_);
      incoming_.push_back(std::move(session));
    }
    has_incoming_.store(true, std::memory_order_release);
    Wake();
  }
  void Wake() const { WriteEventFd(wakeup_.get()); }
  // Returns once the thread has ended every session (after the owner's
  // stopping_ fired) and exited.
  void Join() {
    if (thread_.joinable()) thread_.join();
  }

 private:
  static constexpr int kEvents = 64;

  Thread(RingSessions* owner, UniqueFd epoll, UniqueFd wakeup)
      : owner_(owner), epoll_(std::move(epoll)), wakeup_(std::move(wakeup)) {}

  void Run();
  // Moves the sessions handed over into the set; false when none was
  // waiting.
  bool TakeIncoming();
  // Ends `session`: out of the epoll set (a closed connection stays
  // readable), its batches cancelled. Its ends are still posted.
  void End(Session& session);
  // Destroys the sessions whose last batch has ended: their connections
  // close and their charges go back.
  void FreeEnded();
  // Sets NEEDS_WAKEUP on every session and, unless one had work published
  // meanwhile, waits in epoll: without a timeout, or 1 ms when a session
  // has work it cannot take yet. False when it did not sleep.
  bool Sleep();
  // Doorbells (drained), closes (the session ends), the eventfd (read).
  void Handle(const struct epoll_event* events, int count);

  RingSessions* const owner_;
  const UniqueFd epoll_;
  const UniqueFd wakeup_;  // eventfd: batch ends, new sessions, shutdown
  std::thread thread_;
  std::atomic<size_t> load_{0};
  std::atomic<bool> has_incoming_{false};
  absl::Mutex mu_;
  std::vector<std::unique_ptr<Session>> incoming_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Session>> sessions_;  // in turn order
};

void RingSessions::Thread::Run() {
  const absl::Duration spin = owner_->limits_.spin;
  absl::Time last_work = absl::Now();
  struct epoll_event events[kEvents];
  uint32_t passes = 0;
  for (;;) {
    if (has_incoming_.load(std::memory_order_acquire) && TakeIncoming()) {
      last_work = absl::Now();
    }
    const bool stopping = owner_->stopping_.cancelled();
    // One turn of each session in round: each takes at most one batch, so
    // a busy ring cannot starve the others.
    bool worked = false;
    bool may_spin = false;
    for (const std::unique_ptr<Session>& session : sessions_) {
      bool session_worked = false;
      if (stopping) End(*session);
      if (session->ending()) {
        session_worked = session->PostEnded();
      } else if (!session->Turn(&session_worked)) {
        End(*session);  // stopped: its reason is written
      }
      worked = worked || session_worked;
      // Spinning serves only sessions with nothing running: ends of
      // running batches write the eventfd, and their threads need the
      // cores a spinning ring thread would take.
      may_spin = may_spin || (!session->ending() && !session->running());
    }
    FreeEnded();
    if (stopping && sessions_.empty()) {
      // Open hands nothing over once the owner is closed, which it is
      // before stopping_ fires.
      absl::MutexLock lock(&mu_);
      if (incoming_.empty()) return;
      continue;
    }
    if (worked) {
      last_work = absl::Now();
    } else if (!may_spin || absl::Now() - last_work >= spin) {
      if (Sleep()) last_work = absl::Now();
      continue;
    }
    // Busy or spinning: the connections are looked at now and then, so
    // that a session's close is seen while others keep the thread busy.
    if (++passes % 64 == 0) {
      Handle(events, ::epoll_wait(epoll_.get(), events, kEvents, 0));
    }
  }
}

bool RingSessions::Thread::TakeIncoming() {
  absl::MutexLock lock(&mu_);
  has_incoming_.store(false, std::memory_order_relaxed);
  if (incoming_.empty()) return false;
  for (std::unique_ptr<Session>& session : incoming_) {
    struct epoll_event event = {};
    event.events = EPOLLIN | EPOLLRDHUP;
    event.data.ptr = session.get();
    if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, session->fd(), &event) != 0) {
      // Not expected (the fd is open and new to the set); unserved, the
      // session ends at once.
      spdlog::error("ring session of uid {} pid {}: epoll_ctl: {}",
                    session->Info().uid, session->Info().pid,
                    std::strerror(errno));
      session->BeginEnd();
    }
    sessions_.push_back(std::move(session));
  }
  incoming_.clear();
  return true;
}

void RingSessions::Thread::End(Session& session) {
  if (session.ending()) return;
  (void)::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, session.fd(), nullptr);
  session.BeginEnd();
}

void RingSessions::Thread::FreeEnded() {
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    if (!(*it)->ended()) {
      ++it;
      continue;
    }
    owner_->Forget(it->get());
    it = sessions_.erase(it);
    load_.fetch_sub(1, std::memory_order_relaxed);
  }
}

bool RingSessions::Thread::Sleep() {
  bool pending = false;
  bool work = false;
  for (const std::unique_ptr<Session>& session : sessions_) {
    if (session->ending()) continue;
    switch (session->ArmWakeup()) {
      case Session::Wakeup::kIdle:
        break;
      case Session::Wakeup::kPending:
        pending = true;
        break;
      case Session::Wakeup::kWork:
        work = true;
        break;
    }
    if (work) break;
  }
  bool slept = false;
  if (!work) {
    struct epoll_event events[kEvents];
    const int count =
        ::epoll_wait(epoll_.get(), events, kEvents, pending ? 1 : -1);
    Handle(events, count);
    // A timed sleep that ended on its timeout is no activity.
    slept = !pending || count > 0;
  }
  for (const std::unique_ptr<Session>& session : sessions_) {
    session->DisarmWakeup();
  }
  return slept || work;
}

void RingSessions::Thread::Handle(const struct epoll_event* events, int count) {
  for (int i = 0; i < count; ++i) {
    auto* session = static_cast<Session*>(events[i].data.ptr);
    if (session == nullptr) {
      uint64_t wakeups;
      (void)!::read(wakeup_.get(), &wakeups, sizeof(wakeups));
      continue;
    }
    if (session->ending()) continue;
    const bool hung_up = (events[i].events & (EPOLLHUP | EPOLLERR)) != 0 &&
                         (events[i].events & EPOLLIN) == 0;
    if (hung_up || !session->Drain()) End(*session);
  }
}

RingSessions::RingSessions(const RingLimits& limits,
                           const OpBatchEnvironment& env, ActiveCalls* calls,
                           std::shared_ptr<ResourceQuota> bytes,
                           TransferTable* transfers,
                           const PreparedTransferTable* prepared)
    : limits_(limits),
      env_(env),
      calls_(calls),
      bytes_(std::move(bytes)),
      transfers_(transfers),
      prepared_(prepared),
      sessions_(ResourceQuota::Create(
          "ring sessions", "max_ring_sessions_per_user", "max_ring_sessions",
          {limits.max_sessions_per_user, limits.max_sessions})) {}

absl::StatusOr<std::unique_ptr<RingSessions>> RingSessions::Start(
    const RingLimits& limits, const OpBatchEnvironment& env, ActiveCalls* calls,
    std::shared_ptr<ResourceQuota> bytes, TransferTable* transfers,
    const PreparedTransferTable* prepared) {
  if (limits.threads < 1 || limits.threads > kMaxRingThreads) {
    return absl::InvalidArgumentError(
        absl::StrCat("--ring_threads must be 1 to ", kMaxRingThreads, ", not ",
                     limits.threads));
  }
  std::unique_ptr<RingSessions> rings(new RingSessions(
      limits, env, calls, std::move(bytes), transfers, prepared));
  for (int i = 0; i < limits.threads; ++i) {
    auto thread = Thread::Start(rings.get(), i);
    if (!thread.ok()) return thread.status();  // the started ones are joined
    rings->threads_.push_back(std::move(*thread));
  }
  return rings;
}

RingSessions::~RingSessions() {
  Shutdown(absl::CancelledError("the ring sessions were destroyed"));
}

RingSessions::Thread& RingSessions::LeastLoaded() const {
  // Least loaded rather than in turn: sessions end at any time, so turns
  // would leave one thread with the long-lived ones.
  Thread* least = threads_.front().get();
  for (const std::unique_ptr<Thread>& thread : threads_) {
    if (thread->load() < least->load()) least = thread.get();
  }
  return *least;
}

void RingSessions::Forget(const Session* session) {
  absl::MutexLock lock(&mu_);
  open_sessions_.remove(const_cast<Session*>(session));
  open_.fetch_sub(1, std::memory_order_relaxed);
}

void RingSessions::Open(UniqueFd connection, QuotaCharge connection_charge,
                        const PeerCredentials& peer,
                        const v1::OpenRing& request) {
  const int fd = connection.get();
  auto refuse = [&](const absl::Status& status) {
    (void)SendFdMessage(fd, Refusal(Prefixed(status, "open ring")));
  };
  if (stopping_.cancelled()) return refuse(stopping_.reason());
  if (request.entries() > limits_.max_entries) {
    return refuse(absl::InvalidArgumentError(
        absl::StrCat("entries ", request.entries(), " exceeds the limit of ",
                     limits_.max_entries, " (--max_ring_entries)")));
  }
  auto geometry = ring::GeometryFor(request.entries());
  if (!geometry.ok()) return refuse(geometry.status());
  // Counted before anything of the session exists; held until it ends.
  auto slot = sessions_->Reserve(peer.uid, 1);
  if (!slot.ok()) return refuse(slot.status());
  // Charged like registered memory, before the memfd exists.
  auto memory = SharedMemory::Allocate(
      geometry->total_bytes, "rdma-agentd-ring",
      [&](uint64_t bytes) -> absl::StatusOr<std::unique_ptr<MappingCharge>> {
        auto charge = bytes_->Reserve(peer.uid, bytes);
        if (!charge.ok()) return charge.status();
        return MemoryCharge::Of(std::move(*charge));
      });
  if (!memory.ok()) return refuse(memory.status());
  ring::WriteHeader(memory->data(), *geometry);
  const int memfd = memory->fd();  // owned by the session from here
  Thread& thread = LeastLoaded();
  auto session = std::make_unique<Session>(
      this, std::move(connection), std::move(connection_charge),
      std::move(*slot), peer, std::move(*memory), *geometry,
      thread.wakeup_fd());
  // Listed and counted before the client has its ring, so that whoever it
  // tells finds the session.
  absl::Status closed;
  {
    absl::MutexLock lock(&mu_);
    if (closed_) {
      closed = closed_reason_;
    } else {
      open_sessions_.push_back(session.get());
    }
  }
  if (!closed.ok()) return refuse(closed);
  open_.fetch_add(1, std::memory_order_relaxed);
  v1::AttachResponse response;
  response.set_size_bytes(geometry->total_bytes);
  // Answered before the hand-over: from then on only the ring thread
  // touches the connection.
  if (!SendFdMessage(fd, response, memfd).ok()) return Forget(session.get());
  spdlog::debug("uid {} pid {} opened a ring of {} entries", peer.uid, peer.pid,
                geometry->entries);
  absl::MutexLock lock(&mu_);
  if (closed_) {
    // The threads are ending: this session, which took nothing, ends here
    // (its connection closes: the client sees the agent go).
    open_sessions_.remove(session.get());
    open_.fetch_sub(1, std::memory_order_relaxed);
    return;
  }
  thread.Adopt(std::move(session));
}

void RingSessions::Shutdown(const absl::Status& reason) {
  {
    absl::MutexLock lock(&mu_);
    if (closed_) return;
    closed_ = true;
    closed_reason_ = reason;
  }
  // After closed_: a thread that sees stopping_ knows nothing more comes.
  stopping_.Cancel(reason);
  for (const std::unique_ptr<Thread>& thread : threads_) thread->Wake();
  for (const std::unique_ptr<Thread>& thread : threads_) thread->Join();
}

std::vector<RingSessionInfo> RingSessions::List(
    std::optional<uid_t> uid) const {
  std::vector<RingSessionInfo> sessions;
  absl::MutexLock lock(&mu_);
  for (const Session* session : open_sessions_) {
    RingSessionInfo info = session->Info();
    if (uid.has_value() && info.uid != *uid) continue;
    sessions.push_back(std::move(info));
  }
  return sessions;
}

}  // namespace rdma_agent

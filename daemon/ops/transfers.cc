#include "daemon/ops/transfers.h"

#include <algorithm>
#include <deque>
#include <iterator>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/random.h"
#include "common/status_util.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/unknown_field_set.h"
#include "google/protobuf/util/time_util.h"

namespace rdma_agent {
namespace {

using google::protobuf::io::CodedOutputStream;

// ------------------------------------------------------------ byte sizes
//
// Estimates from above of what messages take in memory: each message and
// each set string is a heap block of its own (with the allocator's
// overhead), each repeated message field holds a pointer per element in an
// array that may be up to twice as long as needed.

constexpr uint64_t kBlockOverhead = 16;
constexpr uint64_t kSlotBytes = 2 * sizeof(void*);

// A set string field: protobuf's heap std::string and, past the small
// string buffer, its characters (a copy's capacity is at most this).
uint64_t StringBytes(const std::string& value) {
  if (value.empty()) return 0;
  uint64_t bytes = sizeof(std::string) + kBlockOverhead;
  if (value.capacity() > 15) bytes += value.capacity() + 1 + kBlockOverhead;
  return bytes;
}

uint64_t StringBytes(size_t size) {
  if (size == 0) return 0;
  uint64_t bytes = sizeof(std::string) + kBlockOverhead;
  if (size > 15) bytes += size + 1 + kBlockOverhead;
  return bytes;
}

// Fields a sender added that the schema does not know: a copy keeps them.
uint64_t UnknownBytes(const google::protobuf::Message& message) {
  const google::protobuf::UnknownFieldSet& unknown =
      message.GetReflection()->GetUnknownFields(message);
  if (unknown.empty()) return 0;
  return sizeof(unknown) + kBlockOverhead +
         unknown.SpaceUsedExcludingSelfLong();
}

template <typename Message>
constexpr uint64_t ElementBytes() {
  return sizeof(Message) + kBlockOverhead + kSlotBytes;
}

// A Transfer's fields besides its results: id, state, three timestamps,
// results_left_out. In memory, and on the wire with its repeated-field tag
// and length prefix in a reply.
constexpr uint64_t kTransferCopyBytes =
    sizeof(v1::Transfer) + kSlotBytes +
    3 * (sizeof(google::protobuf::Timestamp) + kBlockOverhead) + kBlockOverhead;
constexpr uint64_t kTransferWireBytes = 64;

// What a record takes besides its results: the record itself, its control
// block, and its entries in the table's indexes.
constexpr uint64_t kRecordBytes = 1024;

google::protobuf::Timestamp ToTimestamp(absl::Time time) {
  return google::protobuf::util::TimeUtil::NanosecondsToTimestamp(
      absl::ToUnixNanos(time));
}

// DONE when every op is OK; CANCELLED when Cancel was asked and stopped at
// least one op (a transfer the deadline ended first stays FAILED, so that
// the state never contradicts the results); FAILED otherwise.
v1::TransferState FinalState(bool all_ok, bool any_cancelled,
                             bool cancel_asked) {
  if (all_ok) return v1::TRANSFER_STATE_DONE;
  if (cancel_asked && any_cancelled) return v1::TRANSFER_STATE_CANCELLED;
  return v1::TRANSFER_STATE_FAILED;
}

// The wire size of a repeated message field's element whose body is
// `inner` bytes (one-byte tag).
uint64_t ElementWireBytes(uint64_t inner) {
  return 1 + CodedOutputStream::VarintSize64(inner) + inner;
}

// The body of a result or notification described from its code alone: the
// code (one-byte tag) and, when not OK, the marker (one-byte tag).
uint64_t CodeOnlyWireBytes(bool ok, size_t marker) {
  if (ok) return 0;
  return 2 + 1 + CodedOutputStream::VarintSize64(marker) + marker;
}

}  // namespace

uint64_t RequestCopyBytes(const v1::SubmitRequest& request) {
  uint64_t bytes = sizeof(v1::SubmitRequest) + kBlockOverhead +
                   StringBytes(request.notification()) + UnknownBytes(request);
  if (request.has_timeout()) {
    bytes += request.timeout().SpaceUsedLong() + kBlockOverhead;
  }
  for (const v1::Op& op : request.ops()) {
    bytes += ElementBytes<v1::Op>() + StringBytes(op.remote_context()) +
             UnknownBytes(op);
  }
  return bytes;
}

uint64_t ResultsBytes(const v1::SubmitResponse& response) {
  uint64_t bytes = sizeof(v1::SubmitResponse) + kBlockOverhead;
  for (const v1::OpResult& result : response.results()) {
    bytes += ElementBytes<v1::OpResult>() + StringBytes(result.message()) +
             StringBytes(result.backend());
  }
  for (const v1::NotificationResult& sent : response.notifications()) {
    bytes += ElementBytes<v1::NotificationResult>() +
             StringBytes(sent.agent_id()) + StringBytes(sent.message()) +
             StringBytes(sent.backend());
  }
  return bytes;
}

uint64_t TransferCharge::bytes() const {
  uint64_t bytes = floor_.amount();
  for (const QuotaCharge& held : held_) bytes += held.amount();
  return bytes;
}

struct TransferTable::Record {
  enum class Phase {
    kQueued,   // in its user's queue
    kRunning,  // taken off the queue by a worker, Cancel or Shutdown
    kEnded,
  };

  Record(uint64_t id, uid_t uid, std::unique_ptr<TransferWork> work,
         absl::Time deadline, TransferCharge charge)
      : id(id),
        uid(uid),
        deadline(deadline),
        work(std::move(work)),
        charge(std::move(charge)) {}

  const uint64_t id;
  const uid_t uid;
  const absl::Time deadline;
  const absl::Time create_time = absl::Now();
  // Started (or skipped) by whoever took the record off the queue, and
  // destroyed by Finish, before the end is recorded.
  std::unique_ptr<TransferWork> work;
  // Fired by Cancel and Shutdown; the work's StopToken watches it.
  Cancellation cancellation;
  // Counted by the work while it runs (nullptr: it reports none).
  std::shared_ptr<const TransferProgress> progress;

  // The rest is guarded by the table's mu_, except the end (below).
  Phase phase = Phase::kQueued;
  bool cancel_asked = false;
  // Taken off the queue by a worker (counted in its user's `running`).
  bool on_worker = false;
  std::list<RecordPtr>::iterator queue_position;
  absl::Time start_time = absl::InfinitePast();  // InfinitePast: never ran
  absl::Time end_time = absl::InfinitePast();
  v1::TransferState state = v1::TRANSFER_STATE_PENDING;
  uint64_t end_sequence = 0;
  std::list<std::pair<absl::Time, uint64_t>>::iterator end_position;
  // A Stream has delivered its end (it may be dropped to make room).
  bool delivered = false;
  // Polls waiting for its end (one entry per poll).
  std::vector<std::shared_ptr<Poll::State>> polls;
  // The bytes charged for it: its floor, and what it holds besides (its
  // request copy and prepared batch until it ends, then its results).
  // Given back when the record is destroyed, or moved into a reply.
  TransferCharge charge;

  // The end: written once, under the lock, by End; from then on read
  // without the lock (it never changes), and moved out only by a Report
  // that holds the record alone.
  //
  // Its results and notifications...
  v1::SubmitResponse outcome;
  // ...or, when they did not fit the budget, only their codes (results
  // first), described with `dropped_marker` as the message of each non-OK
  // one.
  const char* dropped_marker = nullptr;
  std::string codes;
  size_t result_count = 0;
  // What describing it costs: its size in a reply and a copy's memory.
  uint64_t reply_wire_bytes = 0;
  uint64_t reply_copy_bytes = 0;
};

// Guarded by the table's mu_, except `wake` (its own lock) and what is const.
struct TransferTable::Poll::State {
  State(uid_t uid, std::function<void()> on_settled)
      : uid(uid),
        wake(std::make_shared<RevocableCallback>(std::move(on_settled))) {}

  const uid_t uid;
  const std::shared_ptr<RevocableCallback> wake;
  std::vector<RecordPtr> records;  // one per distinct id asked for
  size_t pending = 0;              // of `records`, not ended yet
  bool reported = false;
  // What the reply holds: the copies made for it, and the charges of the
  // ends moved into it.
  std::vector<QuotaCharge> reply_charges;
  std::vector<TransferCharge> taken_charges;
};

struct TransferTable::Stream::State {
  State(uid_t uid, std::function<void()> on_ready)
      : uid(uid),
        wake(std::make_shared<RevocableCallback>(std::move(on_ready))) {}

  const uid_t uid;
  const std::shared_ptr<RevocableCallback> wake;
  std::deque<RecordPtr> queue;  // ends not taken by Next yet
  absl::Status status;          // OK while open
  // The copy of queue.front() (reserved once it is at the front), and the
  // copy Next last handed out (held by the stream's writer until the next).
  QuotaCharge head_charge;
  QuotaCharge event_charge;
};

struct TransferTable::Outcome {
  v1::SubmitResponse response;
  bool all_ok = true;
  bool any_cancelled = false;
  uint64_t bytes = 0;       // ResultsBytes(response)
  uint64_t wire_bytes = 0;  // response.ByteSizeLong()
  // Each result's code then each notification's; how many of each are OK.
  std::string codes;
  size_t results_ok = 0;
  size_t notifications_ok = 0;
};

struct TransferTable::ReportPlan {
  RecordPtr record;
  v1::Transfer header;
  // Its results go in the reply: copied, or moved (the poll holds it alone).
  bool results = false;
  bool take = false;
};

// mu_, and the records dropped meanwhile destroyed once it is released.
class ABSL_SCOPED_LOCKABLE TransferTable::Locked {
 public:
  explicit Locked(TransferTable* table) ABSL_EXCLUSIVE_LOCK_FUNCTION(table->mu_)
      : table_(table) {
    table_->mu_.Lock();
  }
  ~Locked() ABSL_UNLOCK_FUNCTION() {
    std::vector<RecordPtr> dead;
    dead.swap(table_->graveyard_);
    table_->mu_.Unlock();
  }
  Locked(const Locked&) = delete;
  Locked& operator=(const Locked&) = delete;

 private:
  TransferTable* const table_;
};

// ------------------------------------------------------------------ Poll

TransferTable::Poll::~Poll() {
  state_->wake->Revoke();
  owner_->ForgetPoll(state_);
}

bool TransferTable::Poll::settled() const {
  absl::MutexLock lock(&owner_->mu_);
  return state_->pending == 0;
}

absl::StatusOr<std::vector<v1::Transfer>> TransferTable::Poll::Report(
    size_t max_bytes) {
  std::vector<ReportPlan> plans;
  {
    Locked lock(owner_);
    if (state_->reported) {
      return absl::FailedPreconditionError(
          "a GetTransfers poll is reported once");
    }
    // Sized from each record's kept byte counts, nothing copied: O(ids).
    // Planned again (once) after room was made in the budget: what was
    // dropped to make it may have been named here.
    for (int attempt = 0;; ++attempt) {
      plans.clear();
      plans.reserve(state_->records.size());
      uint64_t bytes = 0;
      uint64_t copies = 0;
      bool full = false;
      for (const RecordPtr& record : state_->records) {
        const bool ended = record->phase == Record::Phase::kEnded;
        auto kept = owner_->records_.find(record->id);
        const bool kept_by_it =
            kept != owner_->records_.end() && kept->second == record;
        // Held by the table's two indexes and this poll alone: once
        // dropped, nobody else can reach it, so its results move into the
        // reply with their charge instead of being copied.
        const bool alone = kept_by_it && record.use_count() == 3;
        ReportPlan plan{record, owner_->Header(*record)};
        const uint64_t size =
            ended ? record->reply_wire_bytes : plan.header.ByteSizeLong() + 11;
        full = full || (!plans.empty() && bytes + size > max_bytes);
        copies += kTransferCopyBytes;
        if (ended && full) {
          plan.header.set_results_left_out(true);
          bytes += plan.header.ByteSizeLong() + 11;
        } else {
          bytes += size;
        }
        if (ended && !full) {
          plan.results = true;
          plan.take = alone;
          const uint64_t own = alone ? record->charge.bytes() : 0;
          if (record->reply_copy_bytes > own) {
            copies += record->reply_copy_bytes - own;
          }
        }
        plans.push_back(std::move(plan));
      }
      absl::StatusOr<QuotaCharge> charge =
          owner_->budget_->Reserve(state_->uid, copies);
      if (charge.ok()) {
        state_->reply_charges.push_back(std::move(*charge));
        break;
      }
      absl::Status refused = charge.status();
      if (attempt == 0) {
        // Ends the user's streams delivered go first.
        absl::StatusOr<QuotaCharge> room =
            owner_->ReserveBytes(state_->uid, copies);
        if (room.ok()) continue;  // the trial charge goes back at once
        refused = room.status();
      }
      return Prefixed(refused,
                      "no room for the reply's copy of the transfers' results");
    }
    state_->reported = true;
    for (ReportPlan& plan : plans) {
      if (!plan.results) continue;
      const Record& record = *plan.record;
      auto kept = owner_->records_.find(record.id);
      if (kept == owner_->records_.end() || kept->second != plan.record) {
        continue;  // dropped meanwhile by another reader, expiry or room
      }
      owner_->Drop(record);
      owner_->ForgetIfIdle(record.uid);
      if (plan.take) {
        state_->taken_charges.push_back(std::move(plan.record->charge));
      }
    }
  }
  // Without the lock: the results of an ended record do not change, and a
  // taken one is this poll's alone.
  std::vector<v1::Transfer> transfers;
  transfers.reserve(plans.size());
  for (ReportPlan& plan : plans) {
    v1::Transfer& transfer = transfers.emplace_back(std::move(plan.header));
    if (!plan.results) continue;
    Record& record = *plan.record;
    if (plan.take && record.dropped_marker == nullptr) {
      transfer.mutable_results()->Swap(record.outcome.mutable_results());
      transfer.mutable_notifications()->Swap(
          record.outcome.mutable_notifications());
    } else {
      AddResults(record, transfer);
    }
  }
  return transfers;
}

void TransferTable::ForgetPoll(const std::shared_ptr<Poll::State>& poll) {
  Locked lock(this);
  if (poll->pending > 0) --waiting_polls_;
  // Records still running would otherwise keep it until they end.
  for (const RecordPtr& record : poll->records) {
    auto& polls = record->polls;
    polls.erase(std::remove(polls.begin(), polls.end(), poll), polls.end());
  }
}

// ---------------------------------------------------------------- Stream

TransferTable::Stream::~Stream() {
  state_->wake->Revoke();
  owner_->ForgetStream(state_);
}

std::optional<v1::Transfer> TransferTable::Stream::Next() {
  RecordPtr record;
  v1::Transfer transfer;
  {
    Locked lock(owner_);
    if (!state_->status.ok() || state_->queue.empty()) return std::nullopt;
    record = std::move(state_->queue.front());
    state_->queue.pop_front();
    // The copy about to be made was reserved when it became the head.
    state_->event_charge = std::move(state_->head_charge);
    owner_->ReserveHead(*state_);
    transfer = owner_->Header(*record);
  }
  AddResults(*record, transfer);
  return transfer;
}

void TransferTable::Stream::Delivered(uint64_t id) {
  absl::MutexLock lock(&owner_->mu_);
  auto record = owner_->Find(state_->uid, id);
  if (!record.ok() || (*record)->phase != Record::Phase::kEnded ||
      (*record)->delivered) {
    return;
  }
  (*record)->delivered = true;
  owner_->users_[state_->uid].delivered.insert((*record)->end_sequence);
}

absl::Status TransferTable::Stream::status() const {
  absl::MutexLock lock(&owner_->mu_);
  return state_->status;
}

void TransferTable::ForgetStream(const std::shared_ptr<Stream::State>& stream) {
  Locked lock(this);
  --streams_;
  auto user = users_.find(stream->uid);
  if (user == users_.end()) return;
  auto& streams = user->second.streams;
  streams.erase(std::remove(streams.begin(), streams.end(), stream),
                streams.end());
  ForgetIfIdle(stream->uid);
}

// ----------------------------------------------------------------- table

TransferTable::TransferTable(TransferLimits limits)
    : limits_(limits),
      running_per_user_(limits.running_per_user()),
      budget_(ResourceQuota::Create(
          "bytes of transfer state", "max_transfer_bytes_per_user",
          "max_transfer_bytes_total",
          {limits.max_bytes_per_user, limits.max_bytes_total})) {
  for (size_t i = 0; i < std::max<size_t>(limits_.workers, 1); ++i) {
    workers_.emplace_back([this] { WorkLoop(); });
  }
}

TransferTable::~TransferTable() {
  Shutdown(absl::UnavailableError("the agent is shutting down"));
}

absl::Status TransferTable::MakeRoom(uid_t uid, User& user) {
  const size_t bound = std::max<size_t>(limits_.max_kept_per_user, 1);
  while (user.in_flight + user.ended.size() >= bound) {
    if (user.delivered.empty()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "user ", uid, " keeps ", user.in_flight + user.ended.size(),
          " transfers (limit ", bound, ", --max_kept_transfers_per_user): ",
          user.in_flight, " in flight and ", user.ended.size(),
          " ended that no GetTransfers has read and no WatchTransfers "
          "stream has delivered; read them with GetTransfers"));
    }
    // The oldest end a stream delivered: its client has it already.
    Drop(*user.ended.at(*user.delivered.begin()));
  }
  return absl::OkStatus();
}

absl::StatusOr<QuotaCharge> TransferTable::ReserveBytes(uid_t uid,
                                                        uint64_t bytes) {
  if (bytes == 0) return QuotaCharge();  // no entry for the user either
  while (true) {
    absl::StatusOr<QuotaCharge> charge = budget_->Reserve(uid, bytes);
    if (charge.ok()) return charge;
    auto user = users_.find(uid);
    if (user == users_.end() || user->second.delivered.empty()) {
      return absl::Status(
          charge.status().code(),
          absl::StrCat(charge.status().message(),
                       " (queued and running transfers' requests, ended "
                       "transfers' results no GetTransfers has read, and "
                       "results being sent count; read ends with "
                       "GetTransfers)"));
    }
    // The oldest end a stream delivered: its client has it already. Its
    // bytes come back now unless a Stream or Poll still holds it.
    Drop(*user->second.ended.at(*user->second.delivered.begin()));
  }
}

absl::StatusOr<TransferCharge> TransferTable::Reserve(uid_t uid,
                                                      uint64_t request_bytes,
                                                      size_t ops) {
  Locked lock(this);
  if (closed_) return closed_reason_;
  DropExpired();
  // The floor: the record, and one code per result and per notification
  // (at most one per op), what its end keeps when its results do not fit.
  auto floor = ReserveBytes(uid, kRecordBytes + 2 * uint64_t{ops});
  if (!floor.ok()) return floor.status();
  auto held = ReserveBytes(uid, request_bytes);
  if (!held.ok()) return held.status();
  TransferCharge charge;
  charge.uid_ = uid;
  charge.ops_ = ops;
  charge.floor_ = std::move(*floor);
  charge.held_.push_back(std::move(*held));
  return charge;
}

absl::Status TransferTable::Grow(TransferCharge& charge, uint64_t bytes) {
  Locked lock(this);
  auto held = ReserveBytes(charge.uid_, bytes);
  if (!held.ok()) return held.status();
  charge.held_.push_back(std::move(*held));
  return absl::OkStatus();
}

uint64_t TransferTable::NewId() const {
  while (true) {
    // 63 bits: positive in every client's integer type.
    const uint64_t id = RandomNonZeroU64() >> 1;
    if (id != 0 && !records_.contains(id)) return id;
  }
}

absl::StatusOr<uint64_t> TransferTable::Submit(
    uid_t uid, std::unique_ptr<TransferWork> work, absl::Time deadline,
    TransferCharge charge) {
  // Asked before the lock: the work may look at every op.
  std::shared_ptr<const TransferProgress> progress = work->progress();
  RecordPtr start_now;
  absl::StatusOr<uint64_t> id =
      Admit(uid, std::move(work), deadline, std::move(charge),
            std::move(progress), start_now);
  // Started here, off the lock, as a worker would: Start never blocks (the
  // backends post), and it may end the transfer at once.
  if (start_now != nullptr) Start(std::move(start_now), absl::OkStatus());
  return id;
}

absl::StatusOr<uint64_t> TransferTable::Admit(
    uid_t uid, std::unique_ptr<TransferWork> work, absl::Time deadline,
    TransferCharge charge, std::shared_ptr<const TransferProgress> progress,
    RecordPtr& start_now) {
  Locked lock(this);
  if (closed_) return closed_reason_;
  DropExpired();
  User& user = users_[uid];
  if (user.in_flight >= limits_.max_in_flight_per_user) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "user ", uid, " already has ", user.in_flight,
        " transfers in flight (limit ", limits_.max_in_flight_per_user,
        ", --max_transfers_in_flight_per_user)"));
  }
  if (in_flight_ >= limits_.max_in_flight) {
    ForgetIfIdle(uid);
    return absl::ResourceExhaustedError(absl::StrCat(
        "the agent already has ", in_flight_, " transfers in flight (limit ",
        limits_.max_in_flight, ", --max_transfers_in_flight)"));
  }
  if (absl::Status room = MakeRoom(uid, user); !room.ok()) {
    ForgetIfIdle(uid);
    return room;
  }
  const uint64_t id = NewId();
  auto record = std::make_shared<Record>(id, uid, std::move(work), deadline,
                                         std::move(charge));
  record->progress = std::move(progress);
  ++user.in_flight;
  ++in_flight_;
  // Nobody waits for a worker and the user is below its cap of running
  // transfers: the submitting thread starts it, saving the hand-off to a
  // worker (10-20 us here) without passing anyone in the queue.
  if (record->work->StartsWithoutBlocking() && ready_users_ == 0 &&
      !stopping_ && user.running < running_per_user_) {
    ++user.running;
    record->on_worker = true;
    record->phase = Record::Phase::kRunning;
    running_.emplace(id, record);
    records_.emplace(id, record);
    start_now = std::move(record);
    return id;
  }
  user.queued.push_back(record);
  record->queue_position = std::prev(user.queued.end());
  records_.emplace(id, std::move(record));
  UpdateTurn(uid, user);
  return id;
}

void TransferTable::UpdateTurn(uid_t uid, User& user) {
  const bool queued = !user.queued.empty();
  if (queued && !user.in_turns) {
    user.turn = turns_.insert(turns_.end(), uid);
    user.in_turns = true;
  } else if (!queued && user.in_turns) {
    turns_.erase(user.turn);
    user.in_turns = false;
  }
  const bool ready = queued && user.running < running_per_user_;
  if (ready != user.ready) {
    user.ready = ready;
    if (ready) {
      ++ready_users_;
    } else {
      --ready_users_;
    }
  }
}

void TransferTable::WorkLoop() {
  while (true) {
    Job job = NextJob();
    if (job.task) {
      std::move(job.task)();
    } else if (job.record != nullptr) {
      Start(std::move(job.record), absl::OkStatus());
    } else {
      return;
    }
  }
}

void TransferTable::Run(Task task) {
  absl::MutexLock lock(&mu_);
  tasks_.push_back(std::move(task));
}

TransferTable::Job TransferTable::NextJob() {
  absl::MutexLock lock(&mu_);
  // Once stopping, workers stay while transfers run: their ends may still
  // hand them notifications to send.
  const auto ready = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return !tasks_.empty() || ready_users_ > 0 ||
           (stopping_ && running_.empty());
  };
  mu_.Await(absl::Condition(&ready));
  Job job;
  // Tasks first: they end transfers already running.
  if (!tasks_.empty()) {
    job.task = std::move(tasks_.front());
    tasks_.pop_front();
    return job;
  }
  if (ready_users_ == 0) return job;
  // The first user in turn below its cap of running transfers; those at
  // their cap keep their place for when one of theirs ends.
  uid_t uid = 0;
  User* user = nullptr;
  for (uid_t candidate : turns_) {
    User& found = users_.at(candidate);
    if (found.ready) {
      uid = candidate;
      user = &found;
      break;
    }
  }
  RecordPtr record = std::move(user->queued.front());
  user->queued.pop_front();
  ++user->running;
  record->on_worker = true;
  // To the back of the turns (if it still has queued transfers).
  turns_.erase(user->turn);
  user->in_turns = false;
  UpdateTurn(uid, *user);
  record->phase = Record::Phase::kRunning;
  running_.emplace(record->id, record);
  job.record = std::move(record);
  return job;
}

void TransferTable::Start(RecordPtr record, const absl::Status& skip) {
  const StopToken stop(record->deadline, &record->cancellation);
  if (!skip.ok()) {
    v1::SubmitResponse response = record->work->Skip(skip);
    return Finish(std::move(record), std::move(response));
  }
  if (stop.stopped()) {
    // Cancelled or expired while queued: nothing of it starts.
    v1::SubmitResponse response =
        record->work->Skip(stop.StopStatus("before the transfer started"));
    return Finish(std::move(record), std::move(response));
  }
  {
    absl::MutexLock lock(&mu_);
    record->start_time = absl::Now();
  }
  // The record (held by `done`, and by running_) keeps the work and the
  // Cancellation behind `stop` until the end.
  TransferWork& work = *record->work;
  work.Start(
      stop, *this,
      [this, record = std::move(record)](v1::SubmitResponse response) mutable {
        Finish(std::move(record), std::move(response));
      });
}

void TransferTable::Finish(RecordPtr record, v1::SubmitResponse response) {
  Outcome outcome;
  outcome.response = std::move(response);
  // Before the end is visible: a client that sees the end may submit again
  // at once, and must find the ops and registrations given back.
  record->work.reset();
  // What the end costs, worked out without the lock: O(results).
  const auto& results = outcome.response.results();
  const auto& notifications = outcome.response.notifications();
  outcome.codes.reserve(results.size() + notifications.size());
  // A code outside gRPC's 0..16 (none is) would be kept as UNKNOWN.
  const auto code_of = [](int code) {
    return static_cast<char>(code >= 0 && code <= 16 ? code : 2);
  };
  for (const v1::OpResult& result : results) {
    outcome.all_ok = outcome.all_ok && result.code() == 0;
    outcome.any_cancelled =
        outcome.any_cancelled ||
        result.code() == static_cast<int>(absl::StatusCode::kCancelled);
    if (result.code() == 0) ++outcome.results_ok;
    outcome.codes.push_back(code_of(result.code()));
  }
  for (const v1::NotificationResult& sent : notifications) {
    if (sent.code() == 0) ++outcome.notifications_ok;
    outcome.codes.push_back(code_of(sent.code()));
  }
  outcome.bytes = ResultsBytes(outcome.response);
  outcome.wire_bytes = outcome.response.ByteSizeLong();
  Wakeups wake;
  {
    Locked lock(this);
    wake = End(record, outcome);
    // Not kept by this thread while readers are told: a reader that finds
    // the end held by its indexes alone may take its results uncopied.
    record.reset();
  }
  // Without the lock: they take the waiting RPCs' locks, which call into
  // the table. Results that did not fit are freed here too.
  for (const auto& callback : wake) callback->Run();
}

TransferTable::Wakeups TransferTable::End(const RecordPtr& record,
                                          Outcome& outcome) {
  record->phase = Record::Phase::kEnded;
  record->end_time = absl::Now();
  record->state =
      FinalState(outcome.all_ok, outcome.any_cancelled, record->cancel_asked);
  record->end_sequence = next_end_++;
  ends_.emplace_back(record->end_time, record->id);
  record->end_position = std::prev(ends_.end());
  running_.erase(record->id);
  --in_flight_;
  User& user = users_[record->uid];
  --user.in_flight;
  if (record->on_worker) {
    --user.running;
    UpdateTurn(record->uid, user);
  }
  user.ended.emplace(record->end_sequence, record);

  // The request copy went with the work: its results take its place in
  // the budget, or, when they do not fit, only their codes (the floor).
  record->charge.held_.clear();
  const size_t results = static_cast<size_t>(outcome.response.results_size());
  record->result_count = results;
  absl::StatusOr<QuotaCharge> kept = ReserveBytes(record->uid, outcome.bytes);
  if (kept.ok()) {
    record->charge.held_.push_back(std::move(*kept));
    record->outcome = std::move(outcome.response);
    record->reply_wire_bytes = kTransferWireBytes + outcome.wire_bytes;
    record->reply_copy_bytes = kTransferCopyBytes + outcome.bytes;
  } else {
    const bool per_user =
        outcome.bytes > limits_.max_bytes_per_user ||
        budget_->used(record->uid) > limits_.max_bytes_per_user - outcome.bytes;
    record->dropped_marker =
        per_user ? kDetailsDroppedPerUser : kDetailsDroppedTotal;
    record->codes = std::move(outcome.codes);
    const size_t marker =
        std::char_traits<char>::length(record->dropped_marker);
    const size_t brief = std::char_traits<char>::length(kDetailsDropped);
    const size_t notifications = record->codes.size() - results;
    const size_t bad =
        results - outcome.results_ok + notifications - outcome.notifications_ok;
    // A result is {code, message}, a notification {code, message} too; the
    // first non-OK one of each says why (at most two such).
    const uint64_t ok_wire = ElementWireBytes(CodeOnlyWireBytes(true, 0));
    const uint64_t bad_wire = ElementWireBytes(CodeOnlyWireBytes(false, brief));
    const uint64_t why_wire =
        ElementWireBytes(CodeOnlyWireBytes(false, marker));
    record->reply_wire_bytes =
        kTransferWireBytes +
        (outcome.results_ok + outcome.notifications_ok) * ok_wire +
        bad * bad_wire + 2 * why_wire;
    record->reply_copy_bytes =
        kTransferCopyBytes + sizeof(v1::SubmitResponse) +
        results * ElementBytes<v1::OpResult>() +
        notifications * ElementBytes<v1::NotificationResult>() +
        bad * StringBytes(brief) + 2 * StringBytes(marker);
    // outcome.response is freed by Finish, without the lock.
  }

  Wakeups wake;
  for (const auto& poll : record->polls) {
    if (--poll->pending == 0) {
      --waiting_polls_;
      wake.push_back(poll->wake);
    }
  }
  record->polls.clear();
  for (const auto& stream : user.streams) {
    Queue(*stream, record);
    wake.push_back(stream->wake);
  }
  return wake;
}

void TransferTable::Queue(Stream::State& stream, const RecordPtr& record) {
  if (!stream.status.ok()) return;
  if (stream.queue.size() >= std::max<size_t>(limits_.max_kept_per_user, 1)) {
    // Its client does not read: holding more for it would let one stalled
    // reader keep every end of its user.
    Close(stream,
          absl::ResourceExhaustedError(absl::StrCat(
              "the stream fell ", stream.queue.size() + 1,
              " transfer ends behind (limit --max_kept_transfers_per_user); "
              "the agent keeps the ends for GetTransfers and for a new "
              "stream")));
    return;
  }
  stream.queue.push_back(record);
  if (stream.queue.size() == 1) ReserveHead(stream);
}

void TransferTable::ReserveHead(Stream::State& stream) {
  if (!stream.status.ok() || stream.queue.empty()) return;
  absl::StatusOr<QuotaCharge> charge =
      ReserveBytes(stream.uid, stream.queue.front()->reply_copy_bytes);
  if (charge.ok()) {
    stream.head_charge = std::move(*charge);
    return;
  }
  Close(stream, Prefixed(charge.status(),
                         absl::StrCat("no room for the stream's copy of the "
                                      "end of transfer ",
                                      stream.queue.front()->id,
                                      " (it stays kept for GetTransfers)")));
}

void TransferTable::Close(Stream::State& stream, const absl::Status& why) {
  stream.status = why;
  for (RecordPtr& record : stream.queue) Bury(std::move(record));
  stream.queue.clear();
  stream.head_charge.Reset();
}

absl::StatusOr<TransferTable::RecordPtr> TransferTable::Find(
    uid_t uid, uint64_t id) const {
  auto it = records_.find(id);
  // Another user's transfer reads exactly like one that does not exist.
  if (it == records_.end() || it->second->uid != uid) {
    return absl::NotFoundError(absl::StrCat(
        "transfer ", id,
        " is not known (never submitted by this user, or its end was already "
        "read or has expired)"));
  }
  return it->second;
}

void TransferTable::DropExpired() {
  const absl::Time cutoff = absl::Now() - limits_.retention;
  while (!ends_.empty() && ends_.front().first <= cutoff) {
    const uid_t uid = records_.at(ends_.front().second)->uid;
    Drop(*records_.at(ends_.front().second));
    ForgetIfIdle(uid);
  }
}

void TransferTable::Drop(const Record& record) {
  // Copied first: erasing the entries may destroy `record`.
  const uint64_t id = record.id;
  const uint64_t sequence = record.end_sequence;
  ends_.erase(record.end_position);
  User& user = users_.at(record.uid);
  user.delivered.erase(sequence);
  auto ended = user.ended.find(sequence);
  RecordPtr held = std::move(ended->second);
  user.ended.erase(ended);
  records_.erase(id);
  Bury(std::move(held));
}

void TransferTable::Bury(RecordPtr record) {
  // Nothing else holds it: its bytes come back now (it is freed as soon as
  // the lock is released). Otherwise they come back with the last holder.
  if (record.use_count() == 1) {
    record->charge = TransferCharge();
  }
  graveyard_.push_back(std::move(record));
}

void TransferTable::ForgetIfIdle(uid_t uid) {
  auto user = users_.find(uid);
  if (user != users_.end() && user->second.in_flight == 0 &&
      user->second.ended.empty() && user->second.streams.empty()) {
    users_.erase(user);
  }
}

v1::Transfer TransferTable::Header(const Record& record) const {
  v1::Transfer transfer;
  transfer.set_transfer_id(record.id);
  transfer.set_state(record.state);
  *transfer.mutable_create_time() = ToTimestamp(record.create_time);
  if (record.start_time != absl::InfinitePast()) {
    *transfer.mutable_start_time() = ToTimestamp(record.start_time);
  }
  if (record.phase == Record::Phase::kEnded) {
    *transfer.mutable_end_time() = ToTimestamp(record.end_time);
  }
  if (record.progress != nullptr) {
    const uint64_t total = record.progress->total_bytes;
    transfer.set_bytes_total(total);
    transfer.set_bytes_done(std::min(
        total, record.progress->landed_bytes.load(std::memory_order_relaxed)));
  }
  return transfer;
}

void TransferTable::AddResults(const Record& record, v1::Transfer& transfer) {
  if (transfer.state() == v1::TRANSFER_STATE_PENDING) return;
  if (record.dropped_marker == nullptr) {
    *transfer.mutable_results() = record.outcome.results();
    *transfer.mutable_notifications() = record.outcome.notifications();
    return;
  }
  transfer.mutable_results()->Reserve(static_cast<int>(record.result_count));
  bool result_told = false;
  bool notification_told = false;
  const auto message = [&](bool& told) {
    const char* why = told ? kDetailsDropped : record.dropped_marker;
    told = true;
    return why;
  };
  for (size_t i = 0; i < record.codes.size(); ++i) {
    const int code = static_cast<unsigned char>(record.codes[i]);
    if (i < record.result_count) {
      v1::OpResult* result = transfer.add_results();
      result->set_code(code);
      if (code != 0) result->set_message(message(result_told));
    } else {
      v1::NotificationResult* sent = transfer.add_notifications();
      sent->set_code(code);
      if (code != 0) sent->set_message(message(notification_told));
    }
  }
}

absl::StatusOr<std::unique_ptr<TransferTable::Poll>> TransferTable::StartPoll(
    uid_t uid, absl::Span<const uint64_t> ids,
    std::function<void()> on_settled) {
  auto poll = std::make_shared<Poll::State>(uid, std::move(on_settled));
  Locked lock(this);
  DropExpired();
  absl::flat_hash_set<uint64_t> named;
  named.reserve(ids.size());
  for (uint64_t id : ids) {
    if (!named.insert(id).second) continue;  // named before
    auto record = Find(uid, id);
    if (!record.ok()) return record.status();
    poll->records.push_back(std::move(*record));
  }
  for (const RecordPtr& record : poll->records) {
    if (record->phase == Record::Phase::kEnded) continue;
    record->polls.push_back(poll);
    ++poll->pending;
  }
  if (poll->pending > 0) ++waiting_polls_;
  return std::unique_ptr<Poll>(new Poll(this, std::move(poll)));
}

absl::StatusOr<std::vector<v1::Transfer>> TransferTable::Get(
    uid_t uid, absl::Span<const uint64_t> ids) {
  auto poll = StartPoll(uid, ids, nullptr);
  if (!poll.ok()) return poll.status();
  return (*poll)->Report();
}

absl::StatusOr<TransferTable::RecordPtr> TransferTable::FireCancel(
    uid_t uid, uint64_t id) {
  RecordPtr record;
  bool take_off_queue = false;
  {
    Locked lock(this);
    DropExpired();
    auto found = Find(uid, id);
    if (!found.ok()) return found.status();
    record = std::move(*found);
    if (record->phase == Record::Phase::kQueued) {
      record->cancel_asked = true;
      User& user = users_.at(record->uid);
      user.queued.erase(record->queue_position);
      UpdateTurn(record->uid, user);
      record->phase = Record::Phase::kRunning;
      take_off_queue = true;
    } else if (record->phase == Record::Phase::kRunning) {
      record->cancel_asked = true;
    }
  }
  if (!take_off_queue) {
    // Without the lock: a backend may end the batch inside its
    // cancellation callback, and its done records the end.
    record->cancellation.Cancel(absl::CancelledError(
        absl::StrCat("transfer ", id, " was cancelled (CancelTransfer)")));
  } else {
    // Start releases the reference it is given; this one stays.
    Start(record, absl::CancelledError(absl::StrCat(
                      "transfer ", id,
                      " was cancelled (CancelTransfer) before it started")));
  }
  return record;
}

absl::Status TransferTable::StartCancel(uid_t uid, uint64_t id) {
  return FireCancel(uid, id).status();
}

absl::StatusOr<v1::Transfer> TransferTable::Cancel(uid_t uid, uint64_t id) {
  auto fired = FireCancel(uid, id);
  if (!fired.ok()) return fired.status();
  const RecordPtr record = std::move(*fired);
  // CancelTransfer's contract is to return only once the run has ended, so
  // this one waits (on its own RPC thread).
  v1::Transfer transfer;
  {
    absl::MutexLock lock(&mu_);
    const auto ended = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return record->phase == Record::Phase::kEnded;
    };
    mu_.Await(absl::Condition(&ended));
    transfer = Header(*record);
  }
  // Without the lock: the results of an ended record do not change (this
  // reference keeps any Report from taking them).
  AddResults(*record, transfer);
  return transfer;
}

absl::StatusOr<std::unique_ptr<TransferTable::Stream>> TransferTable::Watch(
    uid_t uid, std::function<void()> on_ready) {
  auto stream = std::make_shared<Stream::State>(uid, std::move(on_ready));
  Locked lock(this);
  if (closed_) return closed_reason_;
  DropExpired();
  User& user = users_[uid];
  // The backlog: every end kept (whether or not another stream has
  // delivered it), oldest first.
  for (const auto& [sequence, record] : user.ended) {
    stream->queue.push_back(record);
  }
  user.streams.push_back(stream);
  ++streams_;
  // Refused: the stream opens closed, and says why at once.
  ReserveHead(*stream);
  return std::unique_ptr<Stream>(new Stream(this, std::move(stream)));
}

void TransferTable::Shutdown(const absl::Status& reason) {
  std::vector<RecordPtr> queued;
  std::vector<RecordPtr> running;
  Wakeups wake;
  absl::Status why;
  {
    Locked lock(this);
    if (!closed_) {
      closed_ = true;
      closed_reason_ = reason;
    }
    why = closed_reason_;
    for (auto& [uid, user] : users_) {
      for (RecordPtr& record : user.queued) {
        record->phase = Record::Phase::kRunning;
        queued.push_back(std::move(record));
      }
      user.queued.clear();
      user.in_turns = false;
      user.ready = false;
    }
    turns_.clear();
    ready_users_ = 0;
    for (auto& [id, record] : running_) running.push_back(record);
    for (auto& [uid, user] : users_) {
      for (const auto& stream : user.streams) {
        if (!stream->status.ok()) continue;
        Close(*stream, why);
        wake.push_back(stream->wake);
      }
    }
    stopping_ = true;
  }
  // Without the lock, as in Cancel.
  for (const RecordPtr& record : running) record->cancellation.Cancel(why);
  running.clear();
  for (const auto& callback : wake) callback->Run();
  for (RecordPtr& record : queued) Start(std::move(record), why);
  // The workers leave once the cancelled transfers have ended (backends end
  // them soon after their cancellation) and their tasks have run: nothing
  // of a transfer touches local memory once this returns.
  for (std::thread& worker : workers_) {
    if (worker.joinable()) worker.join();
  }
}

size_t TransferTable::in_flight() const {
  absl::MutexLock lock(&mu_);
  return in_flight_;
}

size_t TransferTable::in_flight(uid_t uid) const {
  absl::MutexLock lock(&mu_);
  auto it = users_.find(uid);
  return it == users_.end() ? 0 : it->second.in_flight;
}

size_t TransferTable::running(uid_t uid) const {
  absl::MutexLock lock(&mu_);
  auto it = users_.find(uid);
  return it == users_.end() ? 0 : it->second.running;
}

size_t TransferTable::kept() const {
  absl::MutexLock lock(&mu_);
  return records_.size();
}

size_t TransferTable::watchers() const {
  absl::MutexLock lock(&mu_);
  return streams_;
}

size_t TransferTable::waiting_polls() const {
  absl::MutexLock lock(&mu_);
  return waiting_polls_;
}

uint64_t TransferTable::bytes() const { return budget_->used_total(); }

uint64_t TransferTable::bytes(uid_t uid) const { return budget_->used(uid); }

}  // namespace rdma_agent

#include "daemon/ops/transfers.h"

#include <algorithm>
#include <deque>
#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "google/protobuf/util/time_util.h"

namespace rdma_agent {
namespace {

google::protobuf::Timestamp ToTimestamp(absl::Time time) {
  return google::protobuf::util::TimeUtil::NanosecondsToTimestamp(
      absl::ToUnixNanos(time));
}

// DONE when every op is OK; CANCELLED when Cancel was asked and stopped at
// least one op (a transfer the deadline ended first stays FAILED, so that
// the state never contradicts the results); FAILED otherwise.
v1::TransferState FinalState(
    const google::protobuf::RepeatedPtrField<v1::OpResult>& results,
    bool cancel_asked) {
  const auto has_code = [&](absl::StatusCode code) {
    return std::any_of(results.begin(), results.end(),
                       [code](const v1::OpResult& result) {
                         return result.code() == static_cast<int>(code);
                       });
  };
  const bool all_ok = std::all_of(
      results.begin(), results.end(),
      [](const v1::OpResult& result) { return result.code() == 0; });
  if (all_ok) return v1::TRANSFER_STATE_DONE;
  if (cancel_asked && has_code(absl::StatusCode::kCancelled)) {
    return v1::TRANSFER_STATE_CANCELLED;
  }
  return v1::TRANSFER_STATE_FAILED;
}

}  // namespace

struct TransferTable::Record {
  enum class Phase {
    kQueued,   // in its user's queue
    kRunning,  // taken off the queue by a worker, Cancel or Shutdown
    kEnded,
  };

  Record(uint64_t id, uid_t uid, std::unique_ptr<TransferWork> work,
         absl::Time deadline)
      : id(id), uid(uid), deadline(deadline), work(std::move(work)) {}

  const uint64_t id;
  const uid_t uid;
  const absl::Time deadline;
  const absl::Time create_time = absl::Now();
  // Owned by whoever took the record off the queue (Finish), until the end.
  std::unique_ptr<TransferWork> work;
  // Fired by Cancel and Shutdown; the work's StopToken watches it.
  Cancellation cancellation;

  // The rest is guarded by the table's mu_.
  Phase phase = Phase::kQueued;
  bool cancel_asked = false;
  std::list<RecordPtr>::iterator queue_position;
  absl::Time start_time = absl::InfinitePast();  // InfinitePast: never ran
  absl::Time end_time = absl::InfinitePast();
  v1::TransferState state = v1::TRANSFER_STATE_PENDING;
  v1::SubmitResponse outcome;  // results and notifications, once ended
  uint64_t end_sequence = 0;
  std::list<std::pair<absl::Time, uint64_t>>::iterator end_position;
  // A Stream has delivered its end (it may be dropped to make room).
  bool delivered = false;
  // Polls waiting for its end (one entry per time a poll names it).
  std::vector<std::shared_ptr<Poll::State>> polls;
};

// Guarded by the table's mu_, except `wake` (its own lock) and what is const.
struct TransferTable::Poll::State {
  State(uid_t uid, std::function<void()> on_settled)
      : uid(uid),
        wake(std::make_shared<RevocableCallback>(std::move(on_settled))) {}

  const uid_t uid;
  const std::shared_ptr<RevocableCallback> wake;
  std::vector<RecordPtr> records;  // one per id asked for
  size_t pending = 0;              // of `records`, not ended yet
  bool reported = false;
};

struct TransferTable::Stream::State {
  State(uid_t uid, std::function<void()> on_ready)
      : uid(uid),
        wake(std::make_shared<RevocableCallback>(std::move(on_ready))) {}

  const uid_t uid;
  const std::shared_ptr<RevocableCallback> wake;
  std::deque<RecordPtr> queue;  // ends not taken by Next yet
  absl::Status status;          // OK while open
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

std::vector<v1::Transfer> TransferTable::Poll::Report(size_t max_bytes) {
  absl::MutexLock lock(&owner_->mu_);
  std::vector<v1::Transfer> transfers;
  // Which transfers go out whole (the others' ends stay kept).
  std::vector<bool> whole;
  size_t bytes = 0;
  bool full = false;
  for (const RecordPtr& record : state_->records) {
    v1::Transfer transfer = owner_->Describe(*record);
    // A repeated field's tag and length prefix: 1 + up to 10 bytes.
    const size_t size = transfer.ByteSizeLong() + 11;
    full = full || (!transfers.empty() && bytes + size > max_bytes);
    if (full && record->phase == Record::Phase::kEnded) {
      transfer.clear_results();
      transfer.clear_notifications();
      transfer.set_results_left_out(true);
    }
    bytes += full ? transfer.ByteSizeLong() + 11 : size;
    whole.push_back(!transfer.results_left_out());
    transfers.push_back(std::move(transfer));
  }
  if (state_->reported) return transfers;
  state_->reported = true;
  for (size_t i = 0; i < state_->records.size(); ++i) {
    const RecordPtr& record = state_->records[i];
    // Still kept, and by this very record (not dropped meanwhile by another
    // reader, expiry or room-making: it is described all the same).
    auto kept = owner_->records_.find(record->id);
    if (whole[i] && record->phase == Record::Phase::kEnded &&
        kept != owner_->records_.end() && kept->second == record) {
      owner_->Drop(*record);
      owner_->ForgetIfIdle(record->uid);
    }
  }
  return transfers;
}

void TransferTable::ForgetPoll(const std::shared_ptr<Poll::State>& poll) {
  absl::MutexLock lock(&mu_);
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
  absl::MutexLock lock(&owner_->mu_);
  if (!state_->status.ok() || state_->queue.empty()) return std::nullopt;
  RecordPtr record = std::move(state_->queue.front());
  state_->queue.pop_front();
  return owner_->Describe(*record);
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
  absl::MutexLock lock(&mu_);
  --streams_;
  auto user = users_.find(stream->uid);
  if (user == users_.end()) return;
  auto& streams = user->second.streams;
  streams.erase(std::remove(streams.begin(), streams.end(), stream),
                streams.end());
  ForgetIfIdle(stream->uid);
}

// ----------------------------------------------------------------- table

TransferTable::TransferTable(TransferLimits limits) : limits_(limits) {
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

absl::StatusOr<uint64_t> TransferTable::Submit(
    uid_t uid, std::unique_ptr<TransferWork> work, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
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
  const uint64_t id = next_id_++;
  auto record = std::make_shared<Record>(id, uid, std::move(work), deadline);
  if (user.queued.empty()) user.turn = turns_.insert(turns_.end(), uid);
  user.queued.push_back(record);
  record->queue_position = std::prev(user.queued.end());
  ++queued_;
  records_.emplace(id, std::move(record));
  ++user.in_flight;
  ++in_flight_;
  return id;
}

void TransferTable::WorkLoop() {
  while (RecordPtr record = NextQueued()) Finish(record, absl::OkStatus());
}

TransferTable::RecordPtr TransferTable::NextQueued() {
  absl::MutexLock lock(&mu_);
  const auto ready = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return queued_ > 0 || stopping_;
  };
  mu_.Await(absl::Condition(&ready));
  if (queued_ == 0) return nullptr;
  const uid_t uid = turns_.front();
  User& user = users_.at(uid);
  RecordPtr record = std::move(user.queued.front());
  user.queued.pop_front();
  --queued_;
  turns_.pop_front();
  if (!user.queued.empty()) user.turn = turns_.insert(turns_.end(), uid);
  record->phase = Record::Phase::kRunning;
  running_.emplace(record->id, record);
  return record;
}

void TransferTable::Finish(const RecordPtr& record, const absl::Status& skip) {
  const StopToken stop(record->deadline, &record->cancellation);
  v1::SubmitResponse outcome;
  if (!skip.ok()) {
    outcome = record->work->Skip(skip);
  } else if (stop.stopped()) {
    // Cancelled or expired while queued: nothing of it starts.
    outcome =
        record->work->Skip(stop.StopStatus("before the transfer started"));
  } else {
    {
      absl::MutexLock lock(&mu_);
      record->start_time = absl::Now();
    }
    outcome = record->work->Run(stop);
  }
  // Before the end is visible: a client that sees it may submit again at
  // once, and must find the ops and registrations given back.
  record->work.reset();
  Wakeups wake;
  {
    absl::MutexLock lock(&mu_);
    wake = End(record, std::move(outcome));
  }
  // Without the lock: they take the waiting RPCs' locks, which call into
  // the table.
  for (const auto& callback : wake) callback->Run();
}

TransferTable::Wakeups TransferTable::End(const RecordPtr& record,
                                          v1::SubmitResponse outcome) {
  record->phase = Record::Phase::kEnded;
  record->end_time = absl::Now();
  record->state = FinalState(outcome.results(), record->cancel_asked);
  record->outcome = std::move(outcome);
  record->end_sequence = next_end_++;
  ends_.emplace_back(record->end_time, record->id);
  record->end_position = std::prev(ends_.end());
  running_.erase(record->id);
  --in_flight_;
  User& user = users_[record->uid];
  --user.in_flight;
  user.ended.emplace(record->end_sequence, record);
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
    stream.status = absl::ResourceExhaustedError(absl::StrCat(
        "the stream fell ", stream.queue.size() + 1,
        " transfer ends behind (limit --max_kept_transfers_per_user); the "
        "agent keeps the ends for GetTransfers and for a new stream"));
    stream.queue.clear();
    return;
  }
  stream.queue.push_back(record);
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
    const RecordPtr record = records_.at(ends_.front().second);
    Drop(*record);
    ForgetIfIdle(record->uid);
  }
}

void TransferTable::Drop(const Record& record) {
  // Copied first: erasing the map entry may destroy `record`.
  const uint64_t id = record.id;
  const uint64_t sequence = record.end_sequence;
  ends_.erase(record.end_position);
  User& user = users_.at(record.uid);
  user.ended.erase(sequence);
  user.delivered.erase(sequence);
  records_.erase(id);
}

void TransferTable::ForgetIfIdle(uid_t uid) {
  auto user = users_.find(uid);
  if (user != users_.end() && user->second.in_flight == 0 &&
      user->second.ended.empty() && user->second.streams.empty()) {
    users_.erase(user);
  }
}

v1::Transfer TransferTable::Describe(const Record& record) const {
  v1::Transfer transfer;
  transfer.set_transfer_id(record.id);
  transfer.set_state(record.state);
  *transfer.mutable_results() = record.outcome.results();
  *transfer.mutable_notifications() = record.outcome.notifications();
  *transfer.mutable_create_time() = ToTimestamp(record.create_time);
  if (record.start_time != absl::InfinitePast()) {
    *transfer.mutable_start_time() = ToTimestamp(record.start_time);
  }
  if (record.phase == Record::Phase::kEnded) {
    *transfer.mutable_end_time() = ToTimestamp(record.end_time);
  }
  return transfer;
}

absl::StatusOr<std::unique_ptr<TransferTable::Poll>> TransferTable::StartPoll(
    uid_t uid, absl::Span<const uint64_t> ids,
    std::function<void()> on_settled) {
  auto poll = std::make_shared<Poll::State>(uid, std::move(on_settled));
  absl::MutexLock lock(&mu_);
  DropExpired();
  for (uint64_t id : ids) {
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

absl::StatusOr<v1::Transfer> TransferTable::Cancel(uid_t uid, uint64_t id) {
  RecordPtr record;
  bool take_off_queue = false;
  {
    absl::MutexLock lock(&mu_);
    DropExpired();
    auto found = Find(uid, id);
    if (!found.ok()) return found.status();
    record = std::move(*found);
    if (record->phase == Record::Phase::kEnded) return Describe(*record);
    record->cancel_asked = true;
    if (record->phase == Record::Phase::kQueued) {
      User& user = users_.at(record->uid);
      user.queued.erase(record->queue_position);
      --queued_;
      if (user.queued.empty()) turns_.erase(user.turn);
      record->phase = Record::Phase::kRunning;
      take_off_queue = true;
    } else {
      // Cancel() only runs short callbacks (close sockets, move QPs to
      // ERR), none of which takes this lock.
      record->cancellation.Cancel(absl::CancelledError(
          absl::StrCat("transfer ", id, " was cancelled (CancelTransfer)")));
    }
  }
  if (take_off_queue) {
    Finish(record, absl::CancelledError(absl::StrCat(
                       "transfer ", id,
                       " was cancelled (CancelTransfer) before it started")));
  }
  // CancelTransfer's contract is to return only once the run has ended, so
  // this one waits (on its own RPC thread).
  absl::MutexLock lock(&mu_);
  const auto ended = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return record->phase == Record::Phase::kEnded;
  };
  mu_.Await(absl::Condition(&ended));
  return Describe(*record);
}

absl::StatusOr<std::unique_ptr<TransferTable::Stream>> TransferTable::Watch(
    uid_t uid, std::function<void()> on_ready) {
  auto stream = std::make_shared<Stream::State>(uid, std::move(on_ready));
  absl::MutexLock lock(&mu_);
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
  return std::unique_ptr<Stream>(new Stream(this, std::move(stream)));
}

void TransferTable::Shutdown(const absl::Status& reason) {
  std::vector<RecordPtr> queued;
  Wakeups wake;
  absl::Status why;
  {
    absl::MutexLock lock(&mu_);
    if (!closed_) {
      closed_ = true;
      closed_reason_ = reason;
    }
    why = closed_reason_;
    for (uid_t uid : turns_) {
      for (RecordPtr& record : users_.at(uid).queued) {
        record->phase = Record::Phase::kRunning;
        queued.push_back(std::move(record));
      }
      users_.at(uid).queued.clear();
    }
    turns_.clear();
    queued_ = 0;
    for (auto& [id, record] : running_) record->cancellation.Cancel(why);
    for (auto& [uid, user] : users_) {
      for (const auto& stream : user.streams) {
        if (!stream->status.ok()) continue;
        stream->status = why;
        stream->queue.clear();
        wake.push_back(stream->wake);
      }
    }
    stopping_ = true;
  }
  for (const auto& callback : wake) callback->Run();
  for (const RecordPtr& record : queued) Finish(record, why);
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

}  // namespace rdma_agent

#include "daemon/transfers.h"

#include <algorithm>
#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "google/protobuf/util/time_util.h"

namespace rdma_agent {
namespace {

// Ends NextEnded returns at once: a watcher with a large backlog sends it
// in pieces instead of holding every result in one batch.
constexpr size_t kMaxEndsPerWake = 64;

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
    kQueued,   // in queue_
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
};

TransferTable::Watcher::~Watcher() {
  absl::MutexLock lock(&owner_->mu_);
  --owner_->watchers_;
}

TransferTable::TransferTable(TransferLimits limits) : limits_(limits) {
  for (size_t i = 0; i < std::max<size_t>(limits_.workers, 1); ++i) {
    workers_.emplace_back([this] { WorkLoop(); });
  }
}

TransferTable::~TransferTable() {
  Shutdown(absl::UnavailableError("the agent is shutting down"));
}

absl::StatusOr<uint64_t> TransferTable::Submit(
    uid_t uid, std::unique_ptr<TransferWork> work, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  if (closed_) return closed_reason_;
  DropExpired();
  auto mine = in_flight_by_uid_.find(uid);
  const size_t user_in_flight =
      mine == in_flight_by_uid_.end() ? 0 : mine->second;
  if (user_in_flight >= limits_.max_in_flight_per_user) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "user ", uid, " already has ", user_in_flight,
        " transfers in flight (limit ", limits_.max_in_flight_per_user,
        ", --max_transfers_in_flight_per_user)"));
  }
  if (in_flight_ >= limits_.max_in_flight) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the agent already has ", in_flight_, " transfers in flight (limit ",
        limits_.max_in_flight, ", --max_transfers_in_flight)"));
  }
  const uint64_t id = next_id_++;
  auto record = std::make_shared<Record>(id, uid, std::move(work), deadline);
  queue_.push_back(record);
  record->queue_position = std::prev(queue_.end());
  records_.emplace(id, std::move(record));
  ++in_flight_by_uid_[uid];
  ++in_flight_;
  return id;
}

void TransferTable::WorkLoop() {
  while (RecordPtr record = NextQueued()) Finish(record, absl::OkStatus());
}

TransferTable::RecordPtr TransferTable::NextQueued() {
  absl::MutexLock lock(&mu_);
  const auto ready = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return !queue_.empty() || stopping_;
  };
  mu_.Await(absl::Condition(&ready));
  if (queue_.empty()) return nullptr;
  RecordPtr record = std::move(queue_.front());
  queue_.pop_front();
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
  absl::MutexLock lock(&mu_);
  End(*record, std::move(outcome));
}

void TransferTable::End(Record& record, v1::SubmitResponse outcome) {
  record.phase = Record::Phase::kEnded;
  record.end_time = absl::Now();
  record.state = FinalState(outcome.results(), record.cancel_asked);
  record.outcome = std::move(outcome);
  record.end_sequence = next_end_++;
  ended_by_uid_[record.uid].emplace(record.end_sequence, record.id);
  ends_.emplace_back(record.end_time, record.id);
  record.end_position = std::prev(ends_.end());
  running_.erase(record.id);
  auto mine = in_flight_by_uid_.find(record.uid);
  if (--mine->second == 0) in_flight_by_uid_.erase(mine);
  --in_flight_;
}

absl::StatusOr<TransferTable::RecordPtr> TransferTable::Find(
    uid_t uid, uint64_t id) const {
  auto it = records_.find(id);
  // Another user's transfer reads exactly like one that does not exist.
  if (it == records_.end() || it->second->uid != uid) {
    return absl::NotFoundError(absl::StrCat(
        "transfer ", id,
        " is not known (never submitted by this user, or its end was already "
        "reported or has expired)"));
  }
  return it->second;
}

void TransferTable::DropExpired() {
  const absl::Time cutoff = absl::Now() - limits_.retention;
  while (!ends_.empty() && ends_.front().first <= cutoff) {
    Drop(*records_.at(ends_.front().second));
  }
}

void TransferTable::Drop(const Record& record) {
  // Copied first: erasing the map entry may destroy `record`.
  const uint64_t id = record.id;
  const uid_t uid = record.uid;
  const uint64_t sequence = record.end_sequence;
  ends_.erase(record.end_position);
  auto ended = ended_by_uid_.find(uid);
  ended->second.erase(sequence);
  if (ended->second.empty()) ended_by_uid_.erase(ended);
  records_.erase(id);
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

std::unique_ptr<Cancellation::Callback> TransferTable::WakeOnCancel(
    const Cancellation* stop, bool* stopped) {
  if (stop == nullptr) return nullptr;
  return stop->OnCancel([this, stopped] {
    absl::MutexLock lock(&mu_);
    *stopped = true;
  });
}

absl::StatusOr<std::vector<v1::Transfer>> TransferTable::Get(
    uid_t uid, absl::Span<const uint64_t> ids, absl::Time deadline,
    const Cancellation* stop) {
  bool stopped = false;
  auto wake = WakeOnCancel(stop, &stopped);
  absl::MutexLock lock(&mu_);
  DropExpired();
  std::vector<RecordPtr> records;
  for (uint64_t id : ids) {
    auto record = Find(uid, id);
    if (!record.ok()) return record.status();
    records.push_back(std::move(*record));
  }
  // Records are held, not looked up again: a watcher may report (drop) one
  // while this call waits, and it is still described here.
  const auto settled = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return stopped ||
           std::all_of(records.begin(), records.end(),
                       [](const RecordPtr& record) {
                         return record->phase == Record::Phase::kEnded;
                       });
  };
  mu_.AwaitWithDeadline(absl::Condition(&settled), deadline);
  std::vector<v1::Transfer> transfers;
  for (const RecordPtr& record : records) {
    transfers.push_back(Describe(*record));
  }
  for (const RecordPtr& record : records) {
    auto kept = records_.find(record->id);
    if (record->phase == Record::Phase::kEnded && kept != records_.end() &&
        kept->second == record) {
      Drop(*record);
    }
  }
  return transfers;
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
      queue_.erase(record->queue_position);
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
  absl::MutexLock lock(&mu_);
  const auto ended = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return record->phase == Record::Phase::kEnded;
  };
  mu_.Await(absl::Condition(&ended));
  return Describe(*record);
}

std::unique_ptr<TransferTable::Watcher> TransferTable::Watch(uid_t uid) {
  absl::MutexLock lock(&mu_);
  ++watchers_;
  return std::unique_ptr<Watcher>(new Watcher(this, uid));
}

std::vector<v1::Transfer> TransferTable::NextEnded(Watcher& watcher,
                                                   const Cancellation* stop) {
  bool stopped = false;
  auto wake = WakeOnCancel(stop, &stopped);
  absl::MutexLock lock(&mu_);
  const auto unseen = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    auto ended = ended_by_uid_.find(watcher.uid_);
    return ended != ended_by_uid_.end() &&
           ended->second.upper_bound(watcher.seen_) != ended->second.end();
  };
  const auto wake_up = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return stopped || closed_ || unseen();
  };
  mu_.Await(absl::Condition(&wake_up));
  std::vector<v1::Transfer> transfers;
  if (stopped || closed_) return transfers;
  DropExpired();
  auto ended = ended_by_uid_.find(watcher.uid_);
  if (ended == ended_by_uid_.end()) return transfers;
  for (auto it = ended->second.upper_bound(watcher.seen_);
       it != ended->second.end() && transfers.size() < kMaxEndsPerWake; ++it) {
    transfers.push_back(Describe(*records_.at(it->second)));
    watcher.seen_ = it->first;
  }
  return transfers;
}

void TransferTable::MarkReported(uid_t uid, uint64_t id) {
  absl::MutexLock lock(&mu_);
  auto record = Find(uid, id);
  if (record.ok() && (*record)->phase == Record::Phase::kEnded) Drop(**record);
}

void TransferTable::Shutdown(const absl::Status& reason) {
  std::vector<RecordPtr> queued;
  absl::Status why;
  {
    absl::MutexLock lock(&mu_);
    if (!closed_) {
      closed_ = true;
      closed_reason_ = reason;
    }
    why = closed_reason_;
    for (RecordPtr& record : queue_) {
      record->phase = Record::Phase::kRunning;
      queued.push_back(std::move(record));
    }
    queue_.clear();
    for (auto& [id, record] : running_) record->cancellation.Cancel(why);
    stopping_ = true;
  }
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
  auto it = in_flight_by_uid_.find(uid);
  return it == in_flight_by_uid_.end() ? 0 : it->second;
}

size_t TransferTable::kept() const {
  absl::MutexLock lock(&mu_);
  return records_.size();
}

size_t TransferTable::watchers() const {
  absl::MutexLock lock(&mu_);
  return watchers_;
}

}  // namespace rdma_agent

#include "daemon/ops/op_batch.h"

#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/log_text.h"
#include "daemon/metrics/metrics.h"
#include "daemon/ops/notification_plan.h"
#include "daemon/ops/op_preparer.h"
#include "spdlog/spdlog.h"

namespace rdma_agent {

void FailedOpLog::Notification(const PeerCredentials& caller,
                               absl::string_view rpc,
                               const v1::RemoteBuffer& remote,
                               const absl::Status& status) {
  const auto suppressed = limiter_.Allow();
  if (!suppressed && !spdlog::should_log(spdlog::level::debug)) return;
  const std::string line =
      absl::StrCat(rpc, " from uid ", caller.uid, " pid ", caller.pid,
                   ": notification to buffer ", remote.buffer_id(),
                   " of agent ", LogSafe(remote.agent_id()),
                   " not delivered: ", LogSafe(status.ToString()));
  if (suppressed) {
    spdlog::warn("{} ({} similar suppressed)", line, *suppressed);
  } else {
    spdlog::debug("{}", line);
  }
}

void FailedOpLog::Op(const PeerCredentials& caller, absl::string_view rpc,
                     const v1::Op& op, const std::string& backend,
                     const absl::Status& status) {
  const auto suppressed = limiter_.Allow();
  if (!suppressed && !spdlog::should_log(spdlog::level::debug)) return;
  // Where the op went, as far as its context says (it may not parse).
  std::string remote = "an unreadable remote context";
  v1::RemoteBuffer context;
  // An oversized context (refused unparsed) is not parsed for a log line.
  if (op.remote_handle() != 0) {
    remote = absl::StrCat("remote handle ", op.remote_handle());
  } else if (op.remote_context().size() <= kMaxRemoteContextBytesLimit &&
             context.ParseFromString(op.remote_context())) {
    remote = absl::StrCat("buffer ", context.buffer_id(), " of agent ",
                          LogSafe(context.agent_id()));
  }
  Log(suppressed, caller, rpc, op.type(), op.length(), op.local_buffer_id(),
      remote, backend, status);
}

void FailedOpLog::Op(const PeerCredentials& caller, absl::string_view rpc,
                     const OpSpec& op, const std::string& backend,
                     const absl::Status& status) {
  const auto suppressed = limiter_.Allow();
  if (!suppressed && !spdlog::should_log(spdlog::level::debug)) return;
  std::string remote = "no remote side";
  if (op.remote_handle != 0) {
    remote = absl::StrCat("remote handle ", op.remote_handle);
  } else if (op.remote != nullptr) {
    remote = absl::StrCat("buffer ", op.remote->buffer_id(), " of agent ",
                          LogSafe(op.remote->agent_id()));
  }
  Log(suppressed, caller, rpc, op.type, op.length, op.local_buffer_id, remote,
      backend, status);
}

void FailedOpLog::Log(std::optional<uint64_t> suppressed,
                      const PeerCredentials& caller, absl::string_view rpc,
                      v1::OpType type, uint64_t length,
                      uint64_t local_buffer_id, const std::string& remote,
                      const std::string& backend, const absl::Status& status) {
  const std::string line = absl::StrCat(
      rpc, " from uid ", caller.uid, " pid ", caller.pid, ": ",
      type == v1::OP_TYPE_READ_INTO_LOCAL ? "READ" : "WRITE", " of ", length,
      " bytes, local buffer ", local_buffer_id, ", ", remote,
      backend.empty() ? "" : absl::StrCat(" over ", backend),
      " failed: ", LogSafe(status.ToString()));
  if (suppressed) {
    spdlog::warn("{} ({} similar suppressed)", line, *suppressed);
  } else {
    spdlog::debug("{}", line);
  }
}

void OpEndTally::Add(v1::OpType type, uint64_t length,
                     const OpOutcome& outcome) {
  if (metrics_ == nullptr) return;
  // Every other type counts as "invalid": a caller's made-up types make no
  // more groups than one.
  if (type != v1::OP_TYPE_READ_INTO_LOCAL &&
      type != v1::OP_TYPE_WRITE_FROM_LOCAL) {
    type = v1::OP_TYPE_UNSPECIFIED;
  }
  if (last_ >= groups_.size() || !groups_[last_].Holds(type, outcome)) {
    last_ = 0;
    while (last_ < groups_.size() && !groups_[last_].Holds(type, outcome)) {
      ++last_;
    }
    if (last_ == groups_.size()) {
      Group& group = groups_.emplace_back();
      group.backend = outcome.backend;
      group.type = type;
      group.code = outcome.status.code();
      group.latency = outcome.latency;
    }
  }
  Group& group = groups_[last_];
  ++group.count;
  group.bytes += length;
  if (!outcome.retried_from.empty()) {
    metrics_->RecordRetry(outcome.retried_from, outcome.backend);
  }
}

void OpEndTally::Record() {
  for (const Group& group : groups_) {
    metrics_->RecordOps(group.backend, group.type, group.code, group.count,
                        group.bytes, group.latency);
  }
  groups_.clear();
  last_ = 0;
}

std::unique_ptr<OpBatch> OpBatch::Prepare(const OpBatchEnvironment& env,
                                          const PeerCredentials& caller,
                                          const v1::SubmitRequest* request,
                                          absl::string_view rpc) {
  std::unique_ptr<OpBatch> batch(new OpBatch(env, caller, request, rpc));
  batch->PrepareOps();
  return batch;
}

std::unique_ptr<OpBatch> OpBatch::Prepare(
    const OpBatchEnvironment& env, const PeerCredentials& caller,
    std::unique_ptr<v1::SubmitRequest> request,
    std::unique_ptr<ActiveCalls::OpsCharge> charge, absl::string_view rpc) {
  auto batch = Prepare(env, caller, request.get(), rpc);
  batch->owned_request_ = std::move(request);
  batch->charge_ = std::move(charge);
  return batch;
}

std::unique_ptr<OpBatch> OpBatch::Prepare(
    const OpBatchEnvironment& env, const PeerCredentials& caller,
    std::shared_ptr<const PreparedTransfer> prepared,
    std::unique_ptr<ActiveCalls::OpsCharge> charge, absl::string_view rpc) {
  std::unique_ptr<OpBatch> batch(
      new OpBatch(env, caller, &prepared->request, rpc));
  batch->prepared_ = std::move(prepared);
  batch->charge_ = std::move(charge);
  batch->PrepareOps();
  return batch;
}

OpBatch::OpBatch(const OpBatchEnvironment& env, const PeerCredentials& caller,
                 const v1::SubmitRequest* request, absl::string_view rpc)
    : env_(env),
      caller_(caller),
      request_(request),
      rpc_(rpc),
      outcomes_(request->ops_size()) {}

void OpBatch::ReplaceNotification(std::string bytes) {
  replaced_notification_ = std::move(bytes);
  notification_replaced_ = true;
}

const std::string& OpBatch::notification() const {
  return notification_replaced_ ? replaced_notification_
                                : request_->notification();
}

v1::SubmitResponse OpBatch::Run(const StopToken& stop) {
  std::vector<OpOutcome> ran;
  if (!ready_.empty()) {
    absl::Notification ended;
    env_.registry->PostInPlace(absl::MakeSpan(ready_), stop,
                               [&](std::vector<OpOutcome> outcomes) {
                                 ran = std::move(outcomes);
                                 ended.Notify();
                               });
    ended.WaitForNotification();
  }
  Ran(ran);
  return Conclude(ran, stop);
}

void OpBatch::Start(const StopToken& stop, BlockingExecutor& blocking,
                    TransferDone done) {
  stop_ = stop;
  done_ = std::move(done);
  // On the thread that ended the last op: a backend's completion thread,
  // which must not block, so notifications go to `blocking`.
  auto ended = [this, &blocking](std::vector<OpOutcome> ran) {
    Ran(ran);
    if (!Notifies()) return ConcludeStarted(ran);
    blocking.Run(
        [this, ran = std::move(ran)]() mutable { ConcludeStarted(ran); });
  };
  if (ready_.empty()) return ended({});
  // The registry calls `ended` exactly once; `ready_` and the Cancellation
  // behind stop_ stay until then (the batch is destroyed only by done_).
  env_.registry->PostInPlace(absl::MakeSpan(ready_), stop_, std::move(ended));
}

void OpBatch::Ran(std::vector<OpOutcome>& ran) {
  // Kept whole only when notifications are planned from them.
  const bool keep = Notifies();
  for (size_t k = 0; k < ran.size(); ++k) {
    outcomes_[ready_index_[k]] = keep ? ran[k] : std::move(ran[k]);
  }
}

v1::SubmitResponse OpBatch::Conclude(const std::vector<OpOutcome>& ran,
                                     const StopToken& stop) {
  v1::SubmitResponse response;
  if (Notifies()) {
    for (const PlannedNotification& planned :
         PlanNotifications(ready_, ran, first_refused_)) {
      Notify(planned, stop, response.add_notifications());
    }
  }
  Finish(response);
  return response;
}

void OpBatch::ConcludeStarted(const std::vector<OpOutcome>& ran) {
  v1::SubmitResponse response = Conclude(ran, stop_);
  // Out of the batch first: done_ may destroy it.
  TransferDone done = std::move(done_);
  std::move(done)(std::move(response));
}

std::shared_ptr<const TransferProgress> OpBatch::progress() {
  if (progress_ == nullptr) {
    uint64_t total = 0;
    for (const Op& op : ready_) total += op.length;
    progress_ = std::make_shared<TransferProgress>(total);
    for (Op& op : ready_) op.landed = &progress_->landed_bytes;
  }
  return progress_;
}

v1::SubmitResponse OpBatch::Skip(const absl::Status& reason) {
  for (size_t i : ready_index_) outcomes_[i].status = AnnotateOp(reason, i);
  v1::SubmitResponse response;
  if (!notification().empty()) {
    const absl::Status not_sent(reason.code(),
                                absl::StrCat("not sent: ", reason.message()));
    for (PlannedNotification planned :
         PlanNotifications(ready_, OutcomesOfReady(), first_refused_)) {
      if (planned.status.ok()) planned.status = not_sent;
      Notify(planned, StopToken(absl::InfinitePast()),
             response.add_notifications());
    }
  }
  Finish(response);
  return response;
}

void OpBatch::PrepareOps() {
  // What the ops share (their contexts, their local buffers) is resolved
  // once for the whole batch; each op is still checked on its own.
  OpPreparer preparer(env_.buffers, caller_.uid, env_.handles, env_.names);
  ready_.reserve(outcomes_.size());
  ready_index_.reserve(outcomes_.size());
  for (size_t i = 0; i < outcomes_.size(); ++i) {
    absl::StatusOr<Op> op = PrepareOp(preparer, i);
    if (!op.ok()) {
      outcomes_[i].status = AnnotateOp(op.status(), i);
      if (!first_refused_.has_value()) first_refused_ = i;
      continue;
    }
    ready_.push_back(std::move(*op));
    ready_index_.push_back(i);
  }
}

absl::StatusOr<Op> OpBatch::PrepareOp(OpPreparer& preparer, size_t i) const {
  const v1::Op& wire = request_->ops(static_cast<int>(i));
  // A prepared op's context was parsed (or its handle resolved) when it was
  // prepared; everything else is checked again.
  if (prepared_ != nullptr) {
    return preparer.Prepare(prepared_->ops[i], i);
  }
  // Its context's size before anything of it is parsed.
  const absl::Status size = CheckRemoteContextSize(
      wire.remote_context(), env_.max_remote_context_bytes);
  if (!size.ok()) return size;
  return preparer.Prepare(wire, i);
}

uint64_t OpBatch::PreparedBytes() const {
  constexpr uint64_t kBlockOverhead = 16;
  uint64_t bytes = sizeof(OpBatch) + outcomes_.capacity() * sizeof(OpOutcome) +
                   ready_.capacity() * sizeof(Op) +
                   ready_index_.capacity() * sizeof(size_t);
  for (const OpOutcome& outcome : outcomes_) {
    const size_t message = outcome.status.message().size();
    if (message > 0) bytes += message + 64 + kBlockOverhead;
  }
  // Ops sharing a context share one parsed copy, mostly consecutive ones.
  absl::flat_hash_set<const v1::RemoteBuffer*> seen;
  const v1::RemoteBuffer* last = nullptr;
  for (const Op& op : ready_) {
    const v1::RemoteBuffer* remote = op.remote.get();
    if (remote == nullptr || remote == last) continue;
    last = remote;
    if (!seen.insert(remote).second) continue;
    // The message, its shared_ptr control block and the allocator's share.
    bytes += remote->SpaceUsedLong() + 64 + kBlockOverhead;
  }
  return bytes;
}

std::vector<OpOutcome> OpBatch::OutcomesOfReady() const {
  std::vector<OpOutcome> outcomes;
  outcomes.reserve(ready_index_.size());
  for (size_t i : ready_index_) outcomes.push_back(outcomes_[i]);
  return outcomes;
}

void OpBatch::Notify(const PlannedNotification& planned, const StopToken& stop,
                     v1::NotificationResult* result) const {
  const v1::RemoteBuffer& remote = *planned.remote;
  result->set_agent_id(remote.agent_id());
  result->set_buffer_id(remote.buffer_id());
  absl::Status status = planned.status;
  if (status.ok()) {
    status = stop.Check("before the notification was sent");
    if (!status.ok()) {
      status = absl::Status(status.code(),
                            absl::StrCat("not sent: ", status.message()));
    }
  }
  if (status.ok()) {
    result->set_backend(planned.backend);
    status =
        env_.registry->Notify(planned.backend, remote, notification(), stop);
  }
  result->set_code(static_cast<int>(status.code()));
  result->set_message(std::string(status.message()));
  if (env_.metrics != nullptr) {
    env_.metrics->RecordNotificationSent(result->backend(), status.code());
  }
  if (!status.ok()) {
    env_.failures->Notification(caller_, rpc_, remote, status);
  }
}

void OpBatch::Finish(v1::SubmitResponse& response) {
  ready_.clear();
  if (progress_ != nullptr) {
    // Parts of an op that failed later, or moved twice by a retry, counted
    // while it ran; the end counts what succeeded.
    uint64_t landed = 0;
    for (size_t i = 0; i < outcomes_.size(); ++i) {
      if (outcomes_[i].status.ok()) {
        landed += request_->ops(static_cast<int>(i)).length();
      }
    }
    progress_->landed_bytes.store(landed, std::memory_order_relaxed);
  }
  google::protobuf::RepeatedPtrField<v1::OpResult>& results =
      *response.mutable_results();
  results.Reserve(static_cast<int>(outcomes_.size()));
  for (size_t i = 0; i < outcomes_.size(); ++i) results.Add();
  OpEndTally tally(env_.metrics);
  for (size_t i = 0; i < outcomes_.size(); ++i) {
    const v1::Op& wire = request_->ops(static_cast<int>(i));
    const OpOutcome& outcome = outcomes_[i];
    tally.Add(wire.type(), wire.length(), outcome);
    if (!outcome.status.ok()) {
      env_.failures->Op(caller_, rpc_, wire, outcome.backend, outcome.status);
    }
    v1::OpResult& result = results[static_cast<int>(i)];
    result.set_code(static_cast<int>(outcome.status.code()));
    // An OK op has no message: setting an empty one would still allocate.
    if (!outcome.status.message().empty()) {
      result.set_message(std::string(outcome.status.message()));
    }
    result.set_backend(outcome.backend);
  }
  tally.Record();
}

}  // namespace rdma_agent

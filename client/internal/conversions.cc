#include "client/internal/conversions.h"

#include <string>

#include "common/status_util.h"
#include "google/protobuf/duration.pb.h"
#include "google/protobuf/timestamp.pb.h"

namespace rdma_agent::client::internal {
namespace {

absl::Time FromTimestamp(bool set, const google::protobuf::Timestamp& time) {
  if (!set) return absl::InfinitePast();
  return absl::FromUnixSeconds(time.seconds()) +
         absl::Nanoseconds(time.nanos());
}

void SetTimestamp(absl::Time time, google::protobuf::Timestamp* out) {
  const int64_t nanos = absl::ToUnixNanos(time);
  int64_t seconds = nanos / 1000000000;
  int64_t rest = nanos % 1000000000;
  if (rest < 0) {
    rest += 1000000000;
    --seconds;
  }
  out->set_seconds(seconds);
  out->set_nanos(static_cast<int32_t>(rest));
}

}  // namespace

bool LeavesTimeoutToAgent(absl::Duration timeout) {
  return timeout == absl::ZeroDuration() || timeout == absl::InfiniteDuration();
}

v1::SubmitRequest SubmitRequestFor(const std::vector<OpSpec>& ops,
                                   absl::Duration timeout) {
  v1::SubmitRequest request;
  for (const OpSpec& spec : ops) {
    v1::Op* op = request.add_ops();
    op->set_type(spec.type);
    op->set_local_buffer_id(spec.local_buffer_id);
    op->set_local_offset(spec.local_offset);
    op->set_length(spec.length);
    op->set_remote_context(spec.remote_context);
    op->set_remote_offset(spec.remote_offset);
    op->set_remote_handle(spec.remote_handle);
    op->set_remote_name(spec.remote_name);
  }
  SetTimeout(timeout, request);
  return request;
}

void SetTimeout(absl::Duration timeout, v1::SubmitRequest& request) {
  if (!LeavesTimeoutToAgent(timeout)) {
    const int64_t nanos = absl::ToInt64Nanoseconds(timeout);
    request.mutable_timeout()->set_seconds(nanos / 1000000000);
    request.mutable_timeout()->set_nanos(
        static_cast<int32_t>(nanos % 1000000000));
  }
}

OpResult FromProto(const v1::OpResult& result) {
  return OpResult{StatusFromInt(result.code(), result.message()),
                  result.backend()};
}

v1::OpResult ToProto(const OpResult& result) {
  v1::OpResult out;
  out.set_code(static_cast<int>(result.status.code()));
  out.set_message(std::string(result.status.message()));
  out.set_backend(result.backend);
  return out;
}

TransferState FromProto(v1::TransferState state) {
  switch (state) {
    case v1::TRANSFER_STATE_UNSPECIFIED:
    case v1::TRANSFER_STATE_PENDING:
      return TransferState::kPending;
    case v1::TRANSFER_STATE_DONE:
      return TransferState::kDone;
    case v1::TRANSFER_STATE_CANCELLED:
      return TransferState::kCancelled;
    default:
      return TransferState::kFailed;
  }
}

v1::TransferState ToProto(TransferState state) {
  switch (state) {
    case TransferState::kPending:
      return v1::TRANSFER_STATE_PENDING;
    case TransferState::kDone:
      return v1::TRANSFER_STATE_DONE;
    case TransferState::kFailed:
      return v1::TRANSFER_STATE_FAILED;
    case TransferState::kCancelled:
      return v1::TRANSFER_STATE_CANCELLED;
  }
  return v1::TRANSFER_STATE_UNSPECIFIED;
}

NotificationResult FromProto(const v1::NotificationResult& result) {
  NotificationResult out;
  out.agent_id = result.agent_id();
  out.buffer_id = result.buffer_id();
  out.status = absl::Status(static_cast<absl::StatusCode>(result.code()),
                            result.message());
  out.backend = result.backend();
  return out;
}

v1::NotificationResult ToProto(const NotificationResult& result) {
  v1::NotificationResult out;
  out.set_agent_id(result.agent_id);
  out.set_buffer_id(result.buffer_id);
  out.set_code(static_cast<int>(result.status.code()));
  out.set_message(std::string(result.status.message()));
  out.set_backend(result.backend);
  return out;
}

Notification FromProto(const v1::Notification& notification) {
  Notification out;
  out.from_agent_id = notification.from_agent_id();
  out.buffer_id = notification.buffer_id();
  out.data = notification.data();
  out.receive_time = FromTimestamp(notification.has_receive_time(),
                                   notification.receive_time());
  out.sequence = notification.sequence();
  return out;
}

TransferResult FromProto(const v1::Transfer& transfer) {
  TransferResult result;
  result.id = transfer.transfer_id();
  result.state = FromProto(transfer.state());
  result.results.reserve(transfer.results_size());
  for (const v1::OpResult& op : transfer.results()) {
    result.results.push_back(FromProto(op));
  }
  result.create_time =
      FromTimestamp(transfer.has_create_time(), transfer.create_time());
  result.start_time =
      FromTimestamp(transfer.has_start_time(), transfer.start_time());
  result.end_time = FromTimestamp(transfer.has_end_time(), transfer.end_time());
  for (const v1::NotificationResult& sent : transfer.notifications()) {
    result.notifications.push_back(FromProto(sent));
  }
  result.bytes_total = transfer.bytes_total();
  result.bytes_done = transfer.bytes_done();
  return result;
}

v1::Transfer ToProto(const TransferResult& result) {
  v1::Transfer transfer;
  transfer.set_transfer_id(result.id);
  transfer.set_state(ToProto(result.state));
  for (const OpResult& op : result.results) {
    *transfer.add_results() = ToProto(op);
  }
  for (const NotificationResult& sent : result.notifications) {
    *transfer.add_notifications() = ToProto(sent);
  }
  if (result.create_time != absl::InfinitePast()) {
    SetTimestamp(result.create_time, transfer.mutable_create_time());
  }
  if (result.start_time != absl::InfinitePast()) {
    SetTimestamp(result.start_time, transfer.mutable_start_time());
  }
  if (result.end_time != absl::InfinitePast()) {
    SetTimestamp(result.end_time, transfer.mutable_end_time());
  }
  transfer.set_bytes_total(result.bytes_total);
  transfer.set_bytes_done(result.bytes_done);
  return transfer;
}

}  // namespace rdma_agent::client::internal

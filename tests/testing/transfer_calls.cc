#include "tests/testing/transfer_calls.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "grpcpp/grpcpp.h"

namespace rdma_agent::testing {
namespace {

void SetDuration(absl::Duration duration, google::protobuf::Duration* out) {
  const int64_t seconds = absl::ToInt64Seconds(duration);
  out->set_seconds(seconds);
  out->set_nanos(static_cast<int32_t>(
      absl::ToInt64Nanoseconds(duration - absl::Seconds(seconds))));
}

void SetDeadline(grpc::ClientContext& context, absl::Duration from_now) {
  context.set_deadline(absl::ToChronoTime(absl::Now() + from_now));
}

}  // namespace

v1::Op MakeWireOp(v1::OpType type, uint64_t local_id, uint64_t local_offset,
                  uint64_t length, const std::string& remote_context,
                  uint64_t remote_offset) {
  v1::Op op;
  op.set_type(type);
  op.set_local_buffer_id(local_id);
  op.set_local_offset(local_offset);
  op.set_length(length);
  op.set_remote_context(remote_context);
  op.set_remote_offset(remote_offset);
  return op;
}

v1::Op MakeWireOp(v1::OpType type, const client::Buffer& local,
                  uint64_t local_offset, uint64_t length,
                  const client::Buffer& remote, uint64_t remote_offset) {
  return MakeWireOp(type, local.id(), local_offset, length,
                    remote.remote_context(), remote_offset);
}

v1::SubmitRequest MakeBatch(std::vector<v1::Op> ops, absl::Duration timeout) {
  v1::SubmitRequest request;
  for (v1::Op& op : ops) *request.add_ops() = std::move(op);
  SetDuration(timeout, request.mutable_timeout());
  return request;
}

absl::StatusOr<uint64_t> SubmitAsync(v1::RdmaAgent::Stub& stub,
                                     const v1::SubmitRequest& request) {
  grpc::ClientContext context;
  SetDeadline(context, kCallSlack);
  v1::SubmitAsyncResponse response;
  const absl::Status status =
      FromGrpcStatus(stub.SubmitAsync(&context, request, &response));
  if (!status.ok()) return status;
  return response.transfer_id();
}

absl::StatusOr<std::vector<v1::Transfer>> GetTransfers(
    v1::RdmaAgent::Stub& stub, absl::Span<const uint64_t> ids,
    absl::Duration wait) {
  grpc::ClientContext context;
  SetDeadline(context, wait + kCallSlack);
  v1::GetTransfersRequest request;
  for (uint64_t id : ids) request.add_transfer_ids(id);
  if (wait > absl::ZeroDuration()) SetDuration(wait, request.mutable_wait());
  v1::GetTransfersResponse response;
  const absl::Status status =
      FromGrpcStatus(stub.GetTransfers(&context, request, &response));
  if (!status.ok()) return status;
  if (response.transfers_size() != static_cast<int>(ids.size())) {
    return absl::InternalError(
        absl::StrCat("GetTransfers answered ", response.transfers_size(),
                     " transfers for ", ids.size(), " ids"));
  }
  return std::vector<v1::Transfer>(response.transfers().begin(),
                                   response.transfers().end());
}

absl::StatusOr<v1::Transfer> GetTransfer(v1::RdmaAgent::Stub& stub, uint64_t id,
                                         absl::Duration wait) {
  auto transfers = GetTransfers(stub, {id}, wait);
  if (!transfers.ok()) return transfers.status();
  return std::move(transfers->front());
}

absl::StatusOr<v1::Transfer> CancelTransfer(v1::RdmaAgent::Stub& stub,
                                            uint64_t id) {
  grpc::ClientContext context;
  SetDeadline(context, kCallSlack);
  v1::CancelTransferRequest request;
  request.set_transfer_id(id);
  v1::CancelTransferResponse response;
  const absl::Status status =
      FromGrpcStatus(stub.CancelTransfer(&context, request, &response));
  if (!status.ok()) return status;
  return response.transfer();
}

absl::StatusOr<std::vector<v1::OpResult>> SubmitSync(
    v1::RdmaAgent::Stub& stub, const v1::SubmitRequest& request) {
  grpc::ClientContext context;
  SetDeadline(context, absl::Seconds(request.timeout().seconds()) + kCallSlack);
  v1::SubmitResponse response;
  const absl::Status status =
      FromGrpcStatus(stub.Submit(&context, request, &response));
  if (!status.ok()) return status;
  return std::vector<v1::OpResult>(response.results().begin(),
                                   response.results().end());
}

std::string DescribeFailures(const v1::Transfer& transfer, int limit) {
  std::string text = absl::StrCat("transfer ", transfer.transfer_id(), " ",
                                  v1::TransferState_Name(transfer.state()),
                                  " (", transfer.results_size(), " results)");
  int shown = 0;
  for (int i = 0; i < transfer.results_size() && shown < limit; ++i) {
    const v1::OpResult& result = transfer.results(i);
    if (result.code() == 0) continue;
    absl::StrAppend(
        &text, "; op ", i, ": ",
        absl::StatusCodeToString(static_cast<absl::StatusCode>(result.code())),
        " ", result.message());
    ++shown;
  }
  return text;
}

}  // namespace rdma_agent::testing

#include "tests/directory/name_calls.h"

#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "rdma/agent/v1/agent.grpc.pb.h"

namespace rdma_agent::testing {

namespace v1 = ::rdma::agent::v1;

absl::StatusOr<v1::RegisterResponse> RegisterNamed(AgentProcess& agent,
                                                   const std::string& name,
                                                   absl::Duration patience,
                                                   v1::Visibility visibility,
                                                   uint64_t size) {
  auto stub = v1::RdmaAgent::NewStub(agent.client().channel());
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + patience));
  v1::RegisterRequest request;
  request.set_allocate_bytes(size);
  request.set_access(v1::ACCESS_READ_WRITE);
  request.set_lifetime(v1::LIFETIME_AGENT);
  request.set_name(name);
  request.set_name_visibility(visibility);
  v1::RegisterResponse response;
  const grpc::Status status = stub->Register(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<v1::OpResult> SubmitOne(AgentProcess& agent, const v1::Op& op,
                                       absl::Duration patience) {
  auto stub = v1::RdmaAgent::NewStub(agent.client().channel());
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + patience));
  v1::SubmitRequest request;
  *request.add_ops() = op;
  request.mutable_timeout()->set_seconds(10);
  v1::SubmitResponse response;
  const grpc::Status status = stub->Submit(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  if (response.results_size() != 1) {
    return absl::InternalError("Submit of one op answered another count");
  }
  return response.results(0);
}

v1::Op ReadByNameOp(uint64_t local, const std::string& name, uint64_t length) {
  v1::Op op;
  op.set_type(v1::OP_TYPE_READ_INTO_LOCAL);
  op.set_local_buffer_id(local);
  op.set_length(length);
  op.set_remote_name(name);
  return op;
}

}  // namespace rdma_agent::testing

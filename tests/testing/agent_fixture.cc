#include "tests/testing/agent_fixture.h"

#include "backends/memory/memory_backend.h"
#include "common/grpc_status.h"

namespace rdma_agent::testing {

absl::StatusOr<std::unique_ptr<InProcessAgent>> InProcessAgent::Start(
    AgentOptions options) {
  std::unique_ptr<InProcessAgent> fixture(new InProcessAgent());
  options.runtime_dir = fixture->dir_.path();
  // Loopback unless the test chose an address (empty: the agent's default).
  if (options.peer_listen == AgentOptions().peer_listen) {
    options.peer_listen = "127.0.0.1:0";
  }
  if (options.advertise_host.empty()) options.advertise_host = "127.0.0.1";
  if (options.backends.empty()) {
    options.backends.push_back([](const BackendEnvironment& env)
                                   -> absl::StatusOr<std::unique_ptr<Backend>> {
      return std::make_unique<memory::MemoryBackend>(env);
    });
  }
  fixture->options_ = std::move(options);
  absl::Status status = fixture->Restart();
  if (!status.ok()) return status;
  return fixture;
}

absl::Status InProcessAgent::Restart() {
  stub_.reset();
  agent_.reset();
  auto agent = Agent::Start(options_);
  if (!agent.ok()) return agent.status();
  agent_ = std::move(*agent);
  stub_ = NewStub();
  return absl::OkStatus();
}

std::unique_ptr<v1::RdmaAgent::Stub> InProcessAgent::NewStub() const {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  // A distinct channel argument keeps gRPC from sharing one connection.
  args.SetInt("rdma_agent.test.channel", rand());
  return v1::RdmaAgent::NewStub(grpc::CreateCustomChannel(
      agent_->target(), grpc::InsecureChannelCredentials(), args));
}

absl::StatusOr<v1::RegisterResponse> InProcessAgent::Allocate(
    uint64_t size, v1::Access access) {
  grpc::ClientContext context;
  v1::RegisterRequest request;
  request.set_allocate_bytes(size);
  request.set_access(access);
  v1::RegisterResponse response;
  absl::Status status =
      FromGrpcStatus(stub_->Register(&context, request, &response));
  if (!status.ok()) return status;
  return response;
}

}  // namespace rdma_agent::testing

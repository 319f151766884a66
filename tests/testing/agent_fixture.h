#ifndef RDMA_AGENTD_TESTS_TESTING_AGENT_FIXTURE_H_
#define RDMA_AGENTD_TESTS_TESTING_AGENT_FIXTURE_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/grpc_status.h"  // FromGrpcStatus, for the stub's statuses
#include "daemon/agent.h"
#include "grpcpp/grpcpp.h"
#include "rdma/agent/v1/agent.grpc.pb.h"
#include "tests/testing/temp_dir.h"

namespace rdma_agent::testing {

// An in-process Agent in a temporary runtime dir, with a stub to call it.
class InProcessAgent {
 public:
  // Starts an agent with `options` (runtime_dir is filled in); with no
  // backends given, the memory backend.
  static absl::StatusOr<std::unique_ptr<InProcessAgent>> Start(
      AgentOptions options = {});

  Agent& agent() { return *agent_; }
  v1::RdmaAgent::Stub& stub() { return *stub_; }
  const std::string& runtime_dir() const { return dir_.path(); }

  // Stops the agent and starts it again in the same runtime dir (same agent
  // id, new epoch, no registrations); the stub is renewed.
  absl::Status Restart();

  // A new stub on a new connection (a separate caller).
  std::unique_ptr<v1::RdmaAgent::Stub> NewStub() const;

  // Registers `size` agent-allocated bytes; returns the response.
  absl::StatusOr<v1::RegisterResponse> Allocate(
      uint64_t size, v1::Access access = v1::ACCESS_READ_WRITE);

 private:
  InProcessAgent() = default;

  TempDir dir_;
  AgentOptions options_;
  std::unique_ptr<Agent> agent_;
  std::unique_ptr<v1::RdmaAgent::Stub> stub_;
};

}  // namespace rdma_agent::testing

#endif  // RDMA_AGENTD_TESTS_TESTING_AGENT_FIXTURE_H_

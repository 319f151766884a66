#ifndef RDMA_AGENTD_TESTS_DIRECTORY_NAME_CALLS_H_
#define RDMA_AGENTD_TESTS_DIRECTORY_NAME_CALLS_H_

// The calls the directory tests make straight on an agent's API (no client
// library in between, so each test sees exactly the codes the agent
// answers), every one bounded by the caller's patience.

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/rdma_agent_client.h"
#include "rdma/agent/v1/agent.pb.h"
#include "tests/testing/agent_process.h"

namespace rdma_agent::testing {

// Registers `size` bytes the agent allocates (agent lifetime), published
// under `name` with `visibility` (no name when empty).
absl::StatusOr<::rdma::agent::v1::RegisterResponse> RegisterNamed(
    AgentProcess& agent, const std::string& name, absl::Duration patience,
    ::rdma::agent::v1::Visibility visibility =
        ::rdma::agent::v1::VISIBILITY_OWNER,
    uint64_t size = 4096);

// Runs `op` alone through Submit (a 10 s op timeout): its result, or the
// RPC's own failure.
absl::StatusOr<::rdma::agent::v1::OpResult> SubmitOne(
    AgentProcess& agent, const ::rdma::agent::v1::Op& op,
    absl::Duration patience);

// A READ of `length` bytes at offset 0 of what `name` stands for into
// `local` at offset 0.
::rdma::agent::v1::Op ReadByNameOp(uint64_t local, const std::string& name,
                                   uint64_t length = 100);

}  // namespace rdma_agent::testing

#endif  // RDMA_AGENTD_TESTS_DIRECTORY_NAME_CALLS_H_

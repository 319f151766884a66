#ifndef RDMA_AGENTD_TESTS_TESTING_TRANSFER_CALLS_H_
#define RDMA_AGENTD_TESTS_TESTING_TRANSFER_CALLS_H_

// The asynchronous-transfer RPCs (SubmitAsync, GetTransfers, CancelTransfer)
// called raw on a stub, with the agent's answer as an absl status, and ops
// between mapped client buffers: for tests that check the API's contract
// (agent.proto) itself rather than what the client library makes of it.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/rdma_agent_client.h"
#include "rdma/agent/v1/agent.grpc.pb.h"

namespace rdma_agent::testing {

namespace v1 = ::rdma::agent::v1;

// Every call below has this gRPC deadline on top of what it asks the agent
// to wait, so that a hung agent fails the test instead of hanging it.
inline constexpr absl::Duration kCallSlack = absl::Seconds(60);

// An op between `local` (a registration of the agent the op is submitted
// to) and the remote context `remote`.
v1::Op MakeWireOp(v1::OpType type, uint64_t local_id, uint64_t local_offset,
                  uint64_t length, const std::string& remote_context,
                  uint64_t remote_offset);
v1::Op MakeWireOp(v1::OpType type, const client::Buffer& local,
                  uint64_t local_offset, uint64_t length,
                  const client::Buffer& remote, uint64_t remote_offset);

// A SubmitRequest of `ops` with `timeout`.
v1::SubmitRequest MakeBatch(std::vector<v1::Op> ops, absl::Duration timeout);

// SubmitAsync: the transfer id, or the call's status.
absl::StatusOr<uint64_t> SubmitAsync(v1::RdmaAgent::Stub& stub,
                                     const v1::SubmitRequest& request);
// GetTransfers of `ids` waiting at most `wait`: one Transfer per id, or the
// call's status.
absl::StatusOr<std::vector<v1::Transfer>> GetTransfers(
    v1::RdmaAgent::Stub& stub, absl::Span<const uint64_t> ids,
    absl::Duration wait = absl::ZeroDuration());
// GetTransfers of one id.
absl::StatusOr<v1::Transfer> GetTransfer(
    v1::RdmaAgent::Stub& stub, uint64_t id,
    absl::Duration wait = absl::ZeroDuration());
// CancelTransfer: the final state it returns, or the call's status.
absl::StatusOr<v1::Transfer> CancelTransfer(v1::RdmaAgent::Stub& stub,
                                            uint64_t id);
// Submit (synchronous): one result per op, or the call's status.
absl::StatusOr<std::vector<v1::OpResult>> SubmitSync(
    v1::RdmaAgent::Stub& stub, const v1::SubmitRequest& request);

// "op 3: CANCELLED ..." for each op of `transfer` whose code is not OK (at
// most `limit` of them): for failure messages.
std::string DescribeFailures(const v1::Transfer& transfer, int limit = 5);

}  // namespace rdma_agent::testing

#endif  // RDMA_AGENTD_TESTS_TESTING_TRANSFER_CALLS_H_

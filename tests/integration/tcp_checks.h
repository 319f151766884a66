#ifndef RDMA_AGENTD_TESTS_INTEGRATION_TCP_CHECKS_H_
#define RDMA_AGENTD_TESTS_INTEGRATION_TCP_CHECKS_H_

// Transfer checks shared by the cross-host and the loopback tcp tests.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "client/rdma_agent_client.h"
#include "tests/testing/agent_process.h"

namespace rdma_agent::testing {

namespace v1 = ::rdma::agent::v1;

// One op of a Submit between two buffers.
client::OpSpec MakeOp(v1::OpType type, const client::Buffer& local,
                      uint64_t local_offset, uint64_t length,
                      const client::Buffer& remote, uint64_t remote_offset);

// Expects `buffer` to hold pattern `seed` everywhere except in
// [offset, offset + length), which must hold pattern `inner_seed` as laid out
// from position `inner_start`. (length 0: the whole buffer is `seed`.)
void ExpectLayout(const client::Buffer& buffer, uint8_t seed, uint64_t offset,
                  uint64_t length, uint8_t inner_seed, uint64_t inner_start,
                  absl::string_view what);

// Through `local_agent`, writes then reads each of `sizes` bytes at odd
// offsets between `local` (on that agent) and `remote` (on the other agent),
// checking every byte of both buffers after each op. Both buffers must be
// READ_WRITE and at least max(sizes) + 64 bytes; they are refilled with
// patterns 1 (local) and 2 (remote).
void SweepSizes(client::AgentClient& local_agent, client::Buffer& local,
                client::Buffer& remote, const std::vector<uint64_t>& sizes);

}  // namespace rdma_agent::testing

#endif  // RDMA_AGENTD_TESTS_INTEGRATION_TCP_CHECKS_H_

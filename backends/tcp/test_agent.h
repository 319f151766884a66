#ifndef RDMA_AGENTD_BACKENDS_TCP_TEST_AGENT_H_
#define RDMA_AGENTD_BACKENDS_TCP_TEST_AGENT_H_

#include <cstdint>
#include <memory>

#include "backends/tcp/data_client.h"
#include "backends/testing/harness.h"

namespace rdma_agent::tcp {

// An in-process agent (::rdma_agent::testing::TestAgent) whose tcp backend
// listens on 127.0.0.1:port (0: any free port) with `client` as its requesting
// side's options. nullptr, with a test failure, when it cannot be made.
std::unique_ptr<::rdma_agent::testing::TestAgent> TcpTestAgent(
    uint64_t epoch, uint16_t port = 0, DataClientOptions client = {});

}  // namespace rdma_agent::tcp

#endif  // RDMA_AGENTD_BACKENDS_TCP_TEST_AGENT_H_

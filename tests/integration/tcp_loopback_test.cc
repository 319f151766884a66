// Two rdma-agentd processes on one host, talking TCP over loopback (distinct
// agents: the memory backend cannot reach across them). Needs no root.

#include <memory>

#include "gtest/gtest.h"
#include "tests/integration/tcp_checks.h"
#include "tests/testing/agent_process.h"

namespace rdma_agent::testing {
namespace {

TEST(TcpLoopbackTest, SameHostPairMovesEveryByteOverTcp) {
  auto a = AgentProcess::Start(TcpAgentOptions());
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = AgentProcess::Start(TcpAgentOptions());
  ASSERT_TRUE(b.ok()) << b.status();
  constexpr uint64_t kMax = 64ull << 20;
  auto local = (*a)->client().Attach(kMax + 64, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(local.ok()) << local.status();
  auto remote = (*b)->client().Attach(kMax + 64, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(remote.ok()) << remote.status();
  SweepSizes((*a)->client(), *local, *remote,
             {1, 4097, (1ull << 20) + 5, (9ull << 20) + 1, kMax});
  if (HasFailure()) {
    ADD_FAILURE() << "agent a log:\n" << (*a)->Log();
    ADD_FAILURE() << "agent b log:\n" << (*b)->Log();
  }
}

}  // namespace
}  // namespace rdma_agent::testing

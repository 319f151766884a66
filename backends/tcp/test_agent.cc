#include "backends/tcp/test_agent.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "backends/tcp/tcp_backend.h"
#include "gtest/gtest.h"

namespace rdma_agent::tcp {

std::unique_ptr<::rdma_agent::testing::TestAgent> TcpTestAgent(
    uint64_t epoch, uint16_t port, DataClientOptions client) {
  TcpOptions options;
  options.listen = absl::StrCat("127.0.0.1:", port);
  options.client = client;
  auto agent = ::rdma_agent::testing::TestAgent::Create(
      absl::StrCat("agent-", epoch),
      [options](const BackendEnvironment& env)
          -> absl::StatusOr<std::unique_ptr<Backend>> {
        auto backend = TcpBackend::Create(options, env);
        if (!backend.ok()) return backend.status();
        return std::unique_ptr<Backend>(std::move(*backend));
      },
      epoch);
  EXPECT_TRUE(agent.ok()) << agent.status();
  return agent.ok() ? std::move(*agent) : nullptr;
}

}  // namespace rdma_agent::tcp

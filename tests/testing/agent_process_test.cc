#include "tests/testing/agent_process.h"

#include <signal.h>
#include <unistd.h>

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rdma_agent::testing {
namespace {

using ::testing::HasSubstr;

TEST(AgentProcessTest, ServesWithTheMemoryBackendByDefault) {
  auto agent = AgentProcess::Start();
  ASSERT_TRUE(agent.ok()) << agent.status();
  auto info = (*agent)->client().GetInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_EQ(info->backends_size(), 1);
  EXPECT_EQ(info->backends(0).name(), "memory");
  EXPECT_EQ((*agent)->tcp_port(), 0);
  EXPECT_EQ(::access((*agent)->attach_socket_path().c_str(), F_OK), 0);
  EXPECT_THAT((*agent)->Log(), HasSubstr("serving unix://"));
}

TEST(AgentProcessTest, RestartKeepsIdentityAndTcpPortWithANewEpoch) {
  AgentProcess::Options options;
  options.backends = "memory,tcp";
  options.advertise_host = "127.0.0.1";
  options.log_level = "info";
  auto agent = AgentProcess::Start(options);
  ASSERT_TRUE(agent.ok()) << agent.status();
  const uint16_t port = (*agent)->tcp_port();
  EXPECT_NE(port, 0);
  auto before = (*agent)->client().GetInfo();
  ASSERT_TRUE(before.ok()) << before.status();

  (*agent)->Kill();
  EXPECT_FALSE((*agent)->Running());
  ASSERT_TRUE((*agent)->Restart().ok()) << (*agent)->Log();
  EXPECT_TRUE((*agent)->Running());
  auto after = (*agent)->client().GetInfo();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->agent_id(), before->agent_id());
  EXPECT_NE(after->epoch(), before->epoch());
  EXPECT_EQ((*agent)->tcp_port(), port);
  auto other = (*agent)->NewClient();
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_TRUE((*other)->GetInfo().ok());
}

TEST(AgentProcessTest, StopSignalsAndReturnsTheExitCode) {
  auto agent = AgentProcess::Start();
  ASSERT_TRUE(agent.ok()) << agent.status();
  auto code = (*agent)->Stop(SIGINT, absl::Seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  EXPECT_FALSE((*agent)->Running());
  EXPECT_NE(::access((*agent)->socket_path().c_str(), F_OK), 0)
      << "a clean stop removes the socket";
  EXPECT_THAT((*agent)->Log(), HasSubstr("shutting down"));
}

TEST(AgentProcessTest, ADaemonThatCannotStartIsAnErrorWithItsLog) {
  AgentProcess::Options options;
  options.extra_flags = {"--backends=memory,carrier-pigeon"};
  auto agent = AgentProcess::Start(options);
  EXPECT_EQ(agent.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(agent.status().message(), HasSubstr("carrier-pigeon"));
}

}  // namespace
}  // namespace rdma_agent::testing

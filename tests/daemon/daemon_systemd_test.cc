// rdma-agentd as systemd runs it (Type=notify, WatchdogSec=): READY=1 once
// its socket accepts connections, WATCHDOG=1 at half the interval, STOPPING=1
// at SIGTERM; and SIGHUP does not stop it.
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "client/rdma_agent_client.h"
#include "common/unique_fd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/fake_service_manager.h"
#include "tests/testing/process.h"
#include "tests/testing/temp_dir.h"

namespace rdma_agent {
namespace {

using ::rdma_agent::testing::FakeServiceManager;
using ::rdma_agent::testing::MakeShortTempDir;
using ::rdma_agent::testing::RemoveTree;
using ::rdma_agent::testing::RunfilePath;
using ::rdma_agent::testing::Subprocess;
using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// True when a client can connect to the Unix socket at `path` now.
bool Accepts(const std::string& path) {
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un address = {};
  address.sun_family = AF_UNIX;
  std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
  return ::connect(fd.get(), reinterpret_cast<sockaddr*>(&address),
                   sizeof(address)) == 0;
}

class DaemonSystemdTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto dir = MakeShortTempDir();
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = *dir;
    // Left unset, sd_watchdog_enabled takes the watchdog as the daemon's own:
    // its pid is not known before it starts.
    ::unsetenv("WATCHDOG_PID");
  }
  void TearDown() override { RemoveTree(dir_); }

  std::string Socket() const { return dir_ + "/run/agent.sock"; }
  std::string LogPath() const { return dir_ + "/rdma-agentd.log"; }
  std::string Log() const {
    std::ifstream in(LogPath());
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }

  // The daemon with `env` added to its environment and `flags` to its
  // command line, logging to LogPath().
  Subprocess Spawn(std::vector<std::string> env,
                   const std::vector<std::string>& flags = {}) {
    Subprocess::Options options;
    options.argv = {RunfilePath("daemon/rdma-agentd"),
                    "--runtime_dir=" + dir_ + "/run",
                    "--state_dir=" + dir_ + "/state", "--backends=memory"};
    options.argv.insert(options.argv.end(), flags.begin(), flags.end());
    options.env = std::move(env);
    options.log_path = LogPath();
    auto process = Subprocess::Spawn(std::move(options));
    EXPECT_TRUE(process.ok()) << process.status();
    return std::move(*process);
  }

  // Messages up to and including the first that starts with `prefix`.
  std::vector<std::string> MessagesUntil(FakeServiceManager& manager,
                                         absl::string_view prefix,
                                         absl::Duration timeout) {
    std::vector<std::string> messages;
    const absl::Time deadline = absl::Now() + timeout;
    for (;;) {
      auto message = manager.Next(deadline - absl::Now());
      if (!message.ok()) {
        ADD_FAILURE() << "waiting for " << prefix << ": " << message.status()
                      << "\n"
                      << Log();
        return messages;
      }
      messages.push_back(*message);
      if (absl::StartsWith(*message, prefix)) return messages;
    }
  }

  std::string dir_;
};

TEST_F(DaemonSystemdTest, ReadyOnceServingThenWatchdogPingsThenStopping) {
  auto manager = FakeServiceManager::Bind(dir_ + "/notify");
  ASSERT_TRUE(manager.ok()) << manager.status();
  Subprocess daemon = Spawn({manager->Environment(), "WATCHDOG_USEC=400000"});

  std::vector<std::string> messages =
      MessagesUntil(*manager, "READY=1", absl::Seconds(30));
  ASSERT_FALSE(messages.empty());
  // Checked the moment READY=1 arrives: sent any earlier, the socket would
  // not be there yet.
  EXPECT_TRUE(Accepts(Socket())) << "READY=1 before the socket listens";
  EXPECT_THAT(messages, Contains("STATUS=starting"));
  EXPECT_EQ(messages.back(), "READY=1\nSTATUS=serving unix://" + Socket() +
                                 "; backends: memory");

  client::ConnectOptions options;
  options.target = "unix://" + Socket();
  auto agent = client::AgentClient::Connect(options);
  ASSERT_TRUE(agent.ok()) << agent.status();
  EXPECT_TRUE((*agent)->GetInfo().ok());

  // Pings at half of the 400 ms interval: several, and not in a busy loop.
  std::vector<std::chrono::steady_clock::time_point> pings;
  while (pings.size() < 4) {
    auto message = manager->Next(absl::Seconds(5));
    ASSERT_TRUE(message.ok()) << message.status() << "\n" << Log();
    ASSERT_EQ(*message, "WATCHDOG=1");
    pings.push_back(std::chrono::steady_clock::now());
  }
  for (size_t i = 1; i < pings.size(); ++i) {
    EXPECT_GE(pings[i] - pings[i - 1], std::chrono::milliseconds(100));
  }

  daemon.Signal(SIGTERM);
  messages = MessagesUntil(*manager, "STOPPING=1", absl::Seconds(10));
  ASSERT_FALSE(messages.empty());
  EXPECT_THAT(messages.back(), HasSubstr("STATUS=stopping: Terminated"));
  auto code = daemon.Wait(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0) << Log();
}

TEST_F(DaemonSystemdTest, WatchdogOfAnotherProcessGetsNoPings) {
  auto manager = FakeServiceManager::Bind(dir_ + "/notify");
  ASSERT_TRUE(manager.ok()) << manager.status();
  // systemd sets WATCHDOG_PID to its main process; this is not it.
  Subprocess daemon =
      Spawn({manager->Environment(), "WATCHDOG_USEC=400000", "WATCHDOG_PID=1"});
  MessagesUntil(*manager, "READY=1", absl::Seconds(30));
  auto message = manager->Next(absl::Seconds(1));
  EXPECT_FALSE(message.ok()) << "unexpected " << *message;
  daemon.Signal(SIGTERM);
  MessagesUntil(*manager, "STOPPING=1", absl::Seconds(10));
  auto code = daemon.Wait(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0) << Log();
}

TEST_F(DaemonSystemdTest, SighupIsLoggedAndTheAgentKeepsServing) {
  Subprocess::Options spawn;
  spawn.argv = {RunfilePath("daemon/rdma-agentd"),
                "--runtime_dir=" + dir_ + "/run",
                "--state_dir=" + dir_ + "/state", "--backends=memory"};
  spawn.pipe_stdio = true;
  spawn.stderr_to_stdout = true;
  auto daemon = Subprocess::Spawn(std::move(spawn));
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  ASSERT_TRUE(daemon->WaitForLine("serving unix://", absl::Seconds(30)).ok());

  daemon->Signal(SIGHUP);
  std::string logged;
  const absl::Status seen =
      daemon->WaitForLine("SIGHUP", absl::Seconds(10),
                          [&](const std::string& line) { logged = line; });
  ASSERT_TRUE(seen.ok()) << seen;
  EXPECT_THAT(logged, HasSubstr("SIGHUP received: nothing to reload; logs go "
                                "to stderr"));
  // At info, whichever log format names the level.
  EXPECT_TRUE(std::regex_search(logged, std::regex(R"(\binfo\b)"))) << logged;
  EXPECT_TRUE(daemon->Running());

  client::ConnectOptions options;
  options.target = "unix://" + Socket();
  auto agent = client::AgentClient::Connect(options);
  ASSERT_TRUE(agent.ok()) << agent.status();
  auto buffer = (*agent)->Allocate(4096, ::rdma::agent::v1::ACCESS_READ_WRITE);
  EXPECT_TRUE(buffer.ok()) << buffer.status();

  daemon->Signal(SIGTERM);
  auto code = daemon->Wait(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
}

}  // namespace
}  // namespace rdma_agent

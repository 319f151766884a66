// rdma-agentd as a process: flags and --flagfile, readiness, clean shutdown on
// SIGTERM and SIGINT (socket files removed), and refusal of bad flags.
#include <signal.h>
#include <sys/stat.h>

#include <fstream>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/rdma_agent_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/process.h"
#include "tests/testing/temp_dir.h"

namespace rdma_agent {
namespace {

using ::rdma_agent::testing::MakeShortTempDir;
using ::rdma_agent::testing::RemoveTree;
using ::rdma_agent::testing::RunfilePath;
using ::rdma_agent::testing::RunToCompletion;
using ::rdma_agent::testing::Subprocess;
using ::testing::HasSubstr;

bool Exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

class DaemonProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto dir = MakeShortTempDir();
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = *dir;
  }
  void TearDown() override { RemoveTree(dir_); }

  // Every run keeps its id under the test's dir, never in the host's
  // /var/lib/rdma-agentd (tests run as root).
  std::string StateDir() const { return dir_ + "/state"; }
  std::string StateFlag() const { return "--state_dir=" + StateDir(); }

  // Starts the daemon and waits until it says it serves.
  // `startup_line` (when set) receives the line that says it serves.
  Subprocess Start(std::vector<std::string> flags,
                   std::string* startup_line = nullptr) {
    Subprocess::Options options;
    options.argv = {RunfilePath("daemon/rdma-agentd")};
    for (auto& flag : flags) options.argv.push_back(std::move(flag));
    options.pipe_stdio = true;
    options.stderr_to_stdout = true;
    auto process = Subprocess::Spawn(std::move(options));
    EXPECT_TRUE(process.ok()) << process.status();
    const absl::Status serving = process->WaitForLine(
        "serving unix://", absl::Seconds(30), [&](const std::string& line) {
          if (startup_line != nullptr) *startup_line = line;
        });
    EXPECT_TRUE(serving.ok()) << "rdma-agentd did not start: " << serving;
    return std::move(*process);
  }

  std::string dir_;
};

TEST_F(DaemonProcessTest, FlagfileConfiguresAndSigtermCleansUp) {
  const std::string socket = dir_ + "/custom.sock";
  const std::string attach = dir_ + "/custom-attach.sock";
  const std::string flagfile = dir_ + "/agentd.flags";
  {
    std::ofstream out(flagfile);
    out << "--runtime_dir=" << dir_ << "\n"
        << StateFlag() << "\n"
        << "--socket=unix://" << socket << "\n"
        << "--attach_socket=" << attach << "\n"
        << "--agent_id=agent-from-flagfile\n"
        << "--backends=memory\n"
        << "--log_level=debug\n"
        // A connected client must not hold the shutdown for the grace.
        << "--shutdown_grace=10m\n";
  }
  Subprocess daemon = Start({"--flagfile=" + flagfile});
  EXPECT_TRUE(Exists(socket));
  EXPECT_TRUE(Exists(attach));
  struct stat st;
  ASSERT_EQ(::stat(socket.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0666u) << "every local user may connect";

  client::ConnectOptions options;
  options.target = "unix://" + socket;
  options.attach_socket = attach;
  auto agent = client::AgentClient::Connect(options);
  ASSERT_TRUE(agent.ok()) << agent.status();
  auto info = (*agent)->GetInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->agent_id(), "agent-from-flagfile");
  ASSERT_EQ(info->backends_size(), 1);
  EXPECT_EQ(info->backends(0).name(), "memory");
  auto buffer = (*agent)->Allocate(4096, ::rdma::agent::v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(buffer.ok()) << buffer.status();

  daemon.Signal(SIGTERM);
  auto code = daemon.Wait(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  EXPECT_FALSE(Exists(socket)) << "agent socket left behind";
  EXPECT_FALSE(Exists(attach)) << "attach socket left behind";
}

TEST_F(DaemonProcessTest, MaxTransferBytesPerRpcFlagIsHonoured) {
  Subprocess daemon =
      Start({"--runtime_dir=" + dir_, StateFlag(), "--backends=memory",
             "--max_transfer_bytes_per_rpc=4096"});
  client::ConnectOptions options;
  options.target = "unix://" + dir_ + "/agent.sock";
  options.attach_socket = dir_ + "/attach.sock";
  options.transfer_chunk_bytes = 8192;  // above the agent's limit
  auto agent = client::AgentClient::Connect(options);
  ASSERT_TRUE(agent.ok()) << agent.status();
  auto buffer = (*agent)->Allocate(16384, ::rdma::agent::v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(buffer.ok()) << buffer.status();

  auto too_big = (*agent)->ReadBuffer(buffer->id(), 0, 8192);
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(too_big.status().message(),
              HasSubstr("exceeds the limit of 4096 bytes per call"));
  auto at_limit = (*agent)->ReadBuffer(buffer->id(), 0, 4096);
  ASSERT_TRUE(at_limit.ok()) << at_limit.status();
  EXPECT_EQ(at_limit->size(), 4096u);

  daemon.Signal(SIGTERM);
  auto code = daemon.Wait(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
}

TEST_F(DaemonProcessTest, MaxTransferBytesPerRpcOutOfRangeIsRefused) {
  auto result = RunToCompletion(
      {RunfilePath("daemon/rdma-agentd"), "--runtime_dir=" + dir_, StateFlag(),
       "--backends=memory", "--max_transfer_bytes_per_rpc=0"},
      "", absl::Seconds(20));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->exit_code, 2);
  EXPECT_THAT(result->out + result->err,
              HasSubstr("--max_transfer_bytes_per_rpc"));
}

TEST_F(DaemonProcessTest, SigintStopsTooAndTheIdPersists) {
  Subprocess first =
      Start({"--runtime_dir=" + dir_, StateFlag(), "--backends=memory"});
  std::string id;
  {
    std::ifstream in(StateDir() + "/agent-id");
    std::getline(in, id);
  }
  EXPECT_THAT(id, HasSubstr("agent-"));
  first.Signal(SIGINT);
  auto code = first.Wait(absl::Seconds(20));
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 0);
  EXPECT_FALSE(Exists(dir_ + "/agent.sock"));

  Subprocess second =
      Start({"--runtime_dir=" + dir_, StateFlag(), "--backends=memory"});
  client::ConnectOptions options;
  options.target = "unix://" + dir_ + "/agent.sock";
  auto agent = client::AgentClient::Connect(options);
  ASSERT_TRUE(agent.ok()) << agent.status();
  auto info = (*agent)->GetInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->agent_id(), id);
  second.Signal(SIGTERM);
  EXPECT_TRUE(second.Wait(absl::Seconds(20)).ok());
}

std::string ReadFirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// What systemd does: StateDirectory= outlives the agent, RuntimeDirectory= is
// removed when it stops.
TEST_F(DaemonProcessTest, IdInTheStateDirSurvivesRemovingTheRuntimeDir) {
  const std::string runtime = dir_ + "/run";
  Subprocess first =
      Start({"--runtime_dir=" + runtime, StateFlag(), "--backends=memory"});
  const std::string id = ReadFirstLine(StateDir() + "/agent-id");
  EXPECT_THAT(id, HasSubstr("agent-"));
  EXPECT_FALSE(Exists(runtime + "/agent-id"));
  first.Signal(SIGTERM);
  auto code = first.Wait(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  RemoveTree(runtime);

  Subprocess second =
      Start({"--runtime_dir=" + runtime, StateFlag(), "--backends=memory"});
  client::ConnectOptions options;
  options.target = "unix://" + runtime + "/agent.sock";
  auto agent = client::AgentClient::Connect(options);
  ASSERT_TRUE(agent.ok()) << agent.status();
  auto info = (*agent)->GetInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->agent_id(), id);
  second.Signal(SIGTERM);
  EXPECT_TRUE(second.Wait(absl::Seconds(20)).ok());
}

TEST_F(DaemonProcessTest, IdLeftInTheRuntimeDirMovesToTheStateDir) {
  {
    std::ofstream out(dir_ + "/agent-id");
    out << "agent-from-an-earlier-version\n";
  }
  Subprocess daemon = Start({"--runtime_dir=" + dir_, StateFlag(),
                             "--backends=memory", "--log_level=debug"});
  EXPECT_EQ(ReadFirstLine(StateDir() + "/agent-id"),
            "agent-from-an-earlier-version");
  EXPECT_FALSE(Exists(dir_ + "/agent-id")) << "read once, then removed";
  client::ConnectOptions options;
  options.target = "unix://" + dir_ + "/agent.sock";
  auto agent = client::AgentClient::Connect(options);
  ASSERT_TRUE(agent.ok()) << agent.status();
  auto info = (*agent)->GetInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->agent_id(), "agent-from-an-earlier-version");
  daemon.Signal(SIGTERM);
  EXPECT_TRUE(daemon.Wait(absl::Seconds(20)).ok());
}

TEST_F(DaemonProcessTest, UnusableStateDirFallsBackToTheRuntimeDir) {
  // Not even root can create a directory under a regular file.
  const std::string file = dir_ + "/a-file";
  std::ofstream(file) << "x";
  Subprocess::Options spawn;
  spawn.argv = {RunfilePath("daemon/rdma-agentd"), "--runtime_dir=" + dir_,
                "--state_dir=" + file + "/state", "--backends=memory"};
  spawn.pipe_stdio = true;
  spawn.stderr_to_stdout = true;
  auto daemon = Subprocess::Spawn(std::move(spawn));
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  std::string warning;
  ASSERT_TRUE(daemon
                  ->WaitForLine("serving unix://", absl::Seconds(30),
                                [&](const std::string& line) {
                                  if (absl::StrContains(line, "state dir")) {
                                    warning = line;
                                  }
                                })
                  .ok());
  EXPECT_THAT(warning, HasSubstr("warning"));  // the level, in any log format
  EXPECT_THAT(warning, HasSubstr(file + "/state"));
  EXPECT_THAT(warning, HasSubstr("runtime dir " + dir_));
  EXPECT_THAT(ReadFirstLine(dir_ + "/agent-id"), HasSubstr("agent-"));
  daemon->Signal(SIGTERM);
  auto code = daemon->Wait(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
}

// Two agents sharing a state dir would share an agent id.
TEST_F(DaemonProcessTest, SecondAgentOnTheSameStateDirRefuses) {
  const std::string one = dir_ + "/one";
  const std::string two = dir_ + "/two";
  Subprocess first =
      Start({"--runtime_dir=" + one, StateFlag(), "--backends=memory"});
  auto second = RunToCompletion(
      {RunfilePath("daemon/rdma-agentd"), "--runtime_dir=" + two, StateFlag(),
       "--backends=memory"},
      "", absl::Seconds(20));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->exit_code, 1);
  EXPECT_THAT(
      second->out + second->err,
      HasSubstr(absl::StrCat("another rdma-agentd (pid ", first.pid(),
                             ") already keeps its agent id in ", StateDir())));
  EXPECT_THAT(second->out + second->err, HasSubstr("--state_dir"));
  first.Signal(SIGTERM);
  EXPECT_TRUE(first.Wait(absl::Seconds(20)).ok());
}

TEST_F(DaemonProcessTest, UnknownLogLevelIsRefusedOnStderrListingTheValidOnes) {
  auto result = RunToCompletion(
      {RunfilePath("daemon/rdma-agentd"), "--runtime_dir=" + dir_, StateFlag(),
       "--backends=memory", "--log_level=verbose"},
      "", absl::Seconds(20));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->exit_code, 2);
  EXPECT_EQ(result->out, "") << "logs go to stderr";
  EXPECT_THAT(result->err, HasSubstr("unknown level \"verbose\""));
  EXPECT_THAT(result->err, HasSubstr("trace, debug, info, warn"));
  EXPECT_FALSE(Exists(dir_ + "/agent.sock"));
}

TEST_F(DaemonProcessTest, StartupLineSaysVersionPortsBoundBackendsAndFlags) {
  std::string startup;
  Subprocess::Options options;
  options.argv = {RunfilePath("daemon/rdma-agentd"),
                  "--runtime_dir=" + dir_,
                  StateFlag(),
                  "--backends=memory,tcp",
                  "--tcp_listen=127.0.0.1:0",
                  "--log_level=WARNING",
                  "--log_format=journal"};
  options.pipe_stdio = true;
  options.stderr_to_stdout = true;
  auto daemon = Subprocess::Spawn(std::move(options));
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  // At warning level the startup line is not logged: wait for the socket.
  for (int i = 0; i < 300 && !Exists(dir_ + "/agent.sock"); ++i) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  daemon->Signal(SIGTERM);
  ASSERT_TRUE(daemon->Wait(absl::Seconds(20)).ok());
  // WARNING was accepted (not silently "off"), and no info line came out.
  while (true) {
    auto line = daemon->ReadLine(absl::Seconds(5));
    if (!line.ok()) break;
    EXPECT_FALSE(absl::StartsWith(*line, "<6>")) << *line;
  }

  std::string line;
  Subprocess info =
      Start({"--runtime_dir=" + dir_, StateFlag(), "--backends=memory,tcp",
             "--tcp_listen=127.0.0.1:0", "--log_format=journal"},
            &line);
  client::ConnectOptions connect;
  connect.target = "unix://" + dir_ + "/agent.sock";
  auto agent = client::AgentClient::Connect(connect);
  ASSERT_TRUE(agent.ok()) << agent.status();
  auto got = (*agent)->GetInfo();
  ASSERT_TRUE(got.ok()) << got.status();
  std::string tcp_address;
  for (const auto& backend : got->backends()) {
    if (backend.name() == "tcp") {
      ASSERT_EQ(backend.transport_info().addresses_size(), 1);
      tcp_address = backend.transport_info().addresses(0);
    }
  }
  // The port bound, on the address bound (not the default-route host).
  EXPECT_TRUE(absl::StartsWith(tcp_address, "127.0.0.1:")) << tcp_address;
  EXPECT_NE(tcp_address, "127.0.0.1:0");
  EXPECT_TRUE(absl::StartsWith(line, "<6>rdma-agentd " + got->version()))
      << line;
  EXPECT_THAT(line, HasSubstr("tcp at " + tcp_address));
  EXPECT_THAT(line, HasSubstr(absl::StrCat(" epoch ", got->epoch(), " ")))
      << "the epoch in decimal, as GetInfo gives it";
  EXPECT_THAT(line, HasSubstr("--backends=memory,tcp"));
  EXPECT_THAT(line, HasSubstr("--tcp_listen=127.0.0.1:0"));
  EXPECT_THAT(line, ::testing::Not(HasSubstr("--max_rpcs=")))
      << "flags left at their defaults are not listed";
  info.Signal(SIGTERM);
  EXPECT_TRUE(info.Wait(absl::Seconds(20)).ok());
}

TEST_F(DaemonProcessTest, UnknownBackendIsRefusedAtStart) {
  auto result = RunToCompletion(
      {RunfilePath("daemon/rdma-agentd"), "--runtime_dir=" + dir_, StateFlag(),
       "--backends=memory,carrier-pigeon"},
      "", absl::Seconds(20));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->exit_code, 2);
  EXPECT_THAT(result->out + result->err, HasSubstr("carrier-pigeon"));
  EXPECT_FALSE(Exists(dir_ + "/agent.sock"));
}

TEST_F(DaemonProcessTest, UnusableSocketPathIsAClearError) {
  auto result = RunToCompletion(
      {RunfilePath("daemon/rdma-agentd"), "--runtime_dir=" + dir_, StateFlag(),
       "--backends=memory", "--socket=" + dir_ + "/" + std::string(200, 's')},
      "", absl::Seconds(20));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->exit_code, 1);
  EXPECT_THAT(result->out + result->err, HasSubstr("longer than"));
}

TEST_F(DaemonProcessTest, SecondAgentOnTheSameRuntimeDirRefusesAndFirstServes) {
  Subprocess first =
      Start({"--runtime_dir=" + dir_, StateFlag(), "--backends=memory"});
  client::ConnectOptions options;
  options.target = "unix://" + dir_ + "/agent.sock";
  auto agent = client::AgentClient::Connect(options);
  ASSERT_TRUE(agent.ok()) << agent.status();
  auto buffer = (*agent)->Allocate(4096, ::rdma::agent::v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(buffer.ok()) << buffer.status();

  auto second = RunToCompletion(
      {RunfilePath("daemon/rdma-agentd"), "--runtime_dir=" + dir_, StateFlag(),
       "--backends=memory"},
      "", absl::Seconds(20));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->exit_code, 1);
  EXPECT_THAT(second->out + second->err,
              HasSubstr(absl::StrCat("another rdma-agentd (pid ", first.pid(),
                                     ") already serves ", dir_)));

  // The first one's sockets were left alone: it still serves the same
  // registrations, on a fresh connection too.
  EXPECT_TRUE(Exists(dir_ + "/agent.sock"));
  EXPECT_TRUE(Exists(dir_ + "/attach.sock"));
  auto again = client::AgentClient::Connect(options);
  ASSERT_TRUE(again.ok()) << again.status();
  auto listed = (*again)->ListBuffers();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].buffer_id(), buffer->id());

  first.Signal(SIGTERM);
  auto code = first.Wait(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
}

TEST_F(DaemonProcessTest, LiveSocketOfAnotherRuntimeDirIsNotTakenOver) {
  const std::string other = dir_ + "/other";
  ASSERT_EQ(::mkdir(other.c_str(), 0755), 0);
  Subprocess first =
      Start({"--runtime_dir=" + dir_, StateFlag(), "--backends=memory"});
  auto second =
      RunToCompletion({RunfilePath("daemon/rdma-agentd"),
                       "--runtime_dir=" + other, "--state_dir=" + other,
                       "--socket=" + dir_ + "/agent.sock", "--backends=memory"},
                      "", absl::Seconds(20));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->exit_code, 1);
  EXPECT_THAT(second->out + second->err,
              HasSubstr("is in use by a running process"));

  client::ConnectOptions options;
  options.target = "unix://" + dir_ + "/agent.sock";
  auto agent = client::AgentClient::Connect(options);
  ASSERT_TRUE(agent.ok()) << agent.status();
  EXPECT_TRUE((*agent)->GetInfo().ok());
  first.Signal(SIGTERM);
  EXPECT_TRUE(first.Wait(absl::Seconds(20)).ok());
}

TEST_F(DaemonProcessTest, KilledAgentsStaleSocketsAreReplaced) {
  Subprocess first =
      Start({"--runtime_dir=" + dir_, StateFlag(), "--backends=memory"});
  first.Signal(SIGKILL);
  ASSERT_TRUE(first.Wait(absl::Seconds(20)).ok());
  ASSERT_TRUE(Exists(dir_ + "/agent.sock")) << "SIGKILL leaves its sockets";

  Subprocess second =
      Start({"--runtime_dir=" + dir_, StateFlag(), "--backends=memory"});
  client::ConnectOptions options;
  options.target = "unix://" + dir_ + "/agent.sock";
  options.attach_socket = dir_ + "/attach.sock";
  auto agent = client::AgentClient::Connect(options);
  ASSERT_TRUE(agent.ok()) << agent.status();
  auto buffer = (*agent)->Allocate(4096, ::rdma::agent::v1::ACCESS_READ_WRITE);
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  second.Signal(SIGTERM);
  EXPECT_TRUE(second.Wait(absl::Seconds(20)).ok());
}

TEST_F(DaemonProcessTest, SocketOutsideTheRuntimeDirGetsItsAttachSocketBeside) {
  const std::string runtime = dir_ + "/run";
  const std::string sockets = dir_ + "/sockets";
  ASSERT_EQ(::mkdir(sockets.c_str(), 0755), 0);
  Subprocess daemon =
      Start({"--runtime_dir=" + runtime, StateFlag(),
             "--socket=" + sockets + "/agent.sock", "--backends=memory"});
  EXPECT_TRUE(Exists(sockets + "/attach.sock"));
  EXPECT_FALSE(Exists(runtime + "/attach.sock"));
  // A client that knows only the API socket finds the attach socket.
  client::ConnectOptions options;
  options.target = "unix://" + sockets + "/agent.sock";
  auto agent = client::AgentClient::Connect(options);
  ASSERT_TRUE(agent.ok()) << agent.status();
  auto buffer = (*agent)->Allocate(4096, ::rdma::agent::v1::ACCESS_READ_WRITE);
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  daemon.Signal(SIGTERM);
  EXPECT_TRUE(daemon.Wait(absl::Seconds(20)).ok());
}

}  // namespace
}  // namespace rdma_agent

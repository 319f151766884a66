// Strangers flooding a real rdma-agentd's tcp data plane with idle
// connections, the agent running with the common 1024 soft fd limit. The
// flood comes from 127.0.0.2/127.0.0.3 and the legitimate peer agent from
// 127.0.0.1: on loopback they are distinct sources, as distinct hosts would
// be, so no network namespace is needed.
//
// What must hold: a peer agent still moves bytes (every byte checked) during
// the flood; the agent does not spin (its CPU time from /proc/PID/stat stays
// low); its fds return to near baseline once the attacker leaves; its log
// gets a few lines, not one per connection.

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/rdma_agent_client.h"
#include "common/unique_fd.h"
#include "gtest/gtest.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/pattern.h"

namespace rdma_agent::testing {
namespace {

namespace v1 = ::rdma::agent::v1;

constexpr int kFloodConnections = 4200;
// The soft fd limit the attacked agent runs with (a common default).
constexpr rlim_t kAgentFdLimit = 1024;
// Bytes the peer writes and reads back through the attacked agent.
constexpr uint64_t kTransferBytes = 8ull << 20;
// How many more fds than before the flood the agent may keep: the peer's
// pooled data connections (2 by default) and slack.
constexpr int kFdSlack = 6;

// True once `condition` holds, polled every 50 ms for at most `timeout`.
bool WaitFor(const std::function<bool()>& condition, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!condition()) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return true;
}

// Open fds of process `pid` (-1 if unreadable).
int OpenFds(pid_t pid) {
  DIR* dir = opendir(absl::StrCat("/proc/", pid, "/fd").c_str());
  if (dir == nullptr) return -1;
  int count = 0;
  while (dirent* entry = readdir(dir)) {
    if (entry->d_name[0] != '.') ++count;
  }
  closedir(dir);
  return count;
}

// User plus system CPU time of process `pid`, from /proc/PID/stat.
absl::Duration CpuTime(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::stringstream text;
  text << in.rdbuf();
  const std::string stat = text.str();
  // Fields after the command name (which may hold spaces) in parentheses;
  // utime and stime are fields 14 and 15 of the whole line.
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return absl::InfiniteDuration();
  std::vector<std::string> fields =
      absl::StrSplit(stat.substr(close + 2), ' ', absl::SkipEmpty());
  if (fields.size() < 13) return absl::InfiniteDuration();
  const double ticks = std::stod(fields[11]) + std::stod(fields[12]);
  return absl::Seconds(ticks / static_cast<double>(sysconf(_SC_CLK_TCK)));
}

// Lines of `log` that contain `text`.
int CountLines(const std::string& log, absl::string_view text) {
  int count = 0;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    if (absl::StrContains(line, text)) ++count;
  }
  return count;
}

// An attacker holding idle TCP connections to 127.0.0.1:port, spread over
// `sources`; it sends nothing. Closes them all when destroyed.
class Flood {
 public:
  Flood(uint16_t port, int connections,
        const std::vector<std::string>& sources) {
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(port);
    inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
    for (int i = 0; i < connections; ++i) {
      UniqueFd fd(
          socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
      if (!fd) {
        error_ = absl::StrCat("socket: ", std::strerror(errno));
        return;
      }
      sockaddr_in from{};
      from.sin_family = AF_INET;
      inet_pton(AF_INET, sources[i % sources.size()].c_str(), &from.sin_addr);
      if (bind(fd.get(), reinterpret_cast<sockaddr*>(&from), sizeof(from)) !=
          0) {
        error_ = absl::StrCat("bind: ", std::strerror(errno));
        return;
      }
      if (connect(fd.get(), reinterpret_cast<sockaddr*>(&to), sizeof(to)) !=
              0 &&
          errno != EINPROGRESS) {
        error_ = absl::StrCat("connect: ", std::strerror(errno));
        return;
      }
      fds_.push_back(std::move(fd));
    }
  }

  // Empty when every connection was started.
  const std::string& error() const { return error_; }

  // Connections whose TCP handshake completed (bounded wait): the kernel
  // completes them on the agent's behalf whatever the agent then does.
  int Established(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    int established = 0;
    for (const UniqueFd& fd : fds_) {
      pollfd p{fd.get(), POLLOUT, 0};
      const absl::Duration left =
          std::max(deadline - absl::Now(), absl::ZeroDuration());
      if (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(left))) != 1) {
        continue;
      }
      int error = 0;
      socklen_t length = sizeof(error);
      getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &error, &length);
      if (error == 0) ++established;
    }
    return established;
  }

 private:
  std::vector<UniqueFd> fds_;
  std::string error_;
};

client::OpSpec Op(v1::OpType type, const client::Buffer& local,
                  uint64_t local_offset, const client::Buffer& remote) {
  client::OpSpec op;
  op.type = type;
  op.local_buffer_id = local.id();
  op.local_offset = local_offset;
  op.length = kTransferBytes;
  op.remote_context = remote.remote_context();
  op.remote_offset = 0;
  return op;
}

class DataServerAttackTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // The attacker needs more than 4,200 fds of this process.
    ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &limit_), 0);
    ASSERT_GE(limit_.rlim_max, static_cast<rlim_t>(kFloodConnections + 512))
        << "the hard fd limit is too low for the flood";
    rlimit raised = limit_;
    raised.rlim_cur = limit_.rlim_max;
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &raised), 0);
  }

  void TearDown() override {
    if (HasFailure()) {
      if (victim_) ADD_FAILURE() << "attacked agent's log:\n" << victim_->Log();
      if (peer_) ADD_FAILURE() << "peer agent's log:\n" << peer_->Log();
    }
    // Buffers first: releasing them needs their agents' clients.
    remote_.reset();
    local_.reset();
    victim_.reset();
    peer_.reset();
    setrlimit(RLIMIT_NOFILE, &limit_);
  }

  static AgentProcess::Options TcpAgent() {
    AgentProcess::Options options;
    options.backends = "memory,tcp";
    options.listen_host = "127.0.0.1";
    options.advertise_host = "127.0.0.1";
    options.log_level = "info";
    return options;
  }

  // Starts the agent to attack with kAgentFdLimit as its soft fd limit (it
  // inherits this process's at spawn, as under `prlimit --nofile=1024:...`),
  // and the peer agent with this process's.
  void StartAgents(std::vector<std::string> victim_flags = {}) {
    rlimit current{};
    ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &current), 0);
    rlimit lowered = current;
    lowered.rlim_cur = kAgentFdLimit;
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &lowered), 0);
    AgentProcess::Options options = TcpAgent();
    options.extra_flags = std::move(victim_flags);
    // The agent raises its soft limit to the hard one unless told not to.
    options.extra_flags.push_back(
        absl::StrCat("--open_files_limit=", kAgentFdLimit));
    auto victim = AgentProcess::Start(options);
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &current), 0);
    ASSERT_TRUE(victim.ok()) << victim.status();
    victim_ = std::move(*victim);
    auto peer = AgentProcess::Start(TcpAgent());
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = std::move(*peer);

    auto remote = victim_->client().Attach(kTransferBytes,
                                           v1::ACCESS_READ_WRITE, "attacked");
    ASSERT_TRUE(remote.ok()) << remote.status();
    remote_ = std::make_unique<client::Buffer>(std::move(*remote));
    auto local = peer_->client().Attach(2 * kTransferBytes,
                                        v1::ACCESS_READ_WRITE, "peer");
    ASSERT_TRUE(local.ok()) << local.status();
    local_ = std::make_unique<client::Buffer>(std::move(*local));
  }

  // The peer writes a pattern into the attacked agent's buffer and reads
  // another back over tcp; every byte of both is checked.
  void ExpectPeerMovesBytes(uint64_t seed) {
    FillPattern(local_->bytes().subspan(0, kTransferBytes), seed);
    auto results = peer_->client().Submit(
        {Op(v1::OP_TYPE_WRITE_FROM_LOCAL, *local_, 0, *remote_)},
        absl::Seconds(20));
    ASSERT_TRUE(results.ok()) << results.status();
    ASSERT_TRUE((*results)[0].status.ok()) << (*results)[0].status;
    EXPECT_EQ((*results)[0].backend, "tcp");
    EXPECT_EQ(FindMismatch(remote_->bytes(), seed), std::nullopt)
        << "the write did not land intact";

    FillPattern(remote_->bytes(), seed + 1);
    results = peer_->client().Submit(
        {Op(v1::OP_TYPE_READ_INTO_LOCAL, *local_, kTransferBytes, *remote_)},
        absl::Seconds(20));
    ASSERT_TRUE(results.ok()) << results.status();
    ASSERT_TRUE((*results)[0].status.ok()) << (*results)[0].status;
    EXPECT_EQ(FindMismatch(local_->bytes().subspan(kTransferBytes), seed + 1),
              std::nullopt)
        << "the read did not land intact";
  }

  rlimit limit_{};
  std::unique_ptr<AgentProcess> victim_;
  std::unique_ptr<AgentProcess> peer_;
  std::unique_ptr<client::Buffer> remote_;  // on the attacked agent
  std::unique_ptr<client::Buffer> local_;   // on the peer
};

TEST_F(DataServerAttackTest, IdleFloodLocksOutNoPeerAndCostsLittle) {
  ASSERT_NO_FATAL_FAILURE(StartAgents());
  // The cap follows the fd limit the agent runs with: 1024 / 4.
  ASSERT_TRUE(absl::StrContains(victim_->Log(), "at most 256 connections"))
      << "the agent does not run with a 1024 fd limit";
  const pid_t pid = victim_->pid();
  const int fds_before = OpenFds(pid);
  const absl::Duration cpu_before = CpuTime(pid);
  const absl::Time start = absl::Now();

  auto flood = std::make_unique<Flood>(
      victim_->tcp_port(), kFloodConnections,
      std::vector<std::string>{"127.0.0.2", "127.0.0.3"});
  ASSERT_EQ(flood->error(), "");
  const int established = flood->Established(absl::Seconds(5));
  EXPECT_GT(established, kFloodConnections * 9 / 10)
      << "the flood did not reach the agent";
  // While the attacker holds its connections, a peer dials afresh and moves
  // bytes.
  ASSERT_NO_FATAL_FAILURE(ExpectPeerMovesBytes(7));
  // Hold the flood a few seconds in all: refusing and timing out strangers
  // must cost a fraction of one core, not a spinning one.
  absl::SleepFor(
      std::max(absl::Seconds(4) - (absl::Now() - start), absl::ZeroDuration()));
  const absl::Duration cpu = CpuTime(pid) - cpu_before;
  const absl::Duration wall = absl::Now() - start;
  EXPECT_LT(cpu, wall / 4) << "agent CPU " << cpu << " in " << wall;
  std::cout << "flood of " << established << " connections: agent CPU " << cpu
            << " in " << wall << ", " << OpenFds(pid) << " fds (" << fds_before
            << " before)\n";

  flood.reset();  // the attacker leaves
  EXPECT_TRUE(WaitFor([&] { return OpenFds(pid) <= fds_before + kFdSlack; },
                      absl::Seconds(20)))
      << OpenFds(pid) << " fds open, " << fds_before << " before the flood";
  ASSERT_NO_FATAL_FAILURE(ExpectPeerMovesBytes(9));

  // A few lines per second of attack, not one per connection.
  const std::string log = victim_->Log();
  EXPECT_GT(CountLines(log, "refused a connection from 127.0.0."), 0);
  EXPECT_LT(CountLines(log, "tcp data plane:"), 40) << "the log is flooded";
  EXPECT_LT(CountLines(log, "\n"), 200);
}

TEST_F(DataServerAttackTest, OutOfFdsTheAgentBacksOffAndRecovers) {
  // Caps above what the fds allow and a long handshake: the flood exhausts
  // the agent's fds and keeps them, so accept fails with EMFILE throughout.
  ASSERT_NO_FATAL_FAILURE(
      StartAgents({"--tcp_max_connections=100000",
                   "--tcp_max_connections_per_source=100000",
                   "--tcp_handshake_timeout=120s"}));
  const pid_t pid = victim_->pid();
  const int fds_before = OpenFds(pid);

  auto flood = std::make_unique<Flood>(victim_->tcp_port(), kFloodConnections,
                                       std::vector<std::string>{"127.0.0.2"});
  ASSERT_EQ(flood->error(), "");
  ASSERT_TRUE(WaitFor(
      [&] {
        return OpenFds(pid) >= static_cast<int>(kAgentFdLimit) - 16 &&
               absl::StrContains(victim_->Log(), "Too many open files");
      },
      absl::Seconds(20)))
      << "the agent's fds were not exhausted: " << OpenFds(pid);
  const absl::Duration cpu_before = CpuTime(pid);
  const absl::Time start = absl::Now();
  absl::SleepFor(absl::Seconds(3));
  const absl::Duration cpu = CpuTime(pid) - cpu_before;
  const absl::Duration wall = absl::Now() - start;
  EXPECT_LT(cpu, wall / 10) << "the agent spins: CPU " << cpu << " in " << wall;
  std::cout << "out of fds: agent CPU " << cpu << " in " << wall << ", "
            << OpenFds(pid) << " fds (" << fds_before << " before)\n";

  flood.reset();  // fds come back as the strangers' connections end
  EXPECT_TRUE(WaitFor([&] { return OpenFds(pid) <= fds_before + kFdSlack; },
                      absl::Seconds(30)))
      << OpenFds(pid) << " fds open, " << fds_before << " before the flood";
  ASSERT_NO_FATAL_FAILURE(ExpectPeerMovesBytes(11));
  // At most a line a second about accept failing.
  const absl::Duration attacked = absl::Now() - start + absl::Seconds(20);
  EXPECT_LE(CountLines(victim_->Log(), "Too many open files"),
            absl::ToInt64Seconds(attacked) + 2);
}

}  // namespace
}  // namespace rdma_agent::testing

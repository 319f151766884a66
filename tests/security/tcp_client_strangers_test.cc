// A forged remote context cannot turn the agent into a deputy: it never
// sends a byte to an endpoint that is not an rdma-agentd, its errors do not
// tell open ports from closed ones, connections to fake peers do not pile
// up, and host names neither stall it nor get resolved unless allowed.
// Real rdma-agentd processes; the host-name case runs one in a network
// namespace (root).

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "backends/tcp/client_test_peer.h"
#include "gtest/gtest.h"
#include "tests/integration/netns.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/process.h"

namespace rdma_agent::testing {
namespace {

using ::rdma_agent::tcp::testing::ClosedPort;
using ::rdma_agent::tcp::testing::ContextFor;
using ::rdma_agent::tcp::testing::ScriptedPeer;
using Behavior = ScriptedPeer::Behavior;
namespace v1 = ::rdma::agent::v1;

AgentProcess::Options AgentOptions(std::vector<std::string> flags = {}) {
  AgentProcess::Options options;
  options.backends = "memory,tcp";
  options.log_level = "info";
  options.extra_flags = std::move(flags);
  return options;
}

client::OpSpec ForgedOp(uint64_t local_id, const std::string& host,
                        uint16_t port) {
  client::OpSpec op;
  op.type = v1::OP_TYPE_WRITE_FROM_LOCAL;
  op.local_buffer_id = local_id;
  op.length = 4096;
  op.remote_context = ContextFor(host, port, 1 << 20)->SerializeAsString();
  return op;
}

int OpenFdsOf(pid_t pid) {
  DIR* dir = opendir(absl::StrCat("/proc/", pid, "/fd").c_str());
  if (dir == nullptr) return -1;
  int count = 0;
  while (dirent* entry = readdir(dir)) {
    if (entry->d_name[0] != '.') ++count;
  }
  closedir(dir);
  return count;
}

template <typename Condition>
bool Eventually(Condition condition, absl::Duration limit) {
  const absl::Time end = absl::Now() + limit;
  while (!condition()) {
    if (absl::Now() > end) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return true;
}

// Problem 8: the old client dialled whatever a context named and sent its
// request (header, then the caller-chosen token: here an HTTP request) at
// once, and its errors told refused from timed out from "not an agent".
TEST(TcpClientStrangersTest, NonAgentsReceiveNothingAndReadLikeClosedPorts) {
  auto agent =
      AgentProcess::Start(AgentOptions({"--tcp_client_connect_timeout=500ms"}));
  ASSERT_TRUE(agent.ok()) << agent.status();
  auto local =
      (*agent)->client().AllocateUnmapped(1 << 20, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(local.ok()) << local.status();
  ScriptedPeer http_like(Behavior::kSilent);
  ScriptedPeer smtp_like(Behavior::kBanner);
  const uint16_t closed = ClosedPort();
  const uint16_t ports[] = {http_like.port(), smtp_like.port(), closed};
  std::vector<client::OpSpec> ops;
  for (uint16_t port : ports) {
    ops.push_back(ForgedOp(local->id, "127.0.0.1", port));
  }
  auto results = (*agent)->client().Submit(ops, absl::Seconds(10));
  ASSERT_TRUE(results.ok()) << results.status();
  std::vector<std::string> shapes;
  for (size_t i = 0; i < ops.size(); ++i) {
    const absl::Status& status = (*results)[i].status;
    EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
    shapes.push_back(absl::StrReplaceAll(
        status.message(), {{absl::StrCat("op ", i, ":"), "op N:"},
                           {absl::StrCat(":", ports[i]), ":PORT"}}));
  }
  EXPECT_EQ(shapes[0], "op N: peer 127.0.0.1:PORT is unreachable");
  EXPECT_EQ(shapes[1], shapes[0]);
  EXPECT_EQ(shapes[2], shapes[0]);
  EXPECT_TRUE(Eventually(
      [&] {
        return http_like.closed_by_client() > 0 &&
               smtp_like.closed_by_client() > 0;
      },
      absl::Seconds(5)));
  EXPECT_EQ(http_like.bytes_received(), 0u);
  EXPECT_EQ(smtp_like.bytes_received(), 0u);
}

// Problem 8, the pool: one idle fd per distinct peer, kept forever.
TEST(TcpClientStrangersTest, FdsOfThreeHundredFakePeersGoAway) {
  auto agent = AgentProcess::Start(
      AgentOptions({"--tcp_client_idle_timeout=1s",
                    "--tcp_client_max_idle_connections=32"}));
  ASSERT_TRUE(agent.ok()) << agent.status();
  auto local =
      (*agent)->client().AllocateUnmapped(1 << 20, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(local.ok()) << local.status();
  // Fake agents: hello, then every request refused; the connections are
  // healthy, so the agent pools them.
  ScriptedPeer fake(Behavior::kRefuseAll, "0.0.0.0");
  const pid_t pid = (*agent)->pid();
  const int baseline = OpenFdsOf(pid);
  ASSERT_GT(baseline, 0);
  std::vector<client::OpSpec> ops;
  for (int i = 0; i < 300; ++i) {
    ops.push_back(ForgedOp(
        local->id, absl::StrCat("127.0.", 20 + i / 250, ".", 1 + i % 250),
        fake.port()));
  }
  auto results = (*agent)->client().Submit(ops, absl::Seconds(30));
  ASSERT_TRUE(results.ok()) << results.status();
  for (const auto& result : *results) {
    EXPECT_EQ(result.status.code(), absl::StatusCode::kNotFound)
        << result.status;
  }
  EXPECT_EQ(fake.accepted(), 300);
  EXPECT_LE(OpenFdsOf(pid), baseline + 32 + 8) << "idle pool not bounded";
  EXPECT_TRUE(Eventually([&] { return OpenFdsOf(pid) <= baseline + 2; },
                         absl::Seconds(10)))
      << OpenFdsOf(pid) << " fds, baseline " << baseline;
}

// Problem 9: a host name in a context was resolved with a blocking
// getaddrinfo, so a 1 s Submit returned after 10 s when DNS hung.
TEST(TcpClientStrangersTest, HostNamesAreRefusedOrResolvedWithinTheDeadline) {
  ASSERT_TRUE(CheckNetnsPrivileges().ok()) << CheckNetnsPrivileges();
  auto pair = NetnsPair::Create();
  ASSERT_TRUE(pair.ok()) << pair.status();
  const std::string netns = (*pair)->netns(0);
  // The namespace's resolver is an address whose packets vanish (a
  // neighbour entry for a MAC nobody has): every lookup hangs for the
  // resolver's full timeout.
  const std::string etc = absl::StrCat("/etc/netns/", netns);
  ASSERT_EQ(mkdir("/etc/netns", 0755) == 0 || errno == EEXIST, true);
  ASSERT_EQ(mkdir(etc.c_str(), 0755), 0) << std::strerror(errno);
  {
    std::ofstream resolv(etc + "/resolv.conf");
    resolv << "nameserver 10.77.0.99\noptions timeout:5 attempts:2\n";
  }
  ASSERT_TRUE(RunCommand({"ip", "netns", "exec", netns, "ip", "neigh", "add",
                          "10.77.0.99", "lladdr", "02:00:00:00:00:99", "dev",
                          (*pair)->link(0), "nud", "permanent"})
                  .ok());

  const std::string name = "peer.rdma-agent-test.invalid";
  for (bool allow : {false, true}) {
    SCOPED_TRACE(allow ? "--tcp_allow_host_names" : "names refused");
    AgentProcess::Options options = AgentOptions(
        {absl::StrCat("--tcp_allow_host_names=", allow ? "true" : "false")});
    options.netns = netns;
    options.listen_host = (*pair)->address(0);
    options.advertise_host = (*pair)->address(0);
    auto agent = AgentProcess::Start(options);
    ASSERT_TRUE(agent.ok()) << agent.status();
    auto local =
        (*agent)->client().AllocateUnmapped(1 << 20, v1::ACCESS_READ_WRITE);
    ASSERT_TRUE(local.ok()) << local.status();
    const absl::Time start = absl::Now();
    auto results = (*agent)->client().Submit({ForgedOp(local->id, name, 7471)},
                                             absl::Seconds(1));
    const absl::Duration took = absl::Now() - start;
    ASSERT_TRUE(results.ok()) << results.status();
    const absl::Status& status = (*results)[0].status;
    if (allow) {
      EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
      EXPECT_LT(took, absl::Milliseconds(1500));
    } else {
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
      EXPECT_TRUE(absl::StrContains(status.message(), "op 0:")) << status;
      EXPECT_TRUE(absl::StrContains(status.message(), "--tcp_allow_host_names"))
          << status;
      EXPECT_LT(took, absl::Milliseconds(500));
    }
    // Still answering at once while the lookup may linger in the background.
    const absl::Time ping = absl::Now();
    EXPECT_TRUE((*agent)->client().GetInfo().ok());
    EXPECT_LT(absl::Now() - ping, absl::Milliseconds(500));
  }
  std::remove((etc + "/resolv.conf").c_str());
  rmdir(etc.c_str());
}

}  // namespace
}  // namespace rdma_agent::testing

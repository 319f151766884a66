// A 3-member etcd cluster (three real etcd processes, each alone in a
// network namespace, a "host" of its own) whose leader is killed with
// SIGKILL while two real agents, on two more hosts of the same switch,
// publish names, resolve them and move bytes by name: no client sees an
// error, and both agents stay published. Needs root (network namespaces).
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/rdma_agent_client.h"
#include "common/grpc_status.h"
#include "gmock/gmock.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "rdma/agent/v1/agent.grpc.pb.h"
#include "tests/directory/name_calls.h"
#include "tests/integration/netns.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/etcd_cluster.h"
#include "tests/testing/eventually.h"

namespace rdma_agent {
namespace {

namespace v1 = ::rdma::agent::v1;

using ::rdma_agent::testing::AgentProcess;
using ::rdma_agent::testing::CheckNetnsPrivileges;
using ::rdma_agent::testing::EtcdCluster;
using ::rdma_agent::testing::Eventually;
using ::rdma_agent::testing::NetnsSwitch;
using ::rdma_agent::testing::ReadByNameOp;
using ::rdma_agent::testing::RegisterNamed;
using ::rdma_agent::testing::SubmitOne;
using ::rdma_agent::testing::TcpAgentOptions;
using ::testing::IsEmpty;

constexpr absl::Duration kPatience = absl::Seconds(20);
constexpr int kMembers = 3;
// Hosts 0..2 run the members, 3 and 4 the agents.
constexpr int kAgentA = kMembers;
constexpr int kAgentB = kMembers + 1;

absl::StatusOr<v1::RegisterResponse> Register(AgentProcess& agent,
                                              const std::string& name) {
  return RegisterNamed(agent, name, kPatience);
}

// Reads 100 bytes of the buffer `name` stands for into `local` by name.
absl::Status ReadByName(AgentProcess& agent, uint64_t local,
                        const std::string& name) {
  absl::StatusOr<v1::OpResult> result =
      SubmitOne(agent, ReadByNameOp(local, name), kPatience);
  if (!result.ok()) return result.status();
  return absl::Status(static_cast<absl::StatusCode>(result->code()),
                      result->message());
}

TEST(NamesClusterTest, KillingTheLeaderIsSeenByNoClient) {
  // Not root: fail loudly, never pass silently.
  ASSERT_TRUE(CheckNetnsPrivileges().ok()) << CheckNetnsPrivileges();
  auto net = NetnsSwitch::Create(kMembers + 2);
  ASSERT_TRUE(net.ok()) << net.status();
  std::vector<EtcdCluster::Host> hosts;
  for (int i = 0; i < kMembers; ++i) {
    hosts.push_back({(*net)->netns(i), (*net)->address(i)});
  }
  auto cluster = EtcdCluster::Start(hosts);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  absl::StatusOr<int> leader;
  ASSERT_TRUE(Eventually(
      [&] {
        leader = (*cluster)->Leader();
        return leader.ok();
      },
      kPatience))
      << leader.status();
  // The agents talk to the leader first: its death is what they notice.
  std::vector<int> order = {*leader};
  for (int i = 0; i < (*cluster)->size(); ++i) {
    if (i != *leader) order.push_back(i);
  }
  auto start = [&](int host, const std::string& id) {
    auto agent = AgentProcess::Start(TcpAgentOptions(
        (*net)->address(host), (*net)->netns(host),
        {"--agent_id=" + id, "--directory=" + (*cluster)->directory(order),
         "--directory_prefix=/test", "--directory_lease_ttl=5s"}));
    EXPECT_TRUE(agent.ok()) << agent.status();
    return agent.ok() ? std::move(*agent) : nullptr;
  };
  auto a = start(kAgentA, "agent-a");
  auto b = start(kAgentB, "agent-b");
  ASSERT_TRUE(a && b);
  ASSERT_TRUE(Register(*a, "c/blocks").ok());
  auto near = Register(*b, "");
  ASSERT_TRUE(near.ok()) << near.status();

  // Publish, resolve (a miss: etcd asked) and read by name, over and over;
  // the leader dies a second in, and the work goes on for five more.
  std::vector<std::string> errors;
  const absl::Time begin = absl::Now();
  absl::Time killed = absl::InfiniteFuture();
  int after_kill = 0;
  for (int i = 0; absl::Now() < killed + absl::Seconds(5); ++i) {
    if (killed == absl::InfiniteFuture() &&
        absl::Now() - begin > absl::Seconds(1)) {
      (*cluster)->Kill(*leader);
      killed = absl::Now();
    }
    const std::string name = absl::StrCat("c/", i);
    auto registered = Register(*a, name);
    if (!registered.ok()) {
      errors.push_back(
          absl::StrCat(i, " register: ", registered.status().ToString()));
    }
    auto resolved = b->client().Resolve(name);
    if (!resolved.ok()) {
      errors.push_back(
          absl::StrCat(i, " resolve: ", resolved.status().ToString()));
    }
    absl::Status read = ReadByName(*b, near->buffer_id(), "c/blocks");
    if (!read.ok())
      errors.push_back(absl::StrCat(i, " read: ", read.ToString()));
    if (killed != absl::InfiniteFuture()) ++after_kill;
  }
  EXPECT_THAT(errors, IsEmpty());
  EXPECT_GT(after_kill, 0);
  // Both agents are still published (their leases survived the election).
  auto listed = b->client().ListAgents();
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_EQ(listed->agents_size(), 2);
  // And the cluster has a new leader.
  auto now_leading = (*cluster)->Leader();
  ASSERT_TRUE(now_leading.ok()) << now_leading.status();
  EXPECT_NE(*now_leading, *leader);
}

}  // namespace
}  // namespace rdma_agent

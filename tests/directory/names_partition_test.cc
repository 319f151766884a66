// A partitioned agent: agent A in one network namespace, etcd and agent B
// in another, joined by a veth pair. With A's link down, once A's lease can
// no longer be renewed A stops claiming its names (Resolve of its own name
// and Publish answer UNAVAILABLE), and B sees A's record and names go with
// the lease; with the link up again A publishes them again and B moves
// bytes by name.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/rdma_agent_client.h"
#include "common/grpc_status.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "rdma/agent/v1/agent.grpc.pb.h"
#include "tests/directory/name_calls.h"
#include "tests/integration/netns.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/etcd_server.h"
#include "tests/testing/eventually.h"

namespace rdma_agent {
namespace {

namespace v1 = ::rdma::agent::v1;

using ::rdma_agent::testing::AgentProcess;
using ::rdma_agent::testing::CheckNetnsPrivileges;
using ::rdma_agent::testing::EtcdServer;
using ::rdma_agent::testing::Eventually;
using ::rdma_agent::testing::NetnsPair;
using ::rdma_agent::testing::ReadByNameOp;
using ::rdma_agent::testing::RegisterNamed;
using ::rdma_agent::testing::SubmitOne;
using ::rdma_agent::testing::TcpAgentOptions;

constexpr absl::Duration kLeaseTtl = absl::Seconds(3);
constexpr absl::Duration kPatience = absl::Seconds(30);

absl::StatusOr<v1::RegisterResponse> Register(AgentProcess& agent,
                                              const std::string& name) {
  return RegisterNamed(agent, name, kPatience);
}

// Reads 100 bytes at offset 0 of what `name` stands for into `local`.
v1::OpResult ReadByName(AgentProcess& agent, uint64_t local,
                        const std::string& name) {
  absl::StatusOr<v1::OpResult> result =
      SubmitOne(agent, ReadByNameOp(local, name), kPatience);
  if (result.ok()) return *result;
  v1::OpResult failed;
  failed.set_code(grpc::StatusCode::UNKNOWN);
  failed.set_message(std::string(result.status().message()));
  return failed;
}

TEST(NamesPartitionTest, ACutOffAgentStopsClaimingItsNamesUntilItHeals) {
  // Not root: fail loudly, never pass silently.
  ASSERT_TRUE(CheckNetnsPrivileges().ok()) << CheckNetnsPrivileges();
  auto pair = NetnsPair::Create();
  ASSERT_TRUE(pair.ok()) << pair.status();
  EtcdServer::Options etcd_options;
  etcd_options.netns = (*pair)->netns(1);
  etcd_options.host = (*pair)->address(1);
  auto etcd = EtcdServer::Start(etcd_options);
  ASSERT_TRUE(etcd.ok()) << etcd.status();
  auto start = [&](int side, const std::string& id) {
    auto agent = AgentProcess::Start(TcpAgentOptions(
        (*pair)->address(side), (*pair)->netns(side),
        {"--agent_id=" + id, "--directory=" + (*etcd)->directory(),
         "--directory_prefix=/test",
         absl::StrCat("--directory_lease_ttl=",
                      absl::FormatDuration(kLeaseTtl))}));
    EXPECT_TRUE(agent.ok()) << agent.status();
    return agent.ok() ? std::move(*agent) : nullptr;
  };
  auto a = start(0, "agent-a");
  auto b = start(1, "agent-b");
  ASSERT_TRUE(a && b);
  auto far = Register(*a, "part/a");
  ASSERT_TRUE(far.ok()) << far.status();
  ASSERT_TRUE(
      a->client().WriteBuffer(far->buffer_id(), 0, std::string(100, 'p')).ok());
  auto spare = Register(*a, "");
  auto near = Register(*b, "");
  ASSERT_TRUE(spare.ok() && near.ok());
  ASSERT_TRUE(a->client().Resolve("part/a").ok());
  ASSERT_EQ(ReadByName(*b, near->buffer_id(), "part/a").code(), 0);

  ASSERT_TRUE((*pair)->SetLink(0, false).ok());
  // A can no longer renew its lease: it stops claiming its names.
  absl::Status own;
  EXPECT_TRUE(Eventually(
      [&] {
        own = a->client().Resolve("part/a").status();
        return own.code() == absl::StatusCode::kUnavailable;
      },
      kLeaseTtl + kPatience))
      << own;
  EXPECT_NE(own.message().find("no longer claims"), std::string::npos) << own;
  const absl::Status publish =
      a->client().Publish(spare->buffer_id(), "part/new");
  EXPECT_EQ(publish.code(), absl::StatusCode::kUnavailable) << publish;
  // B, beside etcd, sees A's record and names go with A's lease.
  EXPECT_TRUE(Eventually(
      [&] {
        auto listed = b->client().ListAgents();
        return listed.ok() && listed->agents_size() == 1 &&
               b->client().Resolve("part/a").status().code() ==
                   absl::StatusCode::kNotFound;
      },
      kLeaseTtl + kPatience));

  // Healed: A publishes itself and its names again.
  ASSERT_TRUE((*pair)->SetLink(0, true).ok());
  EXPECT_TRUE(Eventually(
      [&] {
        auto listed = b->client().ListAgents();
        return listed.ok() && listed->agents_size() == 2 &&
               b->client().Resolve("part/a").ok();
      },
      kPatience));
  EXPECT_TRUE(Eventually([&] { return a->client().Resolve("part/a").ok(); },
                         kPatience));
  const v1::OpResult read = ReadByName(*b, near->buffer_id(), "part/a");
  ASSERT_EQ(read.code(), 0) << read.message();
  auto bytes = b->client().ReadBuffer(near->buffer_id(), 0, 200);
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ(*bytes, std::string(100, 'p') + std::string(100, '\0'));
  if (HasFailure()) {
    ADD_FAILURE() << "agent-a log:\n" << a->Log();
  }
}

}  // namespace
}  // namespace rdma_agent

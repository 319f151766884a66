// Agents publishing themselves in a real etcd (etcd-server) and in the local
// directory: records while they serve, gone at a clean stop at once and
// after a crash with their lease, back after a restart (new epoch), after a
// lost lease and after an etcd outage; endpoint failover; rdma-agentctl
// agents; bad directory flags.
#include <signal.h>
#include <sys/stat.h>

#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/rdma_agent_client.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/message_differencer.h"
#include "grpcpp/channel.h"
#include "gtest/gtest.h"
#include "rdma/agent/v1/agent.grpc.pb.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/etcd_server.h"
#include "tests/testing/eventually.h"
#include "tests/testing/process.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/test_pki.h"

namespace rdma_agent {
namespace {

namespace v1 = ::rdma::agent::v1;

using ::rdma_agent::testing::AgentProcess;
using ::rdma_agent::testing::EtcdServer;
using ::rdma_agent::testing::Eventually;
using ::rdma_agent::testing::FreeLoopbackPort;
using ::rdma_agent::testing::RunfilePath;
using ::rdma_agent::testing::RunToCompletion;
using ::rdma_agent::testing::TcpAgentOptions;
using ::rdma_agent::testing::TempDir;
using ::rdma_agent::testing::TestPki;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr absl::Duration kLeaseTtl = absl::Seconds(3);

// Agent ids and epochs the directory lists, through `agent`'s ListAgents.
std::vector<std::pair<std::string, uint64_t>> Listed(AgentProcess& agent) {
  auto listed = agent.client().ListAgents();
  EXPECT_TRUE(listed.ok()) << listed.status();
  std::vector<std::pair<std::string, uint64_t>> agents;
  if (!listed.ok()) return agents;
  for (const auto& record : listed->agents()) {
    agents.emplace_back(record.info().agent_id(), record.info().epoch());
  }
  return agents;
}

std::pair<std::string, uint64_t> Self(AgentProcess& agent) {
  auto info = agent.client().GetInfo();
  EXPECT_TRUE(info.ok()) << info.status();
  return {info->agent_id(), info->epoch()};
}

class AgentsDirectoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto etcd = EtcdServer::Start();
    ASSERT_TRUE(etcd.ok()) << etcd.status();
    etcd_ = std::move(*etcd);
  }

  std::unique_ptr<AgentProcess> StartAgent(
      const std::string& id, std::vector<std::string> more_flags = {}) {
    std::vector<std::string> flags = {
        "--agent_id=" + id, "--directory=" + etcd_->directory(),
        "--directory_prefix=/test",
        absl::StrCat("--directory_lease_ttl=",
                     absl::FormatDuration(kLeaseTtl))};
    flags.insert(flags.end(), more_flags.begin(), more_flags.end());
    auto agent =
        AgentProcess::Start(TcpAgentOptions("127.0.0.1", "", std::move(flags)));
    EXPECT_TRUE(agent.ok()) << agent.status();
    return agent.ok() ? std::move(*agent) : nullptr;
  }

  std::unique_ptr<EtcdServer> etcd_;
};

TEST_F(AgentsDirectoryTest, AgentsSeeEachOtherWithTheirEndpoints) {
  auto a = StartAgent("agent-a");
  auto b = StartAgent("agent-b");
  ASSERT_TRUE(a && b);
  EXPECT_THAT(Listed(*a), ElementsAre(Self(*a), Self(*b)));
  EXPECT_THAT(Listed(*b), ElementsAre(Self(*a), Self(*b)));

  auto listed = a->client().ListAgents();
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->directory(), etcd_->directory());
  auto info_b = b->client().GetInfo();
  ASSERT_TRUE(info_b.ok());
  const v1::AgentRecord& record_b = listed->agents(1);
  // The record is what GetInfo says, endpoints included.
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(
      record_b.info(), *info_b))
      << record_b.info().DebugString() << "\nvs GetInfo\n"
      << info_b->DebugString();
  EXPECT_LE(absl::FromUnixSeconds(record_b.start_time().seconds()),
            absl::Now());
  EXPECT_GT(absl::FromUnixSeconds(record_b.start_time().seconds()),
            absl::Now() - absl::Minutes(1));

  // An operator reads the records with etcdctl: JSON under the prefix.
  auto dump = etcd_->Etcdctl({"get", "--prefix", "/test/agents/"});
  ASSERT_TRUE(dump.ok()) << dump.status();
  EXPECT_THAT(*dump, HasSubstr("/test/agents/agent-b\n"));
  EXPECT_THAT(*dump, HasSubstr("\"agent_id\":\"agent-b\""));
  EXPECT_THAT(*dump, HasSubstr(absl::StrCat("127.0.0.1:", b->tcp_port())));
}

TEST_F(AgentsDirectoryTest, CleanStopRemovesTheRecordAtOnce) {
  auto a = StartAgent("agent-a");
  auto b = StartAgent("agent-b");
  ASSERT_TRUE(a && b);
  const auto self_a = Self(*a);
  ASSERT_EQ(Listed(*a).size(), 2u);
  auto code = b->Stop();
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  // No lease to wait out: the stop revoked it.
  EXPECT_THAT(Listed(*a), ElementsAre(self_a));
}

TEST_F(AgentsDirectoryTest, CrashedAgentExpiresWithItsLease) {
  auto a = StartAgent("agent-a");
  auto b = StartAgent("agent-b");
  ASSERT_TRUE(a && b);
  const auto self_a = Self(*a);
  b->Kill();
  const absl::Time killed = absl::Now();
  // Still listed for a while: nobody withdrew it.
  EXPECT_EQ(Listed(*a).size(), 2u);
  EXPECT_TRUE(Eventually([&] { return Listed(*a).size() == 1; },
                         kLeaseTtl + absl::Seconds(5)));
  EXPECT_THAT(Listed(*a), ElementsAre(self_a));
  EXPECT_GE(absl::Now() - killed, kLeaseTtl - absl::Seconds(1));
}

TEST_F(AgentsDirectoryTest, RestartedAgentIsListedOnceWithItsNewEpoch) {
  auto a = StartAgent("agent-a");
  auto b = StartAgent("agent-b");
  ASSERT_TRUE(a && b);
  const auto before = Self(*b);
  b->Kill();
  ASSERT_TRUE(b->Restart().ok());
  const auto after = Self(*b);
  ASSERT_EQ(after.first, before.first);
  ASSERT_NE(after.second, before.second);
  // The new life's record replaces the old one (same key) at once.
  EXPECT_THAT(Listed(*a), ElementsAre(Self(*a), after));
  // And the crashed life's lease expiring later takes nothing with it.
  absl::SleepFor(kLeaseTtl + absl::Seconds(2));
  EXPECT_THAT(Listed(*a), ElementsAre(Self(*a), after));
}

TEST_F(AgentsDirectoryTest, RecordComesBackAfterItsLeaseIsLost) {
  auto a = StartAgent("agent-a");
  ASSERT_TRUE(a);
  auto range = etcd_->client().RangePrefix("/test/agents/agent-a", 10,
                                           absl::Now() + absl::Seconds(2));
  ASSERT_TRUE(range.ok()) << range.status();
  ASSERT_EQ(range->kvs_size(), 1);
  const int64_t lease = range->kvs(0).lease();
  ASSERT_NE(lease, 0);
  // Someone (an operator, an etcd restore) drops the agent's lease: the
  // record goes with it.
  ASSERT_TRUE(etcd_->client().RevokeLease(lease).ok());
  EXPECT_TRUE(Listed(*a).empty());
  // The keeper notices at its next renewal and publishes again.
  EXPECT_TRUE(Eventually([&] { return Listed(*a).size() == 1; },
                         kLeaseTtl + absl::Seconds(3)));
  EXPECT_THAT(a->Log(), HasSubstr("lease expired; publishing again"));
}

TEST_F(AgentsDirectoryTest, EtcdOutageIsSurvivedAndTheRecordReturns) {
  auto a = StartAgent("agent-a");
  ASSERT_TRUE(a);
  etcd_->Kill();
  // The agent serves on; only the directory's answers fail, naming it.
  EXPECT_TRUE(a->client().GetInfo().ok());
  auto listed = a->client().ListAgents();
  EXPECT_EQ(listed.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(listed.status().message(), HasSubstr("ListAgents"));
  EXPECT_THAT(listed.status().message(), HasSubstr(etcd_->directory()));
  // Longer than a lease: etcd keeps leases across its restart, but the
  // agent must cope either way.
  absl::SleepFor(kLeaseTtl + absl::Seconds(1));
  ASSERT_TRUE(etcd_->Restart().ok());
  EXPECT_TRUE(Eventually([&] { return Listed(*a).size() == 1; },
                         kLeaseTtl + absl::Seconds(5)));
}

TEST_F(AgentsDirectoryTest, AnUnreachableFirstEndpointFailsOverToTheNext) {
  auto dead = FreeLoopbackPort();
  ASSERT_TRUE(dead.ok());
  auto a = StartAgent("agent-a", {absl::StrCat("--directory=etcd://127.0.0.1:",
                                               *dead, ",", etcd_->endpoint())});
  ASSERT_TRUE(a);
  EXPECT_THAT(Listed(*a), ElementsAre(Self(*a)));
}

TEST_F(AgentsDirectoryTest, AgentStartsAndServesWhileEtcdIsDown) {
  etcd_->Kill();
  auto a = StartAgent("agent-a");
  ASSERT_TRUE(a);
  EXPECT_THAT(a->Log(), HasSubstr("cannot publish agent agent-a yet"));
  ASSERT_TRUE(etcd_->Restart().ok());
  EXPECT_TRUE(
      Eventually([&] { return Listed(*a).size() == 1; }, absl::Seconds(5)));
}

TEST_F(AgentsDirectoryTest, PrefixesKeepClustersApart) {
  auto a = StartAgent("agent-a");
  auto b = StartAgent("agent-b", {"--directory_prefix=/other"});
  ASSERT_TRUE(a && b);
  EXPECT_THAT(Listed(*a), ElementsAre(Self(*a)));
  EXPECT_THAT(Listed(*b), ElementsAre(Self(*b)));
}

TEST_F(AgentsDirectoryTest, UnreadableRecordsAreCountedNotListed) {
  auto a = StartAgent("agent-a");
  ASSERT_TRUE(a);
  ASSERT_TRUE(
      etcd_->client().Put("/test/agents/zz-garbage", "not json", 0).ok());
  auto listed = a->client().ListAgents();
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->agents_size(), 1);
  EXPECT_EQ(listed->unreadable(), 1u);
}

TEST_F(AgentsDirectoryTest, ListingIsBoundedByFlag) {
  auto a = StartAgent("agent-a", {"--directory_max_listed_agents=2"});
  ASSERT_TRUE(a);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(
        etcd_->client()
            .Put(absl::StrCat("/test/agents/other-", i),
                 absl::StrCat(R"({"info":{"agent_id":"other-)", i, R"("}})"), 0)
            .ok());
  }
  auto listed = a->client().ListAgents();
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->agents_size(), 2);
  EXPECT_TRUE(listed->truncated());
}

TEST_F(AgentsDirectoryTest, AgentctlPrintsTheAgents) {
  auto a = StartAgent("agent-a");
  auto b = StartAgent("agent-b");
  ASSERT_TRUE(a && b);
  auto run = RunToCompletion({RunfilePath("client/rdma-agentctl"),
                              "--target=" + a->target(), "agents"},
                             "", absl::Seconds(20));
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(run->exit_code, 0) << run->err;
  const std::vector<std::string> lines =
      absl::StrSplit(run->out, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 3u) << run->out;
  EXPECT_THAT(lines[0], HasSubstr("AGENT"));
  EXPECT_TRUE(absl::StartsWith(lines[2], "agent-b ")) << lines[2];
  EXPECT_THAT(lines[2], HasSubstr(absl::StrCat("127.0.0.1:", b->tcp_port())));
  auto json =
      RunToCompletion({RunfilePath("client/rdma-agentctl"),
                       "--target=" + a->target(), "-o", "json", "agents"},
                      "", absl::Seconds(20));
  ASSERT_TRUE(json.ok());
  EXPECT_THAT(json->out, HasSubstr("\"agent_id\": \"agent-b\""));
}

// Names: agent A's user publishes a buffer, agent B's user resolves the
// name and moves bytes with the context it stands for.
TEST_F(AgentsDirectoryTest, NamesResolveOnOtherAgentsAndMoveBytes) {
  auto a = StartAgent("agent-a");
  auto b = StartAgent("agent-b");
  ASSERT_TRUE(a && b);
  auto far = a->client().Allocate(4096, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(far.ok()) << far.status();
  for (int i = 0; i < 4096; ++i) far->data()[i] = std::byte(i * 7 + 1);
  ASSERT_TRUE(a->client().Publish(far->id(), "job-1/kv/layer.0").ok());

  auto record = b->client().Resolve("job-1/kv/layer.0");
  ASSERT_TRUE(record.ok()) << record.status();
  EXPECT_EQ(record->remote_context(), far->remote_context());
  EXPECT_EQ(record->agent_id(), "agent-a");
  EXPECT_EQ(record->agent_epoch(), Self(*a).second);
  EXPECT_EQ(record->buffer_id(), far->id());

  auto near = b->client().Allocate(4096, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(near.ok());
  std::memset(near->data(), 0xee, 4096);
  client::OpSpec op;
  op.type = v1::OP_TYPE_READ_INTO_LOCAL;
  op.local_buffer_id = near->id();
  op.local_offset = 100;
  op.length = 1000;
  op.remote_context = record->remote_context();
  op.remote_offset = 200;
  auto results = b->client().Submit({op}, absl::Seconds(10));
  ASSERT_TRUE(results.ok()) << results.status();
  ASSERT_TRUE((*results)[0].status.ok()) << (*results)[0].status;
  for (int i = 0; i < 4096; ++i) {
    const std::byte want = (i >= 100 && i < 1100)
                               ? std::byte((i - 100 + 200) * 7 + 1)
                               : std::byte(0xee);
    ASSERT_EQ(near->data()[i], want) << "byte " << i;
  }
  // Unknown and malformed names.
  EXPECT_EQ(b->client().Resolve("job-1/kv/layer.1").status().code(),
            absl::StatusCode::kNotFound);
  for (const char* bad : {"", "/abs", "a//b", "a/../b", "sp ace", "quo\"te"}) {
    const absl::Status status = b->client().Resolve(bad).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(status.message(), HasSubstr("Resolve")) << bad;
  }
}

TEST_F(AgentsDirectoryTest, OpsNameTheirRemoteByPublishedName) {
  auto a = StartAgent("agent-a");
  auto b = StartAgent("agent-b");
  ASSERT_TRUE(a && b);
  auto far =
      a->client().Allocate(4096, v1::ACCESS_READ_WRITE, "", v1::LIFETIME_AGENT);
  ASSERT_TRUE(far.ok());
  for (int i = 0; i < 4096; ++i) far->data()[i] = std::byte(i % 251);
  ASSERT_TRUE(a->client().Publish(far->id(), "prefill/blocks").ok());
  auto near = b->client().Allocate(4096, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(near.ok());
  auto stub = v1::RdmaAgent::NewStub(b->client().channel());
  auto submit = [&](v1::Op op) {
    v1::SubmitRequest request;
    *request.add_ops() = op;
    request.mutable_timeout()->set_seconds(10);
    v1::SubmitResponse response;
    grpc::ClientContext context;
    const grpc::Status status = stub->Submit(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response.results_size() == 1 ? response.results(0) : v1::OpResult();
  };
  v1::Op op;
  op.set_type(v1::OP_TYPE_READ_INTO_LOCAL);
  op.set_local_buffer_id(near->id());
  op.set_local_offset(8);
  op.set_length(512);
  op.set_remote_name("prefill/blocks");
  op.set_remote_offset(1000);
  std::memset(near->data(), 0, 4096);
  v1::OpResult result = submit(op);
  ASSERT_EQ(result.code(), 0) << result.message();
  for (int i = 0; i < 4096; ++i) {
    const std::byte want =
        (i >= 8 && i < 520) ? std::byte((i - 8 + 1000) % 251) : std::byte(0);
    ASSERT_EQ(near->data()[i], want) << "byte " << i;
  }
  // A name nobody publishes fails its op, naming it.
  v1::Op unknown = op;
  unknown.set_remote_name("prefill/none");
  result = submit(unknown);
  EXPECT_EQ(result.code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(result.message(), HasSubstr("op 0"));
  EXPECT_THAT(result.message(), HasSubstr("prefill/none"));
  // A name and a context at once is malformed.
  v1::Op both = op;
  both.set_remote_context(far->remote_context());
  result = submit(both);
  EXPECT_EQ(result.code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(result.message(), HasSubstr("not several"));

  // The publisher restarts: the name is gone with its old life, and its
  // owner publishes it again for its new buffer; ops by name reach the new
  // epoch at once.
  a->Kill();
  const absl::Status restarted = a->Restart();
  ASSERT_TRUE(restarted.ok()) << restarted << "\n" << a->Log();
  auto again = a->client().Allocate(4096, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(again.ok());
  for (int i = 0; i < 4096; ++i) again->data()[i] = std::byte(0x5a);
  ASSERT_TRUE(a->client().Publish(again->id(), "prefill/blocks").ok());
  // Other agents answer from a cache their watch updates: the new record
  // reaches them within moments.
  const uint64_t epoch = Self(*a).second;
  EXPECT_TRUE(Eventually(
      [&] {
        auto record = b->client().Resolve("prefill/blocks");
        return record.ok() && record->agent_epoch() == epoch;
      },
      absl::Seconds(20)));
  result = submit(op);
  ASSERT_EQ(result.code(), 0) << result.message();
  EXPECT_EQ(near->data()[8], std::byte(0x5a));
  EXPECT_EQ(near->data()[7], std::byte(0));
}

// What another local user sees: a name published for its owner only does
// not exist for it (the same answer as an unknown name), one published for
// any user resolves.
TEST_F(AgentsDirectoryTest, ANameIsForItsOwnerUnlessPublishedForAnyUser) {
  auto a = StartAgent("agent-a");
  auto b = StartAgent("agent-b");
  ASSERT_TRUE(a && b);
  auto buffer =
      a->client().Allocate(4096, v1::ACCESS_READ, "", v1::LIFETIME_AGENT);
  ASSERT_TRUE(buffer.ok());
  ASSERT_TRUE(a->client().Publish(buffer->id(), "private/x").ok());
  ASSERT_TRUE(a->client()
                  .Publish(buffer->id(), "shared/y", v1::VISIBILITY_ANY_USER)
                  .ok());
  // mkdtemp made it 0700; the daemon makes its sockets 0666.
  ASSERT_EQ(::chmod(b->runtime_dir().c_str(), 0755), 0);
  auto resolve_as = [&](int uid, const std::string& name) {
    auto run = RunToCompletion({"setpriv", absl::StrCat("--reuid=", uid),
                                absl::StrCat("--regid=", uid), "--clear-groups",
                                RunfilePath("client/rdma-agentctl"),
                                "--target=" + b->target(), "resolve", name},
                               "", absl::Seconds(20));
    EXPECT_TRUE(run.ok()) << run.status();
    return run.ok() ? *run : testing::RunResult();
  };
  constexpr int kNobody = 65534;
  const auto hidden = resolve_as(kNobody, "private/x");
  EXPECT_EQ(hidden.exit_code, 1) << hidden.out << hidden.err;
  EXPECT_THAT(hidden.err, HasSubstr("NOT_FOUND"));
  const auto unknown = resolve_as(kNobody, "private/none");
  EXPECT_EQ(absl::StrReplaceAll(hidden.err, {{"private/x", "N"}}),
            absl::StrReplaceAll(unknown.err, {{"private/none", "N"}}));
  const auto shared = resolve_as(kNobody, "shared/y");
  EXPECT_EQ(shared.exit_code, 0) << shared.err;
  EXPECT_THAT(shared.out, HasSubstr("shared/y: buffer"));
  // The owner (root here) finds both, on any agent.
  EXPECT_EQ(resolve_as(0, "private/x").exit_code, 0);
}

TEST_F(AgentsDirectoryTest, ANameBelongsToItsPublisher) {
  auto a = StartAgent("agent-a");
  auto b = StartAgent("agent-b");
  ASSERT_TRUE(a && b);
  auto mine = a->client().Allocate(4096, v1::ACCESS_READ);
  auto theirs = b->client().Allocate(4096, v1::ACCESS_READ);
  auto second = a->client().Allocate(4096, v1::ACCESS_READ);
  ASSERT_TRUE(mine.ok() && theirs.ok() && second.ok());
  ASSERT_TRUE(a->client().Publish(mine->id(), "shared/name").ok());
  // Another agent's user cannot take it.
  const absl::Status taken = b->client().Publish(theirs->id(), "shared/name");
  EXPECT_EQ(taken.code(), absl::StatusCode::kAlreadyExists) << taken;
  EXPECT_THAT(taken.message(), HasSubstr("agent agent-a"));
  EXPECT_EQ(b->client().Unpublish("shared/name").code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(b->client().Resolve("shared/name")->buffer_id(), mine->id());
  // Its owner may move it to another of its buffers.
  ASSERT_TRUE(a->client().Publish(second->id(), "shared/name").ok());
  EXPECT_TRUE(Eventually(
      [&] {
        auto record = b->client().Resolve("shared/name");
        return record.ok() && record->buffer_id() == second->id();
      },
      absl::Seconds(20)));
  // A buffer of someone else's cannot be published (unknown here).
  EXPECT_EQ(a->client().Publish(theirs->id(), "other").code(),
            absl::StatusCode::kNotFound);
  // Unpublished, it is free again.
  ASSERT_TRUE(a->client().Unpublish("shared/name").ok());
  EXPECT_TRUE(Eventually(
      [&] {
        return b->client().Resolve("shared/name").status().code() ==
               absl::StatusCode::kNotFound;
      },
      absl::Seconds(20)));
  EXPECT_TRUE(b->client().Publish(theirs->id(), "shared/name").ok());
}

TEST_F(AgentsDirectoryTest, NamesGoWithTheirBufferAndTheirAgent) {
  auto a = StartAgent("agent-a");
  auto b = StartAgent("agent-b");
  ASSERT_TRUE(a && b);
  auto kept =
      a->client().Allocate(4096, v1::ACCESS_READ, "", v1::LIFETIME_AGENT);
  ASSERT_TRUE(kept.ok());
  {
    auto released = a->client().Allocate(4096, v1::ACCESS_READ);
    ASSERT_TRUE(released.ok());
    ASSERT_TRUE(a->client().Publish(released->id(), "goes/with/buffer").ok());
    ASSERT_TRUE(a->client().Publish(kept->id(), "goes/with/agent").ok());
    ASSERT_TRUE(b->client().Resolve("goes/with/buffer").ok());
  }  // Buffer destroyed: released.
  EXPECT_TRUE(Eventually(
      [&] {
        return b->client().Resolve("goes/with/buffer").status().code() ==
               absl::StatusCode::kNotFound;
      },
      absl::Seconds(5)));
  ASSERT_TRUE(b->client().Resolve("goes/with/agent").ok());
  // A crashed agent's names expire with its lease.
  a->Kill();
  EXPECT_TRUE(Eventually(
      [&] {
        return b->client().Resolve("goes/with/agent").status().code() ==
               absl::StatusCode::kNotFound;
      },
      kLeaseTtl + absl::Seconds(5)));
}

TEST_F(AgentsDirectoryTest, NamesComeBackWithTheirAgentsNewLease) {
  auto a = StartAgent("agent-a");
  ASSERT_TRUE(a);
  auto buffer = a->client().Allocate(4096, v1::ACCESS_READ);
  ASSERT_TRUE(buffer.ok());
  ASSERT_TRUE(a->client().Publish(buffer->id(), "survives/lease").ok());
  auto range = etcd_->client().RangePrefix("/test/agents/agent-a", 10,
                                           absl::Now() + absl::Seconds(2));
  ASSERT_TRUE(range.ok() && range->kvs_size() == 1);
  ASSERT_TRUE(etcd_->client().RevokeLease(range->kvs(0).lease()).ok());
  EXPECT_EQ(a->client().Resolve("survives/lease").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(
      Eventually([&] { return a->client().Resolve("survives/lease").ok(); },
                 kLeaseTtl + absl::Seconds(3)));
}

TEST_F(AgentsDirectoryTest, NamesAreBoundedPerUserAndInTotal) {
  auto a =
      StartAgent("agent-a", {"--max_names_per_user=2", "--max_names_total=2"});
  ASSERT_TRUE(a);
  auto buffer = a->client().Allocate(4096, v1::ACCESS_READ);
  ASSERT_TRUE(buffer.ok());
  ASSERT_TRUE(a->client().Publish(buffer->id(), "n/1").ok());
  ASSERT_TRUE(a->client().Publish(buffer->id(), "n/2").ok());
  // Publishing a name again is not a new one.
  ASSERT_TRUE(a->client().Publish(buffer->id(), "n/2").ok());
  const absl::Status third = a->client().Publish(buffer->id(), "n/3");
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted) << third;
  EXPECT_THAT(third.message(), HasSubstr("--max_names_per_user"));
  EXPECT_EQ(a->client().Resolve("n/3").status().code(),
            absl::StatusCode::kNotFound);
  std::string long_name(300, 'x');
  EXPECT_EQ(a->client().Publish(buffer->id(), long_name).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(a->client().Unpublish("n/1").ok());
  EXPECT_TRUE(a->client().Publish(buffer->id(), "n/3").ok());
}

TEST_F(AgentsDirectoryTest, PublishingNeedsThePublishedAgent) {
  auto a = StartAgent("agent-a");
  ASSERT_TRUE(a);
  auto buffer = a->client().Allocate(4096, v1::ACCESS_READ);
  ASSERT_TRUE(buffer.ok());
  etcd_->Kill();
  const absl::Status status = a->client().Publish(buffer->id(), "n");
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(status.message(), HasSubstr("Publish"));
}

// A WatchNames stream read on a thread of its own, as a client would.
class NameStream {
 public:
  NameStream(client::AgentClient& client, const std::string& prefix)
      : stub_(v1::RdmaAgent::NewStub(client.channel())) {
    v1::WatchNamesRequest request;
    request.set_prefix(prefix);
    reader_ = stub_->WatchNames(&context_, request);
    thread_ = std::thread([this] {
      v1::NameEvent event;
      while (reader_->Read(&event)) {
        absl::MutexLock lock(&mu_);
        events_.push_back(Describe(event));
      }
      absl::MutexLock lock(&mu_);
      end_ = reader_->Finish();
    });
  }
  ~NameStream() {
    context_.TryCancel();
    thread_.join();
  }
  static std::string Describe(const v1::NameEvent& event) {
    switch (event.kind()) {
      case v1::NameEvent::PUBLISHED:
        return "+" + event.record().name();
      case v1::NameEvent::WITHDRAWN:
        return "-" + event.record().name();
      case v1::NameEvent::SYNCED:
        return "synced";
      default:
        return "?";
    }
  }
  std::vector<std::string> events() {
    absl::MutexLock lock(&mu_);
    return events_;
  }
  // True once the events seen are `want`.
  bool Saw(const std::vector<std::string>& want) {
    return Eventually([&] { return events() == want; }, absl::Seconds(10));
  }
  std::optional<grpc::Status> end() {
    absl::MutexLock lock(&mu_);
    return end_;
  }

 private:
  std::unique_ptr<v1::RdmaAgent::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReader<v1::NameEvent>> reader_;
  std::thread thread_;
  absl::Mutex mu_;
  std::vector<std::string> events_ ABSL_GUARDED_BY(mu_);
  std::optional<grpc::Status> end_ ABSL_GUARDED_BY(mu_);
};

TEST_F(AgentsDirectoryTest, WatchNamesStreamsTheNamesThenTheirChanges) {
  auto a = StartAgent("agent-a");
  auto b = StartAgent("agent-b");
  ASSERT_TRUE(a && b);
  auto one = a->client().Allocate(4096, v1::ACCESS_READ);
  auto two =
      a->client().Allocate(4096, v1::ACCESS_READ, "", v1::LIFETIME_AGENT);
  ASSERT_TRUE(one.ok() && two.ok());
  ASSERT_TRUE(a->client().Publish(one->id(), "job/kv/1").ok());
  ASSERT_TRUE(a->client().Publish(one->id(), "other/1").ok());
  NameStream stream(b->client(), "job/");
  ASSERT_TRUE(stream.Saw({"+job/kv/1", "synced"})) << stream.events().size();
  ASSERT_TRUE(a->client().Publish(two->id(), "job/kv/2").ok());
  ASSERT_TRUE(a->client().Publish(two->id(), "other/2").ok());
  ASSERT_TRUE(stream.Saw({"+job/kv/1", "synced", "+job/kv/2"}));
  ASSERT_TRUE(a->client().Unpublish("job/kv/2").ok());
  ASSERT_TRUE(stream.Saw({"+job/kv/1", "synced", "+job/kv/2", "-job/kv/2"}));
  ASSERT_TRUE(a->client().Release(one->id()).ok());
  ASSERT_TRUE(stream.Saw(
      {"+job/kv/1", "synced", "+job/kv/2", "-job/kv/2", "-job/kv/1"}));
  // A crashed publisher's names go when its lease does, and watchers hear.
  ASSERT_TRUE(a->client().Publish(two->id(), "job/kv/3").ok());
  ASSERT_TRUE(stream.Saw({"+job/kv/1", "synced", "+job/kv/2", "-job/kv/2",
                          "-job/kv/1", "+job/kv/3"}));
  a->Kill();
  EXPECT_TRUE(Eventually(
      [&] {
        auto seen = stream.events();
        return !seen.empty() && seen.back() == "-job/kv/3";
      },
      kLeaseTtl + absl::Seconds(5)));
  EXPECT_FALSE(stream.end().has_value());
}

TEST_F(AgentsDirectoryTest, WatchNamesFollowsThroughAnEtcdRestart) {
  auto a = StartAgent("agent-a");
  ASSERT_TRUE(a);
  auto buffer = a->client().Allocate(4096, v1::ACCESS_READ);
  ASSERT_TRUE(buffer.ok());
  NameStream stream(a->client(), "");
  ASSERT_TRUE(stream.Saw({"synced"}));
  etcd_->Kill();
  ASSERT_TRUE(etcd_->Restart().ok());
  EXPECT_TRUE(Eventually(
      [&] { return a->client().Publish(buffer->id(), "after/restart").ok(); },
      absl::Seconds(10)));
  EXPECT_TRUE(stream.Saw({"synced", "+after/restart"}));
}

TEST_F(AgentsDirectoryTest, WatchNamesStreamsAreBounded) {
  auto a = StartAgent("agent-a", {"--max_name_watches_per_user=1"});
  ASSERT_TRUE(a);
  NameStream first(a->client(), "");
  ASSERT_TRUE(first.Saw({"synced"}));
  NameStream second(a->client(), "");
  ASSERT_TRUE(
      Eventually([&] { return second.end().has_value(); }, absl::Seconds(10)));
  EXPECT_EQ(second.end()->error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(second.end()->error_message(),
              HasSubstr("--max_name_watches_per_user"));
}

// An agent on `etcd` with `flags` (directory flags included).
std::unique_ptr<AgentProcess> StartAgentOn(const EtcdServer& etcd,
                                           const std::string& id,
                                           std::vector<std::string> flags) {
  std::vector<std::string> all = {
      "--agent_id=" + id, "--directory=" + etcd.directory(),
      "--directory_prefix=/test",
      absl::StrCat("--directory_lease_ttl=", absl::FormatDuration(kLeaseTtl))};
  all.insert(all.end(), flags.begin(), flags.end());
  auto agent =
      AgentProcess::Start(TcpAgentOptions("127.0.0.1", "", std::move(all)));
  EXPECT_TRUE(agent.ok()) << agent.status();
  return agent.ok() ? std::move(*agent) : nullptr;
}

TEST(EtcdTlsTest, ClientCertificatesAreRequiredAndUsed) {
  TempDir dir;
  TestPki pki(dir.path());
  ASSERT_TRUE(pki.MakeCa("ca")) << pki.Log();
  ASSERT_TRUE(pki.MakeCa("other_ca")) << pki.Log();
  ASSERT_TRUE(pki.MakeCert("etcd", "ca", "IP:127.0.0.1")) << pki.Log();
  ASSERT_TRUE(pki.MakeCert("agent", "ca", "IP:127.0.0.1")) << pki.Log();
  ASSERT_TRUE(pki.MakeCert("stranger", "other_ca", "IP:127.0.0.1"))
      << pki.Log();
  EtcdServer::Options options;
  options.cert_file = pki.Path("etcd.pem");
  options.key_file = pki.Path("etcd.key");
  options.ca_file = pki.Path("ca.pem");
  auto etcd = EtcdServer::Start(options);
  ASSERT_TRUE(etcd.ok()) << etcd.status();

  auto good = StartAgentOn(**etcd, "good",
                           {"--directory_ca_file=" + pki.Path("ca.pem"),
                            "--directory_cert_file=" + pki.Path("agent.pem"),
                            "--directory_key_file=" + pki.Path("agent.key")});
  // Without a client certificate, with one from another CA, and in plain
  // text, the handshake fails: nothing is published.
  auto anonymous = StartAgentOn(**etcd, "anonymous",
                                {"--directory_ca_file=" + pki.Path("ca.pem")});
  auto stranger =
      StartAgentOn(**etcd, "stranger",
                   {"--directory_ca_file=" + pki.Path("ca.pem"),
                    "--directory_cert_file=" + pki.Path("stranger.pem"),
                    "--directory_key_file=" + pki.Path("stranger.key")});
  auto plain = StartAgentOn(**etcd, "plain", {});
  ASSERT_TRUE(good && anonymous && stranger && plain);
  EXPECT_THAT(Listed(*good), ElementsAre(Self(*good)));
  for (AgentProcess* refused : {anonymous.get(), stranger.get(), plain.get()}) {
    EXPECT_THAT(refused->Log(), HasSubstr("cannot publish agent"));
    EXPECT_EQ(refused->client().ListAgents().status().code(),
              absl::StatusCode::kUnavailable);
  }
  auto keys = (*etcd)->Etcdctl({"get", "--prefix", "--keys-only", "/test/"});
  ASSERT_TRUE(keys.ok()) << keys.status();
  EXPECT_EQ(absl::StripAsciiWhitespace(*keys), "/test/agents/good");
}

class EtcdAuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    EtcdServer::Options options;
    // Tokens expire after a second unused.
    options.extra_flags = {"--auth-token-ttl=1"};
    auto etcd = EtcdServer::Start(options);
    ASSERT_TRUE(etcd.ok()) << etcd.status();
    etcd_ = std::move(*etcd);
    for (const std::vector<std::string>& command :
         std::vector<std::vector<std::string>>{
             {"user", "add", "root", "--new-user-password=rootpw"},
             {"user", "grant-role", "root", "root"},
             {"role", "add", "agents"},
             {"role", "grant-permission", "agents", "--prefix=true",
              "readwrite", "/test/"},
             {"user", "add", "agent", "--new-user-password=agentpw"},
             {"user", "grant-role", "agent", "agents"},
             {"auth", "enable"}}) {
      auto done = etcd_->Etcdctl(command);
      ASSERT_TRUE(done.ok()) << done.status();
    }
    etcd_->set_etcdctl_user("root:rootpw");
  }

  std::string PasswordFile(const std::string& password) {
    const std::string path = absl::StrCat(dir_.path(), "/password-", files_++);
    std::ofstream(path) << password << "\n";
    return path;
  }

  TempDir dir_;
  int files_ = 0;
  std::unique_ptr<EtcdServer> etcd_;
};

TEST_F(EtcdAuthTest, AgentLogsInAgainWhenEtcdForgetsItsToken) {
  auto a =
      StartAgentOn(*etcd_, "agent-a",
                   {"--directory_user=agent",
                    "--directory_password_file=" + PasswordFile("agentpw")});
  ASSERT_TRUE(a);
  EXPECT_THAT(Listed(*a), ElementsAre(Self(*a)));
  // etcd forgets every token when it restarts: the agent's next calls are
  // refused as unauthenticated, and it logs in again on its own, both to
  // renew its lease and to answer ListAgents.
  ASSERT_TRUE(etcd_->Restart().ok());
  EXPECT_TRUE(Eventually(
      [&] {
        auto listed = a->client().ListAgents();
        return listed.ok() && listed->agents_size() == 1;
      },
      absl::Seconds(10)));
  absl::SleepFor(kLeaseTtl + absl::Seconds(2));
  EXPECT_THAT(Listed(*a), ElementsAre(Self(*a)));
  auto keys = etcd_->Etcdctl({"get", "--prefix", "--keys-only", "/test/"});
  ASSERT_TRUE(keys.ok()) << keys.status();
  EXPECT_EQ(absl::StripAsciiWhitespace(*keys), "/test/agents/agent-a");
}

TEST_F(EtcdAuthTest, WrongPasswordOrNoUserPublishesNothing) {
  auto wrong = StartAgentOn(
      *etcd_, "wrong",
      {"--directory_user=agent",
       "--directory_password_file=" + PasswordFile("not-the-password")});
  auto anonymous = StartAgentOn(*etcd_, "anonymous", {});
  ASSERT_TRUE(wrong && anonymous);
  for (AgentProcess* refused : {wrong.get(), anonymous.get()}) {
    EXPECT_THAT(refused->Log(), HasSubstr("cannot publish agent"));
    const absl::Status listed = refused->client().ListAgents().status();
    EXPECT_FALSE(listed.ok());
    EXPECT_THAT(listed.message(), HasSubstr("ListAgents"));
  }
  auto keys = etcd_->Etcdctl({"get", "--prefix", "--keys-only", "/test/"});
  ASSERT_TRUE(keys.ok()) << keys.status();
  EXPECT_EQ(absl::StripAsciiWhitespace(*keys), "");
}

TEST(LocalDirectoryTest, AnAgentAloneListsItself) {
  auto a = AgentProcess::Start();
  ASSERT_TRUE(a.ok()) << a.status();
  auto listed = (*a)->client().ListAgents();
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_EQ(listed->directory(), "local");
  EXPECT_THAT(Listed(**a), ElementsAre(Self(**a)));
}

TEST(LocalDirectoryTest, NamesWorkOnOneHostWithoutEtcd) {
  auto a = AgentProcess::Start();
  ASSERT_TRUE(a.ok()) << a.status();
  auto buffer = (*a)->client().Allocate(4096, v1::ACCESS_READ);
  ASSERT_TRUE(buffer.ok());
  ASSERT_TRUE((*a)->client().Publish(buffer->id(), "local/name").ok());
  auto record = (*a)->client().Resolve("local/name");
  ASSERT_TRUE(record.ok()) << record.status();
  EXPECT_EQ(record->remote_context(), buffer->remote_context());
  ASSERT_TRUE((*a)->client().Release(buffer->id()).ok());
  EXPECT_TRUE(Eventually(
      [&] {
        return (*a)->client().Resolve("local/name").status().code() ==
               absl::StatusCode::kNotFound;
      },
      absl::Seconds(5)));
}

TEST(LocalDirectoryTest, WatchNamesOnOneHost) {
  auto a = AgentProcess::Start();
  ASSERT_TRUE(a.ok()) << a.status();
  auto buffer = (*a)->client().Allocate(4096, v1::ACCESS_READ);
  ASSERT_TRUE(buffer.ok());
  ASSERT_TRUE((*a)->client().Publish(buffer->id(), "x/1").ok());
  NameStream stream((*a)->client(), "x/");
  ASSERT_TRUE(stream.Saw({"+x/1", "synced"}));
  ASSERT_TRUE((*a)->client().Publish(buffer->id(), "x/2").ok());
  ASSERT_TRUE((*a)->client().Publish(buffer->id(), "y/2").ok());
  ASSERT_TRUE((*a)->client().Unpublish("x/1").ok());
  EXPECT_TRUE(stream.Saw({"+x/1", "synced", "+x/2", "-x/1"}));
}

TEST(DirectoryFlagsTest, MalformedDirectoryFlagsExitTwoNamingTheFlag) {
  for (const std::vector<std::string>& flags :
       std::vector<std::vector<std::string>>{{"--directory=consul://x:1"},
                                             {"--directory=etcd://nohostport"},
                                             {"--directory_prefix=noslash"},
                                             {"--directory_lease_ttl=1s"},
                                             {"--directory_user=agent"}}) {
    std::vector<std::string> argv = {RunfilePath("daemon/rdma-agentd"),
                                     "--runtime_dir=/tmp/rdma-agentd-dirflags",
                                     "--state_dir=/tmp/rdma-agentd-dirflags"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    auto run = RunToCompletion(argv, "", absl::Seconds(20));
    ASSERT_TRUE(run.ok()) << run.status();
    EXPECT_EQ(run->exit_code, 2) << flags[0] << ": " << run->err;
    const std::string name = std::string(
        absl::StripPrefix(flags[0].substr(0, flags[0].find('=')), "--"));
    EXPECT_THAT(run->out + run->err, HasSubstr("--" + name)) << flags[0];
  }
}

}  // namespace
}  // namespace rdma_agent

// Names in a real etcd (etcd-server) between real rdma-agentd processes:
// Register with a name (both or neither), the resolve cache fed by the
// agent's watch (a hit asks etcd nothing, republish and withdrawal reach
// it, its bound), etcd lost while agents run (cached names still move
// bytes, a cut-off agent stops claiming its own names, all is back after
// etcd returns), and a name republished by its restarted owner while a
// peer holds the old context.
#include <sys/stat.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "client/rdma_agent_client.h"
#include "common/grpc_status.h"
#include "gmock/gmock.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "rdma/agent/v1/agent.grpc.pb.h"
#include "tests/directory/name_calls.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/etcd_server.h"
#include "tests/testing/eventually.h"
#include "tests/testing/process.h"

namespace rdma_agent {
namespace {

namespace v1 = ::rdma::agent::v1;

using ::rdma_agent::testing::AgentProcess;
using ::rdma_agent::testing::EtcdServer;
using ::rdma_agent::testing::Eventually;
using ::rdma_agent::testing::RegisterNamed;
using ::rdma_agent::testing::RunfilePath;
using ::rdma_agent::testing::RunToCompletion;
using ::rdma_agent::testing::TcpAgentOptions;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr absl::Duration kLeaseTtl = absl::Seconds(3);
// Room for a loaded 2-core machine.
constexpr absl::Duration kPatience = absl::Seconds(20);

// Register straight on the API, with a name unless it is empty.
absl::StatusOr<v1::RegisterResponse> Register(
    AgentProcess& agent, const std::string& name,
    v1::Visibility visibility = v1::VISIBILITY_OWNER, uint64_t size = 4096) {
  return RegisterNamed(agent, name, kPatience, visibility, size);
}

// One op through `agent`'s Submit; its result.
v1::OpResult SubmitOne(AgentProcess& agent, const v1::Op& op) {
  absl::StatusOr<v1::OpResult> result =
      testing::SubmitOne(agent, op, kPatience);
  EXPECT_TRUE(result.ok()) << result.status();
  if (!result.ok()) {
    v1::OpResult failed;
    failed.set_code(grpc::StatusCode::UNKNOWN);
    failed.set_message(std::string(result.status().message()));
    return failed;
  }
  return *result;
}

// Reads [remote_offset, +length) of the remote into `local` at offset 8.
v1::Op ReadOp(uint64_t local, uint64_t remote_offset, uint64_t length) {
  v1::Op op;
  op.set_type(v1::OP_TYPE_READ_INTO_LOCAL);
  op.set_local_buffer_id(local);
  op.set_local_offset(8);
  op.set_length(length);
  op.set_remote_offset(remote_offset);
  return op;
}

// The value of one series (name and labels as exposed) in `agent`'s
// metrics, through rdma-agentctl metrics; -1 when absent.
double Metric(AgentProcess& agent, const std::string& series) {
  auto run = RunToCompletion({RunfilePath("client/rdma-agentctl"),
                              "--target=" + agent.target(), "metrics"},
                             "", kPatience);
  EXPECT_TRUE(run.ok()) << run.status();
  if (!run.ok()) return -1;
  EXPECT_EQ(run->exit_code, 0) << run->err;
  for (absl::string_view line : absl::StrSplit(run->out, '\n')) {
    if (!absl::ConsumePrefix(&line, series + " ")) continue;
    double value;
    if (absl::SimpleAtod(line, &value)) return value;
  }
  return -1;
}

constexpr char kEtcdGets[] =
    "rdma_agentd_directory_etcd_calls_total{operation=\"get\"}";
constexpr char kCacheHits[] =
    "rdma_agentd_directory_resolve_cache_lookups_total{result=\"hit\"}";
constexpr char kCacheEntries[] = "rdma_agentd_directory_resolve_cache_entries";

class NamesTest : public ::testing::Test {
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
        absl::StrCat("--directory_lease_ttl=", absl::FormatDuration(kLeaseTtl)),
        "--metrics_listen=127.0.0.1:0"};
    flags.insert(flags.end(), more_flags.begin(), more_flags.end());
    auto agent =
        AgentProcess::Start(TcpAgentOptions("127.0.0.1", "", std::move(flags)));
    EXPECT_TRUE(agent.ok()) << agent.status();
    return agent.ok() ? std::move(*agent) : nullptr;
  }

  // `agent` resolves `name` until the answer came from its cache (the
  // watch is synced by then; the first resolutions may have asked etcd).
  bool ResolveUntilCached(AgentProcess& agent, const std::string& name) {
    return Eventually(
        [&] {
          const double hits = Metric(agent, kCacheHits);
          if (!agent.client().Resolve(name).ok()) return false;
          return Metric(agent, kCacheHits) > hits;
        },
        kPatience);
  }

  std::unique_ptr<EtcdServer> etcd_;
};

TEST_F(NamesTest, RegisterWithANamePublishesItInTheSameCall) {
  auto a = StartAgent("agent-a");
  auto b = StartAgent("agent-b");
  ASSERT_TRUE(a && b);
  auto far = Register(*a, "kv/layer.0");
  ASSERT_TRUE(far.ok()) << far.status();
  ASSERT_TRUE(a->client()
                  .WriteBuffer(far->buffer_id(), 0, std::string(4096, 'f'))
                  .ok());
  // Another agent resolves it to the context Register answered.
  auto record = b->client().Resolve("kv/layer.0");
  ASSERT_TRUE(record.ok()) << record.status();
  EXPECT_EQ(record->remote_context(), far->remote_context());
  EXPECT_EQ(record->buffer_id(), far->buffer_id());
  EXPECT_EQ(record->visibility(), v1::VISIBILITY_OWNER);
  // And moves its bytes by name; nothing outside the op's range changes.
  auto near = Register(*b, "");
  ASSERT_TRUE(near.ok()) << near.status();
  v1::Op op = ReadOp(near->buffer_id(), 100, 1000);
  op.set_remote_name("kv/layer.0");
  v1::OpResult result = SubmitOne(*b, op);
  ASSERT_EQ(result.code(), 0) << result.message();
  auto bytes = b->client().ReadBuffer(near->buffer_id(), 0, 4096);
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ(*bytes, std::string(8, '\0') + std::string(1000, 'f') +
                        std::string(4096 - 1008, '\0'));
  // Released, the name goes with it.
  ASSERT_TRUE(a->client().Release(far->buffer_id()).ok());
  EXPECT_TRUE(Eventually(
      [&] {
        return b->client().Resolve("kv/layer.0").status().code() ==
               absl::StatusCode::kNotFound;
      },
      kPatience));

  // rdma-agentctl register --name does the same, for any user.
  auto run = RunToCompletion(
      {RunfilePath("client/rdma-agentctl"), "--target=" + a->target(),
       "register", "--size=4k", "--name=kv/ctl", "--any_user"},
      "", kPatience);
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_EQ(run->exit_code, 0) << run->err;
  auto ctl = b->client().Resolve("kv/ctl");
  ASSERT_TRUE(ctl.ok()) << ctl.status();
  EXPECT_EQ(ctl->visibility(), v1::VISIBILITY_ANY_USER);
  EXPECT_THAT(run->out,
              HasSubstr(absl::StrCat("buffer_id: ", ctl->buffer_id())));
}

TEST_F(NamesTest, RegisterWithANameThatCannotBePublishedRegistersNothing) {
  auto a = StartAgent("agent-a");
  auto b = StartAgent("agent-b");
  ASSERT_TRUE(a && b);
  ASSERT_TRUE(Register(*a, "taken").ok());
  // Another owner's name (the same uid on another agent).
  auto refused = Register(*b, "taken");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kAlreadyExists)
      << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("Register"));
  EXPECT_THAT(refused.status().message(), HasSubstr("\"taken\""));
  EXPECT_THAT(refused.status().message(), HasSubstr("agent agent-a"));
  auto listed = b->client().ListBuffers();
  ASSERT_TRUE(listed.ok());
  EXPECT_TRUE(listed->empty()) << listed->size() << " buffers left";
  // A malformed name is refused before anything is allocated.
  for (const char* bad : {"/abs", "a//b", "sp ace"}) {
    auto malformed = Register(*b, bad);
    EXPECT_EQ(malformed.status().code(), absl::StatusCode::kInvalidArgument)
        << bad;
  }
  auto stub = v1::RdmaAgent::NewStub(b->client().channel());
  {
    grpc::ClientContext context;
    v1::RegisterRequest request;
    request.set_allocate_bytes(4096);
    request.set_access(v1::ACCESS_READ);
    request.set_name("fine");
    request.set_name_visibility(static_cast<v1::Visibility>(7));
    v1::RegisterResponse response;
    const grpc::Status status = stub->Register(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(status.error_message(), HasSubstr("name_visibility"));
  }
  // etcd away: UNAVAILABLE naming etcd and the name, and no buffer either.
  etcd_->Kill();
  auto unreachable = Register(*b, "while-away");
  EXPECT_EQ(unreachable.status().code(), absl::StatusCode::kUnavailable)
      << unreachable.status();
  EXPECT_THAT(unreachable.status().message(), HasSubstr("etcd"));
  EXPECT_THAT(unreachable.status().message(), HasSubstr("\"while-away\""));
  listed = b->client().ListBuffers();
  ASSERT_TRUE(listed.ok());
  EXPECT_TRUE(listed->empty()) << listed->size() << " buffers left";
  // Without a name, Register does not need the directory.
  EXPECT_TRUE(Register(*b, "").ok());
}

TEST_F(NamesTest, ACachedResolutionAsksEtcdNothing) {
  auto a = StartAgent("agent-a");
  auto b = StartAgent("agent-b");
  ASSERT_TRUE(a && b);
  auto far = Register(*a, "cached/x");
  ASSERT_TRUE(far.ok()) << far.status();
  ASSERT_TRUE(ResolveUntilCached(*b, "cached/x"));
  auto near = Register(*b, "");
  ASSERT_TRUE(near.ok());
  const double gets = Metric(*b, kEtcdGets);
  const double hits = Metric(*b, kCacheHits);
  ASSERT_GE(gets, 1);
  for (int i = 0; i < 20; ++i) {
    auto record = b->client().Resolve("cached/x");
    ASSERT_TRUE(record.ok()) << record.status();
    EXPECT_EQ(record->remote_context(), far->remote_context());
  }
  v1::Op op = ReadOp(near->buffer_id(), 0, 64);
  op.set_remote_name("cached/x");
  for (int i = 0; i < 5; ++i) {
    const v1::OpResult result = SubmitOne(*b, op);
    EXPECT_EQ(result.code(), 0) << result.message();
  }
  EXPECT_EQ(Metric(*b, kEtcdGets), gets);
  EXPECT_EQ(Metric(*b, kCacheHits), hits + 25);
  // The publisher's gauges and lease renewals (every second with a 3 s TTL).
  EXPECT_EQ(Metric(*a, "rdma_agentd_directory_names_published"), 1);
  EXPECT_TRUE(Eventually(
      [&] {
        return Metric(*a,
                      "rdma_agentd_directory_lease_renewals_total{result="
                      "\"ok\"}") > 0;
      },
      kPatience));
  EXPECT_EQ(
      Metric(*a,
             "rdma_agentd_directory_lease_renewals_total{result=\"failed\"}"),
      0);
  // The caller's visibility is judged on cached records too.
  ASSERT_EQ(::chmod(b->runtime_dir().c_str(), 0755), 0);
  auto as_nobody =
      RunToCompletion({"setpriv", "--reuid=65534", "--regid=65534",
                       "--clear-groups", RunfilePath("client/rdma-agentctl"),
                       "--target=" + b->target(), "resolve", "cached/x"},
                      "", kPatience);
  ASSERT_TRUE(as_nobody.ok()) << as_nobody.status();
  EXPECT_EQ(as_nobody->exit_code, 1) << as_nobody->out;
  EXPECT_THAT(as_nobody->err, HasSubstr("NOT_FOUND"));
  EXPECT_EQ(Metric(*b, kEtcdGets), gets);
}

TEST_F(NamesTest, TheWatchUpdatesAndDropsCachedNames) {
  auto a = StartAgent("agent-a");
  auto b = StartAgent("agent-b");
  ASSERT_TRUE(a && b);
  auto first = Register(*a, "moving");
  auto second = Register(*a, "");
  ASSERT_TRUE(first.ok() && second.ok());
  ASSERT_TRUE(ResolveUntilCached(*b, "moving"));
  const double gets = Metric(*b, kEtcdGets);
  // Its owner moves the name to another buffer: the cached entry follows,
  // from the watch, not from asking etcd again.
  ASSERT_TRUE(a->client().Publish(second->buffer_id(), "moving").ok());
  EXPECT_TRUE(Eventually(
      [&] {
        auto record = b->client().Resolve("moving");
        return record.ok() && record->buffer_id() == second->buffer_id();
      },
      kPatience));
  EXPECT_EQ(Metric(*b, kEtcdGets), gets);
  // Withdrawn: dropped, and the next resolution asks etcd (NOT_FOUND).
  ASSERT_TRUE(a->client().Unpublish("moving").ok());
  EXPECT_TRUE(
      Eventually([&] { return Metric(*b, kCacheEntries) == 0; }, kPatience));
  EXPECT_EQ(b->client().Resolve("moving").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(Metric(*b, kEtcdGets), gets + 1);
}

TEST_F(NamesTest, TheCacheKeepsAtMostItsBound) {
  auto a = StartAgent("agent-a");
  auto b = StartAgent("agent-b", {"--directory_resolve_cache_entries=2"});
  ASSERT_TRUE(a && b);
  for (const char* name : {"n/1", "n/2", "n/3"}) {
    ASSERT_TRUE(Register(*a, name).ok()) << name;
  }
  ASSERT_TRUE(ResolveUntilCached(*b, "n/1"));
  ASSERT_TRUE(ResolveUntilCached(*b, "n/2"));
  ASSERT_TRUE(ResolveUntilCached(*b, "n/3"));
  EXPECT_EQ(Metric(*b, kCacheEntries), 2);
  // n/1, the least recently used, went: resolving it asks etcd again.
  const double gets = Metric(*b, kEtcdGets);
  ASSERT_TRUE(b->client().Resolve("n/1").ok());
  EXPECT_EQ(Metric(*b, kEtcdGets), gets + 1);
  EXPECT_EQ(Metric(*b, kCacheEntries), 2);
  // With the cache off, every resolution asks etcd.
  auto c = StartAgent("agent-c", {"--directory_resolve_cache_entries=0"});
  ASSERT_TRUE(c);
  const double c_gets = Metric(*c, kEtcdGets);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(c->client().Resolve("n/2").ok());
  EXPECT_EQ(Metric(*c, kEtcdGets), c_gets + 3);
}

TEST_F(NamesTest, EtcdLostCachedNamesStillMoveBytesAndComeBackAfter) {
  auto a = StartAgent("agent-a");
  auto b = StartAgent("agent-b");
  ASSERT_TRUE(a && b);
  auto far = Register(*a, "outage/cached");
  ASSERT_TRUE(far.ok()) << far.status();
  ASSERT_TRUE(a->client()
                  .WriteBuffer(far->buffer_id(), 0, std::string(4096, 'o'))
                  .ok());
  ASSERT_TRUE(Register(*a, "outage/other").ok());
  ASSERT_TRUE(ResolveUntilCached(*b, "outage/cached"));
  auto near = Register(*b, "");
  ASSERT_TRUE(near.ok());

  etcd_->Kill();
  // A name B never resolved: UNAVAILABLE naming etcd, at once (no call
  // timeout waited out) once B's watch has seen etcd go.
  EXPECT_TRUE(Eventually(
      [&] {
        const absl::Status status =
            b->client().Resolve("outage/other").status();
        return status.code() == absl::StatusCode::kUnavailable &&
               absl::StrContains(status.message(), "watch is down");
      },
      kPatience));
  const absl::Time asked = absl::Now();
  const absl::Status other = b->client().Resolve("outage/other").status();
  EXPECT_LT(absl::Now() - asked, absl::Seconds(1));
  EXPECT_EQ(other.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(other.message(), HasSubstr(etcd_->directory()));

  // Past the lease's life: B still resolves what it cached, and moves the
  // bytes by name (A's buffer lives on, whatever etcd does).
  absl::SleepFor(kLeaseTtl + absl::Seconds(1));
  EXPECT_TRUE(b->client().Resolve("outage/cached").ok());
  v1::Op op = ReadOp(near->buffer_id(), 10, 2000);
  op.set_remote_name("outage/cached");
  v1::OpResult result = SubmitOne(*b, op);
  ASSERT_EQ(result.code(), 0) << result.message();
  auto bytes = b->client().ReadBuffer(near->buffer_id(), 0, 4096);
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ(*bytes, std::string(8, '\0') + std::string(2000, 'o') +
                        std::string(4096 - 2008, '\0'));
  EXPECT_GT(
      Metric(*a,
             "rdma_agentd_directory_lease_renewals_total{result=\"failed\"}"),
      0);
  EXPECT_GT(
      Metric(*b,
             "rdma_agentd_directory_etcd_errors_total{operation=\"watch\"}"),
      0);
  // A, whose lease could not be renewed, no longer claims its own names.
  const absl::Status own = a->client().Resolve("outage/cached").status();
  EXPECT_EQ(own.code(), absl::StatusCode::kUnavailable) << own;
  const absl::Status publish =
      a->client().Publish(far->buffer_id(), "outage/new");
  EXPECT_EQ(publish.code(), absl::StatusCode::kUnavailable) << publish;

  // etcd back: A puts its names again, B's watch catches up and misses
  // are asked again.
  ASSERT_TRUE(etcd_->Restart().ok());
  EXPECT_TRUE(Eventually(
      [&] {
        auto got = etcd_->Etcdctl(
            {"get", "--keys-only", "--prefix", "/test/names/outage/"});
        return got.ok() && absl::StrContains(*got, "outage/cached") &&
               absl::StrContains(*got, "outage/other");
      },
      kPatience));
  EXPECT_TRUE(Eventually(
      [&] { return b->client().Resolve("outage/other").ok(); }, kPatience));
  EXPECT_TRUE(Eventually(
      [&] { return a->client().Resolve("outage/cached").ok(); }, kPatience));
  result = SubmitOne(*b, op);
  EXPECT_EQ(result.code(), 0) << result.message();
}

// A crashed agent's lease takes all its names at once (one etcd revision):
// every one of them leaves the other agents' caches and watches.
TEST_F(NamesTest, EveryNameOfACrashedAgentLeavesTheCaches) {
  auto a = StartAgent("agent-a");
  auto b = StartAgent("agent-b");
  ASSERT_TRUE(a && b);
  const std::vector<std::string> names = {"crash/1", "crash/2", "crash/3"};
  for (const std::string& name : names) {
    ASSERT_TRUE(Register(*a, name).ok()) << name;
    ASSERT_TRUE(ResolveUntilCached(*b, name)) << name;
  }
  testing::Subprocess::Options options;
  options.argv = {RunfilePath("client/rdma-agentctl"),
                  "--target=" + b->target(), "names", "crash/", "--watch"};
  options.pipe_stdio = true;
  auto follower = testing::Subprocess::Spawn(std::move(options));
  ASSERT_TRUE(follower.ok()) << follower.status();
  ASSERT_TRUE(follower->WaitForLine("synced", kPatience).ok());
  a->Kill();
  for (const std::string& name : names) {
    EXPECT_TRUE(Eventually(
        [&] {
          return b->client().Resolve(name).status().code() ==
                 absl::StatusCode::kNotFound;
        },
        kLeaseTtl + kPatience))
        << name;
  }
  std::string seen;
  for (const std::string& name : names) {
    EXPECT_TRUE(
        follower
            ->WaitForLine("withdrawn " + name, kPatience,
                          [&](const std::string& line) { seen += line + "\n"; })
            .ok())
        << name << " not among\n"
        << seen;
  }
}

TEST_F(NamesTest, ANameRepublishedAfterItsOwnerRestartsReachesThePeer) {
  auto a = StartAgent("agent-a");
  auto b = StartAgent("agent-b");
  ASSERT_TRUE(a && b);
  auto old_far = Register(*a, "republished");
  ASSERT_TRUE(old_far.ok()) << old_far.status();
  auto near = Register(*b, "");
  ASSERT_TRUE(near.ok());
  ASSERT_TRUE(ResolveUntilCached(*b, "republished"));
  auto old_record = b->client().Resolve("republished");
  ASSERT_TRUE(old_record.ok());
  v1::Op by_name = ReadOp(near->buffer_id(), 0, 100);
  by_name.set_remote_name("republished");
  ASSERT_EQ(SubmitOne(*b, by_name).code(), 0);

  // The owner's agent restarts (new epoch) and the owner registers again
  // under the same name.
  a->Kill();
  const absl::Status restarted = a->Restart();
  ASSERT_TRUE(restarted.ok()) << restarted << "\n" << a->Log();
  auto new_far = Register(*a, "republished");
  ASSERT_TRUE(new_far.ok()) << new_far.status();
  ASSERT_TRUE(a->client()
                  .WriteBuffer(new_far->buffer_id(), 0, std::string(100, 'n'))
                  .ok());
  // The peer's old context is refused for its epoch...
  v1::Op by_context = ReadOp(near->buffer_id(), 0, 100);
  by_context.set_remote_context(old_record->remote_context());
  const v1::OpResult stale = SubmitOne(*b, by_context);
  EXPECT_EQ(stale.code(), grpc::StatusCode::FAILED_PRECONDITION)
      << stale.message();
  // ...and the name reaches the new buffer as soon as B's watch delivers
  // the change.
  EXPECT_TRUE(Eventually(
      [&] {
        auto record = b->client().Resolve("republished");
        return record.ok() &&
               record->remote_context() == new_far->remote_context();
      },
      kPatience));
  const v1::OpResult fresh = SubmitOne(*b, by_name);
  ASSERT_EQ(fresh.code(), 0) << fresh.message();
  auto bytes = b->client().ReadBuffer(near->buffer_id(), 0, 200);
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ(*bytes, std::string(8, '\0') + std::string(100, 'n') +
                        std::string(92, '\0'));
}

// WatchNames run by another local user (nobody, through setpriv and
// rdma-agentctl names): its snapshot and its events show the names it
// publishes itself and those published for any user, nothing else, not
// even the withdrawal of a name it could not see.
TEST_F(NamesTest, AnotherUserWatchesOnlyItsOwnAndSharedNames) {
  auto a = StartAgent("agent-a");
  auto b = StartAgent("agent-b");
  ASSERT_TRUE(a && b);
  // mkdtemp made it 0700; the daemon makes its sockets 0666.
  ASSERT_EQ(::chmod(b->runtime_dir().c_str(), 0755), 0);
  auto as_nobody = [&](std::vector<std::string> args) {
    std::vector<std::string> argv = {"setpriv",
                                     "--reuid=65534",
                                     "--regid=65534",
                                     "--clear-groups",
                                     RunfilePath("client/rdma-agentctl"),
                                     "--target=" + b->target()};
    argv.insert(argv.end(), args.begin(), args.end());
    return argv;
  };
  auto private_name = Register(*a, "w/private");
  auto shared_name = Register(*a, "w/shared", v1::VISIBILITY_ANY_USER);
  ASSERT_TRUE(private_name.ok() && shared_name.ok());
  auto own = RunToCompletion(
      as_nobody({"register", "--size=4k", "--name=w/nobody"}), "", kPatience);
  ASSERT_TRUE(own.ok()) << own.status();
  ASSERT_EQ(own->exit_code, 0) << own->err;

  auto snapshot = RunToCompletion(as_nobody({"names", "w/"}), "", kPatience);
  ASSERT_TRUE(snapshot.ok()) << snapshot.status();
  ASSERT_EQ(snapshot->exit_code, 0) << snapshot->err;
  EXPECT_THAT(snapshot->out, HasSubstr("w/shared: buffer"));
  EXPECT_THAT(snapshot->out, HasSubstr("w/nobody: buffer"));
  EXPECT_THAT(snapshot->out, Not(HasSubstr("w/private")));
  // The owner (root) sees its own names too.
  auto root = RunToCompletion({RunfilePath("client/rdma-agentctl"),
                               "--target=" + b->target(), "names", "w/"},
                              "", kPatience);
  ASSERT_TRUE(root.ok());
  EXPECT_THAT(root->out, HasSubstr("w/private: buffer"));

  testing::Subprocess::Options options;
  options.argv = as_nobody({"names", "w/", "--watch"});
  options.pipe_stdio = true;
  auto follower = testing::Subprocess::Spawn(std::move(options));
  ASSERT_TRUE(follower.ok()) << follower.status();
  ASSERT_TRUE(follower->WaitForLine("synced", kPatience).ok());
  ASSERT_TRUE(Register(*a, "w/private2").ok());
  ASSERT_TRUE(a->client().Release(private_name->buffer_id()).ok());
  ASSERT_TRUE(Register(*a, "w/shared2", v1::VISIBILITY_ANY_USER).ok());
  ASSERT_TRUE(a->client().Release(shared_name->buffer_id()).ok());
  std::string seen;
  const absl::Status last = follower->WaitForLine(
      "withdrawn w/shared", kPatience,
      [&](const std::string& line) { seen += line + "\n"; });
  EXPECT_TRUE(last.ok()) << last << "\n" << seen;
  EXPECT_THAT(seen, HasSubstr("w/shared2: buffer"));
  EXPECT_THAT(seen, Not(HasSubstr("private")));
}

}  // namespace
}  // namespace rdma_agent

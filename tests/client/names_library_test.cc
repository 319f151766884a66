// The C++ client's names API against real rdma-agentd processes: WatchNames
// delivers the snapshot, SYNCED and each change under its prefix, ends with
// its agent, and stops on destruction; ops name their remote by
// OpSpec::remote_name; across two agents sharing a real etcd, a peer
// waiting on a watch sees the other agent's name appear and moves bytes to
// it by name, and a Buffer rejoins under its name after its agent restarts.

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/rdma_agent_client.h"
#include "gtest/gtest.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/etcd_server.h"
#include "tests/testing/eventually.h"
#include "tests/testing/pattern.h"

namespace rdma_agent::testing {
namespace {

namespace v1 = ::rdma::agent::v1;
using client::OpSpec;

// What a watch delivered, as "KIND name" lines, and the records.
class EventLog {
 public:
  client::NameEventCallback Callback() {
    return [this](const v1::NameEvent& event) {
      absl::MutexLock lock(&mu_);
      events_.push_back(event);
    };
  }
  std::vector<v1::NameEvent> events() const {
    absl::MutexLock lock(&mu_);
    return events_;
  }
  std::vector<std::string> lines() const {
    std::vector<std::string> lines;
    for (const v1::NameEvent& event : events()) {
      lines.push_back(v1::NameEvent::Kind_Name(event.kind()) +
                      (event.has_record() ? " " + event.record().name() : ""));
    }
    return lines;
  }
  // True once `count` events have come, within 10 s.
  bool WaitFor(size_t count) const {
    return Eventually([&] { return events().size() >= count; });
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<v1::NameEvent> events_ ABSL_GUARDED_BY(mu_);
};

using Lines = std::vector<std::string>;

TEST(NamesLibraryTest, WatchDeliversSnapshotSyncedThenChangesUnderItsPrefix) {
  auto agent = AgentProcess::Start();
  ASSERT_TRUE(agent.ok()) << agent.status();
  client::AgentClient& client = (*agent)->client();
  auto first = client.Attach(4096, v1::ACCESS_READ_WRITE);
  auto second = client.Attach(8192, v1::ACCESS_READ);
  ASSERT_TRUE(first.ok() && second.ok());
  ASSERT_TRUE(client.Publish(first->id(), "kv/first").ok());
  ASSERT_TRUE(client.Publish(first->id(), "other/first").ok());

  EventLog log;
  auto watch = client.WatchNames("kv/", log.Callback());
  ASSERT_TRUE(watch.ok()) << watch.status();
  ASSERT_TRUE(watch->WaitSynced(absl::Seconds(10)).ok());
  EXPECT_EQ(log.lines(), (Lines{"PUBLISHED kv/first", "SYNCED"}));
  EXPECT_EQ(log.events()[0].record().remote_context(), first->remote_context());
  EXPECT_EQ(log.events()[0].record().buffer_id(), first->id());

  ASSERT_TRUE(client.Publish(second->id(), "kv/second").ok());
  ASSERT_TRUE(client.Publish(second->id(), "other/second").ok());  // unseen
  ASSERT_TRUE(client.Unpublish("kv/second").ok());
  ASSERT_TRUE(first->Release().ok());  // its names go with it
  ASSERT_TRUE(log.WaitFor(5)) << ::testing::PrintToString(log.lines());
  EXPECT_EQ(log.lines(),
            (Lines{"PUBLISHED kv/first", "SYNCED", "PUBLISHED kv/second",
                   "WITHDRAWN kv/second", "WITHDRAWN kv/first"}));
  const std::vector<v1::NameEvent> events = log.events();
  EXPECT_EQ(events[2].record().remote_context(), second->remote_context());
  EXPECT_EQ(events[2].record().buffer_id(), second->id());
  EXPECT_TRUE(events[3].record().remote_context().empty());
  EXPECT_TRUE(watch->status().ok()) << watch->status();

  watch->Stop();
  EXPECT_EQ(watch->status().code(), absl::StatusCode::kCancelled);
  // Nothing more arrives after Stop.
  ASSERT_TRUE(client.Publish(second->id(), "kv/late").ok());
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(log.events().size(), 5u);
}

TEST(NamesLibraryTest, WatchEndsWithItsAgentAndCancelsOnDestruction) {
  auto agent = AgentProcess::Start();
  ASSERT_TRUE(agent.ok()) << agent.status();
  auto other = (*agent)->NewClient();
  ASSERT_TRUE(other.ok()) << other.status();

  EventLog log;
  {
    auto scoped = (*other)->WatchNames("", log.Callback());
    ASSERT_TRUE(scoped.ok());
    ASSERT_TRUE(scoped->WaitSynced(absl::Seconds(10)).ok());
  }  // destroyed: cancelled and joined, the agent frees the stream
  EXPECT_EQ(log.lines(), (Lines{"SYNCED"}));

  auto watch = (*other)->WatchNames("", log.Callback());
  ASSERT_TRUE(watch.ok());
  ASSERT_TRUE(watch->WaitSynced(absl::Seconds(10)).ok());
  (*agent)->Kill();
  ASSERT_TRUE(Eventually([&] { return !watch->status().ok(); }));
  EXPECT_EQ(watch->status().code(), absl::StatusCode::kUnavailable)
      << watch->status();
  // A watch whose stream has ended reports it to a waiter at once.
  EXPECT_EQ(watch->WaitSynced(absl::Seconds(5)).code(),
            absl::StatusCode::kOk);  // it had synced before
  EXPECT_EQ((*other)->WatchNames("", nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(NamesLibraryTest, WaitSyncedReportsAStreamTheAgentRefused) {
  AgentProcess::Options options;
  options.extra_flags = {"--max_name_watches_per_user=1"};
  auto agent = AgentProcess::Start(options);
  ASSERT_TRUE(agent.ok()) << agent.status();
  client::AgentClient& client = (*agent)->client();
  EventLog log;
  auto too_long = client.WatchNames(std::string(300, 'x'), log.Callback());
  ASSERT_TRUE(too_long.ok());
  const absl::Status refused = too_long->WaitSynced(absl::Seconds(10));
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_EQ(too_long->status(), refused);

  auto first = client.WatchNames("", log.Callback());
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(first->WaitSynced(absl::Seconds(10)).ok());
  auto second = client.WatchNames("", log.Callback());
  ASSERT_TRUE(second.ok());
  const absl::Status over = second->WaitSynced(absl::Seconds(10));
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted) << over;
  EXPECT_EQ(log.lines(), (Lines{"SYNCED"}));
}

TEST(NamesLibraryTest, AnOpNamesItsRemoteByName) {
  auto agent = AgentProcess::Start();
  ASSERT_TRUE(agent.ok()) << agent.status();
  client::AgentClient& client = (*agent)->client();
  auto source = client.Attach(4096, v1::ACCESS_READ);
  auto sink = client.Attach(4096, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(source.ok() && sink.ok());
  FillPattern(source->bytes(), 7);
  FillPattern(sink->bytes(), 8);
  ASSERT_TRUE(client.Publish(source->id(), "blocks/7").ok());

  OpSpec op;
  op.type = v1::OP_TYPE_READ_INTO_LOCAL;
  op.local_buffer_id = sink->id();
  op.local_offset = 100;
  op.length = 1000;
  op.remote_name = "blocks/7";
  op.remote_offset = 200;
  auto results = client.Submit({op}, absl::Seconds(5));
  ASSERT_TRUE(results.ok()) << results.status();
  ASSERT_TRUE((*results)[0].status.ok()) << (*results)[0].status;
  // [100, 1100) holds the source's [200, 1200); the rest is untouched.
  EXPECT_EQ(FirstMismatch(sink->bytes(), 7, 200, 100, 1000, 8), std::nullopt);

  op.remote_name = "blocks/none";
  results = client.Submit({op}, absl::Seconds(5));
  ASSERT_TRUE(results.ok()) << results.status();
  EXPECT_EQ((*results)[0].status.code(), absl::StatusCode::kNotFound);
}

// A decode peer on agent B waits on a watch for the prefill peer's block on
// agent A (the two share a real etcd) and reads it by name over tcp.
TEST(NamesLibraryTest, APeerWaitsForAnotherAgentsNameThroughEtcd) {
  auto etcd = EtcdServer::Start();
  ASSERT_TRUE(etcd.ok()) << etcd.status();
  auto start = [&](const std::string& id) {
    AgentProcess::Options options;
    options.backends = "memory,tcp";
    options.extra_flags = {"--agent_id=" + id,
                           "--directory=" + (*etcd)->directory()};
    return AgentProcess::Start(options);
  };
  auto a = start("agent-a");
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = start("agent-b");
  ASSERT_TRUE(b.ok()) << b.status();

  EventLog log;
  auto watch = (*b)->client().WatchNames("prefill/", log.Callback());
  ASSERT_TRUE(watch.ok());
  ASSERT_TRUE(watch->WaitSynced(absl::Seconds(10)).ok());
  EXPECT_EQ(log.lines(), (Lines{"SYNCED"}));

  constexpr uint64_t kSize = 1 << 20;
  auto block = (*a)->client().Attach(kSize, v1::ACCESS_READ);
  ASSERT_TRUE(block.ok());
  FillPattern(block->bytes(), 21);
  ASSERT_TRUE((*a)->client().Publish(block->id(), "prefill/block-0").ok());
  ASSERT_TRUE(log.WaitFor(2)) << ::testing::PrintToString(log.lines());
  const v1::NameEvent published = log.events()[1];
  EXPECT_EQ(published.kind(), v1::NameEvent::PUBLISHED);
  EXPECT_EQ(published.record().name(), "prefill/block-0");
  EXPECT_EQ(published.record().agent_id(), "agent-a");
  EXPECT_EQ(published.record().remote_context(), block->remote_context());

  auto sink = (*b)->client().Attach(kSize + 4096, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(sink.ok());
  FillPattern(sink->bytes(), 22);
  OpSpec op;
  op.type = v1::OP_TYPE_READ_INTO_LOCAL;
  op.local_buffer_id = sink->id();
  op.local_offset = 4096;
  op.length = kSize;
  op.remote_name = "prefill/block-0";
  auto results = (*b)->client().Submit({op}, absl::Seconds(10));
  ASSERT_TRUE(results.ok()) << results.status();
  ASSERT_TRUE((*results)[0].status.ok()) << (*results)[0].status;
  EXPECT_EQ((*results)[0].backend, "tcp");
  EXPECT_EQ(FirstMismatch(sink->bytes(), 21, 0, 4096, kSize, 22), std::nullopt);

  // The prefill peer is done with it: the watcher learns it.
  ASSERT_TRUE(block->Release().ok());
  ASSERT_TRUE(log.WaitFor(3)) << ::testing::PrintToString(log.lines());
  EXPECT_EQ(log.lines()[2], "WITHDRAWN prefill/block-0");
}

// Buffer::Rejoin after the publishing agent is killed and restarted: the
// same memory is registered on the new epoch under the same name, and a
// peer on another agent writes into it by name.
TEST(NamesLibraryTest, ABufferRejoinsUnderItsNameAfterItsAgentRestarts) {
  auto etcd = EtcdServer::Start();
  ASSERT_TRUE(etcd.ok()) << etcd.status();
  auto start = [&](const std::string& id) {
    AgentProcess::Options options;
    options.backends = "memory,tcp";
    options.extra_flags = {"--agent_id=" + id,
                           "--directory=" + (*etcd)->directory()};
    return AgentProcess::Start(options);
  };
  auto a = start("agent-a");
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = start("agent-b");
  ASSERT_TRUE(b.ok()) << b.status();
  // A client of its own: AgentProcess's goes with the process.
  auto owner = (*a)->NewClient();
  ASSERT_TRUE(owner.ok()) << owner.status();

  constexpr uint64_t kSize = 64 << 10;
  auto mine = (*owner)->Attach(kSize, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(mine.ok()) << mine.status();
  FillPattern(mine->bytes(), 31);
  std::byte* const memory = mine->data();
  ASSERT_TRUE(mine->Publish("kv/rejoined", v1::VISIBILITY_ANY_USER).ok());
  ASSERT_TRUE(mine->Publish("kv/withdrawn").ok());
  ASSERT_TRUE(mine->Unpublish("kv/withdrawn").ok());
  EXPECT_EQ(mine->names().size(), 1u);
  // Nothing to do while the agent runs.
  auto rejoined = mine->Rejoin();
  ASSERT_TRUE(rejoined.ok()) << rejoined.status();
  EXPECT_FALSE(*rejoined);
  auto unmappable = (*owner)->Allocate(4096, v1::ACCESS_READ);
  ASSERT_TRUE(unmappable.ok());
  EXPECT_EQ(unmappable->Rejoin().status().code(),
            absl::StatusCode::kFailedPrecondition);
  const std::string old_context = mine->remote_context();

  (*a)->Kill();
  const absl::Status restarted = (*a)->Restart();
  ASSERT_TRUE(restarted.ok()) << restarted << "\n" << (*a)->Log();
  rejoined = mine->Rejoin();
  ASSERT_TRUE(rejoined.ok()) << rejoined.status();
  EXPECT_TRUE(*rejoined);
  EXPECT_NE(mine->remote_context(), old_context);
  EXPECT_EQ(mine->data(), memory);
  EXPECT_EQ(mine->names().count("kv/rejoined"), 1u);
  auto info = (*a)->client().GetInfo();
  ASSERT_TRUE(info.ok());
  // The peer's re-resolve finds the new registration (etcd may still hold
  // the old record until the restarted agent's Publish replaced it).
  ASSERT_TRUE(Eventually([&] {
    auto record = (*b)->client().Resolve("kv/rejoined");
    return record.ok() && record->agent_epoch() == info->epoch();
  }));
  auto record = (*b)->client().Resolve("kv/rejoined");
  EXPECT_EQ(record->remote_context(), mine->remote_context());
  EXPECT_EQ(record->buffer_id(), mine->id());
  EXPECT_EQ(record->visibility(), v1::VISIBILITY_ANY_USER);

  auto theirs = (*b)->client().Attach(4096, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(theirs.ok());
  FillPattern(theirs->bytes(), 32);
  OpSpec op;
  op.type = v1::OP_TYPE_WRITE_FROM_LOCAL;
  op.local_buffer_id = theirs->id();
  op.length = 4096;
  op.remote_name = "kv/rejoined";
  op.remote_offset = 8192;
  auto results = (*b)->client().Submit({op}, absl::Seconds(10));
  ASSERT_TRUE(results.ok()) << results.status();
  ASSERT_TRUE((*results)[0].status.ok()) << (*results)[0].status;
  EXPECT_EQ(FirstMismatch(mine->bytes(), 32, 0, 8192, 4096, 31), std::nullopt);
  // The released buffer's name goes with it.
  ASSERT_TRUE(mine->Release().ok());
  EXPECT_TRUE(mine->names().empty());
  EXPECT_TRUE(Eventually([&] {
    return (*b)->client().Resolve("kv/rejoined").status().code() ==
           absl::StatusCode::kNotFound;
  }));
}

}  // namespace
}  // namespace rdma_agent::testing

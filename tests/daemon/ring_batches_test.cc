// What protocol version 2 of the ring (docs/RING.md) adds, against an
// in-process agent (memory and tcp) whose remote peer is a real rdma-agentd
// process over loopback tcp: prepared transfers run by one entry,
// notifications delivered to the remote buffer's owner, batches that run
// asynchronously (several in flight, cancelled by a CANCEL entry, cancelled
// when their session ends). A peer held with SIGSTOP keeps a batch running
// for as long as a test needs; bytes are checked inside and outside every
// op's range, and after the peer resumes, to show nothing of a cancelled
// batch lands.
#include <unistd.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/ring.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/agent_fixture.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/backend_factories.h"
#include "tests/testing/eventually.h"
#include "tests/testing/pattern.h"

namespace rdma_agent::testing {
namespace {

using client::Ring;
using client::RingCompletion;
using client::RingOp;
using ::testing::HasSubstr;

constexpr uint64_t kSize = 4096;
constexpr size_t kMaxOpsPerUser = 16;
constexpr v1::OpType kRead = v1::OP_TYPE_READ_INTO_LOCAL;
constexpr v1::OpType kWrite = v1::OP_TYPE_WRITE_FROM_LOCAL;

class RingBatchesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    AgentOptions options;
    options.backends = {MemoryFactory(), LoopbackTcpFactory()};
    options.in_flight.max_ops_per_user = kMaxOpsPerUser;
    // Two workers: batches with a notification run on them as transfers.
    options.transfers.workers = 2;
    auto a = InProcessAgent::Start(std::move(options));
    ASSERT_TRUE(a.ok()) << a.status();
    a_ = std::move(*a);
    AgentProcess::Options b_options;
    b_options.backends = "memory,tcp";
    auto b = AgentProcess::Start(b_options);
    ASSERT_TRUE(b.ok()) << b.status();
    b_ = std::move(*b);
    b_stub_ = v1::RdmaAgent::NewStub(b_->client().channel());
    auto ring =
        Ring::Open(a_->agent().attach_socket_path(), 16, absl::Seconds(10));
    ASSERT_TRUE(ring.ok()) << ring.status();
    ring_ = std::move(*ring);
  }

  void TearDown() override {
    if (b_ != nullptr) b_->Resume();
    if (HasFailure() && b_ != nullptr) {
      ADD_FAILURE() << "agent b log:\n" << b_->Log();
    }
  }

  static uint64_t Allocated(v1::RdmaAgent::Stub& stub, int seed,
                            std::string* context) {
    grpc::ClientContext call;
    v1::RegisterRequest request;
    request.set_allocate_bytes(kSize);
    request.set_access(v1::ACCESS_READ_WRITE);
    v1::RegisterResponse registered;
    EXPECT_TRUE(stub.Register(&call, request, &registered).ok());
    grpc::ClientContext write_call;
    v1::WriteBufferRequest write;
    write.set_buffer_id(registered.buffer_id());
    write.set_data(PatternString(seed, 0, kSize));
    v1::WriteBufferResponse written;
    EXPECT_TRUE(stub.WriteBuffer(&write_call, write, &written).ok());
    *context = registered.remote_context();
    return registered.buffer_id();
  }

  static std::string Read(v1::RdmaAgent::Stub& stub, uint64_t id) {
    grpc::ClientContext call;
    v1::ReadBufferRequest request;
    request.set_buffer_id(id);
    request.set_length(kSize);
    v1::ReadBufferResponse response;
    EXPECT_TRUE(stub.ReadBuffer(&call, request, &response).ok());
    return response.data();
  }

  // A buffer of the in-process agent (A), filled with pattern `seed`.
  uint64_t Local(int seed) {
    std::string context;
    const uint64_t id = Allocated(a_->stub(), seed, &context);
    contexts_[id] = context;
    return id;
  }
  // A buffer of the remote agent (B), filled with pattern `seed`.
  uint64_t Remote(int seed) {
    std::string context;
    const uint64_t id = Allocated(*b_stub_, seed, &context);
    remote_contexts_[id] = context;
    return id;
  }

  uint64_t Import(const std::string& context) {
    grpc::ClientContext call;
    v1::ImportRemoteRequest request;
    request.set_remote_context(context);
    v1::ImportRemoteResponse response;
    EXPECT_TRUE(a_->stub().ImportRemote(&call, request, &response).ok());
    return response.remote_handle();
  }

  static RingOp Op(v1::OpType type, uint64_t local, uint64_t local_offset,
                   uint64_t length, uint64_t handle, uint64_t remote_offset,
                   uint64_t tag) {
    return RingOp{type,   local,         local_offset, length,
                  handle, remote_offset, tag};
  }

  // Waits for `count` completions, by tag.
  // The next `count` completions, in the order posted.
  std::vector<RingCompletion> ReapInOrder(size_t count) {
    std::vector<RingCompletion> ends;
    while (ends.size() < count) {
      auto got = ring_->Wait(&ends, absl::Seconds(20));
      EXPECT_TRUE(got.ok()) << got.status();
      if (!got.ok()) break;
    }
    return ends;
  }

  std::map<uint64_t, RingCompletion> Reap(size_t count) {
    std::vector<RingCompletion> ends = ReapInOrder(count);
    std::map<uint64_t, RingCompletion> by_tag;
    for (RingCompletion& end : ends) by_tag[end.user_tag] = std::move(end);
    EXPECT_EQ(by_tag.size(), ends.size()) << "a tag completed twice";
    return by_tag;
  }

  // The batches of this process's ring sessions taken and not completed.
  uint64_t RingBatchesInFlight() {
    uint64_t batches = 0;
    for (const RingSessionInfo& session :
         a_->agent().rings().List(::geteuid())) {
      batches += session.batches_in_flight;
    }
    return batches;
  }

  // Until the agent has taken `count` batches that have not ended.
  bool Running(size_t count) {
    return Eventually([&] { return RingBatchesInFlight() == count; });
  }

  std::unique_ptr<InProcessAgent> a_;
  std::unique_ptr<AgentProcess> b_;
  std::unique_ptr<v1::RdmaAgent::Stub> b_stub_;
  std::unique_ptr<Ring> ring_;
  std::map<uint64_t, std::string> contexts_;
  std::map<uint64_t, std::string> remote_contexts_;
};

TEST_F(RingBatchesTest, APreparedTransferRunsAsOneEntry) {
  const uint64_t into = Local(1);
  const uint64_t from = Local(2);
  const uint64_t remote = Remote(3);
  v1::PrepareTransferRequest prepare;
  v1::Op* read = prepare.add_ops();
  read->set_type(kRead);
  read->set_local_buffer_id(into);
  read->set_local_offset(100);
  read->set_length(200);
  read->set_remote_context(remote_contexts_[remote]);
  read->set_remote_offset(1000);
  v1::Op* write = prepare.add_ops();
  write->set_type(kWrite);
  write->set_local_buffer_id(from);
  write->set_local_offset(300);
  write->set_length(50);
  write->set_remote_context(remote_contexts_[remote]);
  write->set_remote_offset(2000);
  grpc::ClientContext call;
  v1::PrepareTransferResponse prepared;
  ASSERT_TRUE(a_->stub().PrepareTransfer(&call, prepare, &prepared).ok());

  ASSERT_TRUE(ring_->RunPrepared(prepared.prepared_id(), 9).ok());
  auto ends = Reap(1);
  ASSERT_EQ(ends.count(9), 1u);
  EXPECT_TRUE(ends[9].status.ok()) << ends[9].status;
  EXPECT_EQ(ends[9].backend, "tcp");
  std::string into_expected = PatternString(1, 0, kSize);
  into_expected.replace(100, 200, PatternString(3, 1000, 200));
  EXPECT_EQ(Read(a_->stub(), into), into_expected);
  std::string remote_expected = PatternString(3, 0, kSize);
  remote_expected.replace(2000, 50, PatternString(2, 300, 50));
  EXPECT_EQ(Read(*b_stub_, remote), remote_expected);
  EXPECT_EQ(Read(a_->stub(), from), PatternString(2, 0, kSize));

  // Its second op's local buffer released: one completion, that op's.
  grpc::ClientContext release_call;
  v1::ReleaseRequest release;
  release.set_buffer_id(from);
  v1::ReleaseResponse released;
  ASSERT_TRUE(a_->stub().Release(&release_call, release, &released).ok());
  ASSERT_TRUE(ring_->RunPrepared(prepared.prepared_id(), 10).ok());
  ends = Reap(1);
  ASSERT_EQ(ends.count(10), 1u);
  EXPECT_EQ(ends[10].status.code(), absl::StatusCode::kNotFound)
      << ends[10].status;
  EXPECT_THAT(ends[10].status.message(), HasSubstr("op 1:"));
  EXPECT_EQ(Read(*b_stub_, remote), remote_expected);

  // An id that names nothing.
  ASSERT_TRUE(ring_->RunPrepared(prepared.prepared_id() ^ 1, 11).ok());
  ends = Reap(1);
  EXPECT_EQ(ends[11].status.code(), absl::StatusCode::kNotFound)
      << ends[11].status;
  EXPECT_THAT(ends[11].status.message(), HasSubstr("RUN_PREPARED"));
}

TEST_F(RingBatchesTest, ANotificationReachesTheRemoteOwnerAfterItsBytes) {
  const uint64_t local = Local(4);
  const uint64_t remote = Remote(5);
  const uint64_t handle = Import(remote_contexts_[remote]);
  const RingOp op = Op(kWrite, local, 10, 500, handle, 3000, 1);
  ASSERT_TRUE(ring_->Submit({&op, 1}, absl::ZeroDuration(), "layer 7").ok());
  auto ends = Reap(1);
  EXPECT_TRUE(ends[1].status.ok()) << ends[1].status;

  grpc::ClientContext call;
  v1::GetNotificationsRequest request;
  request.mutable_wait()->set_seconds(10);
  v1::GetNotificationsResponse response;
  ASSERT_TRUE(b_stub_->GetNotifications(&call, request, &response).ok());
  ASSERT_EQ(response.notifications_size(), 1);
  EXPECT_EQ(response.notifications(0).data(), "layer 7");
  EXPECT_EQ(response.notifications(0).buffer_id(), remote);
  EXPECT_EQ(response.notifications(0).from_agent_id(),
            a_->agent().identity().agent_id);
  std::string expected = PatternString(5, 0, kSize);
  expected.replace(3000, 500, PatternString(4, 10, 500));
  EXPECT_EQ(Read(*b_stub_, remote), expected);

  // A failed op sends none; its own code is reported.
  const RingOp bad = Op(kWrite, local, 0, 8, handle, kSize, 2);
  ASSERT_TRUE(ring_->Submit({&bad, 1}, absl::ZeroDuration(), "never").ok());
  ends = Reap(1);
  EXPECT_EQ(ends[2].status.code(), absl::StatusCode::kOutOfRange);
  grpc::ClientContext again;
  request.mutable_wait()->set_seconds(1);
  response.Clear();
  ASSERT_TRUE(b_stub_->GetNotifications(&again, request, &response).ok());
  EXPECT_EQ(response.notifications_size(), 0);
}

TEST_F(RingBatchesTest, ACancelEndsTheRunningBatchHoldingItsTag) {
  const uint64_t local = Local(6);
  const uint64_t handle = Import(remote_contexts_[Remote(7)]);
  b_->Hold();
  const RingOp ops[] = {Op(kRead, local, 0, 1000, handle, 0, 5),
                        Op(kRead, local, 2000, 1000, handle, 2000, 6)};
  ASSERT_TRUE(ring_->Submit(ops).ok());
  ASSERT_TRUE(Running(1));
  ASSERT_TRUE(ring_->Cancel(6, 50).ok());
  const std::vector<RingCompletion> in_order = ReapInOrder(3);
  ASSERT_EQ(in_order.size(), 3u);
  // Posted once the batch has ended, just before the batch's own.
  EXPECT_EQ(in_order[0].user_tag, 50u);
  std::map<uint64_t, RingCompletion> ends;
  for (const RingCompletion& end : in_order) ends[end.user_tag] = end;
  EXPECT_TRUE(ends[50].status.ok()) << ends[50].status;
  EXPECT_EQ(ends[5].status.code(), absl::StatusCode::kCancelled)
      << ends[5].status;
  EXPECT_EQ(ends[6].status.code(), absl::StatusCode::kCancelled)
      << ends[6].status;
  EXPECT_THAT(ends[6].status.message(), HasSubstr("CANCEL"));
  EXPECT_EQ(RingBatchesInFlight(), 0u);
  // It ran without a transfer.
  EXPECT_EQ(a_->agent().transfers().in_flight(), 0u);

  // No batch holds the tag any more, nor ever held this one.
  ASSERT_TRUE(ring_->Cancel(6, 51).ok());
  ASSERT_TRUE(ring_->Cancel(424242, 52).ok());
  ends = Reap(2);
  EXPECT_EQ(ends[51].status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ends[52].status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(ends[52].status.message(), HasSubstr("tag 424242"));

  // The peer answers at last: nothing of the cancelled batch lands.
  b_->Resume();
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(Read(a_->stub(), local), PatternString(6, 0, kSize));
}

TEST_F(RingBatchesTest, SeveralBatchesRunAtOnceAndEndInAnyOrder) {
  const uint64_t local = Local(8);
  const uint64_t remote = Remote(9);
  const uint64_t handle = Import(remote_contexts_[remote]);
  const uint64_t same_host = Import(contexts_[Local(10)]);
  b_->Hold();
  const RingOp slow = Op(kRead, local, 0, 100, handle, 100, 1);
  ASSERT_TRUE(ring_->Submit({&slow, 1}).ok());
  ASSERT_TRUE(Running(1));
  // Taken and run while the first one waits for its peer.
  const RingOp fast[] = {Op(kRead, local, 1000, 10, same_host, 0, 2),
                         Op(kRead, local, 2000, 10, same_host, 10, 3)};
  ASSERT_TRUE(ring_->Submit(fast).ok());
  auto ends = Reap(2);
  ASSERT_EQ(ends.count(2), 1u);
  ASSERT_EQ(ends.count(3), 1u);
  EXPECT_TRUE(ends[2].status.ok()) << ends[2].status;
  EXPECT_EQ(ends[2].backend, "memory");
  EXPECT_EQ(ring_->in_flight(), 1u);
  std::vector<RingCompletion> none;
  EXPECT_EQ(*ring_->Poll(&none), 0u);
  // What ListRingSessions reports of it.
  std::vector<RingSessionInfo> sessions = a_->agent().rings().List(::geteuid());
  ASSERT_EQ(sessions.size(), 1u);
  EXPECT_EQ(sessions[0].pid, ::getpid());
  EXPECT_EQ(sessions[0].entries, 16u);
  EXPECT_EQ(sessions[0].batches_in_flight, 1u);
  EXPECT_EQ(sessions[0].ops_in_flight, 1u);
  EXPECT_EQ(sessions[0].ops_completed, 2u);
  EXPECT_TRUE(sessions[0].stopped_reason.empty());
  EXPECT_TRUE(a_->agent().rings().List(::geteuid() + 1).empty());
  b_->Resume();
  ends = Reap(1);
  EXPECT_TRUE(ends[1].status.ok()) << ends[1].status;
  EXPECT_EQ(ends[1].backend, "tcp");
  std::string expected = PatternString(8, 0, kSize);
  expected.replace(0, 100, PatternString(9, 100, 100));
  expected.replace(1000, 10, PatternString(10, 0, 10));
  expected.replace(2000, 10, PatternString(10, 10, 10));
  EXPECT_EQ(Read(a_->stub(), local), expected);
}

// A small batch between buffers of this agent ends inside its post, on the
// session's own thread: it completes while batches wait on a held peer.
// None of them is a transfer, so none takes a transfer worker.
TEST_F(RingBatchesTest, ASmallLocalBatchCompletesWhileOthersWaitOnAPeer) {
  const uint64_t local = Local(30);
  const uint64_t handle = Import(remote_contexts_[Remote(31)]);
  const uint64_t other = Local(32);
  const uint64_t same_host = Import(contexts_[other]);
  b_->Hold();
  const RingOp slow[] = {Op(kRead, local, 0, 100, handle, 0, 1)};
  const RingOp slower[] = {Op(kRead, local, 100, 100, handle, 100, 2)};
  ASSERT_TRUE(ring_->Submit(slow).ok());
  ASSERT_TRUE(ring_->Submit(slower).ok());
  ASSERT_TRUE(Running(2));
  const RingOp fast[] = {Op(kWrite, local, 1000, 10, same_host, 0, 3),
                         Op(kRead, local, 2000, 10, same_host, 10, 4)};
  ASSERT_TRUE(ring_->Submit(fast).ok());
  auto ends = Reap(2);
  ASSERT_EQ(ends.count(3), 1u);
  ASSERT_EQ(ends.count(4), 1u);
  EXPECT_TRUE(ends[3].status.ok()) << ends[3].status;
  EXPECT_TRUE(ends[4].status.ok()) << ends[4].status;
  EXPECT_EQ(ends[4].backend, "memory");
  EXPECT_EQ(RingBatchesInFlight(), 2u);
  EXPECT_EQ(a_->agent().transfers().in_flight(), 0u);
  // A CANCEL naming it finds it ended.
  ASSERT_TRUE(ring_->Cancel(3, 5).ok());
  auto cancelled = Reap(1);
  ASSERT_EQ(cancelled.count(5), 1u);
  EXPECT_EQ(cancelled[5].status.code(), absl::StatusCode::kNotFound);
  b_->Resume();
  ends = Reap(2);
  EXPECT_TRUE(ends[1].status.ok()) << ends[1].status;
  EXPECT_TRUE(ends[2].status.ok()) << ends[2].status;
  std::string expected = PatternString(30, 0, kSize);
  expected.replace(0, 200, PatternString(31, 0, 200));
  expected.replace(2000, 10, PatternString(32, 10, 10));
  EXPECT_EQ(Read(a_->stub(), local), expected);
  std::string written = PatternString(32, 0, kSize);
  written.replace(0, 10, PatternString(30, 1000, 10));
  EXPECT_EQ(Read(a_->stub(), other), written);
}

TEST_F(RingBatchesTest, ABatchOverTheOpsBoundWaitsForRoom) {
  const uint64_t local = Local(11);
  const uint64_t handle = Import(remote_contexts_[Remote(12)]);
  const uint64_t same_host = Import(contexts_[Local(13)]);
  // Room in the ring for more ops than the bound.
  auto ring = Ring::Open(a_->agent().attach_socket_path(), 2 * kMaxOpsPerUser,
                         absl::Seconds(10));
  ASSERT_TRUE(ring.ok()) << ring.status();
  ring_ = std::move(*ring);
  b_->Hold();
  std::vector<RingOp> slow;
  for (uint64_t i = 0; i < kMaxOpsPerUser - 2; ++i) {
    slow.push_back(Op(kRead, local, i, 1, handle, i, 100 + i));
  }
  ASSERT_TRUE(ring_->Submit(slow).ok());
  ASSERT_TRUE(Running(1));
  // Three more ops would pass --max_ops_in_flight_per_user: they wait.
  const RingOp fast[] = {Op(kRead, local, 1000, 8, same_host, 0, 1),
                         Op(kRead, local, 1100, 8, same_host, 8, 2),
                         Op(kRead, local, 1200, 8, same_host, 16, 3)};
  ASSERT_TRUE(ring_->Submit(fast).ok());
  absl::SleepFor(absl::Milliseconds(300));
  std::vector<RingCompletion> none;
  EXPECT_EQ(*ring_->Poll(&none), 0u);
  b_->Resume();
  auto ends = Reap(slow.size() + 3);
  for (uint64_t tag = 1; tag <= 3; ++tag) {
    EXPECT_TRUE(ends[tag].status.ok()) << tag << ": " << ends[tag].status;
  }
  EXPECT_TRUE(ends[100].status.ok()) << ends[100].status;
}

TEST_F(RingBatchesTest, AClosedSessionCancelsItsBatchesAndGivesAllBack) {
  const uint64_t local = Local(14);
  const uint64_t handle = Import(remote_contexts_[Remote(15)]);
  b_->Hold();
  const RingOp ops[] = {Op(kRead, local, 0, 3000, handle, 0, 1)};
  ASSERT_TRUE(ring_->Submit(ops).ok());
  ASSERT_TRUE(Running(1));
  ring_.reset();
  EXPECT_TRUE(Eventually([&] { return a_->agent().rings().open() == 0; }));
  EXPECT_EQ(a_->agent().transfers().in_flight(), 0u);
  EXPECT_EQ(a_->agent().transfers().bytes(), 0u);
  EXPECT_TRUE(a_->agent().rings().List(std::nullopt).empty());
  b_->Resume();
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(Read(a_->stub(), local), PatternString(14, 0, kSize));

  // Its ops' admission is back: a new session runs a batch of the whole
  // --max_ops_in_flight_per_user at once.
  auto ring =
      Ring::Open(a_->agent().attach_socket_path(), 16, absl::Seconds(10));
  ASSERT_TRUE(ring.ok()) << ring.status();
  ring_ = std::move(*ring);
  const uint64_t same_host = Import(contexts_[Local(16)]);
  std::vector<RingOp> full;
  for (uint64_t i = 0; i < kMaxOpsPerUser; ++i) {
    full.push_back(Op(kRead, local, 100 + i, 1, same_host, i, i));
  }
  ASSERT_TRUE(ring_->Submit(full, absl::Seconds(2)).ok());
  auto ends = Reap(full.size());
  ASSERT_EQ(ends.size(), full.size());
  for (auto& [tag, end] : ends) {
    EXPECT_TRUE(end.status.ok()) << tag << ": " << end.status;
  }
}

TEST_F(RingBatchesTest, AStoppingAgentEndsRunningBatchesFirst) {
  const uint64_t local = Local(17);
  const uint64_t handle = Import(remote_contexts_[Remote(18)]);
  b_->Hold();
  const RingOp op = Op(kRead, local, 0, 1000, handle, 0, 1);
  ASSERT_TRUE(ring_->Submit({&op, 1}).ok());
  ASSERT_TRUE(Running(1));
  const absl::Time start = absl::Now();
  a_.reset();  // returns once the session's thread has ended
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  // The batch's completion was posted before the session went.
  std::vector<RingCompletion> ends;
  ASSERT_EQ(*ring_->Poll(&ends), 1u);
  EXPECT_EQ(ends[0].user_tag, 1u);
  EXPECT_EQ(ends[0].status.code(), absl::StatusCode::kCancelled)
      << ends[0].status;
  EXPECT_EQ(ring_->Poll(&ends).status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace rdma_agent::testing

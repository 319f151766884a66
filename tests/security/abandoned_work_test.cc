// Abandoned work: a client that is killed, or cancels, in the middle of a
// long Submit must not keep the agent moving bytes for nobody, and SIGTERM
// must not wait for transfers in flight. Real rdma-agentd processes; the
// long Submit is thousands of 128 MiB copies inside one agent-allocated
// buffer over the memory backend (minutes of work if nothing stops it).

#include <signal.h>
#include <unistd.h>

#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "rdma/agent/v1/remote_buffer.pb.h"
#include "tests/client/worker_process.h"
#include "tests/security/raw_data_peer.h"
#include "tests/testing/agent_process.h"

namespace rdma_agent::testing {
namespace {

namespace v1 = ::rdma::agent::v1;

constexpr int kReadWrite = 3;  // v1::ACCESS_READ_WRITE
constexpr uint64_t kHalf = 128ull << 20;
// 4096 x 128 MiB = 512 GiB of copying: never finishes within a test.
constexpr int kOps = 4096;

// bytes_moved of buffer `id`, as root sees it.
uint64_t BytesMoved(AgentProcess& agent, const std::string& id) {
  auto buffers = agent.client().ListBuffers();
  if (!buffers.ok()) return 0;
  for (const auto& info : *buffers) {
    if (absl::StrCat(info.buffer_id()) == id) return info.bytes_moved();
  }
  return 0;
}

// Waits until the buffer's counter moves: the long Submit is running.
bool WaitForProgress(AgentProcess& agent, const std::string& id) {
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (absl::Now() < give_up) {
    if (BytesMoved(agent, id) > 0) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

// Asserts that nothing moves any more: a second after the work was
// abandoned, the counter stays put for another second.
void ExpectStoppedWithinASecond(AgentProcess& agent, const std::string& id) {
  absl::SleepFor(absl::Seconds(1));
  const uint64_t before = BytesMoved(agent, id);
  absl::SleepFor(absl::Seconds(1));
  EXPECT_EQ(BytesMoved(agent, id), before)
      << "the agent kept copying for a client that was gone";
  EXPECT_LT(before, kOps * kHalf);
}

class AbandonedWorkTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto agent = AgentProcess::Start();
    ASSERT_TRUE(agent.ok()) << agent.status();
    agent_ = std::move(*agent);
    auto worker = WorkerProcess::Start(*agent_);
    ASSERT_TRUE(worker.ok()) << worker.status();
    worker_.emplace(std::move(*worker));
    // Agent lifetime: its counters stay readable after the worker is
    // killed (tests/daemon/client_lifetime_test kills owners mid-op too).
    auto words = worker_->CallWords(
        absl::StrCat("allocate ", 2 * kHalf, " ", kReadWrite, " agent"));
    ASSERT_TRUE(words.ok()) << words.status();
    auto buffer = ParseRegistered(*words);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    buffer_ = *buffer;
  }

  // Starts the long Submit in the worker without waiting for its answer.
  void StartLongSubmit() {
    ASSERT_TRUE(worker_->process()
                    .WriteLine(absl::StrCat("submit_many ", kOps, " read ",
                                            buffer_.id, " 0 ", kHalf, " ",
                                            kHalf, " ", buffer_.context))
                    .ok());
    ASSERT_TRUE(WaitForProgress(*agent_, buffer_.id))
        << "the long Submit never started";
  }

  std::unique_ptr<AgentProcess> agent_;
  std::optional<WorkerProcess> worker_;
  WorkerBuffer buffer_;
};

TEST_F(AbandonedWorkTest, KilledClientsSubmitStopsWithinASecond) {
  StartLongSubmit();
  worker_->process().Signal(SIGKILL);
  ExpectStoppedWithinASecond(*agent_, buffer_.id);
  // The agent still serves: a fresh client moves bytes.
  auto info = agent_->client().GetInfo();
  EXPECT_TRUE(info.ok()) << info.status();
}

TEST_F(AbandonedWorkTest, CancelledSubmitStopsWithinASecond) {
  std::string context;
  ASSERT_TRUE(absl::Base64Unescape(buffer_.context, &context));
  v1::SubmitRequest request;
  for (int i = 0; i < kOps; ++i) {
    v1::Op* op = request.add_ops();
    op->set_type(v1::OP_TYPE_READ_INTO_LOCAL);
    uint64_t id = 0;
    ASSERT_TRUE(absl::SimpleAtoi(buffer_.id, &id));
    op->set_local_buffer_id(id);
    op->set_length(kHalf);
    op->set_remote_context(context);
    op->set_remote_offset(kHalf);
  }
  request.mutable_timeout()->set_seconds(600);
  auto stub = v1::RdmaAgent::NewStub(agent_->client().channel());
  grpc::ClientContext call;
  grpc::Status status;
  std::thread caller([&] {
    v1::SubmitResponse response;
    status = stub->Submit(&call, request, &response);
  });
  ASSERT_TRUE(WaitForProgress(*agent_, buffer_.id));
  call.TryCancel();
  caller.join();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED);
  ExpectStoppedWithinASecond(*agent_, buffer_.id);
}

TEST_F(AbandonedWorkTest, SigtermDoesNotWaitForTransfersInFlight) {
  StartLongSubmit();
  const absl::Time start = absl::Now();
  auto exit_code = agent_->Stop(SIGTERM, absl::Seconds(30));
  const absl::Duration took = absl::Now() - start;
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0);
  // --shutdown_grace defaults to 5 s; cancelling the transfer first means
  // the grace is not even needed.
  EXPECT_LT(took, absl::Seconds(5)) << "shutdown took " << took;
  // The worker's Submit ended with the shutdown (results or a transport
  // error), it did not hang.
  auto answer = worker_->process().ReadLine(absl::Seconds(10));
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_TRUE(absl::StartsWith(*answer, "results ") ||
              absl::StartsWith(*answer, "error "))
      << *answer;
}

// An agent with the tcp backend, a stalled peer, and a client process that
// registered a buffer of `size` bytes.
class AbandonedTcpWorkTest : public ::testing::Test {
 protected:
  void StartWithBuffer(uint64_t size) {
    AgentProcess::Options options;
    options.backends = "memory,tcp";
    auto agent = AgentProcess::Start(options);
    ASSERT_TRUE(agent.ok()) << agent.status();
    agent_ = std::move(*agent);
    auto worker = WorkerProcess::Start(*agent_);
    ASSERT_TRUE(worker.ok()) << worker.status();
    worker_.emplace(std::move(*worker));
    auto words =
        worker_->CallWords(absl::StrCat("allocate ", size, " ", kReadWrite));
    ASSERT_TRUE(words.ok()) << words.status();
    auto buffer = ParseRegistered(*words);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    buffer_ = *buffer;
  }

  SilentDataPeer peer_;
  std::unique_ptr<AgentProcess> agent_;
  std::optional<WorkerProcess> worker_;
  WorkerBuffer buffer_;
};

TEST_F(AbandonedTcpWorkTest, KilledClientsConnectionsToAStalledPeerClose) {
  ASSERT_NO_FATAL_FAILURE(StartWithBuffer(1048576));
  SilentDataPeer& peer = peer_;
  WorkerProcess* worker = &*worker_;
  const WorkerBuffer* buffer = &buffer_;
  // A WRITE with a ten-minute timeout that the peer never answers.
  ASSERT_TRUE(worker->process()
                  .WriteLine(absl::StrCat("submit_many 1 write ", buffer->id,
                                          " 0 1048576 0 ",
                                          absl::Base64Escape(peer.Context())))
                  .ok());
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (peer.talking() == 0 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_TRUE(peer.talking() > 0) << "the Submit never reached the peer";
  worker->process().Signal(SIGKILL);
  // The agent notices the client is gone and closes the connection, so no
  // late answer can touch the buffer: within a second (plus slack for a
  // loaded machine), not at the ten-minute deadline.
  const absl::Time killed = absl::Now();
  while (peer.closed() == 0 && absl::Now() < killed + absl::Seconds(3)) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(peer.closed() > 0)
      << "the agent kept waiting on the stalled peer";
  EXPECT_LT(absl::Now() - killed, absl::Seconds(2));
}

// A peer that answers the hello and then moves nothing holds the op only
// until --tcp_no_progress_timeout (15 s by default), not until its
// ten-minute deadline: the op fails UNAVAILABLE and its thread is free.
TEST_F(AbandonedTcpWorkTest, AStalledPeerFailsTheOpAfterTheNoProgressTimeout) {
  ASSERT_NO_FATAL_FAILURE(StartWithBuffer(4096));
  SilentDataPeer& peer = peer_;
  WorkerProcess* worker = &*worker_;
  const WorkerBuffer* buffer = &buffer_;
  // A READ with a ten-minute timeout: its request reaches the peer, whose
  // answer never comes.
  const absl::Time start = absl::Now();
  ASSERT_TRUE(worker->process()
                  .WriteLine(absl::StrCat("submit_many 1 read ", buffer->id,
                                          " 0 4096 0 ",
                                          absl::Base64Escape(peer.Context())))
                  .ok());
  auto answer = worker->process().ReadLine(absl::Seconds(60));
  const absl::Duration took = absl::Now() - start;
  ASSERT_TRUE(answer.ok()) << "no answer within a minute: " << answer.status();
  EXPECT_EQ(*answer, "results 0 UNAVAILABLE");
  EXPECT_GE(took, absl::Seconds(14)) << "gave up before the timeout";
  EXPECT_LT(took, absl::Seconds(45));
  EXPECT_TRUE(peer.talking() > 0) << "the request never reached the peer";
}

}  // namespace
}  // namespace rdma_agent::testing

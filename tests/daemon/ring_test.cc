// Shared-memory ring sessions (docs/RING.md) against an in-process agent
// with the memory backend: ops posted through the ring move exactly their
// bytes, every bad entry gets its code naming the op, a client that lies
// about its indices has only its own session stopped (with a reason it can
// read), a client that does not reap stalls only itself, and a session's
// end (the client closing it, the agent stopping) is seen by both sides.
#include "client/ring.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/internal/attach_socket.h"
#include "common/ring_protocol.h"
#include "common/shared_memory.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "rdma/agent/v1/attach.pb.h"
#include "tests/testing/agent_fixture.h"
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
constexpr v1::OpType kRead = v1::OP_TYPE_READ_INTO_LOCAL;
constexpr v1::OpType kWrite = v1::OP_TYPE_WRITE_FROM_LOCAL;

class RingTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(AgentOptions{}); }

  void Start(AgentOptions options) {
    agent_.reset();
    auto agent = InProcessAgent::Start(std::move(options));
    ASSERT_TRUE(agent.ok()) << agent.status();
    agent_ = std::move(*agent);
  }

  std::unique_ptr<Ring> Open(uint32_t entries = 8) {
    auto ring = Ring::Open(agent_->agent().attach_socket_path(), entries,
                           absl::Seconds(10));
    EXPECT_TRUE(ring.ok()) << ring.status();
    return ring.ok() ? std::move(*ring) : nullptr;
  }

  // A buffer of kSize bytes filled with pattern `seed`.
  uint64_t Filled(int seed) {
    auto buffer = agent_->Allocate(kSize);
    EXPECT_TRUE(buffer.ok()) << buffer.status();
    grpc::ClientContext call;
    v1::WriteBufferRequest request;
    request.set_buffer_id(buffer->buffer_id());
    request.set_data(PatternString(seed, 0, kSize));
    v1::WriteBufferResponse response;
    EXPECT_TRUE(agent_->stub().WriteBuffer(&call, request, &response).ok());
    contexts_[buffer->buffer_id()] = buffer->remote_context();
    return buffer->buffer_id();
  }

  uint64_t Import(uint64_t buffer_id) {
    grpc::ClientContext call;
    v1::ImportRemoteRequest request;
    request.set_remote_context(contexts_[buffer_id]);
    v1::ImportRemoteResponse response;
    EXPECT_TRUE(agent_->stub().ImportRemote(&call, request, &response).ok());
    return response.remote_handle();
  }

  std::string Read(uint64_t id) {
    grpc::ClientContext call;
    v1::ReadBufferRequest request;
    request.set_buffer_id(id);
    request.set_length(kSize);
    v1::ReadBufferResponse response;
    EXPECT_TRUE(agent_->stub().ReadBuffer(&call, request, &response).ok());
    return response.data();
  }

  // Waits for `count` completions on `ring`.
  static std::vector<RingCompletion> Reap(Ring& ring, size_t count) {
    std::vector<RingCompletion> ends;
    while (ends.size() < count) {
      auto got = ring.Wait(&ends, absl::Seconds(10));
      EXPECT_TRUE(got.ok()) << got.status();
      if (!got.ok()) break;
    }
    return ends;
  }

  static RingOp Op(v1::OpType type, uint64_t local, uint64_t local_offset,
                   uint64_t length, uint64_t handle, uint64_t remote_offset,
                   uint64_t tag) {
    return RingOp{type,   local,         local_offset, length,
                  handle, remote_offset, tag};
  }

  std::unique_ptr<InProcessAgent> agent_;
  std::map<uint64_t, std::string> contexts_;
};

TEST_F(RingTest, OpsThroughTheRingMoveExactlyTheirBytes) {
  const uint64_t local = Filled(1);
  const uint64_t remote = Filled(2);
  const uint64_t handle = Import(remote);
  auto ring = Open();
  ASSERT_NE(ring, nullptr);
  const RingOp ops[] = {Op(kRead, local, 10, 100, handle, 20, 7),
                        Op(kWrite, local, 3000, 50, handle, 4000, 8)};
  ASSERT_TRUE(ring->Submit(ops).ok());
  std::vector<RingCompletion> ends = Reap(*ring, 2);
  ASSERT_EQ(ends.size(), 2u);
  EXPECT_EQ(ends[0].user_tag, 7u);
  EXPECT_TRUE(ends[0].status.ok()) << ends[0].status;
  EXPECT_EQ(ends[0].backend, "memory");
  EXPECT_EQ(ends[1].user_tag, 8u);
  EXPECT_TRUE(ends[1].status.ok()) << ends[1].status;
  std::string local_expected = PatternString(1, 0, kSize);
  local_expected.replace(10, 100, PatternString(2, 20, 100));
  std::string remote_expected = PatternString(2, 0, kSize);
  remote_expected.replace(4000, 50, PatternString(1, 3000, 50));
  EXPECT_EQ(Read(local), local_expected);
  EXPECT_EQ(Read(remote), remote_expected);

  // Many batches, more than the ring holds in all, reaped as they end.
  for (uint64_t i = 0; i < 40; ++i) {
    const RingOp op = Op(kRead, local, i, 1, handle, i, 100 + i);
    ASSERT_TRUE(ring->Submit({&op, 1}).ok());
    std::vector<RingCompletion> one = Reap(*ring, 1);
    ASSERT_EQ(one.size(), 1u);
    EXPECT_EQ(one[0].user_tag, 100 + i);
    EXPECT_TRUE(one[0].status.ok()) << one[0].status;
  }
  local_expected.replace(0, 40, PatternString(2, 0, 40));
  EXPECT_EQ(Read(local), local_expected);
}

TEST_F(RingTest, EveryBadEntryGetsItsCodeAndTheOthersRun) {
  const uint64_t local = Filled(3);
  const uint64_t remote = Filled(4);
  const uint64_t handle = Import(remote);
  auto ring = Open(16);
  ASSERT_NE(ring, nullptr);
  const std::vector<std::pair<RingOp, absl::StatusCode>> cases = {
      {Op(v1::OP_TYPE_UNSPECIFIED, local, 0, 8, handle, 0, 0),
       absl::StatusCode::kInvalidArgument},
      {Op(kRead, local, 0, 0, handle, 0, 1),
       absl::StatusCode::kInvalidArgument},
      {Op(kRead, local, 0, 8, 0, 0, 2), absl::StatusCode::kInvalidArgument},
      {Op(kRead, local, 0, 8, 424242, 0, 3), absl::StatusCode::kNotFound},
      {Op(kRead, local, kSize - 4, 8, handle, 0, 4),
       absl::StatusCode::kOutOfRange},
      {Op(kRead, local, 0, 8, handle, kSize, 5), absl::StatusCode::kOutOfRange},
      {Op(kRead, 999999, 0, 8, handle, 0, 6), absl::StatusCode::kNotFound},
      {Op(kRead, local, 200, 16, handle, 300, 7), absl::StatusCode::kOk},
  };
  std::vector<RingOp> ops;
  for (const auto& c : cases) ops.push_back(c.first);
  ASSERT_TRUE(ring->Submit(ops).ok());
  std::vector<RingCompletion> ends = Reap(*ring, ops.size());
  ASSERT_EQ(ends.size(), ops.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("entry ", i));
    EXPECT_EQ(ends[i].user_tag, i);
    EXPECT_EQ(ends[i].status.code(), cases[i].second) << ends[i].status;
    if (!ends[i].status.ok()) {
      EXPECT_THAT(ends[i].status.message(), HasSubstr(absl::StrCat("op ", i)));
    }
  }
  std::string expected = PatternString(3, 0, kSize);
  expected.replace(200, 16, PatternString(4, 300, 16));
  EXPECT_EQ(Read(local), expected);
  EXPECT_EQ(Read(remote), PatternString(4, 0, kSize));

  // The same ops by Submit fail with the same messages, but for entries 0
  // and 2, which the ring's own checks refuse (an opcode that is no op
  // type; a remote_handle of 0, where Submit would want a context).
  v1::SubmitRequest request;
  for (const RingOp& ring_op : ops) {
    v1::Op* op = request.add_ops();
    op->set_type(ring_op.type);
    op->set_local_buffer_id(ring_op.local_buffer_id);
    op->set_local_offset(ring_op.local_offset);
    op->set_length(ring_op.length);
    op->set_remote_handle(ring_op.remote_handle);
    op->set_remote_offset(ring_op.remote_offset);
  }
  grpc::ClientContext call;
  v1::SubmitResponse response;
  ASSERT_TRUE(agent_->stub().Submit(&call, request, &response).ok());
  ASSERT_EQ(response.results_size(), static_cast<int>(cases.size()));
  for (size_t i = 1; i < cases.size(); ++i) {
    if (i == 2) continue;
    SCOPED_TRACE(absl::StrCat("op ", i));
    const v1::OpResult& result = response.results(static_cast<int>(i));
    EXPECT_EQ(result.code(), static_cast<int>(ends[i].status.code()));
    EXPECT_EQ(result.message(), ends[i].status.message());
  }

  // A timeout past --max_submit_timeout fails the batch's ops.
  const RingOp op = Op(kRead, local, 0, 8, handle, 0, 9);
  ASSERT_TRUE(ring->Submit({&op, 1}, absl::Hours(2)).ok());
  ends = Reap(*ring, 1);
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_EQ(ends[0].status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ends[0].status.message(), HasSubstr("timeout"));
}

TEST_F(RingTest, BadSessionsAreRefused) {
  auto three = Ring::Open(agent_->agent().attach_socket_path(), 3);
  EXPECT_EQ(three.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(three.status().message(), HasSubstr("power of two"));
  auto huge = Ring::Open(agent_->agent().attach_socket_path(), 1u << 16);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(huge.status().message(), HasSubstr("--max_ring_entries"));
}

TEST_F(RingTest, AClientThatDoesNotReapStallsOnlyItself) {
  const uint64_t local = Filled(5);
  const uint64_t handle = Import(Filled(6));
  auto ring = Open(4);
  ASSERT_NE(ring, nullptr);
  for (uint64_t i = 0; i < 4; ++i) {
    const RingOp op = Op(kRead, local, i, 1, handle, i, i);
    ASSERT_TRUE(ring->Submit({&op, 1}).ok());
  }
  const RingOp more = Op(kRead, local, 9, 1, handle, 9, 9);
  EXPECT_EQ(ring->Submit({&more, 1}).code(),
            absl::StatusCode::kResourceExhausted);
  // Another session is served meanwhile.
  auto other = Open(4);
  ASSERT_NE(other, nullptr);
  ASSERT_TRUE(other->Submit({&more, 1}).ok());
  EXPECT_EQ(Reap(*other, 1).size(), 1u);
  // Reaped, the first goes on.
  EXPECT_EQ(Reap(*ring, 4).size(), 4u);
  ASSERT_TRUE(ring->Submit({&more, 1}).ok());
  EXPECT_EQ(Reap(*ring, 1).size(), 1u);
}

// A raw session: the memfd and the connection, as a hostile client holds
// them.
struct RawSession {
  UniqueFd connection;
  SharedMemory memory;
  std::atomic<uint32_t>& Word(size_t offset) {
    return ring::Word(memory.data(), offset);
  }
};

absl::StatusOr<RawSession> OpenRaw(const std::string& path, uint32_t entries) {
  v1::AttachRequest request;
  request.mutable_open_ring()->set_entries(entries);
  auto reply = client::internal::ExchangeOnAttachSocket(
      path, request, -1, absl::Seconds(10), /*keep_connection=*/true);
  if (!reply.ok()) return reply.status();
  if (!reply->fd) return absl::InternalError("no memfd");
  auto memory = SharedMemory::Adopt(std::move(reply->fd));
  if (!memory.ok()) return memory.status();
  return RawSession{std::move(reply->connection), std::move(*memory)};
}

// Whether the agent closed `fd` (reads until EOF, bounded).
bool ClosedByAgent(int fd) {
  return Eventually([&] {
    char bytes[64];
    const ssize_t n = ::recv(fd, bytes, sizeof(bytes), MSG_DONTWAIT);
    return n == 0;
  });
}

TEST_F(RingTest, ALyingTailStopsOnlyThatSession) {
  // Another session, served by the same ring thread (the default is one).
  const uint64_t local = Filled(7);
  const uint64_t handle = Import(Filled(8));
  auto ring = Open();
  ASSERT_NE(ring, nullptr);
  auto raw = OpenRaw(agent_->agent().attach_socket_path(), 8);
  ASSERT_TRUE(raw.ok()) << raw.status();
  EXPECT_TRUE(Eventually([&] { return agent_->agent().rings().open() == 2; }));
  raw->Word(ring::kSqTailOffset).store(9);  // 9 entries past a head of 0
  const char byte = 1;
  ASSERT_EQ(::send(raw->connection.get(), &byte, 1, MSG_NOSIGNAL), 1);
  ASSERT_TRUE(ClosedByAgent(raw->connection.get()));
  EXPECT_NE(raw->Word(ring::kAgentFlagsOffset).load() & ring::kAgentStopped,
            0u);
  const std::string reason(reinterpret_cast<const char*>(
      raw->memory.data() + ring::kStopReasonOffset));
  EXPECT_THAT(reason, HasSubstr("sq_tail 9"));
  EXPECT_TRUE(Eventually([&] { return agent_->agent().rings().open() == 1; }));

  // The other session works on.
  const RingOp op = Op(kRead, local, 0, 8, handle, 0, 1);
  ASSERT_TRUE(ring->Submit({&op, 1}).ok());
  std::vector<RingCompletion> ends = Reap(*ring, 1);
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_TRUE(ends[0].status.ok()) << ends[0].status;
}

TEST_F(RingTest, ALyingCompletionHeadStopsTheSession) {
  auto raw = OpenRaw(agent_->agent().attach_socket_path(), 8);
  ASSERT_TRUE(raw.ok()) << raw.status();
  raw->Word(ring::kCqHeadOffset).store(5);  // ahead of the agent's tail
  const char byte = 1;
  ASSERT_EQ(::send(raw->connection.get(), &byte, 1, MSG_NOSIGNAL), 1);
  ASSERT_TRUE(ClosedByAgent(raw->connection.get()));
  const std::string reason(reinterpret_cast<const char*>(
      raw->memory.data() + ring::kStopReasonOffset));
  EXPECT_THAT(reason, HasSubstr("cq_head 5"));
}

TEST_F(RingTest, AScribbledEntryIsJudgedOnItsCopy) {
  const uint64_t local = Filled(9);
  const uint64_t handle = Import(Filled(10));
  auto raw = OpenRaw(agent_->agent().attach_socket_path(), 4);
  ASSERT_TRUE(raw.ok()) << raw.status();
  auto geometry = ring::ReadHeader(raw->memory.data(), raw->memory.size());
  ASSERT_TRUE(geometry.ok());
  // Garbage in every byte of every slot, then one published batch of one.
  std::memset(raw->memory.data() + geometry->submissions_offset, 0xff,
              4 * ring::kSubmissionBytes);
  raw->Word(ring::kSqTailOffset).store(1);
  const char byte = 1;
  ASSERT_EQ(::send(raw->connection.get(), &byte, 1, MSG_NOSIGNAL), 1);
  ASSERT_TRUE(
      Eventually([&] { return raw->Word(ring::kCqTailOffset).load() == 1; }));
  std::string message;
  const ring::Completion end =
      ring::ReadCompletion(raw->memory.data(), *geometry, 0, &message);
  EXPECT_EQ(end.code, static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(message, HasSubstr("op 0: opcode 255"));
  // The session goes on: a good entry after it runs.
  ring::Submission good;
  good.opcode = ring::kOpReadIntoLocal;
  good.flags = ring::kEndOfBatch;
  good.user_tag = 77;
  good.local_buffer_id = local;
  good.length = 8;
  good.remote_handle = handle;
  std::memcpy(raw->memory.data() + geometry->submissions_offset +
                  ring::kSubmissionBytes,
              &good, sizeof(good));
  raw->Word(ring::kSqTailOffset).store(2);
  ASSERT_EQ(::send(raw->connection.get(), &byte, 1, MSG_NOSIGNAL), 1);
  ASSERT_TRUE(
      Eventually([&] { return raw->Word(ring::kCqTailOffset).load() == 2; }));
  const ring::Completion second =
      ring::ReadCompletion(raw->memory.data(), *geometry, 1, &message);
  EXPECT_EQ(second.user_tag, 77u);
  EXPECT_EQ(second.code, 0) << message;
}

TEST_F(RingTest, ABadNotificationFailsItsEntryAndOthersRun) {
  const uint64_t local = Filled(13);
  const uint64_t handle = Import(Filled(14));
  auto raw = OpenRaw(agent_->agent().attach_socket_path(), 32);
  ASSERT_TRUE(raw.ok()) << raw.status();
  auto geometry = ring::ReadHeader(raw->memory.data(), raw->memory.size());
  ASSERT_TRUE(geometry.ok());
  ASSERT_EQ(geometry->payload_area_bytes(), 32u * 256);
  auto entry = [&](uint64_t tag, uint64_t local_offset) {
    ring::Submission e;
    e.opcode = ring::kOpReadIntoLocal;
    e.flags = ring::kEndOfBatch | ring::kNotify;
    e.user_tag = tag;
    e.local_buffer_id = local;
    e.local_offset = local_offset;
    e.length = 8;
    e.remote_handle = handle;
    return e;
  };
  const uint64_t area = geometry->payload_area_bytes();
  std::vector<ring::Submission> entries = {entry(1, 0), entry(2, 100),
                                           entry(3, 200), entry(4, 300)};
  // Beyond the payload area; over --max_notification_bytes (4096; the
  // area holds 8192); empty.
  entries[0].notification = (area - 4) | (uint64_t{8} << 32);
  entries[1].notification = uint64_t{4097} << 32;
  entries[2].notification = 16;
  // A good batch among them, without a notification.
  entries[3].flags = ring::kEndOfBatch;
  for (size_t i = 0; i < entries.size(); ++i) {
    std::memcpy(raw->memory.data() + geometry->submissions_offset +
                    i * ring::kSubmissionBytes,
                &entries[i], sizeof(entries[i]));
  }
  raw->Word(ring::kSqTailOffset).store(4);
  const char byte = 1;
  ASSERT_EQ(::send(raw->connection.get(), &byte, 1, MSG_NOSIGNAL), 1);
  ASSERT_TRUE(
      Eventually([&] { return raw->Word(ring::kCqTailOffset).load() == 4; }));
  std::map<uint64_t, std::pair<int, std::string>> ends;
  for (uint32_t i = 0; i < 4; ++i) {
    std::string message;
    const ring::Completion end =
        ring::ReadCompletion(raw->memory.data(), *geometry, i, &message);
    ends[end.user_tag] = {end.code, message};
  }
  const int invalid = static_cast<int>(absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ends[1].first, invalid);
  EXPECT_THAT(ends[1].second, HasSubstr("beyond the payload area"));
  EXPECT_EQ(ends[2].first, invalid);
  EXPECT_THAT(ends[2].second, HasSubstr("--max_notification_bytes"));
  EXPECT_EQ(ends[3].first, invalid);
  EXPECT_THAT(ends[3].second, HasSubstr("payload_length"));
  EXPECT_EQ(ends[4].first, 0) << ends[4].second;
  // Only the good batch moved bytes.
  std::string expected = PatternString(13, 0, kSize);
  expected.replace(300, 8, PatternString(14, 0, 8));
  EXPECT_EQ(Read(local), expected);
}

TEST_F(RingTest, ClosingTheConnectionEndsTheSession) {
  auto ring = Open(1024);
  ASSERT_NE(ring, nullptr);
  EXPECT_TRUE(Eventually([&] { return agent_->agent().rings().open() == 1; }));
  ring.reset();
  EXPECT_TRUE(Eventually([&] { return agent_->agent().rings().open() == 0; }));
}

TEST_F(RingTest, AStoppedAgentEndsTheSession) {
  const uint64_t local = Filled(11);
  const uint64_t handle = Import(Filled(12));
  auto ring = Open();
  ASSERT_NE(ring, nullptr);
  const RingOp op = Op(kRead, local, 0, 8, handle, 0, 1);
  ASSERT_TRUE(ring->Submit({&op, 1}).ok());
  EXPECT_EQ(Reap(*ring, 1).size(), 1u);
  agent_.reset();
  std::vector<RingCompletion> ends;
  auto waited = ring->Wait(&ends, absl::Seconds(10));
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kUnavailable)
      << waited.status();
  EXPECT_EQ(ring->Submit({&op, 1}).code(), absl::StatusCode::kUnavailable);
}

// A ring op whose handle names another agent's buffer runs over tcp.
TEST(RingTcpTest, RingOpsReachAnotherAgentOverTcp) {
  AgentOptions a_options;
  a_options.backends = {LoopbackTcpFactory()};
  auto a = InProcessAgent::Start(std::move(a_options));
  ASSERT_TRUE(a.ok()) << a.status();
  AgentOptions b_options;
  b_options.backends = {LoopbackTcpFactory()};
  auto b = InProcessAgent::Start(std::move(b_options));
  ASSERT_TRUE(b.ok()) << b.status();
  auto local = (*a)->Allocate(kSize);
  ASSERT_TRUE(local.ok()) << local.status();
  auto remote = (*b)->Allocate(kSize);
  ASSERT_TRUE(remote.ok()) << remote.status();
  {
    grpc::ClientContext call;
    v1::WriteBufferRequest request;
    request.set_buffer_id(remote->buffer_id());
    request.set_data(PatternString(31, 0, kSize));
    v1::WriteBufferResponse response;
    ASSERT_TRUE((*b)->stub().WriteBuffer(&call, request, &response).ok());
  }
  grpc::ClientContext call;
  v1::ImportRemoteRequest import;
  import.set_remote_context(remote->remote_context());
  v1::ImportRemoteResponse imported;
  ASSERT_TRUE((*a)->stub().ImportRemote(&call, import, &imported).ok());
  auto ring =
      Ring::Open((*a)->agent().attach_socket_path(), 8, absl::Seconds(10));
  ASSERT_TRUE(ring.ok()) << ring.status();
  RingOp op;
  op.type = kRead;
  op.local_buffer_id = local->buffer_id();
  op.local_offset = 1000;
  op.length = 2000;
  op.remote_handle = imported.remote_handle();
  op.remote_offset = 500;
  ASSERT_TRUE((*ring)->Submit({&op, 1}).ok());
  std::vector<RingCompletion> ends;
  auto got = (*ring)->Wait(&ends, absl::Seconds(10));
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_TRUE(ends[0].status.ok()) << ends[0].status;
  EXPECT_EQ(ends[0].backend, "tcp");
  grpc::ClientContext read_call;
  v1::ReadBufferRequest read;
  read.set_buffer_id(local->buffer_id());
  read.set_length(kSize);
  v1::ReadBufferResponse data;
  ASSERT_TRUE((*a)->stub().ReadBuffer(&read_call, read, &data).ok());
  std::string expected(kSize, '\0');
  expected.replace(1000, 2000, PatternString(31, 500, 2000));
  EXPECT_EQ(data.data(), expected);
}

}  // namespace
}  // namespace rdma_agent::testing

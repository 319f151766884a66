// Asynchronous transfers between two rdma-agentd processes over tcp
// (loopback; distinct agents, so the memory backend cannot carry them):
// every byte lands where a DONE transfer says, and CancelTransfer in the
// middle of a large transfer returns only when nothing of it writes into
// local memory any more.

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "client/rdma_agent_client.h"
#include "common/grpc_status.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/eventually.h"
#include "tests/testing/pattern.h"

namespace rdma_agent::testing {
namespace {

namespace v1 = ::rdma::agent::v1;

constexpr uint64_t kLarge = 512ull << 20;

AgentProcess::Options TcpAgent() {
  AgentProcess::Options options;
  options.backends = "memory,tcp";
  options.log_level = "info";  // debug would log every chunk
  return options;
}

v1::Op ReadOp(const client::Buffer& local, uint64_t local_offset,
              uint64_t length, const client::Buffer& remote,
              uint64_t remote_offset) {
  v1::Op op;
  op.set_type(v1::OP_TYPE_READ_INTO_LOCAL);
  op.set_local_buffer_id(local.id());
  op.set_local_offset(local_offset);
  op.set_length(length);
  op.set_remote_context(remote.remote_context());
  op.set_remote_offset(remote_offset);
  return op;
}

absl::StatusOr<uint64_t> SubmitAsyncTo(v1::RdmaAgent::Stub& stub,
                                       const v1::SubmitRequest& request) {
  grpc::ClientContext context;
  v1::SubmitAsyncResponse response;
  const absl::Status status =
      FromGrpcStatus(stub.SubmitAsync(&context, request, &response));
  if (!status.ok()) return status;
  return response.transfer_id();
}

absl::StatusOr<v1::Transfer> GetFrom(v1::RdmaAgent::Stub& stub, uint64_t id,
                                     int64_t wait_seconds = 0) {
  grpc::ClientContext context;
  v1::GetTransfersRequest request;
  request.add_transfer_ids(id);
  request.mutable_wait()->set_seconds(wait_seconds);
  v1::GetTransfersResponse response;
  const absl::Status status =
      FromGrpcStatus(stub.GetTransfers(&context, request, &response));
  if (!status.ok()) return status;
  return response.transfers(0);
}

class TransfersTcpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto a = AgentProcess::Start(TcpAgent());
    ASSERT_TRUE(a.ok()) << a.status();
    a_ = std::move(*a);
    auto b = AgentProcess::Start(TcpAgent());
    ASSERT_TRUE(b.ok()) << b.status();
    b_ = std::move(*b);
    stub_ = v1::RdmaAgent::NewStub(a_->client().channel());
  }

  void TearDown() override {
    if (HasFailure()) {
      ADD_FAILURE() << "agent a log:\n" << a_->Log();
      ADD_FAILURE() << "agent b log:\n" << b_->Log();
    }
  }

  absl::StatusOr<uint64_t> SubmitAsync(const v1::SubmitRequest& request) {
    return SubmitAsyncTo(*stub_, request);
  }

  absl::StatusOr<v1::Transfer> Get(uint64_t id, int64_t wait_seconds = 0) {
    return GetFrom(*stub_, id, wait_seconds);
  }

  std::unique_ptr<AgentProcess> a_;
  std::unique_ptr<AgentProcess> b_;
  std::unique_ptr<v1::RdmaAgent::Stub> stub_;
};

TEST_F(TransfersTcpTest, DoneTransferMovedExactlyItsRanges) {
  constexpr uint64_t kSize = (4ull << 20) + 4096;
  auto local = a_->client().Attach(kSize, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(local.ok()) << local.status();
  auto remote = b_->client().Attach(kSize, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(remote.ok()) << remote.status();
  FillPattern(local->bytes(), 1);
  FillPattern(remote->bytes(), 2);
  v1::SubmitRequest request;
  // 3 MiB + 5 bytes at odd offsets, and a 1-byte op far from it.
  constexpr uint64_t kOffset = 4099, kFrom = 333, kLength = (3ull << 20) + 5;
  *request.add_ops() = ReadOp(*local, kOffset, kLength, *remote, kFrom);
  *request.add_ops() = ReadOp(*local, kSize - 1, 1, *remote, 0);
  request.mutable_timeout()->set_seconds(60);
  auto id = SubmitAsync(request);
  ASSERT_TRUE(id.ok()) << id.status();
  auto done = Get(*id, 30);
  ASSERT_TRUE(done.ok()) << done.status();
  ASSERT_EQ(done->state(), v1::TRANSFER_STATE_DONE) << done->ShortDebugString();
  for (const auto& result : done->results()) EXPECT_EQ(result.backend(), "tcp");
  const absl::Span<const std::byte> bytes = local->bytes();
  EXPECT_EQ(FindMismatch(bytes.subspan(0, kOffset), 1, 0), std::nullopt);
  EXPECT_EQ(FindMismatch(bytes.subspan(kOffset, kLength), 2, kFrom),
            std::nullopt);
  EXPECT_EQ(FindMismatch(
                bytes.subspan(kOffset + kLength, kSize - 1 - kOffset - kLength),
                1, kOffset + kLength),
            std::nullopt);
  EXPECT_EQ(bytes[kSize - 1], PatternByte(2, 0));
  // The remote side was only read.
  EXPECT_EQ(FindMismatch(remote->bytes(), 2, 0), std::nullopt);
}

TEST_F(TransfersTcpTest, CancelMidFlightLeavesNothingWritingIntoMemory) {
  auto local = a_->client().Attach(kLarge, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(local.ok()) << local.status();
  auto remote = b_->client().Attach(kLarge, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(remote.ok()) << remote.status();
  std::memset(local->data(), 0, kLarge);
  std::memset(remote->data(), 0x5a, kLarge);
  // 32 reads of the whole 512 MiB: seconds of work over loopback.
  v1::SubmitRequest request;
  for (int i = 0; i < 32; ++i) {
    *request.add_ops() = ReadOp(*local, 0, kLarge, *remote, 0);
  }
  request.mutable_timeout()->set_seconds(600);
  auto id = SubmitAsync(request);
  ASSERT_TRUE(id.ok()) << id.status();
  // Mid-flight: bytes have started to land.
  const std::byte* data = local->data();
  ASSERT_TRUE(Eventually(
      [&] {
        for (uint64_t at = 0; at < kLarge; at += 1 << 20) {
          if (data[at] == std::byte{0x5a}) return true;
        }
        return false;
      },
      absl::Seconds(60)))
      << "the transfer never moved a byte";

  grpc::ClientContext context;
  v1::CancelTransferRequest cancel;
  cancel.set_transfer_id(*id);
  v1::CancelTransferResponse response;
  const absl::Time start = absl::Now();
  ASSERT_TRUE(stub_->CancelTransfer(&context, cancel, &response).ok());
  // Right away: a sentinel over the whole buffer. Anything of the transfer
  // still in flight would overwrite some of it with 0x5a.
  std::memset(local->data(), 0xc3, kLarge);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  const v1::Transfer& transfer = response.transfer();
  EXPECT_EQ(transfer.state(), v1::TRANSFER_STATE_CANCELLED) << transfer.state();
  ASSERT_EQ(transfer.results_size(), 32);
  int stopped = 0;
  for (const auto& result : transfer.results()) {
    EXPECT_TRUE(result.code() == 0 || result.code() == 1) << result.message();
    stopped += result.code() == 1;
  }
  EXPECT_GT(stopped, 0);

  absl::SleepFor(absl::Seconds(1));
  const std::byte* end = data + kLarge;
  const std::byte* changed =
      std::find_if(data, end, [](std::byte b) { return b != std::byte{0xc3}; });
  EXPECT_EQ(changed, end) << "byte " << (changed - data)
                          << " was written after CancelTransfer returned";
  // The agent serves on: a fresh transfer over tcp completes.
  v1::SubmitRequest again;
  *again.add_ops() = ReadOp(*local, 0, 4096, *remote, 0);
  auto next = SubmitAsync(again);
  ASSERT_TRUE(next.ok()) << next.status();
  auto done = Get(*next, 30);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->state(), v1::TRANSFER_STATE_DONE) << done->ShortDebugString();
}

TEST_F(TransfersTcpTest, RunningTransferReportsBytesLandedWithinItsOps) {
  auto local = a_->client().Attach(kLarge, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(local.ok()) << local.status();
  auto remote = b_->client().Attach(kLarge, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(remote.ok()) << remote.status();
  std::memset(remote->data(), 0x5a, kLarge);
  constexpr int kOps = 32;  // seconds of work over loopback
  v1::SubmitRequest request;
  for (int i = 0; i < kOps; ++i) {
    *request.add_ops() = ReadOp(*local, 0, kLarge, *remote, 0);
  }
  request.mutable_timeout()->set_seconds(600);
  auto id = SubmitAsync(request);
  ASSERT_TRUE(id.ok()) << id.status();
  // While it runs the agent reports what has landed, part of an op at a
  // time (tcp counts chunks), never going back and never past the total.
  uint64_t last = 0;
  bool inside_an_op = false;
  const absl::Time until = absl::Now() + absl::Seconds(120);
  while (!inside_an_op && absl::Now() < until) {
    auto now = Get(*id);
    ASSERT_TRUE(now.ok()) << now.status();
    ASSERT_EQ(now->state(), v1::TRANSFER_STATE_PENDING)
        << "ended before a part of an op was seen: " << now->bytes_done();
    EXPECT_EQ(now->bytes_total(), kOps * kLarge);
    EXPECT_GE(now->bytes_done(), last);
    EXPECT_LE(now->bytes_done(), now->bytes_total());
    last = now->bytes_done();
    inside_an_op = last % kLarge != 0;
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_TRUE(inside_an_op) << "bytes_done only ever " << last;

  grpc::ClientContext context;
  v1::CancelTransferRequest cancel;
  cancel.set_transfer_id(*id);
  v1::CancelTransferResponse response;
  ASSERT_TRUE(stub_->CancelTransfer(&context, cancel, &response).ok());
  // Once ended it is exact: the bytes of the ops that succeeded.
  const v1::Transfer& end = response.transfer();
  ASSERT_EQ(end.results_size(), kOps);
  uint64_t succeeded = 0;
  for (const auto& result : end.results()) succeeded += result.code() == 0;
  EXPECT_EQ(end.bytes_total(), kOps * kLarge);
  EXPECT_EQ(end.bytes_done(), succeeded * kLarge) << end.ShortDebugString();
}

TEST_F(TransfersTcpTest, EndedTransferCountsOnlyTheBytesOfOpsThatRan) {
  constexpr uint64_t kSize = 1 << 20;
  auto local = a_->client().Attach(kSize, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(local.ok()) << local.status();
  auto remote = b_->client().Attach(kSize, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(remote.ok()) << remote.status();
  v1::SubmitRequest request;
  *request.add_ops() = ReadOp(*local, 0, kSize, *remote, 0);
  // Refused before it runs (past the remote buffer's end): not in the total.
  *request.add_ops() = ReadOp(*local, 0, kSize, *remote, 4096);
  *request.add_ops() = ReadOp(*local, 0, 4096, *remote, 0);
  auto id = SubmitAsync(request);
  ASSERT_TRUE(id.ok()) << id.status();
  auto end = Get(*id, 30);
  ASSERT_TRUE(end.ok()) << end.status();
  ASSERT_NE(end->state(), v1::TRANSFER_STATE_PENDING);
  ASSERT_EQ(end->results_size(), 3);
  EXPECT_EQ(end->results(0).code(), 0) << end->results(0).message();
  EXPECT_NE(end->results(1).code(), 0);
  EXPECT_EQ(end->results(2).code(), 0) << end->results(2).message();
  EXPECT_EQ(end->bytes_total(), kSize + 4096);
  EXPECT_EQ(end->bytes_done(), kSize + 4096);
}

// One transfer worker, and a transfer to a peer that answers nothing (held
// with SIGSTOP: its kernel still accepts the connection): the worker only
// starts it and goes back to the queue, so a second transfer still runs.
// Before transfers were started by callback, the worker waited on the first
// until its deadline and the second stayed PENDING.
TEST(TransfersHeldPeerTest, OneWorkerIsNotHeldByATransferToASilentPeer) {
  AgentProcess::Options one_worker = TcpAgent();
  one_worker.extra_flags = {"--transfer_workers=1",
                            "--max_running_transfers_per_user=4"};
  auto a = AgentProcess::Start(one_worker);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = AgentProcess::Start(TcpAgent());
  ASSERT_TRUE(b.ok()) << b.status();
  auto stub = v1::RdmaAgent::NewStub((*a)->client().channel());
  constexpr uint64_t kSize = 1 << 20;
  auto local = (*a)->client().Attach(kSize, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(local.ok()) << local.status();
  auto near = (*a)->client().Attach(kSize, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(near.ok()) << near.status();
  auto remote = (*b)->client().Attach(kSize, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(remote.ok()) << remote.status();
  FillPattern(local->bytes(), 1);
  FillPattern(near->bytes(), 2);
  FillPattern(remote->bytes(), 3);
  // A read over tcp first, so that the held peer's connection is pooled.
  {
    client::OpSpec warm;
    warm.type = v1::OP_TYPE_READ_INTO_LOCAL;
    warm.local_buffer_id = local->id();
    warm.length = 16;
    warm.remote_context = remote->remote_context();
    auto results = (*a)->client().Submit({warm}, absl::Seconds(30));
    ASSERT_TRUE(results.ok()) << results.status();
    ASSERT_TRUE((*results)[0].status.ok()) << (*results)[0].status;
    FillPattern(local->bytes(), 1);
  }
  auto submit = [&](const v1::SubmitRequest& request) -> uint64_t {
    absl::StatusOr<uint64_t> id = SubmitAsyncTo(*stub, request);
    EXPECT_TRUE(id.ok()) << id.status();
    return id.ok() ? *id : 0;
  };
  auto get = [&](uint64_t id, int64_t wait_seconds) {
    absl::StatusOr<v1::Transfer> transfer = GetFrom(*stub, id, wait_seconds);
    EXPECT_TRUE(transfer.ok()) << transfer.status();
    return transfer.ok() ? *transfer : v1::Transfer();
  };

  (*b)->Hold();
  v1::SubmitRequest held;
  *held.add_ops() = ReadOp(*local, 0, 4096, *remote, 0);
  held.mutable_timeout()->set_seconds(60);
  const uint64_t held_id = submit(held);
  // The worker takes it at once (PENDING covers queued and running alike).
  absl::SleepFor(absl::Milliseconds(500));
  ASSERT_EQ(get(held_id, 0).state(), v1::TRANSFER_STATE_PENDING);

  v1::SubmitRequest local_copy;
  *local_copy.add_ops() = ReadOp(*local, 8192, 4096, *near, 100);
  local_copy.mutable_timeout()->set_seconds(30);
  const uint64_t copy_id = submit(local_copy);
  const v1::Transfer copied = get(copy_id, 10);
  ASSERT_EQ(copied.state(), v1::TRANSFER_STATE_DONE)
      << copied.ShortDebugString();
  EXPECT_EQ(get(held_id, 0).state(), v1::TRANSFER_STATE_PENDING);
  const absl::Span<const std::byte> bytes = local->bytes();
  EXPECT_EQ(FindMismatch(bytes.subspan(8192, 4096), 2, 100), std::nullopt);
  EXPECT_EQ(FindMismatch(bytes.subspan(0, 8192), 1, 0), std::nullopt);
  EXPECT_EQ(FindMismatch(bytes.subspan(12288), 1, 12288), std::nullopt);

  {
    grpc::ClientContext context;
    v1::CancelTransferRequest cancel;
    cancel.set_transfer_id(held_id);
    v1::CancelTransferResponse response;
    ASSERT_TRUE(stub->CancelTransfer(&context, cancel, &response).ok());
  }
  EXPECT_EQ(get(held_id, 10).state(), v1::TRANSFER_STATE_CANCELLED);
  (*b)->Resume();
  // Nothing of the cancelled read lands once the peer answers.
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(FindMismatch(bytes.subspan(0, 4096), 1, 0), std::nullopt);
}

}  // namespace
}  // namespace rdma_agent::testing

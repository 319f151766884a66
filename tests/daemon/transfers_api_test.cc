// The asynchronous transfer API (SubmitAsync, GetTransfers, WatchTransfers,
// CancelTransfer) of one in-process agent with the memory backend: every
// state transition, cancellation before, during and after a run, long polls,
// bounds, watchers, retention and shutdown, with the bytes checked.
//
// Transfers are made to wait with a "blocker": a transfer of thousands of
// 64 MiB copies inside one buffer (minutes of work) that keeps the agent's
// only transfer worker busy until the test cancels it.

#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/internal/http_get.h"
#include "daemon/ops/transfers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/agent_fixture.h"
#include "tests/testing/eventually.h"
#include "tests/testing/pattern.h"

namespace rdma_agent {
namespace {

using ::rdma_agent::FromGrpcStatus;
using ::rdma_agent::testing::Eventually;
using ::rdma_agent::testing::InProcessAgent;
using ::rdma_agent::testing::PatternString;
using ::testing::HasSubstr;

constexpr uint64_t kBlockerHalf = 64ull << 20;
constexpr int kBlockerOps = 4096;  // 256 GiB of copying: never ends by itself

struct Buffer {
  uint64_t id = 0;
  std::string context;
};

v1::Op MakeOp(v1::OpType type, const Buffer& local, uint64_t local_offset,
              uint64_t length, const Buffer& remote, uint64_t remote_offset) {
  v1::Op op;
  op.set_type(type);
  op.set_local_buffer_id(local.id);
  op.set_local_offset(local_offset);
  op.set_length(length);
  op.set_remote_context(remote.context);
  op.set_remote_offset(remote_offset);
  return op;
}

v1::SubmitRequest Batch(std::vector<v1::Op> ops,
                        absl::Duration timeout = absl::Seconds(60)) {
  v1::SubmitRequest request;
  for (auto& op : ops) *request.add_ops() = std::move(op);
  request.mutable_timeout()->set_seconds(absl::ToInt64Seconds(timeout));
  request.mutable_timeout()->set_nanos(
      static_cast<int32_t>(absl::ToInt64Nanoseconds(
          timeout - absl::Seconds(absl::ToInt64Seconds(timeout)))));
  return request;
}

class TransfersApiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    AgentOptions options;
    options.transfers.workers = 1;  // transfers queue behind a blocker
    StartAgent(std::move(options));
  }

  void StartAgent(AgentOptions options) {
    fixture_.reset();
    auto fixture = InProcessAgent::Start(std::move(options));
    ASSERT_TRUE(fixture.ok()) << fixture.status();
    fixture_ = std::move(*fixture);
  }

  v1::RdmaAgent::Stub& stub() { return fixture_->stub(); }
  const TransferTable& transfers() { return fixture_->agent().transfers(); }

  Buffer Allocate(uint64_t size) {
    auto response = fixture_->Allocate(size);
    EXPECT_TRUE(response.ok()) << response.status();
    if (!response.ok()) return {};
    return {response->buffer_id(), response->remote_context()};
  }

  absl::Status Write(const Buffer& buffer, uint64_t offset,
                     const std::string& data) {
    grpc::ClientContext context;
    v1::WriteBufferRequest request;
    request.set_buffer_id(buffer.id);
    request.set_offset(offset);
    request.set_data(data);
    v1::WriteBufferResponse response;
    return FromGrpcStatus(stub().WriteBuffer(&context, request, &response));
  }

  std::string Read(const Buffer& buffer, uint64_t offset, uint64_t length) {
    grpc::ClientContext context;
    v1::ReadBufferRequest request;
    request.set_buffer_id(buffer.id);
    request.set_offset(offset);
    request.set_length(length);
    v1::ReadBufferResponse response;
    const absl::Status status =
        FromGrpcStatus(stub().ReadBuffer(&context, request, &response));
    EXPECT_TRUE(status.ok()) << status;
    return response.data();
  }

  absl::StatusOr<uint64_t> SubmitAsync(const v1::SubmitRequest& request) {
    grpc::ClientContext context;
    v1::SubmitAsyncResponse response;
    const absl::Status status =
        FromGrpcStatus(stub().SubmitAsync(&context, request, &response));
    if (!status.ok()) return status;
    return response.transfer_id();
  }

  absl::StatusOr<v1::Transfer> Get(uint64_t id,
                                   absl::Duration wait = absl::ZeroDuration()) {
    grpc::ClientContext context;
    v1::GetTransfersRequest request;
    request.add_transfer_ids(id);
    request.mutable_wait()->set_seconds(absl::ToInt64Seconds(wait));
    request.mutable_wait()->set_nanos(
        static_cast<int32_t>(absl::ToInt64Nanoseconds(wait) % 1000000000));
    v1::GetTransfersResponse response;
    const absl::Status status =
        FromGrpcStatus(stub().GetTransfers(&context, request, &response));
    if (!status.ok()) return status;
    return response.transfers(0);
  }

  absl::StatusOr<v1::Transfer> Cancel(uint64_t id) {
    grpc::ClientContext context;
    v1::CancelTransferRequest request;
    request.set_transfer_id(id);
    v1::CancelTransferResponse response;
    const absl::Status status =
        FromGrpcStatus(stub().CancelTransfer(&context, request, &response));
    if (!status.ok()) return status;
    return response.transfer();
  }

  // A WatchTransfers stream on a connection of its own.
  struct Watch {
    std::unique_ptr<v1::RdmaAgent::Stub> stub;
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReader<v1::TransferEvent>> reader;
  };
  std::unique_ptr<Watch> OpenWatch() {
    auto watch = std::make_unique<Watch>();
    // A test expecting ends that never come fails instead of hanging.
    watch->context.set_deadline(
        absl::ToChronoTime(absl::Now() + absl::Minutes(2)));
    watch->stub = fixture_->NewStub();
    watch->reader = watch->stub->WatchTransfers(&watch->context,
                                                v1::WatchTransfersRequest());
    return watch;
  }
  // The stream's end, once its client has cancelled it or the agent ended
  // it.
  static grpc::Status Close(Watch& watch, bool cancel = true) {
    if (cancel) watch.context.TryCancel();
    v1::TransferEvent ignored;
    while (watch.reader->Read(&ignored)) {
    }
    return watch.reader->Finish();
  }

  // A GetTransfers long poll for `id` on a thread of its own.
  struct LongPoll {
    // A test that stops early gives the poll up rather than wait for it.
    ~LongPoll() {
      context.TryCancel();
      if (thread.joinable()) thread.join();
    }

    grpc::ClientContext context;
    grpc::Status status;
    v1::GetTransfersResponse response;
    std::thread thread;
  };
  std::unique_ptr<LongPoll> StartLongPoll(uint64_t id, absl::Duration wait) {
    auto poll = std::make_unique<LongPoll>();
    v1::GetTransfersRequest request;
    request.add_transfer_ids(id);
    request.mutable_wait()->set_seconds(absl::ToInt64Seconds(wait));
    poll->thread = std::thread([this, request, poll = poll.get()] {
      poll->status =
          stub().GetTransfers(&poll->context, request, &poll->response);
    });
    return poll;
  }

  // A transfer of kBlockerOps 64 MiB copies inside one buffer, running on
  // the worker once this returns.
  uint64_t StartBlocker(absl::Duration timeout = absl::Seconds(600)) {
    if (blocker_buffer_.id == 0) blocker_buffer_ = Allocate(2 * kBlockerHalf);
    std::vector<v1::Op> ops(
        kBlockerOps, MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, blocker_buffer_, 0,
                            kBlockerHalf, blocker_buffer_, kBlockerHalf));
    auto id = SubmitAsync(Batch(std::move(ops), timeout));
    EXPECT_TRUE(id.ok()) << id.status();
    if (!id.ok()) return 0;
    EXPECT_TRUE(Eventually([&] {
      auto transfer = Get(*id);
      return transfer.ok() && transfer->has_start_time();
    })) << "the blocker never started";
    return *id;
  }

  // A source and a destination of `size` bytes holding patterns 1 and 2.
  void MakePair(uint64_t size, Buffer* source, Buffer* destination) {
    *source = Allocate(size);
    *destination = Allocate(size);
    ASSERT_TRUE(Write(*source, 0, PatternString(1, 0, size)).ok());
    ASSERT_TRUE(Write(*destination, 0, PatternString(2, 0, size)).ok());
  }

  std::unique_ptr<InProcessAgent> fixture_;
  Buffer blocker_buffer_;
};

TEST_F(TransfersApiTest, SubmitAsyncValidatesTheBatchLikeSubmit) {
  AgentOptions options;
  options.api.max_ops_per_submit = 2;
  options.api.max_submit_timeout = absl::Seconds(10);
  StartAgent(std::move(options));
  const Buffer buffer = Allocate(4096);
  const v1::Op op =
      MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, buffer, 0, 16, buffer, 16);
  std::vector<v1::SubmitRequest> bad = {
      Batch({}),                       // empty
      Batch({op, op, op}),             // too many ops
      Batch({op}, absl::Seconds(11)),  // past the limit
  };
  bad.push_back(Batch({op}));
  bad.back().mutable_timeout()->set_seconds(-1);  // malformed
  for (const v1::SubmitRequest& request : bad) {
    SCOPED_TRACE(request.ShortDebugString());
    grpc::ClientContext sync_context;
    v1::SubmitResponse sync_response;
    const absl::Status sync =
        FromGrpcStatus(stub().Submit(&sync_context, request, &sync_response));
    const absl::Status async = SubmitAsync(request).status();
    ASSERT_FALSE(sync.ok());
    EXPECT_EQ(async.code(), sync.code()) << async;
    // The same words after the name of the RPC.
    ASSERT_THAT(std::string(sync.message()), ::testing::StartsWith("Submit: "));
    EXPECT_EQ(std::string(async.message()),
              absl::StrCat("SubmitAsync: ", sync.message().substr(8)));
  }
  EXPECT_EQ(transfers().kept(), 0u);
}

TEST_F(TransfersApiTest, PendingThenDoneMovesExactlyTheBytesAsked) {
  constexpr uint64_t kSize = 1 << 20;
  Buffer source, destination;
  MakePair(kSize, &source, &destination);
  const uint64_t blocker = StartBlocker();
  // A READ into destination[1000, 1000+70000) from source[5000, ...) and a
  // WRITE from destination[300000, +4097) into source[600000, ...).
  auto id = SubmitAsync(Batch({MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, destination,
                                      1000, 70000, source, 5000),
                               MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL, destination,
                                      300000, 4097, source, 600000)}));
  ASSERT_TRUE(id.ok()) << id.status();
  auto pending = Get(*id);
  ASSERT_TRUE(pending.ok()) << pending.status();
  EXPECT_EQ(pending->state(), v1::TRANSFER_STATE_PENDING);
  EXPECT_EQ(pending->results_size(), 0);
  EXPECT_TRUE(pending->has_create_time());
  EXPECT_FALSE(pending->has_start_time()) << "queued behind the blocker";
  // Nothing moved while it waited.
  EXPECT_EQ(Read(destination, 0, kSize), PatternString(2, 0, kSize));

  ASSERT_TRUE(Cancel(blocker).ok());
  auto done = Get(*id, absl::Seconds(30));
  ASSERT_TRUE(done.ok()) << done.status();
  ASSERT_EQ(done->state(), v1::TRANSFER_STATE_DONE);
  ASSERT_EQ(done->results_size(), 2);
  for (const auto& result : done->results()) {
    EXPECT_EQ(result.code(), 0) << result.message();
    EXPECT_EQ(result.backend(), "memory");
  }
  EXPECT_TRUE(done->has_start_time());
  EXPECT_TRUE(done->has_end_time());
  // Inside each op's range the other side's bytes, outside them untouched.
  const std::string got = Read(destination, 0, kSize);
  EXPECT_EQ(got.substr(0, 1000), PatternString(2, 0, 1000));
  EXPECT_EQ(got.substr(1000, 70000), PatternString(1, 5000, 70000));
  EXPECT_EQ(got.substr(71000), PatternString(2, 71000, kSize - 71000));
  const std::string written = Read(source, 0, kSize);
  EXPECT_EQ(written.substr(0, 600000), PatternString(1, 0, 600000));
  EXPECT_EQ(written.substr(600000, 4097), PatternString(2, 300000, 4097));
  EXPECT_EQ(written.substr(604097), PatternString(1, 604097, kSize - 604097));
  // Its end was reported: the id is gone.
  EXPECT_TRUE(absl::IsNotFound(Get(*id).status()));
}

TEST_F(TransfersApiTest, FailedCarriesEachOpsResultAsSubmitWould) {
  Buffer source, destination;
  MakePair(4096, &source, &destination);
  const Buffer unknown{destination.id + 1000, destination.context};
  const v1::SubmitRequest request = Batch(
      {MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, destination, 0, 100, source, 0),
       MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, unknown, 0, 100, source, 0),
       MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, destination, 4000, 100, source, 0)});
  auto id = SubmitAsync(request);
  ASSERT_TRUE(id.ok()) << id.status();
  auto failed = Get(*id, absl::Seconds(30));
  ASSERT_TRUE(failed.ok()) << failed.status();
  EXPECT_EQ(failed->state(), v1::TRANSFER_STATE_FAILED);
  grpc::ClientContext context;
  v1::SubmitResponse sync;
  ASSERT_TRUE(FromGrpcStatus(stub().Submit(&context, request, &sync)).ok());
  ASSERT_EQ(failed->results_size(), 3);
  EXPECT_EQ(failed->results(0).code(), 0);
  EXPECT_EQ(failed->results(1).code(), 5);   // NOT_FOUND
  EXPECT_EQ(failed->results(2).code(), 11);  // OUT_OF_RANGE
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(failed->results(i).SerializeAsString(),
              sync.results(i).SerializeAsString())
        << "op " << i << ": " << failed->results(i).ShortDebugString() << " vs "
        << sync.results(i).ShortDebugString();
  }
  EXPECT_THAT(failed->results(1).message(), HasSubstr("op 1: "));
}

TEST_F(TransfersApiTest, CancelBeforeStartNeverTouchesTheBuffer) {
  constexpr uint64_t kSize = 65536;
  Buffer source, destination;
  MakePair(kSize, &source, &destination);
  const uint64_t blocker = StartBlocker();
  auto id = SubmitAsync(Batch(
      {MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, destination, 0, kSize, source, 0)}));
  ASSERT_TRUE(id.ok()) << id.status();
  auto cancelled = Cancel(*id);
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_EQ(cancelled->state(), v1::TRANSFER_STATE_CANCELLED);
  EXPECT_FALSE(cancelled->has_start_time());
  ASSERT_EQ(cancelled->results_size(), 1);
  EXPECT_EQ(cancelled->results(0).code(), 1);  // CANCELLED
  EXPECT_THAT(cancelled->results(0).message(), HasSubstr("before it started"));
  // The worker gets to run again: still nothing of the cancelled one.
  ASSERT_TRUE(Cancel(blocker).ok());
  auto after = SubmitAsync(
      Batch({MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, source, 0, 1, source, 1)}));
  ASSERT_TRUE(after.ok());
  ASSERT_TRUE(Get(*after, absl::Seconds(30)).ok());
  EXPECT_EQ(Read(destination, 0, kSize), PatternString(2, 0, kSize));
}

TEST_F(TransfersApiTest, CancelMidFlightStopsTheOpsAndReturnsWhenTheyHave) {
  const uint64_t blocker = StartBlocker();
  const absl::Time start = absl::Now();
  auto cancelled = Cancel(blocker);
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(cancelled->state(), v1::TRANSFER_STATE_CANCELLED);
  ASSERT_EQ(cancelled->results_size(), kBlockerOps);
  int stopped = 0;
  for (const auto& result : cancelled->results()) {
    EXPECT_TRUE(result.code() == 0 || result.code() == 1) << result.message();
    stopped += result.code() == 1;
  }
  EXPECT_GT(stopped, kBlockerOps / 2);
  EXPECT_EQ(transfers().in_flight(), 0u);
  // Its ops were given back: a Submit of the whole per-user allowance fits.
  Buffer source, destination;
  MakePair(4096, &source, &destination);
  std::vector<v1::Op> ops(
      65536, MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, destination, 0, 1, source, 0));
  grpc::ClientContext context;
  v1::SubmitResponse response;
  EXPECT_TRUE(
      FromGrpcStatus(stub().Submit(&context, Batch(std::move(ops)), &response))
          .ok());
}

TEST_F(TransfersApiTest, CancelAfterTheEndChangesNothing) {
  Buffer source, destination;
  MakePair(4096, &source, &destination);
  const v1::SubmitRequest request = Batch(
      {MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, destination, 0, 100, source, 0)});
  auto first = SubmitAsync(request);
  auto second = SubmitAsync(request);
  ASSERT_TRUE(first.ok() && second.ok());
  // One worker, first in first out: once the second has ended, so has the
  // first (which nobody has read yet).
  ASSERT_EQ(Get(*second, absl::Seconds(30))->state(), v1::TRANSFER_STATE_DONE);
  auto cancelled = Cancel(*first);
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_EQ(cancelled->state(), v1::TRANSFER_STATE_DONE);
  ASSERT_EQ(cancelled->results_size(), 1);
  EXPECT_EQ(cancelled->results(0).code(), 0);
  auto read = Get(*first);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->SerializeAsString(), cancelled->SerializeAsString());
}

TEST_F(TransfersApiTest, GetTransfersWaitReturnsAsSoonAsTheTransferEnds) {
  Buffer source, destination;
  MakePair(4096, &source, &destination);
  const uint64_t blocker = StartBlocker();
  auto id = SubmitAsync(Batch(
      {MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, destination, 0, 100, source, 0)}));
  ASSERT_TRUE(id.ok());
  absl::StatusOr<v1::Transfer> waited;
  absl::Time returned;
  std::thread waiter([&] {
    waited = Get(*id, absl::Seconds(50));
    returned = absl::Now();
  });
  absl::SleepFor(absl::Milliseconds(300));
  const absl::Time released = absl::Now();
  ASSERT_TRUE(Cancel(blocker).ok());
  waiter.join();
  ASSERT_TRUE(waited.ok()) << waited.status();
  EXPECT_EQ(waited->state(), v1::TRANSFER_STATE_DONE);
  EXPECT_GT(returned, released) << "it returned before the transfer could end";
  EXPECT_LT(returned - released, absl::Seconds(10));
}

TEST_F(TransfersApiTest, GetTransfersRefusesBadRequests) {
  grpc::ClientContext context;
  v1::GetTransfersRequest request;
  v1::GetTransfersResponse response;
  EXPECT_TRUE(absl::IsInvalidArgument(
      FromGrpcStatus(stub().GetTransfers(&context, request, &response))));
  auto unknown = Get(12345);
  EXPECT_TRUE(absl::IsNotFound(unknown.status())) << unknown.status();
  EXPECT_THAT(std::string(unknown.status().message()),
              HasSubstr("transfer 12345 is not known"));
  EXPECT_TRUE(absl::IsNotFound(Cancel(12345).status()));
}

TEST_F(TransfersApiTest, DeadlineRacingCancelEndsInOneConsistentState) {
  Buffer buffer = Allocate(2 * kBlockerHalf);
  for (int round = 0; round < 8; ++round) {
    SCOPED_TRACE(round);
    std::vector<v1::Op> ops(kBlockerOps,
                            MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, buffer, 0,
                                   kBlockerHalf, buffer, kBlockerHalf));
    const absl::Duration timeout = absl::Milliseconds(100);
    auto id = SubmitAsync(Batch(std::move(ops), timeout));
    ASSERT_TRUE(id.ok()) << id.status();
    absl::SleepFor(timeout - absl::Milliseconds(10) +
                   absl::Milliseconds(5 * round));
    auto cancelled = Cancel(*id);
    ASSERT_TRUE(cancelled.ok()) << cancelled.status();
    auto read = Get(*id);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(read->SerializeAsString(), cancelled->SerializeAsString());
    bool any_cancelled = false;
    for (const auto& result : read->results()) {
      EXPECT_TRUE(result.code() == 0 || result.code() == 1 ||
                  result.code() == 4)
          << result.message();
      any_cancelled |= result.code() == 1;
    }
    EXPECT_EQ(read->state(), any_cancelled ? v1::TRANSFER_STATE_CANCELLED
                                           : v1::TRANSFER_STATE_FAILED);
  }
}

TEST_F(TransfersApiTest, InFlightBoundIsHitCleanlyAndFreesUp) {
  AgentOptions options;
  options.transfers.workers = 1;
  options.transfers.max_in_flight_per_user = 2;
  options.in_flight.max_ops_per_user = kBlockerOps + 10;
  StartAgent(std::move(options));
  Buffer source, destination;
  MakePair(4096, &source, &destination);
  const uint64_t blocker = StartBlocker();
  const v1::SubmitRequest small = Batch(
      {MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, destination, 0, 100, source, 0)});
  auto queued = SubmitAsync(small);
  ASSERT_TRUE(queued.ok()) << queued.status();
  auto refused = SubmitAsync(small);
  EXPECT_TRUE(absl::IsResourceExhausted(refused.status())) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("--max_transfers_in_flight_per_user"));
  EXPECT_EQ(transfers().kept(), 2u) << "the refused one left something";
  // The transfers' ops count toward Submit's bound (blocker + 1 queued op).
  std::vector<v1::Op> ops(
      10, MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, destination, 0, 1, source, 0));
  grpc::ClientContext context;
  v1::SubmitResponse response;
  const absl::Status over =
      FromGrpcStatus(stub().Submit(&context, Batch(ops), &response));
  EXPECT_TRUE(absl::IsResourceExhausted(over)) << over;
  EXPECT_THAT(std::string(over.message()),
              HasSubstr("--max_ops_in_flight_per_user"));

  ASSERT_TRUE(Cancel(blocker).ok());
  ASSERT_TRUE(Get(*queued, absl::Seconds(30)).ok());
  ASSERT_TRUE(Get(blocker).ok());
  EXPECT_EQ(transfers().in_flight(), 0u);
  EXPECT_EQ(transfers().kept(), 0u);
  // Room again, for transfers and for ops.
  auto again = SubmitAsync(small);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(Get(*again, absl::Seconds(30))->state(), v1::TRANSFER_STATE_DONE);
  grpc::ClientContext retry;
  EXPECT_TRUE(
      FromGrpcStatus(stub().Submit(&retry, Batch(ops), &response)).ok());
}

TEST_F(TransfersApiTest, WatchTransfersPushesEndsAndLeavesThemReadable) {
  Buffer source, destination;
  MakePair(4096, &source, &destination);
  grpc::ClientContext watch_context;
  auto stream =
      stub().WatchTransfers(&watch_context, v1::WatchTransfersRequest());
  ASSERT_TRUE(Eventually([&] { return transfers().watchers() == 1; }));
  auto done = SubmitAsync(Batch(
      {MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, destination, 0, 100, source, 0)}));
  auto failed = SubmitAsync(Batch({MakeOp(v1::OP_TYPE_READ_INTO_LOCAL,
                                          destination, 4090, 100, source, 0)}));
  ASSERT_TRUE(done.ok() && failed.ok());
  v1::TransferEvent event;
  ASSERT_TRUE(stream->Read(&event));
  EXPECT_EQ(event.transfer().transfer_id(), *done);
  EXPECT_EQ(event.transfer().state(), v1::TRANSFER_STATE_DONE);
  ASSERT_EQ(event.transfer().results_size(), 1);
  ASSERT_TRUE(stream->Read(&event));
  EXPECT_EQ(event.transfer().transfer_id(), *failed);
  EXPECT_EQ(event.transfer().state(), v1::TRANSFER_STATE_FAILED);
  EXPECT_EQ(event.transfer().results(0).code(), 11);
  // Pushed is not read: GetTransfers still reports them, and its report is
  // the read.
  EXPECT_EQ(transfers().kept(), 2u);
  auto read = Get(*done);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->state(), v1::TRANSFER_STATE_DONE);
  EXPECT_TRUE(absl::IsNotFound(Get(*done).status()));

  // The watcher goes away: the agent hears it from gRPC and frees it.
  watch_context.TryCancel();
  v1::TransferEvent ignored;
  while (stream->Read(&ignored)) {
  }
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(Eventually([&] { return transfers().watchers() == 0; }));
}

TEST_F(TransfersApiTest, TwoWatchersBothSeeEveryEnd) {
  Buffer source, destination;
  MakePair(4096, &source, &destination);
  auto first = OpenWatch();
  auto second = OpenWatch();
  ASSERT_TRUE(Eventually([&] { return transfers().watchers() == 2; }));
  std::vector<uint64_t> ids;
  for (int i = 0; i < 6; ++i) {
    auto id = SubmitAsync(Batch(
        {MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, destination, i, 100, source, 0)}));
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  for (Watch* watch : {first.get(), second.get()}) {
    std::vector<uint64_t> seen;
    v1::TransferEvent event;
    while (seen.size() < ids.size() && watch->reader->Read(&event)) {
      EXPECT_EQ(event.transfer().state(), v1::TRANSFER_STATE_DONE);
      seen.push_back(event.transfer().transfer_id());
    }
    // One transfer worker: they end in the order they were submitted.
    EXPECT_EQ(seen, ids) << "the watchers split the ends between them";
  }
  EXPECT_EQ(Close(*first).error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(Close(*second).error_code(), grpc::StatusCode::CANCELLED);
}

TEST_F(TransfersApiTest, AWatcherKilledMidStreamLosesNothing) {
  Buffer source, destination;
  MakePair(4096, &source, &destination);
  auto doomed = OpenWatch();
  ASSERT_TRUE(Eventually([&] { return transfers().watchers() == 1; }));
  auto id = SubmitAsync(Batch(
      {MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, destination, 0, 100, source, 0)}));
  ASSERT_TRUE(id.ok()) << id.status();
  // The agent has written the end to the stream (it arrived), and its
  // client dies before acting on it: its connection closes under it.
  v1::TransferEvent event;
  ASSERT_TRUE(doomed->reader->Read(&event));
  ASSERT_EQ(event.transfer().transfer_id(), *id);
  doomed->reader.reset();
  doomed.reset();
  ASSERT_TRUE(Eventually([&] { return transfers().watchers() == 0; }));
  auto read = Get(*id);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->state(), v1::TRANSFER_STATE_DONE);
  ASSERT_EQ(read->results_size(), 1);
  EXPECT_EQ(read->results(0).code(), 0);
}

TEST_F(TransfersApiTest, TheKeptBoundRefusesUnseenEndsAndDropsDeliveredOnes) {
  AgentOptions options;
  options.transfers.max_kept_per_user = 2;
  StartAgent(std::move(options));
  Buffer source, destination;
  MakePair(4096, &source, &destination);
  const v1::SubmitRequest small = Batch(
      {MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, destination, 0, 100, source, 0)});
  auto first = SubmitAsync(small);
  auto second = SubmitAsync(small);
  ASSERT_TRUE(first.ok() && second.ok());
  ASSERT_TRUE(Eventually([&] { return transfers().in_flight() == 0; }));
  // Two ends nobody has seen: no room, and none is dropped to make some.
  auto refused = SubmitAsync(small);
  EXPECT_TRUE(absl::IsResourceExhausted(refused.status())) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("--max_kept_transfers_per_user"));
  EXPECT_THAT(std::string(refused.status().message()),
              ::testing::StartsWith("SubmitAsync: "));
  EXPECT_EQ(transfers().kept(), 2u);

  // A watch delivers both; the next SubmitAsync drops the oldest.
  auto watch = OpenWatch();
  v1::TransferEvent event;
  ASSERT_TRUE(watch->reader->Read(&event));
  ASSERT_TRUE(watch->reader->Read(&event));
  ASSERT_TRUE(Eventually([&] { return SubmitAsync(small).ok(); }))
      << "the delivered ends were not made room of";
  EXPECT_TRUE(absl::IsNotFound(Get(*first).status()));
  auto kept = Get(*second);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(kept->state(), v1::TRANSFER_STATE_DONE);
  Close(*watch);
}

TEST_F(TransfersApiTest, WaitingCallsHoldNoRpcThread) {
  AgentOptions options;
  options.transfers.workers = 1;
  options.in_flight.max_calls =
      4;  // gRPC server threads for the synchronous RPCs
  StartAgent(std::move(options));
  const uint64_t blocker = StartBlocker();
  constexpr int kEach = 8;
  std::vector<std::unique_ptr<Watch>> watches;
  std::vector<std::unique_ptr<LongPoll>> polls;
  for (int i = 0; i < kEach; ++i) {
    watches.push_back(OpenWatch());
    polls.push_back(StartLongPoll(blocker, absl::Seconds(50)));
  }
  // All of them wait in the agent at once, four times more than it has
  // threads for...
  ASSERT_TRUE(Eventually([&] {
    return transfers().watchers() == kEach &&
           transfers().waiting_polls() == kEach;
  })) << transfers().watchers()
      << " watches and " << transfers().waiting_polls() << " polls are waiting";
  // ...and a synchronous RPC still gets a thread.
  grpc::ClientContext context;
  v1::AgentInfo info;
  EXPECT_TRUE(
      FromGrpcStatus(stub().GetInfo(&context, v1::GetInfoRequest(), &info))
          .ok());
  // The polls answer once the blocker ends, with its end.
  ASSERT_TRUE(Cancel(blocker).ok());
  for (auto& poll : polls) {
    poll->thread.join();
    ASSERT_TRUE(poll->status.ok()) << poll->status.error_message();
    EXPECT_EQ(poll->response.transfers(0).state(),
              v1::TRANSFER_STATE_CANCELLED);
  }
  for (auto& watch : watches) {
    v1::TransferEvent event;
    ASSERT_TRUE(watch->reader->Read(&event));
    EXPECT_EQ(event.transfer().transfer_id(), blocker);
    EXPECT_EQ(Close(*watch).error_code(), grpc::StatusCode::CANCELLED);
  }
}

TEST_F(TransfersApiTest, WaitingCallsAreBoundedPerUserAndFreedWhenCancelled) {
  AgentOptions options;
  options.transfers.workers = 1;
  options.in_flight.max_waiting_per_user = 2;
  StartAgent(std::move(options));
  auto first = OpenWatch();
  auto second = OpenWatch();
  ASSERT_TRUE(Eventually([&] { return transfers().watchers() == 2; }));
  auto third = OpenWatch();
  const grpc::Status refused = Close(*third, /*cancel=*/false);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(refused.error_message(), HasSubstr("WatchTransfers: user "));
  EXPECT_THAT(refused.error_message(),
              HasSubstr("--max_waiting_rpcs_per_user"));
  // A GetTransfers long poll is a waiting call too...
  const uint64_t blocker = StartBlocker();
  const absl::Status poll = Get(blocker, absl::Seconds(10)).status();
  EXPECT_TRUE(absl::IsResourceExhausted(poll)) << poll;
  // ...not a GetTransfers that answers at once, nor the other RPCs: they
  // take call slots, so a user whose watches fill its waiting slots can
  // still read and act.
  auto now = Get(blocker);
  ASSERT_TRUE(now.ok()) << now.status();
  EXPECT_EQ(now->state(), v1::TRANSFER_STATE_PENDING);
  grpc::ClientContext context;
  v1::AgentInfo info;
  EXPECT_TRUE(
      FromGrpcStatus(stub().GetInfo(&context, v1::GetInfoRequest(), &info))
          .ok());

  // A watch its client cancels gives its slot back.
  EXPECT_EQ(Close(*first).error_code(), grpc::StatusCode::CANCELLED);
  // Accepted, the agent registers a watch; refused, it ends at once (the
  // slot comes back when gRPC is done with the cancelled call). Attempts
  // are kept open: on a loaded machine one may be registered only after
  // the next was refused.
  ASSERT_TRUE(Eventually([&] { return transfers().watchers() == 1; }));
  std::vector<std::unique_ptr<Watch>> attempts;
  ASSERT_TRUE(Eventually([&] {
    attempts.push_back(OpenWatch());
    return Eventually([&] { return transfers().watchers() == 2; },
                      absl::Milliseconds(200));
  })) << "the cancelled watch kept its slot";
  ASSERT_TRUE(Cancel(blocker).ok());
  int accepted = 0;
  for (auto& attempt : attempts) {
    v1::TransferEvent event;
    if (!attempt->reader->Read(&event)) {
      EXPECT_EQ(Close(*attempt, /*cancel=*/false).error_code(),
                grpc::StatusCode::RESOURCE_EXHAUSTED);
      continue;
    }
    ++accepted;
    EXPECT_EQ(event.transfer().transfer_id(), blocker);
    Close(*attempt);
  }
  EXPECT_EQ(accepted, 1) << "the freed slot was given to exactly one watch";
  Close(*second);
}

TEST_F(TransfersApiTest, TheRpcObserverSeesTheWaitingCalls) {
  AgentOptions options;
  options.metrics_listen = "127.0.0.1:0";
  StartAgent(std::move(options));
  EXPECT_TRUE(absl::IsNotFound(Get(12345).status()));
  EXPECT_TRUE(absl::IsNotFound(Get(12345, absl::Seconds(1)).status()));
  auto watch = OpenWatch();
  ASSERT_TRUE(Eventually([&] { return transfers().watchers() == 1; }));
  EXPECT_EQ(Close(*watch).error_code(), grpc::StatusCode::CANCELLED);
  // Counted by the interceptor once their status is sent (the watch's after
  // its client is gone: the agent still finishes it).
  const auto count = [&](const std::string& method, const std::string& code) {
    auto page = client::HttpGet(fixture_->agent().metrics_address(), "/metrics",
                                absl::Seconds(10));
    if (!page.ok()) return -1;
    const std::string series =
        absl::StrCat("rdma_agentd_rpcs_total{code=\"", code,
                     "\",method=\"rdma.agent.v1.RdmaAgent/", method, "\"} ");
    const size_t at = page->find(series);
    if (at == std::string::npos) return 0;
    return std::atoi(page->c_str() + at + series.size());
  };
  EXPECT_TRUE(Eventually([&] {
    return count("GetTransfers", "NOT_FOUND") == 2;
  })) << count("GetTransfers", "NOT_FOUND");
  EXPECT_TRUE(Eventually([&] {
    return count("WatchTransfers", "CANCELLED") == 1;
  })) << count("WatchTransfers", "CANCELLED");
}

TEST_F(TransfersApiTest, AWatchFirstPushesEndsNobodyReadYet) {
  Buffer source, destination;
  MakePair(4096, &source, &destination);
  auto id = SubmitAsync(Batch(
      {MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, destination, 0, 100, source, 0)}));
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(Eventually([&] { return transfers().in_flight() == 0; }));
  grpc::ClientContext watch_context;
  auto stream =
      stub().WatchTransfers(&watch_context, v1::WatchTransfersRequest());
  v1::TransferEvent event;
  ASSERT_TRUE(stream->Read(&event));
  EXPECT_EQ(event.transfer().transfer_id(), *id);
  EXPECT_EQ(event.transfer().state(), v1::TRANSFER_STATE_DONE);
  watch_context.TryCancel();
}

TEST_F(TransfersApiTest, UnreadEndsExpireAfterTheRetention) {
  AgentOptions options;
  options.transfers.retention = absl::Milliseconds(200);
  StartAgent(std::move(options));
  Buffer source, destination;
  MakePair(4096, &source, &destination);
  auto id = SubmitAsync(Batch(
      {MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, destination, 0, 100, source, 0)}));
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(Eventually([&] { return transfers().in_flight() == 0; }));
  absl::SleepFor(absl::Milliseconds(300));
  auto expired = Get(*id);
  EXPECT_TRUE(absl::IsNotFound(expired.status())) << expired.status();
  EXPECT_EQ(transfers().kept(), 0u);
}

TEST_F(TransfersApiTest, ShutdownEndsTransfersWatchesAndPollsPromptly) {
  AgentOptions options;
  options.transfers.workers = 1;
  // Shutdown waits this long for calls that do not end by themselves: if
  // the watch or the poll held on, it would take an hour.
  options.shutdown_grace = absl::Hours(1);
  StartAgent(std::move(options));
  Buffer source, destination;
  MakePair(4096, &source, &destination);
  const uint64_t blocker = StartBlocker();
  auto queued = SubmitAsync(Batch(
      {MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, destination, 0, 100, source, 0)}));
  ASSERT_TRUE(queued.ok());
  auto watch = OpenWatch();
  auto poll = StartLongPoll(blocker, absl::Seconds(50));
  ASSERT_TRUE(Eventually([&] {
    return transfers().watchers() == 1 && transfers().waiting_polls() == 1;
  }));
  std::thread stopper([&] { fixture_->agent().Shutdown(); });
  const bool stopped = Eventually(
      [&] {
        return transfers().in_flight() == 0 && transfers().watchers() == 0;
      },
      absl::Seconds(60));
  stopper.join();
  ASSERT_TRUE(stopped) << "shutdown waited for the transfers or the watch";
  // Both end UNAVAILABLE: the agent is going away, ask again elsewhere or
  // later (not OK, which would read as "nothing more will ever come").
  const grpc::Status ended = Close(*watch, /*cancel=*/false);
  EXPECT_EQ(ended.error_code(), grpc::StatusCode::UNAVAILABLE)
      << ended.error_code() << " " << ended.error_message();
  poll->thread.join();
  EXPECT_EQ(poll->status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << poll->status.error_code() << " " << poll->status.error_message();
}

}  // namespace
}  // namespace rdma_agent

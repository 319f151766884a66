// Prepared transfers through the RdmaAgent API of an in-process agent:
// PrepareTransfer, Submit and SubmitAsync naming a prepared_id, and
// ReleasePrepared. A prepared batch is judged once as Submit would judge
// it, then run again as often as asked, each run checking what may have
// changed since (local buffers released) and moving exactly its bytes;
// prepared transfers are bounded by count and bytes.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/agent_fixture.h"
#include "tests/testing/pattern.h"
#include "tests/testing/transfer_calls.h"

namespace rdma_agent::testing {
namespace {

using ::testing::HasSubstr;

constexpr v1::OpType kRead = v1::OP_TYPE_READ_INTO_LOCAL;
constexpr v1::OpType kWrite = v1::OP_TYPE_WRITE_FROM_LOCAL;
constexpr uint64_t kSize = 4096;

class PreparedTransfersTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(AgentOptions{}); }

  void Start(AgentOptions options) {
    agent_.reset();
    auto agent = InProcessAgent::Start(std::move(options));
    ASSERT_TRUE(agent.ok()) << agent.status();
    agent_ = std::move(*agent);
  }

  v1::RdmaAgent::Stub& stub() { return agent_->stub(); }

  v1::RegisterResponse Allocate(v1::Access access = v1::ACCESS_READ_WRITE) {
    auto response = agent_->Allocate(kSize, access);
    EXPECT_TRUE(response.ok()) << response.status();
    return response.ok() ? *response : v1::RegisterResponse();
  }

  void Write(uint64_t id, const std::string& data) {
    grpc::ClientContext call;
    v1::WriteBufferRequest request;
    request.set_buffer_id(id);
    request.set_data(data);
    v1::WriteBufferResponse response;
    ASSERT_TRUE(stub().WriteBuffer(&call, request, &response).ok());
  }

  std::string Read(uint64_t id) {
    grpc::ClientContext call;
    v1::ReadBufferRequest request;
    request.set_buffer_id(id);
    request.set_length(kSize);
    v1::ReadBufferResponse response;
    EXPECT_TRUE(stub().ReadBuffer(&call, request, &response).ok());
    return response.data();
  }

  absl::StatusOr<uint64_t> Prepare(std::vector<v1::Op> ops,
                                   const std::string& notification = "") {
    grpc::ClientContext call;
    v1::PrepareTransferRequest request;
    for (v1::Op& op : ops) *request.add_ops() = std::move(op);
    request.set_notification(notification);
    v1::PrepareTransferResponse response;
    absl::Status status =
        FromGrpcStatus(stub().PrepareTransfer(&call, request, &response));
    if (!status.ok()) return status;
    return response.prepared_id();
  }

  absl::Status ReleasePrepared(uint64_t id) {
    grpc::ClientContext call;
    v1::ReleasePreparedRequest request;
    request.set_prepared_id(id);
    v1::ReleasePreparedResponse response;
    return FromGrpcStatus(stub().ReleasePrepared(&call, request, &response));
  }

  static v1::SubmitRequest Run(uint64_t prepared_id) {
    v1::SubmitRequest request = MakeBatch({}, absl::Seconds(10));
    request.set_prepared_id(prepared_id);
    return request;
  }

  std::unique_ptr<InProcessAgent> agent_;
};

TEST_F(PreparedTransfersTest, APreparedTransferRunsAgainAndAgain) {
  const v1::RegisterResponse local = Allocate();
  const v1::RegisterResponse remote = Allocate();
  auto id = Prepare({MakeWireOp(kRead, local.buffer_id(), 16, 1000,
                                remote.remote_context(), 500),
                     MakeWireOp(kWrite, local.buffer_id(), 3000, 100,
                                remote.remote_context(), 3500)});
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_NE(*id, 0u);
  // Each run reads what the buffers hold then: the bytes are not copied
  // when it is prepared.
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    const std::string local_data = PatternString(10 + round, 0, kSize);
    const std::string remote_data = PatternString(20 + round, 0, kSize);
    Write(local.buffer_id(), local_data);
    Write(remote.buffer_id(), remote_data);
    auto results = SubmitSync(stub(), Run(*id));
    ASSERT_TRUE(results.ok()) << results.status();
    ASSERT_EQ(results->size(), 2u);
    for (const v1::OpResult& result : *results) {
      EXPECT_EQ(result.code(), 0) << result.message();
      EXPECT_EQ(result.backend(), "memory");
    }
    std::string local_expected = local_data;
    local_expected.replace(16, 1000, remote_data.substr(500, 1000));
    std::string remote_expected = remote_data;
    remote_expected.replace(3500, 100, local_data.substr(3000, 100));
    EXPECT_EQ(Read(local.buffer_id()), local_expected);
    EXPECT_EQ(Read(remote.buffer_id()), remote_expected);
  }
  EXPECT_EQ(agent_->agent().prepared_transfers().size(), 1u);
  ASSERT_TRUE(ReleasePrepared(*id).ok());
  EXPECT_EQ(agent_->agent().prepared_transfers().size(), 0u);
  EXPECT_EQ(agent_->agent().prepared_transfers().bytes(), 0u);
}

TEST_F(PreparedTransfersTest, APreparedTransferRunsAsynchronously) {
  const v1::RegisterResponse local = Allocate();
  const v1::RegisterResponse remote = Allocate();
  const std::string remote_data = PatternString(3, 0, kSize);
  Write(remote.buffer_id(), remote_data);
  auto id = Prepare({MakeWireOp(kRead, local.buffer_id(), 0, kSize,
                                remote.remote_context(), 0)});
  ASSERT_TRUE(id.ok()) << id.status();
  auto transfer_id = SubmitAsync(stub(), Run(*id));
  ASSERT_TRUE(transfer_id.ok()) << transfer_id.status();
  // Released while it may be queued: the transfer keeps what it runs.
  ASSERT_TRUE(ReleasePrepared(*id).ok());
  auto transfer = GetTransfer(stub(), *transfer_id, absl::Seconds(10));
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  EXPECT_EQ(transfer->state(), v1::TRANSFER_STATE_DONE)
      << DescribeFailures(*transfer);
  EXPECT_EQ(transfer->results_size(), 1);
  EXPECT_EQ(Read(local.buffer_id()), remote_data);
}

TEST_F(PreparedTransfersTest, HandlesAreResolvedWhenPrepared) {
  const v1::RegisterResponse local = Allocate();
  const v1::RegisterResponse remote = Allocate();
  const std::string remote_data = PatternString(4, 0, kSize);
  Write(remote.buffer_id(), remote_data);
  grpc::ClientContext call;
  v1::ImportRemoteRequest import;
  import.set_remote_context(remote.remote_context());
  v1::ImportRemoteResponse imported;
  ASSERT_TRUE(stub().ImportRemote(&call, import, &imported).ok());
  v1::Op op = MakeWireOp(kRead, local.buffer_id(), 0, 64, "", 64);
  op.set_remote_handle(imported.remote_handle());
  auto id = Prepare({op});
  ASSERT_TRUE(id.ok()) << id.status();
  grpc::ClientContext release_call;
  v1::ReleaseRemoteRequest release;
  release.set_remote_handle(imported.remote_handle());
  v1::ReleaseRemoteResponse released;
  ASSERT_TRUE(stub().ReleaseRemote(&release_call, release, &released).ok());
  auto results = SubmitSync(stub(), Run(*id));
  ASSERT_TRUE(results.ok()) << results.status();
  ASSERT_EQ(results->size(), 1u);
  EXPECT_EQ((*results)[0].code(), 0) << (*results)[0].message();
  std::string expected(kSize, '\0');
  expected.replace(0, 64, remote_data.substr(64, 64));
  EXPECT_EQ(Read(local.buffer_id()), expected);
}

TEST_F(PreparedTransfersTest, EachRunChecksItsLocalBuffersAgain) {
  const v1::RegisterResponse kept = Allocate();
  const v1::RegisterResponse released = Allocate();
  const v1::RegisterResponse remote = Allocate();
  const std::string remote_data = PatternString(5, 0, kSize);
  Write(remote.buffer_id(), remote_data);
  auto id = Prepare(
      {MakeWireOp(kRead, released.buffer_id(), 0, 8, remote.remote_context(),
                  0),
       MakeWireOp(kRead, kept.buffer_id(), 8, 8, remote.remote_context(), 8)});
  ASSERT_TRUE(id.ok()) << id.status();
  grpc::ClientContext call;
  v1::ReleaseRequest release;
  release.set_buffer_id(released.buffer_id());
  v1::ReleaseResponse response;
  ASSERT_TRUE(stub().Release(&call, release, &response).ok());
  auto results = SubmitSync(stub(), Run(*id));
  ASSERT_TRUE(results.ok()) << results.status();
  ASSERT_EQ(results->size(), 2u);
  EXPECT_EQ((*results)[0].code(), static_cast<int>(absl::StatusCode::kNotFound))
      << (*results)[0].message();
  EXPECT_THAT((*results)[0].message(), HasSubstr("op 0: local buffer"));
  EXPECT_EQ((*results)[1].code(), 0) << (*results)[1].message();
  std::string expected(kSize, '\0');
  expected.replace(8, 8, remote_data.substr(8, 8));
  EXPECT_EQ(Read(kept.buffer_id()), expected);
}

TEST_F(PreparedTransfersTest, ABadOpFailsThePreparationNamingIt) {
  const v1::RegisterResponse local = Allocate();
  const v1::RegisterResponse remote = Allocate();
  const v1::RegisterResponse read_only = Allocate(v1::ACCESS_READ);
  const std::string& ctx = remote.remote_context();
  const uint64_t id = local.buffer_id();
  struct Case {
    v1::Op bad;
    absl::StatusCode code;
    std::string fragment;
  };
  v1::Op unknown_handle = MakeWireOp(kRead, id, 0, 8, "", 0);
  unknown_handle.set_remote_handle(777);
  const std::vector<Case> cases = {
      {MakeWireOp(kRead, id, 0, 8, "garbage", 0),
       absl::StatusCode::kInvalidArgument, "remote_context"},
      {MakeWireOp(kRead, id, 0, 8, std::string(17 << 10, 'x'), 0),
       absl::StatusCode::kInvalidArgument, "--max_remote_context_bytes"},
      {unknown_handle, absl::StatusCode::kNotFound, "remote handle 777"},
      {MakeWireOp(kRead, id, 0, 8, ctx, kSize), absl::StatusCode::kOutOfRange,
       "remote"},
      {MakeWireOp(kWrite, id, 0, 8, read_only.remote_context(), 0),
       absl::StatusCode::kPermissionDenied, "WRITE"},
      {MakeWireOp(kRead, 4242, 0, 8, ctx, 0), absl::StatusCode::kNotFound,
       "local buffer 4242"},
      {MakeWireOp(v1::OP_TYPE_UNSPECIFIED, id, 0, 8, ctx, 0),
       absl::StatusCode::kInvalidArgument, "type"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("case ", i));
    // The bad op second: its index is named.
    auto prepared =
        Prepare({MakeWireOp(kRead, id, 0, 8, ctx, 0), cases[i].bad});
    EXPECT_EQ(prepared.status().code(), cases[i].code) << prepared.status();
    EXPECT_THAT(prepared.status().message(),
                HasSubstr("PrepareTransfer: op 1: "));
    EXPECT_THAT(prepared.status().message(), HasSubstr(cases[i].fragment));
  }
  auto empty = Prepare({});
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(empty.status().message(), HasSubstr("PrepareTransfer: "));
  auto long_notification =
      Prepare({MakeWireOp(kRead, id, 0, 8, ctx, 0)}, std::string(5000, 'n'));
  EXPECT_EQ(long_notification.status().code(),
            absl::StatusCode::kInvalidArgument);
  // Nothing refused is kept.
  EXPECT_EQ(agent_->agent().prepared_transfers().size(), 0u);
  EXPECT_EQ(agent_->agent().prepared_transfers().bytes(), 0u);
}

TEST_F(PreparedTransfersTest, BadRunsAreRefused) {
  const v1::RegisterResponse local = Allocate();
  const v1::RegisterResponse remote = Allocate();
  const v1::Op op =
      MakeWireOp(kRead, local.buffer_id(), 0, 8, remote.remote_context(), 0);
  auto id = Prepare({op});
  ASSERT_TRUE(id.ok()) << id.status();

  v1::SubmitRequest with_ops = Run(*id);
  *with_ops.add_ops() = op;
  v1::SubmitRequest with_notification = Run(*id);
  with_notification.set_notification("hello");
  v1::SubmitRequest released = Run(*id);
  for (const auto& [request, code, fragment] : std::vector<
           std::tuple<v1::SubmitRequest, absl::StatusCode, std::string>>{
           {with_ops, absl::StatusCode::kInvalidArgument, "must be empty"},
           {with_notification, absl::StatusCode::kInvalidArgument,
            "must be empty"},
           {Run(123456), absl::StatusCode::kNotFound,
            "prepared transfer 123456 is not prepared"},
       }) {
    SCOPED_TRACE(fragment);
    auto sync = SubmitSync(stub(), request);
    EXPECT_EQ(sync.status().code(), code) << sync.status();
    EXPECT_THAT(sync.status().message(), HasSubstr("Submit: "));
    EXPECT_THAT(sync.status().message(), HasSubstr(fragment));
    auto async = SubmitAsync(stub(), request);
    EXPECT_EQ(async.status().code(), code) << async.status();
    EXPECT_THAT(async.status().message(), HasSubstr("SubmitAsync: "));
  }
  ASSERT_TRUE(ReleasePrepared(*id).ok());
  auto after = SubmitSync(stub(), released);
  EXPECT_EQ(after.status().code(), absl::StatusCode::kNotFound);
  absl::Status again = ReleasePrepared(*id);
  EXPECT_EQ(again.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(again.message(), HasSubstr("ReleasePrepared: "));
}

TEST_F(PreparedTransfersTest, PreparedTransfersAreBoundedByCount) {
  AgentOptions options;
  options.prepared_transfers.max_per_user = 2;
  Start(std::move(options));
  const v1::RegisterResponse local = Allocate();
  const v1::RegisterResponse remote = Allocate();
  const v1::Op op =
      MakeWireOp(kRead, local.buffer_id(), 0, 8, remote.remote_context(), 0);
  auto first = Prepare({op});
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(Prepare({op}).ok());
  auto refused = Prepare({op});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("--max_prepared_transfers_per_user"));
  ASSERT_TRUE(ReleasePrepared(*first).ok());
  EXPECT_TRUE(Prepare({op}).ok());
}

TEST_F(PreparedTransfersTest, PreparedTransfersAreBoundedByBytes) {
  AgentOptions options;
  options.prepared_transfers.max_bytes_per_user = 64 << 10;
  Start(std::move(options));
  const v1::RegisterResponse local = Allocate();
  const v1::RegisterResponse remote = Allocate();
  std::vector<v1::Op> ops;
  for (int i = 0; i < 64; ++i) {
    ops.push_back(
        MakeWireOp(kRead, local.buffer_id(), i, 1, remote.remote_context(), i));
  }
  auto small = Prepare(ops);
  ASSERT_TRUE(small.ok()) << small.status();
  const uint64_t charged = agent_->agent().prepared_transfers().bytes();
  // At least the ops' contexts and one parsed context.
  EXPECT_GE(charged, 64 * remote.remote_context().size());
  // 1024 ops carrying a context of ~100 bytes each do not fit in 64 KiB.
  std::vector<v1::Op> many;
  for (int i = 0; i < 1024; ++i) {
    many.push_back(
        MakeWireOp(kRead, local.buffer_id(), i, 1, remote.remote_context(), i));
  }
  auto refused = Prepare(many);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("--max_prepared_transfer_bytes_per_user"));
  EXPECT_EQ(agent_->agent().prepared_transfers().bytes(), charged);
  ASSERT_TRUE(ReleasePrepared(*small).ok());
  EXPECT_EQ(agent_->agent().prepared_transfers().bytes(), 0u);
}

}  // namespace
}  // namespace rdma_agent::testing

// The RdmaAgent API of one agent with the memory backend: every bad input
// gets the contract's status code, and good ops move exactly the bytes asked.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <limits>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "backends/memory/memory_backend.h"
#include "common/fd_message.h"
#include "common/unique_fd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "rdma/agent/v1/attach.pb.h"
#include "rdma/agent/v1/remote_buffer.pb.h"
#include "tests/testing/agent_fixture.h"
#include "tests/testing/pattern.h"

namespace rdma_agent {
namespace {

using ::rdma_agent::FromGrpcStatus;
using ::rdma_agent::testing::InProcessAgent;
using ::testing::HasSubstr;

constexpr uint64_t kMax64 = std::numeric_limits<uint64_t>::max();

class AgentApiTest : public ::testing::Test {
 protected:
  void SetUp() override { StartAgent(AgentOptions{}); }

  void StartAgent(AgentOptions options) {
    fixture_.reset();
    auto fixture = InProcessAgent::Start(std::move(options));
    ASSERT_TRUE(fixture.ok()) << fixture.status();
    fixture_ = std::move(*fixture);
  }

  v1::RdmaAgent::Stub& stub() { return fixture_->stub(); }

  v1::RegisterResponse Allocate(uint64_t size,
                                v1::Access access = v1::ACCESS_READ_WRITE) {
    auto response = fixture_->Allocate(size, access);
    EXPECT_TRUE(response.ok()) << response.status();
    return response.ok() ? *response : v1::RegisterResponse();
  }

  absl::Status Write(uint64_t id, uint64_t offset, const std::string& data) {
    grpc::ClientContext context;
    v1::WriteBufferRequest request;
    request.set_buffer_id(id);
    request.set_offset(offset);
    request.set_data(data);
    v1::WriteBufferResponse response;
    return FromGrpcStatus(stub().WriteBuffer(&context, request, &response));
  }

  absl::StatusOr<std::string> Read(uint64_t id, uint64_t offset,
                                   uint64_t length) {
    grpc::ClientContext context;
    v1::ReadBufferRequest request;
    request.set_buffer_id(id);
    request.set_offset(offset);
    request.set_length(length);
    v1::ReadBufferResponse response;
    absl::Status status =
        FromGrpcStatus(stub().ReadBuffer(&context, request, &response));
    if (!status.ok()) return status;
    return response.data();
  }

  absl::Status Release(uint64_t id) {
    grpc::ClientContext context;
    v1::ReleaseRequest request;
    request.set_buffer_id(id);
    v1::ReleaseResponse response;
    return FromGrpcStatus(stub().Release(&context, request, &response));
  }

  absl::Status RegisterStatus(const v1::RegisterRequest& request) {
    grpc::ClientContext context;
    v1::RegisterResponse response;
    return FromGrpcStatus(stub().Register(&context, request, &response));
  }

  static v1::Op MakeOp(v1::OpType type, uint64_t local_id,
                       uint64_t local_offset, uint64_t length,
                       const std::string& remote_context,
                       uint64_t remote_offset) {
    v1::Op op;
    op.set_type(type);
    op.set_local_buffer_id(local_id);
    op.set_local_offset(local_offset);
    op.set_length(length);
    op.set_remote_context(remote_context);
    op.set_remote_offset(remote_offset);
    return op;
  }

  // Submits `ops`; the RPC must succeed. Returns the per-op results.
  std::vector<v1::OpResult> Submit(const std::vector<v1::Op>& ops,
                                   absl::Duration timeout = absl::Seconds(10)) {
    auto response = SubmitRaw(ops, timeout);
    EXPECT_TRUE(response.ok()) << response.status();
    if (!response.ok()) return {};
    EXPECT_EQ(response->results_size(), static_cast<int>(ops.size()));
    return {response->results().begin(), response->results().end()};
  }

  absl::StatusOr<v1::SubmitResponse> SubmitRaw(const std::vector<v1::Op>& ops,
                                               absl::Duration timeout) {
    grpc::ClientContext context;
    v1::SubmitRequest request;
    for (const auto& op : ops) *request.add_ops() = op;
    request.mutable_timeout()->set_seconds(absl::ToInt64Seconds(timeout));
    request.mutable_timeout()->set_nanos(static_cast<int32_t>(
        absl::ToInt64Nanoseconds(timeout % absl::Seconds(1))));
    v1::SubmitResponse response;
    absl::Status status =
        FromGrpcStatus(stub().Submit(&context, request, &response));
    if (!status.ok()) return status;
    return response;
  }

  // Fills buffer `id` of `size` bytes with a pattern derived from `seed`.
  std::string Fill(uint64_t id, uint64_t size, int seed) {
    std::string data = ::rdma_agent::testing::PatternString(seed, 0, size);
    EXPECT_TRUE(Write(id, 0, data).ok());
    return data;
  }

  std::unique_ptr<InProcessAgent> fixture_;
};

// Expects one result with `code` whose message names op `index`.
void ExpectOpFailed(const v1::OpResult& result, absl::StatusCode code,
                    size_t index, absl::string_view fragment = "") {
  EXPECT_EQ(result.code(), static_cast<int>(code)) << result.message();
  EXPECT_THAT(result.message(), HasSubstr(absl::StrCat("op ", index, ":")));
  if (!fragment.empty()) {
    EXPECT_THAT(result.message(), HasSubstr(fragment));
  }
}

TEST_F(AgentApiTest, GetInfoDescribesAgentAndBackends) {
  grpc::ClientContext context;
  v1::AgentInfo info;
  ASSERT_TRUE(stub().GetInfo(&context, v1::GetInfoRequest(), &info).ok());
  EXPECT_EQ(info.agent_id(), fixture_->agent().identity().agent_id);
  EXPECT_EQ(info.epoch(), fixture_->agent().identity().epoch);
  EXPECT_NE(info.epoch(), 0u);
  EXPECT_FALSE(info.version().empty());
  ASSERT_EQ(info.backends_size(), 1);
  EXPECT_EQ(info.backends(0).name(), "memory");
  EXPECT_TRUE(info.backends(0).available());
  EXPECT_EQ(info.backends(0).transport_level(), v1::TRANSPORT_LEVEL_MEMORY);
}

TEST_F(AgentApiTest, RegisterReturnsContextDescribingTheBuffer) {
  const v1::RegisterResponse response = Allocate(4096, v1::ACCESS_READ);
  EXPECT_EQ(response.size_bytes(), 4096u);
  EXPECT_THAT(response.backends(), ::testing::ElementsAre("memory"));
  v1::RemoteBuffer context;
  ASSERT_TRUE(context.ParseFromString(response.remote_context()));
  EXPECT_EQ(context.agent_id(), fixture_->agent().identity().agent_id);
  EXPECT_EQ(context.agent_epoch(), fixture_->agent().identity().epoch);
  EXPECT_EQ(context.buffer_id(), response.buffer_id());
  EXPECT_EQ(context.size_bytes(), 4096u);
  EXPECT_EQ(context.access(), v1::ACCESS_READ);
  EXPECT_EQ(context.token().size(), 16u);
  ASSERT_EQ(context.endpoints_size(), 1);
  EXPECT_EQ(context.endpoints(0).backend(), "memory");
  // Fresh registrations read as zeros.
  auto data = Read(response.buffer_id(), 0, 4096);
  ASSERT_TRUE(data.ok());
  EXPECT_EQ(*data, std::string(4096, '\0'));
}

TEST_F(AgentApiTest, RegisterRejectsBadRequests) {
  v1::RegisterRequest request;
  request.set_access(v1::ACCESS_READ);
  EXPECT_EQ(RegisterStatus(request).code(), absl::StatusCode::kInvalidArgument)
      << "no memory source";
  request.set_allocate_bytes(0);
  EXPECT_EQ(RegisterStatus(request).code(), absl::StatusCode::kInvalidArgument);
  request.set_allocate_bytes(kMax64);
  absl::Status huge = RegisterStatus(request);
  EXPECT_EQ(huge.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(huge.message(), HasSubstr("Register"));
  request.set_allocate_bytes(16);
  request.set_access(v1::ACCESS_UNSPECIFIED);
  EXPECT_EQ(RegisterStatus(request).code(), absl::StatusCode::kInvalidArgument);
  request.set_access(static_cast<v1::Access>(42));
  EXPECT_EQ(RegisterStatus(request).code(), absl::StatusCode::kInvalidArgument);
  request.set_access(v1::ACCESS_READ);
  request.set_label(std::string(1000, 'x'));
  EXPECT_EQ(RegisterStatus(request).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(AgentApiTest, ReleaseUnknownAndTwiceIsNotFound) {
  EXPECT_EQ(Release(987654).code(), absl::StatusCode::kNotFound);
  const uint64_t id = Allocate(64).buffer_id();
  EXPECT_TRUE(Release(id).ok());
  absl::Status again = Release(id);
  EXPECT_EQ(again.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(again.message(), HasSubstr("Release"));
  EXPECT_EQ(Read(id, 0, 1).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(AgentApiTest, ReadAndWriteBufferCheckBounds) {
  const uint64_t id = Allocate(100).buffer_id();
  EXPECT_TRUE(Write(id, 90, std::string(10, 'a')).ok());
  EXPECT_EQ(Write(id, 91, std::string(10, 'a')).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(Write(id, kMax64, "a").code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(Write(id, 0, "").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Write(id + 1000, 0, "a").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Read(id, 0, 101).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(Read(id, kMax64, 2).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(Read(id, 2, kMax64).status().code(),
            absl::StatusCode::kInvalidArgument)
      << "longer than one call may carry";
  EXPECT_EQ(Read(id, 0, 0).status().code(), absl::StatusCode::kInvalidArgument);
  auto data = Read(id, 89, 11);
  ASSERT_TRUE(data.ok());
  EXPECT_EQ(*data, std::string(1, '\0') + std::string(10, 'a'));
}

TEST_F(AgentApiTest, SubmitMovesExactlyTheRangeBothWays) {
  constexpr uint64_t kSize = (3 << 20) + 77;
  const v1::RegisterResponse a = Allocate(kSize);
  const v1::RegisterResponse b = Allocate(kSize);
  const std::string a_data = Fill(a.buffer_id(), kSize, 1);
  const std::string b_data = Fill(b.buffer_id(), kSize, 2);

  // a[13, 13+L) <- b[1001, 1001+L), then a[5, 5+999) -> b[7, 7+999).
  constexpr uint64_t kLength = (2 << 20) + 3;
  auto results = Submit({MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, a.buffer_id(), 13,
                                kLength, b.remote_context(), 1001),
                         MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL, a.buffer_id(),
                                kSize - 999, 999, b.remote_context(), 7)});
  ASSERT_EQ(results.size(), 2u);
  for (const auto& result : results) {
    EXPECT_EQ(result.code(), 0) << result.message();
    EXPECT_EQ(result.backend(), "memory");
  }
  std::string a_expected = a_data;
  a_expected.replace(13, kLength, b_data.substr(1001, kLength));
  std::string b_expected = b_data;
  b_expected.replace(7, 999, a_expected.substr(kSize - 999, 999));
  auto a_now = Read(a.buffer_id(), 0, kSize);
  auto b_now = Read(b.buffer_id(), 0, kSize);
  ASSERT_TRUE(a_now.ok() && b_now.ok());
  EXPECT_TRUE(*a_now == a_expected) << "bytes of a differ";
  EXPECT_TRUE(*b_now == b_expected) << "bytes of b differ";

  grpc::ClientContext context;
  v1::ListBuffersResponse list;
  ASSERT_TRUE(
      stub().ListBuffers(&context, v1::ListBuffersRequest(), &list).ok());
  ASSERT_EQ(list.buffers_size(), 2);
  EXPECT_EQ(list.buffers(0).buffer_id(), a.buffer_id());
  EXPECT_EQ(list.buffers(0).bytes_moved(), kLength + 999);
  EXPECT_EQ(list.buffers(1).bytes_served(), kLength + 999);
}

TEST_F(AgentApiTest, SubmitWithinOneBufferHandlesOverlap) {
  const v1::RegisterResponse a = Allocate(1000);
  const std::string data = Fill(a.buffer_id(), 1000, 3);
  auto results = Submit({MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, a.buffer_id(), 10,
                                500, a.remote_context(), 0)});
  ASSERT_EQ(results.size(), 1u);
  EXPECT_EQ(results[0].code(), 0) << results[0].message();
  std::string expected = data;
  expected.replace(10, 500, data.substr(0, 500));
  EXPECT_EQ(*Read(a.buffer_id(), 0, 1000), expected);
}

TEST_F(AgentApiTest, SubmitRejectsBadBatches) {
  const v1::RegisterResponse a = Allocate(64);
  EXPECT_EQ(SubmitRaw({}, absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  const v1::Op good = MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, a.buffer_id(), 0, 8,
                             a.remote_context(), 8);
  EXPECT_EQ(SubmitRaw({good}, absl::ZeroDuration()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SubmitRaw({good}, -absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);

  AgentOptions small;
  small.api.max_ops_per_submit = 4;
  StartAgent(std::move(small));
  const v1::RegisterResponse b = Allocate(64);
  const v1::Op op = MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, b.buffer_id(), 0, 8,
                           b.remote_context(), 8);
  EXPECT_TRUE(SubmitRaw(std::vector<v1::Op>(4, op), absl::Seconds(5)).ok());
  absl::Status huge =
      SubmitRaw(std::vector<v1::Op>(5, op), absl::Seconds(5)).status();
  EXPECT_EQ(huge.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(huge.message(), HasSubstr("5 ops"));
}

TEST_F(AgentApiTest, BadOpsFailAloneAndTouchNothing) {
  constexpr uint64_t kSize = 4096;
  const v1::RegisterResponse local = Allocate(kSize);
  const v1::RegisterResponse remote = Allocate(kSize);
  const v1::RegisterResponse read_only = Allocate(kSize, v1::ACCESS_READ);
  const v1::RegisterResponse write_only = Allocate(kSize, v1::ACCESS_WRITE);
  const std::string local_data = Fill(local.buffer_id(), kSize, 4);
  const std::string remote_data = Fill(remote.buffer_id(), kSize, 5);
  const std::string read_only_data = Fill(read_only.buffer_id(), kSize, 6);
  const std::string write_only_data = Fill(write_only.buffer_id(), kSize, 7);

  v1::RemoteBuffer forged;
  ASSERT_TRUE(forged.ParseFromString(remote.remote_context()));
  forged.set_token(std::string(16, 'x'));
  v1::RemoteBuffer stale;
  ASSERT_TRUE(stale.ParseFromString(remote.remote_context()));
  stale.set_agent_epoch(stale.agent_epoch() + 1);
  v1::RemoteBuffer foreign;
  ASSERT_TRUE(foreign.ParseFromString(remote.remote_context()));
  foreign.set_agent_id("agent-on-another-host");
  v1::RemoteBuffer lying_size;  // claims more than the buffer has
  ASSERT_TRUE(lying_size.ParseFromString(remote.remote_context()));
  lying_size.set_size_bytes(kSize * 2);
  v1::RemoteBuffer lying_access;  // claims WRITE on a READ buffer
  ASSERT_TRUE(lying_access.ParseFromString(read_only.remote_context()));
  lying_access.set_access(v1::ACCESS_READ_WRITE);
  const std::string& ctx = remote.remote_context();
  const auto R = v1::OP_TYPE_READ_INTO_LOCAL;
  const auto W = v1::OP_TYPE_WRITE_FROM_LOCAL;
  const uint64_t id = local.buffer_id();

  struct Case {
    v1::Op op;
    absl::StatusCode code;
    std::string fragment;
  };
  const std::vector<Case> cases = {
      {MakeOp(R, id, 0, 0, ctx, 0), absl::StatusCode::kInvalidArgument,
       "length"},
      {MakeOp(v1::OP_TYPE_UNSPECIFIED, id, 0, 8, ctx, 0),
       absl::StatusCode::kInvalidArgument, "type"},
      {MakeOp(R, id + 100, 0, 8, ctx, 0), absl::StatusCode::kNotFound,
       "local buffer"},
      {MakeOp(R, id, kMax64, 8, ctx, 0), absl::StatusCode::kOutOfRange,
       "local"},
      {MakeOp(R, id, 8, kMax64, ctx, 0), absl::StatusCode::kOutOfRange,
       "local"},
      {MakeOp(R, id, 0, 8, ctx, kMax64), absl::StatusCode::kOutOfRange,
       "remote"},
      {MakeOp(W, id, 0, 8, ctx, kSize - 7), absl::StatusCode::kOutOfRange,
       "remote"},
      {MakeOp(R, id, kSize - 7, 8, ctx, 0), absl::StatusCode::kOutOfRange,
       "local"},
      {MakeOp(R, id, 0, 8, "not a context at all", 0),
       absl::StatusCode::kInvalidArgument, "remote_context"},
      {MakeOp(R, id, 0, 8, ctx.substr(0, ctx.size() / 2), 0),
       absl::StatusCode::kInvalidArgument, "remote_context"},
      {MakeOp(R, id, 0, 8, "", 0), absl::StatusCode::kInvalidArgument,
       "remote_context"},
      {MakeOp(R, id, 0, 8, forged.SerializeAsString(), 0),
       absl::StatusCode::kNotFound, "not registered here"},
      {MakeOp(W, id, 0, 8, read_only.remote_context(), 0),
       absl::StatusCode::kPermissionDenied, "WRITE"},
      {MakeOp(W, id, 0, 8, lying_access.SerializeAsString(), 0),
       absl::StatusCode::kPermissionDenied, "remote writes"},
      {MakeOp(R, id, 0, 8, write_only.remote_context(), 0),
       absl::StatusCode::kPermissionDenied, "READ"},
      {MakeOp(R, read_only.buffer_id(), 0, 8, ctx, 0),
       absl::StatusCode::kPermissionDenied, "local buffer"},
      {MakeOp(W, write_only.buffer_id(), 0, 8, ctx, 0),
       absl::StatusCode::kPermissionDenied, "local buffer"},
      {MakeOp(R, id, 0, 8, stale.SerializeAsString(), 0),
       absl::StatusCode::kFailedPrecondition, "stale"},
      {MakeOp(W, id, 0, 8, lying_size.SerializeAsString(), kSize),
       absl::StatusCode::kOutOfRange, "remote"},
      {MakeOp(R, id, 0, 8, foreign.SerializeAsString(), 0),
       absl::StatusCode::kUnavailable, "no backend"},
  };
  std::vector<v1::Op> ops;
  for (const auto& c : cases) ops.push_back(c.op);
  // A good op in the middle of the bad ones still runs.
  ops.push_back(MakeOp(R, id, 100, 50, ctx, 200));
  auto results = Submit(ops);
  ASSERT_EQ(results.size(), cases.size() + 1);
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("case ", i));
    ExpectOpFailed(results[i], cases[i].code, i, cases[i].fragment);
  }
  EXPECT_EQ(results.back().code(), 0) << results.back().message();

  std::string local_expected = local_data;
  local_expected.replace(100, 50, remote_data.substr(200, 50));
  EXPECT_EQ(*Read(local.buffer_id(), 0, kSize), local_expected);
  EXPECT_EQ(*Read(remote.buffer_id(), 0, kSize), remote_data);
  EXPECT_EQ(*Read(read_only.buffer_id(), 0, kSize), read_only_data);
  EXPECT_EQ(*Read(write_only.buffer_id(), 0, kSize), write_only_data);
}

// A batch as clients send them: 1000 ops carrying a few contexts. The agent
// works out what the ops share once per batch (a context's parse, a
// buffer's lookup), yet every op keeps its own verdict: a forged token that
// shares the good context's buffer id, ranges past either end and writes
// into a READ buffer fail alone (with the right op's index) and move no
// byte; every good op moves exactly its range; every OK result has no
// message.
TEST_F(AgentApiTest, ABatchOnFewContextsStillChecksEveryOp) {
  constexpr uint64_t kSize = 1 << 20;
  const v1::RegisterResponse local = Allocate(kSize);
  const v1::RegisterResponse remote = Allocate(kSize);
  const v1::RegisterResponse read_only = Allocate(kSize, v1::ACCESS_READ);
  std::string local_expected = Fill(local.buffer_id(), kSize, 8);
  std::string remote_expected = Fill(remote.buffer_id(), kSize, 9);
  const std::string read_only_data = Fill(read_only.buffer_id(), kSize, 10);
  v1::RemoteBuffer forged;
  ASSERT_TRUE(forged.ParseFromString(remote.remote_context()));
  forged.set_token(std::string(forged.token().size(), 'x'));
  const std::string forged_ctx = forged.SerializeAsString();
  const auto R = v1::OP_TYPE_READ_INTO_LOCAL;
  const auto W = v1::OP_TYPE_WRITE_FROM_LOCAL;
  const uint64_t id = local.buffer_id();

  std::vector<v1::Op> ops;
  std::vector<absl::StatusCode> codes;
  for (uint64_t i = 0; i < 1000; ++i) {
    const uint64_t at = i * 1024;
    switch (i % 10) {
      case 0:
        ops.push_back(MakeOp(i % 20 == 0 ? W : R, id, at, 64, forged_ctx, at));
        codes.push_back(absl::StatusCode::kNotFound);
        break;
      case 1:
        ops.push_back(
            MakeOp(W, id, at, 64, remote.remote_context(), kSize - 63));
        codes.push_back(absl::StatusCode::kOutOfRange);
        break;
      case 2:
        ops.push_back(
            MakeOp(R, id, kSize - 63, 64, remote.remote_context(), at));
        codes.push_back(absl::StatusCode::kOutOfRange);
        break;
      case 3:
        ops.push_back(MakeOp(W, id, at, 64, read_only.remote_context(), at));
        codes.push_back(absl::StatusCode::kPermissionDenied);
        break;
      case 4: {
        ops.push_back(MakeOp(R, id, at, 64, read_only.remote_context(), at));
        codes.push_back(absl::StatusCode::kOk);
        local_expected.replace(at, 64, read_only_data.substr(at, 64));
        break;
      }
      default: {
        const uint64_t length = 64 + i % 7;
        if (i % 2 == 0) {
          ops.push_back(
              MakeOp(W, id, at, length, remote.remote_context(), at + 9));
          remote_expected.replace(at + 9, length,
                                  local_expected.substr(at, length));
        } else {
          ops.push_back(
              MakeOp(R, id, at, length, remote.remote_context(), at + 9));
          local_expected.replace(at, length,
                                 remote_expected.substr(at + 9, length));
        }
        codes.push_back(absl::StatusCode::kOk);
      }
    }
  }
  auto results = Submit(ops);
  ASSERT_EQ(results.size(), ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("op ", i));
    if (codes[i] == absl::StatusCode::kOk) {
      EXPECT_EQ(results[i].code(), 0) << results[i].message();
      EXPECT_EQ(results[i].message(), "");
      EXPECT_EQ(results[i].backend(), "memory");
    } else {
      ExpectOpFailed(results[i], codes[i], i);
    }
  }
  EXPECT_TRUE(*Read(local.buffer_id(), 0, kSize) == local_expected)
      << "bytes of the local buffer differ";
  EXPECT_TRUE(*Read(remote.buffer_id(), 0, kSize) == remote_expected)
      << "bytes of the remote buffer differ";
  EXPECT_TRUE(*Read(read_only.buffer_id(), 0, kSize) == read_only_data)
      << "the READ buffer was written";
}

TEST_F(AgentApiTest, OpOnReleasedRemoteBufferIsNotFound) {
  const v1::RegisterResponse local = Allocate(64);
  const v1::RegisterResponse remote = Allocate(64);
  ASSERT_TRUE(Release(remote.buffer_id()).ok());
  auto results = Submit({MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, local.buffer_id(),
                                0, 8, remote.remote_context(), 0)});
  ASSERT_EQ(results.size(), 1u);
  ExpectOpFailed(results[0], absl::StatusCode::kNotFound, 0, "remote buffer");
}

TEST_F(AgentApiTest, ContextFromBeforeARestartIsFailedPrecondition) {
  // Same runtime dir, so the same agent id, but a new epoch.
  const v1::RegisterResponse old_remote = Allocate(64);
  const std::string agent_id = fixture_->agent().identity().agent_id;
  const uint64_t old_epoch = fixture_->agent().identity().epoch;
  ASSERT_TRUE(fixture_->Restart().ok());
  EXPECT_EQ(fixture_->agent().identity().agent_id, agent_id);
  EXPECT_NE(fixture_->agent().identity().epoch, old_epoch);
  const v1::RegisterResponse local = Allocate(64);
  auto results = Submit({MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, local.buffer_id(),
                                0, 8, old_remote.remote_context(), 0)});
  ASSERT_EQ(results.size(), 1u);
  ExpectOpFailed(results[0], absl::StatusCode::kFailedPrecondition, 0, "stale");
}

// --- the attach socket ---

class AttachSocketTest : public AgentApiTest {
 protected:
  UniqueFd Connect() {
    UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    struct sockaddr_un addr = {};
    addr.sun_family = AF_UNIX;
    const std::string& path = fixture_->agent().attach_socket_path();
    std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
    EXPECT_EQ(::connect(fd.get(), reinterpret_cast<struct sockaddr*>(&addr),
                        sizeof(addr)),
              0);
    return fd;
  }

  // Sends `request` with `fd` and returns the answer (and any fd).
  v1::AttachResponse Exchange(int sock, const v1::AttachRequest& request,
                              int fd = -1, UniqueFd* fd_out = nullptr) {
    EXPECT_TRUE(SendFdMessage(sock, request, fd).ok());
    v1::AttachResponse response;
    auto received = ReceiveFdMessage(sock, &response);
    EXPECT_TRUE(received.ok()) << received.status();
    if (received.ok() && fd_out != nullptr) *fd_out = std::move(*received);
    return response;
  }

  static UniqueFd Memfd(uint64_t size, unsigned int seals) {
    UniqueFd fd(::memfd_create("test", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    EXPECT_EQ(::ftruncate(fd.get(), static_cast<off_t>(size)), 0);
    if (seals != 0) {
      EXPECT_EQ(::fcntl(fd.get(), F_ADD_SEALS, seals), 0);
    }
    return fd;
  }

  static v1::AttachRequest AttachMemory() {
    v1::AttachRequest request;
    request.mutable_attach();
    return request;
  }

  absl::StatusOr<v1::RegisterResponse> RegisterToken(const std::string& token) {
    grpc::ClientContext context;
    v1::RegisterRequest request;
    request.set_attach_token(token);
    request.set_access(v1::ACCESS_READ_WRITE);
    v1::RegisterResponse response;
    absl::Status status =
        FromGrpcStatus(stub().Register(&context, request, &response));
    if (!status.ok()) return status;
    return response;
  }
};

TEST_F(AttachSocketTest, AttachedMemoryIsSharedWithoutCopies) {
  UniqueFd sock = Connect();
  UniqueFd memfd = Memfd(8192, F_SEAL_SHRINK);
  auto* mapping = static_cast<char*>(::mmap(
      nullptr, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, memfd.get(), 0));
  ASSERT_NE(mapping, MAP_FAILED);
  std::memset(mapping, 'c', 8192);
  const v1::AttachResponse attached =
      Exchange(sock.get(), AttachMemory(), memfd.get());
  ASSERT_EQ(attached.code(), 0) << attached.message();
  EXPECT_EQ(attached.size_bytes(), 8192u);
  auto registered = RegisterToken(attached.attach_token());
  ASSERT_TRUE(registered.ok()) << registered.status();
  EXPECT_EQ(registered->size_bytes(), 8192u);
  // The agent sees the client's bytes, and the client sees the agent's.
  EXPECT_EQ(*Read(registered->buffer_id(), 8000, 3), "ccc");
  ASSERT_TRUE(Write(registered->buffer_id(), 4, "agent").ok());
  EXPECT_EQ(std::string(mapping + 4, 5), "agent");

  // The client drops its mapping and fd; the agent keeps working.
  ::munmap(mapping, 8192);
  memfd.reset();
  sock.reset();
  EXPECT_EQ(*Read(registered->buffer_id(), 0, 9), "ccccagent");
}

TEST_F(AttachSocketTest, AttachTokensAreSingleUse) {
  UniqueFd sock = Connect();
  UniqueFd memfd = Memfd(4096, F_SEAL_SHRINK);
  const v1::AttachResponse attached =
      Exchange(sock.get(), AttachMemory(), memfd.get());
  ASSERT_EQ(attached.code(), 0);
  ASSERT_TRUE(RegisterToken(attached.attach_token()).ok());
  EXPECT_EQ(RegisterToken(attached.attach_token()).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(RegisterToken("0123456789abcdef0123456789abcdef").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(RegisterToken("").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(AttachSocketTest, AttachTokensExpire) {
  AgentOptions options;
  options.attach_token_ttl = absl::Milliseconds(100);
  StartAgent(std::move(options));
  UniqueFd sock = Connect();
  UniqueFd memfd = Memfd(4096, F_SEAL_SHRINK);
  const v1::AttachResponse attached =
      Exchange(sock.get(), AttachMemory(), memfd.get());
  ASSERT_EQ(attached.code(), 0);
  absl::SleepFor(absl::Milliseconds(300));
  absl::Status status = RegisterToken(attached.attach_token()).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(status.message(), HasSubstr("expired"));
}

TEST_F(AttachSocketTest, RefusesMemoryThatCouldShrinkOrIsNotAMemfd) {
  UniqueFd sock = Connect();
  UniqueFd unsealed = Memfd(4096, 0);
  v1::AttachResponse response =
      Exchange(sock.get(), AttachMemory(), unsealed.get());
  EXPECT_EQ(response.code(),
            static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(response.message(), HasSubstr("F_SEAL_SHRINK"));

  UniqueFd empty = Memfd(0, F_SEAL_SHRINK);
  response = Exchange(sock.get(), AttachMemory(), empty.get());
  EXPECT_EQ(response.code(),
            static_cast<int>(absl::StatusCode::kInvalidArgument));

  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  UniqueFd pipe_read(pipe_fds[0]), pipe_write(pipe_fds[1]);
  response = Exchange(sock.get(), AttachMemory(), pipe_read.get());
  EXPECT_EQ(response.code(),
            static_cast<int>(absl::StatusCode::kInvalidArgument));

  response = Exchange(sock.get(), AttachMemory());
  EXPECT_EQ(response.code(),
            static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(response.message(), HasSubstr("no file descriptor"));

  response = Exchange(sock.get(), v1::AttachRequest());
  EXPECT_EQ(response.code(),
            static_cast<int>(absl::StatusCode::kInvalidArgument));
}

TEST_F(AttachSocketTest, ClientCannotShrinkAttachedMemory) {
  UniqueFd sock = Connect();
  UniqueFd memfd = Memfd(1 << 20, F_SEAL_SHRINK);
  const v1::AttachResponse attached =
      Exchange(sock.get(), AttachMemory(), memfd.get());
  ASSERT_EQ(attached.code(), 0);
  auto registered = RegisterToken(attached.attach_token());
  ASSERT_TRUE(registered.ok());
  EXPECT_NE(::ftruncate(memfd.get(), 0), 0);
  EXPECT_EQ(errno, EPERM);
  // The agent can still touch its last page.
  EXPECT_TRUE(Write(registered->buffer_id(), (1 << 20) - 1, "z").ok());
  EXPECT_EQ(*Read(registered->buffer_id(), (1 << 20) - 1, 1), "z");
}

TEST_F(AttachSocketTest, OpenBufferHandsBackTheSameMemory) {
  const v1::RegisterResponse allocated = Allocate(4096);
  ASSERT_TRUE(Write(allocated.buffer_id(), 100, "shared").ok());
  UniqueFd sock = Connect();
  v1::AttachRequest open;
  open.mutable_open()->set_buffer_id(allocated.buffer_id());
  UniqueFd fd;
  const v1::AttachResponse response = Exchange(sock.get(), open, -1, &fd);
  ASSERT_EQ(response.code(), 0) << response.message();
  ASSERT_TRUE(fd.valid());
  EXPECT_EQ(response.size_bytes(), 4096u);
  auto* mapping = static_cast<char*>(
      ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0));
  ASSERT_NE(mapping, MAP_FAILED);
  EXPECT_EQ(std::string(mapping + 100, 6), "shared");
  std::memcpy(mapping, "client", 6);
  EXPECT_EQ(*Read(allocated.buffer_id(), 0, 6), "client");
  // Sealed: the client cannot shrink agent memory either.
  EXPECT_NE(::ftruncate(fd.get(), 0), 0);
  ::munmap(mapping, 4096);

  open.mutable_open()->set_buffer_id(allocated.buffer_id() + 50);
  const v1::AttachResponse missing = Exchange(sock.get(), open);
  EXPECT_EQ(missing.code(), static_cast<int>(absl::StatusCode::kNotFound));
}

TEST_F(AttachSocketTest, MalformedFramesGetAnErrorAndCloseTheConnection) {
  UniqueFd sock = Connect();
  const char frame[] = {'\x05', '\0',   '\0',   '\0',  '\xff',
                        '\xff', '\xff', '\xff', '\xff'};
  ASSERT_EQ(::send(sock.get(), frame, sizeof(frame), 0),
            static_cast<ssize_t>(sizeof(frame)));
  v1::AttachResponse response;
  auto received = ReceiveFdMessage(sock.get(), &response);
  ASSERT_TRUE(received.ok()) << received.status();
  EXPECT_EQ(response.code(),
            static_cast<int>(absl::StatusCode::kInvalidArgument));
  // The agent is still fine.
  EXPECT_TRUE(fixture_->Allocate(16).ok());
}

}  // namespace
}  // namespace rdma_agent

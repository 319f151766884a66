// Mutated remote contexts and op fields through a real agent's Submit: every
// op answers with a contract code (never INTERNAL/UNKNOWN), the agent keeps
// serving, and a READ-only buffer the ops name is never changed.
#include <map>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/fuzz/fuzz_driver.h"
#include "tests/testing/agent_fixture.h"

namespace rdma_agent {
namespace {

using ::rdma_agent::FromGrpcStatus;
using ::rdma_agent::testing::InProcessAgent;
using ::rdma_agent::testing::Mutator;

constexpr uint64_t kSize = 8192;
constexpr int kIterations = 3000;
constexpr int kOpsPerSubmit = 50;

bool IsContractCode(int code) {
  static const std::set<int> kAllowed = {
      0,  // a mutation can leave a context valid
      static_cast<int>(absl::StatusCode::kInvalidArgument),
      static_cast<int>(absl::StatusCode::kNotFound),
      static_cast<int>(absl::StatusCode::kOutOfRange),
      static_cast<int>(absl::StatusCode::kPermissionDenied),
      static_cast<int>(absl::StatusCode::kFailedPrecondition),
      static_cast<int>(absl::StatusCode::kUnavailable),
      static_cast<int>(absl::StatusCode::kDeadlineExceeded)};
  return kAllowed.count(code) > 0;
}

std::string ReadAll(InProcessAgent& agent, uint64_t id) {
  grpc::ClientContext context;
  v1::ReadBufferRequest request;
  request.set_buffer_id(id);
  request.set_length(kSize);
  v1::ReadBufferResponse response;
  EXPECT_TRUE(agent.stub().ReadBuffer(&context, request, &response).ok());
  return response.data();
}

TEST(RemoteContextFuzzTest, MutatedContextsGetContractCodes) {
  // Memory backend only: a mutated tcp endpoint could name any address.
  auto fixture = InProcessAgent::Start();
  ASSERT_TRUE(fixture.ok()) << fixture.status();
  InProcessAgent& agent = **fixture;
  auto scratch = agent.Allocate(kSize, v1::ACCESS_READ_WRITE);
  auto sentinel = agent.Allocate(kSize, v1::ACCESS_READ);
  ASSERT_TRUE(scratch.ok() && sentinel.ok());
  {
    grpc::ClientContext context;
    v1::WriteBufferRequest request;
    request.set_buffer_id(sentinel->buffer_id());
    std::string pattern(kSize, '\0');
    for (uint64_t i = 0; i < kSize; ++i) pattern[i] = static_cast<char>(i * 7);
    request.set_data(pattern);
    v1::WriteBufferResponse response;
    ASSERT_TRUE(agent.stub().WriteBuffer(&context, request, &response).ok());
  }
  const std::string sentinel_before = ReadAll(agent, sentinel->buffer_id());

  Mutator mutator(20261202);
  std::map<int, int> seen;
  for (int i = 0; i < kIterations; i += kOpsPerSubmit) {
    grpc::ClientContext context;
    v1::SubmitRequest request;
    request.mutable_timeout()->set_seconds(5);
    for (int k = 0; k < kOpsPerSubmit; ++k) {
      v1::Op* op = request.add_ops();
      // Mostly plausible fields so mutations reach the deeper checks.
      op->set_type(mutator.Next() % 8 == 0
                       ? static_cast<v1::OpType>(mutator.Next() % 4)
                       : (mutator.Next() % 2 ? v1::OP_TYPE_READ_INTO_LOCAL
                                             : v1::OP_TYPE_WRITE_FROM_LOCAL));
      op->set_local_buffer_id(mutator.Next() % 16 == 0 ? mutator.Next()
                                                       : scratch->buffer_id());
      op->set_local_offset(mutator.Next() % 8 == 0 ? mutator.Next()
                                                   : mutator.Next() % kSize);
      op->set_length(mutator.Next() % 8 == 0 ? mutator.Next()
                                             : mutator.Next() % 64);
      op->set_remote_offset(mutator.Next() % 8 == 0 ? mutator.Next()
                                                    : mutator.Next() % kSize);
      op->set_remote_context(mutator.Mutate(sentinel->remote_context()));
    }
    v1::SubmitResponse response;
    absl::Status status =
        FromGrpcStatus(agent.stub().Submit(&context, request, &response));
    ASSERT_TRUE(status.ok()) << status;
    ASSERT_EQ(response.results_size(), kOpsPerSubmit);
    for (int k = 0; k < kOpsPerSubmit; ++k) {
      const v1::OpResult& result = response.results(k);
      ++seen[result.code()];
      ASSERT_TRUE(IsContractCode(result.code()))
          << "op " << k << " of submit " << i / kOpsPerSubmit << ": code "
          << result.code() << " " << result.message();
      if (result.code() != 0) {
        EXPECT_NE(result.message().find(absl::StrCat("op ", k, ":")),
                  std::string::npos)
            << result.message();
      }
    }
  }
  EXPECT_EQ(ReadAll(agent, sentinel->buffer_id()), sentinel_before)
      << "a READ-only buffer was written through a mutated context";
  // The mutations reached more than the parser.
  EXPECT_GT(seen.size(), 3u);
  EXPECT_GT(seen[0], 0) << "no mutation left a usable context";
}

}  // namespace
}  // namespace rdma_agent

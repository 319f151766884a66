// Token first: a remote context without the right token learns nothing
// about the serving agent. A forged context naming a live buffer with a
// wrong token and one naming an unknown id get byte-identical answers, over
// tcp between two agents and over the memory backend inside one; no answer
// carries the agent's current epoch, and a stale context is told it is stale.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/testing/agent_fixture.h"
#include "tests/testing/backend_factories.h"

namespace rdma_agent {
namespace {

using testing::InProcessAgent;

constexpr uint64_t kSize = 4096;

std::unique_ptr<InProcessAgent> StartAgent(bool with_memory) {
  AgentOptions options;
  if (with_memory) {
    options.backends.push_back(testing::MemoryFactory());
  }
  options.backends.push_back(testing::LoopbackTcpFactory());
  auto agent = InProcessAgent::Start(std::move(options));
  EXPECT_TRUE(agent.ok()) << agent.status();
  return agent.ok() ? std::move(*agent) : nullptr;
}

v1::Op MakeOp(v1::OpType type, uint64_t local, const std::string& context) {
  v1::Op op;
  op.set_type(type);
  op.set_local_buffer_id(local);
  op.set_length(64);
  op.set_remote_context(context);
  return op;
}

// Submits `op` alone (so that every answer carries the same "op 0:").
v1::OpResult SubmitOne(InProcessAgent& agent, const v1::Op& op) {
  grpc::ClientContext context;
  v1::SubmitRequest request;
  *request.add_ops() = op;
  request.mutable_timeout()->set_seconds(10);
  v1::SubmitResponse response;
  const absl::Status status =
      FromGrpcStatus(agent.stub().Submit(&context, request, &response));
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_EQ(response.results_size(), 1);
  return response.results_size() == 1 ? response.results(0) : v1::OpResult();
}

uint64_t EpochOf(InProcessAgent& agent) {
  grpc::ClientContext context;
  v1::AgentInfo info;
  EXPECT_TRUE(agent.stub().GetInfo(&context, v1::GetInfoRequest(), &info).ok());
  return info.epoch();
}

// The ways an epoch could be spelled in a message.
void ExpectNoEpoch(const v1::OpResult& result, uint64_t epoch) {
  const std::string text = result.message();
  EXPECT_EQ(text.find(absl::StrCat(epoch)), std::string::npos) << text;
  EXPECT_EQ(text.find(absl::StrCat(absl::Hex(epoch))), std::string::npos)
      << text;
  EXPECT_EQ(text.find(absl::StrCat(absl::Hex(epoch, absl::kZeroPad16))),
            std::string::npos)
      << text;
}

struct Contexts {
  std::string wrong_token;
  std::string unknown_id;
  std::string stale;
  std::string good;
};

Contexts Forge(const v1::RegisterResponse& real) {
  Contexts contexts;
  contexts.good = real.remote_context();
  v1::RemoteBuffer forged;
  EXPECT_TRUE(forged.ParseFromString(real.remote_context()));
  forged.set_token(std::string(forged.token().size(), 'x'));
  contexts.wrong_token = forged.SerializeAsString();
  v1::RemoteBuffer unknown;
  EXPECT_TRUE(unknown.ParseFromString(real.remote_context()));
  unknown.set_buffer_id(unknown.buffer_id() + 1000);
  contexts.unknown_id = unknown.SerializeAsString();
  v1::RemoteBuffer stale;
  EXPECT_TRUE(stale.ParseFromString(real.remote_context()));
  stale.set_agent_epoch(stale.agent_epoch() ^ 0x5a5a);
  contexts.stale = stale.SerializeAsString();
  return contexts;
}

// Runs every forged context as read and write from `caller`'s buffer `local`
// and checks what comes back, for contexts issued by `server`.
void CheckAnswers(InProcessAgent& caller, uint64_t local,
                  InProcessAgent& server, const Contexts& contexts,
                  const std::string& expected_backend) {
  const uint64_t epoch = EpochOf(server);
  for (const v1::OpType type :
       {v1::OP_TYPE_READ_INTO_LOCAL, v1::OP_TYPE_WRITE_FROM_LOCAL}) {
    SCOPED_TRACE(v1::OpType_Name(type));
    const v1::OpResult wrong_token =
        SubmitOne(caller, MakeOp(type, local, contexts.wrong_token));
    const v1::OpResult unknown_id =
        SubmitOne(caller, MakeOp(type, local, contexts.unknown_id));
    EXPECT_EQ(wrong_token.code(), static_cast<int>(absl::StatusCode::kNotFound))
        << wrong_token.message();
    EXPECT_EQ(wrong_token.backend(), expected_backend);
    // Byte-identical: code, message and backend.
    EXPECT_EQ(wrong_token.SerializeAsString(), unknown_id.SerializeAsString())
        << "wrong token: " << wrong_token.ShortDebugString()
        << "\nunknown id: " << unknown_id.ShortDebugString();
    ExpectNoEpoch(wrong_token, epoch);
    ExpectNoEpoch(unknown_id, epoch);

    const v1::OpResult stale =
        SubmitOne(caller, MakeOp(type, local, contexts.stale));
    EXPECT_EQ(stale.code(),
              static_cast<int>(absl::StatusCode::kFailedPrecondition))
        << stale.message();
    EXPECT_NE(stale.message().find("stale"), std::string::npos)
        << stale.message();
    ExpectNoEpoch(stale, epoch);

    // The real context still works, so the refusals were not about the path.
    const v1::OpResult good =
        SubmitOne(caller, MakeOp(type, local, contexts.good));
    EXPECT_EQ(good.code(), 0) << good.message();
    EXPECT_EQ(good.backend(), expected_backend);
  }
}

TEST(PeerTokenFirstTest, TcpPeerCannotTellAWrongTokenFromAnUnknownId) {
  auto a = StartAgent(/*with_memory=*/false);
  auto b = StartAgent(/*with_memory=*/false);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  auto local = a->Allocate(kSize);
  auto remote = b->Allocate(kSize);
  ASSERT_TRUE(local.ok() && remote.ok());
  CheckAnswers(*a, local->buffer_id(), *b, Forge(*remote), "tcp");
}

TEST(PeerTokenFirstTest, MemoryBackendCannotTellAWrongTokenFromAnUnknownId) {
  auto a = StartAgent(/*with_memory=*/true);
  ASSERT_NE(a, nullptr);
  auto local = a->Allocate(kSize);
  auto target = a->Allocate(kSize);
  ASSERT_TRUE(local.ok() && target.ok());
  CheckAnswers(*a, local->buffer_id(), *a, Forge(*target), "memory");
}

// Access is checked only once the token matched: a READ-only buffer refuses
// a write with PERMISSION_DENIED to a token holder, NOT_FOUND to others.
TEST(PeerTokenFirstTest, AccessIsCheckedOnlyAfterTheToken) {
  auto a = StartAgent(/*with_memory=*/false);
  auto b = StartAgent(/*with_memory=*/false);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  auto local = a->Allocate(kSize);
  auto read_only = b->Allocate(kSize, v1::ACCESS_READ);
  ASSERT_TRUE(local.ok() && read_only.ok());
  // The context claims READ_WRITE so that the caller's agent lets it pass
  // and the serving agent decides.
  v1::RemoteBuffer lying;
  ASSERT_TRUE(lying.ParseFromString(read_only->remote_context()));
  lying.set_access(v1::ACCESS_READ_WRITE);
  const v1::OpResult holder =
      SubmitOne(*a, MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL, local->buffer_id(),
                           lying.SerializeAsString()));
  EXPECT_EQ(holder.code(),
            static_cast<int>(absl::StatusCode::kPermissionDenied))
      << holder.message();
  lying.set_token(std::string(lying.token().size(), 'x'));
  const v1::OpResult stranger =
      SubmitOne(*a, MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL, local->buffer_id(),
                           lying.SerializeAsString()));
  EXPECT_EQ(stranger.code(), static_cast<int>(absl::StatusCode::kNotFound))
      << stranger.message();
}

}  // namespace
}  // namespace rdma_agent

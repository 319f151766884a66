// Imported remotes through the RdmaAgent API of in-process agents:
// ImportRemote, ReleaseRemote, ListRemotes and ops naming Op.remote_handle.
// Every bad input gets the contract's code naming the op or the RPC, a
// handle is checked per op exactly as its context would be, good ops move
// exactly the bytes asked (every byte of both buffers is checked), and
// handles are bounded by count and bytes.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends/tcp/tcp_backend.h"
#include "common/unique_fd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "rdma/agent/v1/remote_buffer.pb.h"
#include "tests/testing/agent_fixture.h"
#include "tests/testing/backend_factories.h"
#include "tests/testing/pattern.h"
#include "tests/testing/transfer_calls.h"

namespace rdma_agent::testing {
namespace {

using ::testing::HasSubstr;

constexpr v1::OpType kRead = v1::OP_TYPE_READ_INTO_LOCAL;
constexpr v1::OpType kWrite = v1::OP_TYPE_WRITE_FROM_LOCAL;
constexpr uint64_t kSize = 4096;

// The RPCs of one stub, with their statuses as absl::Status.
class Caller {
 public:
  explicit Caller(v1::RdmaAgent::Stub* stub) : stub_(stub) {}

  absl::StatusOr<v1::ImportRemoteResponse> Import(const std::string& context) {
    grpc::ClientContext call;
    v1::ImportRemoteRequest request;
    request.set_remote_context(context);
    v1::ImportRemoteResponse response;
    absl::Status status =
        FromGrpcStatus(stub_->ImportRemote(&call, request, &response));
    if (!status.ok()) return status;
    return response;
  }

  absl::Status ReleaseRemote(uint64_t handle) {
    grpc::ClientContext call;
    v1::ReleaseRemoteRequest request;
    request.set_remote_handle(handle);
    v1::ReleaseRemoteResponse response;
    return FromGrpcStatus(stub_->ReleaseRemote(&call, request, &response));
  }

  absl::StatusOr<std::vector<v1::RemoteHandleInfo>> List() {
    grpc::ClientContext call;
    v1::ListRemotesResponse response;
    absl::Status status = FromGrpcStatus(
        stub_->ListRemotes(&call, v1::ListRemotesRequest(), &response));
    if (!status.ok()) return status;
    return std::vector<v1::RemoteHandleInfo>(response.remotes().begin(),
                                             response.remotes().end());
  }

  absl::Status Write(uint64_t id, const std::string& data) {
    grpc::ClientContext call;
    v1::WriteBufferRequest request;
    request.set_buffer_id(id);
    request.set_data(data);
    v1::WriteBufferResponse response;
    return FromGrpcStatus(stub_->WriteBuffer(&call, request, &response));
  }

  std::string Read(uint64_t id) {
    grpc::ClientContext call;
    v1::ReadBufferRequest request;
    request.set_buffer_id(id);
    request.set_length(kSize);
    v1::ReadBufferResponse response;
    absl::Status status =
        FromGrpcStatus(stub_->ReadBuffer(&call, request, &response));
    EXPECT_TRUE(status.ok()) << status;
    return response.data();
  }

  std::vector<v1::OpResult> Submit(std::vector<v1::Op> ops) {
    auto results =
        SubmitSync(*stub_, MakeBatch(std::move(ops), absl::Seconds(10)));
    EXPECT_TRUE(results.ok()) << results.status();
    return results.ok() ? *results : std::vector<v1::OpResult>();
  }

 private:
  v1::RdmaAgent::Stub* stub_;
};

v1::Op HandleOp(v1::OpType type, uint64_t local_id, uint64_t local_offset,
                uint64_t length, uint64_t handle, uint64_t remote_offset) {
  v1::Op op =
      MakeWireOp(type, local_id, local_offset, length, "", remote_offset);
  op.set_remote_handle(handle);
  return op;
}

void ExpectOpFailed(const v1::OpResult& result, absl::StatusCode code,
                    size_t index, absl::string_view fragment) {
  EXPECT_EQ(result.code(), static_cast<int>(code)) << result.message();
  EXPECT_THAT(result.message(), HasSubstr(absl::StrCat("op ", index, ":")));
  EXPECT_THAT(result.message(), HasSubstr(fragment));
}

class ImportedRemotesTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(AgentOptions{}); }

  void Start(AgentOptions options) {
    agent_.reset();
    auto agent = InProcessAgent::Start(std::move(options));
    ASSERT_TRUE(agent.ok()) << agent.status();
    agent_ = std::move(*agent);
  }

  Caller caller() { return Caller(&agent_->stub()); }

  v1::RegisterResponse Allocate(v1::Access access = v1::ACCESS_READ_WRITE) {
    auto response = agent_->Allocate(kSize, access);
    EXPECT_TRUE(response.ok()) << response.status();
    return response.ok() ? *response : v1::RegisterResponse();
  }

  // A buffer filled with the pattern of `seed`; returns it and its bytes.
  std::pair<v1::RegisterResponse, std::string> Filled(int seed) {
    v1::RegisterResponse buffer = Allocate();
    std::string data = PatternString(seed, 0, kSize);
    EXPECT_TRUE(caller().Write(buffer.buffer_id(), data).ok());
    return {buffer, data};
  }

  uint64_t Import(const std::string& context) {
    auto imported = caller().Import(context);
    EXPECT_TRUE(imported.ok()) << imported.status();
    return imported.ok() ? imported->remote_handle() : 0;
  }

  std::unique_ptr<InProcessAgent> agent_;
};

TEST_F(ImportedRemotesTest, ImportDescribesTheContext) {
  const v1::RegisterResponse remote = Allocate(v1::ACCESS_READ);
  auto imported = caller().Import(remote.remote_context());
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_NE(imported->remote_handle(), 0u);
  EXPECT_EQ(imported->remote().remote_handle(), imported->remote_handle());
  EXPECT_EQ(imported->remote().agent_id(), agent_->agent().identity().agent_id);
  EXPECT_EQ(imported->remote().buffer_id(), remote.buffer_id());
  EXPECT_EQ(imported->remote().size_bytes(), kSize);
  EXPECT_EQ(imported->remote().access(), v1::ACCESS_READ);
  EXPECT_THAT(imported->remote().backends(), ::testing::ElementsAre("memory"));
  // A second import of the same context is a handle of its own.
  EXPECT_NE(Import(remote.remote_context()), imported->remote_handle());
  EXPECT_EQ(agent_->agent().remote_handles().size(), 2u);
}

TEST_F(ImportedRemotesTest, OpsNamingAHandleMoveExactlyTheirBytes) {
  auto [local, local_data] = Filled(1);
  auto [remote, remote_data] = Filled(2);
  const uint64_t handle = Import(remote.remote_context());
  auto results = caller().Submit(
      {HandleOp(kRead, local.buffer_id(), 100, 300, handle, 7),
       HandleOp(kWrite, local.buffer_id(), 2000, 50, handle, 3000)});
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results[0].code(), 0) << results[0].message();
  EXPECT_EQ(results[0].backend(), "memory");
  EXPECT_EQ(results[1].code(), 0) << results[1].message();
  // Every byte of both buffers: only the ops' ranges changed.
  std::string local_expected = local_data;
  local_expected.replace(100, 300, remote_data.substr(7, 300));
  std::string remote_expected = remote_data;
  remote_expected.replace(3000, 50, local_data.substr(2000, 50));
  EXPECT_EQ(caller().Read(local.buffer_id()), local_expected);
  EXPECT_EQ(caller().Read(remote.buffer_id()), remote_expected);
}

TEST_F(ImportedRemotesTest, ContextAndHandleMixInOneBatch) {
  auto [local, local_data] = Filled(3);
  auto [remote, remote_data] = Filled(4);
  const uint64_t handle = Import(remote.remote_context());
  auto results =
      caller().Submit({HandleOp(kRead, local.buffer_id(), 0, 10, handle, 0),
                       MakeWireOp(kRead, local.buffer_id(), 10, 10,
                                  remote.remote_context(), 10)});
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results[0].code(), 0) << results[0].message();
  EXPECT_EQ(results[1].code(), 0) << results[1].message();
  std::string expected = local_data;
  expected.replace(0, 20, remote_data.substr(0, 20));
  EXPECT_EQ(caller().Read(local.buffer_id()), expected);
}

TEST_F(ImportedRemotesTest, EveryBadOpNamingAHandleGetsItsCode) {
  auto [local, local_data] = Filled(5);
  auto [remote, remote_data] = Filled(6);
  const v1::RegisterResponse read_only = Allocate(v1::ACCESS_READ);
  const v1::RegisterResponse gone = Allocate();
  const uint64_t handle = Import(remote.remote_context());
  const uint64_t read_only_handle = Import(read_only.remote_context());
  const uint64_t gone_handle = Import(gone.remote_context());
  grpc::ClientContext call;
  v1::ReleaseRequest release;
  release.set_buffer_id(gone.buffer_id());
  v1::ReleaseResponse released;
  ASSERT_TRUE(agent_->stub().Release(&call, release, &released).ok());
  const uint64_t released_handle = Import(remote.remote_context());
  ASSERT_TRUE(caller().ReleaseRemote(released_handle).ok());

  v1::Op both = HandleOp(kRead, local.buffer_id(), 0, 8, handle, 0);
  both.set_remote_context(remote.remote_context());
  struct Case {
    v1::Op op;
    absl::StatusCode code;
    std::string fragment;
  };
  const uint64_t id = local.buffer_id();
  const std::vector<Case> cases = {
      {both, absl::StatusCode::kInvalidArgument, "not several"},
      {MakeWireOp(kRead, id, 0, 8, "", 0), absl::StatusCode::kInvalidArgument,
       "no remote_handle"},
      {HandleOp(kRead, id, 0, 8, 12345, 0), absl::StatusCode::kNotFound,
       "remote handle 12345 is not imported"},
      {HandleOp(kRead, id, 0, 8, released_handle, 0),
       absl::StatusCode::kNotFound, "is not imported"},
      {HandleOp(kRead, id, 0, 8, handle, kSize - 7),
       absl::StatusCode::kOutOfRange, "remote"},
      {HandleOp(kRead, id, kSize - 7, 8, handle, 0),
       absl::StatusCode::kOutOfRange, "local"},
      {HandleOp(kWrite, id, 0, 8, read_only_handle, 0),
       absl::StatusCode::kPermissionDenied, "WRITE"},
      {HandleOp(kRead, id, 0, 0, handle, 0), absl::StatusCode::kInvalidArgument,
       "length"},
      {HandleOp(kRead, 999999, 0, 8, handle, 0), absl::StatusCode::kNotFound,
       "local buffer"},
      // Checked by the serving side as its context would be.
      {HandleOp(kRead, id, 0, 8, gone_handle, 0), absl::StatusCode::kNotFound,
       "remote buffer"},
  };
  std::vector<v1::Op> ops;
  for (const Case& c : cases) ops.push_back(c.op);
  ops.push_back(HandleOp(kRead, id, 100, 50, handle, 200));  // still runs
  auto results = caller().Submit(ops);
  ASSERT_EQ(results.size(), cases.size() + 1);
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("case ", i));
    ExpectOpFailed(results[i], cases[i].code, i, cases[i].fragment);
  }
  EXPECT_EQ(results.back().code(), 0) << results.back().message();
  std::string expected = local_data;
  expected.replace(100, 50, remote_data.substr(200, 50));
  EXPECT_EQ(caller().Read(id), expected);
  EXPECT_EQ(caller().Read(remote.buffer_id()), remote_data);
}

TEST_F(ImportedRemotesTest, BadContextsAreRefusedAtImport) {
  const v1::RegisterResponse remote = Allocate();
  v1::RemoteBuffer foreign;
  ASSERT_TRUE(foreign.ParseFromString(remote.remote_context()));
  foreign.mutable_endpoints(0)->set_backend("tcp");
  foreign.mutable_endpoints(0)->clear_memory();
  struct Case {
    std::string context;
    absl::StatusCode code;
    std::string fragment;
  };
  const std::vector<Case> cases = {
      {"", absl::StatusCode::kInvalidArgument, "empty"},
      {"not a context", absl::StatusCode::kInvalidArgument, "remote_context"},
      {remote.remote_context().substr(0, remote.remote_context().size() / 2),
       absl::StatusCode::kInvalidArgument, "remote_context"},
      {std::string(17 << 10, 'x'), absl::StatusCode::kInvalidArgument,
       "--max_remote_context_bytes"},
      {foreign.SerializeAsString(), absl::StatusCode::kUnavailable,
       "no backend of this agent reaches remote buffer"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("case ", i));
    auto imported = caller().Import(cases[i].context);
    EXPECT_EQ(imported.status().code(), cases[i].code) << imported.status();
    EXPECT_THAT(imported.status().message(), HasSubstr("ImportRemote: "));
    EXPECT_THAT(imported.status().message(), HasSubstr(cases[i].fragment));
  }
  EXPECT_EQ(agent_->agent().remote_handles().size(), 0u);
  EXPECT_EQ(agent_->agent().remote_handles().bytes(), 0u);
}

TEST_F(ImportedRemotesTest, ReleaseAndListAreTheCallersOwn) {
  const v1::RegisterResponse remote = Allocate();
  const uint64_t first = Import(remote.remote_context());
  const uint64_t second = Import(remote.remote_context());
  auto listed = caller().List();
  ASSERT_TRUE(listed.ok()) << listed.status();
  std::vector<uint64_t> handles;
  for (const auto& info : *listed) handles.push_back(info.remote_handle());
  EXPECT_THAT(handles, ::testing::UnorderedElementsAre(first, second));

  // Another connection of the same user names the same handles.
  auto other_stub = agent_->NewStub();
  Caller other(other_stub.get());
  EXPECT_TRUE(other.ReleaseRemote(first).ok());
  absl::Status again = caller().ReleaseRemote(first);
  EXPECT_EQ(again.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(again.message(), HasSubstr("ReleaseRemote: remote handle"));
  EXPECT_EQ(caller().ReleaseRemote(0).code(), absl::StatusCode::kNotFound);
  listed = caller().List();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].remote_handle(), second);
  ASSERT_TRUE(caller().ReleaseRemote(second).ok());
  EXPECT_EQ(agent_->agent().remote_handles().bytes(), 0u);
}

TEST_F(ImportedRemotesTest, HandlesAreBoundedByCount) {
  AgentOptions options;
  options.remote_handles.max_per_user = 2;
  Start(std::move(options));
  const v1::RegisterResponse remote = Allocate();
  const uint64_t first = Import(remote.remote_context());
  Import(remote.remote_context());
  auto refused = caller().Import(remote.remote_context());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("--max_remote_handles_per_user"));
  // Released, its slot is given back.
  ASSERT_TRUE(caller().ReleaseRemote(first).ok());
  EXPECT_TRUE(caller().Import(remote.remote_context()).ok());
}

TEST_F(ImportedRemotesTest, HandlesAreBoundedByBytes) {
  AgentOptions options;
  options.remote_handles.max_bytes_per_user = 1024;
  Start(std::move(options));
  const v1::RegisterResponse remote = Allocate();
  const uint64_t first = Import(remote.remote_context());
  const uint64_t charged = agent_->agent().remote_handles().bytes();
  // A handle is charged at least its context and the table's share.
  EXPECT_GE(charged, remote.remote_context().size() +
                         RemoteHandleLimits::kOverheadBytes);
  ASSERT_LT(charged, 1024u);
  ASSERT_GT(2 * charged, 1024u);
  auto refused = caller().Import(remote.remote_context());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("--max_remote_handle_bytes_per_user"));
  // A refused import keeps nothing.
  EXPECT_EQ(agent_->agent().remote_handles().bytes(), charged);
  EXPECT_EQ(agent_->agent().remote_handles().size(), 1u);
  ASSERT_TRUE(caller().ReleaseRemote(first).ok());
  EXPECT_EQ(agent_->agent().remote_handles().bytes(), 0u);
  EXPECT_TRUE(caller().Import(remote.remote_context()).ok());
}

TEST_F(ImportedRemotesTest, AHandleOfAContextFromBeforeARestartIsStale) {
  const v1::RegisterResponse old_remote = Allocate();
  ASSERT_TRUE(agent_->Restart().ok());
  const v1::RegisterResponse local = Allocate();
  // Importing only parses: the issuing agent judges the epoch per op.
  const uint64_t handle = Import(old_remote.remote_context());
  auto results =
      caller().Submit({HandleOp(kRead, local.buffer_id(), 0, 8, handle, 0)});
  ASSERT_EQ(results.size(), 1u);
  ExpectOpFailed(results[0], absl::StatusCode::kFailedPrecondition, 0, "stale");
}

TEST_F(ImportedRemotesTest, HandlesRunInAsynchronousTransfers) {
  auto [local, local_data] = Filled(7);
  auto [remote, remote_data] = Filled(8);
  const uint64_t handle = Import(remote.remote_context());
  auto id = SubmitAsync(
      agent_->stub(),
      MakeBatch({HandleOp(kRead, local.buffer_id(), 0, kSize, handle, 0)},
                absl::Seconds(10)));
  ASSERT_TRUE(id.ok()) << id.status();
  auto transfer = GetTransfer(agent_->stub(), *id, absl::Seconds(10));
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  EXPECT_EQ(transfer->state(), v1::TRANSFER_STATE_DONE)
      << DescribeFailures(*transfer);
  EXPECT_EQ(caller().Read(local.buffer_id()), remote_data);
}

// A free TCP port on 127.0.0.1 (bound, read, closed).
uint16_t FreeLoopbackPort() {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM, 0));
  struct sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)),
            0);
  socklen_t length = sizeof(addr);
  EXPECT_EQ(
      ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &length), 0);
  return ntohs(addr.sin_port);
}

BackendFactory TcpOnPort(uint16_t port) {
  return [port](const BackendEnvironment& env)
             -> absl::StatusOr<std::unique_ptr<Backend>> {
    tcp::TcpOptions options;
    options.listen = absl::StrCat("127.0.0.1:", port);
    auto backend = tcp::TcpBackend::Create(options, env);
    if (!backend.ok()) return backend.status();
    return std::unique_ptr<Backend>(std::move(*backend));
  };
}

// A handle of another agent's buffer (over tcp) runs ops and prepared
// transfers; then that agent restarts on the same data port and the
// handle's ops fail as a stale context's do.
TEST(ImportedRemotesTcpTest,
     HandlesRunOverTcpAndGoStaleWhenTheirAgentRestarts) {
  AgentOptions a_options;
  a_options.backends = {LoopbackTcpFactory()};
  auto a = InProcessAgent::Start(std::move(a_options));
  ASSERT_TRUE(a.ok()) << a.status();
  AgentOptions b_options;
  b_options.backends = {TcpOnPort(FreeLoopbackPort())};
  auto b = InProcessAgent::Start(std::move(b_options));
  ASSERT_TRUE(b.ok()) << b.status();
  auto local = (*a)->Allocate(kSize);
  ASSERT_TRUE(local.ok()) << local.status();
  auto remote = (*b)->Allocate(kSize);
  ASSERT_TRUE(remote.ok()) << remote.status();
  Caller on_a(&(*a)->stub());
  auto imported = on_a.Import(remote->remote_context());
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_THAT(imported->remote().backends(), ::testing::ElementsAre("tcp"));
  const uint64_t handle = imported->remote_handle();
  ASSERT_TRUE(Caller(&(*b)->stub())
                  .Write(remote->buffer_id(), PatternString(9, 0, kSize))
                  .ok());
  auto results =
      on_a.Submit({HandleOp(kRead, local->buffer_id(), 0, kSize, handle, 0)});
  ASSERT_EQ(results.size(), 1u);
  ASSERT_EQ(results[0].code(), 0) << results[0].message();
  EXPECT_EQ(on_a.Read(local->buffer_id()), PatternString(9, 0, kSize));

  // A prepared transfer naming the handle runs over tcp too, and carries
  // its notification to the remote buffer's owner at every run.
  grpc::ClientContext prepare_call;
  v1::PrepareTransferRequest prepare;
  *prepare.add_ops() =
      HandleOp(kWrite, local->buffer_id(), 0, 100, handle, 1000);
  prepare.set_notification("layer 7");
  v1::PrepareTransferResponse prepared;
  ASSERT_TRUE(
      (*a)->stub().PrepareTransfer(&prepare_call, prepare, &prepared).ok());
  v1::SubmitRequest run = MakeBatch({}, absl::Seconds(10));
  run.set_prepared_id(prepared.prepared_id());
  for (int i = 0; i < 2; ++i) {
    grpc::ClientContext call;
    v1::SubmitResponse response;
    ASSERT_TRUE((*a)->stub().Submit(&call, run, &response).ok());
    ASSERT_EQ(response.results_size(), 1);
    EXPECT_EQ(response.results(0).code(), 0) << response.results(0).message();
    EXPECT_EQ(response.results(0).backend(), "tcp");
    ASSERT_EQ(response.notifications_size(), 1);
    EXPECT_EQ(response.notifications(0).code(), 0)
        << response.notifications(0).message();
  }
  grpc::ClientContext notifications_call;
  v1::GetNotificationsRequest get;
  v1::GetNotificationsResponse notifications;
  ASSERT_TRUE((*b)->stub()
                  .GetNotifications(&notifications_call, get, &notifications)
                  .ok());
  ASSERT_EQ(notifications.notifications_size(), 2);
  EXPECT_EQ(notifications.notifications(0).data(), "layer 7");
  EXPECT_EQ(notifications.notifications(0).buffer_id(), remote->buffer_id());
  std::string remote_expected = PatternString(9, 0, kSize);
  remote_expected.replace(1000, 100, PatternString(9, 0, 100));
  EXPECT_EQ(Caller(&(*b)->stub()).Read(remote->buffer_id()), remote_expected);

  ASSERT_TRUE((*b)->Restart().ok());
  results = on_a.Submit({HandleOp(kRead, local->buffer_id(), 0, 8, handle, 0)});
  ASSERT_EQ(results.size(), 1u);
  ExpectOpFailed(results[0], absl::StatusCode::kFailedPrecondition, 0, "stale");
}

}  // namespace
}  // namespace rdma_agent::testing

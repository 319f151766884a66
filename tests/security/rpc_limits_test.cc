// One local user cannot take the agent's RPC threads or its connections
// from everyone else: past its own share it is refused (RESOURCE_EXHAUSTED,
// or its connection closed) while another user is still served. Real
// rdma-agentd processes with small limits; needs root for the second user.

#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/unique_fd.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "tests/client/worker_process.h"
#include "tests/testing/agent_process.h"

namespace rdma_agent::testing {
namespace {

namespace v1 = ::rdma::agent::v1;

constexpr int kNobody = 65534;
constexpr int kReadWrite = 3;  // v1::ACCESS_READ_WRITE
constexpr uint64_t kHalf = 64ull << 20;

// A raw connection to the agent's socket (accepted, never spoken on).
UniqueFd ConnectRaw(const std::string& path) {
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) !=
      0) {
    return UniqueFd();
  }
  return fd;
}

// A worker of `uid` asks for GetInfo: "status OK" when it is served.
std::string InfoAs(const AgentProcess& agent, int uid) {
  WorkerProcess::Options options;
  options.uid = uid;
  options.gid = uid;
  auto worker = WorkerProcess::Start(agent, options);
  if (!worker.ok()) return worker.status().ToString();
  return worker->Answer("info");
}

class RpcLimitsTest : public ::testing::Test {
 protected:
  void Start(std::vector<std::string> flags) {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a second user";
    AgentProcess::Options options;
    options.extra_flags = std::move(flags);
    auto agent = AgentProcess::Start(options);
    ASSERT_TRUE(agent.ok()) << agent.status();
    agent_ = std::move(*agent);
    ASSERT_EQ(::chmod(agent_->runtime_dir().c_str(), 0755), 0);
  }

  std::unique_ptr<AgentProcess> agent_;
};

TEST_F(RpcLimitsTest, OneUsersLongCallsDoNotTakeEveryThread) {
  Start({"--max_rpcs_per_user=2"});
  auto buffer = agent_->client().Allocate(2 * kHalf, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  // Two long Submits (thousands of 64 MiB copies) fill root's share.
  v1::SubmitRequest request;
  for (int i = 0; i < 4096; ++i) {
    v1::Op* op = request.add_ops();
    op->set_type(v1::OP_TYPE_READ_INTO_LOCAL);
    op->set_local_buffer_id(buffer->id());
    op->set_length(kHalf);
    op->set_remote_context(buffer->remote_context());
    op->set_remote_offset(kHalf);
  }
  request.mutable_timeout()->set_seconds(600);
  // Raw calls, to see the agent's own refusal: a stub on the client's channel.
  auto stub = v1::RdmaAgent::NewStub(agent_->client().channel());
  grpc::ClientContext calls[2];
  std::vector<std::thread> callers;
  for (grpc::ClientContext& call : calls) {
    callers.emplace_back([&] {
      v1::SubmitResponse response;
      (void)stub->Submit(&call, request, &response);
    });
  }
  // Root's third call is refused once both are admitted...
  grpc::Status third;
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  do {
    absl::SleepFor(absl::Milliseconds(50));
    grpc::ClientContext call;
    v1::AgentInfo info;
    third = stub->GetInfo(&call, v1::GetInfoRequest(), &info);
  } while (third.ok() && absl::Now() < give_up);
  EXPECT_EQ(third.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(absl::StrContains(third.error_message(), "--max_rpcs_per_user"))
      << third.error_message();
  // ...while another user is served.
  EXPECT_EQ(InfoAs(*agent_, kNobody), "status OK");
  for (grpc::ClientContext& call : calls) call.TryCancel();
  for (std::thread& caller : callers) caller.join();
  // The slots come back when the calls end (the agent notices the
  // cancellations within its watch interval).
  absl::Status info;
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  do {
    info = agent_->client().GetInfo().status();
  } while (!info.ok() && absl::Now() < deadline);
  EXPECT_TRUE(info.ok()) << info;
}

// What the agent does with a fresh raw connection: "served" (gRPC's
// server preface arrives), "closed" (EOF: refused at accept) or "silent".
std::string Fate(int fd) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, 5000) <= 0) return "silent";
  char byte;
  return ::recv(fd, &byte, 1, MSG_PEEK) > 0 ? "served" : "closed";
}

TEST_F(RpcLimitsTest, ConnectionsPerUserAreBoundedAndComeBack) {
  Start({"--max_connections_per_user=4"});
  // The harness's own client holds one of root's connections; three more
  // are served, the fifth is closed at accept.
  std::vector<UniqueFd> held;
  for (int i = 0; i < 3; ++i) {
    held.push_back(ConnectRaw(agent_->socket_path()));
    ASSERT_TRUE(held.back()) << "connect " << i;
    EXPECT_EQ(Fate(held.back().get()), "served") << "connection " << i;
  }
  UniqueFd over = ConnectRaw(agent_->socket_path());
  ASSERT_TRUE(over);
  EXPECT_EQ(Fate(over.get()), "closed");
  // Another user is not affected.
  EXPECT_EQ(InfoAs(*agent_, kNobody), "status OK");
  // Closed connections free their slots once gRPC has closed its end (the
  // agent sees their inodes go).
  held.clear();
  std::string fate;
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  do {
    UniqueFd again = ConnectRaw(agent_->socket_path());
    ASSERT_TRUE(again);
    fate = Fate(again.get());
  } while (fate != "served" && absl::Now() < give_up);
  EXPECT_EQ(fate, "served");
}

}  // namespace
}  // namespace rdma_agent::testing

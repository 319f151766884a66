// Registration lifetimes in one in-process agent: what Register answers, how
// a registration is bound to its client's connection or process, the
// fallbacks where a process cannot be watched, and the watched-clients
// quota. Killed client processes against a real rdma-agentd are in
// client_lifetime_test.cc.
#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/worker_process.h"
#include "tests/testing/agent_fixture.h"
#include "tests/testing/eventually.h"

namespace rdma_agent {
namespace {

using ::rdma_agent::FromGrpcStatus;
using ::rdma_agent::testing::Eventually;
using ::rdma_agent::testing::InProcessAgent;
using ::rdma_agent::testing::WorkerProcess;
using ::testing::HasSubstr;

class RegistrationLifetimeTest : public ::testing::Test {
 protected:
  void SetUp() override { StartAgent(AgentOptions{}); }

  void StartAgent(AgentOptions options) {
    fixture_.reset();
    // Short, so that connection-bound registrations go quickly.
    options.connection_poll_interval = absl::Milliseconds(50);
    auto fixture = InProcessAgent::Start(std::move(options));
    ASSERT_TRUE(fixture.ok()) << fixture.status();
    fixture_ = std::move(*fixture);
  }

  absl::StatusOr<v1::RegisterResponse> Register(v1::RdmaAgent::Stub& stub,
                                                v1::Lifetime lifetime) {
    grpc::ClientContext context;
    v1::RegisterRequest request;
    request.set_allocate_bytes(4096);
    request.set_access(v1::ACCESS_READ_WRITE);
    request.set_lifetime(lifetime);
    v1::RegisterResponse response;
    absl::Status status =
        FromGrpcStatus(stub.Register(&context, request, &response));
    if (!status.ok()) return status;
    return response;
  }

  absl::Status Release(uint64_t id) {
    grpc::ClientContext context;
    v1::ReleaseRequest request;
    request.set_buffer_id(id);
    v1::ReleaseResponse response;
    return FromGrpcStatus(
        fixture_->stub().Release(&context, request, &response));
  }

  // The caller's (this process's user's) registrations.
  std::vector<v1::BufferInfo> Listed() {
    grpc::ClientContext context;
    v1::ListBuffersResponse response;
    const grpc::Status status = fixture_->stub().ListBuffers(
        &context, v1::ListBuffersRequest(), &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return {response.buffers().begin(), response.buffers().end()};
  }

  std::optional<v1::BufferInfo> Find(uint64_t id) {
    for (const v1::BufferInfo& info : Listed()) {
      if (info.buffer_id() == id) return info;
    }
    return std::nullopt;
  }

  bool Gone(uint64_t id) { return !Find(id).has_value(); }

  std::unique_ptr<InProcessAgent> fixture_;
};

TEST_F(RegistrationLifetimeTest, UnsetLifetimeIsAgentAndTheCallerOwnsIt) {
  auto registered = Register(fixture_->stub(), v1::LIFETIME_UNSPECIFIED);
  ASSERT_TRUE(registered.ok()) << registered.status();
  EXPECT_EQ(registered->lifetime(), v1::LIFETIME_AGENT);
  auto info = Find(registered->buffer_id());
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->lifetime(), v1::LIFETIME_AGENT);
  EXPECT_EQ(info->owner_uid(), ::geteuid());
  EXPECT_EQ(info->owner_pid(), static_cast<uint32_t>(::getpid()));
  EXPECT_GT(info->create_time().seconds(), 0);
  EXPECT_EQ(info->last_use_time().seconds(), info->create_time().seconds());
  EXPECT_EQ(info->last_use_time().nanos(), info->create_time().nanos())
      << "unused: last use is the creation";
}

TEST_F(RegistrationLifetimeTest, UnknownLifetimeIsInvalidArgument) {
  auto registered = Register(fixture_->stub(), static_cast<v1::Lifetime>(9));
  EXPECT_EQ(registered.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(registered.status().message()),
              HasSubstr("Register: lifetime 9 is not"));
  EXPECT_TRUE(Listed().empty());
}

TEST_F(RegistrationLifetimeTest, ClosingAConnectionEndsOnlyItsOwnLifetime) {
  std::unique_ptr<v1::RdmaAgent::Stub> stub = fixture_->NewStub();
  auto agent = Register(*stub, v1::LIFETIME_AGENT);
  auto process = Register(*stub, v1::LIFETIME_CLIENT_PROCESS);
  auto connection = Register(*stub, v1::LIFETIME_CLIENT_CONNECTION);
  ASSERT_TRUE(agent.ok()) << agent.status();
  ASSERT_TRUE(process.ok()) << process.status();
  ASSERT_TRUE(connection.ok()) << connection.status();
  EXPECT_EQ(process->lifetime(), v1::LIFETIME_CLIENT_PROCESS);
  EXPECT_EQ(connection->lifetime(), v1::LIFETIME_CLIENT_CONNECTION);
  EXPECT_EQ(Find(connection->buffer_id())->lifetime(),
            v1::LIFETIME_CLIENT_CONNECTION);

  stub.reset();  // its channel, and the connection, close
  ASSERT_TRUE(Eventually([&] { return Gone(connection->buffer_id()); }))
      << "the connection-bound registration outlived its connection";
  // This process lives on, and with it what it registered with process
  // lifetime, whatever connection that came through.
  EXPECT_FALSE(Gone(process->buffer_id()));
  EXPECT_FALSE(Gone(agent->buffer_id()));
  // A released registration is an ordinary NOT_FOUND afterwards.
  EXPECT_EQ(Release(connection->buffer_id()).code(),
            absl::StatusCode::kNotFound);
}

TEST_F(RegistrationLifetimeTest,
       WithoutPidfdsProcessLifetimeEndsWithTheConnection) {
  AgentOptions options;
  options.process_watch.peer_pidfd = false;
  options.process_watch.pidfd_open = false;
  StartAgent(std::move(options));
  std::unique_ptr<v1::RdmaAgent::Stub> stub = fixture_->NewStub();
  auto process = Register(*stub, v1::LIFETIME_CLIENT_PROCESS);
  ASSERT_TRUE(process.ok()) << process.status();
  // What it got instead, said in the answer and in the listing.
  EXPECT_EQ(process->lifetime(), v1::LIFETIME_CLIENT_CONNECTION);
  EXPECT_EQ(Find(process->buffer_id())->lifetime(),
            v1::LIFETIME_CLIENT_CONNECTION);
  stub.reset();
  EXPECT_TRUE(Eventually([&] { return Gone(process->buffer_id()); }));
}

TEST_F(RegistrationLifetimeTest, PidfdOpenAloneWatchesAKilledProcess) {
  AgentOptions options;
  options.process_watch.peer_pidfd = false;  // as on Linux before 6.5
  StartAgent(std::move(options));
  auto worker = WorkerProcess::Start(fixture_->agent().target(),
                                     fixture_->agent().attach_socket_path(),
                                     WorkerProcess::Options());
  ASSERT_TRUE(worker.ok()) << worker.status();
  auto bound = worker->CallWords("allocate 4096 3 process");
  auto kept = worker->CallWords("attach 4096 3 agent");
  ASSERT_TRUE(bound.ok() && kept.ok());
  uint64_t bound_id = 0, kept_id = 0;
  ASSERT_TRUE(bound->size() >= 2 && absl::SimpleAtoi((*bound)[1], &bound_id))
      << absl::StrJoin(*bound, " ");
  ASSERT_TRUE(kept->size() >= 2 && absl::SimpleAtoi((*kept)[1], &kept_id));
  auto info = Find(bound_id);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->lifetime(), v1::LIFETIME_CLIENT_PROCESS);
  EXPECT_EQ(info->owner_pid(), static_cast<uint32_t>(worker->process().pid()));

  worker->process().Signal(SIGKILL);
  EXPECT_TRUE(Eventually([&] { return Gone(bound_id); }));
  EXPECT_FALSE(Gone(kept_id));
}

// Open fds of this process (the agent runs in it).
int OpenFds() {
  int count = 0;
  if (DIR* dir = ::opendir("/proc/self/fd")) {
    while (::readdir(dir) != nullptr) ++count;
    ::closedir(dir);
  }
  return count;
}

TEST_F(RegistrationLifetimeTest, AProcessWatchEndsWithItsLastRegistration) {
  std::unique_ptr<v1::RdmaAgent::Stub> stub = fixture_->NewStub();
  auto warm_up = Register(*stub, v1::LIFETIME_AGENT);  // connects
  ASSERT_TRUE(warm_up.ok()) << warm_up.status();
  ASSERT_TRUE(Release(warm_up->buffer_id()).ok());
  const int before = OpenFds();
  auto a = Register(*stub, v1::LIFETIME_CLIENT_PROCESS);
  auto b = Register(*stub, v1::LIFETIME_CLIENT_PROCESS);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(OpenFds(), before + 3) << "a memfd each, one pidfd for both";
  ASSERT_TRUE(Release(a->buffer_id()).ok());
  EXPECT_EQ(OpenFds(), before + 2) << "the watch stays for b";
  ASSERT_TRUE(Release(b->buffer_id()).ok());
  EXPECT_EQ(OpenFds(), before) << "nothing bound: the pidfd is closed";
}

TEST_F(RegistrationLifetimeTest, WatchQuotaCountsClientsNotRegistrations) {
  AgentOptions options;
  options.quotas.watched_clients.per_user = 1;
  StartAgent(std::move(options));
  std::unique_ptr<v1::RdmaAgent::Stub> first = fixture_->NewStub();
  std::unique_ptr<v1::RdmaAgent::Stub> second = fixture_->NewStub();
  // One process, two connections: one watch.
  auto a = Register(*first, v1::LIFETIME_CLIENT_PROCESS);
  auto b = Register(*second, v1::LIFETIME_CLIENT_PROCESS);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  // A connection is a second client to watch: over the quota, refused
  // before anything is allocated.
  auto refused = Register(*first, v1::LIFETIME_CLIENT_CONNECTION);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("--max_watched_clients_per_user"));
  EXPECT_EQ(Listed().size(), 2u);
  // Agent lifetime needs no watch.
  EXPECT_TRUE(Register(*first, v1::LIFETIME_AGENT).ok());

  // Once the process has nothing bound any more, its watch makes room.
  ASSERT_TRUE(Release(a->buffer_id()).ok());
  ASSERT_TRUE(Release(b->buffer_id()).ok());
  auto connection = Register(*first, v1::LIFETIME_CLIENT_CONNECTION);
  EXPECT_TRUE(connection.ok()) << connection.status();
}

}  // namespace
}  // namespace rdma_agent

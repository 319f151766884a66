// RingSessions' admission of sessions, driven over socket pairs with
// chosen peer credentials (two users without a second real one): the
// per-user and total session bounds are counted before the memfd exists
// and given back when a session ends, with the attach connection's place
// the session kept; sessions are served by the fixed ring threads, none
// started per session.
#include "daemon/ops/ring_sessions.h"

#include <sys/socket.h>

#include <memory>
#include <vector>

#include "common/fd_message.h"
#include "common/unique_fd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/eventually.h"

namespace rdma_agent {
namespace {

using ::rdma_agent::testing::Eventually;
using ::testing::HasSubstr;

class RingSessionsTest : public ::testing::Test {
 protected:
  RingSessionsTest()
      : calls_(InFlightLimits{}),
        bytes_(ResourceQuota::Create("registered bytes", "per_user", "total",
                                     {uint64_t{1} << 30, uint64_t{1} << 30})),
        connections_(ResourceQuota::Create("attach connections", "per_user",
                                           "total", {16, 16})) {
    RingLimits limits;
    limits.max_sessions_per_user = 2;
    limits.max_sessions = 3;
    limits.threads = 2;
    // No batch runs here: no transfer table or prepared transfers needed.
    auto rings = RingSessions::Start(limits, OpBatchEnvironment{}, &calls_,
                                     bytes_, nullptr, nullptr);
    EXPECT_TRUE(rings.ok()) << rings.status();
    rings_ = std::move(*rings);
  }

  // Opens a ring of 4 entries as `uid`, the way the attach server hands a
  // connection over (with its place in the connection quota): the agent's
  // answer (OK with the memfd, or its refusal). The session, if any, stays
  // open until the test closes it.
  absl::Status Open(uid_t uid) {
    int fds[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
    clients_.emplace_back(fds[0]);
    PeerCredentials peer;
    peer.uid = uid;
    peer.pid = 1000 + static_cast<pid_t>(uid);
    auto charge = connections_->Reserve(uid, 1);
    EXPECT_TRUE(charge.ok()) << charge.status();
    v1::OpenRing request;
    request.set_entries(4);
    // Returns once answered: the session is served by a ring thread.
    rings_->Open(UniqueFd(fds[1]), std::move(*charge), peer, request);
    v1::AttachResponse response;
    auto memfd = ReceiveFdMessage(clients_.back().get(), &response);
    if (!memfd.ok()) return memfd.status();
    if (response.code() != 0) {
      return absl::Status(static_cast<absl::StatusCode>(response.code()),
                          response.message());
    }
    EXPECT_TRUE(memfd->valid());
    return absl::OkStatus();
  }

  // Closes session `i` (the client hangs up) and waits for its end.
  void Close(size_t i, int64_t left) {
    clients_[i].reset();
    EXPECT_TRUE(Eventually([&] { return rings_->open() == left; }));
  }

  ActiveCalls calls_;
  std::shared_ptr<ResourceQuota> bytes_;
  std::shared_ptr<ResourceQuota> connections_;
  std::unique_ptr<RingSessions> rings_;
  std::vector<UniqueFd> clients_;
};

TEST_F(RingSessionsTest, SessionsAreBoundedPerUserAndInTotal) {
  ASSERT_TRUE(Open(501).ok());
  ASSERT_TRUE(Open(501).ok());
  const uint64_t two_rings = bytes_->used(501);
  const absl::Status third = Open(501);
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted) << third;
  EXPECT_THAT(third.message(), HasSubstr("--max_ring_sessions_per_user"));
  EXPECT_THAT(third.message(), HasSubstr("open ring"));
  // Refused before its memfd was created: nothing more charged.
  EXPECT_EQ(bytes_->used(501), two_rings);

  // Another user has room of its own, until the total is reached.
  ASSERT_TRUE(Open(502).ok());
  const absl::Status fourth = Open(502);
  EXPECT_EQ(fourth.code(), absl::StatusCode::kResourceExhausted) << fourth;
  EXPECT_THAT(fourth.message(), HasSubstr("--max_ring_sessions)"));
  EXPECT_EQ(bytes_->used(502), two_rings / 2);
  EXPECT_EQ(rings_->open(), 3);
  // Listed by user: each sees its own; unset, everyone's.
  ASSERT_EQ(rings_->List(501).size(), 2u);
  EXPECT_EQ(rings_->List(501)[0].entries, 4u);
  EXPECT_EQ(rings_->List(501)[0].pid, 1501);
  ASSERT_EQ(rings_->List(502).size(), 1u);
  EXPECT_EQ(rings_->List(502)[0].uid, 502u);
  EXPECT_EQ(rings_->List(std::nullopt).size(), 3u);

  // A session's end gives its place back, its memory's charge and its
  // connection's place in the attach-connection quota.
  EXPECT_EQ(connections_->used(501), 2u);  // the refused one's went back
  Close(0, 2);
  EXPECT_EQ(bytes_->used(501), two_rings / 2);
  EXPECT_EQ(connections_->used(501), 1u);
  EXPECT_TRUE(Open(502).ok());
}

TEST_F(RingSessionsTest, ShutdownEndsEverySessionAndRefusesNewOnes) {
  ASSERT_TRUE(Open(501).ok());
  ASSERT_TRUE(Open(501).ok());
  ASSERT_TRUE(Open(502).ok());
  rings_->Shutdown(absl::UnavailableError("the agent is shutting down"));
  // Ended on every thread and the threads joined: nothing is held.
  EXPECT_EQ(rings_->open(), 0);
  EXPECT_EQ(bytes_->used(501), 0u);
  EXPECT_EQ(connections_->used(501), 0u);
  EXPECT_EQ(connections_->used(502), 0u);
  // Each client sees its connection close.
  for (const UniqueFd& client : clients_) {
    char byte;
    EXPECT_EQ(::recv(client.get(), &byte, 1, 0), 0);
  }
  const absl::Status refused = Open(503);
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("shutting down"));
}

}  // namespace
}  // namespace rdma_agent

// RingSessions' admission of sessions, driven over socket pairs with
// chosen peer credentials (two users without a second real one): the
// per-user and total session bounds are counted before the memfd exists
// and given back when a session ends.
#include "daemon/ops/ring_sessions.h"

#include <sys/socket.h>

#include <memory>
#include <thread>
#include <vector>

#include "common/fd_message.h"
#include "common/unique_fd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rdma_agent {
namespace {

using ::testing::HasSubstr;

class RingSessionsTest : public ::testing::Test {
 protected:
  RingSessionsTest()
      : calls_(InFlightLimits{}),
        bytes_(ResourceQuota::Create("registered bytes", "per_user", "total",
                                     {uint64_t{1} << 30, uint64_t{1} << 30})) {
    RingLimits limits;
    limits.max_sessions_per_user = 2;
    limits.max_sessions = 3;
    // No batch runs here: no transfer table or prepared transfers needed.
    rings_ = std::make_unique<RingSessions>(limits, OpBatchEnvironment{},
                                            &calls_, bytes_, nullptr, nullptr);
  }

  ~RingSessionsTest() override {
    rings_->Shutdown(absl::CancelledError("test over"));
    for (Session& session : sessions_) {
      ::shutdown(session.client.get(), SHUT_RDWR);
      session.server.join();
    }
  }

  struct Session {
    UniqueFd client;
    std::thread server;
  };

  // Opens a ring of 4 entries as `uid`: the agent's answer (OK with the
  // memfd, or its refusal). The session, if any, stays open until the test
  // closes it.
  absl::Status Open(uid_t uid) {
    int fds[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
    Session& session = sessions_.emplace_back();
    session.client = UniqueFd(fds[0]);
    PeerCredentials peer;
    peer.uid = uid;
    peer.pid = 1000 + static_cast<pid_t>(uid);
    session.server = std::thread([this, fd = fds[1], peer] {
      UniqueFd owned(fd);
      v1::OpenRing request;
      request.set_entries(4);
      rings_->Serve(owned.get(), peer, request);
    });
    v1::AttachResponse response;
    auto memfd = ReceiveFdMessage(session.client.get(), &response);
    if (!memfd.ok()) return memfd.status();
    if (response.code() != 0) {
      return absl::Status(static_cast<absl::StatusCode>(response.code()),
                          response.message());
    }
    EXPECT_TRUE(memfd->valid());
    return absl::OkStatus();
  }

  // Closes session `i` (the client hangs up) and waits for its end.
  void Close(size_t i) {
    ::shutdown(sessions_[i].client.get(), SHUT_RDWR);
    sessions_[i].server.join();
    sessions_[i].server = std::thread([] {});
  }

  ActiveCalls calls_;
  std::shared_ptr<ResourceQuota> bytes_;
  std::unique_ptr<RingSessions> rings_;
  std::vector<Session> sessions_;
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

  // A session's end gives its place back.
  Close(0);
  EXPECT_EQ(rings_->open(), 2);
  EXPECT_TRUE(Open(502).ok());
}

}  // namespace
}  // namespace rdma_agent

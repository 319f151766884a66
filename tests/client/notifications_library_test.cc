// The C++ client's notification API between two rdma-agentd processes over
// tcp: Submit and SubmitAsync with a notification report its delivery, and
// the target buffer's owner receives it through WatchNotifications (on the
// watch's thread, in order) or GetNotifications (long poll), with the bytes
// already in its buffer.

#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/rdma_agent_client.h"
#include "gtest/gtest.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/pattern.h"

namespace rdma_agent::testing {
namespace {

namespace v1 = ::rdma::agent::v1;
using client::Notification;
using client::OpSpec;
using client::SubmitOptions;

AgentProcess::Options TcpAgent() {
  AgentProcess::Options options;
  options.backends = "memory,tcp";
  return options;
}

class NotificationsLibraryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto a = AgentProcess::Start(TcpAgent());
    ASSERT_TRUE(a.ok()) << a.status();
    a_ = std::move(*a);
    auto b = AgentProcess::Start(TcpAgent());
    ASSERT_TRUE(b.ok()) << b.status();
    b_ = std::move(*b);
  }

  static OpSpec Write(const client::Buffer& local, uint64_t length,
                      const client::Buffer& remote, uint64_t remote_offset) {
    OpSpec op;
    op.type = v1::OP_TYPE_WRITE_FROM_LOCAL;
    op.local_buffer_id = local.id();
    op.length = length;
    op.remote_context = remote.remote_context();
    op.remote_offset = remote_offset;
    return op;
  }

  std::unique_ptr<AgentProcess> a_;
  std::unique_ptr<AgentProcess> b_;
};

TEST_F(NotificationsLibraryTest, WatchAndPollReceiveAfterTheBytes) {
  constexpr uint64_t kSize = 1 << 20;
  auto local = a_->client().Attach(kSize, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(local.ok()) << local.status();
  auto remote = b_->client().Attach(kSize, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(remote.ok()) << remote.status();
  FillPattern(local->bytes(), 5);
  FillPattern(remote->bytes(), 6);
  auto a_info = a_->client().GetInfo();
  ASSERT_TRUE(a_info.ok());

  // The owner watches; each callback checks the bytes the notification
  // announces.
  absl::Mutex mu;
  std::vector<std::string> seen;
  std::vector<bool> bytes_there;
  auto watch = b_->client().WatchNotifications(
      [&](const Notification* notification, uint64_t dropped) {
        ASSERT_NE(notification, nullptr);
        EXPECT_EQ(dropped, 0u);
        const uint64_t offset = std::stoull(notification->data);
        const bool there =
            !FindMismatch(remote->bytes().subspan(offset, 4096), 5, 0)
                 .has_value();
        absl::MutexLock lock(&mu);
        seen.push_back(notification->data);
        bytes_there.push_back(there);
        EXPECT_EQ(notification->from_agent_id, a_info->agent_id());
        EXPECT_EQ(notification->buffer_id, remote->id());
      });
  ASSERT_TRUE(watch.ok()) << watch.status();
  absl::SleepFor(absl::Milliseconds(200));  // the stream opens

  for (uint64_t offset : {0ull, 65536ull, 131072ull}) {
    SubmitOptions options;
    options.timeout = absl::Seconds(20);
    options.notification = std::to_string(offset);
    auto submitted =
        a_->client().Submit({Write(*local, 4096, *remote, offset)}, options);
    ASSERT_TRUE(submitted.ok()) << submitted.status();
    ASSERT_TRUE(submitted->results[0].status.ok())
        << submitted->results[0].status;
    ASSERT_EQ(submitted->notifications.size(), 1u);
    EXPECT_TRUE(submitted->notifications[0].status.ok())
        << submitted->notifications[0].status;
    EXPECT_EQ(submitted->notifications[0].backend, "tcp");
  }
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (absl::Now() < until) {
    absl::MutexLock lock(&mu);
    if (seen.size() >= 3) break;
    mu.AwaitWithTimeout(
        absl::Condition(
            +[](std::vector<std::string>* s) { return s->size() >= 3; }, &seen),
        absl::Milliseconds(100));
  }
  watch->Stop();
  EXPECT_EQ(watch->status().code(), absl::StatusCode::kCancelled);
  absl::MutexLock lock(&mu);
  EXPECT_EQ(seen, (std::vector<std::string>{"0", "65536", "131072"}));
  EXPECT_EQ(bytes_there, (std::vector<bool>{true, true, true}));
}

TEST_F(NotificationsLibraryTest, AsyncTransferAndLongPoll) {
  auto local = a_->client().Attach(8192, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(local.ok()) << local.status();
  auto remote = b_->client().Attach(8192, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(remote.ok()) << remote.status();
  FillPattern(local->bytes(), 8);
  SubmitOptions options;
  options.notification = "async";
  auto transfer =
      a_->client().SubmitAsync({Write(*local, 100, *remote, 10)}, options);
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  auto batch = b_->client().GetNotifications(absl::Seconds(20));
  ASSERT_TRUE(batch.ok()) << batch.status();
  ASSERT_EQ(batch->notifications.size(), 1u);
  EXPECT_EQ(batch->notifications[0].data, "async");
  EXPECT_EQ(batch->notifications[0].sequence, 1u);
  EXPECT_GT(batch->notifications[0].receive_time, absl::UnixEpoch());
  EXPECT_EQ(FindMismatch(remote->bytes().subspan(10, 100), 8, 0), std::nullopt);
  auto end = transfer->Wait(absl::Seconds(20));
  ASSERT_TRUE(end.ok()) << end.status();
  ASSERT_EQ(end->notifications.size(), 1u);
  EXPECT_TRUE(end->notifications[0].status.ok());
  EXPECT_EQ(end->notifications[0].buffer_id, remote->id());
  // Nothing else is queued: the poll returns empty at its wait.
  batch = b_->client().GetNotifications(absl::Milliseconds(50));
  ASSERT_TRUE(batch.ok());
  EXPECT_TRUE(batch->notifications.empty());
}

}  // namespace
}  // namespace rdma_agent::testing

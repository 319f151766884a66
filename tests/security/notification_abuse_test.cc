// Notifications against real rdma-agentd processes: who may send one, how
// many one batch sends, what sending many costs in connections, and what
// notifications nobody reads cost the receiving agent.
//  - A holder of a READ-only context cannot notify the owner (a raw kNotify
//    is refused PERMISSION_DENIED; a Submit reports the same), nothing
//    reaches the owner.
//  - One Submit carrying many copies of one context (the agent id in each
//    copy changed: the serving agent never checks it) notifies once.
//  - Many notified Submits to one peer share a few connections (counted in
//    /proc/PID/net/tcp, TIME_WAIT included), and every notification arrives.
//  - A user whose WatchNotifications streams never read cannot make the
//    agent hold more than the notification byte budget; the drop is
//    reported.

#include <sys/resource.h>

#include <fstream>
#include <iostream>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "backends/tcp/wire.h"
#include "client/rdma_agent_client.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "rdma/agent/v1/agent.grpc.pb.h"
#include "rdma/agent/v1/remote_buffer.pb.h"
#include "tests/security/raw_data_peer.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/eventually.h"
#include "tests/testing/process.h"

namespace rdma_agent::testing {
namespace {

namespace v1 = ::rdma::agent::v1;
using tcp::RequestHeader;
using tcp::RequestKind;

constexpr int64_t kMiB = 1 << 20;

v1::RemoteBuffer Parse(const std::string& context) {
  v1::RemoteBuffer remote;
  EXPECT_TRUE(remote.ParseFromString(context));
  return remote;
}

// A kNotify naming `remote`'s buffer with its token, claiming to come from
// `from`.
std::string RawNotify(const v1::RemoteBuffer& remote, absl::string_view from,
                      absl::string_view data) {
  const std::string payload = tcp::EncodeNotification(from, data);
  RequestHeader header;
  header.kind = RequestKind::kNotify;
  header.request_id = 1;
  header.epoch = remote.agent_epoch();
  header.buffer_id = remote.buffer_id();
  header.length = payload.size();
  header.token_bytes = static_cast<uint32_t>(remote.token().size());
  return RawDataConnection::Request(header, remote.token(), payload);
}

client::OpSpec Op(v1::OpType type, uint64_t local_id, uint64_t offset,
                  uint64_t length, std::string context) {
  client::OpSpec op;
  op.type = type;
  op.local_buffer_id = local_id;
  op.local_offset = offset;
  op.length = length;
  op.remote_context = std::move(context);
  op.remote_offset = offset;
  return op;
}

// TCP sockets in `pid`'s network namespace whose remote port is `port`, in
// any state (TIME_WAIT ones, which no process holds, included): the
// connections made to that port that still occupy an ephemeral port.
int SocketsToPort(pid_t pid, uint16_t port) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/net/tcp"));
  std::string line;
  std::getline(in, line);  // the heading
  int count = 0;
  while (std::getline(in, line)) {
    std::vector<std::string> fields =
        absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (fields.size() < 3) continue;
    const std::vector<std::string> remote = absl::StrSplit(fields[2], ':');
    uint32_t remote_port = 0;
    if (remote.size() == 2 && absl::SimpleHexAtoi(remote[1], &remote_port) &&
        remote_port == port) {
      ++count;
    }
  }
  return count;
}

class NotificationAbuseTest : public ::testing::Test {
 protected:
  void TearDown() override {
    if (HasFailure()) {
      if (owner_) ADD_FAILURE() << "owner agent's log:\n" << owner_->Log();
      if (sender_) ADD_FAILURE() << "sender agent's log:\n" << sender_->Log();
    }
    owner_.reset();
    sender_.reset();
  }

  void StartAgents(std::vector<std::string> owner_flags = {}) {
    auto owner = AgentProcess::Start(
        TcpAgentOptions("127.0.0.1", "", std::move(owner_flags)));
    ASSERT_TRUE(owner.ok()) << owner.status();
    owner_ = std::move(*owner);
    auto sender = AgentProcess::Start(TcpAgentOptions());
    ASSERT_TRUE(sender.ok()) << sender.status();
    sender_ = std::move(*sender);
  }

  // Everything queued for the owner's user within `wait` (then, once some
  // came, whatever follows within a short grace).
  std::vector<client::Notification> OwnerNotifications(absl::Duration wait,
                                                       uint64_t* dropped) {
    std::vector<client::Notification> all;
    absl::Duration next_wait = wait;
    while (true) {
      auto batch = owner_->client().GetNotifications(next_wait);
      EXPECT_TRUE(batch.ok()) << batch.status();
      if (!batch.ok()) return all;
      if (dropped != nullptr) *dropped += batch->dropped;
      if (batch->notifications.empty()) return all;
      for (auto& notification : batch->notifications) {
        all.push_back(std::move(notification));
      }
      next_wait = absl::Milliseconds(500);
    }
  }

  std::unique_ptr<AgentProcess> owner_;
  std::unique_ptr<AgentProcess> sender_;
};

// The defect: the kNotify branch proved only the token (proof_only), so a
// READ-only context, handed out so that others may read, let its holder
// plant notifications with any sender id in the owner's queue.
TEST_F(NotificationAbuseTest, ReadOnlyContextHolderCannotNotify) {
  ASSERT_NO_FATAL_FAILURE(StartAgents());
  auto read_only = owner_->client().AllocateUnmapped(4096, v1::ACCESS_READ);
  ASSERT_TRUE(read_only.ok()) << read_only.status();
  const v1::RemoteBuffer remote = Parse(read_only->remote_context);

  auto raw = RawDataConnection::Dial(owner_->tcp_port());
  ASSERT_TRUE(raw.ok()) << raw.status();
  ASSERT_TRUE(raw->Send(RawNotify(remote, "forged-agent", "go")).ok());
  auto answer = raw->ReadAnswer(absl::Seconds(10));
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(answer->header.code,
            static_cast<uint32_t>(absl::StatusCode::kPermissionDenied))
      << "a READ-only context's raw kNotify was answered code "
      << answer->header.code << " \"" << answer->message << "\"";

  // Through a peer agent: the read succeeds, its notification does not.
  auto local = sender_->client().AllocateUnmapped(4096, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(local.ok()) << local.status();
  client::SubmitOptions options;
  options.timeout = absl::Seconds(10);
  options.notification = "read it";
  auto submitted =
      sender_->client().Submit({Op(v1::OP_TYPE_READ_INTO_LOCAL, local->id, 0,
                                   64, read_only->remote_context)},
                               options);
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  ASSERT_TRUE(submitted->results[0].status.ok())
      << submitted->results[0].status;
  ASSERT_EQ(submitted->notifications.size(), 1u);
  EXPECT_EQ(submitted->notifications[0].status.code(),
            absl::StatusCode::kPermissionDenied)
      << submitted->notifications[0].status;

  const std::vector<client::Notification> received =
      OwnerNotifications(absl::Seconds(1), nullptr);
  EXPECT_TRUE(received.empty())
      << received.size() << " notifications reached the owner, the first from "
      << received[0].from_agent_id << ": " << received[0].data;

  // A WRITE-capable context still notifies.
  auto writable =
      owner_->client().AllocateUnmapped(4096, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(writable.ok()) << writable.status();
  submitted =
      sender_->client().Submit({Op(v1::OP_TYPE_WRITE_FROM_LOCAL, local->id, 0,
                                   64, writable->remote_context)},
                               options);
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  ASSERT_EQ(submitted->notifications.size(), 1u);
  EXPECT_TRUE(submitted->notifications[0].status.ok())
      << submitted->notifications[0].status;
  const std::vector<client::Notification> good =
      OwnerNotifications(absl::Seconds(5), nullptr);
  ASSERT_EQ(good.size(), 1u);
  EXPECT_EQ(good[0].data, "read it");
  EXPECT_EQ(good[0].buffer_id, writable->id);
}

// The defect: the plan told notifications apart by the contexts' agent ids,
// which the serving agent never checks, so copies of one context each
// naming another agent id sent one notification each.
TEST_F(NotificationAbuseTest, CopiesOfOneContextNotifyOnce) {
  ASSERT_NO_FATAL_FAILURE(StartAgents());
  auto target =
      owner_->client().AllocateUnmapped(1 << 20, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(target.ok()) << target.status();
  auto local =
      sender_->client().AllocateUnmapped(1 << 20, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(local.ok()) << local.status();
  const v1::RemoteBuffer original = Parse(target->remote_context);

  constexpr int kCopies = 64;
  std::vector<client::OpSpec> ops;
  for (int i = 0; i < kCopies; ++i) {
    v1::RemoteBuffer copy = original;
    // Every other copy claims another agent; the rest are byte for byte
    // the original.
    if (i % 2 == 1) copy.set_agent_id(absl::StrCat("copy-", i));
    ops.push_back(Op(v1::OP_TYPE_WRITE_FROM_LOCAL, local->id, i * 64, 64,
                     copy.SerializeAsString()));
  }
  client::SubmitOptions options;
  options.timeout = absl::Seconds(20);
  options.notification = "once";
  auto submitted = sender_->client().Submit(ops, options);
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  for (const auto& result : submitted->results) {
    ASSERT_TRUE(result.status.ok()) << result.status;
  }
  EXPECT_EQ(submitted->notifications.size(), 1u)
      << "one Submit with " << kCopies << " copies of one context sent "
      << submitted->notifications.size() << " notifications";

  const std::vector<client::Notification> received =
      OwnerNotifications(absl::Seconds(5), nullptr);
  EXPECT_EQ(received.size(), 1u)
      << "the owner received " << received.size() << " notifications";
}

// The defect: one new connection per notification. Many small notified
// Submits left a TIME_WAIT socket each, exhausting the ephemeral ports to
// that peer.
TEST_F(NotificationAbuseTest, ManyNotifiedSubmitsShareFewConnections) {
  ASSERT_NO_FATAL_FAILURE(StartAgents());
  auto target = owner_->client().AllocateUnmapped(4096, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(target.ok()) << target.status();
  constexpr int kThreads = 2;
  constexpr int kSubmitsPerThread = 150;
  const uint16_t port = owner_->tcp_port();
  const int before = SocketsToPort(sender_->pid(), port);

  std::vector<std::thread> threads;
  std::vector<std::string> failures(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto client = sender_->NewClient();
      if (!client.ok()) {
        failures[t] = client.status().ToString();
        return;
      }
      auto local = (*client)->AllocateUnmapped(4096, v1::ACCESS_READ_WRITE);
      if (!local.ok()) {
        failures[t] = local.status().ToString();
        return;
      }
      for (int i = 0; i < kSubmitsPerThread; ++i) {
        client::SubmitOptions options;
        options.timeout = absl::Seconds(10);
        options.notification = absl::StrCat("n-", t, "-", i);
        auto submitted =
            (*client)->Submit({Op(v1::OP_TYPE_WRITE_FROM_LOCAL, local->id, t, 1,
                                  target->remote_context)},
                              options);
        if (!submitted.ok() || !submitted->results[0].status.ok() ||
            submitted->notifications.size() != 1 ||
            !submitted->notifications[0].status.ok()) {
          failures[t] = absl::StrCat(
              "submit ", i, ": ",
              submitted.ok()
                  ? submitted->notifications.empty()
                        ? submitted->results[0].status.ToString()
                        : submitted->notifications[0].status.ToString()
                  : submitted.status().ToString());
          return;
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (const std::string& failure : failures) EXPECT_EQ(failure, "");
  const int sockets = SocketsToPort(sender_->pid(), port);
  // Data connections (one per concurrent Submit, pooled) and the
  // notification connections (--tcp_notify_connections_per_peer, 2).
  std::cout << kThreads * kSubmitsPerThread
            << " notified Submits: " << sockets - before
            << " sockets to the peer's data port\n";
  EXPECT_LE(sockets - before, 10)
      << kThreads * kSubmitsPerThread << " notified Submits left " << sockets
      << " sockets to the peer's data port";

  uint64_t dropped = 0;
  std::set<std::string> seen;
  Eventually(
      [&] {
        for (const auto& notification :
             OwnerNotifications(absl::Milliseconds(200), &dropped)) {
          seen.insert(notification.data);
        }
        return seen.size() >= kThreads * kSubmitsPerThread;
      },
      absl::Seconds(20));
  EXPECT_EQ(seen.size(), static_cast<size_t>(kThreads * kSubmitsPerThread));
  EXPECT_EQ(dropped, 0u);
}

// The defect: each open WatchNotifications stream kept its own copy of up to
// --max_notifications_per_user notifications with no bound in bytes, so one
// user's unread streams made the agent hold hundreds of MiB.
TEST_F(NotificationAbuseTest, UnreadNotificationsStayWithinTheByteBudget) {
  constexpr int64_t kNotificationBytes = 64 << 10;
  constexpr int kStreams = 16;
  constexpr int kNotifications = 300;
  auto owner = AgentProcess::Start(TcpAgentOptions(
      "127.0.0.1", "",
      {absl::StrCat("--max_notification_bytes=", kNotificationBytes)}));
  ASSERT_TRUE(owner.ok()) << owner.status();
  owner_ = std::move(*owner);
  const pid_t pid = owner_->pid();
  auto target = owner_->client().AllocateUnmapped(4096, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(target.ok()) << target.status();
  auto local = owner_->client().AllocateUnmapped(4096, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(local.ok()) << local.status();

  // Streams this user opens and never reads.
  auto channel =
      grpc::CreateChannel(owner_->target(), grpc::InsecureChannelCredentials());
  auto stub = v1::RdmaAgent::NewStub(channel);
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientReader<v1::NotificationEvent>>>
      streams;
  for (int i = 0; i < kStreams; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    streams.push_back(stub->WatchNotifications(contexts.back().get(), {}));
  }
  // Warm up: the Submit path's own allocations are made before measuring.
  client::SubmitOptions options;
  options.timeout = absl::Seconds(10);
  for (int i = 0; i < 4; ++i) {
    options.notification = std::string(kNotificationBytes, 'w');
    auto warm =
        owner_->client().Submit({Op(v1::OP_TYPE_WRITE_FROM_LOCAL, local->id, 0,
                                    1, target->remote_context)},
                                options);
    ASSERT_TRUE(warm.ok()) << warm.status();
  }
  const int64_t rss_before = ProcessStatusBytes(pid, "VmRSS");
  ASSERT_GT(rss_before, 0);

  for (int i = 0; i < kNotifications; ++i) {
    options.notification = std::string(kNotificationBytes, 'a' + i % 26);
    auto submitted =
        owner_->client().Submit({Op(v1::OP_TYPE_WRITE_FROM_LOCAL, local->id, 0,
                                    1, target->remote_context)},
                                options);
    ASSERT_TRUE(submitted.ok()) << submitted.status();
    ASSERT_EQ(submitted->notifications.size(), 1u);
    ASSERT_TRUE(submitted->notifications[0].status.ok())
        << submitted->notifications[0].status;
  }
  const int64_t grown = ProcessStatusBytes(pid, "VmRSS") - rss_before;
  // The default budget is 8 MiB per user; gRPC holds about one message per
  // unread stream besides.
  EXPECT_LT(grown, 48 * kMiB)
      << kStreams << " unread streams and " << kNotifications
      << " notifications of " << kNotificationBytes / 1024
      << " KiB grew the agent's RSS by " << grown / kMiB << " MiB";

  std::cout << kStreams << " unread streams, " << kNotifications
            << " notifications of " << kNotificationBytes / 1024
            << " KiB: agent RSS grew by " << grown / kMiB << " MiB\n";

  // The streams go. With none open, notifications queue for GetNotifications
  // under the same budget, and what is dropped is reported.
  for (auto& context : contexts) context->TryCancel();
  for (auto& stream : streams) (void)stream->Finish();
  streams.clear();
  const auto notify = [&](char fill) {
    options.notification = std::string(kNotificationBytes, fill);
    auto submitted =
        owner_->client().Submit({Op(v1::OP_TYPE_WRITE_FROM_LOCAL, local->id, 0,
                                    1, target->remote_context)},
                                options);
    return submitted.ok() && submitted->notifications.size() == 1 &&
           submitted->notifications[0].status.ok();
  };
  // Once the agent has let go of the streams, a notification reaches the
  // queue.
  ASSERT_TRUE(Eventually(
      [&] {
        if (!notify('p')) return false;
        return !OwnerNotifications(absl::Milliseconds(100), nullptr).empty();
      },
      absl::Seconds(10)));
  (void)OwnerNotifications(absl::Milliseconds(100), nullptr);
  constexpr int kQueued = 200;  // 12.5 MiB: more than the 8 MiB budget
  for (int i = 0; i < kQueued; ++i) ASSERT_TRUE(notify('a' + i % 26));
  uint64_t dropped = 0;
  const std::vector<client::Notification> kept =
      OwnerNotifications(absl::Seconds(2), &dropped);
  EXPECT_GT(dropped, 0u) << "the drops were not reported";
  EXPECT_EQ(kept.size() + dropped, static_cast<size_t>(kQueued));
  EXPECT_LE(static_cast<int64_t>(kept.size()) * kNotificationBytes, 8 * kMiB)
      << kept.size() << " notifications kept";
  EXPECT_GT(kept.size(), 0u);
  // The newest were kept.
  ASSERT_FALSE(kept.empty());
  EXPECT_EQ(kept.back().data[0], 'a' + (kQueued - 1) % 26);
}

}  // namespace
}  // namespace rdma_agent::testing

// NotifyClient against a real DataServer on loopback: notifications to one
// peer share a bounded set of pooled connections however many are sent at
// once, each arrives once, a connection the peer closed is replaced, and a
// refused notification's connection is not kept.
#include "backends/tcp/notify_client.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "backends/buffer_table.h"
#include "backends/notification_sink.h"
#include "backends/registration.h"
#include "backends/tcp/data_server.h"
#include "common/shared_memory.h"
#include "gtest/gtest.h"

namespace rdma_agent::tcp {
namespace {

constexpr uint64_t kEpoch = 5;

class CountingSink : public NotificationSink {
 public:
  explicit CountingSink(const BufferDirectory* directory)
      : directory_(directory) {}
  absl::Status Deliver(const ServeRequest& target, absl::string_view,
                       absl::string_view) override {
    auto registration = directory_->ResolveForNotification(target);
    if (!registration.ok()) return registration.status();
    delivered.fetch_add(1);
    return absl::OkStatus();
  }
  size_t max_bytes() const override { return 4096; }
  std::atomic<int> delivered{0};

 private:
  const BufferDirectory* const directory_;
};

class NotifyClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (auto [id, access] :
         {std::pair{1, v1::ACCESS_READ_WRITE}, std::pair{2, v1::ACCESS_READ}}) {
      auto memory = SharedMemory::Allocate(4096, "notify-client-test");
      ASSERT_TRUE(memory.ok()) << memory.status();
      directory_.Add(std::make_shared<Registration>(
          id, 0, access, "test", "token-" + std::to_string(id),
          std::move(*memory), true));
    }
    StartServer();
  }

  void StartServer() {
    DataServerOptions options;
    options.notifications = &sink_;
    auto server = DataServer::Start({"127.0.0.1", port_}, &directory_, options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    port_ = server_->port();
  }

  static ServeRequest Target(uint64_t id) {
    ServeRequest target;
    target.agent_epoch = kEpoch;
    target.buffer_id = id;
    target.token = "token-" + std::to_string(id);
    return target;
  }

  HostPort peer() const { return {"127.0.0.1", port_}; }

  BufferTable directory_{kEpoch};
  CountingSink sink_{&directory_};
  uint16_t port_ = 0;
  std::unique_ptr<DataServer> server_;
};

TEST_F(NotifyClientTest, ConcurrentNotificationsShareTheConnectionsPerPeer) {
  NotifyClientOptions options;
  options.connections_per_peer = 2;
  NotifyClient client(options, absl::Seconds(30), absl::Seconds(5));
  constexpr int kThreads = 8;
  constexpr int kEach = 25;
  std::atomic<int> failed{0};
  std::atomic<int> most_open{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kEach; ++i) {
        const absl::Status sent =
            client.Send(peer(), Target(1), "agent-a", "ready",
                        StopToken(absl::Now() + absl::Seconds(10)));
        if (!sent.ok()) failed.fetch_add(1);
        for (const auto& [key, open] : client.OpenConnectionsByPeer()) {
          int seen = most_open.load();
          while (open > seen && !most_open.compare_exchange_weak(seen, open)) {
          }
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(sink_.delivered.load(), kThreads * kEach);
  EXPECT_LE(most_open.load(), 2);
  EXPECT_LE(server_->connections(), 2u);
}

TEST_F(NotifyClientTest, AConnectionThePeerClosedIsReplaced) {
  NotifyClient client({}, absl::Seconds(30), absl::Seconds(5));
  const StopToken stop(absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(client.Send(peer(), Target(1), "a", "one", stop).ok());
  ASSERT_EQ(client.OpenConnectionsByPeer().size(), 1u);
  // The peer restarts on the same port: the pooled connection is dead.
  server_.reset();
  StartServer();
  EXPECT_TRUE(client.Send(peer(), Target(1), "a", "two", stop).ok());
  EXPECT_EQ(sink_.delivered.load(), 2);
}

TEST_F(NotifyClientTest, RefusedNotificationsKeepNoConnection) {
  NotifyClient client({}, absl::Seconds(30), absl::Seconds(5));
  const StopToken stop(absl::Now() + absl::Seconds(10));
  EXPECT_EQ(client.Send(peer(), Target(2), "a", "x", stop).code(),
            absl::StatusCode::kPermissionDenied);
  ServeRequest forged = Target(1);
  forged.token = "guess";
  EXPECT_EQ(client.Send(peer(), forged, "a", "x", stop).code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(client.OpenConnectionsByPeer().empty());
  EXPECT_EQ(sink_.delivered.load(), 0);
}

TEST_F(NotifyClientTest, IdleConnectionsExpire) {
  NotifyClient client({}, absl::Milliseconds(100), absl::Seconds(5));
  const StopToken stop(absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(client.Send(peer(), Target(1), "a", "one", stop).ok());
  absl::SleepFor(absl::Milliseconds(300));
  // Expired at the next notification, here one to a closed port.
  EXPECT_FALSE(client.Send({"127.0.0.1", 1}, Target(1), "a", "x", stop).ok());
  EXPECT_TRUE(client.OpenConnectionsByPeer().empty());
  EXPECT_TRUE(absl::Now() < stop.deadline());
}

}  // namespace
}  // namespace rdma_agent::tcp

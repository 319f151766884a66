// Cross-host tests of the TCP backend: two rdma-agentd processes in two
// network namespaces joined by veth, driven by the C++ client. Root only.

#include <atomic>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "rdma/agent/v1/remote_buffer.pb.h"
#include "tests/integration/netns.h"
#include "tests/integration/tcp_checks.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/pattern.h"

namespace rdma_agent::testing {
namespace {

using ::absl::StatusCode;

class TcpNetnsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Not root: fail loudly, never pass silently.
    ASSERT_TRUE(CheckNetnsPrivileges().ok()) << CheckNetnsPrivileges();
    auto pair = NetnsPair::Create();
    ASSERT_TRUE(pair.ok()) << pair.status();
    pair_ = std::move(*pair);
    for (int side = 0; side < 2; ++side) {
      auto agent = AgentProcess::Start(
          TcpAgentOptions(pair_->address(side), pair_->netns(side)));
      ASSERT_TRUE(agent.ok()) << agent.status();
      agents_[side] = std::move(*agent);
    }
  }

  void TearDown() override {
    if (HasFailure()) {
      for (auto& agent : agents_) {
        if (agent) ADD_FAILURE() << "agent log:\n" << agent->Log();
      }
    }
    // Agents first (they live in the namespaces), then the namespaces.
    agents_[0].reset();
    agents_[1].reset();
    pair_.reset();
  }

  client::AgentClient& a() { return agents_[0]->client(); }
  client::AgentClient& b() { return agents_[1]->client(); }

  std::unique_ptr<NetnsPair> pair_;
  std::unique_ptr<AgentProcess> agents_[2];
};

TEST_F(TcpNetnsTest, ContextsAdvertiseTheHostAddress) {
  auto buffer = b().Attach(4096, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  v1::RemoteBuffer context;
  ASSERT_TRUE(context.ParseFromString(buffer->remote_context()));
  bool found = false;
  for (const auto& endpoint : context.endpoints()) {
    if (endpoint.backend() != "tcp") continue;
    found = true;
    EXPECT_EQ(endpoint.tcp().host(), pair_->address(1));
    EXPECT_EQ(endpoint.tcp().port(), agents_[1]->tcp_port());
  }
  EXPECT_TRUE(found) << context.DebugString();
}

TEST_F(TcpNetnsTest, EveryByteOfEverySizeCrossesHosts) {
  constexpr uint64_t kMax = 256ull << 20;
  auto local = a().Attach(kMax + 64, v1::ACCESS_READ_WRITE, "sweep-local");
  ASSERT_TRUE(local.ok()) << local.status();
  auto remote = b().Attach(kMax + 64, v1::ACCESS_READ_WRITE, "sweep-remote");
  ASSERT_TRUE(remote.ok()) << remote.status();
  SweepSizes(a(), *local, *remote,
             {1, 2, 3, 4095, 65537, (1ull << 20) + 1, (17ull << 20) + 3, kMax});
}

TEST_F(TcpNetnsTest, ManyConcurrentClientsOnBothHosts) {
  constexpr int kClientsPerHost = 4;
  constexpr uint64_t kSlice = 2ull << 20;
  constexpr int kRounds = 6;
  // Each host exposes one buffer; every client owns a slice of the other's.
  auto shared_a = a().Attach(kClientsPerHost * kSlice, v1::ACCESS_READ_WRITE);
  auto shared_b = b().Attach(kClientsPerHost * kSlice, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(shared_a.ok() && shared_b.ok());
  const client::Buffer* shared[2] = {&*shared_b, &*shared_a};

  std::vector<std::thread> threads;
  std::vector<std::string> failures(2 * kClientsPerHost);
  for (int host = 0; host < 2; ++host) {
    for (int c = 0; c < kClientsPerHost; ++c) {
      threads.emplace_back([&, host, c] {
        std::string& failure = failures[host * kClientsPerHost + c];
        auto agent = agents_[host]->NewClient();
        if (!agent.ok()) {
          failure = agent.status().ToString();
          return;
        }
        auto local = (*agent)->Attach(2 * kSlice, v1::ACCESS_READ_WRITE);
        if (!local.ok()) {
          failure = local.status().ToString();
          return;
        }
        const uint8_t seed = static_cast<uint8_t>(10 + host * 10 + c);
        const uint64_t slice = c * kSlice;
        for (int round = 0; round < kRounds && failure.empty(); ++round) {
          FillPattern(local->bytes().subspan(0, kSlice), seed, round);
          auto results =
              (*agent)->Submit({MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL, *local, 0,
                                       kSlice, *shared[host], slice),
                                MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, *local,
                                       kSlice, kSlice, *shared[host], slice)},
                               absl::Seconds(60));
          if (!results.ok()) {
            failure = results.status().ToString();
          } else {
            for (const auto& result : *results) {
              if (!result.status.ok()) failure = result.status.ToString();
            }
          }
          // Ops of one Submit may run in any order: check the write landed
          // by reading it back in a second Submit.
          results =
              (*agent)->Submit({MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, *local,
                                       kSlice, kSlice, *shared[host], slice)},
                               absl::Seconds(60));
          if (!results.ok() || !(*results)[0].status.ok()) {
            failure = "read back failed";
          } else if (FindMismatch(local->bytes().subspan(kSlice, kSlice), seed,
                                  round)
                         .has_value()) {
            failure = absl::StrCat("round ", round, ": wrong bytes read back");
          }
        }
      });
    }
  }
  for (auto& thread : threads) thread.join();
  for (size_t i = 0; i < failures.size(); ++i) {
    EXPECT_TRUE(failures[i].empty()) << "client " << i << ": " << failures[i];
  }
}

TEST_F(TcpNetnsTest, KilledPeerFailsFastAndItsRestartIsDetected) {
  constexpr uint64_t kSize = 64ull << 20;
  constexpr uint64_t kGuard = 4096;
  constexpr int kOps = 64;  // 4 GiB in all: long enough to be cut short
  auto local = a().Attach(kSize + 2 * kGuard, v1::ACCESS_READ_WRITE, "local");
  auto remote = b().Attach(kSize, v1::ACCESS_READ_WRITE, "remote");
  ASSERT_TRUE(local.ok() && remote.ok());
  FillPattern(local->bytes(), 1);
  FillPattern(remote->bytes(), 2);
  const uint64_t remote_id = remote->id();

  std::vector<client::OpSpec> ops;
  for (int i = 0; i < kOps; ++i) {
    ops.push_back(
        MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, *local, kGuard, kSize, *remote, 0));
  }
  const absl::Duration timeout = absl::Seconds(60);
  absl::StatusOr<std::vector<client::OpResult>> results;
  std::atomic<bool> done{false};
  std::thread submit([&] {
    results = a().Submit(ops, timeout);
    done = true;
  });

  // Kill the peer once bytes are flowing (bounded wait).
  auto observer = agents_[1]->NewClient();
  ASSERT_TRUE(observer.ok());
  bool flowing = false;
  for (int i = 0; i < 3000 && !flowing && !done; ++i) {
    auto buffers = (*observer)->ListBuffers();
    if (buffers.ok()) {
      for (const auto& info : *buffers) {
        if (info.buffer_id() == remote_id && info.bytes_served() > 0) {
          flowing = true;
        }
      }
    }
    if (!flowing) absl::SleepFor(absl::Milliseconds(5));
  }
  observer->reset();
  ASSERT_TRUE(flowing) << "no bytes were served";
  const absl::Time killed = absl::Now();
  agents_[1]->Kill();
  submit.join();
  const absl::Duration after_kill = absl::Now() - killed;

  ASSERT_TRUE(results.ok()) << results.status();
  ASSERT_EQ(results->size(), ops.size());
  int unavailable = 0;
  for (const auto& result : *results) {
    if (result.status.code() == StatusCode::kUnavailable) {
      ++unavailable;
    } else {
      EXPECT_TRUE(result.status.ok()) << result.status;
    }
  }
  EXPECT_GT(unavailable, 0);
  EXPECT_LT(after_kill, absl::Seconds(10))
      << "not \"well before\" the " << timeout << " deadline";
  // The guards around the ops' range never changed.
  EXPECT_EQ(FindMismatch(local->bytes().subspan(0, kGuard), 1), std::nullopt);
  EXPECT_EQ(FindMismatch(local->bytes().subspan(kGuard + kSize, kGuard), 1,
                         kGuard + kSize),
            std::nullopt);

  // The local agent keeps serving: a same-host (memory) op.
  auto other = a().Attach(4096, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(other.ok()) << other.status();
  auto local_op = a().Submit(
      {MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL, *local, 0, 100, *other, 0)},
      absl::Seconds(10));
  ASSERT_TRUE(local_op.ok()) << local_op.status();
  EXPECT_TRUE((*local_op)[0].status.ok()) << (*local_op)[0].status;
  EXPECT_EQ((*local_op)[0].backend, "memory");

  // The restarted peer refuses the old context as stale...
  ASSERT_TRUE(agents_[1]->Restart().ok());
  FillPattern(local->bytes(), 1);
  auto stale = a().Submit({MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, *local, kGuard,
                                  1 << 20, *remote, 0)},
                          absl::Seconds(10));
  ASSERT_TRUE(stale.ok()) << stale.status();
  EXPECT_EQ((*stale)[0].status.code(), StatusCode::kFailedPrecondition)
      << (*stale)[0].status;
  ExpectLayout(*local, 1, 0, 0, 1, 0, "local after a stale op");

  // ...and serves a new one.
  auto fresh = b().Attach(kSize, v1::ACCESS_READ_WRITE, "fresh");
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  FillPattern(fresh->bytes(), 3);
  auto ok = a().Submit(
      {MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, *local, kGuard, kSize, *fresh, 0)},
      absl::Seconds(30));
  ASSERT_TRUE(ok.ok()) << ok.status();
  ASSERT_TRUE((*ok)[0].status.ok()) << (*ok)[0].status;
  ExpectLayout(*local, 1, kGuard, kSize, 3, 0, "local after the new peer");
}

TEST_F(TcpNetnsTest, ReleaseDuringTransferIsSafeOnBothSides) {
  constexpr uint64_t kSize = 64ull << 20;
  constexpr uint64_t kGuard = 4096;
  auto local = a().Attach(kSize + 2 * kGuard, v1::ACCESS_READ_WRITE);
  auto remote = b().Attach(kSize, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(local.ok() && remote.ok());
  FillPattern(local->bytes(), 1);
  FillPattern(remote->bytes(), 2);
  std::vector<client::OpSpec> ops;
  for (int i = 0; i < 64; ++i) {  // 4 GiB: still running when released
    ops.push_back(
        MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, *local, kGuard, kSize, *remote, 0));
  }
  absl::StatusOr<std::vector<client::OpResult>> results;
  std::atomic<bool> done{false};
  std::thread submit([&] {
    results = a().Submit(ops, absl::Seconds(60));
    done = true;
  });
  bool flowing = false;
  for (int i = 0; i < 3000 && !flowing && !done; ++i) {
    auto buffers = b().ListBuffers();
    if (buffers.ok()) {
      for (const auto& info : *buffers) {
        if (info.buffer_id() == remote->id() && info.bytes_served() > 0) {
          flowing = true;
        }
      }
    }
    if (!flowing) absl::SleepFor(absl::Milliseconds(5));
  }
  // Both sides drop their registration while ops on it are in flight.
  EXPECT_TRUE(remote->Release().ok());
  EXPECT_TRUE(local->Release().ok());
  submit.join();
  ASSERT_TRUE(flowing) << "no bytes were served";
  ASSERT_TRUE(results.ok()) << results.status();
  int refused = 0;
  for (const auto& result : *results) {
    // Served before the release reached the peer, or refused after it.
    if (result.status.code() == StatusCode::kNotFound) {
      ++refused;
    } else {
      EXPECT_TRUE(result.status.ok()) << result.status;
    }
  }
  EXPECT_GT(refused, 0);
  EXPECT_EQ(FindMismatch(local->bytes().subspan(0, kGuard), 1), std::nullopt);
  EXPECT_EQ(FindMismatch(local->bytes().subspan(kGuard + kSize, kGuard), 1,
                         kGuard + kSize),
            std::nullopt);
  // Both agents carry on.
  auto fresh_local = a().Attach(1 << 20, v1::ACCESS_READ_WRITE);
  auto fresh_remote = b().Attach(1 << 20, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(fresh_local.ok() && fresh_remote.ok());
  FillPattern(fresh_remote->bytes(), 5);
  auto after = a().Submit({MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, *fresh_local, 0,
                                  1 << 20, *fresh_remote, 0)},
                          absl::Seconds(10));
  ASSERT_TRUE(after.ok() && (*after)[0].status.ok());
  EXPECT_EQ(FindMismatch(fresh_local->bytes().subspan(0, 1 << 20), 5),
            std::nullopt);
}

TEST_F(TcpNetnsTest, LinkDownIsDeadlineExceededAndLinkUpRecovers) {
  constexpr uint64_t kSize = 16ull << 20;
  constexpr uint64_t kGuard = 4096;
  auto local = a().Attach(2 * kSize + 2 * kGuard, v1::ACCESS_READ_WRITE);
  auto remote = b().Attach(2 * kSize, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(local.ok() && remote.ok());
  FillPattern(local->bytes(), 1);
  FillPattern(remote->bytes(), 2);

  // Warm the connection pool, then cut the wire on the peer's side.
  auto warm = a().Submit(
      {MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, *local, kGuard, 1, *remote, 0)},
      absl::Seconds(10));
  ASSERT_TRUE(warm.ok() && (*warm)[0].status.ok());
  FillPattern(local->bytes().subspan(kGuard, 1), 1, kGuard);
  // The peer goes silent: its link is down and our side still knows its MAC,
  // so nothing fails fast (a failed ARP would be UNAVAILABLE instead).
  ASSERT_TRUE(pair_->PinNeighbour(0).ok()) << pair_->PinNeighbour(0);
  ASSERT_TRUE(pair_->SetLink(1, false).ok());

  const absl::Duration timeout = absl::Seconds(2);
  for (int attempt = 0; attempt < 2; ++attempt) {  // pooled, then fresh dial
    SCOPED_TRACE(absl::StrCat("attempt ", attempt));
    const absl::Time start = absl::Now();
    auto results = a().Submit(
        {MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, *local, kGuard, kSize, *remote, 0),
         MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL, *local, kGuard + kSize, kSize,
                *remote, kSize)},
        timeout);
    const absl::Duration took = absl::Now() - start;
    ASSERT_TRUE(results.ok()) << results.status();
    for (const auto& result : *results) {
      EXPECT_EQ(result.status.code(), StatusCode::kDeadlineExceeded)
          << result.status;
    }
    EXPECT_GE(took, timeout - absl::Milliseconds(50));
    EXPECT_LT(took, timeout + absl::Seconds(3));
    // Nothing landed locally, in or around the ranges.
    ExpectLayout(*local, 1, 0, 0, 1, 0, "local after link down");
  }

  ASSERT_TRUE(pair_->SetLink(1, true).ok());
  // Link back: a fresh connection carries the next Submit. The first attempt
  // after carrier returns may still race the link coming up: bounded retries.
  bool recovered = false;
  for (int attempt = 0; attempt < 20 && !recovered; ++attempt) {
    auto results = a().Submit({MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, *local,
                                      kGuard, kSize, *remote, 0)},
                              absl::Seconds(2));
    recovered = results.ok() && (*results)[0].status.ok();
  }
  ASSERT_TRUE(recovered);
  ExpectLayout(*local, 1, kGuard, kSize, 2, 0, "local after recovery");
}

}  // namespace
// A notification crosses hosts behind its bytes: when the owner on B has it,
// every byte of the batch is in its buffer (checked on the notification's
// own callback), and the bytes around the op's range are untouched.
TEST_F(TcpNetnsTest, NotificationArrivesAfterTheBytesItAnnounces) {
  constexpr uint64_t kLength = (17ull << 20) + 3;
  constexpr uint64_t kGuard = 4096;
  auto local = a().Attach(kLength, v1::ACCESS_READ_WRITE, "notify-local");
  auto remote =
      b().Attach(kLength + 2 * kGuard, v1::ACCESS_READ_WRITE, "notify-remote");
  ASSERT_TRUE(local.ok() && remote.ok());
  FillPattern(local->bytes(), 7);
  FillPattern(remote->bytes(), 8);
  absl::Mutex mu;
  int seen = 0;
  bool bytes_there = false;
  auto watch = b().WatchNotifications(
      [&](const client::Notification* notification, uint64_t) {
        ASSERT_NE(notification, nullptr);
        const bool there =
            !FindMismatch(remote->bytes().subspan(kGuard, kLength), 7, 0)
                 .has_value();
        absl::MutexLock lock(&mu);
        ++seen;
        bytes_there = there && notification->data == "landed";
      });
  ASSERT_TRUE(watch.ok());
  absl::SleepFor(absl::Milliseconds(200));  // the stream opens
  client::SubmitOptions options;
  options.timeout = absl::Seconds(60);
  options.notification = "landed";
  auto submitted = a().Submit({MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL, *local, 0,
                                      kLength, *remote, kGuard)},
                              options);
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  ASSERT_TRUE(submitted->results[0].status.ok())
      << submitted->results[0].status;
  ASSERT_EQ(submitted->notifications.size(), 1u);
  EXPECT_TRUE(submitted->notifications[0].status.ok())
      << submitted->notifications[0].status;
  {
    absl::MutexLock lock(&mu);
    mu.AwaitWithTimeout(absl::Condition(
                            +[](int* n) { return *n > 0; }, &seen),
                        absl::Seconds(20));
    EXPECT_EQ(seen, 1);
    EXPECT_TRUE(bytes_there);
  }
  watch->Stop();
  EXPECT_EQ(FindMismatch(remote->bytes().subspan(0, kGuard), 8, 0),
            std::nullopt);
  EXPECT_EQ(FindMismatch(remote->bytes().subspan(kGuard + kLength, kGuard), 8,
                         kGuard + kLength),
            std::nullopt);
}

// An initiating agent killed in the middle of a batch never notifies: the
// owner on B finds nothing, then or later.
TEST_F(TcpNetnsTest, KilledInitiatorNotifiesNothing) {
  constexpr uint64_t kSize = 64ull << 20;
  auto local = a().Attach(kSize, v1::ACCESS_READ_WRITE, "local");
  auto remote = b().Attach(kSize, v1::ACCESS_READ_WRITE, "remote");
  ASSERT_TRUE(local.ok() && remote.ok());
  const uint64_t remote_id = remote->id();
  std::vector<client::OpSpec> ops(
      64, MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL, *local, 0, kSize, *remote, 0));
  client::SubmitOptions options;
  options.timeout = absl::Seconds(60);
  options.notification = "never";
  std::thread submit([&] { (void)a().Submit(ops, options); });
  // Killed once bytes are flowing.
  bool flowing = false;
  for (int i = 0; i < 3000 && !flowing; ++i) {
    auto buffers = b().ListBuffers();
    if (buffers.ok()) {
      for (const auto& info : *buffers) {
        flowing = flowing ||
                  (info.buffer_id() == remote_id && info.bytes_served() > 0);
      }
    }
    if (!flowing) absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_TRUE(flowing) << "no bytes were served";
  agents_[0]->Kill();
  submit.join();
  auto batch = b().GetNotifications(absl::Seconds(2));
  ASSERT_TRUE(batch.ok()) << batch.status();
  EXPECT_TRUE(batch->notifications.empty());
  EXPECT_EQ(batch->dropped, 0u);
}

}  // namespace rdma_agent::testing

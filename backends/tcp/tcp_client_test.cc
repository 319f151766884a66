// The requesting half of the tcp data plane: cancellation, the hello check,
// uniform errors for unreachable peers, bounded threads and connections,
// the idle pool, lazy chunking and host names.

#include <sys/resource.h>

#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/notification.h"
#include "backends/buffer_table.h"
#include "backends/tcp/client_test_peer.h"
#include "backends/tcp/pool_probe.h"
#include "backends/tcp/tcp_backend.h"
#include "backends/testing/harness.h"
#include "common/shared_memory.h"
#include "common/stop_token.h"
#include "gtest/gtest.h"

namespace rdma_agent::tcp {
namespace {

using ::absl::StatusCode;
using ::rdma_agent::tcp::testing::ClosedPort;
using ::rdma_agent::tcp::testing::ContextFor;
using ::rdma_agent::tcp::testing::OpenFds;
using ::rdma_agent::tcp::testing::PoolProbe;
using ::rdma_agent::tcp::testing::ScriptedPeer;
using ::rdma_agent::tcp::testing::Threads;
using Behavior = ScriptedPeer::Behavior;

// An in-process agent with only a tcp backend and one local buffer.
class Agent {
 public:
  explicit Agent(DataClientOptions client = {}, uint64_t buffer = 1 << 20)
      : directory_(7) {
    BackendEnvironment env;
    env.identity = {"agent-7", 7};
    env.directory = &directory_;
    env.advertise_host = "127.0.0.1";
    TcpOptions options;
    options.listen = "127.0.0.1:0";
    options.client = client;
    auto created = TcpBackend::Create(options, env);
    EXPECT_TRUE(created.ok()) << created.status();
    if (created.ok()) backend_ = std::move(*created);
    auto memory = SharedMemory::Allocate(buffer, "tcp-client-test");
    EXPECT_TRUE(memory.ok()) << memory.status();
    local_ = std::make_shared<Registration>(1, 0, v1::ACCESS_READ_WRITE, "l",
                                            "token-local-x", std::move(*memory),
                                            true);
    directory_.Add(local_);
  }

  TcpBackend& backend() { return *backend_; }
  std::byte* bytes() { return local_->data(); }

  // An op on [0, length) of the local buffer against `remote`.
  Op MakeOp(v1::OpType type, std::shared_ptr<v1::RemoteBuffer> remote,
            uint64_t length, size_t index = 0) const {
    return ::rdma_agent::testing::MakeOp(
        index, type, ::rdma_agent::testing::TestBuffer{local_, nullptr}, 0,
        length, ::rdma_agent::testing::TestBuffer{nullptr, std::move(remote)},
        0);
  }

 private:
  BufferTable directory_;
  std::unique_ptr<TcpBackend> backend_;
  std::shared_ptr<Registration> local_;
};

constexpr auto kRead = v1::OP_TYPE_READ_INTO_LOCAL;
constexpr auto kWrite = v1::OP_TYPE_WRITE_FROM_LOCAL;

// Polls `condition` every 5 ms for up to `limit`.
template <typename Condition>
bool Eventually(Condition condition, absl::Duration limit = absl::Seconds(5)) {
  const absl::Time end = absl::Now() + limit;
  while (!condition()) {
    if (absl::Now() > end) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

TEST(TcpClientCancelTest, StalledPeerIsCancelledPromptlyAndMemoryStaysAlone) {
  Agent agent;
  ScriptedPeer peer(Behavior::kStall);
  ASSERT_NE(peer.port(), 0);
  constexpr uint64_t kSize = 1 << 20;
  std::memset(agent.bytes(), 0x11, kSize);
  Cancellation cancellation;
  std::vector<absl::Status> results;
  absl::Notification returned;
  std::thread submit([&] {
    results = agent.backend().Submit(
        {agent.MakeOp(kRead, ContextFor("127.0.0.1", peer.port(), kSize),
                      kSize)},
        StopToken(absl::Now() + absl::Seconds(30), &cancellation));
    returned.Notify();
  });
  ASSERT_TRUE(Eventually([&] { return peer.requests() > 0; }));
  const absl::Time cancelled_at = absl::Now();
  cancellation.Cancel(absl::CancelledError("the client went away"));
  ASSERT_TRUE(returned.WaitForNotificationWithTimeout(absl::Seconds(5)));
  const absl::Duration took = absl::Now() - cancelled_at;
  submit.join();
  EXPECT_LT(took, absl::Milliseconds(200));
  ASSERT_EQ(results.size(), 1u);
  EXPECT_EQ(results[0].code(), StatusCode::kCancelled) << results[0];
  EXPECT_TRUE(absl::StrContains(results[0].message(), "op 0:")) << results[0];
  // The stalled peer sees its connection closed: nothing of it is pooled.
  EXPECT_TRUE(Eventually([&] { return peer.closed_by_client() > 0; }));
  EXPECT_EQ(PoolProbe(agent.backend()).open_connections(), 0u);
  // Nothing writes into the buffer after Submit returned.
  std::memset(agent.bytes(), 0x5a, kSize);
  absl::SleepFor(absl::Milliseconds(200));
  for (uint64_t i = 0; i < kSize; ++i) {
    ASSERT_EQ(agent.bytes()[i], std::byte{0x5a}) << "byte " << i;
  }
}

TEST(TcpClientCancelTest, CancelledWhileWaitingForTheHello) {
  Agent agent;
  ScriptedPeer silent(Behavior::kSilent);
  Cancellation cancellation;
  std::vector<absl::Status> results;
  absl::Notification returned;
  std::thread submit([&] {
    results = agent.backend().Submit(
        {agent.MakeOp(kWrite, ContextFor("127.0.0.1", silent.port(), 64), 64)},
        StopToken(absl::Now() + absl::Seconds(30), &cancellation));
    returned.Notify();
  });
  ASSERT_TRUE(Eventually([&] { return silent.accepted() > 0; }));
  const absl::Time cancelled_at = absl::Now();
  cancellation.Cancel(absl::CancelledError("agent shutting down"));
  ASSERT_TRUE(returned.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_LT(absl::Now() - cancelled_at, absl::Milliseconds(200));
  submit.join();
  EXPECT_EQ(results[0].code(), StatusCode::kCancelled) << results[0];
  EXPECT_EQ(silent.bytes_received(), 0u);
}

TEST(TcpClientCancelTest, CancelledBeforeSubmitSendsNothing) {
  Agent agent;
  ScriptedPeer peer(Behavior::kRefuseAll);
  Cancellation cancellation;
  cancellation.Cancel(absl::CancelledError("gone"));
  auto results = agent.backend().Submit(
      {agent.MakeOp(kWrite, ContextFor("127.0.0.1", peer.port(), 64), 64)},
      StopToken(absl::Now() + absl::Seconds(30), &cancellation));
  EXPECT_EQ(results[0].code(), StatusCode::kCancelled) << results[0];
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(peer.bytes_received(), 0u);
}

// Peers that are not agents get nothing, and read exactly like closed ports.
TEST(TcpClientStrangerTest, NonAgentsGetNoByteAndLookLikeClosedPorts) {
  DataClientOptions options;
  options.connect_timeout = absl::Milliseconds(300);
  Agent agent(options);
  ScriptedPeer silent(Behavior::kSilent);
  ScriptedPeer banner(Behavior::kBanner);
  const uint16_t closed = ClosedPort();
  std::vector<Op> ops;
  for (uint16_t port : {silent.port(), banner.port(), closed}) {
    ops.push_back(agent.MakeOp(kWrite, ContextFor("127.0.0.1", port, 4096),
                               4096, ops.size()));
  }
  auto results = agent.backend().Submit(ops, absl::Now() + absl::Seconds(10));
  ASSERT_EQ(results.size(), 3u);
  const uint16_t ports[] = {silent.port(), banner.port(), closed};
  std::vector<std::string> shapes;
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(results[i].code(), StatusCode::kUnavailable) << results[i];
    // The message with the op number and port taken out.
    shapes.push_back(absl::StrReplaceAll(
        results[i].message(), {{absl::StrCat("op ", i, ":"), "op N:"},
                               {absl::StrCat(":", ports[i]), ":PORT"}}));
  }
  EXPECT_EQ(shapes[0], "op N: peer 127.0.0.1:PORT is unreachable");
  EXPECT_EQ(shapes[1], shapes[0]);
  EXPECT_EQ(shapes[2], shapes[0]);
  // Not a byte of the caller-chosen request (its "token" is an HTTP request)
  // reached either service, and the connections were dropped.
  EXPECT_TRUE(Eventually([&] {
    return silent.closed_by_client() >= 1 && banner.closed_by_client() >= 1;
  }));
  EXPECT_EQ(silent.bytes_received(), 0u);
  EXPECT_EQ(banner.bytes_received(), 0u);
  EXPECT_EQ(PoolProbe(agent.backend()).open_connections(), 0u);
}

TEST(TcpClientStrangerTest, HostNamesAreRefusedUnlessAllowed) {
  Agent agent;
  ScriptedPeer peer(Behavior::kRefuseAll);
  const absl::Time start = absl::Now();
  auto results = agent.backend().Submit(
      {agent.MakeOp(kWrite, ContextFor("localhost", peer.port(), 64), 64, 3)},
      absl::Now() + absl::Seconds(10));
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(100));
  EXPECT_EQ(results[0].code(), StatusCode::kInvalidArgument) << results[0];
  EXPECT_TRUE(absl::StartsWith(results[0].message(), "op 3: ")) << results[0];
  EXPECT_TRUE(absl::StrContains(results[0].message(), "--tcp_allow_host_names"))
      << results[0];
  EXPECT_EQ(peer.accepted(), 0);

  DataClientOptions options;
  options.allow_host_names = true;
  Agent resolving(options);
  results = resolving.backend().Submit(
      {resolving.MakeOp(kWrite, ContextFor("localhost", peer.port(), 64), 64)},
      absl::Now() + absl::Seconds(10));
  // Resolved and served: the fake agent knows no buffer.
  EXPECT_EQ(results[0].code(), StatusCode::kNotFound) << results[0];
}

TEST(TcpClientBoundsTest, ManyPeersUseOnlyTheWorkerThreads) {
  DataClientOptions options;
  options.threads = 3;
  Agent agent(options);
  ScriptedPeer peer(Behavior::kRefuseAll, "0.0.0.0");
  const int threads_before = Threads();
  // 200 distinct peers: 127.0.0.x on a closed port and on the fake agent.
  const uint16_t closed = ClosedPort();
  std::vector<Op> ops;
  for (int i = 0; i < 200; ++i) {
    const std::string host = absl::StrCat("127.0.", i / 200, ".", 1 + i % 200);
    ops.push_back(agent.MakeOp(
        kWrite, ContextFor(host, i % 2 ? closed : peer.port(), 64), 64, i));
  }
  std::atomic<int> most_threads{0};
  std::atomic<bool> done{false};
  std::thread watcher([&] {
    while (!done) {
      most_threads = std::max(most_threads.load(), Threads());
      absl::SleepFor(absl::Milliseconds(1));
    }
  });
  auto results = agent.backend().Submit(ops, absl::Now() + absl::Seconds(20));
  done = true;
  watcher.join();
  for (int i = 0; i < 200; ++i) {
    EXPECT_EQ(results[i].code(),
              i % 2 ? StatusCode::kUnavailable : StatusCode::kNotFound)
        << i << ": " << results[i];
  }
  // The watcher and the fake peer's connection threads are the only growth.
  EXPECT_LE(most_threads.load(), threads_before + 1 + peer.accepted() + 1);
}

TEST(TcpClientBoundsTest, SubmitsTakeTurnsOnTheWorkers) {
  DataClientOptions options;
  options.threads = 2;
  options.connect_timeout = absl::Milliseconds(500);
  Agent agent(options);
  ScriptedPeer silent(Behavior::kSilent, "0.0.0.0");
  ScriptedPeer fake(Behavior::kRefuseAll);
  // 100 peers that each hold a worker for the connect timeout: 25 s of work
  // for two workers.
  std::vector<Op> slow;
  for (int i = 0; i < 100; ++i) {
    slow.push_back(agent.MakeOp(
        kWrite, ContextFor(absl::StrCat("127.0.3.", i + 1), silent.port(), 64),
        64, i));
  }
  Cancellation cancel_slow;
  std::thread slow_submit([&] {
    agent.backend().Submit(
        slow, StopToken(absl::Now() + absl::Seconds(60), &cancel_slow));
  });
  ASSERT_TRUE(Eventually([&] { return silent.accepted() >= 2; }));
  // The next Submit gets the next free worker, not the 99th.
  const absl::Time start = absl::Now();
  auto results = agent.backend().Submit(
      {agent.MakeOp(kWrite, ContextFor("127.0.0.1", fake.port(), 64), 64)},
      absl::Now() + absl::Seconds(30));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_EQ(results[0].code(), StatusCode::kNotFound) << results[0];
  cancel_slow.Cancel(absl::CancelledError("done"));
  slow_submit.join();
}

TEST(TcpClientBoundsTest, IdlePoolIsBoundedAndExpires) {
  DataClientOptions options;
  options.max_idle_connections = 5;
  options.max_idle_per_peer = 1;
  options.idle_timeout = absl::Milliseconds(300);
  Agent agent(options);
  ScriptedPeer peer(Behavior::kRefuseAll, "0.0.0.0");
  const int fds_before = OpenFds();
  std::vector<Op> ops;
  for (int i = 0; i < 40; ++i) {
    ops.push_back(agent.MakeOp(
        kWrite, ContextFor(absl::StrCat("127.0.1.", i + 1), peer.port(), 64),
        64, i));
  }
  auto results = agent.backend().Submit(ops, absl::Now() + absl::Seconds(20));
  for (const absl::Status& result : results) {
    EXPECT_EQ(result.code(), StatusCode::kNotFound) << result;
  }
  EXPECT_LE(PoolProbe(agent.backend()).idle_connections(), 5u);
  EXPECT_LE(PoolProbe(agent.backend()).open_connections(), 5u);
  // Expired by the workers' own wakeups, with no further Submit.
  EXPECT_TRUE(Eventually(
      [&] { return PoolProbe(agent.backend()).open_connections() == 0; }));
  EXPECT_TRUE(Eventually([&] { return OpenFds() <= fds_before; }))
      << OpenFds() << " fds, " << fds_before << " before";
}

TEST(TcpClientBoundsTest, ConnectionLimitQueuesDials) {
  DataClientOptions options;
  options.threads = 4;
  options.max_connections = 1;
  options.max_idle_per_peer = 2;
  Agent agent(options);
  ScriptedPeer a(Behavior::kRefuseAll, "0.0.0.0");
  ScriptedPeer b(Behavior::kRefuseAll, "0.0.0.0");
  std::vector<Op> ops;
  for (int i = 0; i < 8; ++i) {
    ops.push_back(agent.MakeOp(kWrite,
                               ContextFor(absl::StrCat("127.0.2.", i + 1),
                                          i % 2 ? a.port() : b.port(), 64),
                               64, i));
  }
  auto results = agent.backend().Submit(ops, absl::Now() + absl::Seconds(20));
  for (const absl::Status& result : results) {
    EXPECT_EQ(result.code(), StatusCode::kNotFound) << result;
  }
  EXPECT_LE(PoolProbe(agent.backend()).open_connections(), 1u);
}

// Small ops pipeline past max_in_flight until in_flight_bytes are in
// flight: a peer that never answers sees exactly that many requests.
TEST(TcpClientPipelineTest, SmallOpsFillTheWindowByBytes) {
  for (const uint64_t in_flight_bytes : {uint64_t{64} << 10, uint64_t{0}}) {
    DataClientOptions options;
    options.connections_per_peer = 1;
    options.max_in_flight = 2;
    options.in_flight_bytes = in_flight_bytes;
    Agent agent(options);
    ScriptedPeer peer(Behavior::kStall);
    ASSERT_NE(peer.port(), 0);
    std::vector<Op> ops;
    auto context = ContextFor("127.0.0.1", peer.port(), 4096);
    for (size_t i = 0; i < 100; ++i) {
      ops.push_back(agent.MakeOp(kWrite, context, 4096, i));
    }
    Cancellation cancellation;
    std::vector<absl::Status> results;
    std::thread submit([&] {
      results = agent.backend().Submit(
          ops, StopToken(absl::Now() + absl::Seconds(30), &cancellation));
    });
    const int expected = in_flight_bytes == 0 ? 2 : 16;  // 64 KiB / 4 KiB
    EXPECT_TRUE(Eventually([&] { return peer.requests() >= expected; }))
        << in_flight_bytes;
    // And no more, however long the peer stays silent.
    absl::SleepFor(absl::Milliseconds(200));
    EXPECT_EQ(peer.requests(), expected) << in_flight_bytes;
    cancellation.Cancel(absl::CancelledError("done"));
    submit.join();
    for (const absl::Status& result : results) {
      EXPECT_EQ(result.code(), StatusCode::kCancelled) << result;
    }
  }
}

// Responses are read through a buffer; bytes found there after the last
// answer mean the stream is not what it should be: that connection is not
// pooled (the answered op still succeeds).
TEST(TcpClientPipelineTest, BytesNobodyAskedForKeepAConnectionOutOfThePool) {
  Agent agent;
  ScriptedPeer peer(Behavior::kAnswerThenJunk);
  ASSERT_NE(peer.port(), 0);
  auto results = agent.backend().Submit(
      {agent.MakeOp(kWrite, ContextFor("127.0.0.1", peer.port(), 64), 64)},
      absl::Now() + absl::Seconds(20));
  ASSERT_EQ(results.size(), 1u);
  EXPECT_TRUE(results[0].ok()) << results[0];
  EXPECT_EQ(PoolProbe(agent.backend()).idle_connections(), 0u);
  EXPECT_EQ(PoolProbe(agent.backend()).open_connections(), 0u);
  EXPECT_TRUE(Eventually([&] { return peer.closed_by_client() > 0; }));
}

// A pooled connection remembers the socket timeouts it was given (so that
// Submits with similar deadlines set none); one with a shorter deadline
// still ends by it.
TEST(TcpClientPipelineTest, APooledConnectionHonoursAShorterDeadline) {
  DataClientOptions options;
  options.connections_per_peer = 1;
  Agent agent(options);
  ScriptedPeer peer(Behavior::kRefuseOnceThenStall);
  ASSERT_NE(peer.port(), 0);
  auto context = ContextFor("127.0.0.1", peer.port(), 64);
  // Answered: the connection, its receive timeout set for a minute, goes
  // back to the pool.
  auto first = agent.backend().Submit({agent.MakeOp(kRead, context, 64)},
                                      absl::Now() + absl::Seconds(60));
  EXPECT_EQ(first[0].code(), StatusCode::kNotFound) << first[0];
  ASSERT_EQ(PoolProbe(agent.backend()).idle_connections(), 1u);
  // Reused, and the peer now stalls.
  const absl::Time start = absl::Now();
  auto second = agent.backend().Submit({agent.MakeOp(kRead, context, 64)},
                                       start + absl::Milliseconds(300));
  EXPECT_EQ(second[0].code(), StatusCode::kDeadlineExceeded) << second[0];
  EXPECT_LT(absl::Now() - start, absl::Seconds(10))
      << "waited on the pooled connection's old one-minute timeout";
  EXPECT_EQ(peer.accepted(), 1) << "the pooled connection was not reused";
}

// 2048 ops of 64 GiB each over a sparse 64 GiB buffer: chunks are cut as they
// are sent, so memory does not follow the bytes (the old client built 32 M
// chunks up front, gigabytes).
TEST(TcpClientMemoryTest, HugeOpsCostMemoryPerOpNotPerByte) {
  constexpr uint64_t kHuge = 64ull << 30;
  Agent agent({}, kHuge);
  ScriptedPeer peer(Behavior::kRefuseAll);
  rusage before{};
  getrusage(RUSAGE_SELF, &before);
  std::vector<Op> ops;
  auto context = ContextFor("127.0.0.1", peer.port(), kHuge);
  for (size_t i = 0; i < 2048; ++i) {
    ops.push_back(agent.MakeOp(kRead, context, kHuge, i));
  }
  auto results = agent.backend().Submit(ops, absl::Now() + absl::Seconds(30));
  ASSERT_EQ(results.size(), ops.size());
  for (const absl::Status& result : results) {
    EXPECT_EQ(result.code(), StatusCode::kNotFound) << result;
  }
  rusage after{};
  getrusage(RUSAGE_SELF, &after);
  // The old client grew by > 2 GiB here. AddressSanitizer's own
  // bookkeeping adds a few hundred MiB.
#ifdef __SANITIZE_ADDRESS__
  constexpr long kMaxGrowthKib = 768 << 10;
#else
  constexpr long kMaxGrowthKib = 64 << 10;
#endif
  EXPECT_LT(after.ru_maxrss - before.ru_maxrss, kMaxGrowthKib)
      << "peak RSS grew by " << (after.ru_maxrss - before.ru_maxrss) << " KiB";
}

TEST(TcpClientCreateTest, BadClientOptionsAreRefused) {
  BufferTable directory(1);
  BackendEnvironment env;
  env.directory = &directory;
  TcpOptions options;
  options.listen = "127.0.0.1:0";
  options.client.threads = 0;
  EXPECT_EQ(TcpBackend::Create(options, env).status().code(),
            StatusCode::kInvalidArgument);
  options.client.threads = 2;
  options.client.max_connections = 0;
  EXPECT_EQ(TcpBackend::Create(options, env).status().code(),
            StatusCode::kInvalidArgument);
  options.client.max_connections = 4;
  options.client.idle_timeout = absl::ZeroDuration();
  EXPECT_EQ(TcpBackend::Create(options, env).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rdma_agent::tcp

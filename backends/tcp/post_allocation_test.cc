// Heap allocations of a tcp Post grow with the batch's peers, not its ops.
// Both agents live in this process: allocations are counted on the
// requesting side's threads only (the posting thread, the client's workers
// and timekeeper, known by their names), not on the serving side's.

#include <sys/prctl.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "backends/tcp/tcp_backend.h"
#include "backends/tcp/test_agent.h"
#include "backends/testing/harness.h"
#include "gtest/gtest.h"
#include "tests/testing/allocation_count.h"

namespace rdma_agent::tcp {
namespace {

using ::rdma_agent::testing::In;
using ::rdma_agent::testing::MakeOp;
using ::rdma_agent::testing::TestAgent;
using ::rdma_agent::testing::TestBuffer;

// Counts the requesting side's allocations only: this (the posting) thread
// and the backend's own threads, known by their names.
void CountRequestingSide() {
  ::rdma_agent::testing::CountOnlyOn({"tcp-client", "tcp-timekeeper"});
}

std::unique_ptr<TestAgent> Agent(uint64_t epoch) { return TcpTestAgent(epoch); }

// Allocations on the requesting side of one Post of `ops`, from the call
// to its done. `ended_on`: the name of the thread that called done.
uint64_t AllocationsOfPost(Backend& backend, const std::vector<Op>& ops,
                           std::string* ended_on = nullptr) {
  absl::Notification ended;
  bool all_ok = true;
  char name[16] = {};
  const uint64_t before =
      static_cast<uint64_t>(::rdma_agent::testing::Allocations());
  backend.Post(ops, In(absl::Seconds(20)),
               [&](std::vector<absl::Status> statuses) {
                 for (const absl::Status& status : statuses) {
                   all_ok = all_ok && status.ok();
                 }
                 prctl(PR_GET_NAME, name);
                 ended.Notify();
               });
  ended.WaitForNotification();
  const uint64_t after =
      static_cast<uint64_t>(::rdma_agent::testing::Allocations());
  EXPECT_TRUE(all_ok);
  if (ended_on != nullptr) *ended_on = name;
  return after - before;
}

TEST(TcpPostAllocationTest, AllocationsDoNotGrowWithTheOps) {
  CountRequestingSide();
  auto a = Agent(/*epoch=*/91);
  auto b = Agent(/*epoch=*/92);
  constexpr int kMany = 4096;
  constexpr int kFew = 64;
  auto local = a->Register(kMany * 128, v1::ACCESS_READ_WRITE, 1);
  auto remote = b->Register(kMany * 128, v1::ACCESS_READ_WRITE, 2);
  auto batch = [&](int count) {
    std::vector<Op> ops;
    for (int i = 0; i < count; ++i) {
      ops.push_back(MakeOp(i,
                           i % 2 == 0 ? v1::OP_TYPE_READ_INTO_LOCAL
                                      : v1::OP_TYPE_WRITE_FROM_LOCAL,
                           local, i * 128, 64, remote, i * 128 + 8));
    }
    return ops;
  };
  const std::vector<Op> many = batch(kMany);
  const std::vector<Op> few = batch(kFew);
  // Warm: pooled connections, spare receive buffers, grown windows.
  for (int i = 0; i < 3; ++i) {
    AllocationsOfPost(a->backend(), many);
    AllocationsOfPost(a->backend(), few);
  }
  // The least of a few tries: a worker's idle-connection expiry or a log
  // line may fall into one.
  uint64_t for_many = ~0ull;
  uint64_t for_few = ~0ull;
  for (int i = 0; i < 5; ++i) {
    for_many = std::min(for_many, AllocationsOfPost(a->backend(), many));
    for_few = std::min(for_few, AllocationsOfPost(a->backend(), few));
  }
  std::printf("allocations per Post: %d ops %llu, %d ops %llu\n", kFew,
              static_cast<unsigned long long>(for_few), kMany,
              static_cast<unsigned long long>(for_many));
  // 64x the ops, the same peer: the same allocations per batch and per
  // lane, but for the lanes' request windows, which double (from 16 up to
  // 1024 requests, 7 times at most per lane) to the deepest window they
  // reach. One allocation per 64 ops would add 63.
  EXPECT_LT(for_many, for_few + 32);
}

// Small batches (at most DataClient::kLoopBatchBytes) are sent by the
// posting thread and answered on a loop (tcp-client-loop, counted too).
TEST(TcpPostAllocationTest, LoopBatchAllocationsDoNotGrowWithTheOps) {
  CountRequestingSide();
  auto a = Agent(/*epoch=*/93);
  auto b = Agent(/*epoch=*/94);
  constexpr int kMany = 256;
  constexpr int kFew = 4;
  constexpr uint64_t kLength = 8;
  static_assert(kMany * kLength <= DataClient::kLoopBatchBytes);
  auto local = a->Register(kMany * 64, v1::ACCESS_READ_WRITE, 1);
  auto remote = b->Register(kMany * 64, v1::ACCESS_READ_WRITE, 2);
  auto batch = [&](int count) {
    std::vector<Op> ops;
    for (int i = 0; i < count; ++i) {
      ops.push_back(MakeOp(i,
                           i % 2 == 0 ? v1::OP_TYPE_READ_INTO_LOCAL
                                      : v1::OP_TYPE_WRITE_FROM_LOCAL,
                           local, i * 64, kLength, remote, i * 64 + 8));
    }
    return ops;
  };
  const std::vector<Op> many = batch(kMany);
  const std::vector<Op> few = batch(kFew);
  // Warm: a pooled connection (the first Post dials it on a worker), spare
  // receive buffers.
  for (int i = 0; i < 3; ++i) {
    AllocationsOfPost(a->backend(), many);
    AllocationsOfPost(a->backend(), few);
  }
  uint64_t for_many = ~0ull;
  uint64_t for_few = ~0ull;
  for (int i = 0; i < 5; ++i) {
    std::string ended_on;
    for_many =
        std::min(for_many, AllocationsOfPost(a->backend(), many, &ended_on));
    // The loop, or in place when the answer was there at once: never a
    // worker.
    EXPECT_NE(ended_on, "tcp-client");
    for_few =
        std::min(for_few, AllocationsOfPost(a->backend(), few, &ended_on));
    EXPECT_NE(ended_on, "tcp-client");
  }
  std::printf("allocations per looped Post: %d ops %llu, %d ops %llu\n", kFew,
              static_cast<unsigned long long>(for_few), kMany,
              static_cast<unsigned long long>(for_many));
  // 64x the ops: the same allocations per batch and lane but for the
  // lane's request window, which doubles from 16 to 256 requests (4 more).
  // One allocation per op would add 252.
  EXPECT_LT(for_many, for_few + 16);
}

}  // namespace
}  // namespace rdma_agent::tcp

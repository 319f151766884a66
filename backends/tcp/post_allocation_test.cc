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

// `count` ops alternating READ and WRITE, `length` bytes each, `spacing`
// apart in both buffers.
std::vector<Op> Alternating(const TestBuffer& local, const TestBuffer& remote,
                            int count, uint64_t spacing, uint64_t length) {
  std::vector<Op> ops;
  for (int i = 0; i < count; ++i) {
    ops.push_back(MakeOp(
        i,
        i % 2 == 0 ? v1::OP_TYPE_READ_INTO_LOCAL : v1::OP_TYPE_WRITE_FROM_LOCAL,
        local, i * spacing, length, remote, i * spacing + 8));
  }
  return ops;
}

struct Least {
  uint64_t many = ~0ull;
  uint64_t few = ~0ull;
};

// The least allocations per Post of `many` and of `few` over five tries (a
// worker's idle-connection expiry or a log line may fall into one), after
// three warm-ups (pooled connections, spare receive buffers, grown
// windows). With `never_on_a_worker`, every try must end on a loop or in
// Post.
Least LeastAllocations(Backend& backend, const std::vector<Op>& many,
                       const std::vector<Op>& few, bool never_on_a_worker) {
  for (int i = 0; i < 3; ++i) {
    AllocationsOfPost(backend, many);
    AllocationsOfPost(backend, few);
  }
  Least least;
  for (int i = 0; i < 5; ++i) {
    for (const auto& [ops, kept] :
         {std::pair{&many, &least.many}, std::pair{&few, &least.few}}) {
      std::string ended_on;
      *kept = std::min(*kept, AllocationsOfPost(backend, *ops, &ended_on));
      if (never_on_a_worker) EXPECT_NE(ended_on, "tcp-client");
    }
  }
  std::printf("allocations per Post: %zu ops %llu, %zu ops %llu\n", few.size(),
              static_cast<unsigned long long>(least.few), many.size(),
              static_cast<unsigned long long>(least.many));
  return least;
}

TEST(TcpPostAllocationTest, AllocationsDoNotGrowWithTheOps) {
  CountRequestingSide();
  auto a = Agent(/*epoch=*/91);
  auto b = Agent(/*epoch=*/92);
  constexpr int kMany = 4096;
  constexpr int kFew = 64;
  auto local = a->Register(kMany * 128, v1::ACCESS_READ_WRITE, 1);
  auto remote = b->Register(kMany * 128, v1::ACCESS_READ_WRITE, 2);
  const Least least = LeastAllocations(
      a->backend(), Alternating(local, remote, kMany, 128, 64),
      Alternating(local, remote, kFew, 128, 64), /*never_on_a_worker=*/false);
  // 64x the ops, the same peer: the same allocations per batch and per
  // lane, but for the lanes' request windows, which double (from 16 up to
  // 1024 requests, 7 times at most per lane) to the deepest window they
  // reach. One allocation per 64 ops would add 63.
  EXPECT_LT(least.many, least.few + 32);
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
  // The warm-ups dial the pooled connection on a worker; the tries end on
  // the loop, or in Post when the answer was there at once.
  const Least least = LeastAllocations(
      a->backend(), Alternating(local, remote, kMany, 64, kLength),
      Alternating(local, remote, kFew, 64, kLength),
      /*never_on_a_worker=*/true);
  // 64x the ops: the same allocations per batch and lane but for the
  // lane's request window, which doubles from 16 to 256 requests (4 more).
  // One allocation per op would add 252.
  EXPECT_LT(least.many, least.few + 16);
}

}  // namespace
}  // namespace rdma_agent::tcp

// Heap allocations of an ibverbs Post grow with the batch's peers and lanes,
// not its ops or work requests. Both agents (over the software NIC) live in
// this process: allocations are counted on the requesting side's threads
// only (the posting thread, and the backend's posting, deadline and
// completion-polling threads, known by their names). The soft NIC's queue
// pairs execute WRs on threads of their own (its "hardware"), not counted;
// what it does on the backend's threads (ibv_post_send, ibv_poll_cq)
// allocates nothing per WR, as a real provider's does not.

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "backends/ibverbs/ibverbs_backend.h"
#include "backends/ibverbs/soft/soft_verbs.h"
#include "backends/testing/harness.h"
#include "backends/testing/ibverbs_agent.h"
#include "gtest/gtest.h"
#include "tests/testing/allocation_count.h"

namespace rdma_agent::ibverbs {
namespace {

using ::rdma_agent::testing::Apply;
using ::rdma_agent::testing::FirstDifference;
using ::rdma_agent::testing::In;
using ::rdma_agent::testing::MakeOp;
using ::rdma_agent::testing::Refill;
using ::rdma_agent::testing::Snapshot;
using ::rdma_agent::testing::SoftIbverbsAgent;
using ::rdma_agent::testing::TestAgent;
using ::rdma_agent::testing::TestBuffer;

// Counts the requesting side's allocations only: this (the posting) thread
// and the backend's own threads, known by their names.
void CountRequestingSide() {
  ::rdma_agent::testing::CountOnlyOn(
      {"ibv-posting", "ibv-deadline", "ibv-cq-poller"});
}

constexpr size_t kSizes[] = {64, 256, 1024};
constexpr uint64_t kSpacing = 128;
constexpr uint64_t kLength = 64;

// Allocations on the requesting side of one Post of `ops`, from the call
// to its done (every op must succeed).
uint64_t AllocationsOfPost(Backend& backend, const std::vector<Op>& ops) {
  absl::Notification ended;
  bool all_ok = true;
  const uint64_t before =
      static_cast<uint64_t>(::rdma_agent::testing::Allocations());
  backend.Post(ops, In(absl::Seconds(20)),
               [&](std::vector<absl::Status> statuses) {
                 for (const absl::Status& status : statuses) {
                   all_ok = all_ok && status.ok();
                 }
                 ended.Notify();
               });
  ended.WaitForNotification();
  const uint64_t after =
      static_cast<uint64_t>(::rdma_agent::testing::Allocations());
  EXPECT_TRUE(all_ok);
  return after - before;
}

// The least allocations of a few Posts of each of `batches`, once warm: the
// lanes connected, the grants cached, the send queues' records made.
std::vector<uint64_t> LeastAllocations(
    Backend& backend, const std::vector<std::vector<Op>>& batches) {
  for (int i = 0; i < 3; ++i) {
    for (const std::vector<Op>& ops : batches) AllocationsOfPost(backend, ops);
  }
  // The least of a few tries: a log line or an idle sweep may fall into
  // one.
  std::vector<uint64_t> least(batches.size(), ~0ull);
  for (int i = 0; i < 5; ++i) {
    for (size_t s = 0; s < batches.size(); ++s) {
      least[s] = std::min(least[s], AllocationsOfPost(backend, batches[s]));
    }
  }
  for (size_t s = 0; s < batches.size(); ++s) {
    std::printf("allocations per Post of %zu ops: %llu\n", batches[s].size(),
                static_cast<unsigned long long>(least[s]));
  }
  return least;
}

// Every op of `ops` moves its bytes, and nothing else changes.
void ExpectItMovesItsBytes(Backend& backend, const std::vector<Op>& ops,
                           const TestBuffer& local, const TestBuffer& remote) {
  Refill(local);
  Refill(remote);
  std::vector<uint8_t> local_image = Snapshot(local);
  std::vector<uint8_t> remote_image = Snapshot(remote);
  for (const Op& op : ops) Apply(op, local_image, remote_image);
  AllocationsOfPost(backend, ops);
  EXPECT_EQ(FirstDifference(local, local_image), std::nullopt);
  EXPECT_EQ(FirstDifference(remote, remote_image), std::nullopt);
}

// Soft devices named `names` (each a rail of the agent that sees it).
void AddDevices(verbs::SoftFabric& fabric,
                const std::vector<std::string>& names) {
  for (const std::string& name : names) {
    verbs::SoftDeviceConfig config;
    config.name = name;
    ASSERT_TRUE(fabric.AddDevice(config).ok()) << name;
  }
}

TEST(IbverbsPostAllocationTest, AllocationsDoNotGrowWithTheOps) {
  CountRequestingSide();
  verbs::SoftFabric fabric;
  AddDevices(fabric, {"nic_a", "nic_b"});
  std::unique_ptr<TestAgent> a = SoftIbverbsAgent(fabric, "agent-a", "nic_a");
  std::unique_ptr<TestAgent> b = SoftIbverbsAgent(fabric, "agent-b", "nic_b");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  constexpr size_t kMost = kSizes[std::size(kSizes) - 1];
  TestBuffer local = a->Register(kMost * kSpacing, v1::ACCESS_READ_WRITE, 1);
  TestBuffer remote = b->Register(kMost * kSpacing, v1::ACCESS_READ_WRITE, 2);
  // Even ops read, odd ones write, each its own range on both sides.
  const auto batch = [&](size_t count) {
    std::vector<Op> ops;
    for (size_t i = 0; i < count; ++i) {
      ops.push_back(MakeOp(i,
                           i % 2 == 0 ? v1::OP_TYPE_READ_INTO_LOCAL
                                      : v1::OP_TYPE_WRITE_FROM_LOCAL,
                           local, i * kSpacing, kLength, remote,
                           i * kSpacing + 8));
    }
    return ops;
  };
  std::vector<std::vector<Op>> batches;
  for (size_t size : kSizes) batches.push_back(batch(size));
  const std::vector<uint64_t> least = LeastAllocations(a->backend(), batches);
  // 16x the ops, one peer and one lane: the same allocations per batch
  // (the batch's vectors are sized once, by its op count). The slack is
  // for a batch larger than the send queue (256 WRs here), whose lane goes
  // on a posting thread once: the task and the full queue's status. One
  // allocation per 64 ops would add 15.
  EXPECT_LE(least[1], least[0] + 2);
  EXPECT_LE(least[2], least[0] + 4);
  ExpectItMovesItsBytes(a->backend(), batches.back(), local, remote);
}

// Two rails on each side: small ops spread over the lanes, and one op in
// 16 of 64 KiB, striped over them.
TEST(IbverbsPostAllocationTest, AllocationsDoNotGrowWithTheOpsOverTwoRails) {
  CountRequestingSide();
  verbs::SoftFabric fabric;
  AddDevices(fabric, {"nic_a1", "nic_a2", "nic_b1", "nic_b2"});
  std::unique_ptr<TestAgent> a = SoftIbverbsAgent(
      fabric, "agent-a", std::vector<std::string>{"nic_a1", "nic_a2"});
  std::unique_ptr<TestAgent> b = SoftIbverbsAgent(
      fabric, "agent-b", std::vector<std::string>{"nic_b1", "nic_b2"});
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  constexpr size_t kMost = kSizes[std::size(kSizes) - 1];
  constexpr uint64_t kStriped = 64 << 10;
  constexpr uint64_t kSmallBytes = kMost * kSpacing;
  constexpr uint64_t kSize = kSmallBytes + kMost / 16 * kStriped + 8;
  TestBuffer local = a->Register(kSize, v1::ACCESS_READ_WRITE, 1);
  TestBuffer remote = b->Register(kSize, v1::ACCESS_READ_WRITE, 2);
  const auto batch = [&](size_t count) {
    std::vector<Op> ops;
    for (size_t i = 0; i < count; ++i) {
      const v1::OpType type = i % 2 == 0 ? v1::OP_TYPE_READ_INTO_LOCAL
                                         : v1::OP_TYPE_WRITE_FROM_LOCAL;
      if (i % 16 == 0) {
        const uint64_t at = kSmallBytes + i / 16 * kStriped;
        ops.push_back(MakeOp(i, type, local, at, kStriped, remote, at + 8));
      } else {
        ops.push_back(MakeOp(i, type, local, i * kSpacing, kLength, remote,
                             i * kSpacing + 8));
      }
    }
    return ops;
  };
  std::vector<std::vector<Op>> batches;
  for (size_t size : kSizes) batches.push_back(batch(size));
  const std::vector<uint64_t> least = LeastAllocations(a->backend(), batches);
  // As over one rail, per lane: each lane's send queue (256) outgrown
  // once, and a lane given a few ranges more than an even share grows its
  // vector once more.
  EXPECT_LE(least[1], least[0] + 6);
  EXPECT_LE(least[2], least[0] + 8);
  ExpectItMovesItsBytes(a->backend(), batches.back(), local, remote);
}

}  // namespace
}  // namespace rdma_agent::ibverbs

// Heap allocations of an ibverbs Post grow with the batch's peers and lanes,
// not its ops or work requests. Both agents (over the software NIC) live in
// this process: allocations are counted on the requesting side's threads
// only (the posting thread, and the backend's posting, deadline and
// completion-polling threads, known by their names). The soft NIC's queue
// pairs execute WRs on threads of their own (its "hardware"), not counted;
// what it does on the backend's threads (ibv_post_send, ibv_poll_cq)
// allocates nothing per WR, as a real provider's does not.

#include <sys/prctl.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include "absl/synchronization/notification.h"
#include "backends/ibverbs/ibverbs_backend.h"
#include "backends/ibverbs/soft/soft_verbs.h"
#include "backends/testing/harness.h"
#include "backends/testing/ibverbs_agent.h"
#include "gtest/gtest.h"

namespace {
std::atomic<uint64_t> allocations{0};
std::atomic<bool> counting{false};
thread_local bool posting_thread = false;

bool OnRequestingSide() {
  if (posting_thread) return true;
  char name[16] = {};
  prctl(PR_GET_NAME, name);
  return std::strcmp(name, "ibv-posting") == 0 ||
         std::strcmp(name, "ibv-deadline") == 0 ||
         std::strcmp(name, "ibv-cq-poller") == 0;
}

void Count() {
  if (counting.load(std::memory_order_relaxed) && OnRequestingSide()) {
    allocations.fetch_add(1, std::memory_order_relaxed);
  }
}
}  // namespace

void* operator new(size_t size) {
  Count();
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void* operator new(size_t size, std::align_val_t align) {
  Count();
  const size_t alignment = static_cast<size_t>(align);
  const size_t rounded = (size + alignment - 1) / alignment * alignment;
  if (void* p =
          std::aligned_alloc(alignment, rounded == 0 ? alignment : rounded)) {
    return p;
  }
  throw std::bad_alloc();
}
// Every other form too, so that all of them count and pair with free
// (under AddressSanitizer, a form not replaced here would be its own).
void* operator new[](size_t size) { return operator new(size); }
void* operator new[](size_t size, std::align_val_t align) {
  return operator new(size, align);
}
void* operator new(size_t size, const std::nothrow_t&) noexcept {
  Count();
  return std::malloc(size == 0 ? 1 : size);
}
void* operator new[](size_t size, const std::nothrow_t& nothrow) noexcept {
  return operator new(size, nothrow);
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, size_t, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, const std::nothrow_t&) noexcept {
  std::free(p);
}

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

constexpr size_t kSizes[] = {64, 256, 1024};
constexpr uint64_t kSpacing = 128;
constexpr uint64_t kLength = 64;

// Allocations on the requesting side of one Post of `ops`, from the call
// to its done (every op must succeed).
uint64_t AllocationsOfPost(Backend& backend, const std::vector<Op>& ops) {
  absl::Notification ended;
  bool all_ok = true;
  const uint64_t before = allocations.load();
  backend.Post(ops, In(absl::Seconds(20)),
               [&](std::vector<absl::Status> statuses) {
                 for (const absl::Status& status : statuses) {
                   all_ok = all_ok && status.ok();
                 }
                 ended.Notify();
               });
  ended.WaitForNotification();
  const uint64_t after = allocations.load();
  EXPECT_TRUE(all_ok);
  return after - before;
}

TEST(IbverbsPostAllocationTest, AllocationsDoNotGrowWithTheOps) {
  posting_thread = true;
  verbs::SoftFabric fabric;
  for (const char* name : {"nic_a", "nic_b"}) {
    verbs::SoftDeviceConfig config;
    config.name = name;
    ASSERT_TRUE(fabric.AddDevice(config).ok());
  }
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
  // Steady state: the lane connected, the grant cached, the send queue's
  // records and the batches' vectors grown.
  Backend& backend = a->backend();
  counting = true;
  for (int i = 0; i < 3; ++i) {
    for (const std::vector<Op>& ops : batches) {
      AllocationsOfPost(backend, ops);
    }
  }
  // The least of a few tries: a log line or an idle sweep may fall into
  // one.
  std::vector<uint64_t> least(std::size(kSizes), ~0ull);
  for (int i = 0; i < 5; ++i) {
    for (size_t s = 0; s < std::size(kSizes); ++s) {
      least[s] = std::min(least[s], AllocationsOfPost(backend, batches[s]));
    }
  }
  counting = false;
  for (size_t s = 0; s < std::size(kSizes); ++s) {
    std::printf("allocations per Post of %zu ops: %llu\n", kSizes[s],
                static_cast<unsigned long long>(least[s]));
  }
  // 16x the ops, one peer and one lane: the same allocations per batch
  // (the batch's vectors are sized once, by its op count). The slack is
  // for a batch larger than the send queue (256 WRs here), whose lane goes
  // on a posting thread once: the task and the full queue's status. One
  // allocation per 64 ops would add 15.
  EXPECT_LE(least[1], least[0] + 2);
  EXPECT_LE(least[2], least[0] + 4);

  // Every op moved its bytes, and nothing else changed.
  Refill(local);
  Refill(remote);
  std::vector<uint8_t> local_image = Snapshot(local);
  std::vector<uint8_t> remote_image = Snapshot(remote);
  const std::vector<Op>& ops = batches.back();
  for (const Op& op : ops) Apply(op, local_image, remote_image);
  AllocationsOfPost(backend, ops);
  EXPECT_EQ(FirstDifference(local, local_image), std::nullopt);
  EXPECT_EQ(FirstDifference(remote, remote_image), std::nullopt);
}

}  // namespace
}  // namespace rdma_agent::ibverbs

// No heap allocation per op on the posting path: BackendRegistry::PostInPlace
// over the memory backend, for batches copied inside Post and batches copied
// on the copy threads. Every allocation of the process is counted
// (//tests/testing:allocation_count; the copy threads' included); a batch of
// 1024 ops must allocate exactly as often as one of 256.
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "backends/buffer_table.h"
#include "backends/memory/memory_backend.h"
#include "backends/registry.h"
#include "common/shared_memory.h"
#include "gtest/gtest.h"
#include "tests/testing/allocation_count.h"

namespace rdma_agent::memory {
namespace {

constexpr uint64_t kEpoch = 7;

class PostAllocationTest : public ::testing::Test {
 protected:
  PostAllocationTest() {
    BackendEnvironment env;
    env.identity = {"agent-a", kEpoch};
    env.directory = &table_;
    std::vector<std::unique_ptr<Backend>> backends;
    backends.push_back(std::make_unique<MemoryBackend>(env));
    registry_ = std::make_unique<BackendRegistry>(std::move(backends));
  }

  // A registration of `size` bytes, in the table, and its context.
  std::shared_ptr<const v1::RemoteBuffer> Register(
      uint64_t size, std::shared_ptr<Registration>* kept) {
    auto memory = SharedMemory::Allocate(size, "post_allocation_test");
    EXPECT_TRUE(memory.ok()) << memory.status();
    const uint64_t id = table_.NextId();
    auto registration = std::make_shared<Registration>(
        id, /*owner=*/0, v1::ACCESS_READ_WRITE, "test",
        absl::StrCat("token-", id), std::move(*memory),
        /*agent_allocated=*/true);
    auto context = std::make_shared<v1::RemoteBuffer>();
    EXPECT_TRUE(registry_->RegisterWithAll(*registration, context.get()).ok());
    context->set_agent_id("agent-a");
    context->set_agent_epoch(kEpoch);
    context->set_buffer_id(id);
    context->set_size_bytes(size);
    context->set_access(v1::ACCESS_READ_WRITE);
    context->set_token(registration->token());
    table_.Add(registration);
    *kept = std::move(registration);
    return context;
  }

  // `count` ops of `length` bytes each, alternately reading and writing,
  // between one local buffer and one context, as the daemon builds them.
  std::vector<Op> Batch(size_t count, uint64_t length) {
    std::shared_ptr<Registration> local;
    std::shared_ptr<Registration> remote;
    auto context = Register(count * length, &remote);
    Register(count * length, &local);
    kept_.push_back(remote);
    std::vector<Op> ops(count);
    for (size_t i = 0; i < count; ++i) {
      ops[i].index = i;
      ops[i].type = i % 2 == 0 ? v1::OP_TYPE_READ_INTO_LOCAL
                               : v1::OP_TYPE_WRITE_FROM_LOCAL;
      ops[i].local = local;
      ops[i].local_offset = i * length;
      ops[i].length = length;
      ops[i].remote = context;
      ops[i].remote_offset = i * length;
    }
    return ops;
  }

  // Allocations in the process while `ops` are posted and until their
  // outcomes are in (every op must succeed).
  int64_t AllocationsToPost(std::vector<Op>& ops) {
    auto ended = std::make_unique<absl::Notification>();
    std::vector<OpOutcome> outcomes;
    outcomes.reserve(ops.size());
    const int64_t before = testing::Allocations();
    registry_->PostInPlace(absl::MakeSpan(ops), absl::Now() + absl::Seconds(30),
                           [&outcomes, &ended](std::vector<OpOutcome> given) {
                             outcomes = std::move(given);
                             ended->Notify();
                           });
    ended->WaitForNotification();
    const int64_t after = testing::Allocations();
    EXPECT_EQ(outcomes.size(), ops.size());
    for (const OpOutcome& outcome : outcomes) {
      EXPECT_TRUE(outcome.status.ok()) << outcome.status;
    }
    return after - before;
  }

  // Per-batch allocations of a steady state: each batch was posted once
  // before (warm), then the second post of each is counted.
  void ExpectNoneGrowsWithTheOps(uint64_t op_length) {
    std::vector<Op> small = Batch(256, op_length);
    std::vector<Op> large = Batch(1024, op_length);
    AllocationsToPost(small);
    AllocationsToPost(large);
    const int64_t for_small = AllocationsToPost(small);
    const int64_t for_large = AllocationsToPost(large);
    std::cout << "ops of " << op_length << " bytes: " << for_small
              << " allocations for 256 ops, " << for_large << " for 1024\n";
    EXPECT_EQ(for_large, for_small) << "an allocation per op";
    // What a batch allocates (registry: its state, outcomes, route, the
    // share and its indices; memory: statuses, the resolver's contexts, a
    // queued batch's task) stays a handful.
    EXPECT_LE(for_small, 20);
  }

  BufferTable table_{kEpoch};
  std::unique_ptr<BackendRegistry> registry_;
  std::vector<std::shared_ptr<Registration>> kept_;
};

// 256 and 1024 ops of 64 bytes: 16 and 64 KiB, copied inside Post.
TEST_F(PostAllocationTest, NoneGrowsWithTheOpsOfABatchCopiedInPlace) {
  static_assert(1024 * 64 <= MemoryOptions{}.inline_batch_bytes);
  ExpectNoneGrowsWithTheOps(64);
}

// 256 and 1024 ops of 1 KiB, copied on the copy threads.
TEST_F(PostAllocationTest, NoneGrowsWithTheOpsOfABatchOnTheCopyThreads) {
  static_assert(256 * 1024 > MemoryOptions{}.inline_batch_bytes);
  ExpectNoneGrowsWithTheOps(1024);
}

}  // namespace
}  // namespace rdma_agent::memory

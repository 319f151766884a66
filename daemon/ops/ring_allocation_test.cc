// No heap allocation per op on a ring's native path: a RingSessions served
// over a socket pair, its batches of READs and WRITEs posted to the memory
// backend between two registrations through an imported handle, with the
// agent's metrics. Every allocation of the process is counted
// (//tests/testing:allocation_count; the ring thread included);
// in steady state a batch of 64 ops must allocate no more than one of 8.
#include <sys/mman.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "backends/buffer_table.h"
#include "backends/memory/memory_backend.h"
#include "backends/registry.h"
#include "common/fd_message.h"
#include "common/ring_protocol.h"
#include "common/shared_memory.h"
#include "common/unique_fd.h"
#include "daemon/metrics/metrics.h"
#include "daemon/ops/op_preparer.h"
#include "daemon/ops/prepared_transfers.h"
#include "daemon/ops/remote_handles.h"
#include "daemon/ops/ring_sessions.h"
#include "gtest/gtest.h"
#include "tests/testing/allocation_count.h"

namespace rdma_agent {
namespace {

constexpr uint64_t kEpoch = 7;
constexpr uid_t kUid = 501;
constexpr uint32_t kEntries = 128;
constexpr uint64_t kOpBytes = 64;

class RingAllocationTest : public ::testing::Test {
 protected:
  RingAllocationTest()
      : calls_(InFlightLimits{}),
        bytes_(ResourceQuota::Create("registered bytes", "per_user", "total",
                                     {uint64_t{1} << 30, uint64_t{1} << 30})),
        handles_(RemoteHandleLimits{}),
        prepared_(PreparedTransferLimits{}),
        metrics_("test", "test") {
    BackendEnvironment backend_env;
    backend_env.identity = {"agent-a", kEpoch};
    backend_env.directory = &table_;
    std::vector<std::unique_ptr<Backend>> backends;
    backends.push_back(std::make_unique<memory::MemoryBackend>(backend_env));
    registry_ = std::make_unique<BackendRegistry>(std::move(backends));
    OpBatchEnvironment env;
    env.registry = registry_.get();
    env.buffers = &table_;
    env.metrics = &metrics_;
    env.failures = &failures_;
    env.handles = &handles_;
    auto rings = RingSessions::Start(RingLimits{}, env, &calls_, bytes_,
                                     nullptr, &prepared_);
    EXPECT_TRUE(rings.ok()) << rings.status();
    rings_ = std::move(*rings);
  }

  ~RingAllocationTest() override {
    rings_->Shutdown(absl::CancelledError("test over"));
    if (base_ != nullptr) ::munmap(base_, geometry_.total_bytes);
  }

  // A registration of `size` bytes owned by kUid, in the table; its
  // context in `context`.
  uint64_t Register(uint64_t size, std::string* context) {
    auto memory = SharedMemory::Allocate(size, "ring_allocation_test");
    EXPECT_TRUE(memory.ok()) << memory.status();
    const uint64_t id = table_.NextId();
    auto registration = std::make_shared<Registration>(
        id, kUid, v1::ACCESS_READ_WRITE, "test", absl::StrCat("token-", id),
        std::move(*memory), /*agent_allocated=*/true);
    v1::RemoteBuffer remote;
    EXPECT_TRUE(registry_->RegisterWithAll(*registration, &remote).ok());
    remote.set_agent_id("agent-a");
    remote.set_agent_epoch(kEpoch);
    remote.set_buffer_id(id);
    remote.set_size_bytes(size);
    remote.set_access(v1::ACCESS_READ_WRITE);
    remote.set_token(registration->token());
    table_.Add(registration);
    *context = remote.SerializeAsString();
    return id;
  }

  // Opens the session as kUid and maps its ring.
  void Open() {
    int fds[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
    client_ = UniqueFd(fds[0]);
    PeerCredentials peer;
    peer.uid = kUid;
    peer.pid = 1234;
    v1::OpenRing request;
    request.set_entries(kEntries);
    // Answered on this thread; the session is then served by a ring thread.
    auto charge = connections_->Reserve(kUid, 1);
    ASSERT_TRUE(charge.ok()) << charge.status();
    rings_->Open(UniqueFd(fds[1]), std::move(*charge), peer, request);
    v1::AttachResponse response;
    auto memfd = ReceiveFdMessage(client_.get(), &response);
    ASSERT_TRUE(memfd.ok()) << memfd.status();
    ASSERT_EQ(response.code(), 0) << response.message();
    auto geometry = ring::GeometryFor(kEntries);
    ASSERT_TRUE(geometry.ok());
    geometry_ = *geometry;
    void* mapped = ::mmap(nullptr, geometry_.total_bytes,
                          PROT_READ | PROT_WRITE, MAP_SHARED, memfd->get(), 0);
    ASSERT_NE(mapped, MAP_FAILED);
    base_ = static_cast<std::byte*>(mapped);
  }

  std::atomic<uint32_t>& Word(size_t offset) {
    return ring::Word(base_, offset);
  }

  // A prepared transfer of kUid's: `count` ops as AllocationsForBatch's,
  // naming the imported handle.
  uint64_t Prepare(size_t count) {
    v1::PrepareTransferRequest request;
    for (size_t i = 0; i < count; ++i) {
      v1::Op* op = request.add_ops();
      op->set_type(i % 2 == 0 ? v1::OP_TYPE_READ_INTO_LOCAL
                              : v1::OP_TYPE_WRITE_FROM_LOCAL);
      op->set_local_buffer_id(local_);
      op->set_local_offset(i * kOpBytes);
      op->set_length(kOpBytes);
      op->set_remote_handle(handle_);
      op->set_remote_offset(i * kOpBytes);
    }
    OpPreparer preparer(&table_, kUid, &handles_);
    auto id =
        prepared_.Prepare(kUid, request, preparer, kMaxRemoteContextBytesLimit);
    EXPECT_TRUE(id.ok()) << id.status();
    return id.ok() ? *id : 0;
  }

  // Posts a batch of `count` ops (alternately READ and WRITE of kOpBytes,
  // each at its own offset), or one RUN_PREPARED entry of prepared transfer
  // `prepared` when set, and waits for its completions: the process's
  // allocations meanwhile. Every op must succeed.
  int64_t AllocationsForBatch(size_t count, uint64_t prepared = 0) {
    ring::Submission entries[kEntries];
    for (size_t i = 0; i < count; ++i) {
      ring::Submission& entry = entries[i];
      entry.opcode =
          i % 2 == 0 ? ring::kOpReadIntoLocal : ring::kOpWriteFromLocal;
      entry.user_tag = i;
      entry.local_buffer_id = local_;
      entry.local_offset = i * kOpBytes;
      entry.length = kOpBytes;
      entry.remote_handle = handle_;
      entry.remote_offset = i * kOpBytes;
    }
    if (prepared != 0) {
      count = 1;
      entries[0] = ring::Submission();
      entries[0].opcode = ring::kOpRunPrepared;
      entries[0].remote_handle = prepared;
    }
    entries[count - 1].flags = ring::kEndOfBatch;
    const int64_t before = testing::Allocations();
    for (size_t i = 0; i < count; ++i) {
      std::memcpy(base_ + geometry_.submissions_offset +
                      uint64_t{(sq_tail_ + i) & geometry_.mask()} *
                          ring::kSubmissionBytes,
                  &entries[i], sizeof(entries[i]));
    }
    sq_tail_ += static_cast<uint32_t>(count);
    Word(ring::kSqTailOffset).store(sq_tail_, std::memory_order_seq_cst);
    const char doorbell = 1;
    (void)::send(client_.get(), &doorbell, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
    const uint32_t expected = cq_head_ + static_cast<uint32_t>(count);
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (Word(ring::kCqTailOffset).load(std::memory_order_acquire) !=
               expected &&
           absl::Now() < deadline) {
    }
    const int64_t after = testing::Allocations();
    EXPECT_EQ(Word(ring::kCqTailOffset).load(), expected);
    std::string message;
    for (; cq_head_ != expected; ++cq_head_) {
      const ring::Completion completion =
          ring::ReadCompletion(base_, geometry_, cq_head_, &message);
      EXPECT_EQ(completion.code, 0) << message;
    }
    Word(ring::kCqHeadOffset).store(cq_head_, std::memory_order_seq_cst);
    return after - before;
  }

  // The fewest allocations of `rounds` batches of `count` ops (or runs of
  // prepared transfer `prepared`).
  int64_t SteadyAllocations(size_t count, int rounds, uint64_t prepared = 0) {
    int64_t fewest = INT64_MAX;
    for (int i = 0; i < rounds; ++i) {
      fewest = std::min(fewest, AllocationsForBatch(count, prepared));
    }
    return fewest;
  }

  // Registers the two buffers, imports the remote one and opens the ring.
  void SetUpRing() {
    std::string context;
    local_ = Register(kEntries * kOpBytes, &context);
    Register(kEntries * kOpBytes, &context);
    auto imported =
        handles_.Import(kUid, context, kMaxRemoteContextBytesLimit, *registry_);
    ASSERT_TRUE(imported.ok()) << imported.status();
    handle_ = imported->handle;
    Open();
    ASSERT_NE(base_, nullptr);
  }

  BufferTable table_{kEpoch};
  std::unique_ptr<BackendRegistry> registry_;
  ActiveCalls calls_;
  std::shared_ptr<ResourceQuota> bytes_;
  RemoteHandleTable handles_;
  PreparedTransferTable prepared_;
  AgentMetrics metrics_;
  FailedOpLog failures_;
  std::unique_ptr<RingSessions> rings_;
  std::shared_ptr<ResourceQuota> connections_ = ResourceQuota::Create(
      "attach connections", "per_user", "total", {16, 16});
  UniqueFd client_;
  ring::Geometry geometry_;
  std::byte* base_ = nullptr;
  uint32_t sq_tail_ = 0;
  uint32_t cq_head_ = 0;
  uint64_t local_ = 0;
  uint64_t handle_ = 0;
};

TEST_F(RingAllocationTest, ABatchAllocatesTheSameForEightOpsAsForSixtyFour) {
  ASSERT_NO_FATAL_FAILURE(SetUpRing());
  // Warm: every vector and map of the session has grown to its size.
  SteadyAllocations(8, 5);
  SteadyAllocations(64, 5);
  // The fewest of several rounds: a batch's own allocations, without a
  // stray one of a thread that happened to run meanwhile.
  const int64_t for_8 = SteadyAllocations(8, 20);
  const int64_t for_64 = SteadyAllocations(64, 20);
  std::cout << "ring batch through the memory backend: " << for_8
            << " allocations for 8 ops, " << for_64 << " for 64\n";
  EXPECT_LE(for_64, for_8) << "an allocation per op";
  // What a batch allocates (the admission of its ops, the registry's and
  // the memory backend's per-batch state) stays a handful; the metrics
  // series and the session's vectors are found and grown once.
  EXPECT_LE(for_8, 20);
}

// A prepared transfer's run builds nothing per op either: its ops are kept
// as plain descriptions, checked again and posted from them.
TEST_F(RingAllocationTest,
       ARunPreparedAllocatesTheSameForEightOpsAsForSixtyFour) {
  ASSERT_NO_FATAL_FAILURE(SetUpRing());
  const uint64_t eight = Prepare(8);
  const uint64_t sixty_four = Prepare(64);
  SteadyAllocations(1, 5, eight);
  SteadyAllocations(1, 5, sixty_four);
  const int64_t for_8 = SteadyAllocations(1, 20, eight);
  const int64_t for_64 = SteadyAllocations(1, 20, sixty_four);
  std::cout << "RUN_PREPARED through the memory backend: " << for_8
            << " allocations for 8 ops, " << for_64 << " for 64\n";
  EXPECT_LE(for_64, for_8) << "an allocation per op";
  EXPECT_LE(for_8, 20);
}

}  // namespace
}  // namespace rdma_agent

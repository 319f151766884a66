// What only the memory backend does; the contract every backend keeps is
// backends/testing/backend_contract_test.cc.
#include "backends/memory/memory_backend.h"

#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "backends/testing/harness.h"
#include "gtest/gtest.h"
#include "tests/testing/pattern.h"

namespace rdma_agent::memory {
namespace {

using ::absl::StatusCode;
using testing::Apply;
using testing::FindMismatch;
using testing::FirstChangedByte;
using testing::FirstDifference;
using testing::FirstWrongByte;
using testing::In;
using testing::MakeOp;
using testing::Snapshot;
using testing::TestAgent;
using testing::TestBuffer;

constexpr v1::OpType kRead = v1::OP_TYPE_READ_INTO_LOCAL;
constexpr v1::OpType kWrite = v1::OP_TYPE_WRITE_FROM_LOCAL;

std::unique_ptr<TestAgent> MemoryAgent(const std::string& agent_id,
                                       MemoryOptions options = {}) {
  auto agent =
      TestAgent::Create(agent_id,
                        [options](const BackendEnvironment& env)
                            -> absl::StatusOr<std::unique_ptr<Backend>> {
                          return std::make_unique<MemoryBackend>(env, options);
                        });
  EXPECT_TRUE(agent.ok()) << agent.status();
  return agent.ok() ? std::move(*agent) : nullptr;
}

TEST(MemoryBackendTest, DescribesItself) {
  auto agent = MemoryAgent("agent-m");
  Backend& backend = agent->backend();
  EXPECT_EQ(backend.name(), "memory");
  EXPECT_EQ(backend.transport_level(), v1::TRANSPORT_LEVEL_MEMORY);
  EXPECT_TRUE(backend.available());
  EXPECT_EQ(backend.unavailable_reason(), "");
  EXPECT_EQ(backend.transport_info().attributes().at("agent_id"), "agent-m");
  EXPECT_TRUE(backend.peer_services().empty());
  TestBuffer buffer = agent->Register(64, v1::ACCESS_READ_WRITE, 1);
  ASSERT_EQ(buffer.context->endpoints_size(), 1);
  EXPECT_EQ(buffer.context->endpoints(0).backend(), "memory");
  EXPECT_TRUE(buffer.context->endpoints(0).has_memory());
}

TEST(MemoryBackendTest, ReachesOnlyItsOwnAgentsMemoryEndpoints) {
  auto a = MemoryAgent("agent-a");
  auto b = MemoryAgent("agent-b");
  TestBuffer own = a->Register(64, v1::ACCESS_READ_WRITE, 1);
  TestBuffer other = b->Register(64, v1::ACCESS_READ_WRITE, 2);
  EXPECT_TRUE(a->backend().CanReach(*own.context));
  EXPECT_FALSE(a->backend().CanReach(*other.context));
  EXPECT_TRUE(b->backend().CanReach(*other.context));
  // Its own agent id, but no memory endpoint.
  v1::RemoteBuffer tcp_only = *own.context;
  tcp_only.clear_endpoints();
  tcp_only.add_endpoints()->set_backend("tcp");
  EXPECT_FALSE(a->backend().CanReach(tcp_only));
  // A "memory" entry that is not a memory endpoint.
  v1::RemoteBuffer hollow = *own.context;
  hollow.clear_endpoints();
  hollow.add_endpoints()->set_backend("memory");
  EXPECT_FALSE(a->backend().CanReach(hollow));
}

TEST(MemoryBackendTest, CopiesWithinOneRegistrationEvenOverlapping) {
  auto agent = MemoryAgent("agent-m");
  TestBuffer buffer = agent->Register(1 << 16, v1::ACCESS_READ_WRITE, 5);
  // [100, 100 + 30000) into [107, ...): source and destination overlap.
  const auto results = agent->backend().Submit(
      {MakeOp(0, kRead, buffer, 107, 30000, buffer, 100)},
      In(absl::Seconds(10)));
  ASSERT_TRUE(results[0].ok()) << results[0];
  EXPECT_EQ(FirstWrongByte(buffer, buffer.seed, 100, 107, 30000), std::nullopt)
      << "a memmove, not a memcpy";
}

TEST(MemoryBackendTest, CountsBytesMovedAndServedOnlyForDoneOps) {
  auto agent = MemoryAgent("agent-m");
  TestBuffer near = agent->Register(4096, v1::ACCESS_READ_WRITE, 1);
  TestBuffer far = agent->Register(4096, v1::ACCESS_READ_WRITE, 2);
  ASSERT_TRUE(agent->backend()
                  .Submit({MakeOp(0, kWrite, near, 0, 1000, far, 10),
                           MakeOp(1, kRead, near, 2000, 24, far, 0)},
                          In(absl::Seconds(10)))[0]
                  .ok());
  EXPECT_EQ(near.registration->bytes_moved(), 1024u);
  EXPECT_EQ(far.registration->bytes_served(), 1024u);
  EXPECT_EQ(near.registration->bytes_served(), 0u);
  Cancellation cancelled;
  cancelled.Cancel(absl::UnavailableError("shutting down"));
  const auto results =
      agent->backend().Submit({MakeOp(0, kWrite, near, 0, 1000, far, 10)},
                              StopToken(In(absl::Seconds(10)), &cancelled));
  EXPECT_EQ(results[0].code(), StatusCode::kUnavailable) << results[0];
  EXPECT_EQ(near.registration->bytes_moved(), 1024u);
  EXPECT_EQ(far.registration->bytes_served(), 1024u);
}

// One Submit of many ops on a few contexts, as clients send them: the
// directory is consulted once per distinct context, but a forged token that
// shares the buffer id, an op outside its range or against its buffer's
// access is refused on its own, and moves nothing; every good op moves
// exactly its range.
TEST(MemoryBackendTest, ABatchOnSharedContextsStillChecksEveryOp) {
  auto agent = MemoryAgent("agent-m");
  constexpr uint64_t kSize = 1 << 16;
  TestBuffer near = agent->Register(kSize, v1::ACCESS_READ_WRITE, 1);
  TestBuffer far = agent->Register(kSize, v1::ACCESS_READ_WRITE, 2);
  TestBuffer read_only = agent->Register(kSize, v1::ACCESS_READ, 3);
  TestBuffer forged = far.WithContext([](v1::RemoteBuffer& r) {
    r.set_token(std::string(r.token().size(), 'x'));
  });
  // Claims READ_WRITE on a READ buffer.
  TestBuffer lying = read_only.WithContext(
      [](v1::RemoteBuffer& r) { r.set_access(v1::ACCESS_READ_WRITE); });
  std::vector<Op> ops;
  std::vector<StatusCode> expected;
  auto add = [&](Op op, StatusCode code) {
    op.index = ops.size();
    ops.push_back(std::move(op));
    expected.push_back(code);
  };
  for (uint64_t i = 0; i < 200; ++i) {
    const uint64_t at = i * 256;
    switch (i % 8) {
      case 0:  // forged token, same buffer id, never moves a byte
        add(MakeOp(0, i % 16 == 0 ? kWrite : kRead, near, at, 64, forged, at),
            StatusCode::kNotFound);
        break;
      case 1:  // past the end of the shared context's buffer
        add(MakeOp(0, kWrite, near, at, 64, far, kSize - 63),
            StatusCode::kOutOfRange);
        break;
      case 2:  // writing into the READ buffer through a lying context
        add(MakeOp(0, kWrite, near, at, 64, lying, at),
            StatusCode::kPermissionDenied);
        break;
      case 3:  // reading it through the same lying context is allowed
        add(MakeOp(0, kRead, near, at, 64, lying, at), StatusCode::kOk);
        break;
      default:
        add(MakeOp(0, i % 2 == 0 ? kWrite : kRead, near, at, 64 + i % 5, far,
                   at + 7),
            StatusCode::kOk);
    }
  }
  std::vector<uint8_t> near_image = Snapshot(near);
  std::vector<uint8_t> far_image = Snapshot(far);
  std::vector<uint8_t> read_only_image = Snapshot(read_only);
  for (size_t i = 0; i < ops.size(); ++i) {
    if (expected[i] != StatusCode::kOk) continue;
    Apply(ops[i], near_image,
          ops[i].remote == lying.context ? read_only_image : far_image);
  }
  agent->gate().Close(absl::InfinitePast());
  const auto results = agent->backend().Submit(ops, In(absl::Seconds(10)));
  ASSERT_EQ(results.size(), ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    EXPECT_EQ(results[i].code(), expected[i])
        << "op " << i << ": " << results[i];
  }
  EXPECT_EQ(FirstDifference(near, near_image), std::nullopt);
  EXPECT_EQ(FirstDifference(far, far_image), std::nullopt);
  EXPECT_EQ(FirstDifference(read_only, read_only_image), std::nullopt);
  EXPECT_EQ(FirstChangedByte(read_only), std::nullopt);
  // One lookup per distinct context (far, forged, lying), not per op.
  EXPECT_TRUE(agent->gate().AwaitArrivals(3, absl::ZeroDuration()));
  EXPECT_FALSE(agent->gate().AwaitArrivals(4, absl::ZeroDuration()));
}

// Small ops read the clock only now and then (kClockCheckBytes), but always
// after a directory lookup, which may have waited: a deadline or a
// cancellation that came while the first lookup was held stops that op and
// every later one before any byte is copied.
TEST(MemoryBackendTest, ADeadlineOrCancellationDuringALookupStopsSmallOps) {
  auto agent = MemoryAgent("agent-m");
  TestBuffer near = agent->Register(1 << 16, v1::ACCESS_READ_WRITE, 1);
  TestBuffer far = agent->Register(1 << 16, v1::ACCESS_READ_WRITE, 2);
  TestBuffer other = agent->Register(1 << 16, v1::ACCESS_READ_WRITE, 3);
  std::vector<Op> ops;
  for (uint64_t i = 0; i < 100; ++i) {
    ops.push_back(MakeOp(i, i % 2 == 0 ? kWrite : kRead, near, i * 64, 64,
                         i % 3 == 0 ? other : far, i * 64));
  }
  {
    // The lookups answer only after the deadline.
    const absl::Time deadline = In(absl::Milliseconds(100));
    agent->gate().Close(deadline + absl::Milliseconds(100));
    const auto results = agent->backend().Submit(ops, deadline);
    agent->gate().Open();
    for (size_t i = 0; i < ops.size(); ++i) {
      EXPECT_EQ(results[i].code(), StatusCode::kDeadlineExceeded)
          << "op " << i << ": " << results[i];
    }
  }
  {
    Cancellation cancellation;
    agent->gate().Close();
    std::vector<absl::Status> results;
    std::thread submit([&] {
      results = agent->backend().Submit(
          ops, StopToken(In(absl::Seconds(60)), &cancellation));
    });
    EXPECT_TRUE(agent->gate().AwaitArrivals(1, absl::Seconds(60)));
    cancellation.Cancel(absl::CancelledError("the client went away"));
    agent->gate().Open();
    submit.join();
    for (size_t i = 0; i < ops.size(); ++i) {
      EXPECT_EQ(results[i].code(), StatusCode::kCancelled)
          << "op " << i << ": " << results[i];
    }
  }
  EXPECT_EQ(FirstChangedByte(near), std::nullopt);
  EXPECT_EQ(FirstChangedByte(far), std::nullopt);
  EXPECT_EQ(FirstChangedByte(other), std::nullopt);
  EXPECT_EQ(near.registration->bytes_moved(), 0u);
}

// How a posted batch ended: its statuses and the thread done ran on.
struct Posted {
  std::vector<absl::Status> statuses;
  std::thread::id thread;
  absl::Notification ended;

  OpsDone Done() {
    return [this](std::vector<absl::Status> given) {
      statuses = std::move(given);
      thread = std::this_thread::get_id();
      ended.Notify();
    };
  }
};

// Up to MemoryOptions::inline_batch_bytes a batch is copied inside Post, on
// the posting thread; a larger one on a copy thread.
TEST(MemoryBackendTest, PostCopiesSmallBatchesInPlaceAndLargeOnesOnAPool) {
  auto agent = MemoryAgent("agent-m");
  constexpr uint64_t kInline = MemoryOptions{}.inline_batch_bytes;
  TestBuffer near = agent->Register(4 * kInline, v1::ACCESS_READ_WRITE, 1);
  TestBuffer far = agent->Register(4 * kInline, v1::ACCESS_READ_WRITE, 2);
  // Two ops of half the bound: the whole batch is inline.
  const std::vector<Op> small = {
      MakeOp(0, kWrite, near, 0, kInline / 2, far, 0),
      MakeOp(1, kRead, near, kInline / 2, kInline / 2, far, kInline)};
  Posted in_place;
  agent->backend().Post(small, In(absl::Seconds(10)), in_place.Done());
  ASSERT_TRUE(in_place.ended.HasBeenNotified()) << "copied inside Post";
  EXPECT_EQ(in_place.thread, std::this_thread::get_id());
  for (const absl::Status& status : in_place.statuses) {
    EXPECT_TRUE(status.ok()) << status;
  }
  // One byte more: the copy threads.
  const std::vector<Op> large = {
      MakeOp(0, kWrite, near, 0, kInline / 2, far, 0),
      MakeOp(1, kRead, near, kInline / 2, kInline / 2 + 1, far, kInline)};
  Posted pooled;
  agent->backend().Post(large, In(absl::Seconds(10)), pooled.Done());
  pooled.ended.WaitForNotification();
  EXPECT_NE(pooled.thread, std::this_thread::get_id());
  for (const absl::Status& status : pooled.statuses) {
    EXPECT_TRUE(status.ok()) << status;
  }
  EXPECT_EQ(
      FirstWrongByte(near, far.seed, kInline, kInline / 2, kInline / 2 + 1),
      std::nullopt);
}

// With every copy thread busy and the queue full, Post copies the batch
// itself rather than wait for room; the queued batches still end, each
// once, on the copy thread.
TEST(MemoryBackendTest, AFullQueueCopiesOnThePostingThreadRatherThanWait) {
  MemoryOptions options;
  options.copy_threads = 1;
  options.max_queued_batches = 1;
  auto agent = MemoryAgent("agent-m", options);
  constexpr uint64_t kLength = 256 << 10;
  TestBuffer near = agent->Register(3 * kLength, v1::ACCESS_READ_WRITE, 1);
  TestBuffer far = agent->Register(3 * kLength, v1::ACCESS_READ_WRITE, 2);
  std::vector<std::vector<Op>> batches;
  for (uint64_t b = 0; b < 3; ++b) {
    batches.push_back(
        {MakeOp(0, kRead, near, b * kLength, kLength, far, b * kLength)});
  }
  // The directory answers only after a while: the one copy thread holds
  // the first batch there, the second waits in the queue.
  agent->gate().Close(In(absl::Milliseconds(300)));
  Posted first, second, third;
  agent->backend().Post(batches[0], In(absl::Seconds(10)), first.Done());
  ASSERT_TRUE(agent->gate().AwaitArrivals(1, absl::Seconds(10)));
  agent->backend().Post(batches[1], In(absl::Seconds(10)), second.Done());
  agent->backend().Post(batches[2], In(absl::Seconds(10)), third.Done());
  ASSERT_TRUE(third.ended.HasBeenNotified()) << "copied inside Post";
  EXPECT_EQ(third.thread, std::this_thread::get_id());
  first.ended.WaitForNotification();
  second.ended.WaitForNotification();
  EXPECT_NE(first.thread, std::this_thread::get_id());
  EXPECT_EQ(second.thread, first.thread) << "the one copy thread";
  for (Posted* posted : {&first, &second, &third}) {
    ASSERT_EQ(posted->statuses.size(), 1u);
    EXPECT_TRUE(posted->statuses[0].ok()) << posted->statuses[0];
  }
  EXPECT_EQ(FindMismatch(near.span().subspan(0, 3 * kLength), far.seed),
            std::nullopt);
}

// Batches still queued when the backend goes end first, each once: by the
// backend's destruction, done has been called for every batch posted.
TEST(MemoryBackendTest, DestructionEndsEveryQueuedBatch) {
  MemoryOptions options;
  options.copy_threads = 1;
  auto agent = MemoryAgent("agent-m", options);
  constexpr uint64_t kLength = 256 << 10;
  constexpr int kBatches = 8;
  TestBuffer near =
      agent->Register(kBatches * kLength, v1::ACCESS_READ_WRITE, 1);
  TestBuffer far =
      agent->Register(kBatches * kLength, v1::ACCESS_READ_WRITE, 2);
  std::vector<std::vector<Op>> batches;
  for (uint64_t b = 0; b < kBatches; ++b) {
    batches.push_back(
        {MakeOp(0, kWrite, near, b * kLength, kLength, far, b * kLength)});
  }
  std::vector<std::unique_ptr<Posted>> posted;
  agent->gate().Close(In(absl::Milliseconds(100)));
  for (const auto& batch : batches) {
    posted.push_back(std::make_unique<Posted>());
    agent->backend().Post(batch, In(absl::Seconds(10)), posted.back()->Done());
  }
  agent->DestroyBackend();
  for (int b = 0; b < kBatches; ++b) {
    ASSERT_TRUE(posted[b]->ended.HasBeenNotified()) << "batch " << b;
    ASSERT_EQ(posted[b]->statuses.size(), 1u);
  }
}

TEST(MemoryBackendTest, StopsBetweenSlicesOfAHugeCopy) {
  // Two slices: the deadline passes during the first one, so the second one
  // never starts and the op reports DEADLINE_EXCEEDED with its progress.
  constexpr uint64_t kLength = 2 * MemoryBackend::kCopySliceBytes;
  auto agent = MemoryAgent("agent-m");
  TestBuffer near = agent->Register(kLength, v1::ACCESS_READ_WRITE, 1);
  TestBuffer far = agent->Register(kLength, v1::ACCESS_READ_WRITE, 2);
  // The copy of one 64 MiB slice cannot take less than a microsecond.
  const auto results = agent->backend().Submit(
      {MakeOp(0, kRead, near, 0, kLength, far, 0)}, In(absl::Microseconds(1)));
  ASSERT_EQ(results[0].code(), StatusCode::kDeadlineExceeded) << results[0];
  // Either stopped before the copy began or after the first slice.
  EXPECT_EQ(
      testing::FindMismatch(near.span().subspan(MemoryBackend::kCopySliceBytes),
                            near.seed, MemoryBackend::kCopySliceBytes),
      std::nullopt)
      << "the second slice was copied";
  EXPECT_EQ(near.registration->bytes_moved(), 0u);
  EXPECT_EQ(FirstChangedByte(far), std::nullopt);
}

}  // namespace
}  // namespace rdma_agent::memory

// CancelTransfer at every point of a transfer's life, between two real
// rdma-agentd processes over tcp (loopback), with the bytes of both sides
// checked: before it starts (queued behind a busy worker: none of its ops
// ever runs), after it has ended (the end is returned as it was, nothing
// changes, GetTransfers still reads it), and racing the transfer's own
// deadline (many rounds: the end is exactly one of FAILED with
// DEADLINE_EXCEEDED or CANCELLED, the same in CancelTransfer's answer and in
// GetTransfers, and no byte of local memory is written, or read, once
// CancelTransfer has returned).

#include <algorithm>
#include <cstring>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/rdma_agent_client.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/eventually.h"
#include "tests/testing/pattern.h"
#include "tests/testing/transfer_calls.h"

namespace rdma_agent::testing {
namespace {

constexpr v1::OpType kRead = v1::OP_TYPE_READ_INTO_LOCAL;
constexpr v1::OpType kWrite = v1::OP_TYPE_WRITE_FROM_LOCAL;
constexpr int kCancelled = 1;         // absl::StatusCode::kCancelled
constexpr int kDeadlineExceeded = 4;  // absl::StatusCode::kDeadlineExceeded
constexpr int kOutOfRange = 11;       // absl::StatusCode::kOutOfRange

constexpr uint64_t kBlockerHalf = 64ull << 20;
constexpr int kBlockerOps = 4096;  // 256 GiB of copying: never ends by itself

AgentProcess::Options TcpAgent(std::vector<std::string> flags = {}) {
  AgentProcess::Options options;
  options.backends = "memory,tcp";
  options.log_level = "info";  // debug would log every chunk
  options.extra_flags = std::move(flags);
  return options;
}

class TransfersCancelRaceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // One transfer worker on a: a transfer queued behind a long one stays
    // queued until that one ends.
    auto a = AgentProcess::Start(TcpAgent({"--transfer_workers=1"}));
    ASSERT_TRUE(a.ok()) << a.status();
    a_ = std::move(*a);
    auto b = AgentProcess::Start(TcpAgent());
    ASSERT_TRUE(b.ok()) << b.status();
    b_ = std::move(*b);
    stub_ = v1::RdmaAgent::NewStub(a_->client().channel());
  }

  void TearDown() override {
    if (HasFailure()) {
      ADD_FAILURE() << "agent a log:\n" << a_->Log();
      ADD_FAILURE() << "agent b log:\n" << b_->Log();
    }
  }

  // A mapped buffer of `size` on `agent`, filled with pattern `seed`.
  client::Buffer On(AgentProcess& agent, uint64_t size, uint64_t seed) {
    auto buffer = agent.client().Attach(size, v1::ACCESS_READ_WRITE);
    EXPECT_TRUE(buffer.ok()) << buffer.status();
    if (!buffer.ok()) std::abort();
    FillPattern(buffer->bytes(), seed);
    return std::move(*buffer);
  }

  // Thousands of 64 MiB copies inside one buffer of a (memory backend),
  // running on a's one worker once this returns.
  uint64_t StartBlocker() {
    if (!blocker_.has_value()) {
      auto buffer = a_->client().AllocateUnmapped(2 * kBlockerHalf,
                                                  v1::ACCESS_READ_WRITE);
      EXPECT_TRUE(buffer.ok()) << buffer.status();
      if (!buffer.ok()) return 0;
      blocker_ = *buffer;
    }
    std::vector<v1::Op> ops(kBlockerOps,
                            MakeWireOp(kRead, blocker_->id, 0, kBlockerHalf,
                                       blocker_->remote_context, kBlockerHalf));
    auto id = SubmitAsync(*stub_, MakeBatch(std::move(ops), absl::Minutes(10)));
    EXPECT_TRUE(id.ok()) << id.status();
    if (!id.ok()) return 0;
    EXPECT_TRUE(Eventually(
        [&] {
          auto transfer = GetTransfer(*stub_, *id);
          return transfer.ok() && transfer->has_start_time();
        },
        absl::Seconds(30)))
        << "the blocker never started";
    return *id;
  }

  // Waits until a's worker has run everything submitted before: a tiny
  // transfer submitted now ends DONE (first in, first out).
  void AwaitWorkerPast() {
    const client::Buffer& marker = Marker();
    auto id = SubmitAsync(
        *stub_, MakeBatch({MakeWireOp(kRead, marker, 0, 8, marker, 8)},
                          absl::Seconds(60)));
    ASSERT_TRUE(id.ok()) << id.status();
    auto end = GetTransfer(*stub_, *id, absl::Seconds(60));
    ASSERT_TRUE(end.ok()) << end.status();
    ASSERT_EQ(end->state(), v1::TRANSFER_STATE_DONE) << DescribeFailures(*end);
  }

  const client::Buffer& Marker() {
    if (!marker_.has_value()) marker_.emplace(On(*a_, 4096, 99));
    return *marker_;
  }

  std::unique_ptr<AgentProcess> a_;
  std::unique_ptr<AgentProcess> b_;
  std::unique_ptr<v1::RdmaAgent::Stub> stub_;
  std::optional<client::Registration> blocker_;
  std::optional<client::Buffer> marker_;
};

TEST_F(TransfersCancelRaceTest, CancelBeforeStartRunsNoOpOnEitherSide) {
  constexpr uint64_t kSize = 8ull << 20;
  client::Buffer local = On(*a_, kSize, 1);
  client::Buffer remote = On(*b_, kSize, 2);
  const uint64_t blocker = StartBlocker();
  ASSERT_NE(blocker, 0u);
  // Queued behind it: a READ into local and a WRITE into remote, over tcp;
  // and a batch of both.
  const std::vector<v1::SubmitRequest> requests = {
      MakeBatch({MakeWireOp(kRead, local, 3, kSize - 3, remote, 0)},
                absl::Minutes(5)),
      MakeBatch({MakeWireOp(kWrite, local, 0, kSize - 5, remote, 5)},
                absl::Minutes(5)),
      MakeBatch({MakeWireOp(kRead, local, 0, 4096, remote, 0),
                 MakeWireOp(kWrite, local, 4096, 4096, remote, 4096)},
                absl::Minutes(5)),
  };
  std::vector<uint64_t> ids;
  for (const v1::SubmitRequest& request : requests) {
    auto id = SubmitAsync(*stub_, request);
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  for (size_t k = 0; k < ids.size(); ++k) {
    SCOPED_TRACE(absl::StrCat("transfer ", k));
    auto pending = GetTransfer(*stub_, ids[k]);
    ASSERT_TRUE(pending.ok()) << pending.status();
    EXPECT_EQ(pending->state(), v1::TRANSFER_STATE_PENDING);
    EXPECT_FALSE(pending->has_start_time()) << "it should still be queued";

    auto cancelled = CancelTransfer(*stub_, ids[k]);
    ASSERT_TRUE(cancelled.ok()) << cancelled.status();
    EXPECT_EQ(cancelled->state(), v1::TRANSFER_STATE_CANCELLED);
    EXPECT_FALSE(cancelled->has_start_time()) << "it never ran";
    EXPECT_TRUE(cancelled->has_end_time());
    ASSERT_EQ(cancelled->results_size(), requests[k].ops_size());
    for (const v1::OpResult& result : cancelled->results()) {
      EXPECT_EQ(result.code(), kCancelled) << result.message();
      EXPECT_TRUE(result.backend().empty())
          << "no backend ran it: " << result.backend();
    }
    // Cancelling again answers the same end; reading it too.
    auto again = CancelTransfer(*stub_, ids[k]);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->SerializeAsString(), cancelled->SerializeAsString());
    auto read = GetTransfer(*stub_, ids[k]);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(read->SerializeAsString(), cancelled->SerializeAsString());
  }
  // The worker gets past the blocker and runs what was queued after them.
  ASSERT_TRUE(CancelTransfer(*stub_, blocker).ok());
  ASSERT_NO_FATAL_FAILURE(AwaitWorkerPast());
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(FindMismatch(local.bytes(), 1), std::nullopt)
      << "a cancelled READ wrote into local memory";
  EXPECT_EQ(FindMismatch(remote.bytes(), 2), std::nullopt)
      << "a cancelled WRITE reached the remote buffer";
  // Nothing stuck: the same ops run now.
  auto id = SubmitAsync(*stub_, requests[0]);
  ASSERT_TRUE(id.ok()) << id.status();
  auto end = GetTransfer(*stub_, *id, absl::Seconds(60));
  ASSERT_TRUE(end.ok()) << end.status();
  EXPECT_EQ(end->state(), v1::TRANSFER_STATE_DONE) << DescribeFailures(*end);
  EXPECT_EQ(FirstMismatch(local.bytes(), 2, 0, 3, kSize - 3, 1), std::nullopt);
}

TEST_F(TransfersCancelRaceTest, CancelAfterTheEndReturnsItAndChangesNothing) {
  constexpr uint64_t kSize = 4ull << 20;
  client::Buffer local = On(*a_, kSize, 1);
  client::Buffer remote = On(*b_, kSize, 2);
  // DONE: a READ and a WRITE at odd offsets over tcp. FAILED: one good op
  // and one past the end of the remote buffer.
  auto done = SubmitAsync(
      *stub_,
      MakeBatch({MakeWireOp(kRead, local, 5, 100003, remote, 7),
                 MakeWireOp(kWrite, local, 200001, 70001, remote, 300003)},
                absl::Seconds(60)));
  ASSERT_TRUE(done.ok()) << done.status();
  auto failed = SubmitAsync(
      *stub_, MakeBatch({MakeWireOp(kRead, local, 1000000, 10, remote, 0),
                         MakeWireOp(kRead, local, 0, 100, remote, kSize - 50)},
                        absl::Seconds(60)));
  ASSERT_TRUE(failed.ok()) << failed.status();
  // One worker, first in first out: once the marker has ended, so have
  // both (which nobody has read yet).
  ASSERT_NO_FATAL_FAILURE(AwaitWorkerPast());
  const std::vector<std::byte> local_before(local.bytes().begin(),
                                            local.bytes().end());
  const std::vector<std::byte> remote_before(remote.bytes().begin(),
                                             remote.bytes().end());

  struct Case {
    uint64_t id;
    v1::TransferState state;
    std::vector<int> codes;
  };
  for (const Case& c :
       {Case{*done, v1::TRANSFER_STATE_DONE, {0, 0}},
        Case{*failed, v1::TRANSFER_STATE_FAILED, {0, kOutOfRange}}}) {
    SCOPED_TRACE(absl::StrCat("transfer ", c.id));
    auto cancelled = CancelTransfer(*stub_, c.id);
    ASSERT_TRUE(cancelled.ok()) << cancelled.status();
    EXPECT_EQ(cancelled->state(), c.state) << DescribeFailures(*cancelled);
    ASSERT_EQ(cancelled->results_size(), static_cast<int>(c.codes.size()));
    for (size_t i = 0; i < c.codes.size(); ++i) {
      EXPECT_EQ(cancelled->results(static_cast<int>(i)).code(), c.codes[i]);
    }
    EXPECT_TRUE(cancelled->has_start_time());
    EXPECT_TRUE(cancelled->has_end_time());
    // Again: the same answer.
    auto again = CancelTransfer(*stub_, c.id);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->SerializeAsString(), cancelled->SerializeAsString());
    // Not reported by CancelTransfer: GetTransfers reads the same end, and
    // only then is it gone.
    auto read = GetTransfer(*stub_, c.id);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(read->SerializeAsString(), cancelled->SerializeAsString());
    EXPECT_TRUE(absl::IsNotFound(GetTransfer(*stub_, c.id).status()));
    EXPECT_TRUE(absl::IsNotFound(CancelTransfer(*stub_, c.id).status()));
  }
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_TRUE(std::equal(local_before.begin(), local_before.end(),
                         local.bytes().begin()))
      << "local memory changed after the transfers had ended";
  EXPECT_TRUE(std::equal(remote_before.begin(), remote_before.end(),
                         remote.bytes().begin()))
      << "remote memory changed after the transfers had ended";
  // And they had done exactly their ops.
  const absl::Span<const std::byte> bytes = local.bytes();
  EXPECT_EQ(FirstMismatch(bytes.subspan(0, 1000000), 2, 7, 5, 100003, 1),
            std::nullopt);
  EXPECT_EQ(FindMismatch(bytes.subspan(1000000, 10), 2, 0), std::nullopt);
  EXPECT_EQ(FindMismatch(bytes.subspan(1000010), 1, 1000010), std::nullopt);
  EXPECT_EQ(FirstMismatch(remote.bytes(), 1, 200001, 300003, 70001, 2),
            std::nullopt);
}

// Local bytes [0, kRegion) receive READs; [kRegion, 2 kRegion) are the
// source of WRITEs into the remote's [kRegion, 2 kRegion).
constexpr uint64_t kRegion = 16ull << 20;
// 4 GiB each way per round: far longer than the round's timeout.
constexpr int kOpsEachWay = 256;

// Whether every byte of `bytes` (positions from `first`) holds pattern `a`
// or pattern `b` at that position; the first that holds neither.
std::optional<uint64_t> FindNeither(absl::Span<const std::byte> bytes,
                                    uint64_t a, uint64_t b, uint64_t first) {
  constexpr uint64_t kChunk = 64 << 10;
  for (uint64_t at = 0; at < bytes.size(); at += kChunk) {
    const auto chunk = bytes.subspan(at, std::min(kChunk, bytes.size() - at));
    if (!FindMismatch(chunk, a, first + at).has_value() ||
        !FindMismatch(chunk, b, first + at).has_value()) {
      continue;
    }
    for (uint64_t i = 0; i < chunk.size(); ++i) {
      const uint64_t position = first + at + i;
      if (chunk[i] != PatternByte(a, position) &&
          chunk[i] != PatternByte(b, position)) {
        return at + i;
      }
    }
  }
  return std::nullopt;
}

TEST_F(TransfersCancelRaceTest,
       DeadlineRacingCancelEndsOneWayAndTouchesNothing) {
  constexpr uint64_t kLocalSeed = 1, kRemoteSeed = 2;
  constexpr int kRounds = 24;
  const absl::Duration timeout = absl::Milliseconds(150);
  client::Buffer local = On(*a_, 2 * kRegion, kLocalSeed);
  client::Buffer remote = On(*b_, 2 * kRegion, kRemoteSeed);
  std::vector<v1::Op> ops;
  for (int i = 0; i < kOpsEachWay; ++i) {
    ops.push_back(MakeWireOp(kRead, local, 0, kRegion, remote, 0));
    ops.push_back(MakeWireOp(kWrite, local, kRegion, kRegion, remote, kRegion));
  }
  const v1::SubmitRequest request = MakeBatch(ops, timeout);
  int cancelled_rounds = 0, deadline_rounds = 0;
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    FillPattern(local.bytes(), kLocalSeed);
    auto id = SubmitAsync(*stub_, request);
    ASSERT_TRUE(id.ok()) << id.status();
    // From well before the deadline to well after it.
    absl::SleepFor(timeout - absl::Milliseconds(40) +
                   absl::Milliseconds(80) * round / (kRounds - 1));
    auto cancelled = CancelTransfer(*stub_, *id);
    // Right away: a sentinel over all of local memory. A READ still landing
    // would overwrite some of it; a WRITE still reading it would carry it to
    // the remote.
    const uint64_t sentinel = 1000 + round;
    FillPattern(local.bytes(), sentinel);
    ASSERT_TRUE(cancelled.ok()) << cancelled.status();

    const v1::Transfer& end = *cancelled;
    int ok = 0, stopped = 0, expired = 0, other = 0;
    for (const v1::OpResult& result : end.results()) {
      ok += result.code() == 0;
      stopped += result.code() == kCancelled;
      expired += result.code() == kDeadlineExceeded;
      other += result.code() != 0 && result.code() != kCancelled &&
               result.code() != kDeadlineExceeded;
    }
    ASSERT_EQ(end.results_size(), request.ops_size());
    EXPECT_EQ(other, 0) << DescribeFailures(end);
    EXPECT_LT(ok, request.ops_size()) << "the batch could not have finished";
    if (end.state() == v1::TRANSFER_STATE_CANCELLED) {
      ++cancelled_rounds;
      EXPECT_GT(stopped, 0) << DescribeFailures(end);
    } else {
      ++deadline_rounds;
      EXPECT_EQ(end.state(), v1::TRANSFER_STATE_FAILED)
          << DescribeFailures(end);
      EXPECT_EQ(stopped, 0)
          << "FAILED, yet an op says CANCELLED: " << DescribeFailures(end);
      EXPECT_GT(expired, 0) << DescribeFailures(end);
    }
    // GetTransfers reads exactly the end CancelTransfer answered.
    auto read = GetTransfer(*stub_, *id);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(read->SerializeAsString(), end.SerializeAsString())
        << "CancelTransfer: " << end.ShortDebugString().substr(0, 300)
        << "\nGetTransfers: " << read->ShortDebugString().substr(0, 300);

    absl::SleepFor(absl::Milliseconds(200));
    const auto written = FindMismatch(local.bytes(), sentinel);
    ASSERT_EQ(written, std::nullopt)
        << "local byte " << *written << " written after CancelTransfer";
    const auto carried = FindNeither(remote.bytes().subspan(kRegion, kRegion),
                                     kRemoteSeed, kLocalSeed, kRegion);
    ASSERT_EQ(carried, std::nullopt)
        << "remote byte " << kRegion + *carried
        << " holds local memory read after CancelTransfer";
  }
  std::cout << cancelled_rounds << " rounds ended CANCELLED, "
            << deadline_rounds << " FAILED by the deadline\n";
  // The agent still moves bytes both ways.
  FillPattern(local.bytes(), kLocalSeed);
  FillPattern(remote.bytes(), kRemoteSeed);
  auto id = SubmitAsync(
      *stub_,
      MakeBatch({MakeWireOp(kRead, local, 1, 1000, remote, 3),
                 MakeWireOp(kWrite, local, kRegion, 1000, remote, kRegion + 5)},
                absl::Seconds(60)));
  ASSERT_TRUE(id.ok()) << id.status();
  auto end = GetTransfer(*stub_, *id, absl::Seconds(60));
  ASSERT_TRUE(end.ok()) << end.status();
  EXPECT_EQ(end->state(), v1::TRANSFER_STATE_DONE) << DescribeFailures(*end);
  EXPECT_EQ(FirstMismatch(local.bytes(), kRemoteSeed, 3, 1, 1000, kLocalSeed),
            std::nullopt);
  EXPECT_EQ(FirstMismatch(remote.bytes(), kLocalSeed, kRegion, kRegion + 5,
                          1000, kRemoteSeed),
            std::nullopt);
}

}  // namespace
}  // namespace rdma_agent::testing

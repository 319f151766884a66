// The backend contract (backends/testing/backend_contract_test.cc) through
// the asynchronous path, for every backend of the contract suite (memory,
// tcp, ibverbs on the software RC NIC): one status per op in order with the
// same codes, backends and bytes as a synchronous Submit of the same batch,
// chunked ops moved exactly, and an in-flight batch cancelled (or cut by its
// deadline) touching no byte of local memory once the agent has answered.
//
// Why real agents: each case runs in-process Agents (the daemon as a
// library) whose only backend comes from the contract target's own factory
// (targets.h), and drives them through the RdmaAgent RPCs (SubmitAsync,
// GetTransfers, CancelTransfer). So the whole asynchronous machinery runs as
// in the daemon: the service's validation and Batch, the TransferTable's
// queue, workers, deadline and cancellation, the BackendRegistry's routing,
// and the backend itself (the soft NIC's fabric lives in this process, which
// is why these agents are in-process rather than rdma-agentd processes). A
// TransferTable driven directly with a hand-made TransferWork would test a
// copy of the daemon's Batch instead of the Batch. Buffers are memfds
// attached through the client library, mapped here, so that bytes are
// checked in place.

#include <algorithm>
#include <memory>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "backends/testing/targets.h"
#include "client/rdma_agent_client.h"
#include "gtest/gtest.h"
#include "rdma/agent/v1/remote_buffer.pb.h"
#include "tests/testing/agent_fixture.h"
#include "tests/testing/eventually.h"
#include "tests/testing/pattern.h"
#include "tests/testing/transfer_calls.h"

namespace rdma_agent {
namespace testing {
namespace {

// `message` with the rail it names ("over rail A:1->B:1") left out.
std::string WithoutRail(const std::string& message) {
  static const std::regex kRail(" over rail [^ :]+:[0-9]+->[^ :]+:[0-9]+");
  return std::regex_replace(message, kRail, "");
}

constexpr v1::OpType kRead = v1::OP_TYPE_READ_INTO_LOCAL;
constexpr v1::OpType kWrite = v1::OP_TYPE_WRITE_FROM_LOCAL;
constexpr int kOk = 0, kCancelled = 1, kDeadlineExceeded = 4, kNotFound = 5,
              kFailedPrecondition = 9, kOutOfRange = 11;

// A range of a buffer that an op filled with pattern `seed` from position
// `from` on.
struct Moved {
  uint64_t offset;
  uint64_t length;
  uint64_t seed;
  uint64_t from;
};

// The first byte of `bytes` that is neither in a `moved` range holding what
// was moved there, nor elsewhere holding pattern `own` at its position.
std::optional<uint64_t> FirstWrong(absl::Span<const std::byte> bytes,
                                   uint64_t own, std::vector<Moved> moved) {
  std::sort(moved.begin(), moved.end(),
            [](const Moved& x, const Moved& y) { return x.offset < y.offset; });
  uint64_t at = 0;
  for (const Moved& range : moved) {
    if (auto bad =
            FindMismatch(bytes.subspan(at, range.offset - at), own, at)) {
      return at + *bad;
    }
    if (auto bad = FindMismatch(bytes.subspan(range.offset, range.length),
                                range.seed, range.from)) {
      return range.offset + *bad;
    }
    at = range.offset + range.length;
  }
  if (auto bad = FindMismatch(bytes.subspan(at), own, at)) return at + *bad;
  return std::nullopt;
}

// The first byte of `bytes` (positions from `first`) holding neither
// pattern `a` nor pattern `b` at its position.
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
      if (chunk[i] != PatternByte(a, first + at + i) &&
          chunk[i] != PatternByte(b, first + at + i)) {
        return at + i;
      }
    }
  }
  return std::nullopt;
}

// `context` (a serialized RemoteBuffer) changed by `mutate`.
template <typename Mutate>
std::string Forged(const std::string& context, Mutate mutate) {
  v1::RemoteBuffer remote;
  EXPECT_TRUE(remote.ParseFromString(context));
  mutate(remote);
  return remote.SerializeAsString();
}

class AsyncContractTest : public ::testing::TestWithParam<BackendTarget> {
 protected:
  void SetUp() override {
    world_ = GetParam().make_world();
    for (int i = 0; i < GetParam().agents; ++i) {
      AgentOptions options;
      options.backends.push_back(world_->Factory(i));
      auto agent = InProcessAgent::Start(std::move(options));
      ASSERT_TRUE(agent.ok()) << agent.status();
      client::ConnectOptions connect;
      connect.target = (*agent)->agent().target();
      connect.attach_socket = (*agent)->agent().attach_socket_path();
      auto client = client::AgentClient::Connect(connect);
      ASSERT_TRUE(client.ok()) << client.status();
      agents_.push_back(std::move(*agent));
      clients_.push_back(std::move(*client));
    }
    auto info = clients_.front()->GetInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    ASSERT_EQ(info->backends_size(), 1);
    ASSERT_TRUE(info->backends(0).available())
        << info->backends(0).unavailable_reason();
    backend_ = info->backends(0).name();
  }

  void TearDown() override {
    // Clients and agents before the world they share.
    clients_.clear();
    agents_.clear();
  }

  v1::RdmaAgent::Stub& stub() { return agents_.front()->stub(); }

  // A buffer of agent 0 ("near") or of the last agent ("far": a second
  // agent, or the same one for the memory backend), with pattern `seed`.
  client::Buffer Near(uint64_t size, uint64_t seed) {
    return On(*clients_.front(), size, seed);
  }
  client::Buffer Far(uint64_t size, uint64_t seed) {
    return On(*clients_.back(), size, seed);
  }
  static client::Buffer On(client::AgentClient& client, uint64_t size,
                           uint64_t seed) {
    auto buffer = client.Attach(size, v1::ACCESS_READ_WRITE);
    EXPECT_TRUE(buffer.ok()) << buffer.status();
    if (!buffer.ok()) std::abort();
    FillPattern(buffer->bytes(), seed);
    return std::move(*buffer);
  }

  // A batch long enough never to end by itself within a test: kOpsEachWay
  // READs of near[0, kRegion) from far[0, kRegion) and as many WRITEs of
  // near[kRegion, 2 kRegion) into far[kRegion, 2 kRegion).
  static constexpr uint64_t kRegion = 16ull << 20;
  static constexpr int kOpsEachWay = 1024;
  v1::SubmitRequest LongBatch(const client::Buffer& near,
                              const client::Buffer& far,
                              absl::Duration timeout) {
    std::vector<v1::Op> ops;
    for (int i = 0; i < kOpsEachWay; ++i) {
      ops.push_back(MakeWireOp(kRead, near, 0, kRegion, far, 0));
      ops.push_back(MakeWireOp(kWrite, near, kRegion, kRegion, far, kRegion));
    }
    return MakeBatch(std::move(ops), timeout);
  }

  // After the agent has answered (at which point near was overwritten with
  // pattern `sentinel`), and some time for stragglers: no byte of near was
  // written (it still holds the sentinel) or read (no sentinel byte reached
  // far's WRITE region, which holds far's or near's original bytes only);
  // far's READ region is unchanged.
  void ExpectNothingTouchedAfterAnswer(const client::Buffer& near,
                                       const client::Buffer& far,
                                       uint64_t near_seed, uint64_t far_seed,
                                       uint64_t sentinel) {
    absl::SleepFor(absl::Milliseconds(300));
    const auto written = FindMismatch(near.bytes(), sentinel);
    EXPECT_EQ(written, std::nullopt)
        << "local byte " << *written << " written after the answer";
    const auto carried = FindNeither(far.bytes().subspan(kRegion, kRegion),
                                     far_seed, near_seed, kRegion);
    EXPECT_EQ(carried, std::nullopt)
        << "far byte " << kRegion + *carried
        << " holds local memory read after the answer";
    EXPECT_EQ(FindMismatch(far.bytes().subspan(0, kRegion), far_seed),
              std::nullopt)
        << "a READ changed its source";
  }

  // A small READ and WRITE run DONE with exactly their bytes.
  void ExpectStillMovesBytes() {
    client::Buffer near = Near(1 << 16, 71);
    client::Buffer far = Far(1 << 16, 72);
    auto id = SubmitAsync(
        stub(), MakeBatch({MakeWireOp(kRead, near, 3, 1000, far, 5),
                           MakeWireOp(kWrite, near, 5000, 999, far, 7000)},
                          absl::Seconds(60)));
    ASSERT_TRUE(id.ok()) << id.status();
    auto end = GetTransfer(stub(), *id, absl::Seconds(60));
    ASSERT_TRUE(end.ok()) << end.status();
    EXPECT_EQ(end->state(), v1::TRANSFER_STATE_DONE) << DescribeFailures(*end);
    EXPECT_EQ(FirstWrong(near.bytes(), 71, {{3, 1000, 72, 5}}), std::nullopt);
    EXPECT_EQ(FirstWrong(far.bytes(), 72, {{7000, 999, 71, 5000}}),
              std::nullopt);
  }

  std::unique_ptr<TargetWorld> world_;
  std::vector<std::unique_ptr<InProcessAgent>> agents_;
  std::vector<std::unique_ptr<client::AgentClient>> clients_;
  std::string backend_;  // the backend's name as GetInfo reports it
};

TEST_P(AsyncContractTest, OneResultPerOpInOrderAsSubmitGivesThem) {
  // Chunked ops (past the backend's largest message) between refusals that
  // the serving side decides, each with its own code.
  const uint64_t length = 2 * GetParam().max_message_bytes + 3;
  // far: [0, 100) and [length + 307, 2 length + 307) are written; the
  // READ's source [200, length + 200) is clear of both (the ops of a batch
  // run in any order).
  const uint64_t size = 2 * length + 8192;
  const uint64_t read_from = 200;
  const uint64_t write_at = length + 307;
  constexpr uint64_t kNearSeed = 11, kFarSeed = 12;
  client::Buffer near = Near(size, kNearSeed);
  client::Buffer far = Far(size, kFarSeed);
  const std::string& context = far.remote_context();
  const std::string oversized = Forged(context, [](v1::RemoteBuffer& c) {
    c.set_size_bytes(c.size_bytes() * 2);
  });
  const std::string stale = Forged(context, [](v1::RemoteBuffer& c) {
    c.set_agent_epoch(c.agent_epoch() + 2);
  });
  const std::string forged = Forged(context, [](v1::RemoteBuffer& c) {
    c.set_token(std::string(c.token().size(), 'x'));
  });
  const v1::SubmitRequest batch = MakeBatch(
      {MakeWireOp(kWrite, near, 0, 100, far, 0),
       MakeWireOp(kRead, near.id(), 200, 100, oversized, size - 50),
       MakeWireOp(kRead, near, 1000, length, far, read_from),
       MakeWireOp(kWrite, near.id(), 0, 100, stale, 0),
       MakeWireOp(kRead, near.id(), 0, 100, forged, 0),
       MakeWireOp(kWrite, near, 1000 + length, length, far, write_at)},
      absl::Seconds(60));
  const std::vector<int> want = {
      kOk, kOutOfRange, kOk, kFailedPrecondition, kNotFound, kOk};
  // What the ops leave: far gets two WRITEs, near one READ.
  const std::vector<Moved> far_moved = {
      {0, 100, kNearSeed, 0}, {write_at, length, kNearSeed, 1000 + length}};
  const std::vector<Moved> near_moved = {{1000, length, kFarSeed, read_from}};

  auto id = SubmitAsync(stub(), batch);
  ASSERT_TRUE(id.ok()) << id.status();
  auto end = GetTransfer(stub(), *id, absl::Seconds(60));
  ASSERT_TRUE(end.ok()) << end.status();
  EXPECT_EQ(end->state(), v1::TRANSFER_STATE_FAILED) << DescribeFailures(*end);
  ASSERT_EQ(end->results_size(), static_cast<int>(want.size()));
  for (size_t i = 0; i < want.size(); ++i) {
    const v1::OpResult& result = end->results(static_cast<int>(i));
    EXPECT_EQ(result.code(), want[i]) << "op " << i << ": " << result.message();
    if (want[i] == kOk) {
      EXPECT_EQ(result.backend(), backend_) << "op " << i;
    } else {
      EXPECT_NE(result.message().find(absl::StrCat("op ", i)),
                std::string::npos)
          << "op " << i << ": " << result.message();
    }
  }
  EXPECT_EQ(FirstWrong(near.bytes(), kNearSeed, near_moved), std::nullopt);
  EXPECT_EQ(FirstWrong(far.bytes(), kFarSeed, far_moved), std::nullopt);

  // The same batch through Submit, on fresh bytes: the same results and the
  // same bytes.
  FillPattern(near.bytes(), kNearSeed);
  FillPattern(far.bytes(), kFarSeed);
  auto sync = SubmitSync(stub(), batch);
  ASSERT_TRUE(sync.ok()) << sync.status();
  ASSERT_EQ(sync->size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    const v1::OpResult& async = end->results(static_cast<int>(i));
    EXPECT_EQ((*sync)[i].code(), async.code()) << "op " << i;
    EXPECT_EQ((*sync)[i].backend(), async.backend()) << "op " << i;
    // Word for word, except which rail carried it: a multi-rail backend
    // balances small ops over its rails, so two runs may pick two.
    EXPECT_EQ(WithoutRail((*sync)[i].message()), WithoutRail(async.message()))
        << "op " << i;
  }
  EXPECT_EQ(FirstWrong(near.bytes(), kNearSeed, near_moved), std::nullopt);
  EXPECT_EQ(FirstWrong(far.bytes(), kFarSeed, far_moved), std::nullopt);

  // Only the good ops: DONE.
  FillPattern(near.bytes(), kNearSeed);
  FillPattern(far.bytes(), kFarSeed);
  v1::SubmitRequest good;
  for (int i : {0, 2, 5}) *good.add_ops() = batch.ops(i);
  *good.mutable_timeout() = batch.timeout();
  auto done_id = SubmitAsync(stub(), good);
  ASSERT_TRUE(done_id.ok()) << done_id.status();
  auto done = GetTransfer(stub(), *done_id, absl::Seconds(60));
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->state(), v1::TRANSFER_STATE_DONE) << DescribeFailures(*done);
  EXPECT_EQ(FirstWrong(near.bytes(), kNearSeed, near_moved), std::nullopt);
  EXPECT_EQ(FirstWrong(far.bytes(), kFarSeed, far_moved), std::nullopt);
}

TEST_P(AsyncContractTest, CancelledInFlightBatchTouchesNothingAfterTheAnswer) {
  constexpr uint64_t kNearSeed = 21, kFarSeed = 22, kSentinel = 23;
  client::Buffer near = Near(2 * kRegion, kNearSeed);
  client::Buffer far = Far(2 * kRegion, kFarSeed);
  auto id = SubmitAsync(stub(), LongBatch(near, far, absl::Minutes(10)));
  ASSERT_TRUE(id.ok()) << id.status();
  // In flight: a READ has landed in near or a WRITE in far (a word of the
  // moved pattern at 1 MiB steps).
  const auto moved = [&] {
    for (uint64_t at = 0; at < kRegion; at += 1 << 20) {
      if (!FindMismatch(near.bytes().subspan(at, 8), kFarSeed, at) ||
          !FindMismatch(far.bytes().subspan(kRegion + at, 8), kNearSeed,
                        kRegion + at)) {
        return true;
      }
    }
    return false;
  };
  ASSERT_TRUE(Eventually(moved, absl::Seconds(60)))
      << "the batch never moved a byte";

  auto cancelled = CancelTransfer(stub(), *id);
  FillPattern(near.bytes(), kSentinel);
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_EQ(cancelled->state(), v1::TRANSFER_STATE_CANCELLED)
      << DescribeFailures(*cancelled);
  ASSERT_EQ(cancelled->results_size(), 2 * kOpsEachWay);
  int stopped = 0, other = 0;
  for (const v1::OpResult& result : cancelled->results()) {
    stopped += result.code() == kCancelled;
    other += result.code() != kOk && result.code() != kCancelled;
  }
  EXPECT_GT(stopped, 0);
  EXPECT_EQ(other, 0) << DescribeFailures(*cancelled);
  ExpectNothingTouchedAfterAnswer(near, far, kNearSeed, kFarSeed, kSentinel);
  // Not reported by the cancel: GetTransfers reads the same end.
  auto read = GetTransfer(stub(), *id);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->SerializeAsString(), cancelled->SerializeAsString());
  ExpectStillMovesBytes();
}

TEST_P(AsyncContractTest, DeadlineEndsTheBatchAndNothingIsTouchedAfter) {
  constexpr uint64_t kNearSeed = 31, kFarSeed = 32, kSentinel = 33;
  client::Buffer near = Near(2 * kRegion, kNearSeed);
  client::Buffer far = Far(2 * kRegion, kFarSeed);
  auto id = SubmitAsync(stub(), LongBatch(near, far, absl::Milliseconds(300)));
  ASSERT_TRUE(id.ok()) << id.status();
  auto end = GetTransfer(stub(), *id, absl::Seconds(60));
  FillPattern(near.bytes(), kSentinel);
  ASSERT_TRUE(end.ok()) << end.status();
  EXPECT_EQ(end->state(), v1::TRANSFER_STATE_FAILED) << DescribeFailures(*end);
  ASSERT_EQ(end->results_size(), 2 * kOpsEachWay);
  int expired = 0, other = 0;
  for (const v1::OpResult& result : end->results()) {
    expired += result.code() == kDeadlineExceeded;
    other += result.code() != kOk && result.code() != kDeadlineExceeded;
  }
  EXPECT_GT(expired, 0);
  EXPECT_EQ(other, 0) << DescribeFailures(*end);
  ExpectNothingTouchedAfterAnswer(near, far, kNearSeed, kFarSeed, kSentinel);
  ExpectStillMovesBytes();
}

INSTANTIATE_TEST_SUITE_P(
    Backends, AsyncContractTest,
    ::testing::Values(MemoryTarget(), TcpTarget(), SoftIbverbsTarget(),
                      SoftIbverbsRailsTarget()),
    [](const ::testing::TestParamInfo<BackendTarget>& info) {
      return info.param.name;
    });

}  // namespace
}  // namespace testing
}  // namespace rdma_agent

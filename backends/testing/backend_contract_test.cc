// The contract of backends/backend.h, as cases every backend must pass over
// both of its entries (Post and the Submit that waits on it). Each backend
// joins with one line in INSTANTIATE_TEST_SUITE_P below (and its target in
// targets.h): the cases themselves never name a backend.
//
// Ops run from agent 0 ("local") against buffers of the last agent
// ("remote"): a second agent, or the same one for the memory backend.

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "backends/testing/harness.h"
#include "backends/testing/targets.h"
#include "gtest/gtest.h"
#include "tests/testing/pattern.h"

namespace rdma_agent {
namespace testing {
namespace {

using ::absl::StatusCode;

constexpr v1::OpType kRead = v1::OP_TYPE_READ_INTO_LOCAL;
constexpr v1::OpType kWrite = v1::OP_TYPE_WRITE_FROM_LOCAL;

// Bound on anything that should take milliseconds.
constexpr absl::Duration kLong = absl::Seconds(60);
// How late after its deadline (or cancellation) a Submit may return.
constexpr absl::Duration kSlack = absl::Seconds(1);

// Which entry of Backend a case goes through.
enum class Entry { kSubmit, kPost };

class BackendContractTest
    : public ::testing::TestWithParam<std::tuple<BackendTarget, Entry>> {
 protected:
  static const BackendTarget& target() { return std::get<0>(GetParam()); }
  static Entry entry() { return std::get<1>(GetParam()); }

  void SetUp() override {
    world_ = target().make_world();
    for (int i = 0; i < target().agents; ++i) {
      auto agent =
          TestAgent::Create(absl::StrCat("agent-", i), world_->Factory(i));
      ASSERT_TRUE(agent.ok()) << agent.status();
      ASSERT_TRUE((*agent)->backend().available())
          << (*agent)->backend().unavailable_reason();
      agents_.push_back(std::move(*agent));
    }
  }
  void TearDown() override {
    for (auto& agent : agents_) agent->gate().Open();
  }

  TestAgent& local() { return *agents_.front(); }
  TestAgent& remote() { return *agents_.back(); }
  Backend& backend() { return local().backend(); }

  // Runs `ops` through the case's entry and waits for them to end.
  std::vector<absl::Status> Submit(const std::vector<Op>& ops,
                                   const StopToken& stop) {
    std::vector<absl::Status> results;
    if (entry() == Entry::kSubmit) {
      results = backend().Submit(ops, stop);
    } else {
      results = PostAndWait(ops, stop);
    }
    EXPECT_EQ(results.size(), ops.size()) << "one status per op";
    results.resize(ops.size(), absl::InternalError("no status"));
    return results;
  }

  // How a posted batch ended, as its `done` saw it.
  struct Ended {
    std::atomic<int> calls{0};
    std::vector<absl::Status> statuses;
    absl::Notification notified;
  };

  // Posts `ops`; the returned Ended is notified at the first call of done.
  std::shared_ptr<Ended> Post(absl::Span<const Op> ops, const StopToken& stop) {
    auto ended = std::make_shared<Ended>();
    backend().Post(ops, stop, [ended](std::vector<absl::Status> statuses) {
      if (ended->calls.fetch_add(1) == 0) {
        ended->statuses = std::move(statuses);
        ended->notified.Notify();
      }
    });
    return ended;
  }

  // Waits for `ended`'s done, which must come exactly once, with one status
  // per op of its batch of `ops` ops.
  static std::vector<absl::Status> Wait(Ended& ended, size_t ops) {
    EXPECT_TRUE(ended.notified.WaitForNotificationWithTimeout(kLong));
    // A second call would come from the thread that ended the batch, at
    // once; give it a moment to show.
    absl::SleepFor(absl::Milliseconds(1));
    EXPECT_EQ(ended.calls.load(), 1) << "done is called exactly once";
    if (!ended.notified.HasBeenNotified()) {
      return std::vector<absl::Status>(ops, absl::InternalError("no done"));
    }
    EXPECT_EQ(ended.statuses.size(), ops) << "one status per op";
    return std::move(ended.statuses);
  }

  // Post, then the wait for its `done`, which must come exactly once.
  std::vector<absl::Status> PostAndWait(const std::vector<Op>& ops,
                                        const StopToken& stop) {
    return Wait(*Post(ops, stop), ops.size());
  }

  // For the cases about Post alone: whether this one runs.
  static bool PostOnly() { return entry() == Entry::kPost; }

  // Runs one op and checks every byte of both buffers afterwards (the
  // buffers are refilled with their own patterns first).
  void MoveAndCheck(v1::OpType type, const TestBuffer& near,
                    uint64_t near_offset, uint64_t length,
                    const TestBuffer& far, uint64_t far_offset) {
    SCOPED_TRACE(absl::StrCat(type == kRead ? "read" : "write", " local ",
                              near_offset, " +", length, " remote ",
                              far_offset));
    Refill(near);
    Refill(far);
    const auto results =
        Submit({MakeOp(0, type, near, near_offset, length, far, far_offset)},
               In(kLong));
    ASSERT_TRUE(results[0].ok()) << results[0];
    const TestBuffer& dst = type == kRead ? near : far;
    const TestBuffer& src = type == kRead ? far : near;
    const uint64_t dst_offset = type == kRead ? near_offset : far_offset;
    const uint64_t src_offset = type == kRead ? far_offset : near_offset;
    EXPECT_EQ(FirstWrongByte(dst, src.seed, src_offset, dst_offset, length),
              std::nullopt)
        << "destination: only the op's range changes, to the source's bytes";
    EXPECT_EQ(FirstChangedByte(src), std::nullopt) << "source unchanged";
  }

  // A READ and a WRITE, each chunked, between fresh buffers: ops to cut
  // short.
  struct TwoWay {
    TestBuffer near;
    TestBuffer far;
    std::vector<Op> ops;
  };
  TwoWay MakeTwoWay(uint64_t seed) {
    const uint64_t length = 2 * target().max_message_bytes + 3;
    TwoWay two_way;
    two_way.near =
        local().Register(2 * length + 16, v1::ACCESS_READ_WRITE, seed);
    two_way.far =
        remote().Register(2 * length + 16, v1::ACCESS_READ_WRITE, seed + 1);
    two_way.ops = {MakeOp(0, kRead, two_way.near, 1, length, two_way.far, 3),
                   MakeOp(1, kWrite, two_way.near, length + 5, length,
                          two_way.far, length + 7)};
    return two_way;
  }

  // Runs `ops` with the serving side held: `while_held` runs once a request
  // of theirs has reached it, then the serving side goes on.
  std::vector<absl::Status> SubmitWhileHeld(
      const std::vector<Op>& ops, const std::function<void()>& while_held) {
    remote().gate().Close();
    std::vector<absl::Status> results;
    std::thread submit([&] { results = Submit(ops, In(kLong)); });
    EXPECT_TRUE(remote().gate().AwaitArrivals(1, kLong));
    while_held();
    remote().gate().Open();
    submit.join();
    return results;
  }

  std::unique_ptr<TargetWorld> world_;
  std::vector<std::unique_ptr<TestAgent>> agents_;
};

TEST_P(BackendContractTest, OneStatusPerOpInOrder) {
  TestBuffer near = local().Register(1 << 16, v1::ACCESS_READ_WRITE, 1);
  TestBuffer far = remote().Register(1 << 16, v1::ACCESS_READ_WRITE, 2);
  // Refusals the serving side decides before any byte moves, between good
  // ops, each with its own code.
  const TestBuffer oversized = far.WithContext(
      [](v1::RemoteBuffer& c) { c.set_size_bytes(c.size_bytes() * 2); });
  const TestBuffer stale = far.WithContext(
      [](v1::RemoteBuffer& c) { c.set_agent_epoch(c.agent_epoch() + 2); });
  const TestBuffer forged = far.WithContext([](v1::RemoteBuffer& c) {
    c.set_token(std::string(c.token().size(), 'x'));
  });
  const std::vector<Op> ops = {
      MakeOp(0, kWrite, near, 0, 100, far, 0),
      MakeOp(1, kRead, near, 0, 100, oversized, (1 << 16) - 50),
      MakeOp(2, kRead, near, 200, 100, far, 1000),
      MakeOp(3, kWrite, near, 0, 100, stale, 0),
      MakeOp(4, kRead, near, 0, 100, forged, 0),
      MakeOp(5, kWrite, near, 400, 100, far, 3000),
  };
  const auto results = Submit(ops, In(kLong));
  const std::vector<StatusCode> want = {
      StatusCode::kOk,       StatusCode::kOutOfRange,
      StatusCode::kOk,       StatusCode::kFailedPrecondition,
      StatusCode::kNotFound, StatusCode::kOk};
  for (size_t i = 0; i < ops.size(); ++i) {
    EXPECT_EQ(results[i].code(), want[i]) << "op " << i << ": " << results[i];
  }
  EXPECT_EQ(
      FirstMismatch(far.span().subspan(0, 100), near.seed, 0, 0, 100, far.seed),
      std::nullopt);
  EXPECT_EQ(FirstMismatch(far.span().subspan(3000, 100), near.seed, 400, 0, 100,
                          far.seed),
            std::nullopt);
  EXPECT_EQ(FirstMismatch(near.span().subspan(200, 100), far.seed, 1000, 0, 100,
                          near.seed),
            std::nullopt);
}

TEST_P(BackendContractTest, ReadAndWriteOddOffsetsAndLengths) {
  constexpr uint64_t kMax = (9ull << 20) + 5;
  TestBuffer near = local().Register(kMax + 64, v1::ACCESS_READ_WRITE, 11);
  TestBuffer far = remote().Register(kMax + 64, v1::ACCESS_READ_WRITE, 12);
  for (uint64_t length : {uint64_t{1}, uint64_t{2}, uint64_t{7}, uint64_t{4095},
                          uint64_t{65537}, (uint64_t{1} << 20) + 3, kMax}) {
    const uint64_t near_offset = length % 13 + 1;
    const uint64_t far_offset = length % 29 + 3;
    MoveAndCheck(kWrite, near, near_offset, length, far, far_offset);
    MoveAndCheck(kRead, near, 63 - near_offset, length, far, far_offset);
  }
  // Both ends of the buffers.
  MoveAndCheck(kWrite, near, 0, 1, far, kMax + 63);
  MoveAndCheck(kRead, near, kMax + 63, 1, far, 0);
  EXPECT_GT(near.registration->bytes_moved(), 2 * kMax);
}

TEST_P(BackendContractTest, ChunksOpsPastTheLargestMessage) {
  const uint64_t length = 2 * target().max_message_bytes + 3;
  TestBuffer near = local().Register(length + 8, v1::ACCESS_READ_WRITE, 21);
  TestBuffer far = remote().Register(length + 8, v1::ACCESS_READ_WRITE, 22);
  MoveAndCheck(kWrite, near, 3, length, far, 5);
  MoveAndCheck(kRead, near, 5, length, far, 1);
}

// Op::landed: what a running transfer reports as bytes done. Every byte of
// an op that succeeded is counted exactly once (chunked ops included), an
// op refused by the serving side counts nothing.
TEST_P(BackendContractTest, CountsTheBytesThatLanded) {
  TwoWay two_way = MakeTwoWay(26);
  const TestBuffer stale = two_way.far.WithContext(
      [](v1::RemoteBuffer& c) { c.set_agent_epoch(c.agent_epoch() + 2); });
  two_way.ops.push_back(MakeOp(2, kRead, two_way.near, 0, 100, stale, 0));
  std::atomic<uint64_t> landed{0};
  for (Op& op : two_way.ops) op.landed = &landed;
  const auto results = Submit(two_way.ops, In(kLong));
  ASSERT_TRUE(results[0].ok()) << results[0];
  ASSERT_TRUE(results[1].ok()) << results[1];
  EXPECT_EQ(results[2].code(), StatusCode::kFailedPrecondition) << results[2];
  EXPECT_EQ(landed.load(), two_way.ops[0].length + two_way.ops[1].length);
}

TEST_P(BackendContractTest, MovesAQuarterGibibyteInOneOp) {
  constexpr uint64_t kSize = 256ull << 20;
  TestBuffer near = local().Register(kSize + 8, v1::ACCESS_READ_WRITE, 31);
  TestBuffer far = remote().Register(kSize + 8, v1::ACCESS_READ_WRITE, 32);
  MoveAndCheck(kRead, near, 1, kSize, far, 7);
}

// Each refusal of the serving side, token first. The agent validates ops
// against what the context advertises, so what reaches a backend's serving
// side refused is a context that no longer (or never did) match the buffer:
// forged, stale, released, or overstating access or size.
TEST_P(BackendContractTest, EveryRefusalHasItsCodeAndChangesNothing) {
  TestBuffer near = local().Register(4096, v1::ACCESS_READ_WRITE, 41);
  TestBuffer far = remote().Register(4096, v1::ACCESS_READ_WRITE, 42);
  TestBuffer read_only = remote().Register(4096, v1::ACCESS_READ, 43);
  TestBuffer write_only = remote().Register(4096, v1::ACCESS_WRITE, 44);
  const auto claim_read_write = [](v1::RemoteBuffer& c) {
    c.set_access(v1::ACCESS_READ_WRITE);
  };
  const TestBuffer claims_writable = read_only.WithContext(claim_read_write);
  const TestBuffer claims_readable = write_only.WithContext(claim_read_write);
  const TestBuffer oversized = far.WithContext(
      [](v1::RemoteBuffer& c) { c.set_size_bytes(c.size_bytes() * 4); });
  const TestBuffer bad_token = far.WithContext([](v1::RemoteBuffer& c) {
    c.set_token(std::string(c.token().size(), 'x'));
  });
  const TestBuffer stale = far.WithContext(
      [](v1::RemoteBuffer& c) { c.set_agent_epoch(c.agent_epoch() + 2); });
  const TestBuffer unknown = far.WithContext(
      [](v1::RemoteBuffer& c) { c.set_buffer_id(c.buffer_id() + 1000); });
  const TestBuffer stale_bad_token =
      stale.WithContext([](v1::RemoteBuffer& c) { c.set_token("forged"); });
  const TestBuffer bad_token_read_only =
      claims_writable.WithContext([](v1::RemoteBuffer& c) {
        c.set_token(std::string(c.token().size(), 'y'));
      });
  struct Case {
    const char* name;
    v1::OpType type;
    const TestBuffer* target;
    uint64_t offset;
    StatusCode code;
  };
  const std::vector<Case> cases = {
      {"wrong token, write", kWrite, &bad_token, 0, StatusCode::kNotFound},
      {"wrong token, read", kRead, &bad_token, 0, StatusCode::kNotFound},
      {"wrong token before access", kWrite, &bad_token_read_only, 0,
       StatusCode::kNotFound},
      {"unknown id, write", kWrite, &unknown, 0, StatusCode::kNotFound},
      {"unknown id, read", kRead, &unknown, 0, StatusCode::kNotFound},
      {"write into read-only", kWrite, &claims_writable, 0,
       StatusCode::kPermissionDenied},
      {"read from write-only", kRead, &claims_readable, 0,
       StatusCode::kPermissionDenied},
      {"stale epoch, write", kWrite, &stale, 0,
       StatusCode::kFailedPrecondition},
      {"stale epoch, read", kRead, &stale, 0, StatusCode::kFailedPrecondition},
      {"stale epoch before token", kRead, &stale_bad_token, 0,
       StatusCode::kFailedPrecondition},
      {"write past the end", kWrite, &oversized, 4000, StatusCode::kOutOfRange},
      {"read past the end", kRead, &oversized, 4000, StatusCode::kOutOfRange},
      {"read far past the end", kRead, &oversized, 3 * 4096,
       StatusCode::kOutOfRange},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].name);
    const auto refused = Submit({MakeOp(0, cases[i].type, near, 0, 100,
                                        *cases[i].target, cases[i].offset)},
                                In(kLong))[0];
    EXPECT_EQ(refused.code(), cases[i].code) << refused;
    EXPECT_FALSE(refused.message().empty());
    // Without the token nothing tells which ids exist or the current epoch.
    if (cases[i].code == StatusCode::kNotFound) {
      EXPECT_TRUE(
          absl::StrContains(refused.message(), NotRegisteredError().message()))
          << refused;
    }
    if (cases[i].code == StatusCode::kFailedPrecondition) {
      EXPECT_FALSE(absl::StrContains(refused.message(),
                                     absl::StrCat(far.context->agent_epoch())))
          << refused;
      EXPECT_FALSE(absl::StrContains(
          refused.message(),
          absl::StrCat(absl::Hex(far.context->agent_epoch()))))
          << refused;
    }
    // The backend goes on serving good ops.
    const auto good = Submit(
        {MakeOp(0, kWrite, near, 200 + i, 10, far, 300 + i * 10)}, In(kLong));
    EXPECT_TRUE(good[0].ok()) << good[0];
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(FirstMismatch(far.span().subspan(300 + i * 10, 10), near.seed,
                            200 + i, 0, 10, far.seed),
              std::nullopt);
  }
  EXPECT_EQ(FirstChangedByte(near), std::nullopt);
  EXPECT_EQ(FirstChangedByte(read_only), std::nullopt);
  EXPECT_EQ(FirstChangedByte(write_only), std::nullopt);
}

TEST_P(BackendContractTest, ServingSideReleaseDuringAnOpRefusesIt) {
  TestBuffer near = local().Register(1 << 20, v1::ACCESS_READ_WRITE, 51);
  TestBuffer far = remote().Register(1 << 20, v1::ACCESS_READ_WRITE, 52);
  const std::vector<Op> ops = {MakeOp(0, kRead, near, 0, 1 << 19, far, 0),
                               MakeOp(1, kWrite, near, 0, 1 << 19, far, 0)};
  std::weak_ptr<Registration> far_alive = far.registration;
  // The ops have reached the serving side; the buffer is released under them.
  const auto results = SubmitWhileHeld(ops, [&] {
    remote().Release(far);
    far = TestBuffer{};
  });
  for (const absl::Status& status : results) {
    EXPECT_EQ(status.code(), StatusCode::kNotFound) << status;
  }
  EXPECT_EQ(FirstChangedByte(near), std::nullopt);
  // Nothing pins the released buffer once Submit has returned.
  EXPECT_TRUE(far_alive.expired());
}

TEST_P(BackendContractTest, RequestingSideReleaseDuringAnOpKeepsItsMemory) {
  TestBuffer near = local().Register(1 << 20, v1::ACCESS_READ_WRITE, 61);
  TestBuffer far = remote().Register(1 << 20, v1::ACCESS_READ_WRITE, 62);
  std::vector<Op> ops = {MakeOp(0, kRead, near, 3, 1 << 19, far, 5)};
  std::weak_ptr<Registration> near_alive = near.registration;
  const uint64_t near_seed = near.seed;
  // Only the op pins the local buffer once this has run.
  const auto results = SubmitWhileHeld(ops, [&] {
    local().Release(near);
    near = TestBuffer{};
  });
  ASSERT_TRUE(results[0].ok()) << results[0];
  ASSERT_FALSE(near_alive.expired());
  TestBuffer pinned{ops[0].local, nullptr, near_seed};
  EXPECT_EQ(FirstWrongByte(pinned, far.seed, 5, 3, 1 << 19), std::nullopt);
  ops.clear();
  pinned = TestBuffer{};
  EXPECT_TRUE(near_alive.expired());
}

// After Submit has returned no byte of local memory changes, and no byte
// read from it afterwards reaches the remote: `near` was overwritten with
// pattern `sentinel` right after the return.
void ExpectNothingTouchedAfterReturn(const TestBuffer& near,
                                     const TestBuffer& far,
                                     const std::vector<Op>& ops,
                                     uint64_t sentinel) {
  EXPECT_EQ(FindMismatch(near.span(), sentinel), std::nullopt)
      << "local memory written after Submit returned";
  for (const Op& op : ops) {
    if (op.reads_into_local()) continue;
    for (uint64_t i = 0; i < op.length; ++i) {
      const uint64_t at = op.remote_offset + i;
      const std::byte got = far.registration->data()[at];
      if (got != PatternByte(far.seed, at) &&
          got != PatternByte(near.seed, op.local_offset + i)) {
        ADD_FAILURE() << "remote byte " << at
                      << " holds neither its own nor the op's source byte "
                         "(local memory read after Submit returned)";
        return;
      }
    }
  }
}

TEST_P(BackendContractTest, DeadlineEndsSubmitAndNothingIsTouchedAfter) {
  const TwoWay two_way = MakeTwoWay(71);
  const TestBuffer& near = two_way.near;
  const TestBuffer& far = two_way.far;
  const std::vector<Op>& ops = two_way.ops;
  const absl::Duration timeout = absl::Milliseconds(300);
  const absl::Time start = absl::Now();
  // The serving side answers well after the deadline: opening at the
  // deadline itself raced the requester's timer (an answer read in the same
  // instant completed the op).
  remote().gate().Close(start + timeout + absl::Milliseconds(300));
  const auto results = Submit(ops, start + timeout);
  const absl::Duration took = absl::Now() - start;
  constexpr uint64_t kSentinel = 0x5e;
  FillPattern(near.span(), kSentinel);
  for (const absl::Status& status : results) {
    EXPECT_EQ(status.code(), StatusCode::kDeadlineExceeded) << status;
  }
  EXPECT_GE(took, timeout);
  EXPECT_LT(took, timeout + kSlack);
  // Whatever the serving side still does, it does now; then recheck.
  remote().gate().Open();
  EXPECT_TRUE(remote().gate().AwaitNoneHeld(kLong));
  absl::SleepFor(absl::Milliseconds(300));
  ExpectNothingTouchedAfterReturn(near, far, ops, kSentinel);
  // The backend is usable again.
  MoveAndCheck(kRead, near, 0, 1000, far, 0);
}

TEST_P(BackendContractTest, PassedDeadlineRunsNothing) {
  TestBuffer near = local().Register(4096, v1::ACCESS_READ_WRITE, 81);
  TestBuffer far = remote().Register(4096, v1::ACCESS_READ_WRITE, 82);
  const auto results = Submit({MakeOp(0, kWrite, near, 0, 64, far, 0),
                               MakeOp(1, kRead, near, 0, 64, far, 0)},
                              absl::Now() - absl::Seconds(1));
  for (const absl::Status& status : results) {
    EXPECT_EQ(status.code(), StatusCode::kDeadlineExceeded) << status;
  }
  EXPECT_EQ(FirstChangedByte(near), std::nullopt);
  EXPECT_EQ(FirstChangedByte(far), std::nullopt);
}

TEST_P(BackendContractTest, CancellationEndsSubmitAndNothingIsTouchedAfter) {
  const TwoWay two_way = MakeTwoWay(91);
  const TestBuffer& near = two_way.near;
  const TestBuffer& far = two_way.far;
  const std::vector<Op>& ops = two_way.ops;
  Cancellation cancellation;
  remote().gate().Close();
  std::vector<absl::Status> results;
  absl::Time returned;
  absl::Notification done;
  constexpr uint64_t kSentinel = 0xc4;
  std::thread submit([&] {
    results = Submit(ops, StopToken(In(kLong), &cancellation));
    returned = absl::Now();
    FillPattern(near.span(), kSentinel);
    done.Notify();
  });
  EXPECT_TRUE(remote().gate().AwaitArrivals(1, kLong));
  const absl::Time cancelled = absl::Now();
  cancellation.Cancel(absl::CancelledError("contract: the client went away"));
  // A serving side that runs on the Submit thread (memory) is let go soon
  // after; the others must return without it.
  done.WaitForNotificationWithTimeout(absl::Milliseconds(200));
  remote().gate().Open();
  submit.join();
  EXPECT_LT(returned - cancelled, kSlack);
  for (const absl::Status& status : results) {
    EXPECT_EQ(status.code(), StatusCode::kCancelled) << status;
    EXPECT_TRUE(absl::StrContains(status.message(), "the client went away"))
        << status;
  }
  EXPECT_TRUE(remote().gate().AwaitNoneHeld(kLong));
  absl::SleepFor(absl::Milliseconds(300));
  ExpectNothingTouchedAfterReturn(near, far, ops, kSentinel);
  MoveAndCheck(kWrite, near, 0, 1000, far, 0);
}

TEST_P(BackendContractTest, SixteenThreadsSubmitAtOnce) {
  constexpr int kThreads = 16;
  constexpr uint64_t kSlice = 256 << 10;
  TestBuffer far =
      remote().Register(kThreads * kSlice, v1::ACCESS_READ_WRITE, 100);
  std::vector<TestBuffer> nears;
  for (int t = 0; t < kThreads; ++t) {
    nears.push_back(
        local().Register(2 * kSlice, v1::ACCESS_READ_WRITE, 200 + t));
  }
  std::vector<std::thread> threads;
  std::vector<absl::Status> statuses(kThreads);
  absl::Notification go;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      go.WaitForNotification();
      const uint64_t slice = t * kSlice;
      for (int round = 0; round < 3 && statuses[t].ok(); ++round) {
        // Write the first half into this thread's slice, read it back into
        // the second half.
        std::vector<absl::Status> results =
            Submit({MakeOp(0, kWrite, nears[t], 1, kSlice - 1, far, slice + 1),
                    MakeOp(1, kRead, nears[t], kSlice + 1, kSlice - 1, far,
                           slice + 1)},
                   In(kLong));
        for (const absl::Status& status : results) {
          if (!status.ok()) statuses[t] = status;
        }
      }
    });
  }
  go.Notify();
  for (auto& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) {
    SCOPED_TRACE(absl::StrCat("thread ", t));
    EXPECT_TRUE(statuses[t].ok()) << statuses[t];
    EXPECT_EQ(
        FirstWrongByte(nears[t], nears[t].seed, 1, kSlice + 1, kSlice - 1),
        std::nullopt);
    EXPECT_EQ(FindMismatch(far.span().subspan(t * kSlice + 1, kSlice - 1),
                           nears[t].seed, 1),
              std::nullopt);
  }
}

// What follows is Post's alone: each case runs under Entry::kPost only.

// Post starts the batch and returns: the op is held on the serving side
// (or waits for a thread to reach it) while the caller goes on, and done
// comes once the serving side lets it go. The op is larger than any batch a
// backend runs inside Post (the memory backend's inline bound, 64 KiB).
TEST_P(BackendContractTest, PostReturnsWhileTheServingSideIsHeld) {
  if (!PostOnly()) GTEST_SKIP() << "a case of Post alone";
  constexpr uint64_t kLength = 1 << 20;
  TestBuffer near = local().Register(kLength + 64, v1::ACCESS_READ_WRITE, 301);
  TestBuffer far = remote().Register(kLength + 64, v1::ACCESS_READ_WRITE, 302);
  const std::vector<Op> ops = {MakeOp(0, kRead, near, 5, kLength, far, 9)};
  remote().gate().Close();
  const std::shared_ptr<Ended> ended = Post(ops, In(kLong));
  // Post has returned; the serving side holds the op.
  EXPECT_TRUE(remote().gate().AwaitArrivals(1, kLong));
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_FALSE(ended->notified.HasBeenNotified())
      << "done before the serving side let the op go";
  EXPECT_EQ(FirstChangedByte(near), std::nullopt);
  remote().gate().Open();
  const auto results = Wait(*ended, ops.size());
  ASSERT_TRUE(results[0].ok()) << results[0];
  EXPECT_EQ(FirstWrongByte(near, far.seed, 9, 5, kLength), std::nullopt);
}

// A cancellation racing the batch's own end: whichever wins, done comes
// exactly once, each op either done in full or cancelled, and nothing
// outside the ops' ranges changes.
TEST_P(BackendContractTest, DoneComesOnceEvenWhenCancelledAsItEnds) {
  if (!PostOnly()) GTEST_SKIP() << "a case of Post alone";
  constexpr int kRounds = 20;
  constexpr uint64_t kLength = 96 << 10;
  constexpr int kOps = 4;
  TestBuffer near =
      local().Register(kOps * kLength + 64, v1::ACCESS_READ_WRITE, 311);
  TestBuffer far =
      remote().Register(kOps * kLength + 64, v1::ACCESS_READ_WRITE, 312);
  std::vector<Op> ops;
  for (int k = 0; k < kOps; ++k) {
    ops.push_back(MakeOp(k, kRead, near, 32 + k * kLength, kLength, far,
                         16 + k * kLength));
  }
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    Refill(near);
    Cancellation cancellation;
    std::shared_ptr<Ended> ended;
    std::thread cancel([&] {
      absl::SleepFor(absl::Microseconds(round * 37));
      cancellation.Cancel(absl::CancelledError("contract: cancelled racing"));
    });
    ended = Post(ops, StopToken(In(kLong), &cancellation));
    const auto results = Wait(*ended, ops.size());
    cancel.join();
    for (int k = 0; k < kOps; ++k) {
      if (results[k].ok()) {
        EXPECT_EQ(FindMismatch(near.span().subspan(32 + k * kLength, kLength),
                               far.seed, 16 + k * kLength),
                  std::nullopt)
            << "op " << k << " succeeded with wrong bytes";
      } else {
        EXPECT_EQ(results[k].code(), StatusCode::kCancelled) << results[k];
      }
    }
    // Outside the ops' ranges nothing changes.
    EXPECT_EQ(FindMismatch(near.span().subspan(0, 32), near.seed),
              std::nullopt);
    EXPECT_EQ(FindMismatch(near.span().subspan(32 + kOps * kLength), near.seed,
                           32 + kOps * kLength),
              std::nullopt);
  }
  EXPECT_EQ(FirstChangedByte(far), std::nullopt);
  // The backend goes on serving.
  MoveAndCheck(kWrite, near, 0, 1000, far, 0);
}

// One thread posts many batches before any has ended: Post never waits for
// another batch, a queue slot or a thread. Each ends once, with its own
// bytes.
TEST_P(BackendContractTest, ManyPostsInFlightFromOneThread) {
  if (!PostOnly()) GTEST_SKIP() << "a case of Post alone";
  constexpr int kBatches = 32;
  constexpr uint64_t kSlice = 128 << 10;  // past the memory inline bound
  TestBuffer near =
      local().Register(kBatches * kSlice, v1::ACCESS_READ_WRITE, 321);
  TestBuffer far =
      remote().Register(kBatches * kSlice, v1::ACCESS_READ_WRITE, 322);
  // Even batches write their slice into far, odd ones read theirs from it.
  std::vector<std::vector<Op>> batches;
  for (int b = 0; b < kBatches; ++b) {
    const uint64_t at = b * kSlice;
    batches.push_back(
        {MakeOp(0, b % 2 == 0 ? kWrite : kRead, near, at, kSlice, far, at)});
  }
  // Every Post returns with the serving side held.
  remote().gate().Close();
  std::vector<std::shared_ptr<Ended>> ended;
  for (const auto& batch : batches) ended.push_back(Post(batch, In(kLong)));
  EXPECT_TRUE(remote().gate().AwaitArrivals(1, kLong));
  for (int b = 0; b < kBatches; ++b) {
    EXPECT_FALSE(ended[b]->notified.HasBeenNotified()) << "batch " << b;
  }
  remote().gate().Open();
  for (int b = 0; b < kBatches; ++b) {
    SCOPED_TRACE(absl::StrCat("batch ", b));
    const auto results = Wait(*ended[b], 1);
    EXPECT_TRUE(results[0].ok()) << results[0];
    const uint64_t at = b * kSlice;
    if (b % 2 == 0) {
      EXPECT_EQ(FindMismatch(far.span().subspan(at, kSlice), near.seed, at),
                std::nullopt);
    } else {
      EXPECT_EQ(FindMismatch(near.span().subspan(at, kSlice), far.seed, at),
                std::nullopt);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Backends, BackendContractTest,
    ::testing::Combine(::testing::Values(MemoryTarget(), TcpTarget(),
                                         SoftIbverbsTarget(),
                                         SoftIbverbsRailsTarget()),
                       ::testing::Values(Entry::kSubmit, Entry::kPost)),
    [](const ::testing::TestParamInfo<std::tuple<BackendTarget, Entry>>& info) {
      return absl::StrCat(
          std::get<0>(info.param).name,
          std::get<1>(info.param) == Entry::kPost ? "_post" : "_submit");
    });

}  // namespace
}  // namespace testing
}  // namespace rdma_agent

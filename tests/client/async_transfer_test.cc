// The C++ client's asynchronous transfers against real rdma-agentd
// processes: Transfer handles (Wait, Poll, Cancel, OnDone) over the memory
// backend (both buffers on one agent) and over tcp (two agents), one
// TransferWatch carrying hundreds of transfers, two watching clients of one
// user, stopping a watch with ends pending, an agent that goes away under a
// watch, and a watching client process killed outright.

#include <signal.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/rdma_agent_client.h"
#include "common/thread_name.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/worker_process.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/eventually.h"
#include "tests/testing/pattern.h"

namespace rdma_agent::testing {
namespace {

using client::AgentClient;
using client::Buffer;
using client::OpSpec;
using client::Transfer;
using client::TransferResult;
using client::TransferState;
using client::TransferWatch;
using ::testing::HasSubstr;
namespace v1 = ::rdma::agent::v1;

constexpr uint64_t kMiB = 1 << 20;
// A TransferWatch's threads: its stream reader and its callback thread.
constexpr char kWatchThread[] = "rdma-xfer-watch";
constexpr char kCallbackThread[] = "rdma-xfer-cb";

AgentProcess::Options TcpAgent(std::vector<std::string> flags = {}) {
  AgentProcess::Options options;
  options.backends = "memory,tcp";
  options.log_level = "info";  // debug would log every chunk
  options.extra_flags = std::move(flags);
  return options;
}

OpSpec ReadOp(const Buffer& local, uint64_t local_offset, uint64_t length,
              const Buffer& remote, uint64_t remote_offset) {
  OpSpec op;
  op.type = v1::OP_TYPE_READ_INTO_LOCAL;
  op.local_buffer_id = local.id();
  op.local_offset = local_offset;
  op.length = length;
  op.remote_context = remote.remote_context();
  op.remote_offset = remote_offset;
  return op;
}

// Threads of this process with that name (/proc/self/task/*/comm).
int ThreadsNamed(const std::string& name) {
  int count = 0;
  for (const auto& task :
       std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string line;
    if (std::getline(comm, line) && line == name) ++count;
  }
  return count;
}

// Threads of every TransferWatch of this process.
int WatchThreads() {
  return ThreadsNamed(kWatchThread) + ThreadsNamed(kCallbackThread);
}

// What OnDone callbacks received, by transfer id.
class Ends {
 public:
  client::TransferCallback For(uint64_t id) {
    return [this, id](absl::StatusOr<TransferResult> end) {
      absl::MutexLock lock(&mu_);
      ++calls_[id];
      if (CurrentThreadName() != kCallbackThread) ++off_callback_thread_;
      ends_.insert_or_assign(id, std::move(end));
    };
  }
  size_t called() const {
    absl::MutexLock lock(&mu_);
    return calls_.size();
  }
  std::map<uint64_t, int> calls() const {
    absl::MutexLock lock(&mu_);
    return calls_;
  }
  std::map<uint64_t, absl::StatusOr<TransferResult>> ends() const {
    absl::MutexLock lock(&mu_);
    return ends_;
  }
  int off_callback_thread() const {
    absl::MutexLock lock(&mu_);
    return off_callback_thread_;
  }

 private:
  mutable absl::Mutex mu_;
  std::map<uint64_t, int> calls_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, absl::StatusOr<TransferResult>> ends_ ABSL_GUARDED_BY(mu_);
  int off_callback_thread_ ABSL_GUARDED_BY(mu_) = 0;
};

class AsyncTransferTest : public ::testing::Test {
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
    auto client = a_->NewClient();
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
  }

  void TearDown() override {
    if (HasFailure()) {
      ADD_FAILURE() << "agent a log:\n" << a_->Log();
      ADD_FAILURE() << "agent b log:\n" << b_->Log();
    }
  }

  // A buffer of `size` on agent a (local) or b (remote over tcp), filled
  // with pattern `seed`.
  Buffer On(AgentProcess& agent, uint64_t size, uint64_t seed) {
    auto buffer = agent.client().Attach(size, v1::ACCESS_READ_WRITE);
    EXPECT_TRUE(buffer.ok()) << buffer.status();
    if (!buffer.ok()) std::abort();
    FillPattern(buffer->bytes(), seed);
    return std::move(*buffer);
  }

  std::unique_ptr<AgentProcess> a_;
  std::unique_ptr<AgentProcess> b_;
  std::unique_ptr<AgentClient> client_;
};

// ------------------------------------------------ Wait, Poll, Cancel

class AsyncTransferBackendTest
    : public AsyncTransferTest,
      public ::testing::WithParamInterface<std::string> {
 protected:
  // Remote buffers live on a for the memory backend, on b for tcp.
  AgentProcess& RemoteAgent() { return GetParam() == "tcp" ? *b_ : *a_; }
};

TEST_P(AsyncTransferBackendTest, WaitReturnsTheEndOnceTheBytesHaveLanded) {
  constexpr uint64_t kSize = 2 * kMiB + 4096;
  Buffer local = On(*a_, kSize, 1);
  Buffer remote = On(RemoteAgent(), kSize, 2);
  constexpr uint64_t kOffset = 4099, kFrom = 333, kLength = kMiB + 5;
  const absl::Time before = absl::Now();
  auto transfer =
      client_->SubmitAsync({ReadOp(local, kOffset, kLength, remote, kFrom),
                            ReadOp(local, kSize - 1, 1, remote, 0)},
                           absl::Seconds(60));
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  EXPECT_GT(transfer->id(), 0u);

  auto end = transfer->Wait(absl::Seconds(60));
  ASSERT_TRUE(end.ok()) << end.status();
  EXPECT_EQ(end->id, transfer->id());
  EXPECT_EQ(end->state, TransferState::kDone);
  EXPECT_TRUE(end->ok());
  ASSERT_EQ(end->results.size(), 2u);
  for (const client::OpResult& result : end->results) {
    EXPECT_TRUE(result.status.ok()) << result.status;
    EXPECT_EQ(result.backend, GetParam());
  }
  EXPECT_GE(end->create_time, before - absl::Seconds(1));
  EXPECT_GE(end->start_time, end->create_time);
  EXPECT_GE(end->end_time, end->start_time);
  EXPECT_LE(end->end_time, absl::Now() + absl::Seconds(1));
  const absl::Span<const std::byte> bytes = local.bytes();
  EXPECT_EQ(
      FirstMismatch(bytes.subspan(0, kSize - 1), 2, kFrom, kOffset, kLength, 1),
      std::nullopt);
  EXPECT_EQ(bytes[kSize - 1], PatternByte(2, 0));

  // The agent has reported the end and forgotten it; the handle kept it.
  for (int i = 0; i < 2; ++i) {
    auto again =
        i == 0 ? transfer->Poll() : transfer->Wait(absl::ZeroDuration());
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->state, TransferState::kDone);
    EXPECT_EQ(again->end_time, end->end_time);
  }
  // Cancelling an ended transfer changes nothing.
  auto cancelled = transfer->Cancel();
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_EQ(cancelled->state, TransferState::kDone);
  auto elsewhere = a_->NewClient();
  ASSERT_TRUE(elsewhere.ok());
  EXPECT_EQ((*elsewhere)->TransferById(transfer->id()).Poll().status().code(),
            absl::StatusCode::kNotFound);
}

TEST_P(AsyncTransferBackendTest, AFailedOpEndsTheTransferFailed) {
  Buffer local = On(*a_, 4096, 1);
  Buffer remote = On(RemoteAgent(), 4096, 2);
  auto transfer = client_->SubmitAsync(
      {ReadOp(local, 0, 100, remote, 0), ReadOp(local, 0, 100, remote, 4000)},
      absl::Seconds(30));
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  auto end = transfer->Wait(absl::Seconds(30));
  ASSERT_TRUE(end.ok()) << end.status();
  EXPECT_EQ(end->state, TransferState::kFailed);
  ASSERT_EQ(end->results.size(), 2u);
  EXPECT_TRUE(end->results[0].status.ok()) << end->results[0].status;
  EXPECT_EQ(end->results[1].status.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(end->results[1].status.message(), HasSubstr("op 1"));
}

INSTANTIATE_TEST_SUITE_P(Backends, AsyncTransferBackendTest,
                         ::testing::Values("memory", "tcp"),
                         [](const auto& info) { return info.param; });

TEST_F(AsyncTransferTest, ABadBatchIsRefusedAtSubmission) {
  auto empty = client_->SubmitAsync({}, absl::Seconds(1));
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  Buffer local = On(*a_, 4096, 1);
  auto negative =
      client_->SubmitAsync({ReadOp(local, 0, 1, local, 0)}, absl::Seconds(-1));
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(AsyncTransferTest, PollWaitAndCancelARunningAndAQueuedTransfer) {
  constexpr uint64_t kLarge = 256 * kMiB;
  Buffer local = On(*a_, kLarge, 0);
  Buffer remote = On(*b_, kLarge, 0);
  std::memset(local.data(), 0, kLarge);
  std::memset(remote.data(), 0x5a, kLarge);
  Buffer small_from = On(*a_, 4096, 3);
  Buffer small_to = On(*a_, 4096, 4);
  // 32 reads of the whole 256 MiB over tcp: seconds of work, on a's one
  // transfer worker.
  const std::vector<OpSpec> reads(32, ReadOp(local, 0, kLarge, remote, 0));
  auto running = client_->SubmitAsync(reads, absl::Minutes(10));
  ASSERT_TRUE(running.ok()) << running.status();
  // Queued behind it.
  auto queued = client_->SubmitAsync({ReadOp(small_to, 0, 4096, small_from, 0)},
                                     absl::Minutes(10));
  ASSERT_TRUE(queued.ok()) << queued.status();

  const std::byte* data = local.data();
  ASSERT_TRUE(Eventually(
      [&] {
        for (uint64_t at = 0; at < kLarge; at += kMiB) {
          if (data[at] == std::byte{0x5a}) return true;
        }
        return false;
      },
      absl::Seconds(60)))
      << "the transfer never moved a byte";

  auto now = running->Poll();
  ASSERT_TRUE(now.ok()) << now.status();
  EXPECT_EQ(now->state, TransferState::kPending);
  EXPECT_TRUE(now->results.empty());
  EXPECT_NE(now->start_time, absl::InfinitePast());  // it runs
  EXPECT_EQ(now->end_time, absl::InfinitePast());
  auto waiting = queued->Poll();
  ASSERT_TRUE(waiting.ok()) << waiting.status();
  EXPECT_EQ(waiting->state, TransferState::kPending);
  EXPECT_EQ(waiting->start_time, absl::InfinitePast());  // still queued
  const absl::Time asked = absl::Now();
  auto not_yet = running->Wait(absl::Milliseconds(200));
  EXPECT_EQ(not_yet.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_GE(absl::Now() - asked, absl::Milliseconds(200));

  // Cancelled before it started: its op never ran.
  auto never = queued->Cancel();
  ASSERT_TRUE(never.ok()) << never.status();
  EXPECT_EQ(never->state, TransferState::kCancelled);
  ASSERT_EQ(never->results.size(), 1u);
  EXPECT_EQ(never->results[0].status.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(never->start_time, absl::InfinitePast());
  EXPECT_EQ(FindMismatch(small_to.bytes(), 4), std::nullopt);

  // Mid-flight: once Cancel returns, nothing of it writes into `local`. A
  // sentinel over the whole buffer right away shows any straggler.
  auto stopped = running->Cancel();
  std::memset(local.data(), 0xc3, kLarge);
  ASSERT_TRUE(stopped.ok()) << stopped.status();
  EXPECT_EQ(stopped->state, TransferState::kCancelled);
  ASSERT_EQ(stopped->results.size(), 32u);
  int cancelled_ops = 0;
  for (const client::OpResult& result : stopped->results) {
    EXPECT_TRUE(result.status.ok() ||
                result.status.code() == absl::StatusCode::kCancelled)
        << result.status;
    cancelled_ops += result.status.code() == absl::StatusCode::kCancelled;
  }
  EXPECT_GT(cancelled_ops, 0);
  absl::SleepFor(absl::Seconds(1));
  const std::byte* end = data + kLarge;
  const std::byte* changed =
      std::find_if(data, end, [](std::byte b) { return b != std::byte{0xc3}; });
  EXPECT_EQ(changed, end) << "byte " << (changed - data)
                          << " was written after Cancel returned";

  // The handles keep their ends (the agent still has them too: Cancel does
  // not report them).
  auto later = running->Wait(absl::ZeroDuration());
  ASSERT_TRUE(later.ok()) << later.status();
  EXPECT_EQ(later->state, TransferState::kCancelled);
  EXPECT_EQ(later->end_time, stopped->end_time);
  auto from_agent = a_->client().TransferById(running->id()).Poll();
  ASSERT_TRUE(from_agent.ok()) << from_agent.status();
  EXPECT_EQ(from_agent->state, TransferState::kCancelled);
}

TEST_F(AsyncTransferTest, TransferByIdFollowsATransferOfAnotherClient) {
  Buffer local = On(*a_, 8 * kMiB, 1);
  Buffer remote = On(*b_, 8 * kMiB, 2);
  auto transfer = client_->SubmitAsync({ReadOp(local, 0, 8 * kMiB, remote, 0)},
                                       absl::Seconds(60));
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  auto other = a_->NewClient();
  ASSERT_TRUE(other.ok()) << other.status();
  Transfer followed = (*other)->TransferById(transfer->id());
  EXPECT_EQ(followed.id(), transfer->id());
  auto end = followed.Wait(absl::Seconds(60));
  ASSERT_TRUE(end.ok()) << end.status();
  EXPECT_EQ(end->state, TransferState::kDone);
  EXPECT_EQ(FindMismatch(local.bytes(), 2), std::nullopt);

  // An id the agent never gave out, with and without a watch (with one,
  // Wait asks the agent once whether it knows the id, rather than waiting
  // for an end that never comes).
  Transfer unknown = client_->TransferById(999999);
  EXPECT_EQ(unknown.Wait(absl::Seconds(1)).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(unknown.Poll().status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(unknown.Cancel().status().code(), absl::StatusCode::kNotFound);
  auto watch = client_->WatchTransfers();
  ASSERT_TRUE(watch.ok()) << watch.status();
  EXPECT_EQ(unknown.Wait().status().code(), absl::StatusCode::kNotFound);
}

TEST_F(AsyncTransferTest, AMovedFromHandleRefusesEverything) {
  Buffer local = On(*a_, 4096, 1);
  auto transfer = client_->SubmitAsync({ReadOp(local, 0, 10, local, 100)},
                                       absl::Seconds(30));
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  Transfer moved = std::move(*transfer);
  EXPECT_EQ(transfer->Wait().status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(transfer->Cancel().status().code(),
            absl::StatusCode::kFailedPrecondition);
  auto end = moved.Wait(absl::Seconds(30));
  ASSERT_TRUE(end.ok()) << end.status();
  EXPECT_EQ(end->state, TransferState::kDone);
}

TEST_F(AsyncTransferTest, DestroyingTheHandleDoesNotCancel) {
  Buffer local = On(*a_, 32 * kMiB, 1);
  Buffer remote = On(*b_, 32 * kMiB, 2);
  uint64_t id = 0;
  {
    auto transfer = client_->SubmitAsync(
        {ReadOp(local, 0, 32 * kMiB, remote, 0)}, absl::Seconds(60));
    ASSERT_TRUE(transfer.ok()) << transfer.status();
    id = transfer->id();
  }
  auto end = client_->TransferById(id).Wait(absl::Seconds(60));
  ASSERT_TRUE(end.ok()) << end.status();
  EXPECT_EQ(end->state, TransferState::kDone);
  EXPECT_EQ(FindMismatch(local.bytes(), 2), std::nullopt);
}

// ------------------------------------------------------- TransferWatch

TEST_F(AsyncTransferTest, TwoHundredTransfersEndThroughOneWatch) {
  constexpr int kTransfers = 200;
  constexpr uint64_t kEach = 64 << 10;
  Buffer local = On(*a_, kTransfers * kEach, 1);
  Buffer near = On(*a_, kTransfers * kEach, 2);  // memory backend
  Buffer far = On(*b_, kTransfers * kEach, 3);   // tcp
  absl::Mutex mu;
  std::map<uint64_t, int> seen;  // by the watch's own callback
  auto watch = client_->WatchTransfers([&](const TransferResult& end) {
    absl::MutexLock lock(&mu);
    ++seen[end.id];
  });
  ASSERT_TRUE(watch.ok()) << watch.status();
  EXPECT_TRUE(Eventually([] { return WatchThreads() == 2; }));

  Ends ends;
  std::vector<Transfer> kept;
  std::vector<uint64_t> ids;
  for (int i = 0; i < kTransfers; ++i) {
    const Buffer& remote = i % 2 == 0 ? near : far;
    auto transfer = client_->SubmitAsync(
        {ReadOp(local, i * kEach, kEach, remote, i * kEach)},
        absl::Seconds(120));
    ASSERT_TRUE(transfer.ok()) << i << ": " << transfer.status();
    ids.push_back(transfer->id());
    ASSERT_TRUE(transfer->OnDone(ends.For(transfer->id())).ok());
    // Half are fire-and-forget: their callback outlives the handle.
    if (i % 4 < 2) kept.push_back(std::move(*transfer));
  }
  ASSERT_TRUE(Eventually([&] { return ends.called() == kTransfers; },
                         absl::Seconds(120)))
      << ends.called() << " of " << kTransfers << " callbacks ran";
  absl::SleepFor(absl::Milliseconds(300));  // room for a second call
  const std::map<uint64_t, int> calls = ends.calls();
  const auto results = ends.ends();
  for (uint64_t id : ids) {
    EXPECT_EQ(calls.at(id), 1) << "transfer " << id;
    const absl::StatusOr<TransferResult>& end = results.at(id);
    ASSERT_TRUE(end.ok()) << end.status();
    EXPECT_EQ(end->state, TransferState::kDone) << id;
  }
  // Apart from those set after their end had arrived (run at once, in
  // OnDone), on the watch's callback thread.
  EXPECT_LT(ends.off_callback_thread(), kTransfers / 2);
  {
    absl::MutexLock lock(&mu);
    for (uint64_t id : ids) EXPECT_EQ(seen[id], 1) << "transfer " << id;
  }
  for (int i = 0; i < kTransfers; ++i) {
    EXPECT_EQ(FindMismatch(local.bytes().subspan(i * kEach, kEach),
                           i % 2 == 0 ? 2 : 3, i * kEach),
              std::nullopt)
        << "transfer " << i;
  }
  // The handles kept learnt their ends from the watch too.
  for (Transfer& transfer : kept) {
    auto end = transfer.Wait(absl::ZeroDuration());
    ASSERT_TRUE(end.ok()) << end.status();
    EXPECT_EQ(end->state, TransferState::kDone);
  }
  EXPECT_TRUE(watch->status().ok()) << watch->status();
}

TEST_F(AsyncTransferTest, OnDoneNeedsAWatchUnlessTheEndIsKnown) {
  Buffer local = On(*a_, 4096, 1);
  auto transfer = client_->SubmitAsync({ReadOp(local, 0, 10, local, 100)},
                                       absl::Seconds(30));
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  bool called = false;
  absl::Status refused =
      transfer->OnDone([&](absl::StatusOr<TransferResult>) { called = true; });
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("WatchTransfers"));
  ASSERT_TRUE(transfer->Wait(absl::Seconds(30)).ok());
  EXPECT_FALSE(called);
  // Known: the callback runs before OnDone returns, on this thread.
  std::string ran_on;
  ASSERT_TRUE(transfer
                  ->OnDone([&](absl::StatusOr<TransferResult> end) {
                    called = end.ok() && end->ok();
                    ran_on = CurrentThreadName();
                  })
                  .ok());
  EXPECT_TRUE(called);
  EXPECT_EQ(ran_on, CurrentThreadName());
  EXPECT_EQ(transfer->OnDone(nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(AsyncTransferTest, OneWatchPerClientAndANewOneOnceItStops) {
  auto watch = client_->WatchTransfers();
  ASSERT_TRUE(watch.ok()) << watch.status();
  auto second = client_->WatchTransfers();
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  // Another client may watch (it gets every end too).
  auto other = a_->NewClient();
  ASSERT_TRUE(other.ok());
  auto theirs = (*other)->WatchTransfers();
  ASSERT_TRUE(theirs.ok()) << theirs.status();
  theirs->Stop();
  EXPECT_EQ(theirs->status().code(), absl::StatusCode::kCancelled);

  watch->Stop();
  watch->Stop();  // idempotent
  EXPECT_EQ(watch->status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(WatchThreads(), 0);
  auto again = client_->WatchTransfers();
  ASSERT_TRUE(again.ok()) << again.status();
  Buffer local = On(*a_, 4096, 1);
  auto transfer = client_->SubmitAsync({ReadOp(local, 0, 10, local, 100)},
                                       absl::Seconds(30));
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  auto end = transfer->Wait(absl::Seconds(30));
  ASSERT_TRUE(end.ok()) << end.status();
  EXPECT_EQ(end->state, TransferState::kDone);
}

TEST_F(AsyncTransferTest, TwoWatchingClientsOfOneUserBothGetEveryEnd) {
  constexpr int kTransfers = 30;
  Buffer local = On(*a_, kTransfers * 4096, 1);
  Buffer remote = On(*b_, kTransfers * 4096, 2);
  auto other = a_->NewClient();
  ASSERT_TRUE(other.ok()) << other.status();
  // What each client's watch delivered (this user's ends, whoever
  // submitted them).
  struct Seen {
    absl::Mutex mu;
    std::map<uint64_t, int> ends ABSL_GUARDED_BY(mu);
    client::TransferEndCallback Record() {
      return [this](const TransferResult& end) {
        absl::MutexLock lock(&mu);
        ++ends[end.id];
      };
    }
    std::map<uint64_t, int> Get() {
      absl::MutexLock lock(&mu);
      return ends;
    }
  } mine, theirs;
  auto my_watch = client_->WatchTransfers(mine.Record());
  ASSERT_TRUE(my_watch.ok()) << my_watch.status();
  auto their_watch = (*other)->WatchTransfers(theirs.Record());
  ASSERT_TRUE(their_watch.ok()) << their_watch.status();
  Ends ends;
  std::map<uint64_t, int> expected;
  for (int i = 0; i < kTransfers; ++i) {
    auto transfer = client_->SubmitAsync(
        {ReadOp(local, i * 4096, 4096, remote, i * 4096)}, absl::Seconds(60));
    ASSERT_TRUE(transfer.ok()) << transfer.status();
    ASSERT_TRUE(transfer->OnDone(ends.For(transfer->id())).ok());
    expected[transfer->id()] = 1;
  }
  ASSERT_TRUE(Eventually([&] {
    return mine.Get() == expected && theirs.Get() == expected;
  })) << mine.Get().size()
      << " and " << theirs.Get().size() << " of " << kTransfers
      << " ends: the watches split them";
  ASSERT_TRUE(Eventually([&] { return ends.called() == kTransfers; }));
  // The other client's watch took nothing from this one's handles, nor from
  // a third client that asks: each end is still there to read, once.
  auto third = a_->NewClient();
  ASSERT_TRUE(third.ok()) << third.status();
  const uint64_t first = expected.begin()->first;
  auto read = (*third)->TransferById(first).Poll();
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->state, TransferState::kDone);
  EXPECT_EQ((*third)->TransferById(first).Poll().status().code(),
            absl::StatusCode::kNotFound)
      << "a read by GetTransfers is the one that counts";
}

TEST_F(AsyncTransferTest, DestroyingTheWatchRunsEveryPendingCallbackOnce) {
  constexpr int kTransfers = 40;
  constexpr uint64_t kEach = 32 * kMiB;
  Buffer local = On(*a_, kEach, 1);
  Buffer remote = On(*b_, kEach, 2);
  Ends ends;
  std::vector<Transfer> transfers;
  std::vector<uint64_t> ids;
  {
    auto watch = client_->WatchTransfers();
    ASSERT_TRUE(watch.ok()) << watch.status();
    ASSERT_TRUE(Eventually([] { return WatchThreads() == 2; }));
    // One transfer worker: they end one after the other, over seconds.
    for (int i = 0; i < kTransfers; ++i) {
      auto transfer = client_->SubmitAsync({ReadOp(local, 0, kEach, remote, 0)},
                                           absl::Seconds(300));
      ASSERT_TRUE(transfer.ok()) << transfer.status();
      ASSERT_TRUE(transfer->OnDone(ends.For(transfer->id())).ok());
      ids.push_back(transfer->id());
      transfers.push_back(std::move(*transfer));
    }
    ASSERT_TRUE(Eventually([&] { return ends.called() > 0; }))
        << "no transfer ended";
    // Destroyed with ends pending.
  }
  // Every callback has run, exactly once, before the destructor returned.
  const std::map<uint64_t, int> calls = ends.calls();
  EXPECT_EQ(calls.size(), static_cast<size_t>(kTransfers));
  const auto results = ends.ends();
  int done = 0, dropped = 0;
  for (uint64_t id : ids) {
    EXPECT_EQ(calls.count(id) ? calls.at(id) : 0, 1) << "transfer " << id;
    if (!results.count(id)) continue;
    const absl::StatusOr<TransferResult>& end = results.at(id);
    if (end.ok()) {
      EXPECT_EQ(end->state, TransferState::kDone);
      ++done;
    } else {
      EXPECT_EQ(end.status().code(), absl::StatusCode::kCancelled)
          << end.status();
      EXPECT_THAT(end.status().message(), HasSubstr("watch ended"));
      ++dropped;
    }
  }
  EXPECT_GT(done, 0);
  EXPECT_GT(dropped, 0) << "every transfer ended before the watch went";
  EXPECT_EQ(WatchThreads(), 0);
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(ends.calls(), calls) << "a callback ran after the destructor";

  // The handles still learn their ends: from a new watch, or by asking.
  auto watch = client_->WatchTransfers();
  ASSERT_TRUE(watch.ok()) << watch.status();
  for (Transfer& transfer : transfers) {
    auto end = transfer.Wait(absl::Seconds(120));
    ASSERT_TRUE(end.ok()) << end.status();
    EXPECT_EQ(end->state, TransferState::kDone) << transfer.id();
  }
}

TEST_F(AsyncTransferTest, AWatchStoppedFromItsOwnCallbackEndsItsThread) {
  Buffer local = On(*a_, 4096, 1);
  auto holder = std::make_shared<std::optional<TransferWatch>>();
  std::promise<void> stopped;
  auto watch = client_->WatchTransfers([&, holder](const TransferResult&) {
    if (holder->has_value()) {
      (*holder)->Stop();  // returns at once: the thread ends after this
      holder->reset();    // and may even be destroyed here
      stopped.set_value();
    }
  });
  ASSERT_TRUE(watch.ok()) << watch.status();
  holder->emplace(std::move(*watch));
  auto transfer = client_->SubmitAsync({ReadOp(local, 0, 10, local, 100)},
                                       absl::Seconds(30));
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  ASSERT_EQ(stopped.get_future().wait_for(std::chrono::seconds(30)),
            std::future_status::ready);
  EXPECT_TRUE(Eventually([] { return WatchThreads() == 0; }));
  // The client can watch again.
  auto again = client_->WatchTransfers();
  EXPECT_TRUE(again.ok()) << again.status();
}

TEST_F(AsyncTransferTest, ACallbackMayWaitForAnotherTransfer) {
  Buffer local = On(*a_, 64 * kMiB, 1);
  Buffer remote = On(*b_, 64 * kMiB, 2);
  auto watch = client_->WatchTransfers();
  ASSERT_TRUE(watch.ok()) << watch.status();
  // Holds a's one transfer worker for seconds, so that the two after it are
  // still queued when their callbacks are set.
  auto blocker = client_->SubmitAsync(
      std::vector<OpSpec>(64, ReadOp(local, 0, 64 * kMiB, remote, 0)),
      absl::Minutes(5));
  ASSERT_TRUE(blocker.ok()) << blocker.status();
  auto first = client_->SubmitAsync({ReadOp(local, 0, 4096, local, 4096)},
                                    absl::Seconds(300));
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = client_->SubmitAsync({ReadOp(local, 0, 4096, remote, 0)},
                                     absl::Seconds(300));
  ASSERT_TRUE(second.ok()) << second.status();
  // `first`'s callback waits for `second` on the watch's callback thread,
  // while the reader goes on recording ends.
  std::promise<std::pair<std::string, absl::StatusOr<TransferResult>>> waited;
  ASSERT_TRUE(first
                  ->OnDone([&](absl::StatusOr<TransferResult>) {
                    waited.set_value({CurrentThreadName(),
                                      second->Wait(absl::Seconds(120))});
                  })
                  .ok());
  auto future = waited.get_future();
  ASSERT_EQ(future.wait_for(std::chrono::seconds(180)),
            std::future_status::ready);
  auto [thread, end] = future.get();
  EXPECT_EQ(thread, kCallbackThread);
  ASSERT_TRUE(end.ok()) << end.status();
  EXPECT_EQ(end->state, TransferState::kDone);
  EXPECT_TRUE(watch->status().ok()) << watch->status();
}

TEST(AsyncTransferAgentGoneTest,
     TheWatchEndsUnavailableAndFailsPendingCallbacks) {
  auto agent = AgentProcess::Start(TcpAgent({"--transfer_workers=1"}));
  ASSERT_TRUE(agent.ok()) << agent.status();
  auto peer = AgentProcess::Start(TcpAgent());
  ASSERT_TRUE(peer.ok()) << peer.status();
  auto client = (*agent)->NewClient();
  ASSERT_TRUE(client.ok()) << client.status();
  auto local = (*client)->Attach(64 * kMiB, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(local.ok()) << local.status();
  auto remote = (*peer)->client().Attach(64 * kMiB, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(remote.ok()) << remote.status();
  auto watch = (*client)->WatchTransfers();
  ASSERT_TRUE(watch.ok()) << watch.status();
  Ends ends;
  std::vector<Transfer> transfers;
  for (int i = 0; i < 20; ++i) {
    auto transfer = (*client)->SubmitAsync(
        {ReadOp(*local, 0, 64 * kMiB, *remote, 0)}, absl::Seconds(300));
    ASSERT_TRUE(transfer.ok()) << transfer.status();
    ASSERT_TRUE(transfer->OnDone(ends.For(transfer->id())).ok());
    transfers.push_back(std::move(*transfer));
  }
  (*agent)->Kill();
  ASSERT_TRUE(Eventually([&] { return !watch->status().ok(); }))
      << "the watch did not notice";
  EXPECT_EQ(watch->status().code(), absl::StatusCode::kUnavailable)
      << watch->status();
  ASSERT_TRUE(Eventually([&] { return ends.called() == 20; }));
  int failed = 0;
  for (const auto& [id, end] : ends.ends()) {
    if (!end.ok()) {
      EXPECT_EQ(end.status().code(), absl::StatusCode::kUnavailable);
      ++failed;
    }
  }
  EXPECT_GT(failed, 0);
  EXPECT_TRUE(Eventually([] { return WatchThreads() == 0; }));
  // Waiting now asks the agent, which is gone.
  const auto gone = transfers.back().Wait(absl::Seconds(2));
  EXPECT_FALSE(gone.ok());
}

// ---------------------------------------------- a killed client process

TEST(KilledWatcherTest, AnEndAKilledWatcherWasSentIsStillThere) {
  auto agent = AgentProcess::Start(TcpAgent());
  ASSERT_TRUE(agent.ok()) << agent.status();
  auto worker = WorkerProcess::Start(**agent);
  ASSERT_TRUE(worker.ok()) << worker.status();
  ASSERT_EQ(worker->Answer("watch_start"), "ok DONE");
  // This client submits; the worker's watch (same user) delivers the end to
  // the worker, which dies before doing anything with it.
  auto client = (*agent)->NewClient();
  ASSERT_TRUE(client.ok()) << client.status();
  auto buffer = (*client)->Attach(4096, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  auto transfer = (*client)->SubmitAsync({ReadOp(*buffer, 0, 10, *buffer, 100)},
                                         absl::Seconds(30));
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  const std::string seen = absl::StrCat("watch_seen ", transfer->id());
  ASSERT_TRUE(Eventually([&] { return worker->Answer(seen) == "seen"; }));
  worker->process().Signal(SIGKILL);
  ASSERT_TRUE(worker->process().Wait(absl::Seconds(30)).ok());
  // Delivered is not read: the submitter still learns its end.
  auto end = transfer->Poll();
  ASSERT_TRUE(end.ok()) << end.status();
  EXPECT_EQ(end->state, TransferState::kDone);
}

TEST(KilledWatcherTest, AClientKilledMidWatchLeavesTheAgentServing) {
  // Each open watch holds one of the user's waiting-call slots; a slot a
  // killed client left behind would run these out after three kills.
  auto agent = AgentProcess::Start(TcpAgent({"--max_waiting_rpcs_per_user=3"}));
  ASSERT_TRUE(agent.ok()) << agent.status();
  for (int i = 0; i < 6; ++i) {
    SCOPED_TRACE(absl::StrCat("worker ", i));
    auto worker = WorkerProcess::Start(**agent);
    ASSERT_TRUE(worker.ok()) << worker.status();
    std::string answer;
    // The previous worker's slot is back once the agent has noticed that its
    // connection closed; until then the agent refuses the watch.
    ASSERT_TRUE(Eventually(
        [&] {
          answer = worker->Answer("watch_start");
          return answer.rfind("ok", 0) == 0;
        },
        absl::Seconds(20)))
        << answer;
    ASSERT_EQ(answer, "ok DONE");
    worker->process().Signal(SIGKILL);
    ASSERT_TRUE(worker->process().Wait(absl::Seconds(30)).ok());
  }
  ASSERT_TRUE((*agent)->Running());
  auto client = (*agent)->NewClient();
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->GetInfo().ok());
  auto buffer = (*client)->Attach(4096, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  // A watch of this process gets its slot too (once the last worker's is
  // back) and delivers ends.
  absl::StatusOr<TransferResult> end = absl::UnknownError("no attempt");
  ASSERT_TRUE(Eventually(
      [&] {
        // Before the watch: a callback the watch fails at its end finds it.
        std::promise<absl::StatusOr<TransferResult>> ended;
        auto watch = (*client)->WatchTransfers();
        if (!watch.ok()) return false;
        auto transfer = (*client)->SubmitAsync(
            {ReadOp(*buffer, 0, 10, *buffer, 100)}, absl::Seconds(30));
        if (!transfer.ok()) return false;
        if (!transfer
                 ->OnDone([&](absl::StatusOr<TransferResult> result) {
                   ended.set_value(std::move(result));
                 })
                 .ok()) {
          return false;
        }
        auto future = ended.get_future();
        if (future.wait_for(std::chrono::seconds(30)) !=
            std::future_status::ready) {
          return false;
        }
        end = future.get();
        return end.ok();
      },
      absl::Seconds(20)))
      << end.status();
  EXPECT_EQ(end->state, TransferState::kDone);
}

}  // namespace
}  // namespace rdma_agent::testing

// The ibverbs backend's asynchronous entry (Backend::Post) on the software
// RC NIC: Post returns without waiting for a handshake or the wire, done
// comes from the thread that ends the batch (a completion poller, or the
// deadline timer), the deadline and a cancellation end a posted batch with
// nothing touched afterwards, and many batches posted at once from one
// thread all land.
#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "backends/ibverbs/ibverbs_backend.h"
#include "backends/ibverbs/soft/soft_verbs.h"
#include "backends/testing/harness.h"
#include "backends/testing/ibverbs_agent.h"
#include "common/stop_token.h"
#include "common/thread_name.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rdma_agent::ibverbs {
namespace {

using ::rdma_agent::testing::Apply;
using ::rdma_agent::testing::FirstDifference;
using ::rdma_agent::testing::FirstWrongByte;
using ::rdma_agent::testing::In;
using ::rdma_agent::testing::MakeOp;
using ::rdma_agent::testing::Snapshot;
using ::rdma_agent::testing::SoftIbverbsAgent;
using ::rdma_agent::testing::TestAgent;
using ::rdma_agent::testing::TestBuffer;
using verbs::SoftDeviceConfig;
using verbs::SoftFabric;
using verbs::SoftFault;

constexpr v1::OpType kRead = v1::OP_TYPE_READ_INTO_LOCAL;
constexpr v1::OpType kWrite = v1::OP_TYPE_WRITE_FROM_LOCAL;

// How one posted batch ended: its statuses, when, and on which thread.
class Ending {
 public:
  OpsDone Done() {
    return [this](std::vector<absl::Status> statuses) {
      absl::MutexLock lock(&mu_);
      statuses_ = std::move(statuses);
      thread_ = CurrentThreadName();
      at_ = absl::Now();
      ++calls_;
    };
  }
  bool called() {
    absl::MutexLock lock(&mu_);
    return calls_ > 0;
  }
  // Waits for done (at most `timeout`); false when it did not come.
  bool Await(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    const auto called = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return calls_ > 0;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&called), timeout);
  }
  std::vector<absl::Status> statuses() {
    absl::MutexLock lock(&mu_);
    return statuses_;
  }
  std::string thread() {
    absl::MutexLock lock(&mu_);
    return thread_;
  }
  absl::Time at() {
    absl::MutexLock lock(&mu_);
    return at_;
  }
  int calls() {
    absl::MutexLock lock(&mu_);
    return calls_;
  }

 private:
  absl::Mutex mu_;
  std::vector<absl::Status> statuses_ ABSL_GUARDED_BY(mu_);
  std::string thread_ ABSL_GUARDED_BY(mu_);
  absl::Time at_ ABSL_GUARDED_BY(mu_);
  int calls_ ABSL_GUARDED_BY(mu_) = 0;
};

class PostTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* name : {"nic_a", "nic_b"}) {
      SoftDeviceConfig config;
      config.name = name;
      ASSERT_TRUE(fabric_.AddDevice(config).ok());
    }
    a_ = SoftIbverbsAgent(fabric_, "agent-a", "nic_a");
    b_ = SoftIbverbsAgent(fabric_, "agent-b", "nic_b");
    ASSERT_NE(a_, nullptr);
    ASSERT_NE(b_, nullptr);
    local_ = a_->Register(kSize, v1::ACCESS_READ_WRITE, 11);
    remote_ = b_->Register(kSize, v1::ACCESS_READ_WRITE, 22);
  }

  IbverbsBackend& backend() { return a_->backend<IbverbsBackend>(); }

  // One op through Submit: the lane is connected and the grant cached
  // afterwards (the steady state).
  void Connect() {
    ASSERT_TRUE(backend()
                    .Submit({MakeOp(0, kRead, local_, 0, 8, remote_, 0)},
                            In(absl::Seconds(10)))[0]
                    .ok());
    local_before_ = Snapshot(local_);
    remote_before_ = Snapshot(remote_);
  }

  // Delays the next WR on the wire by `delay`.
  void DelayNextWr(absl::Duration delay) {
    SoftFault fault;
    fault.action = SoftFault::Action::kDelay;
    fault.delay = delay;
    fabric_.InjectFault(fault);
  }

  static constexpr uint64_t kSize = 1 << 20;
  SoftFabric fabric_;
  std::unique_ptr<TestAgent> a_;
  std::unique_ptr<TestAgent> b_;
  TestBuffer local_;
  TestBuffer remote_;
  std::vector<uint8_t> local_before_;
  std::vector<uint8_t> remote_before_;
};

TEST_F(PostTest, ReturnsBeforeASlowHandshakeEnds) {
  // The peer holds the handshake (its serving side checks the buffer
  // there) for three seconds.
  b_->gate().Close(absl::Now() + absl::Seconds(3));
  const std::vector<Op> ops = {MakeOp(0, kRead, local_, 16, 4096, remote_, 7)};
  Ending ending;
  const absl::Time start = absl::Now();
  backend().Post(ops, In(absl::Seconds(20)), ending.Done());
  EXPECT_FALSE(ending.called()) << "Post waited for the handshake";
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  ASSERT_TRUE(b_->gate().AwaitArrivals(1, absl::Seconds(10)));
  b_->gate().Open();
  ASSERT_TRUE(ending.Await(absl::Seconds(20)));
  ASSERT_EQ(ending.statuses().size(), 1u);
  EXPECT_TRUE(ending.statuses()[0].ok()) << ending.statuses()[0];
  EXPECT_EQ(FirstWrongByte(local_, remote_.seed, 7, 16, 4096), std::nullopt);
  EXPECT_EQ(ending.calls(), 1);
}

TEST_F(PostTest, DoneComesFromACompletionPoller) {
  Connect();
  // The WR lands well after Post has returned.
  DelayNextWr(absl::Milliseconds(100));
  const std::vector<Op> ops = {
      MakeOp(0, kWrite, local_, 100, 3000, remote_, 5000)};
  Ending ending;
  backend().Post(ops, In(absl::Seconds(10)), ending.Done());
  EXPECT_FALSE(ending.called()) << "Post waited for the wire";
  ASSERT_TRUE(ending.Await(absl::Seconds(10)));
  ASSERT_TRUE(ending.statuses()[0].ok()) << ending.statuses()[0];
  EXPECT_EQ(ending.thread(), "ibv-cq-poller");
  EXPECT_EQ(FirstWrongByte(remote_, local_.seed, 100, 5000, 3000),
            std::nullopt);
}

TEST_F(PostTest, TheDeadlineEndsAPostedBatchWithNothingTouchedAfterwards) {
  Connect();
  DelayNextWr(absl::Seconds(2));
  const std::vector<Op> ops = {MakeOp(0, kRead, local_, 10, 100, remote_, 50)};
  Ending ending;
  const absl::Time deadline = In(absl::Milliseconds(300));
  backend().Post(ops, deadline, ending.Done());
  EXPECT_FALSE(ending.called()) << "Post waited for the deadline";
  ASSERT_TRUE(ending.Await(absl::Seconds(5)));
  EXPECT_GE(ending.at(), deadline);
  EXPECT_LT(ending.at() - deadline, absl::Seconds(1));
  EXPECT_EQ(ending.statuses()[0].code(), absl::StatusCode::kDeadlineExceeded)
      << ending.statuses()[0];
  EXPECT_EQ(ending.thread(), "ibv-deadline");
  // Nothing signals "a flushed WR did not run later": wait out the delay.
  absl::SleepFor(absl::Milliseconds(2200));
  EXPECT_EQ(Snapshot(local_), local_before_);
  EXPECT_EQ(Snapshot(remote_), remote_before_);
  EXPECT_EQ(ending.calls(), 1);
}

TEST_F(PostTest, ACancellationEndsAPostedBatchWithNothingTouchedAfterwards) {
  Connect();
  DelayNextWr(absl::Seconds(2));
  const std::vector<Op> ops = {
      MakeOp(0, kWrite, local_, 300, 200, remote_, 900)};
  Cancellation cancellation;
  Ending ending;
  backend().Post(ops, StopToken(In(absl::Seconds(30)), &cancellation),
                 ending.Done());
  EXPECT_FALSE(ending.called()) << "Post waited for the wire";
  absl::SleepFor(absl::Milliseconds(100));
  const absl::Time cancelled = absl::Now();
  cancellation.Cancel(absl::CancelledError("the client went away"));
  ASSERT_TRUE(ending.Await(absl::Seconds(5)));
  EXPECT_LT(ending.at() - cancelled, absl::Seconds(1));
  EXPECT_EQ(ending.statuses()[0].code(), absl::StatusCode::kCancelled)
      << ending.statuses()[0];
  absl::SleepFor(absl::Milliseconds(2200));
  EXPECT_EQ(Snapshot(local_), local_before_);
  EXPECT_EQ(Snapshot(remote_), remote_before_);
  EXPECT_EQ(ending.calls(), 1);
}

TEST_F(PostTest, TwoHundredBatchesPostedAtOnceFromOneThreadAllLand) {
  Connect();
  constexpr size_t kBatches = 200;
  constexpr uint64_t kLength = 4096;
  // Batch i moves the i-th 4 KiB: even ones written, odd ones read.
  std::vector<std::vector<Op>> batches(kBatches);
  std::vector<uint8_t> local_image = Snapshot(local_);
  std::vector<uint8_t> remote_image = Snapshot(remote_);
  for (size_t i = 0; i < kBatches; ++i) {
    batches[i].push_back(MakeOp(0, i % 2 == 0 ? kWrite : kRead, local_,
                                i * kLength, kLength, remote_,
                                i * kLength + 3));
    Apply(batches[i][0], local_image, remote_image);
  }
  absl::BlockingCounter ended(kBatches);
  std::atomic<int> failed{0};
  std::atomic<int> on_poller{0};
  std::atomic<int> calls{0};
  for (size_t i = 0; i < kBatches; ++i) {
    backend().Post(batches[i], In(absl::Seconds(30)),
                   [&](std::vector<absl::Status> statuses) {
                     if (statuses.size() != 1 || !statuses[0].ok()) ++failed;
                     if (CurrentThreadName() == "ibv-cq-poller") ++on_poller;
                     ++calls;
                     ended.DecrementCount();
                   });
  }
  ended.Wait();
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(calls.load(), static_cast<int>(kBatches));
  // Most end on a poller; a batch whose completion beat Post's own return
  // ends inside Post.
  EXPECT_GT(on_poller.load(), 0);
  EXPECT_EQ(FirstDifference(local_, local_image), std::nullopt);
  EXPECT_EQ(FirstDifference(remote_, remote_image), std::nullopt);
}

// The posting threads' queue is bounded: with every posting thread held (a
// handshake each, held by its peer) and the queue full, the ops of a lane
// that needs a posting thread fail at once with RESOURCE_EXHAUSTED naming
// the bound, and move nothing; the batches queued end once the peers
// answer.
TEST(PostingQueueTest, PastItsBoundALanesOpsAreRefused) {
  SoftFabric fabric;
  const std::vector<std::string> peers = {"b", "c", "d"};
  for (const std::string& name : {"a", "b", "c", "d"}) {
    SoftDeviceConfig config;
    config.name = "nic_" + name;
    ASSERT_TRUE(fabric.AddDevice(config).ok());
  }
  IbverbsOptions options;
  options.max_queued_posting_tasks = 2;
  std::unique_ptr<TestAgent> a =
      SoftIbverbsAgent(fabric, "agent-a", "nic_a", options);
  ASSERT_NE(a, nullptr);
  TestBuffer local = a->Register(1 << 16, v1::ACCESS_READ_WRITE, 11);
  std::vector<std::unique_ptr<TestAgent>> agents;
  std::vector<TestBuffer> remotes;
  for (const std::string& name : peers) {
    agents.push_back(SoftIbverbsAgent(fabric, "agent-" + name, "nic_" + name));
    ASSERT_NE(agents.back(), nullptr);
    remotes.push_back(agents.back()->Register(1 << 16, v1::ACCESS_READ_WRITE,
                                              22 + remotes.size()));
    agents.back()->gate().Close();
  }
  // Batch i reads 100 bytes into its own 4 KiB of `local`: batches 0-2
  // from b, c and d, batches 3-5 from b again.
  constexpr size_t kBatches = 6;
  std::vector<std::vector<Op>> batches(kBatches);
  for (size_t i = 0; i < kBatches; ++i) {
    batches[i] = {
        MakeOp(0, kRead, local, i * 4096, 100, remotes[i < 3 ? i : 0], 10)};
  }
  std::vector<Ending> endings(kBatches);
  IbverbsBackend& backend = a->backend<IbverbsBackend>();
  // Each of the three posting threads is held in a handshake.
  for (size_t i = 0; i < 3; ++i) {
    backend.Post(batches[i], In(absl::Seconds(20)), endings[i].Done());
    ASSERT_TRUE(agents[i]->gate().AwaitArrivals(1, absl::Seconds(10))) << i;
  }
  // Two more fill the queue; the next is refused at once.
  backend.Post(batches[3], In(absl::Seconds(20)), endings[3].Done());
  backend.Post(batches[4], In(absl::Seconds(20)), endings[4].Done());
  backend.Post(batches[5], In(absl::Seconds(20)), endings[5].Done());
  ASSERT_TRUE(endings[5].called()) << "a refused lane waited";
  ASSERT_EQ(endings[5].statuses().size(), 1u);
  const absl::Status refused = endings[5].statuses()[0];
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_THAT(std::string(refused.message()),
              ::testing::HasSubstr("2 tasks queued "
                                   "(IbverbsOptions::max_queued_posting_"
                                   "tasks)"));
  for (size_t i = 0; i < 5; ++i) EXPECT_FALSE(endings[i].called()) << i;

  for (auto& agent : agents) agent->gate().Open();
  std::vector<uint8_t> local_image = Snapshot(local);
  for (size_t i = 0; i < 5; ++i) {
    ASSERT_TRUE(endings[i].Await(absl::Seconds(20))) << i;
    ASSERT_EQ(endings[i].statuses().size(), 1u);
    EXPECT_TRUE(endings[i].statuses()[0].ok()) << i << endings[i].statuses()[0];
    EXPECT_EQ(endings[i].calls(), 1);
    std::vector<uint8_t> remote_image = Snapshot(remotes[i < 3 ? i : 0]);
    Apply(batches[i][0], local_image, remote_image);
  }
  // Batches 0-4 landed; the refused one's range and every other byte kept.
  EXPECT_EQ(FirstDifference(local, local_image), std::nullopt);
  EXPECT_EQ(endings[5].calls(), 1);
}

}  // namespace
}  // namespace rdma_agent::ibverbs

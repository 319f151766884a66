// OpBatch's two entries over the memory backend: Start ends a batch by
// callback and hands its notifications to the BlockingExecutor (never sent
// on the thread that ended the ops); Run is the same batch waited for, with
// its notifications sent on the calling thread.
#include "daemon/ops/op_batch.h"

#include <unistd.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "backends/memory/memory_backend.h"
#include "backends/notification_sink.h"
#include "common/random.h"
#include "common/shared_memory.h"
#include "gtest/gtest.h"

namespace rdma_agent {
namespace {

constexpr uint64_t kSize = 4096;
constexpr char kAgentId[] = "agent-a";

// Records where notifications were delivered from.
class RecordingSink : public NotificationSink {
 public:
  absl::Status Deliver(const ServeRequest& target,
                       absl::string_view from_agent_id,
                       absl::string_view data) override {
    (void)target;
    (void)from_agent_id;
    absl::MutexLock lock(&mu_);
    threads_.push_back(std::this_thread::get_id());
    data_.emplace_back(data);
    return absl::OkStatus();
  }
  size_t max_bytes() const override { return 4096; }

  std::vector<std::thread::id> threads() const {
    absl::MutexLock lock(&mu_);
    return threads_;
  }
  std::vector<std::string> data() const {
    absl::MutexLock lock(&mu_);
    return data_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<std::thread::id> threads_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> data_ ABSL_GUARDED_BY(mu_);
};

// Keeps the tasks it is given until the test runs them.
class HeldExecutor : public BlockingExecutor {
 public:
  void Run(Task task) override { tasks.push_back(std::move(task)); }
  std::vector<Task> tasks;
};

class OpBatchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    BackendEnvironment backend_env;
    backend_env.identity = AgentIdentity{kAgentId, kEpoch};
    backend_env.directory = &buffers_;
    backend_env.notifications = &sink_;
    std::vector<std::unique_ptr<Backend>> backends;
    backends.push_back(std::make_unique<memory::MemoryBackend>(backend_env));
    registry_ = std::make_unique<BackendRegistry>(std::move(backends));
    env_.registry = registry_.get();
    env_.buffers = &buffers_;
    env_.failures = &failures_;
    caller_.uid = ::geteuid();
    caller_.pid = ::getpid();
  }

  // A registration of this agent filled with `fill`; its remote context.
  std::string Register(char fill, uint64_t* id) {
    *id = buffers_.NextId();
    auto memory = SharedMemory::Allocate(kSize, "op-batch-test");
    EXPECT_TRUE(memory.ok()) << memory.status();
    auto registration = std::make_shared<Registration>(
        *id, caller_.uid, v1::ACCESS_READ_WRITE, "", RandomBytes(16),
        std::move(*memory), /*agent_allocated=*/true);
    std::memset(registration->data(), fill, kSize);
    v1::RemoteBuffer remote;
    remote.set_agent_id(kAgentId);
    remote.set_agent_epoch(kEpoch);
    remote.set_buffer_id(*id);
    remote.set_size_bytes(kSize);
    remote.set_access(v1::ACCESS_READ_WRITE);
    remote.set_token(registration->token());
    EXPECT_TRUE(registry_->RegisterWithAll(*registration, &remote).ok());
    std::string context = remote.SerializeAsString();
    registration->set_remote_context(context);
    registrations_.push_back(registration);
    buffers_.Add(registration);
    return context;
  }

  // One WRITE of 100 bytes from a local buffer into another, with
  // `notification` (none when empty).
  std::unique_ptr<v1::SubmitRequest> Request(const std::string& notification) {
    uint64_t local = 0;
    uint64_t remote = 0;
    Register('a', &local);
    const std::string context = Register('b', &remote);
    auto request = std::make_unique<v1::SubmitRequest>();
    v1::Op* op = request->add_ops();
    op->set_type(v1::OP_TYPE_WRITE_FROM_LOCAL);
    op->set_local_buffer_id(local);
    op->set_local_offset(0);
    op->set_length(100);
    op->set_remote_context(context);
    op->set_remote_offset(200);
    request->set_notification(notification);
    return request;
  }

  std::unique_ptr<OpBatch> Batch(const std::string& notification) {
    return OpBatch::Prepare(env_, caller_, Request(notification),
                            /*charge=*/nullptr, "Test");
  }

  // The bytes of the op's destination: its range written, the rest not.
  void ExpectWritten() const {
    const auto* bytes =
        reinterpret_cast<const char*>(registrations_.back()->data());
    for (uint64_t i = 0; i < kSize; ++i) {
      const char expected = i >= 200 && i < 300 ? 'a' : 'b';
      ASSERT_EQ(bytes[i], expected) << "byte " << i;
    }
  }

  static constexpr uint64_t kEpoch = 0x1234567;
  BufferTable buffers_{kEpoch};
  RecordingSink sink_;
  FailedOpLog failures_;
  std::unique_ptr<BackendRegistry> registry_;
  OpBatchEnvironment env_;
  PeerCredentials caller_;
  std::vector<std::shared_ptr<Registration>> registrations_;
};

TEST_F(OpBatchTest, StartHandsNotificationsToTheExecutor) {
  std::unique_ptr<OpBatch> batch = Batch("ready");
  HeldExecutor executor;
  Cancellation cancellation;
  std::optional<v1::SubmitResponse> ended;
  int calls = 0;
  batch->Start(StopToken(absl::Now() + absl::Seconds(10), &cancellation),
               executor, [&](v1::SubmitResponse response) {
                 ++calls;
                 ended = std::move(response);
                 batch.reset();  // done may destroy the batch
               });
  // The ops ended, but the notification waits for a thread that may block.
  EXPECT_EQ(calls, 0);
  EXPECT_TRUE(sink_.data().empty());
  ASSERT_EQ(executor.tasks.size(), 1u);
  std::thread::id sender;
  std::thread worker([&] {
    sender = std::this_thread::get_id();
    std::move(executor.tasks[0])();
  });
  worker.join();
  ASSERT_EQ(calls, 1);
  EXPECT_EQ(batch, nullptr);
  ASSERT_EQ(ended->results_size(), 1);
  EXPECT_EQ(ended->results(0).code(), 0) << ended->results(0).message();
  EXPECT_EQ(ended->results(0).backend(), "memory");
  ASSERT_EQ(ended->notifications_size(), 1);
  EXPECT_EQ(ended->notifications(0).code(), 0)
      << ended->notifications(0).message();
  ASSERT_EQ(sink_.threads().size(), 1u);
  EXPECT_EQ(sink_.threads()[0], sender);
  EXPECT_EQ(sink_.data()[0], "ready");
  ExpectWritten();
}

TEST_F(OpBatchTest, StartWithoutNotificationsEndsWhereTheOpsEnded) {
  std::unique_ptr<OpBatch> batch = Batch("");
  HeldExecutor executor;
  std::optional<v1::SubmitResponse> ended;
  batch->Start(
      StopToken(absl::Now() + absl::Seconds(10)), executor,
      [&](v1::SubmitResponse response) { ended = std::move(response); });
  // Nothing was handed over: recording the end does not block.
  EXPECT_TRUE(executor.tasks.empty());
  // Over the memory backend the ops end before Start returns (or soon on
  // its pool), and done follows them.
  for (int i = 0; i < 1000 && !ended.has_value(); ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_TRUE(ended.has_value());
  ASSERT_EQ(ended->results_size(), 1);
  EXPECT_EQ(ended->results(0).code(), 0) << ended->results(0).message();
  EXPECT_EQ(ended->notifications_size(), 0);
  ExpectWritten();
}

TEST_F(OpBatchTest, RunSendsNotificationsOnTheCallingThread) {
  std::unique_ptr<OpBatch> batch = Batch("sync");
  const v1::SubmitResponse response =
      batch->Run(StopToken(absl::Now() + absl::Seconds(10)));
  ASSERT_EQ(response.results_size(), 1);
  EXPECT_EQ(response.results(0).code(), 0) << response.results(0).message();
  ASSERT_EQ(response.notifications_size(), 1);
  EXPECT_EQ(response.notifications(0).code(), 0);
  ASSERT_EQ(sink_.threads().size(), 1u);
  EXPECT_EQ(sink_.threads()[0], std::this_thread::get_id());
  ExpectWritten();
}

}  // namespace
}  // namespace rdma_agent

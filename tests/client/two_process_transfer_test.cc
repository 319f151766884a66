// Two client processes on one host, one real rdma-agentd: one registers its
// memory with Attach (client memfd), the other with Allocate (agent memfd),
// they exchange remote contexts, and each moves bytes with Submit in both
// directions. Every byte of both buffers is checked after every op, inside
// and around the op's range, in the memory of the processes themselves.

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/worker_process.h"
#include "tests/testing/agent_process.h"

namespace rdma_agent::testing {
namespace {

constexpr uint64_t kMiB = 1 << 20;
constexpr int kReadWrite = 3;  // v1::ACCESS_READ_WRITE

struct Side {
  WorkerProcess* worker;
  WorkerBuffer buffer;
  uint64_t seed;
};

struct Transfer {
  const char* type;  // "read" (READ_INTO_LOCAL) or "write" (WRITE_FROM_LOCAL)
  uint64_t length;
  uint64_t local_offset;
  uint64_t remote_offset;
};

std::string Describe(const Transfer& t) {
  return absl::StrCat(t.type, " of ", t.length, " bytes, local offset ",
                      t.local_offset, ", remote offset ", t.remote_offset);
}

class TwoProcessTransferTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto agent = AgentProcess::Start();
    ASSERT_TRUE(agent.ok()) << agent.status();
    agent_ = std::move(*agent);
    auto attacher = WorkerProcess::Start(*agent_);
    ASSERT_TRUE(attacher.ok()) << attacher.status();
    attacher_.emplace(std::move(*attacher));
    auto allocator = WorkerProcess::Start(*agent_);
    ASSERT_TRUE(allocator.ok()) << allocator.status();
    allocator_.emplace(std::move(*allocator));
  }

  // Runs `t` from `local`'s process against `remote`'s context, then checks
  // every byte of both buffers.
  void RunAndCheck(Side& local, Side& remote, const Transfer& t) {
    SCOPED_TRACE(Describe(t));
    ASSERT_EQ(local.worker->Answer(
                  absl::StrCat("fill ", local.buffer.id, " ", local.seed)),
              "ok");
    ASSERT_EQ(remote.worker->Answer(
                  absl::StrCat("fill ", remote.buffer.id, " ", remote.seed)),
              "ok");

    auto result = local.worker->CallWords(absl::StrCat(
        "submit ", t.type, " ", local.buffer.id, " ", t.local_offset, " ",
        t.length, " ", t.remote_offset, " ", remote.buffer.context));
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_GE(result->size(), 3u);
    EXPECT_EQ((*result)[0], "result");
    EXPECT_EQ((*result)[1], "OK") << absl::StrJoin(*result, " ");
    EXPECT_EQ((*result)[2], "memory");

    const bool read = std::string(t.type) == "read";
    // The written side holds the other side's pattern in the op's range and
    // its own everywhere else; the read side is untouched.
    Side& written = read ? local : remote;
    Side& source = read ? remote : local;
    const uint64_t written_offset = read ? t.local_offset : t.remote_offset;
    const uint64_t source_offset = read ? t.remote_offset : t.local_offset;
    EXPECT_EQ(
        written.worker->Answer(absl::StrCat(
            "verify ", written.buffer.id, " ", source.seed, " ", source_offset,
            " ", written_offset, " ", t.length, " ", written.seed)),
        "ok");
    EXPECT_EQ(source.worker->Answer(absl::StrCat("verify ", source.buffer.id,
                                                 " 0 0 0 0 ", source.seed)),
              "ok");
  }

  std::unique_ptr<AgentProcess> agent_;
  std::optional<WorkerProcess> attacher_;
  std::optional<WorkerProcess> allocator_;
};

TEST_F(TwoProcessTransferTest, MovesEveryByteBothWaysBetweenTwoProcesses) {
  constexpr uint64_t kAttachedSize = 64 * kMiB + 13;
  constexpr uint64_t kAllocatedSize = 64 * kMiB + 7;
  auto attached = attacher_->CallWords(
      absl::StrCat("attach ", kAttachedSize, " ", kReadWrite));
  ASSERT_TRUE(attached.ok()) << attached.status();
  auto attached_buffer = ParseRegistered(*attached);
  ASSERT_TRUE(attached_buffer.ok()) << attached_buffer.status();
  auto allocated = allocator_->CallWords(
      absl::StrCat("allocate ", kAllocatedSize, " ", kReadWrite));
  ASSERT_TRUE(allocated.ok()) << allocated.status();
  auto allocated_buffer = ParseRegistered(*allocated);
  ASSERT_TRUE(allocated_buffer.ok()) << allocated_buffer.status();

  Side a{&*attacher_, *attached_buffer, /*seed=*/101};
  Side b{&*allocator_, *allocated_buffer, /*seed=*/202};

  // Each op runs once from each process: from B, the local side is agent
  // memory mapped through OpenBuffer and the remote side A's memfd; from A,
  // the other way round.
  struct Step {
    Side* local;
    Side* remote;
    Transfer transfer;
  };
  const std::vector<Step> steps = {
      {&b, &a, {"read", 1, 0, 0}},
      {&a, &b, {"read", 1, 0, 0}},
      {&b, &a, {"write", 1, 0, 0}},
      {&a, &b, {"write", 1, 0, 0}},
      {&b, &a, {"read", 4097, 3, 5}},
      {&a, &b, {"read", 4097, 5, 3}},
      {&b, &a, {"write", 4097, 5, 3}},
      {&a, &b, {"write", 4097, 3, 5}},
      {&b, &a, {"read", kMiB + 1, 17, 1}},
      {&a, &b, {"write", kMiB + 3, 1, 4099}},
      // Up to the last byte of each buffer.
      {&b, &a, {"read", 1, kAllocatedSize - 1, kAttachedSize - 1}},
      {&a, &b, {"read", 7, kAttachedSize - 7, kAllocatedSize - 7}},
      {&b, &a, {"write", 9, kAllocatedSize - 9, kAttachedSize - 9}},
      {&a, &b, {"write", 1, kAttachedSize - 1, kAllocatedSize - 1}},
      // 64 MiB at odd offsets.
      {&b, &a, {"read", 64 * kMiB, 3, 5}},
      {&a, &b, {"read", 64 * kMiB, 5, 3}},
      {&b, &a, {"write", 64 * kMiB, 7, 13}},
      {&a, &b, {"write", 64 * kMiB, 13, 7}},
  };
  for (const Step& step : steps) {
    RunAndCheck(*step.local, *step.remote, step.transfer);
    if (::testing::Test::HasFatalFailure()) return;
  }
  EXPECT_TRUE(agent_->Running()) << agent_->Log();
}

}  // namespace
}  // namespace rdma_agent::testing

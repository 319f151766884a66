// Ring sessions served by a fixed number of ring threads (--ring_threads),
// against real rdma-agentd processes: sessions add no threads to the agent
// (/proc/PID/task) and each still moves exactly its bytes; on one ring
// thread, a session whose batch waits on a held tcp peer, or whose client
// never reaps completions, holds up only itself; a client killed outright
// ends only its own session and gets every charge back; and a stopping
// agent ends the sessions of every ring thread promptly, posting the
// completions of their cancelled batches first. The remote peer is a
// second agent held with SIGSTOP for as long as a batch must keep running.
#include <dirent.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/rdma_agent_client.h"
#include "client/ring.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/worker_process.h"
#include "tests/daemon/agent_gauges.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/eventually.h"
#include "tests/testing/pattern.h"
#include "tests/testing/process.h"
#include "tests/testing/temp_dir.h"

namespace rdma_agent::testing {
namespace {

namespace v1 = ::rdma::agent::v1;
using client::Buffer;
using client::Ring;
using client::RingCompletion;
using client::RingOp;
using ::testing::HasSubstr;

constexpr uint64_t kSize = 4096;
constexpr v1::OpType kRead = v1::OP_TYPE_READ_INTO_LOCAL;
constexpr v1::OpType kWrite = v1::OP_TYPE_WRITE_FROM_LOCAL;

// The names of the threads of process `pid` now (/proc/PID/task/*/comm).
std::vector<std::string> ThreadNames(pid_t pid) {
  std::vector<std::string> names;
  const std::string dir = absl::StrCat("/proc/", pid, "/task");
  DIR* tasks = ::opendir(dir.c_str());
  if (tasks == nullptr) return names;
  while (const struct dirent* entry = ::readdir(tasks)) {
    if (entry->d_name[0] == '.') continue;
    std::ifstream comm(absl::StrCat(dir, "/", entry->d_name, "/comm"));
    std::string name;
    std::getline(comm, name);
    names.push_back(name);
  }
  ::closedir(tasks);
  return names;
}

size_t Count(const std::vector<std::string>& names, const std::string& name) {
  return std::count(names.begin(), names.end(), name);
}

RingOp Op(v1::OpType type, uint64_t local, uint64_t local_offset,
          uint64_t length, uint64_t handle, uint64_t remote_offset,
          uint64_t tag) {
  return RingOp{type, local, local_offset, length, handle, remote_offset, tag};
}

// Waits for `count` completions on `ring`, each within `each`.
std::vector<RingCompletion> Reap(Ring& ring, size_t count,
                                 absl::Duration each = absl::Seconds(20)) {
  std::vector<RingCompletion> ends;
  while (ends.size() < count) {
    auto got = ring.Wait(&ends, each);
    EXPECT_TRUE(got.ok()) << got.status();
    if (!got.ok()) break;
  }
  return ends;
}

class RingThreadsTest : public ::testing::Test {
 protected:
  void TearDown() override {
    if (b_ != nullptr) b_->Resume();
    if (!HasFailure()) return;
    if (a_ != nullptr) ADD_FAILURE() << "agent a log:\n" << a_->Log();
    if (b_ != nullptr) ADD_FAILURE() << "agent b log:\n" << b_->Log();
  }

  // Batches taken and not completed over this user's ring sessions (ring
  // batches are no transfers); -1 if they cannot be listed.
  int64_t RingBatchesInFlight() {
    auto sessions = a_->client().ListRingSessions();
    if (!sessions.ok()) return -1;
    int64_t batches = 0;
    for (const v1::RingSession& session : *sessions) {
      batches += static_cast<int64_t>(session.batches_in_flight());
    }
    return batches;
  }

  // Agent A (memory and tcp, the one the rings are opened on) with `flags`;
  // with `peer`, agent B too, the tcp peer a test may hold.
  void StartAgents(std::vector<std::string> flags, bool peer) {
    AgentProcess::Options a_options;
    a_options.backends = "memory,tcp";
    a_options.log_level = "info";
    a_options.extra_flags = std::move(flags);
    a_options.extra_flags.push_back("--metrics_listen=127.0.0.1:0");
    auto a = AgentProcess::Start(a_options);
    ASSERT_TRUE(a.ok()) << a.status();
    a_ = std::move(*a);
    if (!peer) return;
    AgentProcess::Options b_options;
    b_options.backends = "memory,tcp";
    b_options.log_level = "info";
    auto b = AgentProcess::Start(b_options);
    ASSERT_TRUE(b.ok()) << b.status();
    b_ = std::move(*b);
  }

  // A buffer of `agent`'s, mapped here, filled with pattern `seed`.
  static Buffer Filled(AgentProcess& agent, int seed) {
    auto buffer = agent.client().Allocate(kSize, v1::ACCESS_READ_WRITE);
    EXPECT_TRUE(buffer.ok()) << buffer.status();
    FillPattern(buffer->bytes(), seed);
    return std::move(*buffer);
  }

  // A handle on A for `buffer`'s context.
  uint64_t Import(const Buffer& buffer) {
    auto handle = a_->client().ImportRemote(buffer.remote_context());
    EXPECT_TRUE(handle.ok()) << handle.status();
    return handle.ok() ? handle->handle : 0;
  }

  std::unique_ptr<Ring> Open(uint32_t entries = 8) {
    auto ring = a_->client().OpenRing(entries);
    EXPECT_TRUE(ring.ok()) << ring.status();
    return ring.ok() ? std::move(*ring) : nullptr;
  }

  // One WRITE of 8 bytes between two buffers of A through `ring`, waited
  // for at most `within`: its completion.
  static RingCompletion WriteOnce(Ring& ring, uint64_t local, uint64_t handle,
                                  uint64_t offset, uint64_t tag,
                                  absl::Duration within) {
    const RingOp op = Op(kWrite, local, offset, 8, handle, offset, tag);
    EXPECT_TRUE(ring.Submit({&op, 1}).ok());
    std::vector<RingCompletion> ends = Reap(ring, 1, within);
    if (ends.empty()) return RingCompletion{};
    return ends[0];
  }

  std::unique_ptr<AgentProcess> a_;
  std::unique_ptr<AgentProcess> b_;
};

TEST_F(RingThreadsTest, RingThreadsOutOfRangeAreRefusedAtStart) {
  for (const char* threads : {"0", "65"}) {
    TempDir dir;
    auto result = RunToCompletion(
        {RunfilePath("daemon/rdma-agentd"), "--runtime_dir=" + dir.path(),
         "--state_dir=" + dir.path() + "/state", "--backends=memory",
         absl::StrCat("--ring_threads=", threads)},
        "", absl::Seconds(20));
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->exit_code, 2) << threads;
    EXPECT_THAT(result->out + result->err,
                HasSubstr("--ring_threads must be 1 to 64"));
  }
}

TEST_F(RingThreadsTest, EightSessionsOnOneRingThreadAddNoThreads) {
  constexpr int kSessions = 8;
  StartAgents({"--ring_threads=1", "--max_ring_sessions_per_user=8"},
              /*peer=*/false);
  // Every buffer and handle first: gRPC's own threads settle before the
  // agent's threads are counted.
  std::vector<Buffer> locals, remotes;
  std::vector<uint64_t> handles;
  for (int i = 0; i < kSessions; ++i) {
    locals.push_back(Filled(*a_, 100 + i));
    remotes.push_back(Filled(*a_, 200 + i));
    handles.push_back(Import(remotes.back()));
  }
  std::vector<std::unique_ptr<Ring>> rings;
  rings.push_back(Open());
  ASSERT_NE(rings[0], nullptr);
  EXPECT_TRUE(
      WriteOnce(*rings[0], locals[0].id(), handles[0], 0, 1, absl::Seconds(20))
          .status.ok());
  // The attach connection's thread that opened it has returned.
  absl::SleepFor(absl::Milliseconds(200));
  const std::vector<std::string> one_session = ThreadNames(a_->pid());
  EXPECT_EQ(Count(one_session, "rdma-ring-0"), 1u);
  EXPECT_EQ(Count(one_session, "rdma-ring-1"), 0u);

  for (int i = 1; i < kSessions; ++i) {
    rings.push_back(Open());
    ASSERT_NE(rings.back(), nullptr);
  }
  // Every session moves exactly its bytes: a READ into its local buffer
  // and a WRITE out of it, at offsets of its own, all posted before any is
  // reaped.
  for (int i = 0; i < kSessions; ++i) {
    const uint64_t at = 64 * (i + 1);
    const RingOp ops[] = {
        Op(kRead, locals[i].id(), at, 100, handles[i], at, 10),
        Op(kWrite, locals[i].id(), 2048 + at, 100, handles[i], 2048 + at, 11)};
    ASSERT_TRUE(rings[i]->Submit(ops).ok());
  }
  for (int i = 0; i < kSessions; ++i) {
    std::vector<RingCompletion> ends = Reap(*rings[i], 2);
    ASSERT_EQ(ends.size(), 2u) << "session " << i;
    for (const RingCompletion& end : ends) {
      EXPECT_TRUE(end.status.ok()) << "session " << i << ": " << end.status;
    }
  }
  size_t threads_now = 0;
  EXPECT_TRUE(Eventually(
      [&] {
        threads_now = ThreadNames(a_->pid()).size();
        return threads_now <= one_session.size();
      },
      absl::Seconds(5)))
      << threads_now << " threads with " << kSessions << " sessions, "
      << one_session.size() << " with one";
  EXPECT_EQ(Count(ThreadNames(a_->pid()), "rdma-ring-0"), 1u);
  for (int i = 0; i < kSessions; ++i) {
    const uint64_t at = 64 * (i + 1);
    // Session 0's warm-up WRITE copied local [0, 8) over remote [0, 8).
    std::string local_expected = PatternString(100 + i, 0, kSize);
    local_expected.replace(at, 100, PatternString(200 + i, at, 100));
    std::string remote_expected = PatternString(200 + i, 0, kSize);
    remote_expected.replace(2048 + at, 100,
                            PatternString(100 + i, 2048 + at, 100));
    if (i == 0) remote_expected.replace(0, 8, PatternString(100, 0, 8));
    const std::string local(reinterpret_cast<const char*>(locals[i].data()),
                            kSize);
    const std::string remote(reinterpret_cast<const char*>(remotes[i].data()),
                             kSize);
    EXPECT_EQ(local, local_expected) << "session " << i;
    EXPECT_EQ(remote, remote_expected) << "session " << i;
  }
  auto listed = a_->client().ListRingSessions();
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_EQ(listed->size(), static_cast<size_t>(kSessions));
}

TEST_F(RingThreadsTest, StalledSessionsHoldUpOnlyThemselvesOnTheirThread) {
  StartAgents({"--ring_threads=1"}, /*peer=*/true);
  Buffer held_local = Filled(*a_, 1);
  Buffer far = Filled(*b_, 2);
  const uint64_t far_handle = Import(far);
  Buffer local = Filled(*a_, 3);
  Buffer near = Filled(*a_, 4);
  const uint64_t near_handle = Import(near);

  // Session 1: a READ from the held peer, running until B resumes. One
  // READ before the hold connects A to B, so that the held one waits on B
  // alone.
  std::unique_ptr<Ring> held = Open();
  ASSERT_NE(held, nullptr);
  Buffer warm = Filled(*a_, 9);
  const RingOp warm_read = Op(kRead, warm.id(), 0, 64, far_handle, 0, 0);
  ASSERT_TRUE(held->Submit({&warm_read, 1}).ok());
  std::vector<RingCompletion> warmed = Reap(*held, 1);
  ASSERT_EQ(warmed.size(), 1u);
  ASSERT_TRUE(warmed[0].status.ok()) << warmed[0].status;
  EXPECT_EQ(FirstMismatch(warm.bytes(), 2, 0, 0, 64, 9), std::nullopt);
  b_->Hold();
  const RingOp far_read =
      Op(kRead, held_local.id(), 100, 1000, far_handle, 200, 1);
  ASSERT_TRUE(held->Submit({&far_read, 1}, absl::Seconds(60)).ok());
  // Session 2: a client that never reaps: its 4 completion slots fill, then
  // the agent takes no more of its entries.
  std::unique_ptr<Ring> full = Open(4);
  ASSERT_NE(full, nullptr);
  for (uint64_t i = 0; i < 4; ++i) {
    const RingOp op = Op(kWrite, local.id(), 8 * i, 8, near_handle, 8 * i, i);
    ASSERT_TRUE(full->Submit({&op, 1}).ok());
  }
  // The agent completed all four (counted by it; the client reaps none).
  ASSERT_TRUE(Eventually([&] {
    auto sessions = a_->client().ListRingSessions();
    if (!sessions.ok()) return false;
    for (const v1::RingSession& session : *sessions) {
      if (session.entries() == 4) return session.ops_completed() == 4;
    }
    return false;
  }));
  // Session 3, on the same ring thread, keeps completing promptly.
  std::unique_ptr<Ring> busy = Open();
  ASSERT_NE(busy, nullptr);
  auto sessions = a_->client().ListRingSessions();
  ASSERT_TRUE(sessions.ok()) << sessions.status();
  ASSERT_EQ(sessions->size(), 3u);
  for (uint64_t i = 0; i < 200; ++i) {
    const RingCompletion end =
        WriteOnce(*busy, local.id(), near_handle, 1024 + 8 * (i % 64), 100 + i,
                  absl::Seconds(2));
    ASSERT_TRUE(end.status.ok()) << "op " << i << ": " << end.status;
    ASSERT_EQ(end.user_tag, 100 + i);
  }
  // The held batch is still running, the full ring still full.
  EXPECT_EQ(held->in_flight(), 1u);
  std::vector<RingCompletion> early;
  ASSERT_TRUE(held->Poll(&early).ok());
  EXPECT_TRUE(early.empty()) << early[0].status;

  // Both stalls clear on their own: B resumes, the client reaps.
  b_->Resume();
  std::vector<RingCompletion> far_end = Reap(*held, 1);
  ASSERT_EQ(far_end.size(), 1u);
  EXPECT_TRUE(far_end[0].status.ok()) << far_end[0].status;
  EXPECT_EQ(FirstMismatch(held_local.bytes(), 2, 200, 100, 1000, 1),
            std::nullopt);
  EXPECT_EQ(Reap(*full, 4).size(), 4u);
  const RingOp more = Op(kWrite, local.id(), 40, 8, near_handle, 40, 9);
  ASSERT_TRUE(full->Submit({&more, 1}).ok());
  std::vector<RingCompletion> more_end = Reap(*full, 1);
  ASSERT_EQ(more_end.size(), 1u);
  EXPECT_TRUE(more_end[0].status.ok()) << more_end[0].status;
}

TEST_F(RingThreadsTest, AKilledClientEndsOnlyItsOwnSession) {
  StartAgents({"--ring_threads=1", "--max_ring_sessions_per_user=2"},
              /*peer=*/true);
  Buffer local = Filled(*a_, 5);
  Buffer near = Filled(*a_, 6);
  const uint64_t near_handle = Import(near);
  Buffer far = Filled(*b_, 7);
  std::unique_ptr<Ring> ring = Open();
  ASSERT_NE(ring, nullptr);
  ASSERT_TRUE(WriteOnce(*ring, local.id(), near_handle, 0, 1, absl::Seconds(20))
                  .status.ok());
  auto bytes_before = ScrapeSum(*a_, "rdma_agentd_registered_bytes");
  ASSERT_TRUE(bytes_before.ok()) << bytes_before.status();

  // Another process of the same user opens a ring on the same thread and
  // posts a READ from the held peer; killed while it runs.
  auto worker = WorkerProcess::Start(*a_);
  ASSERT_TRUE(worker.ok()) << worker.status();
  auto allocated = worker->CallWords("allocate 4096 3");
  ASSERT_TRUE(allocated.ok()) << allocated.status();
  auto worker_buffer = ParseRegistered(*allocated);
  ASSERT_TRUE(worker_buffer.ok()) << worker_buffer.status();
  auto imported = worker->CallWords(
      absl::StrCat("import ", absl::Base64Escape(far.remote_context())));
  ASSERT_TRUE(imported.ok()) << imported.status();
  ASSERT_EQ(imported->size(), 2u) << absl::StrJoin(*imported, " ");
  ASSERT_EQ(worker->Answer("ring_open 8"), "ok");
  // Both places of the user are taken.
  EXPECT_EQ(a_->client().OpenRing(8).status().code(),
            absl::StatusCode::kResourceExhausted);
  b_->Hold();
  ASSERT_TRUE(worker->process()
                  .WriteLine(absl::StrCat("ring_op read ", worker_buffer->id,
                                          " 0 1000 0 ", (*imported)[1]))
                  .ok());
  ASSERT_TRUE(Eventually([&] { return RingBatchesInFlight() == 1; }));

  // The other session on the thread keeps it busy meanwhile: 4 WRITEs in
  // flight at all times, each reaped within 2 s.
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> completed{0};
  absl::Status busy_error;
  std::thread busy([&] {
    uint64_t tag = 100;
    // Until stopped, and at least 64 WRITEs: every offset below 512 once.
    const auto more = [&] { return !stop.load() || tag < 164; };
    while (more() || ring->in_flight() > 0) {
      while (more() && ring->in_flight() < 4) {
        const RingOp op = Op(kWrite, local.id(), 8 * (tag % 64), 8, near_handle,
                             8 * (tag % 64), tag);
        busy_error = ring->Submit({&op, 1});
        if (!busy_error.ok()) return;
        ++tag;
      }
      std::vector<RingCompletion> ends;
      auto got = ring->Wait(&ends, absl::Seconds(2));
      if (!got.ok()) {
        busy_error = got.status();
        return;
      }
      for (const RingCompletion& end : ends) {
        if (!end.status.ok()) busy_error = end.status;
      }
      if (!busy_error.ok()) return;
      completed += ends.size();
    }
  });
  EXPECT_TRUE(Eventually([&] { return completed.load() >= 8; }));
  worker->process().Signal(SIGKILL);
  ASSERT_TRUE(worker->process().Wait(absl::Seconds(30)).ok());
  // The killed session ended while B is still held: its batch cancelled
  // (a session ends only once its batches have), its place and its ring's
  // and buffer's bytes given back.
  EXPECT_TRUE(Eventually([&] {
    return ScrapeSum(*a_, "rdma_agentd_ring_sessions").value_or(-1) == 1 &&
           ScrapeSum(*a_, "rdma_agentd_registered_bytes").value_or(-1) ==
               *bytes_before;
  }));
  // The busy session still runs.
  const uint64_t after_end = completed.load();
  EXPECT_TRUE(Eventually([&] { return completed.load() > after_end + 8; }));
  stop = true;
  busy.join();
  EXPECT_TRUE(busy_error.ok()) << busy_error;
  // And its ops' admission.
  EXPECT_TRUE(Eventually([&] {
    return ScrapeSum(*a_, "rdma_agentd_ops_in_flight").value_or(-1) == 0;
  }));
  EXPECT_TRUE(b_->held());
  auto again = a_->client().OpenRing(8);
  EXPECT_TRUE(again.ok()) << again.status();
  b_->Resume();  // before `far` is released on B
  // Every WRITE moved local [0, 512) onto the same range of `near` alone.
  EXPECT_EQ(FirstMismatch(near.bytes(), 5, 0, 0, 512, 6), std::nullopt);
  EXPECT_EQ(FindMismatch(local.bytes(), 5), std::nullopt);
}

TEST_F(RingThreadsTest, AStoppingAgentEndsTheSessionsOfEveryRingThread) {
  StartAgents({"--ring_threads=2", "--max_ring_sessions_per_user=4"},
              /*peer=*/true);
  const std::vector<std::string> names = ThreadNames(a_->pid());
  EXPECT_EQ(Count(names, "rdma-ring-0"), 1u);
  EXPECT_EQ(Count(names, "rdma-ring-1"), 1u);
  EXPECT_EQ(Count(names, "rdma-ring-2"), 0u);
  Buffer far = Filled(*b_, 8);
  const uint64_t far_handle = Import(far);
  std::vector<Buffer> locals;
  std::vector<std::unique_ptr<Ring>> rings;
  // Four sessions, two per thread (the least loaded takes the next), each
  // with a READ from the held peer running.
  b_->Hold();
  for (uint64_t i = 0; i < 4; ++i) {
    locals.push_back(Filled(*a_, 20 + i));
    rings.push_back(Open());
    ASSERT_NE(rings.back(), nullptr);
    const RingOp op = Op(kRead, locals.back().id(), 0, 1000, far_handle, 0, i);
    ASSERT_TRUE(rings.back()->Submit({&op, 1}, absl::Seconds(60)).ok());
  }
  ASSERT_TRUE(Eventually([&] { return RingBatchesInFlight() == 4; }));
  const absl::Time start = absl::Now();
  auto code = a_->Stop(SIGTERM, absl::Seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  // Each batch's completion was posted before its session went; nothing
  // of it landed.
  for (uint64_t i = 0; i < 4; ++i) {
    std::vector<RingCompletion> ends;
    auto polled = rings[i]->Poll(&ends);
    ASSERT_TRUE(polled.ok()) << polled.status();
    ASSERT_EQ(ends.size(), 1u) << "session " << i;
    EXPECT_EQ(ends[0].user_tag, i);
    EXPECT_EQ(ends[0].status.code(), absl::StatusCode::kCancelled)
        << ends[0].status;
    EXPECT_EQ(rings[i]->Poll(&ends).status().code(),
              absl::StatusCode::kUnavailable);
    if (b_ != nullptr) b_->Resume();
    EXPECT_EQ(FindMismatch(locals[i].bytes(), 20 + i), std::nullopt);
  }
}

}  // namespace
}  // namespace rdma_agent::testing

// Clients that die holding registrations, against real rdma-agentd processes
// and real client processes (client_worker) that are SIGKILLed: what a
// client bound to its process goes with it, and so does its quota charge;
// what it registered with agent lifetime stays; ops in flight on the dead
// client's memory end cleanly; ListBuffers tells root whose each buffer is
// and when it was last used. Some cases need root (a second user, a pid
// namespace) and skip without it.
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/unique_fd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/worker_process.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/eventually.h"
#include "tests/testing/pattern.h"
#include "tests/testing/process.h"

namespace rdma_agent::testing {
namespace {

namespace v1 = ::rdma::agent::v1;
using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr int kReadWrite = 3;  // v1::ACCESS_READ_WRITE
constexpr uint64_t kMiB = 1 << 20;
constexpr int kOtherUser = 65533;

uint64_t IdOf(const WorkerBuffer& buffer) {
  uint64_t id = 0;
  EXPECT_TRUE(absl::SimpleAtoi(buffer.id, &id)) << buffer.id;
  return id;
}

int64_t Nanos(const google::protobuf::Timestamp& time) {
  return time.seconds() * 1000000000 + time.nanos();
}

// The clock the agent stamps uses with.
int64_t CoarseNowNanos() {
  struct timespec now;
  ::clock_gettime(CLOCK_REALTIME_COARSE, &now);
  return int64_t{now.tv_sec} * 1000000000 + now.tv_nsec;
}

// Waits until the coarse clock has passed `nanos`: a use stamped afterwards
// is told apart from one stamped at `nanos`.
void WaitForCoarseClockPast(int64_t nanos) {
  ASSERT_TRUE(
      Eventually([&] { return CoarseNowNanos() > nanos; }, absl::Seconds(5)));
}

// Whether this kernel has SO_PEERPIDFD (Linux 6.5).
bool KernelHasPeerPidfd() {
  int pair[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) {
    return false;
  }
  UniqueFd a(pair[0]), b(pair[1]);
  int pidfd = -1;
  socklen_t length = sizeof(pidfd);
  if (::getsockopt(a.get(), SOL_SOCKET, /*SO_PEERPIDFD=*/77, &pidfd, &length) !=
      0) {
    return false;
  }
  ::close(pidfd);
  return true;
}

class ClientLifetimeTest : public ::testing::Test {
 protected:
  void StartAgent(AgentProcess::Options options = AgentProcess::Options()) {
    auto agent = AgentProcess::Start(std::move(options));
    ASSERT_TRUE(agent.ok()) << agent.status();
    agent_ = std::move(*agent);
  }
  void StartAgentWith(std::vector<std::string> extra_flags) {
    AgentProcess::Options options;
    options.extra_flags = std::move(extra_flags);
    StartAgent(std::move(options));
  }

  std::optional<WorkerProcess> StartWorker(
      WorkerProcess::Options options = WorkerProcess::Options()) {
    auto worker = WorkerProcess::Start(*agent_, options);
    EXPECT_TRUE(worker.ok()) << worker.status();
    if (!worker.ok()) return std::nullopt;
    return std::move(*worker);
  }

  // Registers with `command` ("allocate SIZE ACCESS [LIFETIME]" or
  // "attach ...") in `worker`.
  static WorkerBuffer Register(WorkerProcess& worker,
                               absl::string_view command) {
    auto words = worker.CallWords(command);
    EXPECT_TRUE(words.ok()) << words.status();
    if (!words.ok()) return {};
    auto buffer = ParseRegistered(*words);
    EXPECT_TRUE(buffer.ok()) << buffer.status();
    return buffer.ok() ? *buffer : WorkerBuffer();
  }

  // Registration `id` as the test (root, normally) lists it: its own user's
  // registrations, or every user's.
  std::optional<v1::BufferInfo> Listed(uint64_t id, bool all_users = false) {
    auto buffers = agent_->client().ListBuffers(all_users);
    EXPECT_TRUE(buffers.ok()) << buffers.status();
    if (!buffers.ok()) return std::nullopt;
    for (const v1::BufferInfo& info : *buffers) {
      if (info.buffer_id() == id) return info;
    }
    return std::nullopt;
  }

  bool Gone(uint64_t id, bool all_users = false) {
    return !Listed(id, all_users).has_value();
  }

  std::unique_ptr<AgentProcess> agent_;
};

TEST_F(ClientLifetimeTest,
       KilledClientsBoundBuffersGoWithTheirQuotaOthersStay) {
  StartAgentWith({"--max_buffers_per_user=3",
                  absl::StrCat("--max_registered_bytes_per_user=", 3 * kMiB)});
  std::optional<WorkerProcess> worker = StartWorker();
  ASSERT_TRUE(worker.has_value());
  const uint64_t kept = IdOf(Register(
      *worker, absl::StrCat("allocate ", kMiB, " ", kReadWrite, " agent")));
  // The client library's default for a mapped buffer: the process.
  const uint64_t allocated =
      IdOf(Register(*worker, absl::StrCat("allocate ", kMiB, " ", kReadWrite)));
  const uint64_t attached = IdOf(Register(
      *worker, absl::StrCat("attach ", kMiB, " ", kReadWrite, " process")));
  ASSERT_EQ(Listed(kept)->lifetime(), v1::LIFETIME_AGENT);
  ASSERT_EQ(Listed(allocated)->lifetime(), v1::LIFETIME_CLIENT_PROCESS);
  ASSERT_EQ(Listed(attached)->lifetime(), v1::LIFETIME_CLIENT_PROCESS);
  // The user is at its quota (the test runs as the worker's user).
  EXPECT_EQ(
      agent_->client().Allocate(kMiB, v1::ACCESS_READ_WRITE).status().code(),
      absl::StatusCode::kResourceExhausted);

  const pid_t pid = worker->process().pid();
  worker->process().Signal(SIGKILL);
  ASSERT_TRUE(Eventually([&] { return Gone(allocated) && Gone(attached); }))
      << "the dead client's process-bound buffers are still registered";
  EXPECT_FALSE(Gone(kept)) << "agent lifetime must outlive the client";
  // One line says whose buffers went, and why (ids ascending; ids are
  // random, so not necessarily in the order registered).
  const std::string line = absl::StrCat(
      "uid ", ::geteuid(), " pid ", pid,
      ": its process exited; released buffers ", std::min(allocated, attached),
      ",", std::max(allocated, attached));
  EXPECT_TRUE(Eventually([&] {
    return absl::StrContains(agent_->Log(), line);
  })) << "no \""
      << line << "\" in\n"
      << agent_->Log();

  // Their registrations and bytes were given back: the user fills its quota
  // again, and the kept buffer still serves.
  std::vector<client::Buffer> again;
  for (int i = 0; i < 2; ++i) {
    auto buffer = agent_->client().Allocate(kMiB, v1::ACCESS_READ_WRITE);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    again.push_back(std::move(*buffer));
  }
  auto bytes = agent_->client().ReadBuffer(kept, 0, 16);
  EXPECT_TRUE(bytes.ok()) << bytes.status();
}

TEST_F(ClientLifetimeTest, OpsOnADeadOwnersBufferCompleteOrFailCleanly) {
  StartAgent();
  std::optional<WorkerProcess> owner = StartWorker();
  ASSERT_TRUE(owner.has_value());
  // 16 ranges of 4 MiB, read again and again into the same ranges of a
  // buffer of this process: seconds of copying, during which the owner of
  // the source dies.
  constexpr uint64_t kRange = 4 * kMiB;
  constexpr int kRanges = 16;
  constexpr int kRounds = 128;
  constexpr uint64_t kSize = kRange * kRanges;
  const WorkerBuffer source = Register(
      *owner, absl::StrCat("attach ", kSize, " ", kReadWrite, " process"));
  ASSERT_EQ(owner->Answer(absl::StrCat("fill ", source.id, " 7")), "ok");
  std::string context;
  ASSERT_TRUE(absl::Base64Unescape(source.context, &context));
  auto local = agent_->client().Allocate(kSize, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(local.ok()) << local.status();
  FillPattern(local->bytes(), 1);
  std::vector<client::OpSpec> ops;
  for (int round = 0; round < kRounds; ++round) {
    for (int i = 0; i < kRanges; ++i) {
      client::OpSpec op;
      op.type = v1::OP_TYPE_READ_INTO_LOCAL;
      op.local_buffer_id = local->id();
      op.local_offset = i * kRange;
      op.length = kRange;
      op.remote_context = context;
      op.remote_offset = i * kRange;
      ops.push_back(op);
    }
  }
  absl::StatusOr<std::vector<client::OpResult>> results;
  std::thread submit(
      [&] { results = agent_->client().Submit(ops, absl::Seconds(120)); });
  const bool started = Eventually(
      [&] {
        auto info = Listed(IdOf(source));
        return info.has_value() && info->bytes_served() > 0;
      },
      absl::Seconds(30));
  owner->process().Signal(SIGKILL);
  submit.join();
  ASSERT_TRUE(started) << "the Submit never started";

  ASSERT_TRUE(agent_->Running()) << agent_->Log();
  ASSERT_TRUE(results.ok()) << results.status();
  ASSERT_EQ(results->size(), ops.size());
  int ok = 0, not_found = 0;
  std::vector<bool> copied(kRanges, false);
  for (size_t k = 0; k < results->size(); ++k) {
    const absl::Status& status = (*results)[k].status;
    if (status.ok()) {
      ++ok;
      copied[k % kRanges] = true;
    } else if (absl::IsNotFound(status)) {
      ++not_found;  // released before this op began
    } else {
      ADD_FAILURE() << "op " << k << ": " << status;
    }
  }
  EXPECT_GT(ok, 0);
  EXPECT_GT(not_found, 0) << "the owner died after the Submit: nothing was "
                             "in flight";
  // Every range holds either the source's bytes (some op copied it, the one
  // in flight at the release included) or its own: nothing half-done or
  // from freed memory.
  for (int i = 0; i < kRanges; ++i) {
    const uint64_t seed = copied[i] ? 7 : 1;
    EXPECT_EQ(FindMismatch(local->bytes().subspan(i * kRange, kRange), seed,
                           i * kRange),
              std::nullopt)
        << "range " << i << (copied[i] ? " (copied)" : " (never copied)");
  }
  EXPECT_TRUE(Gone(IdOf(source)));
}

TEST_F(ClientLifetimeTest, OwnersOwnSubmitInFlightEndsAndGivesTheMemoryBack) {
  constexpr uint64_t kHalf = 128 * kMiB;
  StartAgentWith({absl::StrCat("--max_registered_bytes_per_user=", 2 * kHalf)});
  std::optional<WorkerProcess> owner = StartWorker();
  ASSERT_TRUE(owner.has_value());
  const WorkerBuffer buffer =
      Register(*owner, absl::StrCat("allocate ", 2 * kHalf, " ", kReadWrite));
  // Thousands of 128 MiB copies inside the buffer: minutes unless stopped.
  ASSERT_TRUE(
      owner->process()
          .WriteLine(absl::StrCat("submit_many 4096 read ", buffer.id, " 0 ",
                                  kHalf, " ", kHalf, " ", buffer.context))
          .ok());
  ASSERT_TRUE(Eventually(
      [&] {
        auto info = Listed(IdOf(buffer));
        return info.has_value() && info->bytes_moved() > 0;
      },
      absl::Seconds(30)))
      << "the long Submit never started";
  owner->process().Signal(SIGKILL);
  EXPECT_TRUE(Eventually([&] { return Gone(IdOf(buffer)); }));
  // The ops in flight pinned the memory; once they are cancelled it is
  // unmapped and its bytes given back: the user can register as much again.
  EXPECT_TRUE(Eventually([&] {
    return agent_->client()
        .AllocateUnmapped(2 * kHalf, v1::ACCESS_READ_WRITE)
        .ok();
  }));
  EXPECT_TRUE(agent_->Running()) << agent_->Log();
}

TEST_F(ClientLifetimeTest, ListBuffersSaysWhoseAndWhenLastUsed) {
  StartAgent();
  std::optional<WorkerProcess> owner = StartWorker();
  ASSERT_TRUE(owner.has_value());
  const int64_t before = CoarseNowNanos();
  const WorkerBuffer x =
      Register(*owner, absl::StrCat("allocate 4096 ", kReadWrite));
  const WorkerBuffer y =
      Register(*owner, absl::StrCat("allocate 4096 ", kReadWrite, " agent"));
  const int64_t after = CoarseNowNanos();
  auto info = Listed(IdOf(x));
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->owner_uid(), ::geteuid());
  EXPECT_EQ(info->owner_pid(), static_cast<uint32_t>(owner->process().pid()));
  EXPECT_EQ(info->lifetime(), v1::LIFETIME_CLIENT_PROCESS);
  EXPECT_EQ(Listed(IdOf(y))->lifetime(), v1::LIFETIME_AGENT);
  const int64_t created = Nanos(info->create_time());
  EXPECT_GE(created, before);
  EXPECT_LE(created, after);
  EXPECT_EQ(Nanos(info->last_use_time()), created);

  // Each kind of use moves last use, and only last use.
  int64_t last = created;
  auto expect_used = [&](absl::string_view command, absl::string_view answer) {
    WaitForCoarseClockPast(last);
    ASSERT_THAT(owner->Answer(command), StartsWith(std::string(answer)))
        << command;
    auto now = Listed(IdOf(x));
    ASSERT_TRUE(now.has_value());
    EXPECT_GT(Nanos(now->last_use_time()), last) << command;
    EXPECT_EQ(Nanos(now->create_time()), created);
    last = Nanos(now->last_use_time());
  };
  expect_used(absl::StrCat("writebuf ", x.id, " 0 0102"), "status OK");
  expect_used(absl::StrCat("readbuf ", x.id, " 0 2"), "status OK 0102");
  // An op: x is its local side, y its remote side; both count as used.
  const int64_t y_before = Nanos(Listed(IdOf(y))->last_use_time());
  expect_used(absl::StrCat("submit write ", x.id, " 0 2 0 ", y.context),
              "result OK");
  EXPECT_GT(Nanos(Listed(IdOf(y))->last_use_time()), y_before);
}

TEST_F(ClientLifetimeTest, OnlyRootListsEveryUsersBuffers) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a second user";
  StartAgent();
  // mkdtemp made the runtime dir 0700; the other user must reach the
  // sockets in it.
  ASSERT_EQ(::chmod(agent_->runtime_dir().c_str(), 0755), 0);
  WorkerProcess::Options as_other;
  as_other.uid = kOtherUser;
  as_other.gid = kOtherUser;
  std::optional<WorkerProcess> other = StartWorker(as_other);
  ASSERT_TRUE(other.has_value());
  const uint64_t theirs =
      IdOf(Register(*other, absl::StrCat("allocate 4096 ", kReadWrite)));
  auto mine = agent_->client().Allocate(4096, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(mine.ok()) << mine.status();

  // Root's own list is root's own.
  EXPECT_TRUE(Gone(theirs));
  EXPECT_FALSE(Gone(mine->id()));
  // Every user's, with whose each one is.
  auto listed = Listed(theirs, /*all_users=*/true);
  ASSERT_TRUE(listed.has_value());
  EXPECT_EQ(listed->owner_uid(), static_cast<uint32_t>(kOtherUser));
  EXPECT_EQ(listed->owner_pid(), static_cast<uint32_t>(other->process().pid()));
  EXPECT_EQ(listed->lifetime(), v1::LIFETIME_CLIENT_PROCESS);
  EXPECT_FALSE(Gone(mine->id(), /*all_users=*/true));

  // Anyone else may not ask.
  const std::string refused = other->Answer("list_all");
  EXPECT_THAT(refused, StartsWith("error PERMISSION_DENIED "));
  EXPECT_THAT(refused, HasSubstr("ListBuffers"));
  EXPECT_EQ(other->Answer("list"), absl::StrCat("ids ", theirs));

  // Another user's process is watched like root's own.
  other->process().Signal(SIGKILL);
  EXPECT_TRUE(Eventually([&] { return Gone(theirs, /*all_users=*/true); }));
}

TEST_F(ClientLifetimeTest, ClientsTheAgentCannotSeeByPidAreWatchedToo) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root for a pid namespace";
  if (!RunCommand({"unshare", "--pid", "--fork", "--", "true"}).ok()) {
    GTEST_SKIP() << "cannot create a pid namespace here";
  }
  // The agent in a pid namespace of its own (as in a container without the
  // host's pids): every client's SO_PEERCRED pid reads 0 there.
  AgentProcess::Options options;
  options.wrapper = {"unshare", "--pid", "--kill-child", "--"};
  StartAgent(std::move(options));
  std::optional<WorkerProcess> worker = StartWorker();
  ASSERT_TRUE(worker.has_value());
  const uint64_t id =
      IdOf(Register(*worker, absl::StrCat("allocate 4096 ", kReadWrite)));
  auto info = Listed(id);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->owner_pid(), 0u);
  // SO_PEERPIDFD still names the process; without it, the connection is
  // all the agent can watch.
  EXPECT_EQ(info->lifetime(), KernelHasPeerPidfd()
                                  ? v1::LIFETIME_CLIENT_PROCESS
                                  : v1::LIFETIME_CLIENT_CONNECTION);
  worker->process().Signal(SIGKILL);
  EXPECT_TRUE(Eventually([&] { return Gone(id); }));
}

}  // namespace
}  // namespace rdma_agent::testing

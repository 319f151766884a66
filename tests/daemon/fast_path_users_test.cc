// Imported remotes and prepared transfers are scoped to the user that made
// them: another local user (a client_worker process that drops to uid 65534
// before connecting) naming the owner's (uid 65533) handle or prepared id
// gets NOT_FOUND exactly as for ids that do not exist, cannot release them,
// does not see them listed, and moves no byte with them; the owner's still
// work. Every byte of every buffer is checked. Needs root to switch users.

#include <unistd.h>

#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/client/worker_process.h"
#include "tests/testing/agent_fixture.h"
#include "tests/testing/pattern.h"

namespace rdma_agent::testing {
namespace {

constexpr int kOwner = 65533;
constexpr int kOther = 65534;
constexpr int kReadWrite = 3;  // v1::ACCESS_READ_WRITE
constexpr uint64_t kSize = 4096;

WorkerProcess StartWorker(InProcessAgent& agent, int uid) {
  WorkerProcess::Options options;
  options.uid = uid;
  options.gid = uid;
  auto worker = WorkerProcess::Start(
      agent.agent().target(), agent.agent().attach_socket_path(), options);
  EXPECT_TRUE(worker.ok()) << worker.status();
  return std::move(*worker);
}

WorkerBuffer Attach(WorkerProcess& worker, int seed) {
  auto words =
      worker.CallWords(absl::StrCat("attach ", kSize, " ", kReadWrite));
  EXPECT_TRUE(words.ok()) << words.status();
  auto buffer = ParseRegistered(*words);
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_EQ(worker.Answer(absl::StrCat("fill ", buffer->id, " ", seed)), "ok");
  return *buffer;
}

// The word after `prefix` in `answer` ("handle 12" -> "12").
std::string After(const std::string& answer, const std::string& prefix) {
  EXPECT_EQ(answer.rfind(prefix + " ", 0), 0u) << answer;
  return answer.substr(prefix.size() + 1);
}

TEST(FastPathUsersTest, AnotherUsersHandlesAndPreparedTransfersAreInvisible) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run other users";
  auto agent = InProcessAgent::Start();
  ASSERT_TRUE(agent.ok()) << agent.status();
  WorkerProcess owner = StartWorker(**agent, kOwner);
  WorkerProcess other = StartWorker(**agent, kOther);

  const WorkerBuffer local = Attach(owner, 1);
  const WorkerBuffer source = Attach(owner, 2);
  const WorkerBuffer others = Attach(other, 3);
  const std::string handle =
      After(owner.Answer(absl::StrCat("import ", source.context)), "handle");
  const std::string prepared =
      After(owner.Answer(
                absl::StrCat("prepare read ", local.id, " 0 100 200 ", handle)),
            "prepared");

  // The other user's own handle works, so what follows is about whose
  // handle it is, not a broken client.
  const std::string own_handle =
      After(other.Answer(absl::StrCat("import ", others.context)), "handle");
  ASSERT_NE(own_handle, handle);
  EXPECT_EQ(other.Answer(absl::StrCat("remotes")),
            absl::StrCat("handles ", own_handle));

  // The owner's handle, named by the other user, reads as an unknown one:
  // the same code and the same words.
  const std::string unknown = "123456789";
  EXPECT_EQ(other.Answer(absl::StrCat("submit_handle read ", others.id,
                                      " 0 100 0 ", handle)),
            absl::StrCat("result NOT_FOUND - op 0: remote handle ", handle,
                         " is not imported"));
  EXPECT_EQ(other.Answer(absl::StrCat("submit_handle read ", others.id,
                                      " 0 100 0 ", unknown)),
            absl::StrCat("result NOT_FOUND - op 0: remote handle ", unknown,
                         " is not imported"));
  EXPECT_EQ(other
                .Answer(absl::StrCat("submit_handle write ", others.id,
                                     " 0 100 0 ", handle))
                .rfind("result NOT_FOUND", 0),
            0u);
  EXPECT_EQ(other.Answer(
                absl::StrCat("prepare read ", others.id, " 0 100 0 ", handle)),
            absl::StrCat("error NOT_FOUND PrepareTransfer: op 0: remote "
                         "handle ",
                         handle, " is not imported"));
  EXPECT_EQ(other.Answer(absl::StrCat("release_remote ", handle)),
            "status NOT_FOUND");
  // The owner's prepared transfer, likewise.
  EXPECT_EQ(other.Answer(absl::StrCat("run_prepared ", prepared)),
            absl::StrCat("error NOT_FOUND Submit: prepared transfer ", prepared,
                         " is not prepared"));
  EXPECT_EQ(other.Answer(absl::StrCat("release_prepared ", prepared)),
            "status NOT_FOUND");

  // Nothing moved: every byte of every buffer is as filled.
  EXPECT_EQ(other.Answer(absl::StrCat("verify ", others.id, " 3 0 0 0 3")),
            "ok");
  EXPECT_EQ(owner.Answer(absl::StrCat("verify ", local.id, " 1 0 0 0 1")),
            "ok");
  EXPECT_EQ(owner.Answer(absl::StrCat("verify ", source.id, " 2 0 0 0 2")),
            "ok");

  // The owner's handle and prepared transfer still work, and move exactly
  // their bytes: [0, 100) of `local` gets `source`'s [200, 300), then
  // [1000, 1050) gets [0, 50) through the handle.
  EXPECT_EQ(owner.Answer(absl::StrCat("run_prepared ", prepared)),
            "result OK memory ");
  EXPECT_EQ(owner.Answer(absl::StrCat("verify ", local.id, " 2 200 0 100 1")),
            "ok");
  EXPECT_EQ(owner.Answer(absl::StrCat("submit_handle read ", local.id,
                                      " 1000 50 0 ", handle)),
            "result OK memory ");
  std::string expected = PatternString(1, 0, kSize);
  expected.replace(0, 100, PatternString(2, 200, 100));
  expected.replace(1000, 50, PatternString(2, 0, 50));
  EXPECT_EQ(owner.Answer(absl::StrCat("readbuf ", local.id, " 0 ", kSize)),
            absl::StrCat("status OK ", absl::BytesToHexString(expected)));
  EXPECT_EQ(owner.Answer(absl::StrCat("verify ", source.id, " 2 0 0 0 2")),
            "ok");
  EXPECT_EQ(owner.Answer("remotes"), absl::StrCat("handles ", handle));
  EXPECT_EQ(owner.Answer(absl::StrCat("release_remote ", handle)), "status OK");
  EXPECT_EQ(owner.Answer(absl::StrCat("release_prepared ", prepared)),
            "status OK");
}

// A ring session acts for the user that opened it: another user's ring
// naming the owner's buffer ids or handles gets NOT_FOUND, as its gRPC
// calls do, and moves no byte; the owner's ring works.
TEST(FastPathUsersTest, OneUsersRingReachesNoneOfAnothersBuffers) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run other users";
  auto agent = InProcessAgent::Start();
  ASSERT_TRUE(agent.ok()) << agent.status();
  WorkerProcess owner = StartWorker(**agent, kOwner);
  WorkerProcess other = StartWorker(**agent, kOther);
  const WorkerBuffer local = Attach(owner, 1);
  const WorkerBuffer source = Attach(owner, 2);
  const WorkerBuffer others = Attach(other, 3);
  const std::string handle =
      After(owner.Answer(absl::StrCat("import ", source.context)), "handle");
  const std::string own_handle =
      After(other.Answer(absl::StrCat("import ", others.context)), "handle");
  ASSERT_EQ(owner.Answer("ring_open 8"), "ok");
  ASSERT_EQ(other.Answer("ring_open 8"), "ok");

  // The owner's handle, from the other user's ring.
  EXPECT_EQ(other.Answer(
                absl::StrCat("ring_op read ", others.id, " 0 100 0 ", handle)),
            absl::StrCat("result NOT_FOUND - op 0: remote handle ", handle,
                         " is not imported"));
  // The owner's buffer as the other user's local side, both ways.
  for (const char* direction : {"read", "write"}) {
    EXPECT_EQ(other.Answer(absl::StrCat("ring_op ", direction, " ", local.id,
                                        " 0 100 0 ", own_handle)),
              absl::StrCat("result NOT_FOUND - op 0: local buffer ", local.id,
                           " is not registered"));
  }
  // The other user's own ring op works: the refusals are about whose.
  EXPECT_EQ(other.Answer(absl::StrCat("ring_op read ", others.id, " 0 100 200 ",
                                      own_handle)),
            "result OK memory ");
  // Every byte of the owner's buffers is as filled.
  EXPECT_EQ(owner.Answer(absl::StrCat("verify ", local.id, " 1 0 0 0 1")),
            "ok");
  EXPECT_EQ(owner.Answer(absl::StrCat("verify ", source.id, " 2 0 0 0 2")),
            "ok");
  // The owner's ring moves exactly its bytes.
  EXPECT_EQ(owner.Answer(
                absl::StrCat("ring_op read ", local.id, " 64 32 16 ", handle)),
            "result OK memory ");
  EXPECT_EQ(owner.Answer(absl::StrCat("verify ", local.id, " 2 16 64 32 1")),
            "ok");
}

}  // namespace
}  // namespace rdma_agent::testing

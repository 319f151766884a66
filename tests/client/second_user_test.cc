// A second local user (uid/gid 65534, a worker process that drops to it
// before connecting) names the buffer ids of another user (uid/gid 65533;
// not root, whom the agent lets see every buffer): every
// RPC that takes a local buffer id answers NOT_FOUND, as if the id did not
// exist, the attach socket does not hand out the fd, and the owner's bytes
// are untouched. Needs root to switch users.

#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/client/worker_process.h"
#include "tests/testing/agent_process.h"

namespace rdma_agent::testing {
namespace {

constexpr int kNobody = 65534;
constexpr int kOwner = 65533;
constexpr int kReadWrite = 3;  // v1::ACCESS_READ_WRITE

class SecondUserTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a second user";
    auto agent = AgentProcess::Start();
    ASSERT_TRUE(agent.ok()) << agent.status();
    agent_ = std::move(*agent);
    // The runtime dir comes from mkdtemp (0700); the other user must reach
    // the sockets in it (the daemon makes them 0666).
    ASSERT_EQ(::chmod(agent_->runtime_dir().c_str(), 0755), 0);

    WorkerProcess::Options as_owner;
    as_owner.uid = kOwner;
    as_owner.gid = kOwner;
    auto owner = WorkerProcess::Start(*agent_, as_owner);
    ASSERT_TRUE(owner.ok()) << owner.status();
    owner_.emplace(std::move(*owner));
    WorkerProcess::Options as_nobody;
    as_nobody.uid = kNobody;
    as_nobody.gid = kNobody;
    auto other = WorkerProcess::Start(*agent_, as_nobody);
    ASSERT_TRUE(other.ok()) << other.status();
    other_.emplace(std::move(*other));
  }

  std::unique_ptr<AgentProcess> agent_;
  std::optional<WorkerProcess> owner_;
  std::optional<WorkerProcess> other_;
};

TEST_F(SecondUserTest, AnotherUsersBufferIdsAreNotFound) {
  // The owner's buffers: one agent-allocated, one attached; known bytes.
  auto allocated =
      owner_->CallWords(absl::StrCat("allocate 4096 ", kReadWrite));
  ASSERT_TRUE(allocated.ok()) << allocated.status();
  auto owned_allocated = ParseRegistered(*allocated);
  ASSERT_TRUE(owned_allocated.ok()) << owned_allocated.status();
  auto attached = owner_->CallWords(absl::StrCat("attach 4096 ", kReadWrite));
  ASSERT_TRUE(attached.ok()) << attached.status();
  auto owned_attached = ParseRegistered(*attached);
  ASSERT_TRUE(owned_attached.ok()) << owned_attached.status();
  for (const WorkerBuffer* owned : {&*owned_allocated, &*owned_attached}) {
    ASSERT_EQ(owner_->Answer(absl::StrCat("writebuf ", owned->id, " 0 c0ffee")),
              "status OK");
  }

  // The other user's own buffer works (so NOT_FOUND below is about
  // ownership, not a broken client), and its id is not the owner's.
  auto mine = other_->CallWords(absl::StrCat("allocate 4096 ", kReadWrite));
  ASSERT_TRUE(mine.ok()) << mine.status();
  auto own = ParseRegistered(*mine);
  ASSERT_TRUE(own.ok()) << own.status();
  ASSERT_NE(own->id, owned_allocated->id);
  ASSERT_NE(own->id, owned_attached->id);
  EXPECT_EQ(other_->Answer(absl::StrCat("readbuf ", own->id, " 0 2")),
            "status OK 0000");
  EXPECT_EQ(other_->Answer(absl::StrCat("open ", own->id)), "status OK fd");

  for (const WorkerBuffer* owned : {&*owned_allocated, &*owned_attached}) {
    SCOPED_TRACE(absl::StrCat("owner's buffer ", owned->id));
    EXPECT_EQ(other_->Answer(absl::StrCat("readbuf ", owned->id, " 0 3")),
              "status NOT_FOUND");
    EXPECT_EQ(other_->Answer(absl::StrCat("writebuf ", owned->id, " 0 ffff")),
              "status NOT_FOUND");
    // The other user's id as the local side; its own, valid context as the
    // remote side, so that only the local id is wrong.
    for (const char* type : {"read", "write"}) {
      auto result = other_->CallWords(absl::StrCat(
          "submit ", type, " ", owned->id, " 0 3 0 ", own->context));
      ASSERT_TRUE(result.ok()) << result.status();
      ASSERT_GE(result->size(), 2u);
      EXPECT_EQ((*result)[0], "result");
      EXPECT_EQ((*result)[1], "NOT_FOUND") << absl::StrJoin(*result, " ");
    }
    EXPECT_EQ(other_->Answer(absl::StrCat("open ", owned->id)),
              "status NOT_FOUND nofd");
    EXPECT_EQ(other_->Answer(absl::StrCat("release ", owned->id)),
              "status NOT_FOUND");
  }
  EXPECT_EQ(other_->Answer("list"), absl::StrCat("ids ", own->id));

  // Nothing of the owner's changed.
  for (const WorkerBuffer* owned : {&*owned_allocated, &*owned_attached}) {
    EXPECT_EQ(owner_->Answer(absl::StrCat("readbuf ", owned->id, " 0 4")),
              "status OK c0ffee00");
    EXPECT_EQ(owner_->Answer(absl::StrCat("open ", owned->id)), "status OK fd");
  }
  EXPECT_EQ(owner_->Answer("list"),
            absl::StrCat("ids ", owned_allocated->id, ",", owned_attached->id));
  // The owner still releases them.
  for (const WorkerBuffer* owned : {&*owned_allocated, &*owned_attached}) {
    EXPECT_EQ(owner_->Answer(absl::StrCat("release ", owned->id)), "status OK");
  }
}

}  // namespace
}  // namespace rdma_agent::testing

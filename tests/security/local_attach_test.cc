// Local attack 1: an unprivileged user hands the attach socket many sparse
// memfds of huge size and never registers them. The agent must refuse them
// before mapping (size and per-user bytes quota), keep its address space
// bounded, close what it parked when the token TTL passes even if nobody
// attaches again, and keep serving every other user meanwhile. Also: one
// user cannot take every attach connection. Real agents; needs root to run
// the other users.

#include <unistd.h>

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/security/local_harness.h"

namespace rdma_agent::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr uint64_t kTiB = uint64_t{1} << 40;
constexpr uint64_t kGiB = uint64_t{1} << 30;

class LocalAttachTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root to run other users";
  }

  // As `worker`: registers memory (attached and agent-allocated), writes and
  // reads back a pattern through the agent.
  void ExpectRegistersAndMovesBytes(LocalWorker& worker) {
    for (const char* how : {"attach 1048576", "allocate 65536"}) {
      SCOPED_TRACE(how);
      const std::string registered = worker.Ask(how);
      ASSERT_THAT(registered, StartsWith("ok ")) << registered;
      const std::string id = registered.substr(3);
      EXPECT_EQ(worker.Ask(absl::StrCat("writebuf ", id, " 0badc0ffee")),
                "status OK");
      EXPECT_EQ(worker.Ask(absl::StrCat("readbuf ", id, " 5")),
                "status OK 0badc0ffee");
    }
  }
};

TEST_F(LocalAttachTest, HugeSparseMemfdsAreRefusedBeforeMapping) {
  auto agent = StartSharedAgent();
  ASSERT_TRUE(agent.ok()) << agent.status();
  const pid_t pid = (*agent)->pid();
  auto attacker = LocalWorker::Start(**agent, kNobody);
  ASSERT_TRUE(attacker.ok()) << attacker.status();
  auto root = LocalWorker::Start(**agent, -1);
  ASSERT_TRUE(root.ok()) << root.status();
  const uint64_t vm_before = VmSizeBytes(pid);
  ASSERT_GT(vm_before, 0u);

  // 63 x 2 TiB: 126 TiB of address space if the agent mapped them.
  const std::string answer =
      attacker->Ask(absl::StrCat("attach_sparse 63 ", 2 * kTiB));
  EXPECT_THAT(answer, StartsWith("attached 0 refused 63 INVALID_ARGUMENT"));
  EXPECT_THAT(answer, HasSubstr("--max_buffer_bytes"));
  EXPECT_LT(VmSizeBytes(pid), vm_before + 64 * kGiB);
  ExpectRegistersAndMovesBytes(*root);
}

TEST_F(LocalAttachTest, BytesQuotaBoundsParkedMemoryAndTheTimerExpiresIt) {
  // Limits an operator might set for huge buffers: the quota still holds.
  auto agent = StartSharedAgent({
      absl::StrCat("--max_buffer_bytes=", 4 * kTiB),
      absl::StrCat("--max_registered_bytes_per_user=", 8 * kTiB),
      absl::StrCat("--max_registered_bytes_total=", 32 * kTiB),
      "--attach_token_ttl=3s",
  });
  ASSERT_TRUE(agent.ok()) << agent.status();
  const pid_t pid = (*agent)->pid();
  auto attacker = LocalWorker::Start(**agent, kNobody);
  ASSERT_TRUE(attacker.ok()) << attacker.status();
  auto other = LocalWorker::Start(**agent, kOtherUser);
  ASSERT_TRUE(other.ok()) << other.status();
  auto root = LocalWorker::Start(**agent, -1);
  ASSERT_TRUE(root.ok()) << root.status();
  // Workers are connected: what the agent holds from here on is the attack.
  ASSERT_TRUE(
      Eventually([&] { return OpenFdCount(pid) > 0; }, absl::Seconds(1)));
  const int fds_before = OpenFdCount(pid);
  const uint64_t vm_before = VmSizeBytes(pid);

  const std::string answer =
      attacker->Ask(absl::StrCat("attach_sparse 63 ", 2 * kTiB));
  // 4 x 2 TiB fill the attacker's 8 TiB; the other 59 are refused unmapped.
  EXPECT_THAT(answer, StartsWith("attached 4 refused 59 RESOURCE_EXHAUSTED"));
  EXPECT_THAT(answer, HasSubstr("--max_registered_bytes_per_user"));
  EXPECT_LE(VmSizeBytes(pid), vm_before + 8 * kTiB + 64 * kGiB);
  EXPECT_GE(OpenFdCount(pid), fds_before + 4);  // parked until the TTL

  // Meanwhile every other user is served: another user's own quota...
  EXPECT_THAT(other->Ask(absl::StrCat("attach_sparse 1 ", 2 * kTiB)),
              StartsWith("attached 1 refused 0"));
  // ...and root and that user register and move bytes.
  ExpectRegistersAndMovesBytes(*root);
  ExpectRegistersAndMovesBytes(*other);
  ASSERT_EQ(root->Ask("release_all"), "released 2");
  ASSERT_EQ(other->Ask("release_all"), "released 2");

  // Nobody attaches again: the TTL alone unmaps and closes what is parked.
  EXPECT_TRUE(Eventually([&] { return OpenFdCount(pid) <= fds_before; },
                         absl::Seconds(15)))
      << OpenFdCount(pid) << " fds open, " << fds_before << " before";
  EXPECT_LT(VmSizeBytes(pid), vm_before + 64 * kGiB);
  // The attacker's quota came back with them.
  EXPECT_THAT(attacker->Ask(absl::StrCat("attach_sparse 1 ", 2 * kTiB)),
              StartsWith("attached 1 refused 0"));
}

TEST_F(LocalAttachTest, OneUserCannotHoldEveryAttachConnection) {
  auto agent = StartSharedAgent();
  ASSERT_TRUE(agent.ok()) << agent.status();
  auto attacker = LocalWorker::Start(**agent, kNobody);
  ASSERT_TRUE(attacker.ok()) << attacker.status();
  auto root = LocalWorker::Start(**agent, -1);
  ASSERT_TRUE(root.ok()) << root.status();

  // Default: 256 in all, a quarter of them per user.
  const std::string held = attacker->Ask("hold_connections 100");
  EXPECT_THAT(held, StartsWith("served 64 refused 36 RESOURCE_EXHAUSTED"));
  EXPECT_THAT(held, HasSubstr("--max_attach_connections_per_user"));
  ExpectRegistersAndMovesBytes(*root);

  // Connections given back are the user's again.
  EXPECT_EQ(attacker->Ask("drop_connections"), "dropped 64");
  EXPECT_TRUE(Eventually(
      [&] {
        return absl::StartsWith(attacker->Ask("hold_connections 1"),
                                "served 1");
      },
      absl::Seconds(10)));
}

}  // namespace
}  // namespace rdma_agent::testing

// Buffer ids against a local user who studies its own: a real rdma-agentd
// shared by two unprivileged users (needs root to switch users). An id must
// tell nothing of other users' registrations (no counter whose gaps count
// them), never be 0, never be reused while live, and another user's id must
// answer exactly like an id that never existed.

#include <unistd.h>

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gtest/gtest.h"
#include "tests/security/local_harness.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/process.h"

namespace rdma_agent::testing {
namespace {

namespace v1 = ::rdma::agent::v1;

// The id of a worker's "allocate" answer ("ok ID"); 0 when it failed.
uint64_t Allocate(LocalWorker& worker) {
  const std::string answer = worker.Ask("allocate 4096");
  uint64_t id = 0;
  if (!absl::StartsWith(answer, "ok ") ||
      !absl::SimpleAtoi(answer.substr(3), &id)) {
    ADD_FAILURE() << "allocate: " << answer;
    return 0;
  }
  return id;
}

// |a - b| without wrapping.
uint64_t Distance(uint64_t a, uint64_t b) { return a > b ? a - b : b - a; }

class BufferIdsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root to run other users";
    auto agent = StartSharedAgent();
    ASSERT_TRUE(agent.ok()) << agent.status();
    agent_ = std::move(*agent);
  }

  // rdma-agentctl as `uid`: its stderr (where failures go).
  std::string CtlAs(int uid, std::vector<std::string> args) {
    std::vector<std::string> argv = {"setpriv",
                                     absl::StrCat("--reuid=", uid),
                                     absl::StrCat("--regid=", uid),
                                     "--clear-groups",
                                     RunfilePath("client/rdma-agentctl"),
                                     "--target=" + agent_->target()};
    argv.insert(argv.end(), args.begin(), args.end());
    auto result = RunToCompletion(argv, "", absl::Seconds(60));
    EXPECT_TRUE(result.ok()) << result.status();
    return result.ok() ? result->err : "";
  }

  std::unique_ptr<AgentProcess> agent_;
};

TEST_F(BufferIdsTest, OwnIdsSayNothingOfOtherUsersRegistrations) {
  auto attacker = LocalWorker::Start(*agent_, kOtherUser);
  ASSERT_TRUE(attacker.ok()) << attacker.status();
  auto victim = LocalWorker::Start(*agent_, kNobody);
  ASSERT_TRUE(victim.ok()) << victim.status();
  // The attacker registers, the victim registers 0 to 3 buffers, and so on:
  // with a global counter, the gap between the attacker's ids is exactly
  // the victim's count plus one.
  std::vector<uint64_t> mine;
  for (int round = 0; round < 16; ++round) {
    mine.push_back(Allocate(*attacker));
    for (int i = 0; i < round % 4; ++i) Allocate(*victim);
  }
  std::set<uint64_t> distinct(mine.begin(), mine.end());
  EXPECT_EQ(distinct.size(), mine.size());
  EXPECT_EQ(distinct.count(0), 0u);
  // Random 64-bit ids: two of them lie within 2^40 of each other with
  // probability 2^-23, and all 16 below 2^56 with probability 2^-128.
  bool high = false;
  for (size_t i = 0; i + 1 < mine.size(); ++i) {
    EXPECT_GT(Distance(mine[i + 1], mine[i]), uint64_t{1} << 40)
        << "own ids " << mine[i] << " then " << mine[i + 1] << ": the gap, "
        << Distance(mine[i + 1], mine[i])
        << ", counts other users' registrations";
  }
  for (uint64_t id : mine) high = high || id >= (uint64_t{1} << 56);
  EXPECT_TRUE(high) << "ids use only the low bits";
}

TEST_F(BufferIdsTest, AnotherUsersIdAnswersLikeOneThatNeverExisted) {
  auto victim = LocalWorker::Start(*agent_, kNobody);
  ASSERT_TRUE(victim.ok()) << victim.status();
  const uint64_t theirs = Allocate(*victim);
  ASSERT_NE(theirs, 0u);
  // An id nobody holds: theirs plus one is as good as any (ids are random).
  const uint64_t never = theirs + 1;
  for (const std::vector<std::string>& command :
       std::vector<std::vector<std::string>>{
           {"release"}, {"read", "--length=1"}, {"write", "--in=/dev/null"}}) {
    std::vector<std::string> on_theirs = command;
    on_theirs.push_back(absl::StrCat(theirs));
    std::vector<std::string> on_never = command;
    on_never.push_back(absl::StrCat(never));
    const std::string refused = CtlAs(kOtherUser, on_theirs);
    EXPECT_TRUE(
        absl::StrContains(refused, "NOT_FOUND: ") &&
        absl::StrContains(refused, absl::StrCat("no buffer with id ", theirs)))
        << refused;
    // Byte for byte what an unknown id gets, the id aside.
    EXPECT_EQ(absl::StrReplaceAll(refused, {{absl::StrCat(theirs), "ID"}}),
              absl::StrReplaceAll(CtlAs(kOtherUser, on_never),
                                  {{absl::StrCat(never), "ID"}}));
  }
  // And the buffer is untouched: its owner still has it.
  EXPECT_EQ(victim->Ask(absl::StrCat("readbuf ", theirs, " 1")),
            "status OK 00");
}

TEST_F(BufferIdsTest, IdsAreNeverReusedWhileLive) {
  auto& client = agent_->client();
  std::set<uint64_t> live;
  std::vector<uint64_t> order;
  for (int i = 0; i < 600; ++i) {
    auto registration = client.AllocateUnmapped(64, v1::ACCESS_READ_WRITE);
    ASSERT_TRUE(registration.ok()) << registration.status();
    ASSERT_NE(registration->id, 0u);
    ASSERT_TRUE(live.insert(registration->id).second)
        << "id " << registration->id << " given twice";
    order.push_back(registration->id);
  }
  // Release every other one, register as many again: no new id may equal a
  // live one.
  for (size_t i = 0; i < order.size(); i += 2) {
    ASSERT_TRUE(client.Release(order[i]).ok());
    live.erase(order[i]);
  }
  for (int i = 0; i < 300; ++i) {
    auto registration = client.AllocateUnmapped(64, v1::ACCESS_READ_WRITE);
    ASSERT_TRUE(registration.ok()) << registration.status();
    ASSERT_NE(registration->id, 0u);
    ASSERT_TRUE(live.insert(registration->id).second)
        << "id " << registration->id << " is live already";
  }
  // Listing keeps the order of registration, whatever the ids are.
  auto listed = client.ListBuffers();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), live.size());
  EXPECT_EQ((*listed)[0].buffer_id(), order[1]);
  EXPECT_EQ((*listed)[1].buffer_id(), order[3]);
}

}  // namespace
}  // namespace rdma_agent::testing

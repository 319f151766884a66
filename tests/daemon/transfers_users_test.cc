// Transfer ids are scoped to the user that submitted them: another local
// user (a client_worker process that drops to uid 65534 before connecting)
// naming them gets NOT_FOUND, exactly as for ids that do not exist, cannot
// cancel them and sees none of their ends on its watch; the owner (uid
// 65533) still gets its transfer, untouched. Waiting calls are bounded per
// user. Needs root to switch users.

#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/client/worker_process.h"
#include "tests/testing/agent_fixture.h"
#include "tests/testing/eventually.h"

namespace rdma_agent::testing {
namespace {

constexpr int kOwner = 65533;
constexpr int kOther = 65534;
constexpr int kReadWrite = 3;  // v1::ACCESS_READ_WRITE

WorkerProcess StartWorker(InProcessAgent& agent, int uid) {
  WorkerProcess::Options options;
  options.uid = uid;
  options.gid = uid;
  auto worker = WorkerProcess::Start(
      agent.agent().target(), agent.agent().attach_socket_path(), options);
  EXPECT_TRUE(worker.ok()) << worker.status();
  return std::move(*worker);
}

// "transfer ID" -> ID.
std::string TransferId(const std::string& answer) {
  EXPECT_EQ(answer.rfind("transfer ", 0), 0u) << answer;
  return answer.substr(answer.find(' ') + 1);
}

TEST(TransfersUsersTest, AnotherUsersTransfersAreInvisible) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run other users";
  auto agent = InProcessAgent::Start();
  ASSERT_TRUE(agent.ok()) << agent.status();
  WorkerProcess owner = StartWorker(**agent, kOwner);
  WorkerProcess other = StartWorker(**agent, kOther);

  auto words = owner.CallWords(absl::StrCat("allocate 4096 ", kReadWrite));
  ASSERT_TRUE(words.ok()) << words.status();
  auto buffer = ParseRegistered(*words);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  const std::string id = TransferId(owner.Answer(absl::StrCat(
      "submit_async read ", buffer->id, " 0 100 200 ", buffer->context)));

  // The other user's own transfer works, so what follows is about whose
  // transfer it is, not a broken client.
  auto mine = other.CallWords(absl::StrCat("allocate 4096 ", kReadWrite));
  ASSERT_TRUE(mine.ok()) << mine.status();
  auto own = ParseRegistered(*mine);
  ASSERT_TRUE(own.ok()) << own.status();
  const std::string own_id = TransferId(other.Answer(absl::StrCat(
      "submit_async read ", own->id, " 0 100 200 ", own->context)));
  ASSERT_NE(own_id, id);

  // Ended and not yet read by its owner: invisible all the same.
  EXPECT_EQ(other.Answer(absl::StrCat("transfer_get ", id)),
            "status NOT_FOUND");
  EXPECT_EQ(other.Answer("transfer_get 999999"), "status NOT_FOUND");
  EXPECT_EQ(other.Answer(absl::StrCat("transfer_cancel ", id)),
            "status NOT_FOUND");
  // Its watch pushes its own end only.
  EXPECT_EQ(other.Answer("transfer_watch 500"),
            absl::StrCat("events ", own_id));

  EXPECT_EQ(owner.Answer(absl::StrCat("transfer_get ", id)),
            "status OK TRANSFER_STATE_DONE");
}

TEST(TransfersUsersTest, WaitingCallsAndStreamsAreEachUsersOwn) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run other users";
  AgentOptions options;
  options.in_flight.max_waiting_per_user = 1;
  auto agent = InProcessAgent::Start(std::move(options));
  ASSERT_TRUE(agent.ok()) << agent.status();
  WorkerProcess owner = StartWorker(**agent, kOwner);
  WorkerProcess other = StartWorker(**agent, kOther);

  auto words = owner.CallWords(absl::StrCat("allocate 4096 ", kReadWrite));
  ASSERT_TRUE(words.ok()) << words.status();
  auto buffer = ParseRegistered(*words);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  const std::string id = TransferId(owner.Answer(absl::StrCat(
      "submit_async read ", buffer->id, " 0 100 200 ", buffer->context)));
  // The owner's watch stays open: it holds the owner's one waiting slot, and
  // it gets the owner's end.
  ASSERT_EQ(owner.Answer("watch_start"), "ok DONE");
  const std::string seen = absl::StrCat("watch_seen ", id);
  ASSERT_TRUE(Eventually([&] { return owner.Answer(seen) == "seen"; }));
  EXPECT_EQ(
      owner.Answer("transfer_watch 200")
          .rfind("error RESOURCE_EXHAUSTED WatchTransfers: user 65533", 0),
      0u);
  // The other user's bound is its own, and its stream carries nothing of
  // the owner's.
  EXPECT_EQ(other.Answer("transfer_watch 300"), "events ");
  // The owner's watch delivered the end without reading it.
  EXPECT_EQ(owner.Answer(absl::StrCat("transfer_get ", id)),
            "status OK TRANSFER_STATE_DONE");
}

}  // namespace
}  // namespace rdma_agent::testing

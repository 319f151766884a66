// Transfer ids of another local user, while the transfer is still PENDING
// (queued behind the memory backend's busy copy threads), and what
// transfers_users_test does not cover: another user's id answers NOT_FOUND with
// exactly the message an unknown id gets (GetTransfers and CancelTransfer), a
// GetTransfers naming one's own id with another user's fails NOT_FOUND and
// reports nothing (the own transfer stays readable), a CancelTransfer of
// another user's id does not stop it (it still ends DONE with its bytes), and a
// watch of the other user open while the transfer ends never sees it. Client
// processes drop to uids 65533 (owner) and 65534 (other) before connecting:
// needs root.

#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gtest/gtest.h"
#include "tests/client/worker_process.h"
#include "tests/testing/agent_fixture.h"
#include "tests/testing/eventually.h"
#include "tests/testing/transfer_calls.h"

namespace rdma_agent::testing {
namespace {

constexpr int kOwner = 65533;
constexpr int kOther = 65534;
constexpr int kReadWrite = 3;  // v1::ACCESS_READ_WRITE
constexpr uint64_t kBlockerHalf = 64ull << 20;
constexpr int kBlockerOps = 4096;  // 256 GiB of copying: never ends by itself

WorkerProcess StartWorker(InProcessAgent& agent, int uid) {
  WorkerProcess::Options options;
  options.uid = uid;
  options.gid = uid;
  auto worker = WorkerProcess::Start(
      agent.agent().target(), agent.agent().attach_socket_path(), options);
  EXPECT_TRUE(worker.ok()) << worker.status();
  if (!worker.ok()) std::abort();
  return std::move(*worker);
}

// "transfer ID" -> ID.
std::string TransferId(const std::string& answer) {
  EXPECT_EQ(answer.rfind("transfer ", 0), 0u) << answer;
  return answer.substr(answer.find(' ') + 1);
}

// `answer` with every occurrence of transfer id `id` replaced by "<id>".
std::string WithoutId(const std::string& answer, const std::string& id) {
  return absl::StrReplaceAll(answer, {{id, "<id>"}});
}

TEST(TransfersUsersPendingTest, AnotherUsersPendingTransferIsInvisible) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run other users";
  auto agent = InProcessAgent::Start(AgentOptions());
  ASSERT_TRUE(agent.ok()) << agent.status();
  WorkerProcess owner = StartWorker(**agent, kOwner);
  WorkerProcess other = StartWorker(**agent, kOther);

  // Root keeps both of the memory backend's copy threads busy: batches over
  // its inline bound queue behind them, PENDING.
  auto blocker_buffer = (*agent)->Allocate(2 * kBlockerHalf);
  ASSERT_TRUE(blocker_buffer.ok()) << blocker_buffer.status();
  std::vector<uint64_t> blockers;
  for (int i = 0; i < 2; ++i) {
    auto blocker = SubmitAsync(
        (*agent)->stub(),
        MakeBatch(
            std::vector<v1::Op>(
                kBlockerOps,
                MakeWireOp(v1::OP_TYPE_READ_INTO_LOCAL,
                           blocker_buffer->buffer_id(), 0, kBlockerHalf,
                           blocker_buffer->remote_context(), kBlockerHalf)),
            absl::Minutes(10)));
    ASSERT_TRUE(blocker.ok()) << blocker.status();
    blockers.push_back(*blocker);
  }

  // Each user queues a transfer of its own behind them: owner copies 128 KiB
  // of pattern 7 into its buffer at 128 KiB.
  auto words = owner.CallWords(absl::StrCat("allocate 262144 ", kReadWrite));
  ASSERT_TRUE(words.ok()) << words.status();
  auto buffer = ParseRegistered(*words);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  ASSERT_EQ(owner.Answer(absl::StrCat("fill ", buffer->id, " 7")), "ok");
  const std::string id = TransferId(owner.Answer(absl::StrCat(
      "submit_async read ", buffer->id, " 131072 131072 0 ", buffer->context)));
  auto mine = other.CallWords(absl::StrCat("allocate 262144 ", kReadWrite));
  ASSERT_TRUE(mine.ok()) << mine.status();
  auto own = ParseRegistered(*mine);
  ASSERT_TRUE(own.ok()) << own.status();
  const std::string own_id = TransferId(other.Answer(absl::StrCat(
      "submit_async read ", own->id, " 0 100000 200 ", own->context)));
  ASSERT_EQ(owner.Answer(absl::StrCat("transfer_get ", id)),
            "status OK TRANSFER_STATE_PENDING");

  // NOT_FOUND, word for word as an id that was never given out.
  const std::string unknown = "987654321";
  for (const char* rpc : {"get", "cancel"}) {
    SCOPED_TRACE(rpc);
    const std::string theirs =
        other.Answer(absl::StrCat("transfer_detail ", rpc, " ", id));
    const std::string nobodys =
        other.Answer(absl::StrCat("transfer_detail ", rpc, " ", unknown));
    EXPECT_EQ(theirs.rfind("status NOT_FOUND ", 0), 0u) << theirs;
    EXPECT_EQ(WithoutId(theirs, id), WithoutId(nobodys, unknown));
  }
  // Named with one of its own: NOT_FOUND, and its own is not reported.
  const std::string both =
      other.Answer(absl::StrCat("transfer_detail get ", own_id, ",", id));
  EXPECT_EQ(both.rfind("status NOT_FOUND ", 0), 0u) << both;
  EXPECT_EQ(other.Answer(absl::StrCat("transfer_detail get ", own_id)),
            "status OK TRANSFER_STATE_PENDING");
  // The other user's cancel did nothing to it.
  EXPECT_EQ(owner.Answer(absl::StrCat("transfer_get ", id)),
            "status OK TRANSFER_STATE_PENDING");

  // The other user watches while both transfers run and end.
  ASSERT_TRUE(other.process().WriteLine("transfer_watch 3000").ok());
  absl::SleepFor(absl::Milliseconds(500));  // most likely open by now
  for (uint64_t blocker : blockers) {
    ASSERT_TRUE(CancelTransfer((*agent)->stub(), blocker).ok());
  }
  auto events = other.process().ReadLine(absl::Seconds(60));
  ASSERT_TRUE(events.ok()) << events.status();
  EXPECT_EQ(*events, absl::StrCat("events ", own_id));

  // The owner's transfer ran, untouched by the other user's calls.
  std::string answer;
  EXPECT_TRUE(Eventually(
      [&] {
        answer = owner.Answer(absl::StrCat("transfer_get ", id));
        return answer != "status OK TRANSFER_STATE_PENDING";
      },
      absl::Seconds(30)));
  EXPECT_EQ(answer, "status OK TRANSFER_STATE_DONE");
  // Bytes [128 KiB, 256 KiB) hold pattern 7 from position 0, the rest its
  // own.
  EXPECT_EQ(
      owner.Answer(absl::StrCat("verify ", buffer->id, " 7 0 131072 131072 7")),
      "ok");
}

}  // namespace
}  // namespace rdma_agent::testing

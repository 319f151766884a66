// Asynchronous transfers under attack, against real rdma-agentd processes:
// what one local user can make the agent hold with SubmitAsync and
// GetTransfers, how long it can hold the transfer workers, and what
// transfer ids tell about other users.
//
// 1. Floods of unread ends (many-op batches whose ops all fail) and of
//    queued transfers carrying megabyte contexts are refused
//    RESOURCE_EXHAUSTED naming --max_transfer_bytes_per_user once the
//    user's budget is full; the agent's peak RSS grows by at most the
//    budget plus 96 MiB of transients, and a second user still submits and
//    reads its transfers.
// 2. GetTransfers naming one huge ended transfer 1,024 times gets it once;
//    the agent's peak RSS grows by at most 64 MiB, and another user's
//    transfer calls answer within a second while such reads run.
// 3. Transfers of one user stuck on a silent peer (it answers the tcp data
//    plane's hello, then reads and never answers) hold at most half the
//    transfer workers: a second user's same-host memory copy runs at once.
// 4. Transfer ids are random: two of one user's ids with another user's
//    transfers in between are nowhere near each other, and one user's id
//    reads to another exactly like an unknown one.
//
// The attacker is this process (root) calling the API raw, or a
// client_worker as uid 65533; the bystander a client_worker as uid 65534.
// Needs root (other users, /proc of the agent).

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "rdma/agent/v1/agent.grpc.pb.h"
#include "rdma/agent/v1/remote_buffer.pb.h"
#include "tests/client/worker_process.h"
#include "tests/security/raw_data_peer.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/process.h"
#include "tests/testing/transfer_calls.h"

namespace rdma_agent::testing {
namespace {

namespace v1 = ::rdma::agent::v1;

constexpr int kAttacker = 65533;
constexpr int kBystander = 65534;
constexpr int kReadWrite = 3;  // v1::ACCESS_READ_WRITE
constexpr uint64_t kMiB = 1 << 20;
// The per-user budget these tests run with, and what the agent may hold
// besides, at its peak, while it refuses a flood: gRPC's buffers for the
// request being received, the request's parsed message and copy, one
// transfer's results being built, and the allocator's slack.
constexpr uint64_t kBudget = 64 * kMiB;
constexpr uint64_t kTransients = 96 * kMiB;

// VmRSS or VmHWM (the peak) of `pid` in bytes; 0 when unreadable.
uint64_t MemoryOf(pid_t pid, absl::string_view field) {
  return static_cast<uint64_t>(
      std::max<int64_t>(0, ProcessStatusBytes(pid, field)));
}
uint64_t RssOf(pid_t pid) { return MemoryOf(pid, "VmRSS"); }
uint64_t PeakRssOf(pid_t pid) { return MemoryOf(pid, "VmHWM"); }

// A real agent with the memory and tcp backends whose sockets other users
// can reach, with `flags`.
std::unique_ptr<AgentProcess> StartAgent(std::vector<std::string> flags) {
  AgentProcess::Options options;
  options.backends = "memory,tcp";
  options.log_level = "info";
  options.extra_flags = std::move(flags);
  auto agent = AgentProcess::Start(std::move(options));
  EXPECT_TRUE(agent.ok()) << agent.status();
  if (!agent.ok()) return nullptr;
  // mkdtemp made it 0700; the daemon makes its sockets 0666.
  EXPECT_EQ(::chmod((*agent)->runtime_dir().c_str(), 0755), 0);
  return std::move(*agent);
}

std::unique_ptr<WorkerProcess> StartWorker(const AgentProcess& agent, int uid) {
  WorkerProcess::Options options;
  options.uid = uid;
  options.gid = uid;
  auto worker = WorkerProcess::Start(agent, options);
  EXPECT_TRUE(worker.ok()) << worker.status();
  if (!worker.ok()) return nullptr;
  return std::make_unique<WorkerProcess>(std::move(*worker));
}

// A user's own buffer, of a client_worker.
struct OwnBuffer {
  std::string id;
  std::string context;
};

OwnBuffer Allocate(WorkerProcess& worker, uint64_t size) {
  auto words =
      worker.CallWords(absl::StrCat("allocate ", size, " ", kReadWrite));
  EXPECT_TRUE(words.ok()) << words.status();
  if (!words.ok()) return {};
  auto buffer = ParseRegistered(*words);
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  if (!buffer.ok()) return {};
  return {buffer->id, buffer->context};
}

// "transfer ID" -> ID; "" otherwise.
std::string TransferId(const std::string& answer) {
  if (!absl::StartsWith(answer, "transfer ")) return "";
  return answer.substr(answer.find(' ') + 1);
}

// The bystander's same-host memory copy (4 KiB of pattern 7 to the other
// half of its buffer), submitted asynchronously: its id, "" when refused.
std::string SubmitCopy(WorkerProcess& worker, const OwnBuffer& buffer) {
  const std::string answer = worker.Answer(absl::StrCat(
      "submit_async read ", buffer.id, " 4096 4096 0 ", buffer.context));
  EXPECT_FALSE(TransferId(answer).empty()) << answer;
  return TransferId(answer);
}

// Polls transfer `id` of `worker` (GetTransfers without waiting) until it
// is no longer PENDING or `within` passes: its last answer.
std::string AwaitEnd(WorkerProcess& worker, const std::string& id,
                     absl::Duration within) {
  const absl::Time give_up = absl::Now() + within;
  std::string answer;
  do {
    answer = worker.Answer(absl::StrCat("transfer_get ", id));
    if (answer != "status OK TRANSFER_STATE_PENDING") return answer;
    absl::SleepFor(absl::Milliseconds(20));
  } while (absl::Now() < give_up);
  return answer;
}

// The bystander gets its work done: a copy submitted, run, read and
// verified.
void ExpectBystanderServed(WorkerProcess& bystander, const OwnBuffer& buffer,
                           absl::Duration within = absl::Seconds(20)) {
  const std::string id = SubmitCopy(bystander, buffer);
  ASSERT_FALSE(id.empty());
  EXPECT_EQ(AwaitEnd(bystander, id, within), "status OK TRANSFER_STATE_DONE");
  EXPECT_EQ(
      bystander.Answer(absl::StrCat("verify ", buffer.id, " 7 0 4096 4096 7")),
      "ok");
}

// A batch of `count` ops whose remote context parses but is incomplete:
// each fails validation with a message of about 150 bytes, so the transfer
// ends at once with `count` results that take far more memory than the
// request.
v1::SubmitRequest FailingBatch(size_t count) {
  v1::RemoteBuffer incomplete;
  incomplete.set_agent_id("x");
  const std::string context = incomplete.SerializeAsString();
  std::vector<v1::Op> ops;
  ops.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    ops.push_back(MakeWireOp(v1::OP_TYPE_READ_INTO_LOCAL, 1, 0, 1, context, 0));
  }
  return MakeBatch(std::move(ops), absl::Seconds(60));
}

// GetTransfers of `ids` as named (repeats included), without waiting.
absl::StatusOr<std::vector<v1::Transfer>> GetNamed(
    v1::RdmaAgent::Stub& stub, const std::vector<uint64_t>& ids) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + kCallSlack));
  v1::GetTransfersRequest request;
  for (uint64_t id : ids) request.add_transfer_ids(id);
  v1::GetTransfersResponse response;
  const grpc::Status status = stub.GetTransfers(&context, request, &response);
  if (!status.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                        status.error_message());
  }
  return std::vector<v1::Transfer>(response.transfers().begin(),
                                   response.transfers().end());
}

// ---------------------------------------------------------------- 1

class TransferFloodTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root to run other users";
    agent_ =
        StartAgent({absl::StrCat("--max_transfer_bytes_per_user=", kBudget),
                    absl::StrCat("--max_transfer_bytes_total=", 4 * kBudget)});
    ASSERT_NE(agent_, nullptr);
    stub_ = v1::RdmaAgent::NewStub(agent_->client().channel());
    bystander_ = StartWorker(*agent_, kBystander);
    ASSERT_NE(bystander_, nullptr);
    own_ = Allocate(*bystander_, 8192);
    ASSERT_EQ(bystander_->Answer(absl::StrCat("fill ", own_.id, " 7")), "ok");
    // Warmed up: the bystander's path has run once.
    ExpectBystanderServed(*bystander_, own_);
    baseline_ = PeakRssOf(agent_->pid());
    ASSERT_GT(baseline_, 0u);
  }

  // SubmitAsync of `request` by root until `refusals` have been refused or
  // `most` sent: the ids of those accepted; the first refusal in `refused`.
  std::vector<uint64_t> Flood(const v1::SubmitRequest& request, int most,
                              int refusals, absl::Status* refused) {
    std::vector<uint64_t> accepted;
    for (int i = 0; i < most && refusals > 0; ++i) {
      auto id = SubmitAsync(*stub_, request);
      if (id.ok()) {
        accepted.push_back(*id);
        continue;
      }
      if (refused->ok()) *refused = id.status();
      --refusals;
    }
    return accepted;
  }

  void ExpectPeakWithinBound() {
    const uint64_t peak = PeakRssOf(agent_->pid());
    std::cout << "agent peak RSS: " << baseline_ / kMiB << " MiB before, "
              << peak / kMiB << " MiB now (bound: +" << kBudget / kMiB
              << " MiB budget +" << kTransients / kMiB << " MiB)\n";
    EXPECT_LE(peak, baseline_ + kBudget + kTransients)
        << "the agent's peak RSS grew by " << (peak - baseline_) / kMiB
        << " MiB (budget " << kBudget / kMiB << " MiB); now "
        << RssOf(agent_->pid()) / kMiB << " MiB";
  }

  std::unique_ptr<AgentProcess> agent_;
  std::unique_ptr<v1::RdmaAgent::Stub> stub_;
  std::unique_ptr<WorkerProcess> bystander_;
  OwnBuffer own_;
  uint64_t baseline_ = 0;
};

// 128 KiB requests of 10,000 failing ops, never read: each end's results
// take megabytes. Before byte budgets, 1 GiB in 14 s.
TEST_F(TransferFloodTest, UnreadEndsOfManyOpBatchesAreRefusedByTheByteBudget) {
  const v1::SubmitRequest request = FailingBatch(10000);
  ASSERT_LT(request.ByteSizeLong(), 132u << 10);
  absl::Status refused;
  const std::vector<uint64_t> accepted =
      Flood(request, /*most=*/400, /*refusals=*/20, &refused);
  EXPECT_FALSE(accepted.empty());
  EXPECT_TRUE(absl::IsResourceExhausted(refused)) << refused;
  EXPECT_TRUE(
      absl::StrContains(refused.message(), "--max_transfer_bytes_per_user"))
      << refused;
  ExpectPeakWithinBound();
  // The other user still submits and reads.
  ExpectBystanderServed(*bystander_, own_);

  // Every accepted end is there to read, each op's code at least (the
  // results that did not fit say so and name the budget); reading them
  // gives the bytes back, and the user may submit again.
  int codes_only = 0;
  for (uint64_t id : accepted) {
    auto read = GetTransfer(*stub_, id);
    ASSERT_TRUE(read.ok()) << read.status();
    ASSERT_EQ(read->state(), v1::TRANSFER_STATE_FAILED);
    ASSERT_EQ(read->results_size(), 10000);
    ASSERT_EQ(read->results(9999).code(),
              static_cast<int>(absl::StatusCode::kInvalidArgument));
    if (absl::StartsWith(read->results(0).message(), "details dropped")) {
      EXPECT_TRUE(absl::StrContains(read->results(0).message(),
                                    "--max_transfer_bytes_per_user"))
          << read->results(0).message();
      ++codes_only;
    }
  }
  EXPECT_LT(codes_only, static_cast<int>(accepted.size()))
      << "no end was kept whole";
  auto again = SubmitAsync(*stub_, request);
  EXPECT_TRUE(again.ok()) << again.status();
  ExpectPeakWithinBound();
}

// One-op transfers carrying 4 MiB contexts queued behind two of the same
// user's transfers stuck on a silent peer: each pins its request copy
// until it runs. The op's context is refused unparsed
// (--max_remote_context_bytes) when it runs; its copy is charged from
// SubmitAsync on.
TEST_F(TransferFloodTest, QueuedRequestCopiesAreRefusedByTheByteBudget) {
  SilentDataPeer peer;
  auto local = agent_->client().AllocateUnmapped(kMiB, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(local.ok()) << local.status();
  std::vector<uint64_t> stuck;
  for (int i = 0; i < 2; ++i) {
    auto id = SubmitAsync(
        *stub_, MakeBatch({MakeWireOp(v1::OP_TYPE_WRITE_FROM_LOCAL, local->id,
                                      0, kMiB, peer.Context(), 0)},
                          absl::Seconds(120)));
    ASSERT_TRUE(id.ok()) << id.status();
    stuck.push_back(*id);
  }
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (peer.talking() < 2 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_GE(peer.talking(), 2) << "the stuck transfers never reached the peer";

  v1::SubmitRequest big =
      MakeBatch({MakeWireOp(v1::OP_TYPE_READ_INTO_LOCAL, local->id, 0, 1,
                            std::string(4 * kMiB, 'c'), 0)},
                absl::Seconds(120));
  absl::Status refused;
  const std::vector<uint64_t> accepted =
      Flood(big, /*most=*/200, /*refusals=*/10, &refused);
  EXPECT_FALSE(accepted.empty());
  EXPECT_LE(accepted.size(), kBudget / (4 * kMiB));
  EXPECT_TRUE(absl::IsResourceExhausted(refused)) << refused;
  EXPECT_TRUE(
      absl::StrContains(refused.message(), "--max_transfer_bytes_per_user"))
      << refused;
  ExpectPeakWithinBound();
  ExpectBystanderServed(*bystander_, own_);

  // Such a context fails its op unparsed, naming the op and the flag.
  v1::SubmitRequest one = big;
  *one.add_ops() = one.ops(0);
  one.mutable_ops(0)->set_remote_context(local->remote_context);
  auto results = SubmitSync(*stub_, one);
  ASSERT_TRUE(results.ok()) << results.status();
  ASSERT_EQ(results->size(), 2u);
  EXPECT_EQ(results->at(1).code(),
            static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_TRUE(absl::StartsWith(results->at(1).message(), "op 1: "))
      << results->at(1).message();
  EXPECT_TRUE(
      absl::StrContains(results->at(1).message(), "--max_remote_context_bytes"))
      << results->at(1).message();
  for (uint64_t id : stuck) (void)CancelTransfer(*stub_, id);
}

// ---------------------------------------------------------------- 2

TEST(TransferReadAttackTest, OneHugeEndNamed1024TimesIsReadOnce) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run other users";
  auto agent = StartAgent({});
  ASSERT_NE(agent, nullptr);
  auto stub = v1::RdmaAgent::NewStub(agent->client().channel());
  auto bystander = StartWorker(*agent, kBystander);
  ASSERT_NE(bystander, nullptr);
  const OwnBuffer own = Allocate(*bystander, 8192);
  ASSERT_EQ(bystander->Answer(absl::StrCat("fill ", own.id, " 7")), "ok");
  ExpectBystanderServed(*bystander, own);

  // One ended transfer of 4096 failed ops (waited for with CancelTransfer,
  // which does not read it).
  const auto ended_transfer = [&]() -> uint64_t {
    auto id = SubmitAsync(*stub, FailingBatch(4096));
    EXPECT_TRUE(id.ok()) << id.status();
    if (!id.ok()) return 0;
    auto ended = CancelTransfer(*stub, *id);
    EXPECT_TRUE(ended.ok()) << ended.status();
    return *id;
  };
  const uint64_t id = ended_transfer();
  ASSERT_NE(id, 0u);
  const uint64_t baseline = PeakRssOf(agent->pid());
  const std::vector<uint64_t> named(1024, id);
  const absl::Time start = absl::Now();
  auto read = GetNamed(*stub, named);
  const absl::Duration took = absl::Now() - start;
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->size(), 1u) << "the repeated id was answered more than once";
  EXPECT_EQ(read->at(0).transfer_id(), id);
  EXPECT_EQ(read->at(0).results_size(), 4096);
  EXPECT_FALSE(read->at(0).results_left_out());
  EXPECT_LT(took, absl::Seconds(2));
  const uint64_t peak = PeakRssOf(agent->pid());
  std::cout << "agent peak RSS: " << baseline / kMiB << " MiB before the "
            << "read, " << peak / kMiB << " MiB after\n";
  EXPECT_LE(peak, baseline + 64 * kMiB)
      << "one read grew the agent's peak RSS by " << (peak - baseline) / kMiB
      << " MiB";

  // Such reads, one after the other, while the other user's transfer calls
  // must answer promptly: each of its answers within a second.
  std::atomic<bool> done{false};
  std::atomic<int> reads{0};
  std::thread attacker([&] {
    const absl::Time until = absl::Now() + absl::Seconds(4);
    while (absl::Now() < until) {
      const uint64_t next = ended_transfer();
      if (next == 0) break;
      auto got = GetNamed(*stub, std::vector<uint64_t>(1024, next));
      EXPECT_TRUE(got.ok()) << got.status();
      ++reads;
    }
    done = true;
  });
  absl::Duration slowest;
  int answers = 0;
  while (!done) {
    for (const bool get : {false, true}) {
      const absl::Time asked = absl::Now();
      const std::string answer =
          get ? bystander->Answer("transfer_get 12345")
              : bystander->Answer(absl::StrCat("submit_async read ", own.id,
                                               " 4096 4096 0 ", own.context));
      slowest = std::max(slowest, absl::Now() - asked);
      ++answers;
      EXPECT_TRUE(
          absl::StartsWith(answer, get ? "status NOT_FOUND" : "transfer "))
          << answer;
    }
  }
  attacker.join();
  std::cout << reads << " reads of 1024 ids; the other user's slowest of "
            << answers << " answers took " << slowest << "\n";
  EXPECT_GT(reads, 0);
  EXPECT_GT(answers, 0);
  EXPECT_LT(slowest, absl::Seconds(1))
      << "another user's transfer call waited " << slowest << " behind reads";
  const uint64_t after = PeakRssOf(agent->pid());
  EXPECT_LE(after, baseline + 64 * kMiB)
      << "the reads grew the agent's peak RSS by " << (after - baseline) / kMiB
      << " MiB";
}

// ---------------------------------------------------------------- 3

TEST(TransferWorkersAttackTest, StuckTransfersOfOneUserLeaveWorkersForOthers) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run other users";
  SilentDataPeer peer;
  auto agent = StartAgent({});  // --transfer_workers 4
  ASSERT_NE(agent, nullptr);
  auto attacker = StartWorker(*agent, kAttacker);
  auto bystander = StartWorker(*agent, kBystander);
  ASSERT_NE(attacker, nullptr);
  ASSERT_NE(bystander, nullptr);
  const OwnBuffer bait = Allocate(*attacker, kMiB);
  const OwnBuffer own = Allocate(*bystander, 8192);
  ASSERT_EQ(bystander->Answer(absl::StrCat("fill ", own.id, " 7")), "ok");

  // As many WRITEs to the silent peer as there are workers: each holds its
  // worker until its deadline (the agent's default 30 s) once running.
  const std::string context = absl::Base64Escape(peer.Context());
  std::vector<std::string> stuck;
  for (int i = 0; i < 4; ++i) {
    const std::string answer = attacker->Answer(absl::StrCat(
        "submit_async write ", bait.id, " 0 ", kMiB, " 0 ", context));
    stuck.push_back(TransferId(answer));
    ASSERT_FALSE(stuck.back().empty()) << answer;
  }
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (peer.talking() < 2 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_GE(peer.talking(), 2) << "the attacker's transfers never ran";
  absl::SleepFor(absl::Milliseconds(300));
  for (const std::string& id : stuck) {
    EXPECT_EQ(attacker->Answer(absl::StrCat("transfer_get ", id)),
              "status OK TRANSFER_STATE_PENDING");
  }

  // The other user's same-host copy runs at once, not after the stuck
  // transfers' deadline.
  const absl::Time start = absl::Now();
  ExpectBystanderServed(*bystander, own, absl::Seconds(10));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // The attacker's transfers are still stuck: the bystander did not wait
  // for them to end.
  int pending = 0;
  for (const std::string& id : stuck) {
    if (attacker->Answer(absl::StrCat("transfer_get ", id)) ==
        "status OK TRANSFER_STATE_PENDING") {
      ++pending;
    }
  }
  EXPECT_EQ(pending, 4);
  for (const std::string& id : stuck) {
    EXPECT_TRUE(absl::StartsWith(
        attacker->Answer(absl::StrCat("transfer_cancel ", id)), "status OK"));
  }
}

// ---------------------------------------------------------------- 4

TEST(TransferIdsAttackTest, IdsTellNothingOfOtherUsersTransfers) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run other users";
  auto agent = StartAgent({});
  ASSERT_NE(agent, nullptr);
  auto a = StartWorker(*agent, kAttacker);
  auto b = StartWorker(*agent, kBystander);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const OwnBuffer a_buffer = Allocate(*a, 8192);
  const OwnBuffer b_buffer = Allocate(*b, 8192);

  // A's transfers, with 0, 1, 2... of B's between each two.
  std::vector<uint64_t> mine;
  std::vector<std::string> theirs;
  for (int round = 0; round < 6; ++round) {
    const std::string id = SubmitCopy(*a, a_buffer);
    uint64_t number = 0;
    ASSERT_TRUE(absl::SimpleAtoi(id, &number)) << id;
    mine.push_back(number);
    for (int i = 0; i < round * 10; ++i) {
      theirs.push_back(SubmitCopy(*b, b_buffer));
      ASSERT_FALSE(theirs.back().empty());
    }
  }
  for (size_t i = 1; i < mine.size(); ++i) {
    const uint64_t gap =
        mine[i] > mine[i - 1] ? mine[i] - mine[i - 1] : mine[i - 1] - mine[i];
    // A counter would give gaps of exactly 1 + B's transfers between.
    EXPECT_GT(gap, uint64_t{1} << 32)
        << "ids " << mine[i - 1] << " and " << mine[i] << " with "
        << (i - 1) * 10 << " of another user's transfers between";
  }

  // B's ids read to A like ids never given out, word for word.
  const std::string unknown = "987654321";
  for (const char* rpc : {"get", "cancel"}) {
    for (const std::string& id : {theirs.front(), theirs.back()}) {
      SCOPED_TRACE(absl::StrCat(rpc, " ", id));
      const std::string answer =
          a->Answer(absl::StrCat("transfer_detail ", rpc, " ", id));
      const std::string nobodys =
          a->Answer(absl::StrCat("transfer_detail ", rpc, " ", unknown));
      EXPECT_TRUE(absl::StartsWith(answer, "status NOT_FOUND ")) << answer;
      EXPECT_EQ(absl::StrReplaceAll(answer, {{id, "<id>"}}),
                absl::StrReplaceAll(nobodys, {{unknown, "<id>"}}));
    }
  }
  // B's transfers are untouched and still its own to read.
  EXPECT_EQ(AwaitEnd(*b, theirs.back(), absl::Seconds(20)),
            "status OK TRANSFER_STATE_DONE");
}

}  // namespace
}  // namespace rdma_agent::testing

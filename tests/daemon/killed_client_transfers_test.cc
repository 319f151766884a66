// A client process killed outright (SIGKILL) in the middle of its work, and
// what the agent does about it, against real rdma-agentd processes:
//
// - mid-Submit (synchronous, a long batch over tcp to a second agent): the
//   agent stops the batch: the ops it held are given back (another client's
//   Submit of the user's whole --max_ops_in_flight_per_user allowance, refused
//   while the batch ran, now runs), the remote agent sees the data
//   connections closed and stops serving bytes;
// - mid-WatchTransfers: the agent frees the stream (the user's
//   --max_rpcs_per_user slot it held comes back, and a new watch of the same
//   user works) and the killed client's transfers still run to their end,
//   which another process of the same user then reads with GetTransfers,
//   bytes included.
//
// The client is tests/client/client_worker, driven over its stdin/stdout;
// it runs as the same user as the test.

#include <signal.h>

#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/rdma_agent_client.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/client/worker_process.h"
#include "tests/daemon/agent_gauges.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/eventually.h"
#include "tests/testing/pattern.h"
#include "tests/testing/process.h"
#include "tests/testing/transfer_calls.h"

namespace rdma_agent::testing {
namespace {

constexpr int kReadWrite = 3;  // v1::ACCESS_READ_WRITE

AgentProcess::Options Agent(std::string backends,
                            std::vector<std::string> flags) {
  AgentProcess::Options options;
  options.backends = std::move(backends);
  options.log_level = "info";  // debug would log every chunk
  options.extra_flags = std::move(flags);
  options.extra_flags.push_back("--metrics_listen=127.0.0.1:0");
  return options;
}

// Data connections the agent serves on its tcp port now (established, as
// `ss` sees them in this network namespace).
absl::StatusOr<int> ServedConnections(uint16_t port) {
  auto out = RunCommand({"ss", "-Htn", "state", "established",
                         absl::StrCat("( sport = :", port, " )")});
  if (!out.ok()) return out.status();
  int count = 0;
  for (absl::string_view line : absl::StrSplit(*out, '\n')) {
    if (!absl::StripAsciiWhitespace(line).empty()) ++count;
  }
  return count;
}

// bytes_served of registration `id` of `agent`'s client.
uint64_t BytesServed(AgentProcess& agent, uint64_t id) {
  auto buffers = agent.client().ListBuffers();
  if (!buffers.ok()) return 0;
  for (const auto& info : *buffers) {
    if (info.buffer_id() == id) return info.bytes_served();
  }
  return 0;
}

void KillAndReap(WorkerProcess& worker) {
  worker.process().Signal(SIGKILL);
  auto code = worker.process().Wait(absl::Seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 128 + SIGKILL);
}

class KilledClientTransfersTest : public ::testing::Test {
 protected:
  void TearDown() override {
    if (!HasFailure()) return;
    if (a_ != nullptr) ADD_FAILURE() << "agent a log:\n" << a_->Log();
    if (b_ != nullptr) ADD_FAILURE() << "agent b log:\n" << b_->Log();
  }

  void ExpectGauge(AgentProcess& agent, const std::string& name, double want) {
    absl::StatusOr<double> value;
    EXPECT_TRUE(Eventually(
        [&] {
          value = ScrapeSum(agent, name);
          return value.ok() && *value == want;
        },
        absl::Seconds(20)))
        << name << " is "
        << (value.ok() ? absl::StrCat(*value) : value.status().ToString())
        << ", not " << want;
  }

  std::unique_ptr<AgentProcess> a_;
  std::unique_ptr<AgentProcess> b_;
};

TEST_F(KilledClientTransfersTest, KilledMidSubmitStopsTheBatchAndFreesItsOps) {
  constexpr int kOps = 64;
  constexpr uint64_t kSize = 256ull << 20;
  auto a = AgentProcess::Start(Agent(
      "memory,tcp", {absl::StrCat("--max_ops_in_flight_per_user=", kOps)}));
  ASSERT_TRUE(a.ok()) << a.status();
  a_ = std::move(*a);
  auto b = AgentProcess::Start(Agent("memory,tcp", {}));
  ASSERT_TRUE(b.ok()) << b.status();
  b_ = std::move(*b);
  auto remote = b_->client().Attach(kSize, v1::ACCESS_READ_WRITE, "remote");
  ASSERT_TRUE(remote.ok()) << remote.status();
  FillPattern(remote->bytes(), 2);
  auto before = ServedConnections(b_->tcp_port());
  ASSERT_TRUE(before.ok()) << before.status();
  ASSERT_EQ(*before, 0);

  auto worker = WorkerProcess::Start(*a_);
  ASSERT_TRUE(worker.ok()) << worker.status();
  auto words =
      worker->CallWords(absl::StrCat("allocate ", kSize, " ", kReadWrite));
  ASSERT_TRUE(words.ok()) << words.status();
  auto local = ParseRegistered(*words);
  ASSERT_TRUE(local.ok()) << local.status();
  // 64 reads of the whole 256 MiB (16 GiB: minutes over loopback), holding
  // every op this user may have in flight; its answer never comes.
  ASSERT_TRUE(worker->process()
                  .WriteLine(absl::StrCat(
                      "submit_many ", kOps, " read ", local->id, " 0 ", kSize,
                      " 0 ", absl::Base64Escape(remote->remote_context())))
                  .ok());
  ASSERT_TRUE(Eventually([&] { return BytesServed(*b_, remote->id()) > 0; },
                         absl::Seconds(30)))
      << "the batch never moved a byte";

  // Another client of the same user has no room while the batch runs.
  auto stub = v1::RdmaAgent::NewStub(a_->client().channel());
  auto scratch = a_->client().Attach(4096, v1::ACCESS_READ_WRITE, "scratch");
  ASSERT_TRUE(scratch.ok()) << scratch.status();
  const v1::SubmitRequest all_of_it = MakeBatch(
      std::vector<v1::Op>(kOps, MakeWireOp(v1::OP_TYPE_READ_INTO_LOCAL,
                                           *scratch, 0, 100, *scratch, 200)),
      absl::Seconds(60));
  auto refused = SubmitSync(*stub, all_of_it);
  EXPECT_TRUE(absl::IsResourceExhausted(refused.status())) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(),
                                "--max_ops_in_flight_per_user"))
      << refused.status();
  auto serving = ServedConnections(b_->tcp_port());
  ASSERT_TRUE(serving.ok()) << serving.status();
  EXPECT_GT(*serving, 0) << "b serves the batch on no connection";

  ASSERT_NO_FATAL_FAILURE(KillAndReap(*worker));

  // The ops come back: the whole allowance runs again, at once (not behind
  // the killed batch: its ops run on its own call).
  absl::StatusOr<std::vector<v1::OpResult>> results;
  ASSERT_TRUE(Eventually(
      [&] {
        results = SubmitSync(*stub, all_of_it);
        return results.ok();
      },
      absl::Seconds(20)))
      << "the killed client's ops were never given back: " << results.status();
  for (const v1::OpResult& result : *results) {
    EXPECT_EQ(result.code(), 0) << result.message();
  }
  ExpectGauge(*a_, "rdma_agentd_ops_in_flight", 0);
  ExpectGauge(*a_, "rdma_agentd_rpcs_in_flight", 0);
  // The remote agent sees the batch's connections closed, and serves no more
  // bytes of it.
  absl::StatusOr<int> left;
  EXPECT_TRUE(Eventually(
      [&] {
        left = ServedConnections(b_->tcp_port());
        return left.ok() && *left == 0;
      },
      absl::Seconds(20)))
      << "b still serves " << (left.ok() ? absl::StrCat(*left) : "?")
      << " connections of the killed client's batch";
  const uint64_t served = BytesServed(*b_, remote->id());
  absl::SleepFor(absl::Seconds(1));
  EXPECT_EQ(BytesServed(*b_, remote->id()), served)
      << "b kept serving the killed client's batch";
  EXPECT_LT(served, kOps * kSize);
  // Both agents serve on: a fresh tcp transfer completes.
  auto fresh = a_->client().Attach(1 << 20, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  auto moved = SubmitSync(
      *stub, MakeBatch({MakeWireOp(v1::OP_TYPE_READ_INTO_LOCAL, *fresh, 0,
                                   1 << 20, *remote, 12345)},
                       absl::Seconds(60)));
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ((*moved)[0].code(), 0) << (*moved)[0].message();
  EXPECT_EQ(FindMismatch(fresh->bytes(), 2, 12345), std::nullopt);
}

constexpr uint64_t kBlockerHalf = 64ull << 20;
constexpr int kBlockerOps = 4096;  // 256 GiB of copying: never ends by itself

TEST_F(KilledClientTransfersTest,
       KilledMidWatchFreesTheStreamTransfersStillEnd) {
  constexpr int kTransfers = 8;
  constexpr uint64_t kSlot = 64 << 10;
  constexpr uint64_t kSize = 2 * kTransfers * kSlot;
  constexpr uint64_t kSourceSeed = 5, kDestinationSeed = 6;
  // Two waiting calls at a time for this user: the watch holds one.
  auto a = AgentProcess::Start(Agent(
      "memory", {"--transfer_workers=1", "--max_waiting_rpcs_per_user=2"}));
  ASSERT_TRUE(a.ok()) << a.status();
  a_ = std::move(*a);
  auto stub = v1::RdmaAgent::NewStub(a_->client().channel());

  auto watcher = WorkerProcess::Start(*a_);
  ASSERT_TRUE(watcher.ok()) << watcher.status();
  // Its buffers outlive it (agent lifetime): the transfers write into them
  // after it is gone, and another process reads them.
  std::optional<WorkerBuffer> buffers[2];
  for (int k = 0; k < 2; ++k) {
    auto words = watcher->CallWords(
        absl::StrCat("allocate ", kSize, " ", kReadWrite, " agent"));
    ASSERT_TRUE(words.ok()) << words.status();
    auto buffer = ParseRegistered(*words);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    buffers[k] = *buffer;
  }
  const WorkerBuffer& source = *buffers[0];
  const WorkerBuffer& destination = *buffers[1];
  ASSERT_EQ(watcher->Answer(absl::StrCat("fill ", source.id, " ", kSourceSeed)),
            "ok");
  ASSERT_EQ(watcher->Answer(
                absl::StrCat("fill ", destination.id, " ", kDestinationSeed)),
            "ok");
  // Its stream is open once this answers (an end came through it).
  ASSERT_EQ(watcher->Answer("watch_start"), "ok DONE");

  // The one transfer worker is kept busy, so that the watcher's transfers
  // are still queued when it dies.
  auto blocker_buffer =
      a_->client().AllocateUnmapped(2 * kBlockerHalf, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(blocker_buffer.ok()) << blocker_buffer.status();
  auto blocker = SubmitAsync(
      *stub,
      MakeBatch(std::vector<v1::Op>(
                    kBlockerOps,
                    MakeWireOp(v1::OP_TYPE_READ_INTO_LOCAL, blocker_buffer->id,
                               0, kBlockerHalf, blocker_buffer->remote_context,
                               kBlockerHalf)),
                absl::Minutes(10)));
  ASSERT_TRUE(blocker.ok()) << blocker.status();
  std::vector<std::string> ids;
  for (int i = 0; i < kTransfers; ++i) {
    const std::string answer = watcher->Answer(
        absl::StrCat("submit_async read ", destination.id, " ", i * kSlot, " ",
                     kSlot, " ", i * kSlot, " ", source.context));
    ASSERT_TRUE(absl::StartsWith(answer, "transfer ")) << answer;
    ids.push_back(answer.substr(9));
  }

  // Fill the user's other waiting slot with a long poll (on the blocker),
  // and make sure it holds it: a short long poll is refused (which it can
  // only be once the watch and the long poll both hold theirs).
  absl::StatusOr<v1::Transfer> polled;
  std::thread long_poll([&] {
    auto client = a_->NewClient();
    if (!client.ok()) {
      polled = client.status();
      return;
    }
    auto own = v1::RdmaAgent::NewStub((*client)->channel());
    // Refused while a short poll below holds the slot: asked again until in.
    const absl::Time give_up = absl::Now() + absl::Seconds(20);
    for (;;) {
      polled = GetTransfer(*own, *blocker, absl::Seconds(60));
      if (!absl::IsResourceExhausted(polled.status()) ||
          absl::Now() > give_up) {
        break;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
  });
  absl::Status quick;
  EXPECT_TRUE(Eventually(
      [&] {
        quick = GetTransfer(*stub, *blocker, absl::Seconds(1)).status();
        return absl::IsResourceExhausted(quick);
      },
      absl::Seconds(20)))
      << "the watch and the long poll should hold both slots: " << quick;
  EXPECT_TRUE(absl::StrContains(quick.message(), "--max_waiting_rpcs_per_user"))
      << quick;

  ASSERT_NO_FATAL_FAILURE(KillAndReap(*watcher));
  // The agent frees the dead client's stream: its slot comes back while the
  // long poll still holds the other.
  EXPECT_TRUE(Eventually(
      [&] {
        quick = GetTransfer(*stub, *blocker, absl::Seconds(1)).status();
        return quick.ok();
      },
      absl::Seconds(20)))
      << "the killed client's watch kept its slot: " << quick;

  // Only now may the transfers run.
  auto cancelled = CancelTransfer(*stub, *blocker);
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_EQ(cancelled->state(), v1::TRANSFER_STATE_CANCELLED);
  long_poll.join();
  ASSERT_TRUE(polled.ok()) << polled.status();
  EXPECT_EQ(polled->state(), v1::TRANSFER_STATE_CANCELLED);

  // Another process of the same user reads their ends, and their bytes.
  auto reader = WorkerProcess::Start(*a_);
  ASSERT_TRUE(reader.ok()) << reader.status();
  for (const std::string& id : ids) {
    std::string answer;
    EXPECT_TRUE(Eventually(
        [&] {
          answer = reader->Answer(absl::StrCat("transfer_get ", id));
          return answer != "status OK TRANSFER_STATE_PENDING";
        },
        absl::Seconds(30)));
    EXPECT_EQ(answer, "status OK TRANSFER_STATE_DONE") << "transfer " << id;
    // Read, it is reported and gone.
    EXPECT_EQ(reader->Answer(absl::StrCat("transfer_get ", id)),
              "status NOT_FOUND");
  }
  const std::string answer =
      reader->Answer(absl::StrCat("readbuf ", destination.id, " 0 ", kSize));
  ASSERT_TRUE(absl::StartsWith(answer, "status OK ")) << answer.substr(0, 100);
  const std::string bytes = absl::HexStringToBytes(answer.substr(10));
  ASSERT_EQ(bytes.size(), kSize);
  const uint64_t moved = kTransfers * kSlot;
  EXPECT_TRUE(bytes.substr(0, moved) == PatternString(kSourceSeed, 0, moved))
      << "the transfers did not copy their slots";
  EXPECT_TRUE(bytes.substr(moved) ==
              PatternString(kDestinationSeed, moved, kSize - moved))
      << "bytes outside the transfers' slots changed";

  // A new watch of the same user works (and delivers ends).
  EXPECT_EQ(reader->Answer("watch_start"), "ok DONE");
  ExpectGauge(*a_, "rdma_agentd_transfers_in_flight", 0);
}

}  // namespace
}  // namespace rdma_agent::testing

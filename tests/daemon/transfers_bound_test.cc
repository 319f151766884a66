// 10,000 asynchronous transfers submitted as fast as four client
// connections can against a real rdma-agentd with small in-flight bounds
// (--max_transfers_in_flight_per_user, --max_transfers_in_flight): those past
// the bound are refused RESOURCE_EXHAUSTED with a message naming it and
// never touch memory; every accepted one ends DONE with its bytes where they
// belong; the agent answers GetInfo throughout; the bound frees exactly
// once transfers end; nothing is left behind (transfers, ops, registrations
// in the agent's gauges; ids NOT_FOUND once read or past the retention).
//
// Each transfer copies its own 4 KiB slot of a source buffer into the same
// slot of a destination buffer (memory backend, both mapped here), so the
// bytes say which transfers ran: a refused one leaves its slot as it was.
// A "blocker" (thousands of 64 MiB copies inside one buffer, minutes of
// work) holds the agent's one transfer worker so that accepted transfers
// stay in flight until the test lets them run.

#include <algorithm>
#include <atomic>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/rdma_agent_client.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/daemon/agent_gauges.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/eventually.h"
#include "tests/testing/pattern.h"
#include "tests/testing/transfer_calls.h"

namespace rdma_agent::testing {
namespace {

using ::testing::HasSubstr;

constexpr int kTransfers = 10000;
constexpr int kSubmitters = 4;
constexpr uint64_t kSlot = 4096;
constexpr uint64_t kSourceSeed = 1;
constexpr uint64_t kDestinationSeed = 2;
constexpr uint64_t kBlockerHalf = 64ull << 20;
constexpr int kBlockerOps = 4096;  // 256 GiB of copying: never ends by itself
constexpr size_t kBound = 16;
// GetTransfers names at most this many ids at once.
constexpr size_t kIdsPerGet = 1024;

// What a SubmitAsync of transfer i answered.
struct Outcome {
  absl::Status status = absl::UnknownError("not submitted");
  uint64_t id = 0;
};

// Which bound a case sets small, and the flag its refusals must name.
struct Bound {
  std::string name;
  std::vector<std::string> flags;
  std::string flag;      // named in every refusal
  std::string not_flag;  // never named (empty: no check)
};

class TransfersBoundTest : public ::testing::TestWithParam<Bound> {
 protected:
  // Starts the agent: one transfer worker, metrics, the case's bound and
  // `retention` for unread ends.
  void StartAgent(absl::Duration retention) {
    AgentProcess::Options options;
    options.backends = "memory";
    options.log_level = "info";  // debug would log each of 10,000 RPCs
    // Every one of the 10,000 ends may stay unread while the storm lasts:
    // the bound on kept ends (tested in transfers_api_test) stays out of the
    // way of the in-flight bounds tested here.
    options.extra_flags = {
        "--transfer_workers=1", "--metrics_listen=127.0.0.1:0",
        "--max_kept_transfers_per_user=20000",
        absl::StrCat("--transfer_retention=", absl::FormatDuration(retention))};
    for (const std::string& flag : GetParam().flags) {
      options.extra_flags.push_back(flag);
    }
    auto agent = AgentProcess::Start(options);
    ASSERT_TRUE(agent.ok()) << agent.status();
    agent_ = std::move(*agent);
    stub_ = v1::RdmaAgent::NewStub(agent_->client().channel());
    auto source = agent_->client().Attach(kTransfers * kSlot,
                                          v1::ACCESS_READ_WRITE, "source");
    ASSERT_TRUE(source.ok()) << source.status();
    source_.emplace(std::move(*source));
    auto destination = agent_->client().Attach(
        kTransfers * kSlot, v1::ACCESS_READ_WRITE, "destination");
    ASSERT_TRUE(destination.ok()) << destination.status();
    destination_.emplace(std::move(*destination));
    FillPattern(source_->bytes(), kSourceSeed);
    FillPattern(destination_->bytes(), kDestinationSeed);
    auto blocker = agent_->client().AllocateUnmapped(2 * kBlockerHalf,
                                                     v1::ACCESS_READ_WRITE);
    ASSERT_TRUE(blocker.ok()) << blocker.status();
    blocker_buffer_ = *blocker;
  }

  void TearDown() override {
    if (HasFailure() && agent_ != nullptr) {
      ADD_FAILURE() << "agent log:\n" << agent_->Log();
    }
  }

  // Transfer i: slot i of the source into slot i of the destination.
  v1::SubmitRequest SlotTransfer(int i) const {
    return MakeBatch({MakeWireOp(v1::OP_TYPE_READ_INTO_LOCAL, *destination_,
                                 i * kSlot, kSlot, *source_, i * kSlot)},
                     absl::Seconds(120));
  }

  // Starts the blocker and waits until the worker runs it.
  uint64_t StartBlocker() {
    std::vector<v1::Op> ops(
        kBlockerOps,
        MakeWireOp(v1::OP_TYPE_READ_INTO_LOCAL, blocker_buffer_.id, 0,
                   kBlockerHalf, blocker_buffer_.remote_context, kBlockerHalf));
    auto id = SubmitAsync(*stub_, MakeBatch(std::move(ops), absl::Minutes(10)));
    EXPECT_TRUE(id.ok()) << id.status();
    if (!id.ok()) return 0;
    EXPECT_TRUE(Eventually(
        [&] {
          auto transfer = GetTransfer(*stub_, *id);
          return transfer.ok() && transfer->has_start_time();
        },
        absl::Seconds(30)))
        << "the blocker never started";
    return *id;
  }

  // Submits transfers [0, kTransfers) from kSubmitters connections at once,
  // as fast as they go, while another connection asks GetInfo in a loop:
  // every GetInfo must be answered.
  std::vector<Outcome> Storm() {
    std::vector<Outcome> outcomes(kTransfers);
    std::atomic<bool> storming{true};
    std::atomic<int> infos{0};
    absl::Mutex mu;
    absl::Status info_failure;
    std::thread prober([&] {
      auto client = agent_->NewClient();
      if (!client.ok()) {
        absl::MutexLock lock(&mu);
        info_failure = client.status();
        return;
      }
      while (storming) {
        auto info = (*client)->GetInfo();
        if (!info.ok()) {
          absl::MutexLock lock(&mu);
          info_failure = info.status();
          return;
        }
        ++infos;
      }
    });
    std::vector<std::thread> submitters;
    for (int t = 0; t < kSubmitters; ++t) {
      submitters.emplace_back([&, t] {
        auto client = agent_->NewClient();
        if (!client.ok()) return;  // every outcome of it stays "not submitted"
        auto stub = v1::RdmaAgent::NewStub((*client)->channel());
        for (int i = t; i < kTransfers; i += kSubmitters) {
          auto id = SubmitAsync(*stub, SlotTransfer(i));
          outcomes[i].status = id.status();
          if (id.ok()) outcomes[i].id = *id;
        }
      });
    }
    for (std::thread& submitter : submitters) submitter.join();
    storming = false;
    prober.join();
    absl::MutexLock lock(&mu);
    EXPECT_TRUE(info_failure.ok())
        << "GetInfo failed during the storm: " << info_failure;
    EXPECT_GT(infos.load(), 0) << "GetInfo never answered during the storm";
    return outcomes;
  }

  // Every outcome is an id or a refusal naming the bound; the accepted ids.
  std::vector<uint64_t> CheckOutcomes(const std::vector<Outcome>& outcomes) {
    std::vector<uint64_t> ids;
    int shown = 0;
    for (int i = 0; i < kTransfers; ++i) {
      const absl::Status& status = outcomes[i].status;
      if (status.ok()) {
        ids.push_back(outcomes[i].id);
        continue;
      }
      const bool clean =
          absl::IsResourceExhausted(status) &&
          absl::StrContains(status.message(), GetParam().flag) &&
          (GetParam().not_flag.empty() ||
           !absl::StrContains(status.message(), GetParam().not_flag));
      if (!clean && shown++ < 5) {
        ADD_FAILURE() << "transfer " << i << " refused uncleanly: " << status;
      }
    }
    EXPECT_EQ(shown, 0) << shown << " refusals were not RESOURCE_EXHAUSTED "
                        << "naming " << GetParam().flag;
    return ids;
  }

  // Waits for every transfer of `ids` to end (reading, i.e. reporting, each
  // end) and expects each DONE with one OK op on the memory backend.
  void ExpectAllDone(const std::vector<uint64_t>& ids) {
    for (size_t first = 0; first < ids.size(); first += kIdsPerGet) {
      const size_t n = std::min(kIdsPerGet, ids.size() - first);
      auto ended =
          GetTransfers(*stub_, absl::MakeConstSpan(ids).subspan(first, n),
                       absl::Seconds(60));
      ASSERT_TRUE(ended.ok()) << ended.status();
      for (const v1::Transfer& transfer : *ended) {
        EXPECT_EQ(transfer.state(), v1::TRANSFER_STATE_DONE)
            << DescribeFailures(transfer);
        ASSERT_EQ(transfer.results_size(), 1);
        EXPECT_EQ(transfer.results(0).code(), 0);
        EXPECT_EQ(transfer.results(0).backend(), "memory");
      }
    }
  }

  // Slot i holds the source's bytes if transfer i was accepted, its own
  // otherwise.
  void ExpectSlots(const std::vector<Outcome>& outcomes) {
    int wrong = 0;
    for (int i = 0; i < kTransfers; ++i) {
      const auto slot = destination_->bytes().subspan(i * kSlot, kSlot);
      const bool ran = outcomes[i].status.ok();
      const auto bad =
          FindMismatch(slot, ran ? kSourceSeed : kDestinationSeed, i * kSlot);
      if (bad.has_value() && wrong++ < 5) {
        ADD_FAILURE() << "slot " << i << " (transfer "
                      << (ran ? "accepted" : "refused") << ") wrong at byte "
                      << *bad;
      }
    }
    EXPECT_EQ(wrong, 0) << wrong << " slots hold the wrong bytes";
    EXPECT_EQ(FindMismatch(source_->bytes(), kSourceSeed), std::nullopt)
        << "the source changed";
  }

  // Every gauge of work in flight is back to zero.
  void ExpectNothingInFlight() {
    for (const char* gauge :
         {"rdma_agentd_transfers_in_flight", "rdma_agentd_ops_in_flight"}) {
      absl::StatusOr<double> value;
      EXPECT_TRUE(Eventually(
          [&] {
            value = ScrapeSum(*agent_, gauge);
            return value.ok() && *value == 0;
          },
          absl::Seconds(20)))
          << gauge << ": "
          << (value.ok() ? absl::StrCat(*value) : value.status().ToString());
    }
  }

  // Gauge `name` reaches `want` (within 20 s: it is read at scrape time).
  void ExpectGauge(const std::string& name, double want) {
    absl::StatusOr<double> value;
    EXPECT_TRUE(Eventually(
        [&] {
          value = ScrapeSum(*agent_, name);
          return value.ok() && *value == want;
        },
        absl::Seconds(20)))
        << name << " is "
        << (value.ok() ? absl::StrCat(*value) : value.status().ToString())
        << ", not " << want;
  }

  // Cancels a blocker; it ends CANCELLED, and once read is gone.
  void CancelBlocker(uint64_t blocker) {
    auto cancelled = CancelTransfer(*stub_, blocker);
    ASSERT_TRUE(cancelled.ok()) << cancelled.status();
    EXPECT_EQ(cancelled->state(), v1::TRANSFER_STATE_CANCELLED);
    auto end = GetTransfer(*stub_, blocker);
    ASSERT_TRUE(end.ok()) << end.status();
    EXPECT_EQ(end->state(), v1::TRANSFER_STATE_CANCELLED);
    EXPECT_TRUE(absl::IsNotFound(GetTransfer(*stub_, blocker).status()));
  }

  // Behind a new blocker exactly kBound - 1 transfers fit and the next is
  // refused naming the bound; then the blocker is cancelled. The ids of
  // those accepted (slots 0.. again: the same bytes).
  std::vector<uint64_t> FillBoundBehindABlocker() {
    const uint64_t blocker = StartBlocker();
    std::vector<uint64_t> ids;
    for (size_t i = 0; i + 1 < kBound; ++i) {
      auto id = SubmitAsync(*stub_, SlotTransfer(static_cast<int>(i)));
      EXPECT_TRUE(id.ok()) << "transfer " << i << ": " << id.status();
      if (id.ok()) ids.push_back(*id);
    }
    auto over = SubmitAsync(*stub_, SlotTransfer(0));
    EXPECT_TRUE(absl::IsResourceExhausted(over.status())) << over.status();
    EXPECT_THAT(std::string(over.status().message()),
                HasSubstr(GetParam().flag));
    CancelBlocker(blocker);
    return ids;
  }

  std::unique_ptr<AgentProcess> agent_;
  std::unique_ptr<v1::RdmaAgent::Stub> stub_;
  std::optional<client::Buffer> source_;
  std::optional<client::Buffer> destination_;
  client::Registration blocker_buffer_;
};

TEST_P(TransfersBoundTest, TenThousandBehindABusyWorkerHitTheBoundCleanly) {
  // Short enough to watch unread ends expire; every end read below is read
  // by a call already waiting for it, or at once.
  ASSERT_NO_FATAL_FAILURE(StartAgent(absl::Seconds(8)));
  const uint64_t blocker = StartBlocker();
  ASSERT_NE(blocker, 0u);
  const std::vector<Outcome> outcomes = Storm();
  const std::vector<uint64_t> accepted = CheckOutcomes(outcomes);
  // The blocker holds one place: exactly the rest were accepted, whichever
  // connection got them.
  ASSERT_EQ(accepted.size(), kBound - 1);
  ExpectGauge("rdma_agentd_transfers_in_flight", kBound);
  // Nothing of the accepted ones ran yet: every slot is untouched.
  EXPECT_EQ(FindMismatch(destination_->bytes(), kDestinationSeed),
            std::nullopt);

  // Waiting on them from now, so that none can expire before it is read.
  absl::StatusOr<std::vector<v1::Transfer>> waited;
  std::thread waiter([&] {
    auto stub = v1::RdmaAgent::NewStub(agent_->client().channel());
    waited = GetTransfers(*stub, accepted, absl::Seconds(60));
  });
  CancelBlocker(blocker);
  waiter.join();
  ASSERT_TRUE(waited.ok()) << waited.status();
  for (const v1::Transfer& transfer : *waited) {
    EXPECT_EQ(transfer.state(), v1::TRANSFER_STATE_DONE)
        << DescribeFailures(transfer);
  }
  ExpectSlots(outcomes);
  // Read ends are gone.
  for (uint64_t id : accepted) {
    EXPECT_TRUE(absl::IsNotFound(GetTransfer(*stub_, id).status())) << id;
  }

  // The bound is free again, exactly: kBound - 1 more fit behind a new
  // blocker, the next is refused.
  ExpectNothingInFlight();
  const std::vector<uint64_t> again = FillBoundBehindABlocker();

  // Left unread: they end, then expire after --transfer_retention.
  ExpectNothingInFlight();
  absl::SleepFor(absl::Seconds(9));
  for (uint64_t id : again) {
    auto expired = GetTransfer(*stub_, id);
    EXPECT_TRUE(absl::IsNotFound(expired.status()))
        << "transfer " << id << ": " << expired.status();
  }

  // Released, the registrations go: no transfer pins one any more.
  ASSERT_TRUE(source_->Release().ok());
  ASSERT_TRUE(destination_->Release().ok());
  ASSERT_TRUE(agent_->client().Release(blocker_buffer_.id).ok());
  ExpectGauge("rdma_agentd_registrations", 0);
  ExpectGauge("rdma_agentd_registered_bytes", 0);
  auto info = agent_->client().GetInfo();
  EXPECT_TRUE(info.ok()) << info.status();
}

TEST_P(TransfersBoundTest, TenThousandWhileTransfersEndStayExact) {
  // Every end is read at the end of the storm: the default retention.
  ASSERT_NO_FATAL_FAILURE(StartAgent(absl::Minutes(5)));
  // The worker runs as the storm submits: transfers end while others are
  // refused and accepted, on four connections at once.
  const std::vector<Outcome> outcomes = Storm();
  const std::vector<uint64_t> accepted = CheckOutcomes(outcomes);
  ASSERT_GE(accepted.size(), kBound) << "the bound never freed";
  std::cout << accepted.size() << " of " << kTransfers
            << " transfers accepted while others ran\n";
  ExpectAllDone(accepted);
  ExpectSlots(outcomes);
  for (uint64_t id : {accepted.front(), accepted.back()}) {
    EXPECT_TRUE(absl::IsNotFound(GetTransfer(*stub_, id).status())) << id;
  }
  ExpectNothingInFlight();

  // Whatever the churn, the count of transfers in flight came back exact.
  const std::vector<uint64_t> again = FillBoundBehindABlocker();
  ExpectAllDone(again);
  ExpectNothingInFlight();
  auto info = agent_->client().GetInfo();
  EXPECT_TRUE(info.ok()) << info.status();
}

INSTANTIATE_TEST_SUITE_P(
    Bounds, TransfersBoundTest,
    ::testing::Values(
        Bound{"PerUser",
              {absl::StrCat("--max_transfers_in_flight_per_user=", kBound)},
              "--max_transfers_in_flight_per_user",
              ""},
        Bound{"Total",
              {absl::StrCat("--max_transfers_in_flight=", kBound)},
              "--max_transfers_in_flight",
              "--max_transfers_in_flight_per_user"}),
    [](const ::testing::TestParamInfo<Bound>& info) {
      return info.param.name;
    });

}  // namespace
}  // namespace rdma_agent::testing

// TransferTable on its own, with fake work whose runs the test controls:
// states and their transitions, cancellation before, during and after a
// run, deadlines, per-user ids, bounds, watchers, retention and shutdown.

#include "daemon/transfers.h"

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/testing/eventually.h"

namespace rdma_agent {
namespace {

using ::rdma_agent::testing::Eventually;

constexpr uid_t kUser = 1000;
constexpr uid_t kOtherUser = 1001;

// What happened to one FakeWork, readable after the table destroyed it.
struct Probe {
  std::atomic<bool> started{false};
  std::atomic<bool> run_returned{false};
  std::atomic<bool> skipped{false};
  std::atomic<bool> destroyed{false};
  absl::Status skip_reason;    // written before `skipped`
  absl::Notification release;  // lets Run end with `codes`
};

// Work of `codes.size()` ops. Run waits until the probe releases it (each op
// then ends with its code) or the stop token fires (every op ends with the
// token's status), polling like a backend that checks between slices.
class FakeWork : public TransferWork {
 public:
  FakeWork(std::shared_ptr<Probe> probe, std::vector<absl::StatusCode> codes)
      : probe_(std::move(probe)), codes_(std::move(codes)) {}
  ~FakeWork() override { probe_->destroyed = true; }

  v1::SubmitResponse Run(const StopToken& stop) override {
    probe_->started = true;
    while (!probe_->release.HasBeenNotified() && !stop.stopped()) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    v1::SubmitResponse outcome;
    const absl::Status stopped = stop.Check("during the fake run");
    for (absl::StatusCode code : codes_) {
      *outcome.add_results() =
          Result(stopped.ok() ? absl::Status(code, "fake") : stopped);
    }
    probe_->run_returned = true;
    return outcome;
  }

  v1::SubmitResponse Skip(const absl::Status& reason) override {
    probe_->skip_reason = reason;
    probe_->skipped = true;
    v1::SubmitResponse outcome;
    for (size_t i = 0; i < codes_.size(); ++i) {
      *outcome.add_results() = Result(reason);
    }
    return outcome;
  }

 private:
  static v1::OpResult Result(const absl::Status& status) {
    v1::OpResult result;
    result.set_code(static_cast<int>(status.code()));
    result.set_message(std::string(status.message()));
    return result;
  }

  std::shared_ptr<Probe> probe_;
  std::vector<absl::StatusCode> codes_;
};

TransferLimits Limits(size_t workers = 2) {
  TransferLimits limits;
  limits.workers = workers;
  limits.max_in_flight_per_user = 4;
  limits.max_in_flight = 6;
  return limits;
}

class TransfersTest : public ::testing::Test {
 protected:
  // Submits fake work for `uid`; returns its id, or 0 when refused.
  uint64_t Submit(TransferTable& table, std::shared_ptr<Probe> probe,
                  std::vector<absl::StatusCode> codes = {absl::StatusCode::kOk},
                  uid_t uid = kUser,
                  absl::Time deadline = absl::Now() + absl::Seconds(60)) {
    auto id = table.Submit(
        uid, std::make_unique<FakeWork>(std::move(probe), std::move(codes)),
        deadline);
    last_status_ = id.status();
    return id.ok() ? *id : 0;
  }

  // GetTransfers of one id, waiting up to `wait`.
  absl::StatusOr<v1::Transfer> Get(TransferTable& table, uint64_t id,
                                   absl::Duration wait = absl::ZeroDuration(),
                                   uid_t uid = kUser) {
    const uint64_t ids[] = {id};
    auto transfers = table.Get(uid, ids, absl::Now() + wait, nullptr);
    if (!transfers.ok()) return transfers.status();
    return transfers->at(0);
  }

  absl::Status last_status_;
};

TEST_F(TransfersTest, PendingThenDoneWithEveryResult) {
  TransferTable table(Limits());
  auto probe = std::make_shared<Probe>();
  const uint64_t id =
      Submit(table, probe, {absl::StatusCode::kOk, absl::StatusCode::kOk});
  ASSERT_NE(id, 0u) << last_status_;
  ASSERT_TRUE(Eventually([&] { return probe->started.load(); }));
  auto pending = Get(table, id);
  ASSERT_TRUE(pending.ok()) << pending.status();
  EXPECT_EQ(pending->state(), v1::TRANSFER_STATE_PENDING);
  EXPECT_EQ(pending->results_size(), 0);
  EXPECT_TRUE(pending->has_create_time());
  EXPECT_TRUE(pending->has_start_time());
  EXPECT_FALSE(pending->has_end_time());
  EXPECT_EQ(table.in_flight(kUser), 1u);

  probe->release.Notify();
  auto done = Get(table, id, absl::Seconds(10));
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->transfer_id(), id);
  EXPECT_EQ(done->state(), v1::TRANSFER_STATE_DONE);
  ASSERT_EQ(done->results_size(), 2);
  EXPECT_EQ(done->results(0).code(), 0);
  EXPECT_EQ(done->results(1).code(), 0);
  EXPECT_TRUE(done->has_end_time());
  // The work (and whatever it held) was gone before the end was visible.
  EXPECT_TRUE(probe->destroyed);
  EXPECT_EQ(table.in_flight(kUser), 0u);
  // Reported once, then dropped.
  EXPECT_TRUE(absl::IsNotFound(Get(table, id).status()));
  EXPECT_EQ(table.kept(), 0u);
}

TEST_F(TransfersTest, FailedKeepsEachOpsCode) {
  TransferTable table(Limits());
  auto probe = std::make_shared<Probe>();
  probe->release.Notify();
  const uint64_t id =
      Submit(table, probe,
             {absl::StatusCode::kOk, absl::StatusCode::kNotFound,
              absl::StatusCode::kOutOfRange});
  auto failed = Get(table, id, absl::Seconds(10));
  ASSERT_TRUE(failed.ok()) << failed.status();
  EXPECT_EQ(failed->state(), v1::TRANSFER_STATE_FAILED);
  ASSERT_EQ(failed->results_size(), 3);
  EXPECT_EQ(failed->results(0).code(), 0);
  EXPECT_EQ(failed->results(1).code(), 5);   // NOT_FOUND
  EXPECT_EQ(failed->results(2).code(), 11);  // OUT_OF_RANGE
}

TEST_F(TransfersTest, GetWithWaitReturnsAsSoonAsTheTransferEnds) {
  TransferTable table(Limits());
  auto probe = std::make_shared<Probe>();
  const uint64_t id = Submit(table, probe);
  std::thread releaser([&] {
    absl::SleepFor(absl::Milliseconds(100));
    probe->release.Notify();
  });
  const absl::Time start = absl::Now();
  auto done = Get(table, id, absl::Seconds(30));
  const absl::Duration took = absl::Now() - start;
  releaser.join();
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->state(), v1::TRANSFER_STATE_DONE);
  EXPECT_GE(took, absl::Milliseconds(90));
  EXPECT_LT(took, absl::Seconds(10))
      << "the wait did not end with the transfer";
}

TEST_F(TransfersTest, GetWithWaitReturnsPendingWhenTheWaitPasses) {
  TransferTable table(Limits());
  auto probe = std::make_shared<Probe>();
  const uint64_t id = Submit(table, probe);
  auto pending = Get(table, id, absl::Milliseconds(100));
  ASSERT_TRUE(pending.ok()) << pending.status();
  EXPECT_EQ(pending->state(), v1::TRANSFER_STATE_PENDING);
  probe->release.Notify();
}

TEST_F(TransfersTest, GetReturnsWhenTheCallerGoes) {
  TransferTable table(Limits());
  auto probe = std::make_shared<Probe>();
  const uint64_t id = Submit(table, probe);
  Cancellation call;
  std::thread leaver([&] {
    absl::SleepFor(absl::Milliseconds(100));
    call.Cancel(absl::CancelledError("client gone"));
  });
  const uint64_t ids[] = {id};
  const absl::Time start = absl::Now();
  auto transfers =
      table.Get(kUser, ids, absl::Now() + absl::Seconds(30), &call);
  leaver.join();
  ASSERT_TRUE(transfers.ok()) << transfers.status();
  EXPECT_EQ(transfers->at(0).state(), v1::TRANSFER_STATE_PENDING);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  probe->release.Notify();
}

TEST_F(TransfersTest, CancelStopsARunningTransferAndWaitsForItsRun) {
  TransferTable table(Limits());
  auto probe = std::make_shared<Probe>();
  const uint64_t id =
      Submit(table, probe, {absl::StatusCode::kOk, absl::StatusCode::kOk});
  ASSERT_TRUE(Eventually([&] { return probe->started.load(); }));
  auto cancelled = table.Cancel(kUser, id);
  // Cancel returned only after the run did.
  EXPECT_TRUE(probe->run_returned);
  EXPECT_TRUE(probe->destroyed);
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_EQ(cancelled->state(), v1::TRANSFER_STATE_CANCELLED);
  ASSERT_EQ(cancelled->results_size(), 2);
  for (const auto& result : cancelled->results()) {
    EXPECT_EQ(result.code(), 1) << result.message();  // CANCELLED
    EXPECT_NE(result.message().find("CancelTransfer"), std::string::npos);
  }
  EXPECT_TRUE(cancelled->has_start_time());
  // Cancel does not report it: GetTransfers still sees the same end.
  auto seen = Get(table, id);
  ASSERT_TRUE(seen.ok()) << seen.status();
  EXPECT_EQ(seen->SerializeAsString(), cancelled->SerializeAsString());
}

TEST_F(TransfersTest, CancelBeforeStartNeverRunsIt) {
  TransferTable table(Limits(/*workers=*/1));
  auto busy = std::make_shared<Probe>();
  const uint64_t first = Submit(table, busy);
  ASSERT_TRUE(Eventually([&] { return busy->started.load(); }));
  auto queued = std::make_shared<Probe>();
  const uint64_t second = Submit(table, queued);
  ASSERT_NE(second, 0u) << last_status_;
  auto cancelled = table.Cancel(kUser, second);
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_EQ(cancelled->state(), v1::TRANSFER_STATE_CANCELLED);
  EXPECT_FALSE(cancelled->has_start_time());
  ASSERT_EQ(cancelled->results_size(), 1);
  EXPECT_EQ(cancelled->results(0).code(), 1);
  EXPECT_TRUE(absl::IsCancelled(queued->skip_reason)) << queued->skip_reason;
  EXPECT_FALSE(queued->started);
  EXPECT_TRUE(queued->destroyed);
  // The worker moves on to nothing of it.
  busy->release.Notify();
  auto done = Get(table, first, absl::Seconds(10));
  ASSERT_TRUE(done.ok());
  EXPECT_EQ(done->state(), v1::TRANSFER_STATE_DONE);
  EXPECT_FALSE(queued->started);
}

TEST_F(TransfersTest, CancelAfterTheEndChangesNothing) {
  TransferTable table(Limits());
  auto probe = std::make_shared<Probe>();
  probe->release.Notify();
  const uint64_t id = Submit(
      table, probe, {absl::StatusCode::kOk, absl::StatusCode::kNotFound});
  ASSERT_TRUE(Eventually([&] { return table.in_flight() == 0; }));
  auto after = table.Cancel(kUser, id);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->state(), v1::TRANSFER_STATE_FAILED);
  ASSERT_EQ(after->results_size(), 2);
  EXPECT_EQ(after->results(1).code(), 5);
  auto seen = Get(table, id);
  ASSERT_TRUE(seen.ok()) << seen.status();
  EXPECT_EQ(seen->SerializeAsString(), after->SerializeAsString());
}

TEST_F(TransfersTest, DeadlineWhileQueuedSkipsTheWork) {
  TransferTable table(Limits(/*workers=*/1));
  auto busy = std::make_shared<Probe>();
  Submit(table, busy);
  ASSERT_TRUE(Eventually([&] { return busy->started.load(); }));
  auto late = std::make_shared<Probe>();
  const uint64_t id = Submit(table, late, {absl::StatusCode::kOk}, kUser,
                             absl::Now() + absl::Milliseconds(20));
  absl::SleepFor(absl::Milliseconds(50));
  busy->release.Notify();
  auto expired = Get(table, id, absl::Seconds(10));
  ASSERT_TRUE(expired.ok()) << expired.status();
  EXPECT_EQ(expired->state(), v1::TRANSFER_STATE_FAILED);
  EXPECT_EQ(expired->results(0).code(), 4);  // DEADLINE_EXCEEDED
  EXPECT_FALSE(late->started);
  EXPECT_FALSE(expired->has_start_time());
}

TEST_F(TransfersTest, DeadlineRacingCancelEndsInOneConsistentState) {
  TransferTable table(Limits(/*workers=*/4));
  for (int round = 0; round < 40; ++round) {
    SCOPED_TRACE(round);
    auto probe = std::make_shared<Probe>();
    const absl::Duration timeout = absl::Milliseconds(5 + round % 5);
    const uint64_t id =
        Submit(table, probe, {absl::StatusCode::kOk, absl::StatusCode::kOk},
               kUser, absl::Now() + timeout);
    ASSERT_NE(id, 0u) << last_status_;
    absl::SleepFor(timeout - absl::Milliseconds(2) +
                   absl::Microseconds(200 * (round % 20)));
    auto cancelled = table.Cancel(kUser, id);
    ASSERT_TRUE(cancelled.ok()) << cancelled.status();
    auto seen = Get(table, id);
    ASSERT_TRUE(seen.ok()) << seen.status();
    // Whoever won, every reader sees the same end...
    EXPECT_EQ(seen->SerializeAsString(), cancelled->SerializeAsString());
    // ...and it is one of the two, consistent with its results.
    ASSERT_EQ(seen->results_size(), 2);
    const int code = seen->results(0).code();
    EXPECT_TRUE(code == 1 || code == 4) << code;
    EXPECT_EQ(seen->results(1).code(), code);
    // CANCELLED when the cancel stopped the ops, FAILED when the deadline
    // did: the state never contradicts the results.
    EXPECT_EQ(seen->state(), code == 1 ? v1::TRANSFER_STATE_CANCELLED
                                       : v1::TRANSFER_STATE_FAILED);
  }
}

TEST_F(TransfersTest, AnotherUsersIdIsNotFoundLikeAnUnknownOne) {
  TransferTable table(Limits());
  auto probe = std::make_shared<Probe>();
  const uint64_t id = Submit(table, probe);
  auto other = Get(table, id, absl::ZeroDuration(), kOtherUser);
  auto unknown = Get(table, id + 1000, absl::ZeroDuration(), kOtherUser);
  ASSERT_TRUE(absl::IsNotFound(other.status())) << other.status();
  ASSERT_TRUE(absl::IsNotFound(unknown.status())) << unknown.status();
  // The same words, the id aside.
  auto without_id = [](const absl::Status& status, uint64_t named) {
    std::string message(status.message());
    const std::string number = std::to_string(named);
    return message.replace(message.find(number), number.size(), "N");
  };
  EXPECT_EQ(without_id(other.status(), id),
            without_id(unknown.status(), id + 1000));
  EXPECT_TRUE(absl::IsNotFound(table.Cancel(kOtherUser, id).status()));
  // Its watch sees nothing of the owner's transfer.
  auto watch = table.Watch(kOtherUser);
  probe->release.Notify();
  ASSERT_TRUE(Eventually([&] { return table.in_flight() == 0; }));
  Cancellation stop;
  stop.Cancel(absl::CancelledError("done"));
  EXPECT_TRUE(table.NextEnded(*watch, &stop).empty());
  // The owner still gets it, untouched.
  auto mine = Get(table, id);
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_EQ(mine->state(), v1::TRANSFER_STATE_DONE);
}

TEST_F(TransfersTest, InFlightBoundsRefuseCleanlyAndFreeUpAgain) {
  TransferTable table(Limits(/*workers=*/1));  // 4 per user, 6 in total
  std::vector<std::shared_ptr<Probe>> probes;
  std::vector<uint64_t> ids;
  for (int i = 0; i < 4; ++i) {
    probes.push_back(std::make_shared<Probe>());
    ids.push_back(Submit(table, probes.back()));
    ASSERT_NE(ids.back(), 0u) << last_status_;
  }
  auto refused = std::make_shared<Probe>();
  EXPECT_EQ(Submit(table, refused), 0u);
  EXPECT_TRUE(absl::IsResourceExhausted(last_status_)) << last_status_;
  EXPECT_NE(last_status_.message().find("--max_transfers_in_flight_per_user"),
            absl::string_view::npos)
      << last_status_;
  // Refused work is dropped at once, nothing of it kept.
  EXPECT_TRUE(refused->destroyed);
  EXPECT_FALSE(refused->started);
  EXPECT_EQ(table.kept(), 4u);
  // Another user fits under the total, up to it.
  for (int i = 0; i < 2; ++i) {
    probes.push_back(std::make_shared<Probe>());
    ids.push_back(
        Submit(table, probes.back(), {absl::StatusCode::kOk}, kOtherUser));
    ASSERT_NE(ids.back(), 0u) << last_status_;
  }
  EXPECT_EQ(Submit(table, std::make_shared<Probe>(), {absl::StatusCode::kOk},
                   kOtherUser),
            0u);
  EXPECT_NE(last_status_.message().find("--max_transfers_in_flight)"),
            absl::string_view::npos)
      << last_status_;
  // Once one ends, there is room again.
  probes[0]->release.Notify();
  ASSERT_TRUE(Get(table, ids[0], absl::Seconds(10)).ok());
  EXPECT_NE(Submit(table, std::make_shared<Probe>()), 0u) << last_status_;
  for (size_t i = 1; i < probes.size(); ++i) probes[i]->release.Notify();
}

TEST_F(TransfersTest, WatchersGetEachEndOnceTheyAsk) {
  TransferTable table(Limits());
  // Ended before the watch starts, and not reported: the backlog.
  auto early = std::make_shared<Probe>();
  early->release.Notify();
  const uint64_t before = Submit(table, early);
  ASSERT_TRUE(Eventually([&] { return table.in_flight() == 0; }));
  auto watch = table.Watch(kUser);
  EXPECT_EQ(table.watchers(), 1u);
  auto backlog = table.NextEnded(*watch, nullptr);
  ASSERT_EQ(backlog.size(), 1u);
  EXPECT_EQ(backlog[0].transfer_id(), before);
  EXPECT_EQ(backlog[0].state(), v1::TRANSFER_STATE_DONE);
  table.MarkReported(kUser, before);
  EXPECT_TRUE(absl::IsNotFound(Get(table, before).status()));

  // One that ends while the watcher waits.
  auto later = std::make_shared<Probe>();
  const uint64_t after = Submit(table, later, {absl::StatusCode::kAborted});
  std::thread releaser([&] {
    absl::SleepFor(absl::Milliseconds(50));
    later->release.Notify();
  });
  auto ended = table.NextEnded(*watch, nullptr);
  releaser.join();
  ASSERT_EQ(ended.size(), 1u);
  EXPECT_EQ(ended[0].transfer_id(), after);
  EXPECT_EQ(ended[0].state(), v1::TRANSFER_STATE_FAILED);

  // A watcher whose caller goes away returns empty-handed, and is gone once
  // destroyed.
  Cancellation call;
  std::thread leaver([&] {
    absl::SleepFor(absl::Milliseconds(50));
    call.Cancel(absl::CancelledError("client gone"));
  });
  EXPECT_TRUE(table.NextEnded(*watch, &call).empty());
  leaver.join();
  watch.reset();
  EXPECT_EQ(table.watchers(), 0u);
}

TEST_F(TransfersTest, UnreadEndsExpireAfterTheRetention) {
  TransferLimits limits = Limits();
  limits.retention = absl::Milliseconds(100);
  TransferTable table(limits);
  auto probe = std::make_shared<Probe>();
  probe->release.Notify();
  const uint64_t id = Submit(table, probe);
  ASSERT_TRUE(Eventually([&] { return table.in_flight() == 0; }));
  EXPECT_EQ(table.kept(), 1u);
  absl::SleepFor(absl::Milliseconds(150));
  auto expired = Get(table, id);
  EXPECT_TRUE(absl::IsNotFound(expired.status())) << expired.status();
  EXPECT_EQ(table.kept(), 0u);
}

TEST_F(TransfersTest, ShutdownEndsEveryTransferAndRefusesNewOnes) {
  TransferTable table(Limits(/*workers=*/1));
  auto running = std::make_shared<Probe>();
  const uint64_t first = Submit(table, running);
  ASSERT_TRUE(Eventually([&] { return running->started.load(); }));
  auto queued = std::make_shared<Probe>();
  const uint64_t second = Submit(table, queued);
  table.Shutdown(absl::UnavailableError("the agent is shutting down"));
  EXPECT_TRUE(running->run_returned);
  EXPECT_TRUE(queued->skipped);
  EXPECT_FALSE(queued->started);
  for (uint64_t id : {first, second}) {
    auto ended = Get(table, id);
    ASSERT_TRUE(ended.ok()) << ended.status();
    EXPECT_EQ(ended->state(), v1::TRANSFER_STATE_FAILED);
    EXPECT_EQ(ended->results(0).code(), 14);  // UNAVAILABLE
  }
  EXPECT_EQ(Submit(table, std::make_shared<Probe>()), 0u);
  EXPECT_TRUE(absl::IsUnavailable(last_status_)) << last_status_;
}

}  // namespace
}  // namespace rdma_agent

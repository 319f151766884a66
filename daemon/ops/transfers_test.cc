// TransferTable on its own, with fake work whose runs the test controls:
// states and their transitions, cancellation before, during and after a
// run, deadlines, per-user ids, bounds, watchers, retention and shutdown.

#include "daemon/ops/transfers.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <optional>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "google/protobuf/unknown_field_set.h"
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
  absl::Status skip_reason;      // written before `skipped`
  absl::Notification release;    // lets Run end with `codes`
  std::string message = "fake";  // of each result, set before Submit
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
          Result(stopped.ok() ? absl::Status(code, probe_->message) : stopped);
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

// What happened to one StartedWork besides its Probe.
struct StartedProbe : Probe {
  // The thread that ends the work, as a backend's completion thread would;
  // joined by the test once the work has ended.
  std::thread completer;
  std::thread::id starter;   // the thread Start ran on
  std::thread::id notifier;  // the thread that sent its notification
  std::atomic<bool> start_returned{false};
  std::atomic<bool> done_called{false};
  // Lets the completer end the work only a while after its stop fired, as
  // a backend draining its queues does.
  absl::Duration drain = absl::ZeroDuration();
  // What the work answers to StartsWithoutBlocking.
  bool starts_without_blocking = false;

  void Join() {
    if (completer.joinable()) completer.join();
  }
};

// Work that starts without holding the worker, as an OpBatch over backends
// that post natively does: Start returns at once, and a thread of its own
// runs FakeWork's ops until they are released or stopped, then calls done,
// through the BlockingExecutor when it has a notification to send (as
// OpBatch::Start does).
class StartedWork : public FakeWork {
 public:
  StartedWork(std::shared_ptr<StartedProbe> probe,
              std::vector<absl::StatusCode> codes, bool notifies)
      : FakeWork(probe, std::move(codes)),
        probe_(std::move(probe)),
        notifies_(notifies) {}

  void Start(const StopToken& stop, BlockingExecutor& blocking,
             TransferDone done) override {
    probe_->starter = std::this_thread::get_id();
    probe_->completer = std::thread([this, stop, &blocking,
                                     done = std::move(done), probe = probe_,
                                     notifies = notifies_]() mutable {
      v1::SubmitResponse response = Run(stop);
      if (stop.stopped()) absl::SleepFor(probe->drain);
      const auto end = [probe](TransferDone done, v1::SubmitResponse response) {
        probe->done_called = true;
        std::move(done)(std::move(response));
      };
      if (!notifies) return end(std::move(done), std::move(response));
      blocking.Run([end, probe, done = std::move(done),
                    response = std::move(response)]() mutable {
        probe->notifier = std::this_thread::get_id();
        response.add_notifications()->set_code(0);
        end(std::move(done), std::move(response));
      });
    });
    probe_->start_returned = true;
  }
  bool StartsWithoutBlocking() const override {
    return probe_->starts_without_blocking;
  }

 private:
  const std::shared_ptr<StartedProbe> probe_;
  const bool notifies_;
};

// Work that holds its ops until its stop token is cancelled and then ends
// inside the cancellation callback, on the cancelling thread, as a backend
// that fails its queued ops when it is told to stop may. The callback's
// handle is kept by the test (destroying it inside the callback would wait
// for itself).
class EndsWhenCancelled : public TransferWork {
 public:
  explicit EndsWhenCancelled(
      std::unique_ptr<Cancellation::Callback>* registration)
      : registration_(registration) {}

  v1::SubmitResponse Run(const StopToken& stop) override {
    (void)stop;
    ADD_FAILURE() << "Start is the table's entry";
    return {};
  }
  void Start(const StopToken& stop, BlockingExecutor& blocking,
             TransferDone done) override {
    (void)blocking;
    done_ = std::move(done);
    *registration_ = stop.OnCancel([this, stop] {
      v1::SubmitResponse response;
      v1::OpResult* result = response.add_results();
      const absl::Status status = stop.StopStatus("while held");
      result->set_code(static_cast<int>(status.code()));
      result->set_message(std::string(status.message()));
      TransferDone done = std::move(done_);
      std::move(done)(std::move(response));
    });
  }
  v1::SubmitResponse Skip(const absl::Status& reason) override {
    v1::SubmitResponse response;
    response.add_results()->set_code(static_cast<int>(reason.code()));
    return response;
  }

 private:
  std::unique_ptr<Cancellation::Callback>* const registration_;
  TransferDone done_;
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
  // Submits fake work for `uid`, its request copy taking `request_bytes`
  // of the budget, as SubmitAsync does; returns its id, or 0 when refused.
  uint64_t Submit(TransferTable& table, std::shared_ptr<Probe> probe,
                  std::vector<absl::StatusCode> codes = {absl::StatusCode::kOk},
                  uid_t uid = kUser,
                  absl::Time deadline = absl::Now() + absl::Seconds(60),
                  uint64_t request_bytes = 0) {
    auto charge = table.Reserve(uid, request_bytes, codes.size());
    if (!charge.ok()) {
      last_status_ = charge.status();
      return 0;
    }
    auto id = table.Submit(
        uid, std::make_unique<FakeWork>(std::move(probe), std::move(codes)),
        deadline, std::move(*charge));
    last_status_ = id.status();
    return id.ok() ? *id : 0;
  }

  // Submits StartedWork for `uid`; returns its id, or 0 when refused.
  uint64_t SubmitStarted(TransferTable& table,
                         std::shared_ptr<StartedProbe> probe, uid_t uid,
                         bool notifies = false) {
    auto charge = table.Reserve(uid, 0, 1);
    if (!charge.ok()) {
      last_status_ = charge.status();
      return 0;
    }
    auto id = table.Submit(
        uid,
        std::make_unique<StartedWork>(
            std::move(probe),
            std::vector<absl::StatusCode>{absl::StatusCode::kOk}, notifies),
        absl::Now() + absl::Seconds(60), std::move(*charge));
    last_status_ = id.status();
    return id.ok() ? *id : 0;
  }

  // GetTransfers of one id, waiting up to `wait` for its end as the
  // service does: a Poll whose callback wakes the waiter.
  absl::StatusOr<v1::Transfer> Get(TransferTable& table, uint64_t id,
                                   absl::Duration wait = absl::ZeroDuration(),
                                   uid_t uid = kUser) {
    absl::Notification settled;
    const uint64_t ids[] = {id};
    auto poll = table.StartPoll(uid, ids, [&] { settled.Notify(); });
    if (!poll.ok()) return poll.status();
    if (!(*poll)->settled()) settled.WaitForNotificationWithTimeout(wait);
    auto transfers = (*poll)->Report();
    if (!transfers.ok()) return transfers.status();
    return transfers->at(0);
  }

  // Opens a stream of `uid`'s ends whose callback counts its wake-ups.
  std::unique_ptr<TransferTable::Stream> Watch(TransferTable& table,
                                               std::atomic<int>* wakes,
                                               uid_t uid = kUser) {
    auto stream = table.Watch(uid, [wakes] { ++*wakes; });
    EXPECT_TRUE(stream.ok()) << stream.status();
    return stream.ok() ? std::move(*stream) : nullptr;
  }

  // The ids a stream has queued now, in order (taken off its queue).
  static std::vector<uint64_t> Drain(TransferTable::Stream& stream) {
    std::vector<uint64_t> ids;
    while (std::optional<v1::Transfer> end = stream.Next()) {
      ids.push_back(end->transfer_id());
    }
    return ids;
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

TEST_F(TransfersTest, APollIsToldWhenTheLastOfItsTransfersEnds) {
  TransferTable table(Limits());
  auto first = std::make_shared<Probe>();
  auto second = std::make_shared<Probe>();
  const uint64_t ids[] = {Submit(table, first), Submit(table, second)};
  std::atomic<int> calls{0};
  auto poll = table.StartPoll(kUser, ids, [&] { ++calls; });
  ASSERT_TRUE(poll.ok()) << poll.status();
  EXPECT_EQ(table.waiting_polls(), 1u);
  first->release.Notify();
  ASSERT_TRUE(Eventually([&] { return table.in_flight() == 1; }));
  EXPECT_FALSE((*poll)->settled());
  EXPECT_EQ(calls, 0) << "told before the last one ended";
  second->release.Notify();
  ASSERT_TRUE(Eventually([&] { return calls == 1; }));
  EXPECT_TRUE((*poll)->settled());
  EXPECT_EQ(table.waiting_polls(), 0u);
  auto transfers = (*poll)->Report().value();
  ASSERT_EQ(transfers.size(), 2u);
  EXPECT_EQ(transfers[0].state(), v1::TRANSFER_STATE_DONE);
  EXPECT_EQ(transfers[1].state(), v1::TRANSFER_STATE_DONE);
  EXPECT_EQ(table.kept(), 0u) << "a report reads (drops) the ends";
  EXPECT_EQ(calls, 1);
}

// A reply over its byte budget carries whole transfers up to it; the ended
// transfers after that come without results, flagged, and stay kept, so
// that naming them again gets them whole: no result is ever lost to a reply
// too large to send.
TEST_F(TransfersTest, AReportOverItsBudgetLeavesLaterResultsKept) {
  TransferTable table(Limits());
  const std::vector<absl::StatusCode> codes(1000, absl::StatusCode::kAborted);
  std::vector<uint64_t> ids;
  for (int i = 0; i < 3; ++i) {
    auto probe = std::make_shared<Probe>();
    probe->release.Notify();
    ids.push_back(Submit(table, probe, codes));
    ASSERT_NE(ids.back(), 0u) << last_status_;
  }
  ASSERT_TRUE(Eventually([&] { return table.in_flight() == 0; }));
  // Room for one transfer of 1000 results, not two (measured on a fourth
  // one like them).
  auto measured = std::make_shared<Probe>();
  measured->release.Notify();
  const uint64_t measured_id = Submit(table, measured, codes);
  ASSERT_TRUE(Eventually([&] { return table.in_flight() == 0; }));
  const size_t one =
      table.Get(kUser, {measured_id}).value().at(0).ByteSizeLong();
  auto poll = table.StartPoll(kUser, ids, nullptr);
  ASSERT_TRUE(poll.ok()) << poll.status();
  auto transfers = (*poll)->Report(one + one / 2).value();
  ASSERT_EQ(transfers.size(), 3u);
  EXPECT_FALSE(transfers[0].results_left_out());
  EXPECT_EQ(transfers[0].results_size(), 1000);
  for (int i = 1; i < 3; ++i) {
    EXPECT_TRUE(transfers[i].results_left_out()) << i;
    EXPECT_EQ(transfers[i].results_size(), 0) << i;
    EXPECT_EQ(transfers[i].state(), v1::TRANSFER_STATE_FAILED) << i;
  }
  EXPECT_EQ(table.kept(), 2u) << "the transfers left out stay kept";
  auto again = table.Get(kUser, {ids[1], ids[2]});
  ASSERT_TRUE(again.ok()) << again.status();
  for (const v1::Transfer& transfer : *again) {
    EXPECT_FALSE(transfer.results_left_out());
    ASSERT_EQ(transfer.results_size(), 1000);
    EXPECT_EQ(transfer.results(999).code(),
              static_cast<int>(absl::StatusCode::kAborted));
  }
  EXPECT_EQ(table.kept(), 0u);
  EXPECT_EQ(table.Get(kUser, {ids[0]}).status().code(),
            absl::StatusCode::kNotFound)
      << "the whole one was read";
}

// Users take turns for the workers: a user's long queue does not make
// another user's transfer wait behind all of it.
TEST_F(TransfersTest, QueuedTransfersTakeTurnsAcrossUsers) {
  TransferTable table(Limits(/*workers=*/1));
  std::vector<std::shared_ptr<Probe>> mine;
  for (int i = 0; i < 4; ++i) {
    mine.push_back(std::make_shared<Probe>());
    ASSERT_NE(Submit(table, mine.back()), 0u) << last_status_;
    if (i == 0) {
      ASSERT_TRUE(Eventually([&] { return mine[0]->started.load(); }));
    }
  }
  auto theirs = std::make_shared<Probe>();
  ASSERT_NE(Submit(table, theirs, {absl::StatusCode::kOk}, kOtherUser), 0u)
      << last_status_;
  mine[0]->release.Notify();
  ASSERT_TRUE(Eventually([&] { return mine[1]->started.load(); }));
  EXPECT_FALSE(theirs->started);
  mine[1]->release.Notify();
  ASSERT_TRUE(Eventually([&] { return theirs->started.load(); }))
      << "the other user's transfer waited behind the first user's queue";
  EXPECT_FALSE(mine[2]->started) << "the other user's turn came first";
  theirs->release.Notify();
  mine[2]->release.Notify();
  mine[3]->release.Notify();
  ASSERT_TRUE(Eventually([&] { return table.in_flight() == 0; }));
  for (const auto& probe : mine) EXPECT_TRUE(probe->run_returned);
  EXPECT_TRUE(theirs->run_returned);
}

TEST_F(TransfersTest, APollGivenUpReportsNothingAndIsNeverCalledAgain) {
  TransferTable table(Limits());
  auto probe = std::make_shared<Probe>();
  const uint64_t ids[] = {Submit(table, probe)};
  std::atomic<int> calls{0};
  {
    auto poll = table.StartPoll(kUser, ids, [&] { ++calls; });
    ASSERT_TRUE(poll.ok()) << poll.status();
    // Its client went away: destroyed without Report.
  }
  EXPECT_EQ(table.waiting_polls(), 0u);
  probe->release.Notify();
  ASSERT_TRUE(Eventually([&] { return table.in_flight() == 0; }));
  EXPECT_EQ(calls, 0);
  // Nothing was read: the end is still there for the next reader.
  auto kept = Get(table, ids[0]);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(kept->state(), v1::TRANSFER_STATE_DONE);
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
  // Its stream sees nothing of the owner's transfer.
  std::atomic<int> wakes{0};
  auto watch = Watch(table, &wakes, kOtherUser);
  probe->release.Notify();
  ASSERT_TRUE(Eventually([&] { return table.in_flight() == 0; }));
  EXPECT_TRUE(Drain(*watch).empty());
  EXPECT_EQ(wakes, 0);
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

TEST_F(TransfersTest, EveryStreamGetsEveryEndAndReadingIsLeftToGet) {
  TransferTable table(Limits());
  // Ended before any stream opens, and not read: the backlog.
  auto early = std::make_shared<Probe>();
  early->release.Notify();
  const uint64_t before = Submit(table, early);
  ASSERT_TRUE(Eventually([&] { return table.in_flight() == 0; }));
  std::atomic<int> first_wakes{0}, second_wakes{0};
  auto first = Watch(table, &first_wakes);
  auto second = Watch(table, &second_wakes);
  EXPECT_EQ(table.watchers(), 2u);
  EXPECT_EQ(Drain(*first), std::vector<uint64_t>{before});
  first->Delivered(before);
  EXPECT_EQ(Drain(*second), std::vector<uint64_t>{before})
      << "the first stream took it from the second";

  // Ends while both are open: each stream gets all of them, in order, and
  // is told as each is queued.
  std::vector<std::shared_ptr<Probe>> probes;
  std::vector<uint64_t> ids;
  for (int i = 0; i < 3; ++i) {
    probes.push_back(std::make_shared<Probe>());
    ids.push_back(Submit(table, probes.back(), {absl::StatusCode::kAborted}));
  }
  for (auto& probe : probes) {
    probe->release.Notify();
    ASSERT_TRUE(Eventually([&] { return probe->destroyed.load(); }));
  }
  // Told after the end is recorded, outside the table's lock.
  ASSERT_TRUE(Eventually([&] { return first_wakes == 3 && second_wakes == 3; }))
      << first_wakes << " " << second_wakes;
  std::sort(ids.begin(), ids.end());
  std::vector<uint64_t> got = Drain(*first);
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, ids);
  got = Drain(*second);
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, ids);

  // Streamed is not read: every end is still there for GetTransfers, and
  // for a stream opened now.
  for (uint64_t id : ids) first->Delivered(id);
  EXPECT_EQ(table.kept(), 4u);
  std::atomic<int> late_wakes{0};
  auto late = Watch(table, &late_wakes);
  EXPECT_EQ(Drain(*late).size(), 4u);
  auto read = Get(table, ids[1]);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->state(), v1::TRANSFER_STATE_FAILED);
  EXPECT_TRUE(absl::IsNotFound(Get(table, ids[1]).status()))
      << "a GetTransfers report is the read";
  EXPECT_EQ(table.kept(), 3u);

  first.reset();
  second.reset();
  late.reset();
  EXPECT_EQ(table.watchers(), 0u);
}

TEST_F(TransfersTest, AStreamKeepsWhatItQueuedWhenAnotherReaderTakesIt) {
  TransferTable table(Limits());
  std::atomic<int> wakes{0};
  auto watch = Watch(table, &wakes);
  auto probe = std::make_shared<Probe>();
  probe->release.Notify();
  const uint64_t id = Submit(table, probe);
  ASSERT_TRUE(Eventually([&] { return wakes == 1; }));
  // Read (and so dropped) by a GetTransfers before the stream wrote it.
  ASSERT_TRUE(Get(table, id).ok());
  EXPECT_EQ(table.kept(), 0u);
  std::optional<v1::Transfer> end = watch->Next();
  ASSERT_TRUE(end.has_value()) << "the stream lost an end that happened "
                                  "while it was open";
  EXPECT_EQ(end->transfer_id(), id);
  EXPECT_EQ(end->state(), v1::TRANSFER_STATE_DONE);
  watch->Delivered(id);  // no longer kept: nothing to mark
  EXPECT_EQ(table.kept(), 0u);
}

TEST_F(TransfersTest, TheKeptBoundDropsDeliveredEndsFirstAndNeverUnseenOnes) {
  TransferLimits limits = Limits(/*workers=*/1);
  limits.max_kept_per_user = 3;
  TransferTable table(limits);
  std::vector<uint64_t> ids;
  for (int i = 0; i < 3; ++i) {
    auto probe = std::make_shared<Probe>();
    probe->release.Notify();
    ids.push_back(Submit(table, probe));
    ASSERT_NE(ids.back(), 0u) << last_status_;
  }
  ASSERT_TRUE(Eventually([&] { return table.in_flight() == 0; }));
  // Three ends nobody has seen: a fourth transfer is refused, not made room
  // for.
  auto refused = std::make_shared<Probe>();
  EXPECT_EQ(Submit(table, refused), 0u);
  EXPECT_TRUE(absl::IsResourceExhausted(last_status_)) << last_status_;
  EXPECT_NE(last_status_.message().find("--max_kept_transfers_per_user"),
            absl::string_view::npos)
      << last_status_;
  EXPECT_TRUE(refused->destroyed);
  EXPECT_EQ(table.kept(), 3u);

  // A stream delivers the second and third: the next Submit drops the
  // oldest delivered one (the second), never the first, which nobody saw.
  std::atomic<int> wakes{0};
  auto watch = Watch(table, &wakes);
  ASSERT_EQ(Drain(*watch), ids);
  watch->Delivered(ids[1]);
  watch->Delivered(ids[2]);
  auto fourth = std::make_shared<Probe>();
  fourth->release.Notify();
  ids.push_back(Submit(table, fourth));
  ASSERT_NE(ids.back(), 0u) << last_status_;
  EXPECT_EQ(table.kept(), 3u);
  EXPECT_TRUE(Get(table, ids[0]).ok()) << "an unseen end was dropped";
  EXPECT_TRUE(absl::IsNotFound(Get(table, ids[1]).status()));
  ASSERT_TRUE(Eventually([&] { return table.in_flight() == 0; }));
  EXPECT_EQ(Drain(*watch), std::vector<uint64_t>{ids[3]});
}

TEST_F(TransfersTest, AStreamThatFallsTooFarBehindIsClosed) {
  TransferLimits limits = Limits(/*workers=*/1);
  limits.max_kept_per_user = 3;
  TransferTable table(limits);
  std::atomic<int> wakes{0};
  auto stalled = Watch(table, &wakes);
  auto reading = Watch(table, &wakes);
  for (int i = 0; i < 4; ++i) {
    auto probe = std::make_shared<Probe>();
    probe->release.Notify();
    const uint64_t id = Submit(table, probe);
    ASSERT_NE(id, 0u) << last_status_;
    ASSERT_TRUE(Eventually([&] { return table.in_flight() == 0; }));
    // The reading stream delivers, so there is always room to submit.
    for (uint64_t delivered : Drain(*reading)) reading->Delivered(delivered);
    EXPECT_TRUE(reading->status().ok()) << reading->status();
  }
  EXPECT_TRUE(absl::IsResourceExhausted(stalled->status()))
      << stalled->status();
  EXPECT_FALSE(stalled->Next().has_value());
}

TEST_F(TransfersTest, ShutdownClosesEveryStreamAndTellsIt) {
  TransferTable table(Limits());
  std::atomic<int> wakes{0};
  auto watch = Watch(table, &wakes);
  table.Shutdown(absl::UnavailableError("the agent is shutting down"));
  EXPECT_EQ(wakes, 1);
  EXPECT_TRUE(absl::IsUnavailable(watch->status())) << watch->status();
  auto refused = table.Watch(kUser, [] {});
  EXPECT_TRUE(absl::IsUnavailable(refused.status())) << refused.status();
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

// ------------------------------------------------------------ bytes

TransferLimits ByteLimits(uint64_t per_user, uint64_t total,
                          size_t workers = 1) {
  TransferLimits limits = Limits(workers);
  limits.max_in_flight_per_user = 64;
  limits.max_in_flight = 128;
  limits.max_bytes_per_user = per_user;
  limits.max_bytes_total = total;
  return limits;
}

// `count` results, every one but the first failed with a `message_bytes`
// long message: a few hundred bytes of memory each.
std::vector<absl::StatusCode> ManyFailed(size_t count) {
  std::vector<absl::StatusCode> codes(count, absl::StatusCode::kAborted);
  codes[0] = absl::StatusCode::kOk;
  return codes;
}

TEST(TransferBytesTest, EstimatesAreNeverBelowWhatProtobufCounts) {
  v1::SubmitRequest request;
  request.set_notification(std::string(3000, 'n'));
  request.mutable_timeout()->set_seconds(5);
  for (int i = 0; i < 100; ++i) {
    v1::Op* op = request.add_ops();
    op->set_type(v1::OP_TYPE_READ_INTO_LOCAL);
    op->set_length(4096);
    op->set_remote_context(std::string(i % 3 == 0 ? 700 : 9, 'c'));
  }
  // Fields the schema does not know are kept by a copy too.
  v1::Op* odd = request.mutable_ops(7);
  odd->GetReflection()->MutableUnknownFields(odd)->AddLengthDelimited(
      99, std::string(100000, 'u'));
  v1::SubmitRequest copy = request;
  EXPECT_GE(RequestCopyBytes(request), copy.SpaceUsedLong());
  EXPECT_GE(RequestCopyBytes(request), 100000u);

  v1::SubmitResponse response;
  for (int i = 0; i < 100; ++i) {
    v1::OpResult* result = response.add_results();
    result->set_code(i % 2 == 0 ? 0 : 10);
    if (i % 2 != 0) result->set_message(std::string(i * 10, 'm'));
    result->set_backend(i % 5 == 0 ? "memory" : std::string(40, 'b'));
  }
  v1::NotificationResult* sent = response.add_notifications();
  sent->set_agent_id(std::string(36, 'a'));
  sent->set_message(std::string(300, 'x'));
  EXPECT_GE(ResultsBytes(response), response.SpaceUsedLong());
  v1::SubmitResponse response_copy = response;
  EXPECT_GE(ResultsBytes(response), response_copy.SpaceUsedLong());
}

// Request copies of queued transfers are charged before they are made:
// past the user's budget, and past the total, Reserve refuses naming the
// flag, and every byte comes back once the transfers are read.
TEST_F(TransfersTest, RequestCopiesAreChargedToTheUserAndTheTotal) {
  TransferTable table(ByteLimits(1 << 20, 5 << 18));  // 1 MiB, 1.25 MiB
  auto busy = std::make_shared<Probe>();
  const uint64_t first = Submit(table, busy);
  ASSERT_TRUE(Eventually([&] { return busy->started.load(); }));
  const uint64_t held = table.bytes(kUser);
  EXPECT_GT(held, 0u) << "a record's floor is charged";
  std::vector<std::shared_ptr<Probe>> probes;
  std::vector<uint64_t> ids = {first};
  for (int i = 0; i < 3; ++i) {
    probes.push_back(std::make_shared<Probe>());
    ids.push_back(Submit(table, probes.back(), {absl::StatusCode::kOk}, kUser,
                         absl::Now() + absl::Seconds(60), 300 << 10));
    ASSERT_NE(ids.back(), 0u) << last_status_;
  }
  EXPECT_GE(table.bytes(kUser), 900u << 10);
  auto refused = std::make_shared<Probe>();
  EXPECT_EQ(Submit(table, refused, {absl::StatusCode::kOk}, kUser,
                   absl::Now() + absl::Seconds(60), 300 << 10),
            0u);
  EXPECT_TRUE(absl::IsResourceExhausted(last_status_)) << last_status_;
  EXPECT_NE(last_status_.message().find("--max_transfer_bytes_per_user"),
            absl::string_view::npos)
      << last_status_;
  EXPECT_LE(table.bytes(kUser), 1u << 20);
  EXPECT_EQ(table.in_flight(kUser), 4u) << "nothing of the refused one kept";

  // Another user fits under the total, up to it.
  probes.push_back(std::make_shared<Probe>());
  const uint64_t theirs =
      Submit(table, probes.back(), {absl::StatusCode::kOk}, kOtherUser,
             absl::Now() + absl::Seconds(60), 300 << 10);
  ASSERT_NE(theirs, 0u) << last_status_;
  EXPECT_EQ(Submit(table, std::make_shared<Probe>(), {absl::StatusCode::kOk},
                   kOtherUser, absl::Now() + absl::Seconds(60), 300 << 10),
            0u);
  EXPECT_NE(last_status_.message().find("--max_transfer_bytes_total"),
            absl::string_view::npos)
      << last_status_;
  EXPECT_LE(table.bytes(), 5u << 18);

  busy->release.Notify();
  for (auto& probe : probes) probe->release.Notify();
  for (uint64_t id : ids) ASSERT_TRUE(Get(table, id, absl::Seconds(10)).ok());
  ASSERT_TRUE(Get(table, theirs, absl::Seconds(10), kOtherUser).ok());
  EXPECT_EQ(table.bytes(), 0u) << "every charge came back";
}

TEST_F(TransfersTest, GrowRefusesWhatDoesNotFitAndLeavesTheChargeAsItWas) {
  TransferTable table(ByteLimits(1 << 20, 1 << 20));
  auto charge = table.Reserve(kUser, 100 << 10, 10);
  ASSERT_TRUE(charge.ok()) << charge.status();
  const uint64_t before = charge->bytes();
  EXPECT_EQ(table.bytes(kUser), before);
  const absl::Status grown = table.Grow(*charge, 1 << 20);
  EXPECT_TRUE(absl::IsResourceExhausted(grown)) << grown;
  EXPECT_EQ(charge->bytes(), before);
  EXPECT_TRUE(table.Grow(*charge, 10 << 10).ok());
  EXPECT_EQ(table.bytes(kUser), before + (10 << 10));
  *charge = TransferCharge();
  EXPECT_EQ(table.bytes(kUser), 0u);
}

// An end whose results do not fit keeps each code and says so; it costs
// only the floor reserved with it.
TEST_F(TransfersTest, AnEndWhoseResultsDoNotFitKeepsOnlyItsCodes) {
  TransferTable table(ByteLimits(256 << 10, 1 << 20, 2));
  auto probe = std::make_shared<Probe>();
  probe->message = std::string(300, 'm');
  probe->release.Notify();
  const std::vector<absl::StatusCode> codes = ManyFailed(1000);
  const uint64_t id = Submit(table, probe, codes);
  ASSERT_NE(id, 0u) << last_status_;
  ASSERT_TRUE(Eventually([&] { return table.in_flight() == 0; }));
  EXPECT_LT(table.bytes(kUser), 16u << 10) << "more than the floor is kept";
  auto ended = Get(table, id);
  ASSERT_TRUE(ended.ok()) << ended.status();
  EXPECT_EQ(ended->state(), v1::TRANSFER_STATE_FAILED);
  EXPECT_FALSE(ended->results_left_out());
  ASSERT_EQ(ended->results_size(), 1000);
  EXPECT_EQ(ended->results(0).code(), 0);
  EXPECT_TRUE(ended->results(0).message().empty());
  // The first failed op says why, naming the budget; every failed op says
  // its details were dropped.
  EXPECT_EQ(ended->results(1).message(), TransferTable::kDetailsDroppedPerUser);
  for (int i = 1; i < 1000; ++i) {
    ASSERT_EQ(ended->results(i).code(),
              static_cast<int>(absl::StatusCode::kAborted));
    if (i > 1) ASSERT_EQ(ended->results(i).message(), "details dropped");
  }
  EXPECT_EQ(table.bytes(), 0u);

  // Results that fit are kept whole.
  auto small = std::make_shared<Probe>();
  small->release.Notify();
  const uint64_t whole = Submit(table, small, ManyFailed(20));
  auto kept = Get(table, whole, absl::Seconds(10));
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(kept->results(1).message(), "fake");
}

// Reading is cheap when nobody else holds the end: its results move into
// the reply with their charge, so a user whose budget its unread ends fill
// can still read them.
TEST_F(TransfersTest, AnEndReadByOneReaderMovesIntoTheReplyUncopied) {
  TransferTable table(ByteLimits(1 << 20, 2 << 20, 2));
  auto probe = std::make_shared<Probe>();
  probe->message = std::string(300, 'm');
  probe->release.Notify();
  const uint64_t id = Submit(table, probe, ManyFailed(1500));
  ASSERT_NE(id, 0u) << last_status_;
  ASSERT_TRUE(Eventually([&] { return table.in_flight() == 0; }));
  const uint64_t kept = table.bytes(kUser);
  EXPECT_GT(kept, 512u << 10) << "the results were not kept whole";
  // A copy would not fit next to the kept results.
  const uint64_t ids[] = {id};
  auto poll = table.StartPoll(kUser, ids, nullptr);
  ASSERT_TRUE(poll.ok()) << poll.status();
  auto read = (*poll)->Report();
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->at(0).results_size(), 1500);
  EXPECT_EQ(read->at(0).results(1499).message(), probe->message);
  EXPECT_LE(table.bytes(kUser), kept + (4 << 10))
      << "the reply was charged as a copy";
  poll->reset();
  EXPECT_EQ(table.bytes(kUser), 0u);
}

// A reader that shares the end (another poll holds it) copies it, and the
// copy is charged: when it does not fit, nothing is reported.
TEST_F(TransfersTest, ACopyThatDoesNotFitIsRefusedAndReportsNothing) {
  TransferTable table(ByteLimits(1 << 20, 2 << 20, 2));
  auto probe = std::make_shared<Probe>();
  probe->message = std::string(300, 'm');
  probe->release.Notify();
  const uint64_t id = Submit(table, probe, ManyFailed(1500));
  ASSERT_NE(id, 0u) << last_status_;
  ASSERT_TRUE(Eventually([&] { return table.in_flight() == 0; }));
  const uint64_t ids[] = {id};
  auto other = table.StartPoll(kUser, ids, nullptr);
  ASSERT_TRUE(other.ok());
  auto refused = table.Get(kUser, ids);
  EXPECT_TRUE(absl::IsResourceExhausted(refused.status())) << refused.status();
  EXPECT_NE(refused.status().message().find("--max_transfer_bytes_per_user"),
            absl::string_view::npos)
      << refused.status();
  EXPECT_EQ(table.kept(), 1u) << "a refused read reported the end";
  other->reset();
  auto read = table.Get(kUser, ids);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->at(0).results_size(), 1500);
  EXPECT_EQ(table.bytes(), 0u);
}

TEST_F(TransfersTest, AStreamWhoseNextCopyDoesNotFitIsClosedNamingTheBudget) {
  TransferTable table(ByteLimits(1 << 20, 2 << 20, 2));
  std::atomic<int> wakes{0};
  auto watch = Watch(table, &wakes);
  auto probe = std::make_shared<Probe>();
  probe->message = std::string(300, 'm');
  probe->release.Notify();
  const uint64_t id = Submit(table, probe, ManyFailed(1500));
  ASSERT_NE(id, 0u) << last_status_;
  ASSERT_TRUE(Eventually([&] { return wakes >= 1; }));
  EXPECT_TRUE(absl::IsResourceExhausted(watch->status())) << watch->status();
  EXPECT_NE(watch->status().message().find("--max_transfer_bytes_per_user"),
            std::string::npos)
      << watch->status();
  EXPECT_FALSE(watch->Next().has_value());
  // The end stays kept, whole, for GetTransfers.
  auto read = Get(table, id);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->results(1).message(), probe->message);
  watch.reset();
  EXPECT_EQ(table.bytes(), 0u);
}

TEST_F(TransfersTest, AStreamsCopiesAreChargedUntilTheNextOne) {
  TransferTable table(ByteLimits(4 << 20, 8 << 20, 2));
  std::atomic<int> wakes{0};
  auto watch = Watch(table, &wakes);
  auto probe = std::make_shared<Probe>();
  probe->message = std::string(300, 'm');
  probe->release.Notify();
  const uint64_t id = Submit(table, probe, ManyFailed(1500));
  ASSERT_TRUE(Eventually([&] { return wakes >= 1; }));
  const uint64_t kept_and_head = table.bytes(kUser);
  std::optional<v1::Transfer> end = watch->Next();
  ASSERT_TRUE(end.has_value());
  EXPECT_EQ(end->transfer_id(), id);
  EXPECT_EQ(end->results_size(), 1500);
  EXPECT_EQ(table.bytes(kUser), kept_and_head) << "the copy moved charges";
  watch->Delivered(id);
  ASSERT_TRUE(Get(table, id).ok());
  watch.reset();
  EXPECT_EQ(table.bytes(), 0u);
}

TEST_F(TransfersTest, DeliveredEndsAreDroppedToMakeRoomForBytes) {
  TransferTable table(ByteLimits(1 << 20, 2 << 20, 2));
  std::atomic<int> wakes{0};
  auto watch = Watch(table, &wakes);
  auto probe = std::make_shared<Probe>();
  probe->message = std::string(300, 'm');
  probe->release.Notify();
  const uint64_t id = Submit(table, probe, ManyFailed(1000));
  ASSERT_TRUE(Eventually([&] { return wakes >= 1; }));
  ASSERT_TRUE(watch->Next().has_value());
  watch->Delivered(id);
  watch.reset();  // and with it the copy it wrote
  // Its client has it: a request copy that needs its bytes drops it.
  const uint64_t next =
      Submit(table, std::make_shared<Probe>(), {absl::StatusCode::kOk}, kUser,
             absl::Now() + absl::Seconds(60), 700 << 10);
  EXPECT_NE(next, 0u) << last_status_;
  EXPECT_TRUE(absl::IsNotFound(Get(table, id).status()));
  ASSERT_TRUE(table.Cancel(kUser, next).ok());
}

TEST_F(TransfersTest, GetCountsARepeatedIdOnce) {
  TransferTable table(Limits());
  auto probe = std::make_shared<Probe>();
  probe->release.Notify();
  const uint64_t id = Submit(table, probe, ManyFailed(100));
  ASSERT_TRUE(Eventually([&] { return table.in_flight() == 0; }));
  std::vector<uint64_t> ids(1024, id);
  auto read = table.Get(kUser, ids);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->size(), 1u);
  EXPECT_EQ(read->at(0).transfer_id(), id);
  EXPECT_EQ(read->at(0).results_size(), 100);
  EXPECT_EQ(table.kept(), 0u);
}

// --------------------------------------------------------- the workers

// With four workers one user runs at most two transfers at once: its other
// transfers wait while another user's take the free workers.
TEST_F(TransfersTest, OneUserRunsAtMostItsShareOfTheWorkers) {
  TransferTable table(Limits(/*workers=*/4));
  EXPECT_EQ(table.limits().running_per_user(), 2u);
  std::vector<std::shared_ptr<Probe>> stuck;
  for (int i = 0; i < 4; ++i) {
    stuck.push_back(std::make_shared<Probe>());
    ASSERT_NE(Submit(table, stuck.back()), 0u) << last_status_;
  }
  ASSERT_TRUE(Eventually([&] { return table.running(kUser) == 2; }));
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(table.running(kUser), 2u);
  EXPECT_FALSE(stuck[2]->started);
  EXPECT_FALSE(stuck[3]->started);
  // Two workers are free for the other user, at once and again.
  for (int i = 0; i < 2; ++i) {
    auto theirs = std::make_shared<Probe>();
    theirs->release.Notify();
    const uint64_t id =
        Submit(table, theirs, {absl::StatusCode::kOk}, kOtherUser);
    ASSERT_NE(id, 0u) << last_status_;
    auto done = Get(table, id, absl::Seconds(10), kOtherUser);
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_EQ(done->state(), v1::TRANSFER_STATE_DONE)
        << "the other user's transfer waited behind the stuck ones";
  }
  // One of the stuck ends: the next of the same user takes its worker.
  stuck[0]->release.Notify();
  ASSERT_TRUE(Eventually([&] { return stuck[2]->started.load(); }));
  EXPECT_EQ(table.running(kUser), 2u);
  EXPECT_FALSE(stuck[3]->started);
  for (int i = 1; i < 4; ++i) stuck[i]->release.Notify();
  ASSERT_TRUE(Eventually([&] { return table.in_flight() == 0; }));
  EXPECT_TRUE(stuck[3]->run_returned);
}

TEST_F(TransfersTest, TheRunningCapIsConfigurable) {
  TransferLimits limits = Limits(/*workers=*/3);
  EXPECT_EQ(limits.running_per_user(), 1u);
  limits.max_running_per_user = 3;
  TransferTable table(limits);
  std::vector<std::shared_ptr<Probe>> probes;
  for (int i = 0; i < 3; ++i) {
    probes.push_back(std::make_shared<Probe>());
    ASSERT_NE(Submit(table, probes.back()), 0u) << last_status_;
  }
  ASSERT_TRUE(Eventually([&] { return table.running(kUser) == 3; }));
  for (auto& probe : probes) probe->release.Notify();
}

// ----------------------------------------------------------------- ids

TEST_F(TransfersTest, IdsSayNothingOfOtherUsersTransfers) {
  TransferTable table(Limits(/*workers=*/2));
  std::vector<uint64_t> mine;
  for (int round = 0; round < 20; ++round) {
    auto probe = std::make_shared<Probe>();
    probe->release.Notify();
    mine.push_back(Submit(table, probe));
    ASSERT_NE(mine.back(), 0u) << last_status_;
    ASSERT_TRUE(Get(table, mine.back(), absl::Seconds(10)).ok());
    // Between two of mine, `round` of theirs.
    for (int i = 0; i < round; ++i) {
      auto theirs = std::make_shared<Probe>();
      theirs->release.Notify();
      const uint64_t id =
          Submit(table, theirs, {absl::StatusCode::kOk}, kOtherUser);
      ASSERT_TRUE(Get(table, id, absl::Seconds(10), kOtherUser).ok());
    }
  }
  size_t small_gaps = 0;
  for (size_t i = 1; i < mine.size(); ++i) {
    EXPECT_LT(mine[i], uint64_t{1} << 63);
    const uint64_t gap =
        mine[i] > mine[i - 1] ? mine[i] - mine[i - 1] : mine[i - 1] - mine[i];
    if (gap < (uint64_t{1} << 32)) ++small_gaps;
  }
  EXPECT_EQ(small_gaps, 0u) << "ids look like a counter";
}

// ------------------------------------------------------ started transfers

constexpr uid_t kThirdUser = 1002;

TEST_F(TransfersTest, AWorkerStartsATransferAndGoesBackToTheQueue) {
  TransferLimits limits = Limits(/*workers=*/1);
  limits.max_in_flight = 8;
  TransferTable table(limits);
  // Two users' transfers that do not end (a peer that holds them) ...
  auto first = std::make_shared<StartedProbe>();
  auto second = std::make_shared<StartedProbe>();
  const uint64_t first_id = SubmitStarted(table, first, kUser);
  const uint64_t second_id = SubmitStarted(table, second, kOtherUser);
  ASSERT_NE(first_id, 0u) << last_status_;
  ASSERT_NE(second_id, 0u) << last_status_;
  // ... both start on the one worker, and stay running.
  ASSERT_TRUE(Eventually([&] { return second->started.load(); }))
      << "the worker waited for the first transfer instead of starting the "
         "second";
  EXPECT_EQ(table.running(kUser), 1u);
  EXPECT_EQ(table.running(kOtherUser), 1u);
  // A third user's transfer starts and ends while they are held.
  auto third = std::make_shared<Probe>();
  third->release.Notify();
  const uint64_t third_id =
      Submit(table, third, {absl::StatusCode::kOk}, kThirdUser);
  ASSERT_NE(third_id, 0u) << last_status_;
  auto third_end = Get(table, third_id, absl::Seconds(10), kThirdUser);
  ASSERT_TRUE(third_end.ok()) << third_end.status();
  EXPECT_EQ(third_end->state(), v1::TRANSFER_STATE_DONE);
  // The held ones end when their ops do, on their completion threads.
  first->release.Notify();
  second->release.Notify();
  for (auto [probe, uid, id] :
       {std::make_tuple(first, kUser, first_id),
        std::make_tuple(second, kOtherUser, second_id)}) {
    auto end = Get(table, id, absl::Seconds(10), uid);
    ASSERT_TRUE(end.ok()) << end.status();
    EXPECT_EQ(end->state(), v1::TRANSFER_STATE_DONE);
    probe->Join();
    EXPECT_TRUE(probe->destroyed);
  }
  EXPECT_EQ(table.running(kUser), 0u);
}

// Work that only posts starts on the submitting thread when nobody waits
// for a worker and its user is below its cap; otherwise it queues for the
// workers as before, behind those who wait.
TEST_F(TransfersTest, WorkThatOnlyPostsStartsOnTheSubmittingThread) {
  TransferLimits limits = Limits(/*workers=*/1);
  limits.max_running_per_user = 1;
  TransferTable table(limits);
  auto first = std::make_shared<StartedProbe>();
  first->starts_without_blocking = true;
  const uint64_t first_id = SubmitStarted(table, first, kUser);
  ASSERT_NE(first_id, 0u) << last_status_;
  // Started before Submit returned, here.
  EXPECT_TRUE(first->start_returned.load());
  EXPECT_EQ(first->starter, std::this_thread::get_id());
  EXPECT_EQ(table.running(kUser), 1u);
  // The user is at its cap: the next one queues, and a worker starts it
  // once the first has ended.
  auto second = std::make_shared<StartedProbe>();
  second->starts_without_blocking = true;
  const uint64_t second_id = SubmitStarted(table, second, kUser);
  ASSERT_NE(second_id, 0u) << last_status_;
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(second->start_returned.load());
  // Work that may block never starts here, whatever the queue.
  auto blocking = std::make_shared<StartedProbe>();
  const uint64_t blocking_id = SubmitStarted(table, blocking, kOtherUser);
  ASSERT_NE(blocking_id, 0u) << last_status_;
  ASSERT_TRUE(Eventually([&] { return blocking->start_returned.load(); }));
  EXPECT_NE(blocking->starter, std::this_thread::get_id());
  first->release.Notify();
  ASSERT_TRUE(Eventually([&] { return second->start_returned.load(); }));
  EXPECT_NE(second->starter, std::this_thread::get_id());
  second->release.Notify();
  blocking->release.Notify();
  for (auto [probe, uid, id] :
       {std::make_tuple(first, kUser, first_id),
        std::make_tuple(second, kUser, second_id),
        std::make_tuple(blocking, kOtherUser, blocking_id)}) {
    auto end = Get(table, id, absl::Seconds(10), uid);
    ASSERT_TRUE(end.ok()) << end.status();
    EXPECT_EQ(end->state(), v1::TRANSFER_STATE_DONE);
    probe->Join();
  }
}

TEST_F(TransfersTest, AStartedTransferSendsItsNotificationsOnAWorker) {
  TransferTable table(Limits(/*workers=*/1));
  auto probe = std::make_shared<StartedProbe>();
  const uint64_t id = SubmitStarted(table, probe, kUser, /*notifies=*/true);
  ASSERT_NE(id, 0u) << last_status_;
  ASSERT_TRUE(Eventually([&] { return probe->start_returned.load(); }));
  probe->release.Notify();
  auto end = Get(table, id, absl::Seconds(10));
  ASSERT_TRUE(end.ok()) << end.status();
  EXPECT_EQ(end->state(), v1::TRANSFER_STATE_DONE);
  ASSERT_EQ(end->notifications_size(), 1);
  const std::thread::id completer = probe->completer.get_id();
  probe->Join();
  // The worker that started it sent the notification; the completion
  // thread only handed it over.
  EXPECT_EQ(probe->notifier, probe->starter);
  EXPECT_NE(probe->notifier, completer);
}

TEST_F(TransfersTest, CancelEndsAStartedTransferBeforeItReturns) {
  TransferTable table(Limits(/*workers=*/1));
  auto probe = std::make_shared<StartedProbe>();
  probe->drain = absl::Milliseconds(50);
  const uint64_t id = SubmitStarted(table, probe, kUser);
  ASSERT_NE(id, 0u) << last_status_;
  ASSERT_TRUE(Eventually([&] { return probe->started.load(); }));
  auto cancelled = table.Cancel(kUser, id);
  // Its done had been called, and the work destroyed, when Cancel returned
  // (the completer took `drain` to end it).
  EXPECT_TRUE(probe->done_called);
  EXPECT_TRUE(probe->destroyed);
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_EQ(cancelled->state(), v1::TRANSFER_STATE_CANCELLED);
  ASSERT_EQ(cancelled->results_size(), 1);
  EXPECT_EQ(cancelled->results(0).code(), 1);  // CANCELLED
  probe->Join();
}

TEST_F(TransfersTest, StartCancelReturnsBeforeTheEndWhichComesAsAnyEnd) {
  TransferTable table(Limits(/*workers=*/1));
  auto probe = std::make_shared<StartedProbe>();
  // Far longer than StartCancel takes: its end cannot have come by then.
  probe->drain = absl::Seconds(1);
  const uint64_t id = SubmitStarted(table, probe, kUser);
  ASSERT_NE(id, 0u) << last_status_;
  ASSERT_TRUE(Eventually([&] { return probe->started.load(); }));
  std::atomic<bool> settled{false};
  auto poll = table.StartPoll(kUser, absl::MakeConstSpan(&id, 1),
                              [&] { settled = true; });
  ASSERT_TRUE(poll.ok()) << poll.status();
  ASSERT_TRUE(table.StartCancel(kUser, id).ok());
  EXPECT_FALSE(probe->done_called);
  EXPECT_FALSE((*poll)->settled());
  // The end comes to the poll as any end does.
  ASSERT_TRUE(Eventually([&] { return settled.load(); }));
  auto ended = (*poll)->Report();
  ASSERT_TRUE(ended.ok()) << ended.status();
  ASSERT_EQ(ended->size(), 1u);
  EXPECT_EQ(ended->front().state(), v1::TRANSFER_STATE_CANCELLED);
  ASSERT_EQ(ended->front().results_size(), 1);
  EXPECT_EQ(ended->front().results(0).code(), 1);  // CANCELLED
  EXPECT_EQ(table.StartCancel(kUser, id + 1).code(),
            absl::StatusCode::kNotFound);
  probe->Join();
}

TEST_F(TransfersTest, ATransferMayEndInsideItsCancellation) {
  std::vector<std::unique_ptr<Cancellation::Callback>> registrations(2);
  TransferLimits limits = Limits(/*workers=*/1);
  limits.max_running_per_user = 2;
  TransferTable table(limits);
  std::vector<uint64_t> ids;
  for (auto& registration : registrations) {
    auto charge = table.Reserve(kUser, 0, 1);
    ASSERT_TRUE(charge.ok()) << charge.status();
    auto id =
        table.Submit(kUser, std::make_unique<EndsWhenCancelled>(&registration),
                     absl::Now() + absl::Seconds(60), std::move(*charge));
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  ASSERT_TRUE(Eventually([&] { return table.running(kUser) == 2; }));
  // Cancel's thread records the end (the table's lock is not held while
  // the cancellation runs), and Cancel returns it.
  auto cancelled = table.Cancel(kUser, ids[0]);
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_EQ(cancelled->state(), v1::TRANSFER_STATE_CANCELLED);
  EXPECT_EQ(cancelled->results(0).code(), 1);  // CANCELLED
  // So does Shutdown's.
  table.Shutdown(absl::UnavailableError("the agent is shutting down"));
  EXPECT_EQ(table.in_flight(), 0u);
  registrations.clear();
}

TEST_F(TransfersTest, ShutdownWaitsForStartedTransfersToEnd) {
  auto probes = {std::make_shared<StartedProbe>(),
                 std::make_shared<StartedProbe>()};
  {
    TransferTable table(Limits(/*workers=*/1));
    uid_t uid = kUser;
    for (const auto& probe : probes) {
      probe->drain = absl::Milliseconds(50);
      ASSERT_NE(SubmitStarted(table, probe, uid++, /*notifies=*/true), 0u)
          << last_status_;
    }
    for (const auto& probe : probes) {
      ASSERT_TRUE(Eventually([&] { return probe->started.load(); }));
    }
    const absl::Time start = absl::Now();
    table.Shutdown(absl::UnavailableError("the agent is shutting down"));
    // Both ended (their notification tasks ran on the worker) before
    // Shutdown returned, promptly.
    for (const auto& probe : probes) {
      EXPECT_TRUE(probe->done_called);
      EXPECT_TRUE(probe->destroyed);
    }
    EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  }
  for (const auto& probe : probes) probe->Join();
}

}  // namespace
}  // namespace rdma_agent

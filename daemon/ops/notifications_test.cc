// NotificationInbox: what a peer's notification must prove (the target's
// token, before anything else is said), where it goes (the buffer owner's
// queue, or every open stream of that owner), what a full queue drops and
// how the drop is shown, and that waiting readers wake.

#include "daemon/ops/notifications.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "backends/buffer_table.h"
#include "common/shared_memory.h"
#include "gtest/gtest.h"

namespace rdma_agent {
namespace {

constexpr uint64_t kEpoch = 11;
constexpr uid_t kOwner = 1000;
constexpr uid_t kOther = 1001;

class NotificationsTest : public ::testing::Test {
 protected:
  // Registers a buffer of `owner` with token "token-<id>".
  uint64_t AddBuffer(uid_t owner, v1::Access access = v1::ACCESS_READ_WRITE) {
    const uint64_t id = table_.NextId();
    auto memory = SharedMemory::Allocate(4096, "notifications_test");
    EXPECT_TRUE(memory.ok()) << memory.status();
    table_.Add(std::make_shared<Registration>(id, owner, access, "label",
                                              Token(id), std::move(*memory),
                                              /*agent_allocated=*/true));
    return id;
  }

  static std::string Token(uint64_t id) {
    return "token-" + std::to_string(id);
  }

  static ServeRequest Target(uint64_t id, uint64_t epoch = kEpoch) {
    ServeRequest target;
    target.agent_epoch = epoch;
    target.buffer_id = id;
    target.token = Token(id);
    return target;
  }

  NotificationInbox::Taken TakeNow(NotificationInbox& inbox, uid_t uid,
                                   size_t max_count = 100) {
    return inbox.Take(uid, max_count);
  }

  // Every event `stream` has now.
  static std::vector<v1::NotificationEvent> Drain(
      NotificationInbox::Stream& stream) {
    std::vector<v1::NotificationEvent> events;
    while (auto event = stream.Next()) events.push_back(std::move(*event));
    return events;
  }

  BufferTable table_{kEpoch};
};

TEST_F(NotificationsTest, DeliversToTheBufferOwnerInOrder) {
  NotificationInbox inbox(&table_, {});
  const uint64_t mine = AddBuffer(kOwner);
  const uint64_t theirs = AddBuffer(kOther);
  ASSERT_TRUE(inbox.Deliver(Target(mine), "agent-a", "first").ok());
  ASSERT_TRUE(inbox.Deliver(Target(theirs), "agent-b", "other").ok());
  ASSERT_TRUE(inbox.Deliver(Target(mine), "agent-c", "second").ok());

  NotificationInbox::Taken batch = TakeNow(inbox, kOwner);
  ASSERT_EQ(batch.notifications.size(), 2u);
  EXPECT_EQ(batch.dropped, 0u);
  EXPECT_EQ(batch.notifications[0].from_agent_id(), "agent-a");
  EXPECT_EQ(batch.notifications[0].buffer_id(), mine);
  EXPECT_EQ(batch.notifications[0].data(), "first");
  EXPECT_EQ(batch.notifications[0].sequence(), 1u);
  EXPECT_EQ(batch.notifications[1].data(), "second");
  EXPECT_EQ(batch.notifications[1].sequence(), 2u);
  EXPECT_GT(batch.notifications[1].receive_time().seconds(), 0);
  // Each is returned once.
  EXPECT_TRUE(TakeNow(inbox, kOwner).notifications.empty());
  // The other user's is its own, numbered from 1 too.
  batch = TakeNow(inbox, kOther);
  ASSERT_EQ(batch.notifications.size(), 1u);
  EXPECT_EQ(batch.notifications[0].data(), "other");
  EXPECT_EQ(batch.notifications[0].sequence(), 1u);
}

TEST_F(NotificationsTest, RefusesWithoutTheTokenBeforeSayingAnythingElse) {
  NotificationLimits limits;
  limits.max_bytes = 4;
  NotificationInbox inbox(&table_, limits);
  const uint64_t id = AddBuffer(kOwner);

  ServeRequest forged = Target(id);
  forged.token = "token-999";
  // Too long as well: the token is what is reported.
  absl::Status status = inbox.Deliver(forged, "x", "longer than four");
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  status = inbox.Deliver(Target(id + 100), "x", "ok");
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  status = inbox.Deliver(Target(id, kEpoch + 1), "x", "ok");
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  // With the token, the length.
  status = inbox.Deliver(Target(id), "x", "12345");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("--max_notification_bytes"),
            absl::string_view::npos)
      << status;
  EXPECT_TRUE(inbox.Deliver(Target(id), "x", "1234").ok());
  EXPECT_EQ(TakeNow(inbox, kOwner).notifications.size(), 1u);
  EXPECT_EQ(inbox.delivered_total(), 1u);
}

TEST_F(NotificationsTest, OnlyAWriteCapableTokenNotifies) {
  NotificationInbox inbox(&table_, {});
  const uint64_t read_only = AddBuffer(kOwner, v1::ACCESS_READ);
  const uint64_t write_only = AddBuffer(kOwner, v1::ACCESS_WRITE);
  absl::Status status = inbox.Deliver(Target(read_only), "x", "planted");
  EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied) << status;
  // The token is still checked first.
  ServeRequest forged = Target(read_only);
  forged.token = "guess";
  EXPECT_EQ(inbox.Deliver(forged, "x", "planted").code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(inbox.Deliver(Target(write_only), "x", "written").ok());
  NotificationInbox::Taken batch = TakeNow(inbox, kOwner);
  ASSERT_EQ(batch.notifications.size(), 1u);
  EXPECT_EQ(batch.notifications[0].data(), "written");
}

TEST_F(NotificationsTest, UnreadStreamPaysForTheUsersByteBudget) {
  NotificationLimits limits;
  const std::string data(1000, 'd');
  const size_t cost = data.size() + 1 + NotificationLimits::kOverheadBytes;
  limits.max_queued_bytes_per_user = 10 * cost;
  NotificationInbox inbox(&table_, limits);
  const uint64_t id = AddBuffer(kOwner);
  auto reading = inbox.OpenStream(kOwner, [] {});
  auto stalled = inbox.OpenStream(kOwner, [] {});
  for (int i = 0; i < 100; ++i) {
    ASSERT_TRUE(inbox.Deliver(Target(id), "a", data).ok());
    // One reader keeps up: it loses nothing.
    std::vector<v1::NotificationEvent> events = Drain(*reading);
    ASSERT_EQ(events.size(), 1u);
    EXPECT_EQ(events[0].dropped(), 0u);
    EXPECT_LE(inbox.held_bytes(), limits.max_queued_bytes_per_user);
  }
  // The one that never read kept the newest that fit beside the reader's
  // copy, and hears of the rest.
  std::vector<v1::NotificationEvent> events = Drain(*stalled);
  ASSERT_EQ(events.size(), 9u);
  EXPECT_EQ(events[0].dropped(), 91u);
  EXPECT_EQ(events[0].notification().sequence(), 92u);
  EXPECT_EQ(inbox.held_bytes(), 0u);
  EXPECT_EQ(inbox.dropped_total(), 91u);
}

TEST_F(NotificationsTest, TotalsDropFromTheUserHoldingTheMost) {
  NotificationLimits limits;
  const std::string data(1000, 'd');
  const size_t cost = data.size() + 1 + NotificationLimits::kOverheadBytes;
  limits.max_queued_bytes_per_user = 100 * cost;
  limits.max_queued_bytes_total = 100 * cost;
  limits.max_queued_total = 50;
  NotificationInbox inbox(&table_, limits);
  const uint64_t theirs = AddBuffer(kOther);
  const uint64_t mine = AddBuffer(kOwner);
  ASSERT_TRUE(inbox.Deliver(Target(theirs), "a", data).ok());
  for (int i = 0; i < 200; ++i) {
    ASSERT_TRUE(inbox.Deliver(Target(mine), "a", data).ok());
  }
  // The count bound held; the flooding user paid for it.
  EXPECT_EQ(inbox.queued(kOwner) + inbox.queued(kOther), 50u);
  EXPECT_EQ(inbox.queued(kOther), 1u);
  EXPECT_EQ(TakeNow(inbox, kOwner, 1000).dropped, 151u);
  EXPECT_EQ(TakeNow(inbox, kOther).notifications.size(), 1u);
  EXPECT_EQ(inbox.held_bytes(), 0u);
}

TEST_F(NotificationsTest, ReleasedBufferTakesNoMore) {
  NotificationInbox inbox(&table_, {});
  const uint64_t id = AddBuffer(kOwner);
  ASSERT_TRUE(table_.Remove(id, kOwner).ok());
  EXPECT_EQ(inbox.Deliver(Target(id), "x", "late").code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(inbox.queued(kOwner), 0u);
}

TEST_F(NotificationsTest, FullQueueDropsTheOldestAndSaysSo) {
  NotificationLimits limits;
  limits.max_queued_per_user = 3;
  NotificationInbox inbox(&table_, limits);
  const uint64_t id = AddBuffer(kOwner);
  for (int i = 1; i <= 5; ++i) {
    ASSERT_TRUE(inbox.Deliver(Target(id), "a", std::to_string(i)).ok());
  }
  EXPECT_EQ(inbox.queued(kOwner), 3u);
  NotificationInbox::Taken batch = TakeNow(inbox, kOwner, 2);
  EXPECT_EQ(batch.dropped, 2u);
  ASSERT_EQ(batch.notifications.size(), 2u);
  // The newest three were kept; the gap in sequence numbers is the drop.
  EXPECT_EQ(batch.notifications[0].data(), "3");
  EXPECT_EQ(batch.notifications[0].sequence(), 3u);
  // The drop is reported once.
  batch = TakeNow(inbox, kOwner);
  EXPECT_EQ(batch.dropped, 0u);
  ASSERT_EQ(batch.notifications.size(), 1u);
  EXPECT_EQ(batch.notifications[0].data(), "5");
  EXPECT_EQ(inbox.dropped_total(), 2u);
}

TEST_F(NotificationsTest, TakeStopsAtItsByteBound) {
  NotificationInbox inbox(&table_, {});
  const uint64_t id = AddBuffer(kOwner);
  const std::string data(1000, 'd');
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(inbox.Deliver(Target(id), "a", data).ok());
  }
  // Two fit in 2500 bytes (1000 + 1 + overhead each); one always comes.
  EXPECT_EQ(inbox.Take(kOwner, 100, 2500).notifications.size(), 2u);
  EXPECT_EQ(inbox.Take(kOwner, 100, 1).notifications.size(), 1u);
  EXPECT_EQ(inbox.Take(kOwner, 100).notifications.size(), 2u);
}

TEST_F(NotificationsTest, DropsAloneWakeAPoll) {
  NotificationLimits limits;
  limits.max_queued_per_user = 1;
  NotificationInbox inbox(&table_, limits);
  const uint64_t id = AddBuffer(kOwner);
  ASSERT_TRUE(inbox.Deliver(Target(id), "a", "1").ok());
  ASSERT_TRUE(inbox.Deliver(Target(id), "a", "2").ok());
  NotificationInbox::Taken batch = TakeNow(inbox, kOwner, 1);
  EXPECT_EQ(batch.dropped, 1u);
  EXPECT_EQ(batch.notifications.size(), 1u);
}

TEST_F(NotificationsTest, EveryOpenStreamGetsEachNotification) {
  NotificationInbox inbox(&table_, {});
  const uint64_t id = AddBuffer(kOwner);
  ASSERT_TRUE(inbox.Deliver(Target(id), "a", "queued").ok());
  // The first stream takes over the queue; the second starts empty.
  int first_woken = 0, second_woken = 0;
  auto first = inbox.OpenStream(kOwner, [&] { ++first_woken; });
  auto second = inbox.OpenStream(kOwner, [&] { ++second_woken; });
  ASSERT_TRUE(inbox.Deliver(Target(id), "a", "live").ok());
  EXPECT_EQ(first_woken, 1);
  EXPECT_EQ(second_woken, 1);

  std::vector<v1::NotificationEvent> a = Drain(*first);
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(a[0].notification().data(), "queued");
  EXPECT_EQ(a[1].notification().data(), "live");
  std::vector<v1::NotificationEvent> b = Drain(*second);
  ASSERT_EQ(b.size(), 1u);
  EXPECT_EQ(b[0].notification().data(), "live");
  // Nothing went to the poll queue while streams were open.
  EXPECT_EQ(inbox.queued(kOwner), 0u);
}

TEST_F(NotificationsTest, LastStreamClosedGivesBackWhatItNeverHandedOut) {
  NotificationInbox inbox(&table_, {});
  const uint64_t id = AddBuffer(kOwner);
  {
    auto stream = inbox.OpenStream(kOwner, [] {});
    ASSERT_TRUE(inbox.Deliver(Target(id), "a", "unread").ok());
  }
  NotificationInbox::Taken batch = TakeNow(inbox, kOwner);
  ASSERT_EQ(batch.notifications.size(), 1u);
  EXPECT_EQ(batch.notifications[0].data(), "unread");
}

TEST_F(NotificationsTest, SlowStreamDropsItsOwnOldest) {
  NotificationLimits limits;
  limits.max_queued_per_user = 2;
  NotificationInbox inbox(&table_, limits);
  const uint64_t id = AddBuffer(kOwner);
  auto stream = inbox.OpenStream(kOwner, [] {});
  for (int i = 1; i <= 4; ++i) {
    ASSERT_TRUE(inbox.Deliver(Target(id), "a", std::to_string(i)).ok());
  }
  std::vector<v1::NotificationEvent> events = Drain(*stream);
  ASSERT_EQ(events.size(), 2u);
  // The drops come with the first event after them.
  EXPECT_EQ(events[0].dropped(), 2u);
  EXPECT_EQ(events[0].notification().data(), "3");
  EXPECT_EQ(events[1].dropped(), 0u);
}

TEST_F(NotificationsTest, PollIsWokenAndSettlesOnDelivery) {
  NotificationInbox inbox(&table_, {});
  const uint64_t id = AddBuffer(kOwner);
  int woken = 0;
  auto poll = inbox.StartPoll(kOwner, [&] { ++woken; });
  EXPECT_FALSE(poll->settled());
  // Another user's notification neither wakes nor settles it.
  ASSERT_TRUE(inbox.Deliver(Target(AddBuffer(kOther)), "a", "other").ok());
  EXPECT_EQ(woken, 0);
  EXPECT_FALSE(poll->settled());
  ASSERT_TRUE(inbox.Deliver(Target(id), "a", "wake").ok());
  EXPECT_EQ(woken, 1);
  ASSERT_TRUE(poll->settled());
  NotificationInbox::Taken batch = poll->Take(10);
  ASSERT_EQ(batch.notifications.size(), 1u);
  EXPECT_EQ(batch.notifications[0].data(), "wake");
  EXPECT_FALSE(poll->settled());
}

TEST_F(NotificationsTest, DestroyedReadersAreNeverWokenAgain) {
  NotificationInbox inbox(&table_, {});
  const uint64_t id = AddBuffer(kOwner);
  int woken = 0;
  inbox.StartPoll(kOwner, [&] { ++woken; }).reset();
  inbox.OpenStream(kOwner, [&] { ++woken; }).reset();
  ASSERT_TRUE(inbox.Deliver(Target(id), "a", "nobody").ok());
  inbox.Close();
  EXPECT_EQ(woken, 0);
  EXPECT_EQ(inbox.queued(kOwner), 1u);
}

TEST_F(NotificationsTest, CloseWakesEveryReaderAndRefusesDeliveries) {
  NotificationInbox inbox(&table_, {});
  int poll_woken = 0, stream_woken = 0;
  auto poll = inbox.StartPoll(kOwner, [&] { ++poll_woken; });
  auto stream = inbox.OpenStream(kOther, [&] { ++stream_woken; });
  EXPECT_TRUE(stream->status().ok());
  inbox.Close();
  EXPECT_EQ(poll_woken, 1);
  EXPECT_EQ(stream_woken, 1);
  EXPECT_TRUE(poll->settled());
  EXPECT_EQ(stream->status().code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(stream->Next().has_value());
  const uint64_t id = AddBuffer(kOwner);
  EXPECT_EQ(inbox.Deliver(Target(id), "a", "late").code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace rdma_agent

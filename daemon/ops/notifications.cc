#include "daemon/ops/notifications.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "google/protobuf/util/time_util.h"

namespace rdma_agent {

NotificationInbox::Stream::~Stream() {
  // First: once revoked, no delivery runs it while this stream goes.
  wake_->Revoke();
  absl::MutexLock lock(&owner_->mu_);
  User& user = owner_->users_[uid_];
  user.streams.erase(this);
  if (!user.streams.empty()) {
    // Another stream has its own copy of everything this one holds.
    while (!queue_.items.empty()) owner_->PopFront(user, queue_, false);
    return;
  }
  // What this stream never handed out goes back to the user's queue (it
  // stays charged to the user), then the queue's bound applies again.
  user.queue.bytes += queue_.bytes;
  while (!queue_.items.empty()) {
    user.queue.items.push_front(std::move(queue_.items.back()));
    queue_.items.pop_back();
  }
  user.queue.dropped += queue_.dropped;
  while (user.queue.items.size() > owner_->limits_.max_queued_per_user) {
    owner_->PopFront(user, user.queue, true);
  }
}

std::optional<v1::NotificationEvent> NotificationInbox::Stream::Next() {
  absl::MutexLock lock(&owner_->mu_);
  if (queue_.items.empty() && queue_.dropped == 0) return std::nullopt;
  v1::NotificationEvent event;
  event.set_dropped(std::exchange(queue_.dropped, 0));
  if (!queue_.items.empty()) {
    *event.mutable_notification() =
        owner_->PopFront(owner_->users_[uid_], queue_, false);
  }
  return event;
}

absl::Status NotificationInbox::Stream::status() const {
  absl::MutexLock lock(&owner_->mu_);
  if (owner_->closed_) {
    return absl::UnavailableError("the agent is shutting down");
  }
  return absl::OkStatus();
}

NotificationInbox::Poll::~Poll() {
  wake_->Revoke();
  absl::MutexLock lock(&owner_->mu_);
  owner_->users_[uid_].polls.erase(this);
}

bool NotificationInbox::Poll::settled() const {
  absl::MutexLock lock(&owner_->mu_);
  const User& user = owner_->users_[uid_];
  return owner_->closed_ || !user.queue.items.empty() || user.queue.dropped > 0;
}

NotificationInbox::Taken NotificationInbox::Poll::Take(size_t max_count,
                                                       size_t max_bytes) {
  return owner_->Take(uid_, max_count, max_bytes);
}

NotificationInbox::NotificationInbox(const BufferDirectory* directory,
                                     NotificationLimits limits)
    : directory_(directory), limits_(limits) {}

NotificationInbox::~NotificationInbox() { Close(); }

absl::Status NotificationInbox::Deliver(const ServeRequest& target,
                                        absl::string_view from_agent_id,
                                        absl::string_view data) {
  // Token first: a sender without it learns neither the limit nor the id;
  // then WRITE access: a READ-only context announces nothing.
  auto registration = directory_->ResolveForNotification(target);
  if (!registration.ok()) return registration.status();
  if (data.size() > limits_.max_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("a notification of ", data.size(),
                     " bytes is longer than this agent takes (",
                     limits_.max_bytes, ", --max_notification_bytes)"));
  }
  v1::Notification notification;
  notification.set_from_agent_id(std::string(from_agent_id));
  notification.set_buffer_id((*registration)->id());
  notification.set_data(std::string(data));
  *notification.mutable_receive_time() =
      google::protobuf::util::TimeUtil::NanosecondsToTimestamp(
          absl::ToUnixNanos(absl::Now()));
  const uid_t owner = (*registration)->owner();
  Wakeups wake;
  {
    absl::MutexLock lock(&mu_);
    if (closed_) {
      return absl::UnavailableError("the agent is shutting down");
    }
    User& user = users_[owner];
    notification.set_sequence(user.next_sequence++);
    ++delivered_total_;
    if (user.streams.empty()) {
      Push(user, user.queue, std::move(notification));
      for (Poll* poll : user.polls) wake.push_back(poll->wake_);
    } else {
      for (Stream* stream : user.streams) {
        Push(user, stream->queue_, notification);
        wake.push_back(stream->wake_);
      }
    }
    Trim(user);
  }
  RunAll(wake);
  return absl::OkStatus();
}

void NotificationInbox::RunAll(const Wakeups& wakeups) {
  for (const auto& wake : wakeups) wake->Run();
}

uint64_t NotificationInbox::Cost(const v1::Notification& notification) {
  return notification.data().size() + notification.from_agent_id().size() +
         NotificationLimits::kOverheadBytes;
}

void NotificationInbox::Push(User& user, Queue& queue,
                             v1::Notification notification) {
  if (queue.items.size() >= limits_.max_queued_per_user) {
    PopFront(user, queue, true);
  }
  const uint64_t cost = Cost(notification);
  queue.items.push_back(std::move(notification));
  queue.bytes += cost;
  user.bytes += cost;
  held_bytes_ += cost;
  ++held_count_;
}

v1::Notification NotificationInbox::PopFront(User& user, Queue& queue,
                                             bool dropped) {
  v1::Notification front = std::move(queue.items.front());
  queue.items.pop_front();
  const uint64_t cost = Cost(front);
  queue.bytes -= cost;
  user.bytes -= cost;
  held_bytes_ -= cost;
  --held_count_;
  if (dropped) {
    ++queue.dropped;
    ++dropped_total_;
  }
  return front;
}

NotificationInbox::Queue* NotificationInbox::Fullest(User& user) {
  Queue* fullest = user.queue.items.empty() ? nullptr : &user.queue;
  for (Stream* stream : user.streams) {
    Queue& queue = stream->queue_;
    if (!queue.items.empty() &&
        (fullest == nullptr || queue.bytes > fullest->bytes)) {
      fullest = &queue;
    }
  }
  return fullest;
}

void NotificationInbox::Trim(User& user) {
  // The user's own budget: its fullest queue (a stream that stopped
  // reading, typically) pays, not the readers that keep up.
  while (user.bytes > limits_.max_queued_bytes_per_user) {
    Queue* fullest = Fullest(user);
    if (fullest == nullptr) break;
    PopFront(user, *fullest, true);
  }
  // The totals: the user holding the most pays.
  while (held_count_ > limits_.max_queued_total ||
         held_bytes_ > limits_.max_queued_bytes_total) {
    User* largest = nullptr;
    for (auto& [uid, candidate] : users_) {
      if (candidate.bytes > 0 &&
          (largest == nullptr || candidate.bytes > largest->bytes)) {
        largest = &candidate;
      }
    }
    Queue* fullest = largest == nullptr ? nullptr : Fullest(*largest);
    if (fullest == nullptr) break;
    PopFront(*largest, *fullest, true);
  }
}

NotificationInbox::Taken NotificationInbox::Pop(User& user, size_t max_count,
                                                size_t max_bytes) {
  Taken batch;
  uint64_t bytes = 0;
  while (batch.notifications.size() < max_count && !user.queue.items.empty()) {
    const uint64_t cost = Cost(user.queue.items.front());
    if (!batch.notifications.empty() && bytes + cost > max_bytes) break;
    bytes += cost;
    batch.notifications.push_back(PopFront(user, user.queue, false));
  }
  batch.dropped = std::exchange(user.queue.dropped, 0);
  return batch;
}

NotificationInbox::Taken NotificationInbox::Take(uid_t uid, size_t max_count,
                                                 size_t max_bytes) {
  absl::MutexLock lock(&mu_);
  return Pop(users_[uid], max_count, max_bytes);
}

std::unique_ptr<NotificationInbox::Poll> NotificationInbox::StartPoll(
    uid_t uid, std::function<void()> wake) {
  std::unique_ptr<Poll> poll(new Poll(this, uid, std::move(wake)));
  absl::MutexLock lock(&mu_);
  users_[uid].polls.insert(poll.get());
  return poll;
}

std::unique_ptr<NotificationInbox::Stream> NotificationInbox::OpenStream(
    uid_t uid, std::function<void()> wake) {
  std::unique_ptr<Stream> stream(new Stream(this, uid, std::move(wake)));
  absl::MutexLock lock(&mu_);
  User& user = users_[uid];
  // The first stream takes over the queue (and its charge).
  if (user.streams.empty()) stream->queue_ = std::exchange(user.queue, {});
  user.streams.insert(stream.get());
  return stream;
}

size_t NotificationInbox::queued(uid_t uid) const {
  absl::MutexLock lock(&mu_);
  auto it = users_.find(uid);
  return it == users_.end() ? 0 : it->second.queue.items.size();
}

uint64_t NotificationInbox::held_bytes() const {
  absl::MutexLock lock(&mu_);
  return held_bytes_;
}

uint64_t NotificationInbox::delivered_total() const {
  absl::MutexLock lock(&mu_);
  return delivered_total_;
}

uint64_t NotificationInbox::dropped_total() const {
  absl::MutexLock lock(&mu_);
  return dropped_total_;
}

void NotificationInbox::Close() {
  Wakeups wake;
  {
    absl::MutexLock lock(&mu_);
    if (closed_) return;
    closed_ = true;
    for (auto& [uid, user] : users_) {
      for (Stream* stream : user.streams) wake.push_back(stream->wake_);
      for (Poll* poll : user.polls) wake.push_back(poll->wake_);
    }
  }
  RunAll(wake);
}

}  // namespace rdma_agent

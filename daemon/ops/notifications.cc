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
  // What this stream never handed out goes back to the user's queue, unless
  // another stream has its own copy of it.
  if (user.streams.empty()) {
    while (!queue_.empty()) {
      user.queue.push_front(std::move(queue_.back()));
      queue_.pop_back();
    }
    while (user.queue.size() > owner_->limits_.max_queued_per_user) {
      user.queue.pop_front();
      ++user.dropped;
      ++owner_->dropped_total_;
    }
    user.dropped += dropped_;
  }
}

std::optional<v1::NotificationEvent> NotificationInbox::Stream::Next() {
  absl::MutexLock lock(&owner_->mu_);
  if (queue_.empty() && dropped_ == 0) return std::nullopt;
  v1::NotificationEvent event;
  event.set_dropped(std::exchange(dropped_, 0));
  if (!queue_.empty()) {
    *event.mutable_notification() = std::move(queue_.front());
    queue_.pop_front();
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
  return owner_->closed_ || !user.queue.empty() || user.dropped > 0;
}

NotificationInbox::Taken NotificationInbox::Poll::Take(size_t max_count) {
  return owner_->Take(uid_, max_count);
}

NotificationInbox::NotificationInbox(const BufferDirectory* directory,
                                     NotificationLimits limits)
    : directory_(directory), limits_(limits) {}

NotificationInbox::~NotificationInbox() { Close(); }

absl::Status NotificationInbox::Deliver(const ServeRequest& target,
                                        absl::string_view from_agent_id,
                                        absl::string_view data) {
  ServeRequest proof = target;
  proof.proof_only = true;
  // Token first: a sender without it learns neither the limit nor the id.
  auto registration = directory_->ResolveForPeer(proof);
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
      Push(user.queue, user.dropped, std::move(notification));
      for (Poll* poll : user.polls) wake.push_back(poll->wake_);
    } else {
      for (Stream* stream : user.streams) {
        Push(stream->queue_, stream->dropped_, notification);
        wake.push_back(stream->wake_);
      }
    }
  }
  RunAll(wake);
  return absl::OkStatus();
}

void NotificationInbox::RunAll(const Wakeups& wakeups) {
  for (const auto& wake : wakeups) wake->Run();
}

void NotificationInbox::Push(std::deque<v1::Notification>& queue,
                             uint64_t& dropped, v1::Notification notification) {
  if (queue.size() >= limits_.max_queued_per_user) {
    queue.pop_front();
    ++dropped;
    ++dropped_total_;
  }
  queue.push_back(std::move(notification));
}

NotificationInbox::Taken NotificationInbox::Pop(
    std::deque<v1::Notification>& queue, uint64_t& dropped, size_t max_count) {
  Taken batch;
  const size_t count = std::min(max_count, queue.size());
  batch.notifications.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    batch.notifications.push_back(std::move(queue.front()));
    queue.pop_front();
  }
  batch.dropped = std::exchange(dropped, 0);
  return batch;
}

NotificationInbox::Taken NotificationInbox::Take(uid_t uid, size_t max_count) {
  absl::MutexLock lock(&mu_);
  User& user = users_[uid];
  return Pop(user.queue, user.dropped, max_count);
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
  if (user.streams.empty()) {
    stream->queue_ = std::exchange(user.queue, {});
    stream->dropped_ = std::exchange(user.dropped, 0);
  }
  user.streams.insert(stream.get());
  return stream;
}

size_t NotificationInbox::queued(uid_t uid) const {
  absl::MutexLock lock(&mu_);
  auto it = users_.find(uid);
  return it == users_.end() ? 0 : it->second.queue.size();
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

#include "daemon/api/notification_rpcs.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/api/waiting_rpcs.h"

namespace rdma_agent {
namespace {

// Notifications one GetNotifications returns at most: bounds the reply.
constexpr uint32_t kMaxNotificationsPerGet = 1024;
// Bytes of notifications one GetNotifications returns at most (one always
// fits: a notification is at most 1 MiB): within gRPC's default 4 MiB a
// client receives, so that large notifications never make an answer the
// client refuses after they were taken off the queue. The rest stay queued
// for the next call.
constexpr size_t kMaxBytesPerGet = 2 << 20;

// A GetNotifications long poll's view of the inbox.
class NotificationPoll final : public PollSource<v1::GetNotificationsResponse> {
 public:
  NotificationPoll(std::unique_ptr<NotificationInbox::Poll> poll,
                   size_t max_count)
      : poll_(std::move(poll)), max_count_(max_count) {}

  bool settled() const override { return poll_->settled(); }

  absl::Status Answer(v1::GetNotificationsResponse* response) override {
    NotificationInbox::Taken batch = poll_->Take(max_count_, kMaxBytesPerGet);
    for (v1::Notification& notification : batch.notifications) {
      *response->add_notifications() = std::move(notification);
    }
    response->set_dropped(batch.dropped);
    return absl::OkStatus();
  }

 private:
  const std::unique_ptr<NotificationInbox::Poll> poll_;
  const size_t max_count_;
};

// A WatchNotifications stream's view of the inbox.
class NotificationEvents final : public EventSource<v1::NotificationEvent> {
 public:
  explicit NotificationEvents(std::unique_ptr<NotificationInbox::Stream> stream)
      : stream_(std::move(stream)) {}

  std::optional<v1::NotificationEvent> Next() override {
    return stream_->Next();
  }
  // Taken off the stream's queue by Next: one that could not be written is
  // lost with its client, like any event in flight.
  void Written(const v1::NotificationEvent&) override {}
  absl::Status status() const override { return stream_->status(); }

 private:
  const std::unique_ptr<NotificationInbox::Stream> stream_;
};

}  // namespace

grpc::ServerUnaryReactor* ServeGetNotifications(
    grpc::CallbackServerContext* context,
    std::unique_ptr<ActiveCalls::Call> call, uid_t uid,
    const v1::GetNotificationsRequest& request,
    v1::GetNotificationsResponse* response, NotificationInbox* inbox,
    absl::Duration max_wait) {
  if (request.max_count() > kMaxNotificationsPerGet) {
    return RefuseUnary(context,
                       absl::InvalidArgumentError(absl::StrCat(
                           "GetNotifications: max_count ", request.max_count(),
                           " is more than ", kMaxNotificationsPerGet)));
  }
  auto wait =
      LongPollWait(request.has_wait() ? &request.wait() : nullptr, max_wait);
  if (!wait.ok()) {
    return RefuseUnary(context, Prefixed(wait.status(), "GetNotifications"));
  }
  const size_t most =
      request.max_count() == 0 ? kMaxNotificationsPerGet : request.max_count();
  const absl::Time deadline =
      std::min(absl::Now() + *wait, absl::FromChrono(context->deadline()));
  return ServeLongPoll<v1::GetNotificationsResponse>(
      std::move(call), "GetNotifications", deadline, response,
      [&](std::function<void()> wake)
          -> absl::StatusOr<
              std::unique_ptr<PollSource<v1::GetNotificationsResponse>>> {
        return std::make_unique<NotificationPoll>(
            inbox->StartPoll(uid, std::move(wake)), most);
      });
}

grpc::ServerWriteReactor<v1::NotificationEvent>* ServeWatchNotifications(
    std::unique_ptr<ActiveCalls::Call> call, uid_t uid,
    NotificationInbox* inbox) {
  return ServeEventStream<v1::NotificationEvent>(
      std::move(call), "WatchNotifications",
      [&](std::function<void()> wake)
          -> absl::StatusOr<
              std::unique_ptr<EventSource<v1::NotificationEvent>>> {
        return std::make_unique<NotificationEvents>(
            inbox->OpenStream(uid, std::move(wake)));
      });
}

}  // namespace rdma_agent

// AgentClient::GetNotifications and the NotificationWatch stream.
#include <memory>
#include <thread>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "client/internal/client_state.h"
#include "client/internal/conversions.h"
#include "client/rdma_agent_client.h"
#include "common/grpc_status.h"

namespace rdma_agent::client {
namespace internal {

// One WatchNotifications RPC read by one thread that runs the callback.
class NotificationStream {
 public:
  NotificationStream(std::shared_ptr<ClientState> state,
                     NotificationCallback callback)
      : state_(std::move(state)), callback_(std::move(callback)) {}
  ~NotificationStream() { Stop(); }

  void Start() {
    thread_ = std::thread([this] { Read(); });
  }

  void Stop() {
    context_.TryCancel();
    if (thread_.joinable()) thread_.join();
  }

  absl::Status status() const {
    absl::MutexLock lock(&mu_);
    return status_;
  }

 private:
  void Read() {
    auto reader = state_->stub().WatchNotifications(&context_, {});
    v1::NotificationEvent event;
    while (reader->Read(&event)) {
      if (event.has_notification()) {
        const Notification notification = FromProto(event.notification());
        callback_(&notification, event.dropped());
      } else {
        callback_(nullptr, event.dropped());
      }
    }
    absl::Status ended = FromGrpcStatus(reader->Finish());
    if (ended.ok()) ended = absl::UnavailableError("the stream ended");
    absl::MutexLock lock(&mu_);
    status_ = std::move(ended);
  }

  const std::shared_ptr<ClientState> state_;
  NotificationCallback callback_;
  grpc::ClientContext context_;
  std::thread thread_;
  mutable absl::Mutex mu_;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace internal

NotificationWatch::NotificationWatch(
    std::shared_ptr<internal::NotificationStream> stream)
    : stream_(std::move(stream)) {}
NotificationWatch::NotificationWatch(NotificationWatch&& other) noexcept =
    default;
NotificationWatch& NotificationWatch::operator=(
    NotificationWatch&& other) noexcept {
  if (this != &other) {
    Stop();
    stream_ = std::move(other.stream_);
  }
  return *this;
}
NotificationWatch::~NotificationWatch() { Stop(); }

void NotificationWatch::Stop() {
  if (stream_ != nullptr) stream_->Stop();
}

absl::Status NotificationWatch::status() const {
  if (stream_ == nullptr) return absl::FailedPreconditionError("moved from");
  return stream_->status();
}

absl::StatusOr<NotificationBatch> AgentClient::GetNotifications(
    absl::Duration wait, uint32_t max_count) {
  grpc::ClientContext context;
  wait = std::max(wait, absl::ZeroDuration());
  // The agent answers by `wait` at the latest (cut to its own bound).
  context.set_deadline(absl::ToChronoTime(absl::Now() +
                                          std::min(wait, absl::Hours(1)) +
                                          state_->options().rpc_timeout));
  v1::GetNotificationsRequest request;
  const int64_t nanos =
      absl::ToInt64Nanoseconds(std::min(wait, absl::Hours(1)));
  request.mutable_wait()->set_seconds(nanos / 1000000000);
  request.mutable_wait()->set_nanos(static_cast<int32_t>(nanos % 1000000000));
  request.set_max_count(max_count);
  v1::GetNotificationsResponse response;
  const grpc::Status status =
      state_->stub().GetNotifications(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  NotificationBatch batch;
  batch.dropped = response.dropped();
  for (const v1::Notification& notification : response.notifications()) {
    batch.notifications.push_back(internal::FromProto(notification));
  }
  return batch;
}

absl::StatusOr<NotificationWatch> AgentClient::WatchNotifications(
    NotificationCallback on_notification) {
  if (on_notification == nullptr) {
    return absl::InvalidArgumentError("WatchNotifications needs a callback");
  }
  auto stream = std::make_shared<internal::NotificationStream>(
      state_, std::move(on_notification));
  stream->Start();
  return NotificationWatch(std::move(stream));
}

}  // namespace rdma_agent::client

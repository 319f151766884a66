#include "daemon/api/name_rpcs.h"

#include <deque>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/api/waiting_rpcs.h"

namespace rdma_agent {

absl::StatusOr<std::shared_ptr<void>> NameWatches::Take(uid_t uid) {
  absl::MutexLock lock(&mu_);
  if (per_user_[uid] >= max_per_user_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("you have ", per_user_[uid],
                     " WatchNames streams open, the most "
                     "--max_name_watches_per_user allows"));
  }
  if (total_ >= max_total_) {
    return absl::ResourceExhaustedError(
        absl::StrCat(total_,
                     " WatchNames streams are open, the most "
                     "--max_name_watches allows"));
  }
  ++per_user_[uid];
  ++total_;
  return std::shared_ptr<void>(nullptr, [this, uid](void*) {
    absl::MutexLock lock(&mu_);
    if (--per_user_[uid] == 0) per_user_.erase(uid);
    --total_;
  });
}

namespace {

// The directory's events for one stream, queued until written.
class NameEventSource final : public EventSource<v1::NameEvent> {
 public:
  NameEventSource(uid_t caller, std::shared_ptr<void> slot,
                  std::function<void()> wake)
      : caller_(caller), slot_(std::move(slot)), wake_(std::move(wake)) {}

  void set_subscription(std::unique_ptr<Directory::Subscription> subscription) {
    subscription_ = std::move(subscription);
  }

  // From the directory (its thread, or the opener's during WatchNames).
  void Add(const v1::NameEvent& event) {
    // Names the caller may not see are not there for it, coming or going.
    if (event.kind() != v1::NameEvent::SYNCED &&
        !VisibleTo(event.record(), caller_)) {
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      if (!status_.ok()) return;
      const size_t bytes = event.ByteSizeLong();
      if (queue_.size() >= kMaxQueuedNameEvents ||
          queued_bytes_ + bytes > kMaxQueuedNameEventBytes) {
        status_ = absl::ResourceExhaustedError(absl::StrCat(
            "the stream fell more than ", queue_.size(), " events (",
            queued_bytes_, " bytes) behind; watch again"));
        queue_.clear();
      } else {
        queued_bytes_ += bytes;
        queue_.push_back(event);
      }
    }
    wake_();
  }
  void End(const absl::Status& status) {
    {
      absl::MutexLock lock(&mu_);
      if (status_.ok()) status_ = status;
    }
    wake_();
  }

  std::optional<v1::NameEvent> Next() override {
    absl::MutexLock lock(&mu_);
    if (queue_.empty()) return std::nullopt;
    v1::NameEvent event = std::move(queue_.front());
    queue_.pop_front();
    queued_bytes_ -= std::min(queued_bytes_, event.ByteSizeLong());
    return event;
  }
  void Written(const v1::NameEvent&) override {}
  absl::Status status() const override {
    absl::MutexLock lock(&mu_);
    // Events queued before the end are still written.
    return queue_.empty() ? status_ : absl::OkStatus();
  }

 private:
  const uid_t caller_;
  const std::shared_ptr<void> slot_;
  const std::function<void()> wake_;
  mutable absl::Mutex mu_;
  std::deque<v1::NameEvent> queue_ ABSL_GUARDED_BY(mu_);
  size_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  // Declared last: destroyed first, so no event arrives during the rest.
  std::unique_ptr<Directory::Subscription> subscription_;
};

}  // namespace

grpc::ServerWriteReactor<v1::NameEvent>* ServeWatchNames(
    std::unique_ptr<ActiveCalls::Call> call, uid_t caller,
    std::shared_ptr<void> slot, Directory* directory, std::string prefix) {
  return ServeEventStream<v1::NameEvent>(
      std::move(call), "WatchNames",
      [caller, slot = std::move(slot), directory,
       prefix = std::move(prefix)](std::function<void()> wake)
          -> absl::StatusOr<std::unique_ptr<EventSource<v1::NameEvent>>> {
        auto source =
            std::make_unique<NameEventSource>(caller, slot, std::move(wake));
        NameEventSource* raw = source.get();
        auto subscription = directory->WatchNames(
            prefix, [raw](const v1::NameEvent& event) { raw->Add(event); },
            [raw](const absl::Status& status) { raw->End(status); });
        if (!subscription.ok()) return subscription.status();
        raw->set_subscription(std::move(*subscription));
        return std::unique_ptr<EventSource<v1::NameEvent>>(std::move(source));
      });
}

}  // namespace rdma_agent

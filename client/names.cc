// AgentClient::WatchNames and the NameWatch stream.
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "client/internal/client_state.h"
#include "client/rdma_agent_client.h"
#include "common/grpc_status.h"

namespace rdma_agent::client {
namespace internal {

// One WatchNames RPC read by one thread that runs the callback.
class NameStream {
 public:
  NameStream(std::shared_ptr<ClientState> state, std::string prefix,
             NameEventCallback callback)
      : state_(std::move(state)),
        prefix_(std::move(prefix)),
        callback_(std::move(callback)) {}
  ~NameStream() { Stop(); }

  void Start() {
    thread_ = std::thread([this] { Read(); });
  }

  void Stop() {
    context_.TryCancel();
    if (thread_.joinable()) thread_.join();
  }

  absl::Status WaitSynced(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto settled = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return synced_ || !status_.ok();
    };
    mu_.AwaitWithTimeout(absl::Condition(&settled), timeout);
    if (synced_) return absl::OkStatus();
    if (!status_.ok()) return status_;
    return absl::DeadlineExceededError(
        "WatchNames: the names published now were not all delivered in time");
  }

  absl::Status status() const {
    absl::MutexLock lock(&mu_);
    return status_;
  }

 private:
  void Read() {
    v1::WatchNamesRequest request;
    request.set_prefix(prefix_);
    auto reader = state_->stub().WatchNames(&context_, request);
    v1::NameEvent event;
    while (reader->Read(&event)) {
      callback_(event);
      if (event.kind() == v1::NameEvent::SYNCED) {
        absl::MutexLock lock(&mu_);
        synced_ = true;
      }
    }
    absl::Status ended = FromGrpcStatus(reader->Finish());
    if (ended.ok()) ended = absl::UnavailableError("the name stream ended");
    absl::MutexLock lock(&mu_);
    status_ = std::move(ended);
  }

  const std::shared_ptr<ClientState> state_;
  const std::string prefix_;
  NameEventCallback callback_;
  grpc::ClientContext context_;
  std::thread thread_;
  mutable absl::Mutex mu_;
  bool synced_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace internal

NameWatch::NameWatch(std::shared_ptr<internal::NameStream> stream)
    : stream_(std::move(stream)) {}
NameWatch::NameWatch(NameWatch&& other) noexcept = default;
NameWatch& NameWatch::operator=(NameWatch&& other) noexcept {
  if (this != &other) {
    Stop();
    stream_ = std::move(other.stream_);
  }
  return *this;
}
NameWatch::~NameWatch() { Stop(); }

absl::Status NameWatch::WaitSynced(absl::Duration timeout) {
  if (stream_ == nullptr) return absl::FailedPreconditionError("moved from");
  return stream_->WaitSynced(timeout);
}

void NameWatch::Stop() {
  if (stream_ != nullptr) stream_->Stop();
}

absl::Status NameWatch::status() const {
  if (stream_ == nullptr) return absl::FailedPreconditionError("moved from");
  return stream_->status();
}

absl::StatusOr<NameWatch> AgentClient::WatchNames(const std::string& prefix,
                                                  NameEventCallback on_event) {
  if (on_event == nullptr) {
    return absl::InvalidArgumentError("WatchNames needs a callback");
  }
  auto stream = std::make_shared<internal::NameStream>(state_, prefix,
                                                       std::move(on_event));
  stream->Start();
  return NameWatch(std::move(stream));
}

}  // namespace rdma_agent::client

// Asynchronous transfers of the C++ client: Transfer handles, the
// TransferWatch stream and the AgentClient calls that make them. What the
// client knows about each transfer lives in its TransferTracker
// (client/internal/transfer_tracker.h).

#include <pthread.h>

#include <algorithm>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/internal/client_state.h"
#include "client/internal/conversions.h"
#include "client/internal/transfer_tracker.h"
#include "client/rdma_agent_client.h"
#include "common/grpc_status.h"
#include "google/protobuf/duration.pb.h"
#include "grpcpp/grpcpp.h"

namespace rdma_agent::client {
namespace internal {

// One WatchTransfers stream and its two threads: the reader records each
// end the stream brings (waking Wait at once) and queues the callbacks; the
// dispatcher runs them, in the order the ends came, then the failures of
// callbacks whose end never came. No user code runs on the reader, so a slow
// callback does not hold the stream up, and a callback may Wait for another
// transfer: the reader goes on recording. Shared by its TransferWatch and
// both threads, so that a watch destroyed from its own callback lives until
// the dispatcher is done with it.
class WatchStream {
 public:
  WatchStream(std::shared_ptr<ClientState> state, TransferEndCallback on_end)
      : state_(std::move(state)), on_end_(std::move(on_end)) {}
  WatchStream(const WatchStream&) = delete;
  WatchStream& operator=(const WatchStream&) = delete;

  // Starts both threads; the client's tracker must have accepted the watch
  // (BeginWatch).
  static void Start(const std::shared_ptr<WatchStream>& self) {
    self->reader_ = std::thread([self] { self->Read(); });
    self->dispatcher_ = std::thread([self] { self->Dispatch(); });
  }

  absl::Status status() const {
    absl::MutexLock lock(&mu_);
    return status_;
  }

  void Stop() {
    {
      absl::MutexLock lock(&mu_);
      stop_asked_ = true;
    }
    // Also fine before the reader has started the call: gRPC cancels it as
    // soon as it starts.
    context_.TryCancel();
    std::lock_guard<std::mutex> joining(join_mu_);
    // The reader runs no user code: it ends promptly once cancelled.
    if (reader_.joinable()) reader_.join();
    if (!dispatcher_.joinable()) return;
    if (dispatcher_.get_id() == std::this_thread::get_id()) {
      // From a callback: the dispatcher ends once the callbacks still queued
      // (the failures included) have run.
      dispatcher_.detach();
      return;
    }
    dispatcher_.join();
  }

 private:
  // One callback to run: an end (its OnDone callback, if any, then on_end),
  // or the failure of a callback whose end will not come.
  struct Item {
    std::optional<TransferResult> end;
    TransferCallback on_done;
    absl::Status failure;
  };

  void Read() {
    // Named so that a thread list shows whose they are (15 characters at
    // most).
    pthread_setname_np(pthread_self(), "rdma-xfer-watch");
    TransferTracker& tracker = state_->transfers();
    std::unique_ptr<grpc::ClientReader<v1::TransferEvent>> reader =
        state_->stub().WatchTransfers(&context_, v1::WatchTransfersRequest());
    v1::TransferEvent event;
    while (reader->Read(&event)) {
      TransferResult end = FromProto(event.transfer());
      if (!end.ended()) continue;  // the stream carries ends only
      TransferCallback on_done = tracker.Delivered(end);
      if (on_done == nullptr && on_end_ == nullptr) continue;
      Queue(Item{std::move(end), std::move(on_done), absl::OkStatus()});
    }
    const grpc::Status finished = reader->Finish();
    TransferTracker::Orphans orphans = tracker.EndWatch();
    absl::MutexLock lock(&mu_);
    if (stop_asked_) {
      status_ = absl::CancelledError("the TransferWatch was stopped");
    } else {
      status_ = FromGrpcStatus(finished);
      if (status_.ok()) {
        status_ =
            absl::UnavailableError("the agent ended the WatchTransfers stream");
      }
    }
    for (auto& [id, callback] : orphans) {
      queue_.push_back(Item{std::nullopt, std::move(callback),
                            TransferTracker::Failure(id, status_)});
    }
    reader_done_ = true;
  }

  void Queue(Item item) {
    absl::MutexLock lock(&mu_);
    queue_.push_back(std::move(item));
  }

  void Dispatch() {
    pthread_setname_np(pthread_self(), "rdma-xfer-cb");
    while (true) {
      Item item;
      {
        absl::MutexLock lock(&mu_);
        const auto ready = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
          return !queue_.empty() || reader_done_;
        };
        mu_.Await(absl::Condition(&ready));
        if (queue_.empty()) return;  // the reader is done and so is this
        item = std::move(queue_.front());
        queue_.pop_front();
      }
      if (!item.end.has_value()) {
        std::move(item.on_done)(std::move(item.failure));
        continue;
      }
      if (item.on_done != nullptr) std::move(item.on_done)(*item.end);
      if (on_end_ != nullptr) on_end_(*item.end);
    }
  }

  const std::shared_ptr<ClientState> state_;
  TransferEndCallback on_end_;  // called by the dispatcher only
  grpc::ClientContext context_;
  mutable absl::Mutex mu_;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  bool stop_asked_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<Item> queue_ ABSL_GUARDED_BY(mu_);
  bool reader_done_ ABSL_GUARDED_BY(mu_) = false;
  std::mutex join_mu_;  // one Stop joins; the others wait for it
  std::thread reader_;
  std::thread dispatcher_;
};

}  // namespace internal

namespace {

using internal::TransferTracker;

// Longest GetTransfers long poll asked for at once; the agent cuts it to its
// --max_transfer_wait, and Wait asks again until its own timeout.
constexpr absl::Duration kLongestPoll = absl::Minutes(10);

absl::Status NotEnded(uint64_t id, absl::Duration timeout) {
  return absl::DeadlineExceededError(absl::StrCat(
      "transfer ", id, " did not end within ", absl::FormatDuration(timeout)));
}

// GetTransfers for one id, waiting at most `wait` on the agent.
absl::StatusOr<v1::Transfer> GetTransfer(internal::ClientState& state,
                                         uint64_t id, absl::Duration wait) {
  wait = std::clamp(wait, absl::ZeroDuration(), kLongestPoll);
  v1::GetTransfersRequest request;
  request.add_transfer_ids(id);
  if (wait > absl::ZeroDuration()) {
    const int64_t nanos = absl::ToInt64Nanoseconds(wait);
    request.mutable_wait()->set_seconds(nanos / 1000000000);
    request.mutable_wait()->set_nanos(static_cast<int32_t>(nanos % 1000000000));
  }
  grpc::ClientContext context;
  context.set_deadline(
      absl::ToChronoTime(absl::Now() + wait + state.options().rpc_timeout));
  v1::GetTransfersResponse response;
  const grpc::Status status =
      state.stub().GetTransfers(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  if (response.transfers_size() != 1 ||
      response.transfers(0).transfer_id() != id) {
    return absl::InternalError(absl::StrCat("GetTransfers: the agent answered ",
                                            response.transfers_size(),
                                            " transfers for transfer ", id));
  }
  return response.transfers(0);
}

}  // namespace

const char* TransferStateName(TransferState state) {
  switch (state) {
    case TransferState::kPending:
      return "PENDING";
    case TransferState::kDone:
      return "DONE";
    case TransferState::kFailed:
      return "FAILED";
    case TransferState::kCancelled:
      return "CANCELLED";
  }
  return "UNKNOWN";
}

// -------------------------------------------------------------- Transfer

Transfer::Transfer(std::shared_ptr<internal::ClientState> state,
                   std::shared_ptr<internal::TransferCore> core)
    : state_(std::move(state)), core_(std::move(core)), id_(core_->id) {}

Transfer::Transfer(Transfer&& other) noexcept
    : state_(std::move(other.state_)),
      core_(std::move(other.core_)),
      id_(std::exchange(other.id_, 0)) {}

Transfer& Transfer::operator=(Transfer&& other) noexcept {
  if (this != &other) {
    Drop();
    state_ = std::move(other.state_);
    core_ = std::move(other.core_);
    id_ = std::exchange(other.id_, 0);
  }
  return *this;
}

Transfer::~Transfer() { Drop(); }

void Transfer::Drop() {
  if (core_ != nullptr) state_->transfers().Close(core_);
  core_.reset();
  state_.reset();
}

absl::Status Transfer::CheckUsable() const {
  if (core_ == nullptr) {
    return absl::FailedPreconditionError("this Transfer handle was moved from");
  }
  return absl::OkStatus();
}

absl::StatusOr<TransferResult> Transfer::Wait(absl::Duration timeout) {
  if (absl::Status usable = CheckUsable(); !usable.ok()) return usable;
  TransferTracker& tracker = state_->transfers();
  const absl::Time deadline = timeout == absl::InfiniteDuration()
                                  ? absl::InfiniteFuture()
                                  : absl::Now() + timeout;
  bool asked = false;
  while (true) {
    if (std::optional<TransferResult> end = tracker.End(*core_)) return *end;
    // A watch delivers the end of an id the agent has confirmed: no RPC.
    if (tracker.WatchServes() && tracker.Confirmed(*core_)) {
      TransferResult end;
      switch (tracker.AwaitEnd(*core_, deadline, &end)) {
        case TransferTracker::Awaited::kEnded:
          return end;
        case TransferTracker::Awaited::kTimedOut:
          return NotEnded(id_, timeout);
        case TransferTracker::Awaited::kNoWatch:
          continue;  // the watch stopped: ask the agent
      }
    }
    if (asked && absl::Now() >= deadline) return NotEnded(id_, timeout);
    // With a watch, only to learn that the agent knows the id.
    const absl::Duration wait =
        tracker.WatchServes() ? absl::ZeroDuration() : deadline - absl::Now();
    absl::StatusOr<v1::Transfer> transfer = GetTransfer(*state_, id_, wait);
    asked = true;
    // NOT_FOUND means what it says: the agent's streams never take an end
    // from it, so the client's own watch cannot have one in transit.
    if (!transfer.ok()) return transfer.status();
    if (transfer->state() != v1::TRANSFER_STATE_PENDING) {
      return tracker.Resolve(core_, internal::FromProto(*transfer));
    }
    tracker.Confirm(*core_);
  }
}

absl::StatusOr<TransferResult> Transfer::Poll() {
  if (absl::Status usable = CheckUsable(); !usable.ok()) return usable;
  TransferTracker& tracker = state_->transfers();
  if (std::optional<TransferResult> end = tracker.End(*core_)) return *end;
  absl::StatusOr<v1::Transfer> transfer =
      GetTransfer(*state_, id_, absl::ZeroDuration());
  if (!transfer.ok()) return transfer.status();
  TransferResult result = internal::FromProto(*transfer);
  if (result.ended()) return tracker.Resolve(core_, std::move(result));
  tracker.Confirm(*core_);
  return result;
}

absl::StatusOr<TransferResult> Transfer::Cancel() {
  if (absl::Status usable = CheckUsable(); !usable.ok()) return usable;
  TransferTracker& tracker = state_->transfers();
  // Ended: another reader may have read it since, and there is nothing to
  // stop.
  if (std::optional<TransferResult> end = tracker.End(*core_)) return *end;
  grpc::ClientContext context;
  state_->PrepareContext(&context);
  v1::CancelTransferRequest request;
  request.set_transfer_id(id_);
  v1::CancelTransferResponse response;
  const grpc::Status status =
      state_->stub().CancelTransfer(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  TransferResult result = internal::FromProto(response.transfer());
  if (!result.ended()) {
    return absl::InternalError(absl::StrCat(
        "CancelTransfer: the agent answered transfer ", id_, " as PENDING"));
  }
  return tracker.Resolve(core_, std::move(result));
}

absl::Status Transfer::OnDone(TransferCallback callback) {
  if (absl::Status usable = CheckUsable(); !usable.ok()) return usable;
  if (callback == nullptr) {
    return absl::InvalidArgumentError("OnDone: the callback is empty");
  }
  return state_->transfers().SetOnDone(core_, std::move(callback));
}

// --------------------------------------------------------- TransferWatch

TransferWatch::TransferWatch(std::shared_ptr<internal::WatchStream> stream)
    : stream_(std::move(stream)) {}

TransferWatch::TransferWatch(TransferWatch&& other) noexcept = default;

TransferWatch& TransferWatch::operator=(TransferWatch&& other) noexcept {
  if (this != &other) {
    Stop();
    stream_ = std::move(other.stream_);
  }
  return *this;
}

TransferWatch::~TransferWatch() { Stop(); }

absl::Status TransferWatch::status() const {
  if (stream_ == nullptr) {
    return absl::FailedPreconditionError(
        "this TransferWatch handle was moved from");
  }
  return stream_->status();
}

void TransferWatch::Stop() {
  if (stream_ != nullptr) stream_->Stop();
}

// ----------------------------------------------------------- AgentClient

absl::StatusOr<Transfer> AgentClient::SubmitAsync(
    const std::vector<OpSpec>& ops, absl::Duration timeout) {
  SubmitOptions options;
  options.timeout = timeout;
  return SubmitAsync(ops, options);
}

absl::StatusOr<Transfer> AgentClient::SubmitAsync(
    const std::vector<OpSpec>& ops, const SubmitOptions& options) {
  v1::SubmitRequest request = internal::SubmitRequestFor(ops, options.timeout);
  request.set_notification(options.notification);
  return SendSubmitAsync(request);
}

absl::StatusOr<Transfer> AgentClient::SubmitPreparedAsync(
    uint64_t prepared_id, const SubmitOptions& options) {
  v1::SubmitRequest request;
  request.set_prepared_id(prepared_id);
  internal::SetTimeout(options.timeout, request);
  request.set_notification(options.notification);
  return SendSubmitAsync(request);
}

absl::StatusOr<Transfer> AgentClient::SendSubmitAsync(
    const v1::SubmitRequest& request) {
  grpc::ClientContext context;
  state_->PrepareContext(&context);
  v1::SubmitAsyncResponse response;
  TransferTracker& tracker = state_->transfers();
  // Taken before the request leaves: the watch may deliver the end before
  // the answer arrives.
  const uint64_t ticket = tracker.BeginSubmit();
  const grpc::Status status =
      state_->stub().SubmitAsync(&context, request, &response);
  std::shared_ptr<internal::TransferCore> core = tracker.EndSubmit(
      ticket, status.ok() ? std::optional<uint64_t>(response.transfer_id())
                          : std::nullopt);
  if (!status.ok()) return FromGrpcStatus(status);
  return Transfer(state_, std::move(core));
}

Transfer AgentClient::TransferById(uint64_t transfer_id) {
  return Transfer(state_, state_->transfers().Open(transfer_id));
}

absl::StatusOr<TransferWatch> AgentClient::WatchTransfers(
    TransferEndCallback on_end) {
  if (absl::Status accepted = state_->transfers().BeginWatch();
      !accepted.ok()) {
    return accepted;
  }
  auto stream =
      std::make_shared<internal::WatchStream>(state_, std::move(on_end));
  internal::WatchStream::Start(stream);
  return TransferWatch(std::move(stream));
}

}  // namespace rdma_agent::client

#ifndef RDMA_AGENTD_DAEMON_API_WAITING_RPCS_H_
#define RDMA_AGENTD_DAEMON_API_WAITING_RPCS_H_

// RPCs that wait without holding a thread: a server stream that pushes
// events as they happen (WatchTransfers) and a long poll (GetTransfers with
// `wait`), served with gRPC's callback API while the rest of the service
// stays synchronous. Each is a self-owned gRPC reactor that
//
// - holds the call's admission (ActiveCalls::StartWaiting) until gRPC is
//   done with the call (OnDone), so a slot is free again only once the call
//   has really ended;
// - is woken by whoever produces its events (a table's callback), by gRPC
//   (the client cancelled or went away: OnCancel, at once, no polling), by a
//   grpc::Alarm (a long poll's deadline: a gRPC timer, no thread), and by the
//   admission's Cancellation (agent shutdown, ActiveCalls::CancelAll);
// - ends with the first reason it gets, exactly once.
//
// The service provides the source (what to write or answer) and does the
// admission and request checks; daemon/transfer_rpcs.h has the transfer
// sources. Everything here runs on gRPC's callback threads or on the
// producer's thread, briefly, under the reactor's own lock; sources are
// called under that lock, so they must not call back into the reactor.

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "common/status_util.h"
#include "common/stop_token.h"
#include "daemon/limits/active_calls.h"
#include "google/protobuf/duration.pb.h"
#include "grpcpp/alarm.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/server_callback.h"

namespace rdma_agent {

// The events of one server stream.
template <typename Event>
class EventSource {
 public:
  virtual ~EventSource() = default;
  // The next event to write, taken from the source; nullopt when none is
  // ready now (the source wakes the stream when one is).
  virtual std::optional<Event> Next() = 0;
  // `event`, returned by Next, has been handed to the client's stream.
  virtual void Written(const Event& event) = 0;
  // OK while the stream may go on; otherwise it ends now, with this status.
  virtual absl::Status status() const = 0;
};

// What a long poll answers.
template <typename Response>
class PollSource {
 public:
  virtual ~PollSource() = default;
  // True once the answer need not wait any longer.
  virtual bool settled() const = 0;
  // Fills `response` with the answer as it is now; the call's status.
  // Called at most once, and only for an answer the client is sent.
  virtual absl::Status Answer(Response* response) = 0;
};

// Makes a source; `wake` is what the source calls (from any thread, without
// its own locks held) when there is something new: an event, the poll
// settled, the source closed.
template <typename Source>
using SourceOpener = std::function<absl::StatusOr<std::unique_ptr<Source>>(
    std::function<void()> wake)>;

// A server-streaming RPC refused before it started: ends at once with
// `status`.
template <typename Event>
grpc::ServerWriteReactor<Event>* RefuseStream(const absl::Status& status);

// A long poll's requested `wait` (null: none), cut to `max_wait` (a longer
// wait simply polls again); INVALID_ARGUMENT when malformed.
absl::StatusOr<absl::Duration> LongPollWait(
    const google::protobuf::Duration* wait, absl::Duration max_wait);

// A unary callback RPC refused before it started.
grpc::ServerUnaryReactor* RefuseUnary(grpc::CallbackServerContext* context,
                                      const absl::Status& status);

// Serves one server stream from the source `open` makes: writes each event
// as the source has it, one write in flight at a time, until the client
// cancels (CANCELLED), the source ends it (its status) or `call` is
// cancelled (its reason: UNAVAILABLE at shutdown). Errors are prefixed with
// `rpc`. Returns the reactor to hand to gRPC; it deletes itself.
template <typename Event>
grpc::ServerWriteReactor<Event>* ServeEventStream(
    std::unique_ptr<ActiveCalls::Call> call, std::string rpc,
    const SourceOpener<EventSource<Event>>& open);

// Serves one unary RPC that may wait: answers (PollSource::Answer) once the
// source is settled or at `deadline`, whichever comes first; without an
// answer when the client cancels (CANCELLED) or `call` is cancelled (its
// reason). `response` is gRPC's, valid until the call is done.
template <typename Response>
grpc::ServerUnaryReactor* ServeLongPoll(
    std::unique_ptr<ActiveCalls::Call> call, std::string rpc,
    absl::Time deadline, Response* response,
    const SourceOpener<PollSource<Response>>& open);

// ------------------------------------------------------- implementation

namespace waiting_rpcs_internal {

template <typename Event>
class RefusedStream final : public grpc::ServerWriteReactor<Event> {
 public:
  explicit RefusedStream(const absl::Status& status) {
    this->Finish(ToGrpcStatus(status));
  }
  void OnDone() override { delete this; }
};

template <typename Event>
class EventStream final : public grpc::ServerWriteReactor<Event> {
 public:
  EventStream(std::unique_ptr<ActiveCalls::Call> call, std::string rpc)
      : call_(std::move(call)), rpc_(std::move(rpc)) {}

  void Begin(const SourceOpener<EventSource<Event>>& open) {
    // May run at once, on this thread, if the agent is already stopping.
    on_shutdown_ = call_->cancellation().OnCancel([this] {
      absl::MutexLock lock(&mu_);
      EndLocked(call_->cancellation().reason());
    });
    auto source = open([this] { Wake(); });
    absl::MutexLock lock(&mu_);
    if (!source.ok()) {
      EndLocked(source.status());
      return;
    }
    source_ = std::move(*source);
    PumpLocked();
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) {
      // The call is being cancelled or the client is gone: nothing more can
      // be written.
      EndLocked(ending_.value_or(absl::CancelledError("the client went away")));
      return;
    }
    source_->Written(event_);
    if (ending_.has_value()) {
      EndLocked(*ending_);
      return;
    }
    PumpLocked();
  }

  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    EndLocked(absl::CancelledError("the client cancelled the stream"));
  }

  void OnDone() override {
    // Revoked first (each waits for a callback running elsewhere), then the
    // admission goes: the slot is free only now that gRPC is done.
    on_shutdown_.reset();
    std::unique_ptr<EventSource<Event>> source;
    {
      absl::MutexLock lock(&mu_);
      source = std::move(source_);
    }
    source.reset();
    call_.reset();
    delete this;
  }

 private:
  void Wake() {
    absl::MutexLock lock(&mu_);
    PumpLocked();
  }

  // Starts the next write, or ends the stream when the source says so.
  void PumpLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || writing_ || ending_.has_value() || source_ == nullptr) {
      return;
    }
    if (absl::Status status = source_->status(); !status.ok()) {
      EndLocked(status);
      return;
    }
    std::optional<Event> next = source_->Next();
    if (!next.has_value()) return;
    event_ = std::move(*next);
    writing_ = true;
    this->StartWrite(&event_);
  }

  // Finishes with `why` (the first reason wins); after the write in flight,
  // if any: gRPC wants one operation of a kind at a time, and a write ends
  // promptly once the call is cancelled.
  void EndLocked(const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    if (writing_) {
      if (!ending_.has_value()) ending_ = why;
      return;
    }
    finished_ = true;
    this->Finish(ToGrpcStatus(Prefixed(why, rpc_)));
  }

  std::unique_ptr<ActiveCalls::Call> call_;
  const std::string rpc_;
  std::unique_ptr<Cancellation::Callback> on_shutdown_;
  absl::Mutex mu_;
  std::unique_ptr<EventSource<Event>> source_ ABSL_GUARDED_BY(mu_);
  Event event_ ABSL_GUARDED_BY(mu_);  // the write in flight
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<absl::Status> ending_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

template <typename Response>
class LongPoll final : public grpc::ServerUnaryReactor {
 public:
  LongPoll(std::unique_ptr<ActiveCalls::Call> call, std::string rpc,
           Response* response)
      : call_(std::move(call)), rpc_(std::move(rpc)), response_(response) {}

  void Begin(absl::Time deadline,
             const SourceOpener<PollSource<Response>>& open) {
    on_shutdown_ = call_->cancellation().OnCancel([this] {
      absl::MutexLock lock(&mu_);
      EndLocked(call_->cancellation().reason());
    });
    auto source = open([this] {
      absl::MutexLock lock(&mu_);
      AnswerLocked();
    });
    absl::MutexLock lock(&mu_);
    if (!source.ok()) {
      EndLocked(source.status());
      return;
    }
    source_ = std::move(*source);
    if (finished_) return;
    if (source_->settled() || deadline <= absl::Now()) {
      AnswerLocked();
      return;
    }
    // A gRPC timer, not a thread. Its callback always runs once (with
    // false when cancelled), so the reactor outlives it: see OnDone.
    alarm_pending_ = true;
    alarm_.Set(absl::ToChronoTime(deadline), [this](bool) { OnAlarm(); });
  }

  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    EndLocked(absl::CancelledError("the client cancelled the call"));
  }

  void OnDone() override {
    on_shutdown_.reset();
    std::unique_ptr<PollSource<Response>> source;
    {
      absl::MutexLock lock(&mu_);
      source = std::move(source_);
    }
    source.reset();
    call_.reset();
    bool last;
    {
      absl::MutexLock lock(&mu_);
      done_ = true;
      last = !alarm_pending_;
    }
    if (last) delete this;
  }

 private:
  void OnAlarm() {
    bool last;
    {
      absl::MutexLock lock(&mu_);
      AnswerLocked();  // the deadline (nothing, if it was cancelled)
      alarm_pending_ = false;
      last = done_;
    }
    if (last) delete this;
  }

  void AnswerLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || source_ == nullptr) return;
    EndLocked(source_->Answer(response_));
  }

  void EndLocked(const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    finished_ = true;
    if (alarm_pending_) alarm_.Cancel();
    Finish(ToGrpcStatus(Prefixed(why, rpc_)));
  }

  std::unique_ptr<ActiveCalls::Call> call_;
  const std::string rpc_;
  Response* const response_;
  std::unique_ptr<Cancellation::Callback> on_shutdown_;
  grpc::Alarm alarm_;
  absl::Mutex mu_;
  std::unique_ptr<PollSource<Response>> source_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool alarm_pending_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace waiting_rpcs_internal

template <typename Event>
grpc::ServerWriteReactor<Event>* RefuseStream(const absl::Status& status) {
  return new waiting_rpcs_internal::RefusedStream<Event>(status);
}

template <typename Event>
grpc::ServerWriteReactor<Event>* ServeEventStream(
    std::unique_ptr<ActiveCalls::Call> call, std::string rpc,
    const SourceOpener<EventSource<Event>>& open) {
  auto* stream = new waiting_rpcs_internal::EventStream<Event>(std::move(call),
                                                               std::move(rpc));
  stream->Begin(open);
  return stream;
}

template <typename Response>
grpc::ServerUnaryReactor* ServeLongPoll(
    std::unique_ptr<ActiveCalls::Call> call, std::string rpc,
    absl::Time deadline, Response* response,
    const SourceOpener<PollSource<Response>>& open) {
  auto* poll = new waiting_rpcs_internal::LongPoll<Response>(
      std::move(call), std::move(rpc), response);
  poll->Begin(deadline, open);
  return poll;
}

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_API_WAITING_RPCS_H_

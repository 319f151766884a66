#include "client/ring.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/internal/attach_socket.h"
#include "common/status_util.h"
#include "rdma/agent/v1/attach.pb.h"

namespace rdma_agent::client {

namespace v1 = ::rdma::agent::v1;

absl::StatusOr<std::unique_ptr<Ring>> Ring::Open(
    const std::string& attach_socket, uint32_t entries,
    absl::Duration timeout) {
  v1::AttachRequest request;
  request.mutable_open_ring()->set_entries(entries);
  auto reply =
      internal::ExchangeOnAttachSocket(attach_socket, request, -1, timeout,
                                       /*keep_connection=*/true);
  if (!reply.ok()) return reply.status();
  if (absl::Status status = internal::ResponseStatus(reply->response);
      !status.ok()) {
    return status;
  }
  if (!reply->fd) {
    return absl::InternalError("open ring: the agent sent no memfd");
  }
  auto memory = SharedMemory::Adopt(std::move(reply->fd));
  if (!memory.ok()) return memory.status();
  // The agent's header is checked before any of it is trusted.
  auto geometry = ring::ReadHeader(memory->data(), memory->size());
  if (!geometry.ok()) return Prefixed(geometry.status(), "open ring");
  if (geometry->entries != entries) {
    return absl::InternalError(absl::StrCat(
        "open ring: asked for ", entries, " entries, got ", geometry->entries));
  }
  return std::unique_ptr<Ring>(
      new Ring(std::move(reply->connection), std::move(*memory), *geometry));
}

Ring::Ring(UniqueFd connection, SharedMemory memory, ring::Geometry geometry)
    : connection_(std::move(connection)),
      memory_(std::move(memory)),
      geometry_(geometry) {}

void Ring::Doorbell() {
  const char byte = 1;
  (void)::send(connection_.get(), &byte, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
}

void Ring::CheckEnded() {
  if (!ended_.ok()) return;
  if ((Word(ring::kAgentFlagsOffset).load(std::memory_order_acquire) &
       ring::kAgentStopped) != 0) {
    char reason[ring::kStopReasonBytes];
    std::memcpy(reason, memory_.data() + ring::kStopReasonOffset,
                sizeof(reason));
    reason[sizeof(reason) - 1] = '\0';
    ended_ = absl::FailedPreconditionError(
        absl::StrCat("the agent stopped this ring: ", reason));
    return;
  }
  char bytes[64];
  for (;;) {
    const ssize_t n =
        ::recv(connection_.get(), bytes, sizeof(bytes), MSG_DONTWAIT);
    if (n > 0) continue;
    if (n < 0 && errno == EINTR) continue;
    if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) {
      ended_ = absl::UnavailableError(
          "the agent closed this ring's session (it stopped or restarted)");
    }
    return;
  }
}

absl::Status Ring::Submit(absl::Span<const RingOp> ops,
                          absl::Duration timeout) {
  CheckEnded();
  if (!ended_.ok()) return ended_;
  if (ops.empty()) {
    return absl::InvalidArgumentError("ring: the op batch is empty");
  }
  const uint32_t head =
      Word(ring::kSqHeadOffset).load(std::memory_order_acquire);
  const uint32_t free = geometry_.entries - (sq_tail_ - head);
  if (ops.size() > free || in_flight() + ops.size() > geometry_.entries) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "ring: ", ops.size(), " ops do not fit; ", in_flight(), " of ",
        geometry_.entries, " slots are in flight (reap completions)"));
  }
  const int64_t ms = absl::ToInt64Milliseconds(timeout);
  const uint32_t timeout_ms =
      static_cast<uint32_t>(std::clamp<int64_t>(ms, 0, UINT32_MAX));
  for (size_t i = 0; i < ops.size(); ++i) {
    ring::Submission entry;
    entry.opcode = static_cast<uint8_t>(ops[i].type);
    entry.flags = i + 1 == ops.size() ? ring::kEndOfBatch : 0;
    entry.timeout_ms = timeout_ms;
    entry.user_tag = ops[i].user_tag;
    entry.local_buffer_id = ops[i].local_buffer_id;
    entry.local_offset = ops[i].local_offset;
    entry.length = ops[i].length;
    entry.remote_handle = ops[i].remote_handle;
    entry.remote_offset = ops[i].remote_offset;
    std::memcpy(memory_.data() + geometry_.submissions_offset +
                    uint64_t{(sq_tail_ + i) & geometry_.mask()} *
                        ring::kSubmissionBytes,
                &entry, sizeof(entry));
  }
  sq_tail_ += static_cast<uint32_t>(ops.size());
  Word(ring::kSqTailOffset).store(sq_tail_, std::memory_order_seq_cst);
  if ((Word(ring::kAgentFlagsOffset).load(std::memory_order_seq_cst) &
       ring::kAgentNeedsWakeup) != 0) {
    Doorbell();
  }
  return absl::OkStatus();
}

size_t Ring::Reap(std::vector<RingCompletion>* out, size_t max) {
  const uint32_t tail =
      Word(ring::kCqTailOffset).load(std::memory_order_acquire);
  size_t reaped = 0;
  std::string message;
  while (cq_head_ != tail && reaped < max) {
    const ring::Completion completion =
        ring::ReadCompletion(memory_.data(), geometry_, cq_head_, &message);
    RingCompletion& end = out->emplace_back();
    end.user_tag = completion.user_tag;
    end.status = completion.code == 0
                     ? absl::OkStatus()
                     : absl::Status(static_cast<absl::StatusCode>(
                                        std::clamp(completion.code, 1, 16)),
                                    message);
    end.backend = ring::BackendName(completion.backend);
    ++cq_head_;
    ++reaped;
  }
  if (reaped > 0) {
    Word(ring::kCqHeadOffset).store(cq_head_, std::memory_order_seq_cst);
    // An agent asleep with a batch waiting for completion room goes on.
    if ((Word(ring::kAgentFlagsOffset).load(std::memory_order_seq_cst) &
         ring::kAgentNeedsWakeup) != 0 &&
        sq_tail_ != Word(ring::kSqHeadOffset).load()) {
      Doorbell();
    }
  }
  return reaped;
}

absl::StatusOr<size_t> Ring::Poll(std::vector<RingCompletion>* out,
                                  size_t max) {
  const size_t reaped = Reap(out, max);
  if (reaped > 0) return reaped;
  CheckEnded();
  if (!ended_.ok()) return ended_;
  return 0;
}

absl::StatusOr<size_t> Ring::Wait(std::vector<RingCompletion>* out,
                                  absl::Duration timeout, absl::Duration spin) {
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + timeout;
  for (;;) {
    auto reaped = Poll(out);
    if (!reaped.ok() || *reaped > 0) return reaped;
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "ring: no completion within ", absl::FormatDuration(timeout)));
    }
    if (now - start < spin) continue;
    // Block: WAITING first, then one more look, then the doorbell.
    Word(ring::kClientFlagsOffset).fetch_or(ring::kClientWaiting);
    if (Word(ring::kCqTailOffset).load() != cq_head_) continue;
    struct pollfd pfd = {connection_.get(), POLLIN, 0};
    const int64_t left = absl::ToInt64Milliseconds(deadline - now) + 1;
    (void)::poll(&pfd, 1, static_cast<int>(std::clamp<int64_t>(left, 1, 1000)));
  }
}

}  // namespace rdma_agent::client

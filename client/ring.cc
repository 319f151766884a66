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

absl::Status Ring::CheckRoom(size_t count) {
  CheckEnded();
  if (!ended_.ok()) return ended_;
  const uint32_t head =
      Word(ring::kSqHeadOffset).load(std::memory_order_acquire);
  const uint32_t free = geometry_.entries - (sq_tail_ - head);
  if (count > free || in_flight() + count > geometry_.entries) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "ring: ", count, " entries do not fit; ", in_flight(), " of ",
        geometry_.entries, " slots are in flight (reap completions)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> Ring::PlacePayload(uint32_t index,
                                            absl::string_view notification) {
  if (notification.empty()) return 0;
  // Payloads of entries the agent has taken are free again.
  const uint32_t head =
      Word(ring::kSqHeadOffset).load(std::memory_order_acquire);
  while (!payloads_.empty() &&
         static_cast<int32_t>(head - payloads_.front().index) > 0) {
    payloads_.pop_front();
  }
  const uint64_t area = geometry_.payload_area_bytes();
  const uint64_t offset = payloads_.empty() ? 0 : payloads_.back().end;
  if (notification.size() > area - offset) {
    return absl::ResourceExhaustedError(
        absl::StrCat("ring: no room for a notification of ",
                     notification.size(), " bytes in the payload area of ",
                     area, " bytes until the agent takes the earlier ones"));
  }
  std::memcpy(memory_.data() + geometry_.payloads_offset + offset,
              notification.data(), notification.size());
  payloads_.push_back({index, offset + notification.size()});
  return offset | (uint64_t{notification.size()} << 32);
}

void Ring::Post(absl::Span<const ring::Submission> entries) {
  for (size_t i = 0; i < entries.size(); ++i) {
    std::memcpy(memory_.data() + geometry_.submissions_offset +
                    uint64_t{(sq_tail_ + i) & geometry_.mask()} *
                        ring::kSubmissionBytes,
                &entries[i], sizeof(entries[i]));
  }
  sq_tail_ += static_cast<uint32_t>(entries.size());
  Word(ring::kSqTailOffset).store(sq_tail_, std::memory_order_seq_cst);
  if ((Word(ring::kAgentFlagsOffset).load(std::memory_order_seq_cst) &
       ring::kAgentNeedsWakeup) != 0) {
    Doorbell();
  }
}

namespace {

uint32_t TimeoutMs(absl::Duration timeout) {
  const int64_t ms = absl::ToInt64Milliseconds(timeout);
  return static_cast<uint32_t>(std::clamp<int64_t>(ms, 0, UINT32_MAX));
}

}  // namespace

absl::Status Ring::Submit(absl::Span<const RingOp> ops, absl::Duration timeout,
                          absl::string_view notification) {
  if (ops.empty()) {
    CheckEnded();
    if (!ended_.ok()) return ended_;
    return absl::InvalidArgumentError("ring: the op batch is empty");
  }
  if (absl::Status room = CheckRoom(ops.size()); !room.ok()) return room;
  const uint32_t last = sq_tail_ + static_cast<uint32_t>(ops.size()) - 1;
  auto payload = PlacePayload(last, notification);
  if (!payload.ok()) return payload.status();
  entries_.assign(ops.size(), ring::Submission());
  for (size_t i = 0; i < ops.size(); ++i) {
    ring::Submission& entry = entries_[i];
    entry.opcode = static_cast<uint8_t>(ops[i].type);
    entry.timeout_ms = TimeoutMs(timeout);
    entry.user_tag = ops[i].user_tag;
    entry.local_buffer_id = ops[i].local_buffer_id;
    entry.local_offset = ops[i].local_offset;
    entry.length = ops[i].length;
    entry.remote_handle = ops[i].remote_handle;
    entry.remote_offset = ops[i].remote_offset;
  }
  entries_.back().flags = ring::kEndOfBatch;
  if (!notification.empty()) {
    entries_.back().flags |= ring::kNotify;
    entries_.back().notification = *payload;
  }
  Post(entries_);
  return absl::OkStatus();
}

absl::Status Ring::RunPrepared(uint64_t prepared_id, uint64_t user_tag,
                               absl::Duration timeout,
                               absl::string_view notification) {
  if (absl::Status room = CheckRoom(1); !room.ok()) return room;
  auto payload = PlacePayload(sq_tail_, notification);
  if (!payload.ok()) return payload.status();
  ring::Submission entry;
  entry.opcode = ring::kOpRunPrepared;
  entry.flags = ring::kEndOfBatch;
  entry.timeout_ms = TimeoutMs(timeout);
  entry.user_tag = user_tag;
  entry.remote_handle = prepared_id;
  if (!notification.empty()) {
    entry.flags |= ring::kNotify;
    entry.notification = *payload;
  }
  Post(absl::MakeConstSpan(&entry, 1));
  return absl::OkStatus();
}

absl::Status Ring::Cancel(uint64_t tag, uint64_t user_tag) {
  if (absl::Status room = CheckRoom(1); !room.ok()) return room;
  ring::Submission entry;
  entry.opcode = ring::kOpCancel;
  entry.flags = ring::kEndOfBatch;
  entry.user_tag = user_tag;
  entry.remote_handle = tag;
  Post(absl::MakeConstSpan(&entry, 1));
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

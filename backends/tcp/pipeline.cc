#include "backends/tcp/pipeline.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_util.h"

namespace rdma_agent::tcp {
namespace {

// How far past the deadline a blocking send or receive may end (see
// Pipeline::ArmTimeout).
constexpr absl::Duration kTimeoutSlack = absl::Milliseconds(2);

// Most iovecs handed to one sendmsg.
constexpr int kMaxIov = 192;

}  // namespace

Pipeline::Pipeline(ChunkSource& source, int max_in_flight,
                   uint64_t in_flight_bytes,
                   std::atomic<uint64_t>& next_request_id,
                   absl::string_view peer, bool zero_copy_send,
                   absl::Duration no_progress_timeout)
    : zero_copy_send_(zero_copy_send),
      no_progress_timeout_(no_progress_timeout),
      source_(source),
      max_in_flight_(static_cast<size_t>(std::max(1, max_in_flight))),
      in_flight_bytes_(in_flight_bytes),
      next_request_id_(next_request_id),
      peer_(peer) {}

void Pipeline::ArmTimeout(bool receive, absl::Duration left) {
  absl::Duration& armed = armed_[receive ? 1 : 0];
  if (armed <= left + kTimeoutSlack) return;
  SetIoTimeout(fd_, receive, left);
  armed = left;
}

void Pipeline::Restart(int fd, absl::Duration* armed) {
  fd_ = fd;
  armed_ = armed;
  sent_ = 0;
  send_pos_ = 0;
  phase_ = Phase::kHeader;
  got_ = 0;
  io_.Reset(fd);   // drops what was buffered from the previous connection
  pages_.reset();  // it may hold bytes of the previous connection
}

PipelineOutcome Pipeline::Run(absl::Time deadline) {
  nonblocking_ = false;
  PipelineOutcome outcome;
  // A peer that takes nothing and sends nothing for no_progress_timeout_
  // is stuck (or hostile): the lane gives up long before a long deadline,
  // so the op fails UNAVAILABLE and its thread goes back to other work.
  absl::Time last_progress = absl::Now();
  while (!window_.empty() || Refill()) {
    const absl::Time stall = last_progress + no_progress_timeout_;
    const bool stall_first =
        no_progress_timeout_ > absl::ZeroDuration() && stall < deadline;
    const absl::Time step = stall_first ? stall : deadline;
    bool progress = false;
    bool want_write = false;
    bool want_read = false;
    absl::Status status = Send(step, &progress, &want_write);
    if (status.ok()) status = Receive(step, &progress, &want_read);
    if (progress) last_progress = absl::Now();
    if (!status.ok()) {
      if (stall_first && absl::IsDeadlineExceeded(status) && !progress) {
        status = absl::UnavailableError(NoProgressMessage());
      }
      return Ended(status, outcome);
    }
    if (window_.empty() && !Refill()) break;
    const bool stalls_first = no_progress_timeout_ > absl::ZeroDuration() &&
                              last_progress + no_progress_timeout_ < deadline;
    const absl::Duration left =
        (stalls_first ? last_progress + no_progress_timeout_ : deadline) -
        absl::Now();
    if (left <= absl::ZeroDuration()) {
      return Ended(stalls_first
                       ? absl::UnavailableError(NoProgressMessage())
                       : absl::DeadlineExceededError(DeadlineMessage()),
                   outcome);
    }
    if (progress || (!want_read && !want_write)) continue;
    pollfd p{fd_, static_cast<short>(POLLIN | (want_write ? POLLOUT : 0)), 0};
    const timespec timeout = absl::ToTimespec(left);
    if (ppoll(&p, 1, &timeout, nullptr) < 0 && errno != EINTR) {
      return Ended(
          absl::UnavailableError(absl::StrCat("poll: ", std::strerror(errno))),
          outcome);
    }
  }
  if (io_.buffered() > 0) {
    // Bytes nobody asked for: the stream is in an unknown state.
    return Ended(ProtocolError("unsolicited bytes after the last response"),
                 outcome);
  }
  outcome.healthy = true;
  outcome.answered = answered_;
  return outcome;
}

Pipeline::Wait Pipeline::Pump(PipelineOutcome& outcome) {
  nonblocking_ = true;
  // Again only while answers come in: they may open the window to more
  // requests, or end the lane. (Sending alone does not make an answer
  // arrive sooner than the socket says so.)
  bool received = true;
  bool want_write = false;
  while (received) {
    bool sent = false;
    received = false;
    want_write = false;
    bool want_read = false;
    // Neither call waits: the deadline is the caller's.
    absl::Status status = Send(absl::InfiniteFuture(), &sent, &want_write);
    if (status.ok()) {
      status = Receive(absl::InfiniteFuture(), &received, &want_read);
    }
    if (!status.ok()) {
      Ended(status, outcome);
      return Wait::kNone;
    }
    if (window_.empty() && !Refill()) {
      if (io_.buffered() > 0) {
        Ended(ProtocolError("unsolicited bytes after the last response"),
              outcome);
        return Wait::kNone;
      }
      outcome.healthy = true;
      outcome.answered = answered_;
      return Wait::kNone;
    }
  }
  return want_write ? Wait::kReadableOrWritable : Wait::kReadable;
}

Pipeline::InFlight& Pipeline::Window::emplace_back() {
  if (size_ == slots_.size()) {
    std::vector<InFlight> larger(std::max<size_t>(16, slots_.size() * 2));
    for (size_t i = 0; i < size_; ++i) larger[i] = (*this)[i];
    slots_.swap(larger);
    mask_ = slots_.size() - 1;
    head_ = 0;
  }
  InFlight& slot = (*this)[size_++];
  slot = InFlight();
  return slot;
}

void Pipeline::FailWindow(const absl::Status& status) {
  for (size_t i = 0; i < window_.size(); ++i) {
    source_.ChunkDone(window_[i].chunk, status);
  }
  window_.clear();
  window_bytes_ = 0;
  sent_ = 0;
  send_pos_ = 0;
}

bool Pipeline::Refill() {
  Chunk chunk;
  while (WindowHasRoom() && source_.NextChunk(&chunk)) {
    InFlight& request = window_.emplace_back();
    request.chunk = chunk;
    window_bytes_ += chunk.length;
    RequestHeader header;
    header.kind = chunk.kind;
    header.request_id = request.id = next_request_id_.fetch_add(1);
    header.epoch = chunk.remote->agent_epoch();
    header.buffer_id = chunk.remote->buffer_id();
    header.offset = chunk.remote_offset;
    header.length = chunk.length;
    header.token_bytes = static_cast<uint32_t>(chunk.remote->token().size());
    EncodeRequestHeader(header, request.header.data());
  }
  return !window_.empty();
}

bool Pipeline::WindowHasRoom() const {
  return window_.size() < max_in_flight_ ||
         (window_bytes_ < in_flight_bytes_ &&
          window_.size() < kMaxRequestsInFlight);
}

size_t Pipeline::RequestBytes(size_t i) const {
  const Chunk& c = chunk(i);
  return kRequestHeaderBytes + c.remote->token().size() +
         (c.kind == RequestKind::kWrite ? c.length : 0);
}

bool Pipeline::CanSend() {
  Refill();
  return sent_ < window_.size();
}

bool Pipeline::ReadOutstanding() const {
  const size_t end = std::min(window_.size(), sent_ + 1);
  for (size_t i = 0; i < end; ++i) {
    if (chunk(i).kind == RequestKind::kRead && (i < sent_ || send_pos_ > 0)) {
      return true;
    }
  }
  return false;
}

absl::Status Pipeline::Send(absl::Time deadline, bool* progress,
                            bool* want_write) {
  while (CanSend()) {
    const bool block = !nonblocking_ && !ReadOutstanding();
    if (block && Spliceable(sent_)) {
      if (absl::Status status = SendSpliced(deadline, progress); !status.ok()) {
        return status;
      }
      continue;
    }
    iovec iov[kMaxIov];
    const int count = GatherRequests(block, iov);
    msghdr message{};
    message.msg_iov = iov;
    message.msg_iovlen = static_cast<size_t>(count);
    if (block) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) return absl::OkStatus();
      ArmTimeout(/*receive=*/false, left);
    }
    ssize_t sent =
        sendmsg(fd_, &message, MSG_NOSIGNAL | (block ? 0 : MSG_DONTWAIT));
    if (sent < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        // Full socket (or, blocking, the deadline): the caller decides.
        *want_write = !block;
        return absl::OkStatus();
      }
      return absl::UnavailableError(
          absl::StrCat("send to ", peer_, ": ", std::strerror(errno)));
    }
    *progress = true;
    AdvanceSent(static_cast<size_t>(sent));
  }
  return absl::OkStatus();
}

int Pipeline::GatherRequests(bool block, iovec* iov) const {
  int count = 0;
  size_t skip = send_pos_;
  for (size_t i = sent_;
       i < window_.size() && count + 3 <= kMaxIov &&
       !(block && i > sent_ &&
         (Spliceable(i) || chunk(i - 1).kind == RequestKind::kRead));
       ++i) {
    const Chunk& c = chunk(i);
    const std::pair<const void*, size_t> parts[3] = {
        {window_[i].header.data(), kRequestHeaderBytes},
        {c.remote->token().data(), c.remote->token().size()},
        {c.local, c.kind == RequestKind::kWrite ? c.length : 0}};
    for (const auto& [base, size] : parts) {
      if (skip >= size) {
        skip -= size;
        continue;
      }
      iov[count++] = {const_cast<char*>(static_cast<const char*>(base)) + skip,
                      size - skip};
      skip = 0;
    }
  }
  return count;
}

void Pipeline::AdvanceSent(size_t bytes) {
  while (bytes > 0) {
    const size_t rest = RequestBytes(sent_) - send_pos_;
    if (bytes >= rest) {
      bytes -= rest;
      ++sent_;
      send_pos_ = 0;
    } else {
      send_pos_ += bytes;
      bytes = 0;
    }
  }
}

bool Pipeline::Spliceable(size_t i) const {
  const Chunk& c = chunk(i);
  return zero_copy_send_ && c.kind == RequestKind::kWrite &&
         c.length >= kSpliceMinBytes;
}

absl::Status Pipeline::SendSpliced(absl::Time deadline, bool* progress) {
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) {
    return absl::DeadlineExceededError(DeadlineMessage());
  }
  if (!pages_.has_value()) {
    auto created = PageSender::Create();
    if (!created.ok()) {
      zero_copy_send_ = false;  // plain sendmsg from now on
      return absl::OkStatus();
    }
    pages_.emplace(std::move(*created));
  }
  ArmTimeout(/*receive=*/false, left);
  const Chunk& c = chunk(sent_);
  const size_t prefix = kRequestHeaderBytes + c.remote->token().size();
  if (send_pos_ < prefix) {
    iovec iov[2];
    int count = 0;
    if (send_pos_ < kRequestHeaderBytes) {
      iov[count++] = {window_[sent_].header.data() + send_pos_,
                      kRequestHeaderBytes - send_pos_};
    }
    const size_t token_skip =
        send_pos_ > kRequestHeaderBytes ? send_pos_ - kRequestHeaderBytes : 0;
    iov[count++] = {const_cast<char*>(c.remote->token().data()) + token_skip,
                    c.remote->token().size() - token_skip};
    msghdr message{};
    message.msg_iov = iov;
    message.msg_iovlen = static_cast<size_t>(count);
    const ssize_t sent = sendmsg(fd_, &message, MSG_NOSIGNAL | MSG_MORE);
    if (sent < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) {
        return absl::OkStatus();  // the caller re-checks the deadline
      }
      return absl::UnavailableError(
          absl::StrCat("send to ", peer_, ": ", std::strerror(errno)));
    }
    *progress = true;
    send_pos_ += static_cast<size_t>(sent);
    if (send_pos_ < prefix) return absl::OkStatus();
  }
  const size_t payload_done = send_pos_ - prefix;
  size_t sent = 0;
  const absl::Status status =
      pages_->Send(fd_, c.local + payload_done, c.length - payload_done,
                   /*more=*/false, &sent);
  if (sent > 0) *progress = true;
  send_pos_ += sent;
  if (send_pos_ == RequestBytes(sent_)) {
    ++sent_;
    send_pos_ = 0;
  }
  if (!status.ok()) {
    // Bytes may be stuck in the pipe: this connection is finished.
    return Prefixed(status, absl::StrCat("sending to ", peer_));
  }
  return absl::OkStatus();
}

absl::Status Pipeline::Receive(absl::Time deadline, bool* progress,
                               bool* want_read) {
  // Always read, even with nothing outstanding: an EOF must be noticed
  // while blocked on sending, and unsolicited bytes are a protocol error.
  while (!window_.empty()) {
    if (absl::Status status = ParseBuffered(progress); !status.ok()) {
      return status;
    }
    if (window_.empty()) break;
    const bool block = !nonblocking_ && !CanSend() && sent_ > 0;
    if (block) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) return absl::OkStatus();
      ArmTimeout(/*receive=*/true, left);
    }
    absl::StatusOr<size_t> received =
        phase_ == Phase::kPayload
            ? io_.ReadSome(chunk(0).local + got_, chunk(0).length - got_, block)
            : io_.Receive(block);
    if (!received.ok()) {
      return absl::UnavailableError(absl::StrCat("receive from ", peer_, ": ",
                                                 received.status().message()));
    }
    if (*received == 0) {
      // Non-blocking: nothing more has arrived. Blocking: the deadline
      // passed; the caller checks it.
      *want_read = !block;
      return absl::OkStatus();
    }
    *progress = true;
    // ReadSome counts what it delivered into local memory.
    if (phase_ == Phase::kPayload) got_ += *received;
  }
  return absl::OkStatus();
}

absl::Status Pipeline::ParseBuffered(bool* progress) {
  while (!window_.empty()) {
    switch (phase_) {
      case Phase::kHeader:
        if (io_.buffered() < kResponseHeaderBytes) return absl::OkStatus();
        std::memcpy(response_bytes_.data(), io_.data(), kResponseHeaderBytes);
        io_.Consume(kResponseHeaderBytes);
        break;
      case Phase::kMessage:
        got_ += io_.Take(message_.data() + got_, message_.size() - got_);
        if (got_ < message_.size()) return absl::OkStatus();
        break;
      case Phase::kPayload:
        got_ += io_.Take(chunk(0).local + got_, chunk(0).length - got_);
        if (got_ < chunk(0).length) return absl::OkStatus();
        break;
    }
    *progress = true;
    if (absl::Status status = Advance(); !status.ok()) return status;
  }
  return absl::OkStatus();
}

absl::Status Pipeline::Advance() {
  got_ = 0;
  switch (phase_) {
    case Phase::kHeader: {
      auto header = DecodeResponseHeader(response_bytes_.data());
      if (!header.ok()) return ProtocolError(header.status().message());
      if (sent_ == 0 || header->request_id != window_.front().id) {
        return ProtocolError("response out of order");
      }
      const Chunk& c = chunk(0);
      const bool ok = header->code == 0;
      const uint64_t want_payload =
          ok && c.kind == RequestKind::kRead ? c.length : 0;
      if (header->payload_bytes != want_payload) {
        return ProtocolError("response payload has the wrong length");
      }
      response_ = *header;
      message_.assign(header->message_bytes, '\0');
      phase_ = Phase::kMessage;
      return absl::OkStatus();
    }
    case Phase::kMessage:
      if (response_.payload_bytes > 0) {
        phase_ = Phase::kPayload;
        io_.ExpectPayload(response_.payload_bytes);
        return absl::OkStatus();
      }
      break;
    case Phase::kPayload:
      break;
  }
  source_.ChunkDone(
      chunk(0),
      response_.code == 0
          ? absl::OkStatus()
          : StatusFromInt(response_.code,
                          absl::StrCat(peer_, " refused: ", message_)));
  window_bytes_ -= chunk(0).length;
  window_.pop_front();
  --sent_;
  ++answered_;
  phase_ = Phase::kHeader;
  return absl::OkStatus();
}

absl::Status Pipeline::ProtocolError(absl::string_view what) const {
  return absl::UnavailableError(
      absl::StrCat("protocol error from ", peer_, ": ", what));
}

std::string Pipeline::NoProgressMessage() const {
  return absl::StrCat(peer_, " took and sent nothing for ",
                      absl::FormatDuration(no_progress_timeout_), " with ",
                      window_.size(),
                      " requests unanswered (--tcp_no_progress_timeout)");
}

std::string Pipeline::DeadlineMessage() const {
  uint64_t unanswered = 0;
  for (size_t i = 0; i < window_.size(); ++i) {
    unanswered += window_[i].chunk.length;
  }
  return absl::StrCat("deadline passed with ", unanswered,
                      " bytes of requests in flight not yet answered by ",
                      peer_);
}

PipelineOutcome& Pipeline::Ended(const absl::Status& status,
                                 PipelineOutcome& outcome) {
  outcome.answered = answered_;
  outcome.healthy = false;
  outcome.status = status;
  return outcome;
}

}  // namespace rdma_agent::tcp

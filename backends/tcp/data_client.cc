#include "backends/tcp/data_client.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "backends/tcp/wire.h"

namespace rdma_agent::tcp {
namespace {

// One request: a contiguous piece of one op.
struct Chunk {
  size_t op = 0;
  RequestKind kind = RequestKind::kRead;
  std::byte* local = nullptr;  // first local byte
  uint64_t remote_offset = 0;
  uint64_t length = 0;
  const v1::RemoteBuffer* remote = nullptr;
};

// Most iovecs handed to one sendmsg.
constexpr int kMaxIov = 64;

// What happened on one connection.
struct PipelineOutcome {
  // All requests answered and the stream is in a known state: reusable.
  bool healthy = false;
  // Responses fully received before the connection failed.
  size_t answered = 0;
  // Set when the deadline ended it.
  bool deadline_passed = false;
};

// Sends the requests for `lane` on `fd` and receives their responses, several
// in flight at a time, until all are answered, the connection fails or the
// deadline passes. Writes each chunk's status into `statuses`. Only this
// thread touches local memory through `fd`, and it has stopped when this
// returns.
class Pipeline {
 public:
  Pipeline(int fd, const std::vector<Chunk>& chunks,
           const std::vector<size_t>& lane, int max_in_flight,
           std::atomic<uint64_t>& next_request_id, absl::string_view peer,
           std::vector<absl::Status>& statuses, bool zero_copy_send)
      : zero_copy_send_(zero_copy_send),
        fd_(fd),
        chunks_(chunks),
        lane_(lane),
        max_in_flight_(static_cast<size_t>(std::max(1, max_in_flight))),
        peer_(peer),
        statuses_(statuses) {
    headers_.resize(lane.size());
    ids_.resize(lane.size());
    for (size_t i = 0; i < lane.size(); ++i) {
      const Chunk& chunk = chunks_[lane[i]];
      RequestHeader header;
      header.kind = chunk.kind;
      header.request_id = ids_[i] = next_request_id.fetch_add(1);
      header.epoch = chunk.remote->agent_epoch();
      header.buffer_id = chunk.remote->buffer_id();
      header.offset = chunk.remote_offset;
      header.length = chunk.length;
      header.token_bytes = static_cast<uint32_t>(chunk.remote->token().size());
      EncodeRequestHeader(header, headers_[i].data());
    }
  }

  PipelineOutcome Run(absl::Time deadline) {
    PipelineOutcome outcome;
    while (next_recv_ < lane_.size()) {
      bool progress = false;
      bool want_write = false;
      bool want_read = false;
      absl::Status status = Send(deadline, &progress, &want_write);
      if (status.ok()) status = Receive(deadline, &progress, &want_read);
      if (!status.ok()) {
        outcome.deadline_passed = absl::IsDeadlineExceeded(status);
        return Fail(status, outcome);
      }
      if (next_recv_ == lane_.size()) break;
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) {
        outcome.deadline_passed = true;
        return Fail(absl::DeadlineExceededError(DeadlineMessage()), outcome);
      }
      if (progress || (!want_read && !want_write)) continue;
      pollfd p{fd_, static_cast<short>(POLLIN | (want_write ? POLLOUT : 0)),
               0};
      const timespec timeout = absl::ToTimespec(left);
      if (ppoll(&p, 1, &timeout, nullptr) < 0 && errno != EINTR) {
        return Fail(absl::UnavailableError(
                        absl::StrCat("poll: ", std::strerror(errno))),
                    outcome);
      }
    }
    outcome.healthy = true;
    outcome.answered = next_recv_;
    return outcome;
  }

 private:
  const Chunk& chunk(size_t i) const { return chunks_[lane_[i]]; }

  // Bytes of request i on the wire: header, token, payload (WRITE).
  size_t RequestBytes(size_t i) const {
    const Chunk& c = chunk(i);
    return kRequestHeaderBytes + c.remote->token().size() +
           (c.kind == RequestKind::kWrite ? c.length : 0);
  }

  // True when the window lets another request (or the rest of one) go out.
  bool CanSend() const {
    return next_send_ < lane_.size() &&
           next_send_ - next_recv_ < max_in_flight_;
  }

  // True when a READ payload may be on its way to us: then a blocking send
  // could deadlock against a server blocked sending that payload.
  bool ReadOutstanding() const {
    const size_t end = std::min(lane_.size(), next_send_ + 1);
    for (size_t i = next_recv_; i < end; ++i) {
      if (chunk(i).kind == RequestKind::kRead && (i < next_send_ || send_pos_ > 0)) {
        return true;
      }
    }
    return false;
  }

  // Sends as much of the queued requests as the window allows. Blocks (up to
  // the deadline) only when no READ payload can be coming back meanwhile:
  // responses to WRITEs are small enough to sit in socket buffers.
  absl::Status Send(absl::Time deadline, bool* progress, bool* want_write) {
    while (CanSend()) {
      const bool block = !ReadOutstanding();
      if (block && Spliceable(next_send_)) {
        if (absl::Status status = SendSpliced(deadline, progress);
            !status.ok()) {
          return status;
        }
        continue;
      }
      iovec iov[kMaxIov];
      int count = 0;
      size_t skip = send_pos_;
      // A blocking batch ends after its first READ: from then on a payload
      // may be coming back, and only a non-blocking send can interleave
      // with receiving it.
      for (size_t i = next_send_;
           i < lane_.size() && count + 3 <= kMaxIov &&
           i - next_recv_ < max_in_flight_ &&
           !(block && i > next_send_ &&
             (Spliceable(i) || chunk(i - 1).kind == RequestKind::kRead));
           ++i) {
        const Chunk& c = chunk(i);
        const std::pair<const void*, size_t> parts[3] = {
            {headers_[i].data(), kRequestHeaderBytes},
            {c.remote->token().data(), c.remote->token().size()},
            {c.local, c.kind == RequestKind::kWrite ? c.length : 0}};
        for (const auto& [base, size] : parts) {
          if (skip >= size) {
            skip -= size;
            continue;
          }
          iov[count++] = {const_cast<char*>(static_cast<const char*>(base)) +
                              skip,
                          size - skip};
          skip = 0;
        }
      }
      msghdr message{};
      message.msg_iov = iov;
      message.msg_iovlen = static_cast<size_t>(count);
      if (block) {
        const absl::Duration left = deadline - absl::Now();
        if (left <= absl::ZeroDuration()) return absl::OkStatus();
        SetIoTimeout(fd_, /*receive=*/false, left);
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
      // Advance over whole requests, then within the current one.
      size_t left = static_cast<size_t>(sent);
      while (left > 0) {
        const size_t rest = RequestBytes(next_send_) - send_pos_;
        if (left >= rest) {
          left -= rest;
          ++next_send_;
          send_pos_ = 0;
        } else {
          send_pos_ += left;
          left = 0;
        }
      }
    }
    return absl::OkStatus();
  }

  // True when request i's payload should go out with vmsplice/splice.
  bool Spliceable(size_t i) const {
    const Chunk& c = chunk(i);
    return zero_copy_send_ && c.kind == RequestKind::kWrite &&
           c.length >= kSpliceMinBytes;
  }

  // Sends the rest of request next_send_ (blocking, up to the deadline): its
  // header and token with sendmsg, its payload lent page by page.
  absl::Status SendSpliced(absl::Time deadline, bool* progress) {
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
    SetIoTimeout(fd_, /*receive=*/false, left);
    const Chunk& c = chunk(next_send_);
    const size_t prefix = kRequestHeaderBytes + c.remote->token().size();
    if (send_pos_ < prefix) {
      iovec iov[2];
      int count = 0;
      if (send_pos_ < kRequestHeaderBytes) {
        iov[count++] = {headers_[next_send_].data() + send_pos_,
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
    if (send_pos_ == RequestBytes(next_send_)) {
      ++next_send_;
      send_pos_ = 0;
    }
    if (!status.ok()) {
      // Bytes may be stuck in the pipe: this connection is finished.
      return absl::Status(status.code(),
                          absl::StrCat("sending to ", peer_, ": ",
                                       status.message()));
    }
    return absl::OkStatus();
  }

  // Receives what has arrived: response headers, messages, and READ payloads
  // straight into local memory. With nothing left to send it blocks (up to
  // the deadline) for whole parts, which costs far fewer system calls than
  // polling for each piece.
  absl::Status Receive(absl::Time deadline, bool* progress, bool* want_read) {
    // Always read, even with nothing outstanding: an EOF must be noticed
    // while blocked on sending, and unsolicited bytes are a protocol error.
    while (next_recv_ < lane_.size()) {
      char* target = nullptr;
      size_t size = 0;
      switch (phase_) {
        case Phase::kHeader:
          target = reinterpret_cast<char*>(response_bytes_.data()) + got_;
          size = kResponseHeaderBytes - got_;
          break;
        case Phase::kMessage:
          target = message_.data() + got_;
          size = message_.size() - got_;
          break;
        case Phase::kPayload:
          target = reinterpret_cast<char*>(chunk(next_recv_).local) + got_;
          size = chunk(next_recv_).length - got_;
          break;
      }
      if (size != 0) {
        const bool block = !CanSend() && next_recv_ < next_send_;
        if (block) {
          const absl::Duration left = deadline - absl::Now();
          if (left <= absl::ZeroDuration()) return absl::OkStatus();
          SetIoTimeout(fd_, /*receive=*/true, left);
        }
        const ssize_t n =
            recv(fd_, target, size, block ? MSG_WAITALL : MSG_DONTWAIT);
        if (n == 0) {
          return absl::UnavailableError(
              absl::StrCat("connection to ", peer_, " closed by the peer"));
        }
        if (n < 0) {
          if (errno == EINTR) continue;
          if (errno == EAGAIN || errno == EWOULDBLOCK) {
            *want_read = !block;
            return absl::OkStatus();
          }
          return absl::UnavailableError(absl::StrCat(
              "receive from ", peer_, ": ", std::strerror(errno)));
        }
        *progress = true;
        got_ += static_cast<size_t>(n);
        if (static_cast<size_t>(n) < size) {
          // Blocking: cut short by the deadline or a signal; let the caller
          // check. Non-blocking: drained for now.
          *want_read = !block;
          if (block) return absl::OkStatus();
          continue;
        }
      }
      // The current part is complete.
      if (absl::Status status = Advance(); !status.ok()) return status;
    }
    return absl::OkStatus();
  }

  // Moves the receive state machine past a completed part.
  absl::Status Advance() {
    got_ = 0;
    switch (phase_) {
      case Phase::kHeader: {
        auto header = DecodeResponseHeader(response_bytes_.data());
        if (!header.ok()) return ProtocolError(header.status().message());
        if (header->request_id != ids_[next_recv_]) {
          return ProtocolError("response out of order");
        }
        const Chunk& c = chunk(next_recv_);
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
          return absl::OkStatus();
        }
        break;
      case Phase::kPayload:
        break;
    }
    statuses_[lane_[next_recv_]] =
        response_.code == 0
            ? absl::OkStatus()
            : absl::Status(static_cast<absl::StatusCode>(response_.code),
                           absl::StrCat(peer_, " refused: ", message_));
    ++next_recv_;
    phase_ = Phase::kHeader;
    return absl::OkStatus();
  }

  absl::Status ProtocolError(absl::string_view what) const {
    return absl::UnavailableError(
        absl::StrCat("protocol error from ", peer_, ": ", what));
  }

  std::string DeadlineMessage() const {
    uint64_t unanswered = 0;
    for (size_t i = next_recv_; i < lane_.size(); ++i) {
      unanswered += chunk(i).length;
    }
    return absl::StrCat("deadline passed with ", unanswered,
                        " bytes not yet answered by ", peer_);
  }

  PipelineOutcome& Fail(const absl::Status& status, PipelineOutcome& outcome) {
    for (size_t i = next_recv_; i < lane_.size(); ++i) {
      statuses_[lane_[i]] = status;
    }
    outcome.answered = next_recv_;
    outcome.healthy = false;
    return outcome;
  }

  enum class Phase { kHeader, kMessage, kPayload };

  bool zero_copy_send_;  // cleared if no PageSender can be made
  std::optional<PageSender> pages_;
  const int fd_;
  const std::vector<Chunk>& chunks_;
  const std::vector<size_t>& lane_;
  const size_t max_in_flight_;
  const std::string peer_;
  std::vector<absl::Status>& statuses_;
  std::vector<std::array<std::byte, kRequestHeaderBytes>> headers_;
  std::vector<uint64_t> ids_;

  size_t next_send_ = 0;  // request being sent
  size_t send_pos_ = 0;   // bytes of it already sent
  size_t next_recv_ = 0;  // request whose response is awaited
  Phase phase_ = Phase::kHeader;
  size_t got_ = 0;  // bytes of the current part received
  std::array<std::byte, kResponseHeaderBytes> response_bytes_;
  ResponseHeader response_;
  std::string message_;
};

}  // namespace

DataClient::DataClient(DataClientOptions options)
    : options_(std::move(options)) {}

absl::StatusOr<DataClient::Checkout> DataClient::CheckoutConnection(
    const HostPort& peer, bool fresh, absl::Time deadline) {
  const std::string key = JoinHostPort(peer.host, peer.port);
  if (!fresh) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<UniqueFd>& idle = idle_[key];
    while (!idle.empty()) {
      UniqueFd fd = std::move(idle.back());
      idle.pop_back();
      // A peer that restarted closed its end: dial it afresh instead.
      if (IdleConnectionAlive(fd.get())) return Checkout{std::move(fd), true};
    }
  }
  auto fd = DialTcp(peer, deadline, options_.socket_buffer_bytes);
  if (!fd.ok()) return fd.status();
  // The server speaks first (wire.h): nothing is sent to an endpoint that
  // is not an rdma-agentd data port.
  std::byte hello[kServerHelloBytes];
  SetIoTimeout(fd->get(), /*receive=*/true, deadline - absl::Now());
  absl::Status greeted = ReadFull(fd->get(), hello, sizeof(hello));
  if (greeted.ok()) greeted = DecodeServerHello(hello);
  if (!greeted.ok()) {
    return absl::Now() >= deadline
               ? absl::DeadlineExceededError(absl::StrCat(
                     "deadline passed waiting for the hello of ", key))
               : absl::UnavailableError(absl::StrCat(
                     "no valid hello from ", key, ": ", greeted.message()));
  }
  return Checkout{std::move(*fd), false};
}

void DataClient::ReturnConnection(const HostPort& peer, UniqueFd fd) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<UniqueFd>& idle = idle_[JoinHostPort(peer.host, peer.port)];
  // Concurrent Submits may dial more; keep a bounded number for reuse.
  if (idle.size() < static_cast<size_t>(2 * options_.connections_per_peer)) {
    idle.push_back(std::move(fd));
  }
}

size_t DataClient::idle_connections(const HostPort& peer) {
  std::lock_guard<std::mutex> lock(mu_);
  return idle_[JoinHostPort(peer.host, peer.port)].size();
}

std::vector<absl::Status> DataClient::Run(const HostPort& peer,
                                          absl::Span<const Op> ops,
                                          absl::Time deadline) {
  const std::string name = JoinHostPort(peer.host, peer.port);
  const uint64_t chunk_bytes =
      std::clamp<uint64_t>(options_.chunk_bytes, 1, kMaxPayloadBytes);
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < ops.size(); ++i) {
    const Op& op = ops[i];
    for (uint64_t done = 0; done < op.length; done += chunk_bytes) {
      Chunk chunk;
      chunk.op = i;
      chunk.kind = op.reads_into_local() ? RequestKind::kRead
                                         : RequestKind::kWrite;
      chunk.local = op.local->data() + op.local_offset + done;
      chunk.remote_offset = op.remote_offset + done;
      chunk.length = std::min(chunk_bytes, op.length - done);
      chunk.remote = op.remote.get();
      chunks.push_back(chunk);
    }
  }

  // Stripe chunks round-robin over the lanes (one connection each).
  const size_t lanes = std::min<size_t>(
      std::max(1, options_.connections_per_peer), chunks.size());
  std::vector<std::vector<size_t>> lane_chunks(lanes);
  for (size_t c = 0; c < chunks.size(); ++c) {
    lane_chunks[c % lanes].push_back(c);
  }
  std::vector<absl::Status> chunk_status(chunks.size());

  auto run_lane = [&](const std::vector<size_t>& lane) {
    bool fresh = false;
    // A reused connection that breaks before answering anything was most
    // likely stale (peer restarted): one retry on a freshly dialled one.
    // Re-sending is safe: nothing reached local memory, and writing the same
    // bytes again to the remote range is idempotent.
    for (int attempt = 0; attempt < 2; ++attempt) {
      if (absl::Now() >= deadline) {
        // Nothing of this lane is sent once the deadline has passed.
        for (size_t c : lane) {
          chunk_status[c] = absl::DeadlineExceededError(absl::StrCat(
              "deadline passed before sending to ", name));
        }
        return;
      }
      auto checkout = CheckoutConnection(peer, fresh, deadline);
      if (!checkout.ok()) {
        for (size_t c : lane) chunk_status[c] = checkout.status();
        return;
      }
      Pipeline pipeline(checkout->fd.get(), chunks, lane,
                        options_.max_in_flight, next_request_id_, name,
                        chunk_status, options_.zero_copy_send);
      const PipelineOutcome outcome = pipeline.Run(deadline);
      if (outcome.healthy) {
        ReturnConnection(peer, std::move(checkout->fd));
        return;
      }
      if (!checkout->reused || outcome.answered > 0 || outcome.deadline_passed) {
        return;  // the connection is closed with `checkout`
      }
      fresh = true;
    }
  };

  std::vector<std::thread> workers;
  workers.reserve(lanes - 1);
  for (size_t l = 1; l < lanes; ++l) {
    workers.emplace_back(run_lane, std::cref(lane_chunks[l]));
  }
  if (lanes > 0) run_lane(lane_chunks[0]);
  // After this no thread of this Run touches any op's memory.
  for (auto& worker : workers) worker.join();

  std::vector<absl::Status> results(ops.size());
  for (size_t c = 0; c < chunks.size(); ++c) {
    absl::Status& result = results[chunks[c].op];
    if (result.ok() && !chunk_status[c].ok()) result = chunk_status[c];
  }
  return results;
}

}  // namespace rdma_agent::tcp

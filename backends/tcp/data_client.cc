#include "backends/tcp/data_client.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <optional>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "backends/tcp/buffered_socket.h"
#include "backends/tcp/wire.h"
#include "common/log_text.h"
#include "common/status_util.h"
#include "spdlog/spdlog.h"

namespace rdma_agent::tcp {
namespace {

// One request: a contiguous piece of one op.
struct Chunk {
  size_t op = 0;  // position in the peer's batch
  RequestKind kind = RequestKind::kRead;
  std::byte* local = nullptr;  // first local byte
  uint64_t remote_offset = 0;
  uint64_t length = 0;
  const v1::RemoteBuffer* remote = nullptr;
};

// How far past the deadline a blocking send or receive may end (see
// Pipeline::ArmTimeout).
constexpr absl::Duration kTimeoutSlack = absl::Milliseconds(2);

// Most iovecs handed to one sendmsg.
constexpr int kMaxIov = 192;

}  // namespace

// One Run: what its jobs share with it and with its cancellation.
struct DataClient::SubmitRun {
  explicit SubmitRun(const StopToken& stop) : stop(stop) {}
  const StopToken& stop;
  // Lane jobs queued or running; Run returns when it is 0.
  size_t unfinished_jobs ABSL_GUARDED_BY(DataClient::mu_) = 0;
  // Cancelled or past the deadline: queued jobs were dropped and the sockets
  // in `active` shut down; nothing new starts.
  bool aborted ABSL_GUARDED_BY(DataClient::mu_) = false;
  // Sockets its lanes use right now (dialling or carrying requests).
  std::vector<int> active ABSL_GUARDED_BY(DataClient::mu_);
  // Lanes not started yet: one entry per connection wanted to a peer.
  std::deque<PeerRun*> queued ABSL_GUARDED_BY(DataClient::mu_);
  // The lane the Submit's own thread runs, until it starts it.
  PeerRun* caller_lane ABSL_GUARDED_BY(DataClient::mu_) = nullptr;
};

struct DataClient::Connection {
  UniqueFd fd;
  bool reused = false;
  // The send [0] and receive [1] timeouts in force on `fd` (see
  // IdleConnection); a new socket has none.
  absl::Duration armed[2] = {absl::InfiniteDuration(),
                             absl::InfiniteDuration()};
};

// The ops of one Run to one peer, cut into chunks as lanes ask for them,
// and their outcome. Thread-safe: the peer's lanes share it.
class DataClient::PeerRun {
 public:
  PeerRun(const PeerBatch& batch, absl::Span<const Op> ops,
          uint64_t chunk_bytes, const StopToken& stop)
      : peer_(batch.peer),
        name_(JoinHostPort(batch.peer.host, batch.peer.port)),
        indices_(batch.ops),
        ops_(ops),
        chunk_bytes_(chunk_bytes),
        stop_(stop),
        answered_(batch.ops.size(), 0),
        failed_(batch.ops.size()) {}

  const HostPort& peer() const { return peer_; }
  const std::string& name() const { return name_; }
  const StopToken& stop() const { return stop_; }

  // Connections worth opening: one per chunk, at most `limit`.
  size_t LanesWanted(size_t limit) const {
    uint64_t chunks = 0;
    for (size_t i : indices_) {
      const uint64_t length = ops_[i].length;
      chunks += length / chunk_bytes_ + (length % chunk_bytes_ != 0 ? 1 : 0);
      if (chunks >= limit) return limit;
    }
    return static_cast<size_t>(chunks);
  }

  // The next chunk to send, or false when every op is handed out (ops that
  // already failed are skipped: their remaining bytes are not sent).
  bool NextChunk(Chunk* chunk) {
    absl::MutexLock lock(&mu_);
    while (next_op_ < indices_.size() && !failed_[next_op_].ok()) {
      ++next_op_;
      next_offset_ = 0;
    }
    if (next_op_ >= indices_.size()) return false;
    const Op& op = ops_[indices_[next_op_]];
    chunk->op = next_op_;
    chunk->kind =
        op.reads_into_local() ? RequestKind::kRead : RequestKind::kWrite;
    chunk->local = op.local->data() + op.local_offset + next_offset_;
    chunk->remote_offset = op.remote_offset + next_offset_;
    chunk->length = std::min(chunk_bytes_, op.length - next_offset_);
    chunk->remote = op.remote.get();
    next_offset_ += chunk->length;
    if (next_offset_ == op.length) {
      ++next_op_;
      next_offset_ = 0;
    }
    return true;
  }

  bool HasWork() {
    absl::MutexLock lock(&mu_);
    return next_op_ < indices_.size() && unreachable_.ok();
  }

  void ChunkDone(const Chunk& chunk, const absl::Status& status) {
    absl::MutexLock lock(&mu_);
    if (status.ok()) {
      answered_[chunk.op] += chunk.length;
    } else if (failed_[chunk.op].ok()) {
      failed_[chunk.op] = status;
    }
  }

  // A lane ended without finishing: chunks nobody took get `status`. An
  // unreachable peer spares its other lanes the dial.
  void LaneGaveUp(const absl::Status& status, bool unreachable) {
    absl::MutexLock lock(&mu_);
    gave_up_ = status;
    if (unreachable) unreachable_ = status;
  }
  absl::Status unreachable() {
    absl::MutexLock lock(&mu_);
    return unreachable_;
  }

  // The addresses to dial, resolved once for all lanes.
  absl::StatusOr<std::vector<PeerAddress>> Addresses(absl::Time until) {
    // Not mu_: lanes on pooled connections keep taking chunks meanwhile.
    absl::MutexLock lock(&resolve_mu_);
    if (!addresses_.has_value()) {
      auto resolved =
          ResolvePeer(peer_, until, [this] { return stop_.cancelled(); });
      // A wait cut short is not an answer: the next lane tries again.
      if (!resolved.ok() && !absl::IsUnavailable(resolved.status())) {
        return resolved.status();
      }
      addresses_ = std::move(resolved);
    }
    return *addresses_;
  }

  // Writes each op's outcome into `results` (indexed like Run's ops).
  void Finish(std::vector<absl::Status>& results) {
    absl::MutexLock lock(&mu_);
    for (size_t k = 0; k < indices_.size(); ++k) {
      const Op& op = ops_[indices_[k]];
      absl::Status& result = results[indices_[k]];
      if (!failed_[k].ok()) {
        result = failed_[k];
      } else if (answered_[k] == op.length) {
        result = absl::OkStatus();
      } else if (!gave_up_.ok()) {
        result = gave_up_;
      } else if (stop_.stopped()) {
        // Its lanes were dropped from the queue before they ran.
        result =
            stop_.StopStatus(absl::StrCat("before ", name_, " was contacted"));
      } else {
        result = absl::InternalError(
            absl::StrCat("no connection to ", name_, " ran the op"));
      }
    }
  }

 private:
  const HostPort peer_;
  const std::string name_;
  const std::vector<size_t>& indices_;
  const absl::Span<const Op> ops_;
  const uint64_t chunk_bytes_;
  const StopToken& stop_;

  absl::Mutex mu_;
  // The chunk cursor: op (position in indices_) and offset within it.
  size_t next_op_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_offset_ ABSL_GUARDED_BY(mu_) = 0;
  // Per op: bytes answered OK, and the first failure.
  std::vector<uint64_t> answered_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Status> failed_ ABSL_GUARDED_BY(mu_);
  absl::Status gave_up_ ABSL_GUARDED_BY(mu_);
  absl::Status unreachable_ ABSL_GUARDED_BY(mu_);
  absl::Mutex resolve_mu_;
  std::optional<absl::StatusOr<std::vector<PeerAddress>>> addresses_
      ABSL_GUARDED_BY(resolve_mu_);
};

namespace {

// What happened on one connection.
struct PipelineOutcome {
  // Every chunk handed out was answered and the stream is in a known state:
  // reusable.
  bool healthy = false;
  // Responses fully received on this connection.
  size_t answered = 0;
  // Why it ended early (when not healthy).
  absl::Status status;
};

// Keeps up to `max_in_flight` requests (more while they carry fewer than
// `in_flight_bytes`) of one lane in flight on a connection: takes chunks from the peer's cursor as the window opens, sends
// their requests and receives their responses until no chunk is left, the
// connection fails or the deadline passes. Reports each answered chunk to
// the PeerRun. Only this thread touches local memory through the
// connection, and it has stopped when Run returns.
//
// The window survives a connection: Restart re-sends what was not answered
// on a new one.
template <typename Source>
class Pipeline {
 public:
  Pipeline(Source& source, int max_in_flight, uint64_t in_flight_bytes,
           std::atomic<uint64_t>& next_request_id, absl::string_view peer,
           bool zero_copy_send)
      : zero_copy_send_(zero_copy_send),
        source_(source),
        max_in_flight_(static_cast<size_t>(std::max(1, max_in_flight))),
        in_flight_bytes_(in_flight_bytes),
        next_request_id_(next_request_id),
        peer_(peer) {}

  // The receive buffer: lent by the client for the lane's life, taken back
  // at its end.
  void LendBuffer(std::unique_ptr<std::byte[]> buffer) {
    io_.LendBuffer(std::move(buffer));
  }
  std::unique_ptr<std::byte[]> TakeBuffer() { return io_.TakeBuffer(); }

  // Starts over on connection `fd`: requests in the window not answered are
  // sent again.
  // Sets fd_'s blocking send or receive timeout so that a call starting
  // now ends by the deadline (`left` away), give or take kTimeoutSlack. A
  // setsockopt per call cost as much as the op for small ones, so the
  // timeout is set again only when the one in force could overshoot by more.
  void ArmTimeout(bool receive, absl::Duration left) {
    absl::Duration& armed = armed_[receive ? 1 : 0];
    if (armed <= left + kTimeoutSlack) return;
    SetIoTimeout(fd_, receive, left);
    armed = left;
  }

  // `armed` (two entries: send, receive) are the timeouts in force on `fd`;
  // the pipeline keeps them up to date while it uses the connection.
  void Restart(int fd, absl::Duration* armed) {
    fd_ = fd;
    armed_ = armed;
    sent_ = 0;
    send_pos_ = 0;
    phase_ = Phase::kHeader;
    got_ = 0;
    io_.Reset(fd);  // drops what was buffered from the previous connection
    pages_.reset();  // it may hold bytes of the previous connection
  }

  PipelineOutcome Run(absl::Time deadline) {
    PipelineOutcome outcome;
    while (!window_.empty() || Refill()) {
      bool progress = false;
      bool want_write = false;
      bool want_read = false;
      absl::Status status = Send(deadline, &progress, &want_write);
      if (status.ok()) status = Receive(deadline, &progress, &want_read);
      if (!status.ok()) return Ended(status, outcome);
      if (window_.empty() && !Refill()) break;
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) {
        return Ended(absl::DeadlineExceededError(DeadlineMessage()), outcome);
      }
      if (progress || (!want_read && !want_write)) continue;
      pollfd p{fd_, static_cast<short>(POLLIN | (want_write ? POLLOUT : 0)), 0};
      const timespec timeout = absl::ToTimespec(left);
      if (ppoll(&p, 1, &timeout, nullptr) < 0 && errno != EINTR) {
        return Ended(absl::UnavailableError(
                         absl::StrCat("poll: ", std::strerror(errno))),
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

  // Fails every chunk still in the window with `status`.
  void FailWindow(const absl::Status& status) {
    for (const InFlight& request : window_)
      source_.ChunkDone(request.chunk, status);
    window_.clear();
    window_bytes_ = 0;
    sent_ = 0;
    send_pos_ = 0;
  }

 private:
  struct InFlight {
    Chunk chunk;
    uint64_t id = 0;
    std::array<std::byte, kRequestHeaderBytes> header;
  };

  // Takes chunks from the source while the window has room. True when the
  // window is not empty.
  bool Refill() {
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

  bool WindowHasRoom() const {
    return window_.size() < max_in_flight_ ||
           (window_bytes_ < in_flight_bytes_ &&
            window_.size() < DataClient::kMaxRequestsInFlight);
  }

  const Chunk& chunk(size_t i) const { return window_[i].chunk; }

  // Bytes of request i on the wire: header, token, payload (WRITE).
  size_t RequestBytes(size_t i) const {
    const Chunk& c = chunk(i);
    return kRequestHeaderBytes + c.remote->token().size() +
           (c.kind == RequestKind::kWrite ? c.length : 0);
  }

  // True when another request (or the rest of one) may go out.
  bool CanSend() {
    Refill();
    return sent_ < window_.size();
  }

  // True when a READ payload may be on its way to us: then a blocking send
  // could deadlock against a server blocked sending that payload.
  bool ReadOutstanding() const {
    const size_t end = std::min(window_.size(), sent_ + 1);
    for (size_t i = 0; i < end; ++i) {
      if (chunk(i).kind == RequestKind::kRead && (i < sent_ || send_pos_ > 0)) {
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
      if (block && Spliceable(sent_)) {
        if (absl::Status status = SendSpliced(deadline, progress);
            !status.ok()) {
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

  // Fills `iov` with the unsent bytes of the next requests; returns how many
  // entries. A blocking batch ends after its first READ: from then on a
  // payload may be coming back, and only a non-blocking send can interleave
  // with receiving it.
  int GatherRequests(bool block, iovec* iov) const {
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
        iov[count++] = {
            const_cast<char*>(static_cast<const char*>(base)) + skip,
            size - skip};
        skip = 0;
      }
    }
    return count;
  }

  // Advances over whole requests, then within the current one.
  void AdvanceSent(size_t bytes) {
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

  // True when request i's payload should go out with vmsplice/splice.
  bool Spliceable(size_t i) const {
    const Chunk& c = chunk(i);
    return zero_copy_send_ && c.kind == RequestKind::kWrite &&
           c.length >= kSpliceMinBytes;
  }

  // Sends the rest of request sent_ (blocking, up to the deadline): its
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

  // Receives what has arrived: response headers and messages through the
  // buffer (one recv brings many responses), READ payloads into local memory
  // (from the buffer, or straight from the socket when large). With nothing
  // left to send it blocks (up to the deadline) for whole parts, which costs
  // far fewer system calls than polling for each piece.
  absl::Status Receive(absl::Time deadline, bool* progress, bool* want_read) {
    // Always read, even with nothing outstanding: an EOF must be noticed
    // while blocked on sending, and unsolicited bytes are a protocol error.
    while (!window_.empty()) {
      if (absl::Status status = ParseBuffered(progress); !status.ok()) {
        return status;
      }
      if (window_.empty()) break;
      const bool block = !CanSend() && sent_ > 0;
      if (block) {
        const absl::Duration left = deadline - absl::Now();
        if (left <= absl::ZeroDuration()) return absl::OkStatus();
        ArmTimeout(/*receive=*/true, left);
      }
      absl::StatusOr<size_t> received =
          phase_ == Phase::kPayload
              ? io_.ReadSome(chunk(0).local + got_, chunk(0).length - got_,
                             block)
              : io_.Receive(block);
      if (!received.ok()) {
        return absl::UnavailableError(
            absl::StrCat("receive from ", peer_, ": ",
                         received.status().message()));
      }
      if (*received == 0) {
        // Non-blocking: drained for now. Blocking: the deadline passed;
        // the caller checks it.
        *want_read = !block;
        return absl::OkStatus();
      }
      *progress = true;
      // ReadSome counts what it delivered into local memory.
      if (phase_ == Phase::kPayload) got_ += *received;
    }
    return absl::OkStatus();
  }

  // Consumes the complete parts in the buffer (and the buffered bytes of a
  // part still arriving).
  absl::Status ParseBuffered(bool* progress) {
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

  // Moves the receive state machine past a completed part.
  absl::Status Advance() {
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
        chunk(0), response_.code == 0
                      ? absl::OkStatus()
                      : StatusFromInt(response_.code,
                                      absl::StrCat(peer_, " refused: ",
                                                   message_)));
    window_bytes_ -= chunk(0).length;
    window_.pop_front();
    --sent_;
    ++answered_;
    phase_ = Phase::kHeader;
    return absl::OkStatus();
  }

  absl::Status ProtocolError(absl::string_view what) const {
    return absl::UnavailableError(
        absl::StrCat("protocol error from ", peer_, ": ", what));
  }

  std::string DeadlineMessage() const {
    uint64_t unanswered = 0;
    for (const InFlight& request : window_) unanswered += request.chunk.length;
    return absl::StrCat("deadline passed with ", unanswered,
                        " bytes of requests in flight not yet answered by ",
                        peer_);
  }

  PipelineOutcome& Ended(const absl::Status& status, PipelineOutcome& outcome) {
    outcome.answered = answered_;
    outcome.healthy = false;
    outcome.status = status;
    return outcome;
  }

  enum class Phase { kHeader, kMessage, kPayload };

  bool zero_copy_send_;  // cleared if no PageSender can be made
  std::optional<PageSender> pages_;
  Source& source_;
  const size_t max_in_flight_;
  const uint64_t in_flight_bytes_;
  std::atomic<uint64_t>& next_request_id_;
  const std::string peer_;
  int fd_ = -1;
  // The send [0] and receive [1] timeouts in force on fd_ (the
  // connection's own record).
  absl::Duration* armed_ = nullptr;

  // Requests taken from the source and not answered yet, oldest first; the
  // first sent_ of them are on the wire, and send_pos_ bytes of the next.
  std::deque<InFlight> window_;
  uint64_t window_bytes_ = 0;  // payload bytes of the requests in window_
  size_t sent_ = 0;
  size_t send_pos_ = 0;
  size_t answered_ = 0;  // responses received on the current connection
  // Responses are read through it; READ payloads of kDirectBytes and more
  // skip its buffer.
  BufferedSocket io_;
  Phase phase_ = Phase::kHeader;
  size_t got_ = 0;  // bytes of the current part received
  std::array<std::byte, kResponseHeaderBytes> response_bytes_;
  ResponseHeader response_;
  std::string message_;
};

// The one message for a peer that could not be reached, whatever the
// reason: refused, timed out, reset, not an agent. Callers must not learn
// more about other services than "not an agent they can use".
absl::Status Unreachable(absl::string_view peer) {
  return absl::UnavailableError(absl::StrCat("peer ", peer, " is unreachable"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataClient>> DataClient::Create(
    DataClientOptions options) {
  if (options.connections_per_peer < 1 || options.max_in_flight < 1 ||
      options.chunk_bytes < 1 || options.chunk_bytes > kMaxPayloadBytes ||
      options.socket_buffer_bytes < 0 || options.threads < 1 ||
      options.max_connections < 1 || options.max_idle_connections < 0 ||
      options.max_idle_per_peer < 0 ||
      options.idle_timeout <= absl::ZeroDuration() ||
      options.connect_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tcp client options out of range: connections per peer, max in "
        "flight, threads and max connections must be >= 1, chunk bytes in "
        "[1, ",
        kMaxPayloadBytes,
        "], socket buffer bytes and idle connection limits >= 0, idle and "
        "connect timeouts > 0"));
  }
  std::unique_ptr<DataClient> client(new DataClient(std::move(options)));
  const int threads = client->options_.threads;
  for (int i = 0; i < threads; ++i) {
    try {
      client->workers_.emplace_back(
          [raw = client.get()] { raw->WorkerLoop(); });
    } catch (const std::system_error& error) {
      // The destructor stops and joins the workers already started.
      return absl::ResourceExhaustedError(
          absl::StrCat("tcp client: cannot start worker thread ", i + 1, " of ",
                       threads, ": ", error.what()));
    }
  }
  return client;
}

DataClient::DataClient(DataClientOptions options)
    : options_(std::move(options)) {}

DataClient::~DataClient() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    work_cv_.SignalAll();
  }
  for (std::thread& worker : workers_) worker.join();
  absl::MutexLock lock(&mu_);
  for (auto& [key, idle] : idle_) CloseIdleLocked(key, idle);
  idle_.clear();
}

std::vector<absl::Status> DataClient::Run(absl::Span<const Op> ops,
                                          absl::Span<const PeerBatch> batches,
                                          const StopToken& stop) {
  std::vector<absl::Status> results(ops.size());
  const uint64_t chunk_bytes =
      std::clamp<uint64_t>(options_.chunk_bytes, 1, kMaxPayloadBytes);
  SubmitRun submit(stop);
  std::vector<std::unique_ptr<PeerRun>> peers;
  peers.reserve(batches.size());
  for (const PeerBatch& batch : batches) {
    peers.push_back(std::make_unique<PeerRun>(batch, ops, chunk_bytes, stop));
  }
  QueueLanes(submit, peers);
  // Cancellation shuts the Run's sockets down at once (the callback must not
  // block: it takes mu_ only briefly).
  std::unique_ptr<Cancellation::Callback> on_cancel = stop.OnCancel([&] {
    absl::MutexLock lock(&mu_);
    AbortLocked(submit);
    changed_cv_.SignalAll();
  });
  WaitForLanes(submit);
  // Not under mu_: unregistering waits for a callback running right now.
  on_cancel.reset();
  // After this no lane of this Run touches any op's memory: all have ended.
  for (const auto& peer : peers) peer->Finish(results);
  return results;
}

void DataClient::QueueLanes(
    SubmitRun& submit, const std::vector<std::unique_ptr<PeerRun>>& peers) {
  absl::MutexLock lock(&mu_);
  for (const auto& peer : peers) {
    const size_t lanes =
        peer->LanesWanted(static_cast<size_t>(options_.connections_per_peer));
    for (size_t l = 0; l < lanes; ++l) submit.queued.push_back(peer.get());
  }
  submit.unfinished_jobs = submit.queued.size();
  if (submit.queued.empty()) return;
  // The first lane is the calling thread's own (WaitForLanes): a Submit of
  // one lane, every small op, never waits for a worker to wake and hand
  // its result back. Only the rest go to the workers, one wake-up each.
  submit.caller_lane = submit.queued.front();
  submit.queued.pop_front();
  if (submit.queued.empty()) return;
  runs_.push_back(&submit);
  for (size_t i = 0; i < submit.queued.size(); ++i) work_cv_.Signal();
}

void DataClient::WaitForLanes(SubmitRun& submit) {
  absl::MutexLock lock(&mu_);
  while (submit.unfinished_jobs > 0) {
    if (!submit.aborted && submit.stop.stopped()) {
      AbortLocked(submit);  // may have dropped the last queued job
      continue;
    }
    if (submit.caller_lane != nullptr) {
      PeerRun* peer = std::exchange(submit.caller_lane, nullptr);
      mu_.Unlock();
      RunLane(LaneJob{&submit, peer});
      mu_.Lock();
      --submit.unfinished_jobs;
      continue;
    }
    changed_cv_.WaitWithDeadline(
        &mu_, submit.aborted ? absl::InfiniteFuture() : submit.stop.deadline());
  }
}

void DataClient::AbortLocked(SubmitRun& submit) {
  if (submit.aborted) return;
  submit.aborted = true;
  submit.unfinished_jobs -= submit.queued.size();
  submit.queued.clear();
  if (submit.caller_lane != nullptr) {
    submit.caller_lane = nullptr;
    --submit.unfinished_jobs;
  }
  auto it = std::find(runs_.begin(), runs_.end(), &submit);
  if (it != runs_.end()) runs_.erase(it);
  // Wakes every blocked send, receive, poll and connect of its lanes.
  for (int fd : submit.active) shutdown(fd, SHUT_RDWR);
}

std::optional<DataClient::LaneJob> DataClient::NextJobLocked() {
  if (runs_.empty()) return std::nullopt;
  // Round robin over the Runs with queued lanes: a Submit naming hundreds
  // of peers does not make the next Submit wait for all of them.
  SubmitRun* submit = runs_.front();
  runs_.pop_front();
  LaneJob job{submit, submit->queued.front()};
  submit->queued.pop_front();
  if (!submit->queued.empty()) runs_.push_back(submit);
  return job;
}

void DataClient::WorkerLoop() {
  absl::MutexLock lock(&mu_);
  // Wake now and then even without work, so idle connections expire.
  const absl::Duration tick = std::clamp(
      options_.idle_timeout / 4, absl::Milliseconds(10), absl::Seconds(5));
  while (true) {
    if (runs_.empty() && !stopping_) work_cv_.WaitWithTimeout(&mu_, tick);
    ExpireIdleLocked();
    if (stopping_) return;
    const std::optional<LaneJob> job = NextJobLocked();
    if (!job.has_value()) continue;
    mu_.Unlock();
    RunLane(*job);
    mu_.Lock();
    --job->submit->unfinished_jobs;
    changed_cv_.SignalAll();
  }
}

void DataClient::RunLane(const LaneJob& job) {
  SubmitRun& submit = *job.submit;
  PeerRun& peer = *job.peer;
  const StopToken& stop = submit.stop;
  if (!peer.HasWork()) {
    // Nothing left for this lane, or another lane found the peer
    // unreachable: no dial.
    if (absl::Status why = peer.unreachable(); !why.ok()) {
      peer.LaneGaveUp(why, /*unreachable=*/true);
    }
    return;
  }
  Pipeline<PeerRun> pipeline(peer, options_.max_in_flight,
                             options_.in_flight_bytes, next_request_id_,
                             peer.name(), options_.zero_copy_send);
  pipeline.LendBuffer(TakeSpareBuffer());
  // Whichever way the lane ends, its buffer goes back for the next one.
  struct GiveBack {
    DataClient* client;
    Pipeline<PeerRun>* pipeline;
    ~GiveBack() { client->ReturnSpareBuffer(pipeline->TakeBuffer()); }
  } give_back{this, &pipeline};
  // A reused connection that breaks before answering anything was most
  // likely stale (peer restarted): one retry on a freshly dialled one.
  // Re-sending is safe: nothing reached local memory, and writing the same
  // bytes again to the remote range is idempotent.
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (stop.stopped()) {
      const absl::Status status =
          stop.StopStatus(absl::StrCat("before sending to ", peer.name()));
      pipeline.FailWindow(status);
      peer.LaneGaveUp(status, /*unreachable=*/false);
      return;
    }
    auto connection = Checkout(submit, peer, /*fresh=*/attempt > 0);
    if (!connection.ok()) {
      pipeline.FailWindow(connection.status());
      peer.LaneGaveUp(connection.status(),
                      absl::IsUnavailable(connection.status()));
      return;
    }
    pipeline.Restart(connection->fd.get(), connection->armed);
    const PipelineOutcome outcome = pipeline.Run(stop.deadline());
    if (outcome.healthy) {
      Release(submit, peer, std::move(*connection), /*reusable=*/true);
      return;
    }
    const bool reused = connection->reused;
    Release(submit, peer, std::move(*connection), /*reusable=*/false);
    if (reused && outcome.answered == 0 && !stop.stopped()) continue;
    // Shut down by the Run (cancelled, or at its deadline): say why, not
    // "closed by the peer".
    const bool cut_by_run =
        stop.cancelled() ||
        (stop.stopped() && !absl::IsDeadlineExceeded(outcome.status));
    const absl::Status status =
        cut_by_run ? stop.StopStatus(absl::StrCat("before ", peer.name(),
                                                  " answered every request"))
                   : outcome.status;
    pipeline.FailWindow(status);
    peer.LaneGaveUp(status, /*unreachable=*/false);
    return;
  }
}

std::unique_ptr<std::byte[]> DataClient::TakeSpareBuffer() {
  absl::MutexLock lock(&mu_);
  if (spare_buffers_.empty()) return nullptr;  // the lane allocates one
  std::unique_ptr<std::byte[]> buffer = std::move(spare_buffers_.back());
  spare_buffers_.pop_back();
  return buffer;
}

void DataClient::ReturnSpareBuffer(std::unique_ptr<std::byte[]> buffer) {
  if (buffer == nullptr) return;
  absl::MutexLock lock(&mu_);
  if (spare_buffers_.size() < kMaxSpareBuffers) {
    spare_buffers_.push_back(std::move(buffer));
  }
}

absl::StatusOr<DataClient::Connection> DataClient::Checkout(SubmitRun& submit,
                                                            PeerRun& peer,
                                                            bool fresh) {
  if (!fresh) {
    absl::MutexLock lock(&mu_);
    ExpireIdleLocked();
    auto it = idle_.find(peer.name());
    while (it != idle_.end() && !it->second.empty()) {
      // Newest first: the least likely to have been closed by the peer.
      UniqueFd fd = std::move(it->second.back().fd);
      const absl::Duration armed[2] = {it->second.back().armed[0],
                                       it->second.back().armed[1]};
      it->second.pop_back();
      --idle_total_;
      if (it->second.empty()) idle_.erase(it);
      // A peer that restarted closed its end: dial it afresh instead.
      if (IdleConnectionAlive(fd.get())) {
        if (!RegisterActiveLocked(submit, fd.get())) {
          idle_[peer.name()].push_back(
              {std::move(fd), absl::Now(), {armed[0], armed[1]}});
          ++idle_total_;
          return submit.stop.StopStatus(
              absl::StrCat("before sending to ", peer.name()));
        }
        Connection connection{std::move(fd), /*reused=*/true};
        connection.armed[0] = armed[0];
        connection.armed[1] = armed[1];
        return connection;
      }
      fd.reset();
      ReleaseConnectionSlotLocked(peer.name());
      it = idle_.find(peer.name());
    }
  }
  return Dial(submit, peer);
}

bool DataClient::RegisterActiveLocked(SubmitRun& submit, int fd) {
  if (submit.aborted) return false;
  submit.active.push_back(fd);
  return true;
}

absl::StatusOr<DataClient::Connection> DataClient::Dial(SubmitRun& submit,
                                                        PeerRun& peer) {
  const StopToken& stop = submit.stop;
  const absl::Time until =
      std::min(stop.deadline(), absl::Now() + options_.connect_timeout);
  auto failed = [&](const absl::Status& why) -> absl::Status {
    if (stop.stopped()) {
      return stop.StopStatus(absl::StrCat("before ", peer.name(), " answered"));
    }
    if (absl::IsResourceExhausted(why)) {
      return Prefixed(why, absl::StrCat("no socket for ", peer.name()));
    }
    spdlog::debug("tcp: peer {} is unreachable: {}", LogSafe(peer.name()),
                  LogSafe(why.message()));
    return Unreachable(peer.name());
  };
  auto addresses = peer.Addresses(until);
  if (!addresses.ok()) return failed(addresses.status());
  if (!ReserveConnectionSlot(submit, peer.name())) {
    return failed(absl::CancelledError(""));
  }
  absl::Status why = absl::UnavailableError("no address");
  for (const PeerAddress& address : *addresses) {
    auto fd = OpenDataSocket(address, options_.socket_buffer_bytes);
    if (!fd.ok()) {
      why = fd.status();
      break;
    }
    {
      absl::MutexLock lock(&mu_);
      if (!RegisterActiveLocked(submit, fd->get())) break;
    }
    const StopCheck cancelled = [&stop] { return stop.cancelled(); };
    why = ConnectSocket(fd->get(), address, until, cancelled);
    // Not a byte goes out before the peer has proven to be an agent.
    if (why.ok()) why = ReadServerHello(fd->get(), until, cancelled);
    if (why.ok()) {
      SetBlocking(fd->get());
      return Connection{std::move(*fd), /*reused=*/false};
    }
    absl::MutexLock lock(&mu_);
    submit.active.erase(
        std::find(submit.active.begin(), submit.active.end(), fd->get()));
    fd->reset();  // closed under mu_, so a cancellation never sees its number
    if (submit.aborted || absl::IsDeadlineExceeded(why)) break;
  }
  absl::MutexLock lock(&mu_);
  ReleaseConnectionSlotLocked(peer.name());
  return failed(why);
}

void DataClient::Release(SubmitRun& submit, const PeerRun& peer,
                         Connection connection, bool reusable) {
  absl::MutexLock lock(&mu_);
  auto it = std::find(submit.active.begin(), submit.active.end(),
                      connection.fd.get());
  if (it != submit.active.end()) submit.active.erase(it);
  // A connection the Run shut down is finished even if its last response
  // made it.
  if (reusable && !submit.aborted && options_.max_idle_per_peer > 0 &&
      options_.max_idle_connections > 0) {
    ExpireIdleLocked();
    std::deque<IdleConnection>& idle = idle_[peer.name()];
    if (idle.size() < static_cast<size_t>(options_.max_idle_per_peer)) {
      if (idle_total_ >= static_cast<size_t>(options_.max_idle_connections)) {
        CloseOldestIdleLocked();
      }
      idle.push_back({std::move(connection.fd),
                      absl::Now(),
                      {connection.armed[0], connection.armed[1]}});
      ++idle_total_;
      return;
    }
  }
  connection.fd.reset();  // under mu_: see Dial
  ReleaseConnectionSlotLocked(peer.name());
}

bool DataClient::ReserveConnectionSlot(SubmitRun& submit,
                                       const std::string& peer) {
  absl::MutexLock lock(&mu_);
  while (open_ >= static_cast<size_t>(options_.max_connections)) {
    if (CloseOldestIdleLocked()) continue;
    if (submit.aborted || submit.stop.stopped()) return false;
    // Every connection is in use: wait for one to be released (bounded, to
    // notice the deadline).
    changed_cv_.WaitWithTimeout(&mu_, absl::Milliseconds(20));
  }
  ++open_;
  ++open_by_peer_[peer];
  return true;
}

void DataClient::ReleaseConnectionSlotLocked(const std::string& peer) {
  --open_;
  auto it = open_by_peer_.find(peer);
  if (it != open_by_peer_.end() && --it->second == 0) open_by_peer_.erase(it);
  changed_cv_.SignalAll();
}

void DataClient::CloseIdleLocked(const std::string& peer,
                                 std::deque<IdleConnection>& idle) {
  for (IdleConnection& connection : idle) {
    connection.fd.reset();
    --idle_total_;
    ReleaseConnectionSlotLocked(peer);
  }
  idle.clear();
}

void DataClient::ExpireIdleLocked() {
  const absl::Time now = absl::Now();
  if (now < next_expiry_check_) return;
  next_expiry_check_ = now + absl::Milliseconds(10);
  const absl::Time cutoff = now - options_.idle_timeout;
  for (auto it = idle_.begin(); it != idle_.end();) {
    std::deque<IdleConnection>& idle = it->second;
    while (!idle.empty() && idle.front().since <= cutoff) {
      idle.pop_front();  // closes it
      --idle_total_;
      ReleaseConnectionSlotLocked(it->first);
    }
    it = idle.empty() ? idle_.erase(it) : std::next(it);
  }
}

bool DataClient::CloseOldestIdleLocked() {
  auto oldest = idle_.end();
  for (auto it = idle_.begin(); it != idle_.end(); ++it) {
    if (it->second.empty()) continue;
    if (oldest == idle_.end() ||
        it->second.front().since < oldest->second.front().since) {
      oldest = it;
    }
  }
  if (oldest == idle_.end()) return false;
  oldest->second.pop_front();
  --idle_total_;
  ReleaseConnectionSlotLocked(oldest->first);
  if (oldest->second.empty()) idle_.erase(oldest);
  return true;
}

size_t DataClient::idle_connections(const HostPort& peer) {
  absl::MutexLock lock(&mu_);
  ExpireIdleLocked();
  auto it = idle_.find(JoinHostPort(peer.host, peer.port));
  return it == idle_.end() ? 0 : it->second.size();
}

size_t DataClient::idle_connections() {
  absl::MutexLock lock(&mu_);
  ExpireIdleLocked();
  return idle_total_;
}

size_t DataClient::open_connections() {
  absl::MutexLock lock(&mu_);
  return open_;
}

std::map<std::string, size_t> DataClient::OpenConnectionsByPeer() {
  absl::MutexLock lock(&mu_);
  return open_by_peer_;
}

}  // namespace rdma_agent::tcp

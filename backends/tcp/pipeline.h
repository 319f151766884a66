#ifndef RDMA_AGENTD_BACKENDS_TCP_PIPELINE_H_
#define RDMA_AGENTD_BACKENDS_TCP_PIPELINE_H_

#include <sys/uio.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "backends/tcp/buffered_socket.h"
#include "backends/tcp/socket_util.h"
#include "backends/tcp/wire.h"
#include "rdma/agent/v1/remote_buffer.pb.h"

namespace rdma_agent::tcp {

// One request: a contiguous piece of one op.
struct Chunk {
  size_t op = 0;  // position in the peer's batch
  RequestKind kind = RequestKind::kRead;
  std::byte* local = nullptr;  // first local byte
  uint64_t remote_offset = 0;
  uint64_t length = 0;
  const ::rdma::agent::v1::RemoteBuffer* remote = nullptr;
};

// Where a Pipeline takes its chunks and reports their outcome (the ops of
// one Run to one peer, shared by the peer's lanes).
class ChunkSource {
 public:
  // The next chunk to send, or false when there is none left.
  virtual bool NextChunk(Chunk* chunk) = 0;
  // `chunk` was answered: OK, or the peer's refusal or why it failed.
  virtual void ChunkDone(const Chunk& chunk, const absl::Status& status) = 0;

 protected:
  ~ChunkSource() = default;
};

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
// `in_flight_bytes`) of one lane in flight on a connection: takes chunks
// from the peer's cursor as the window opens, sends their requests and
// receives their responses until no chunk is left, the connection fails or
// the deadline passes. Reports each answered chunk to the source. Only this
// thread touches local memory through the connection, and it has stopped
// when DataClient::Run returns.
//
// The window survives a connection: Restart re-sends what was not answered
// on a new one.
class Pipeline {
 public:
  // Most requests one connection has in flight, whatever their size.
  static constexpr size_t kMaxRequestsInFlight = 1024;

  // `no_progress_timeout`: Run gives up (UNAVAILABLE) when the connection
  // moves no byte either way for this long; zero waits for the deadline.
  Pipeline(ChunkSource& source, int max_in_flight, uint64_t in_flight_bytes,
           std::atomic<uint64_t>& next_request_id, absl::string_view peer,
           bool zero_copy_send, absl::Duration no_progress_timeout);

  // The receive buffer: lent by the client for the lane's life, taken back
  // at its end.
  void LendBuffer(std::unique_ptr<std::byte[]> buffer) {
    io_.LendBuffer(std::move(buffer));
  }
  std::unique_ptr<std::byte[]> TakeBuffer() { return io_.TakeBuffer(); }

  // Starts over on connection `fd`: requests in the window not answered are
  // sent again. `armed` (two entries: send, receive) are the timeouts in
  // force on `fd`; the pipeline keeps them up to date while it uses the
  // connection.
  void Restart(int fd, absl::Duration* armed);

  PipelineOutcome Run(absl::Time deadline);

  // What Pump asks its caller to wait for.
  enum class Wait { kNone, kReadable, kReadableOrWritable };
  // Run for an event loop: never blocks (and never splices). Sends what
  // the socket takes and takes in what has arrived. kNone: the lane ended,
  // as `outcome` says (healthy when every chunk was answered); else call
  // again once the socket is ready as asked. The deadline is not watched:
  // the caller shuts the socket down when it passes (the next Pump then
  // fails).
  Wait Pump(PipelineOutcome& outcome);

  // Fails every chunk still in the window with `status`.
  void FailWindow(const absl::Status& status);

  // Why a lane gave up on a peer that moved nothing for
  // `no_progress_timeout` (names the flag).
  std::string NoProgressMessage() const;

 private:
  struct InFlight {
    Chunk chunk;
    uint64_t id = 0;
    std::array<std::byte, kRequestHeaderBytes> header;
  };
  enum class Phase { kHeader, kMessage, kPayload };

  // Sets fd_'s blocking send or receive timeout so that a call starting
  // now ends by the deadline (`left` away), give or take kTimeoutSlack. A
  // setsockopt per call cost as much as the op for small ones, so the
  // timeout is set again only when the one in force could overshoot by more.
  void ArmTimeout(bool receive, absl::Duration left);

  // Takes chunks from the source while the window has room. True when the
  // window is not empty.
  bool Refill();
  bool WindowHasRoom() const;
  const Chunk& chunk(size_t i) const { return window_[i].chunk; }
  // Bytes of request i on the wire: header, token, payload (WRITE).
  size_t RequestBytes(size_t i) const;
  // True when another request (or the rest of one) may go out.
  bool CanSend();
  // True when a READ payload may be on its way to us: then a blocking send
  // could deadlock against a server blocked sending that payload.
  bool ReadOutstanding() const;

  // Sends as much of the queued requests as the window allows. Blocks (up to
  // the deadline) only when no READ payload can be coming back meanwhile:
  // responses to WRITEs are small enough to sit in socket buffers.
  absl::Status Send(absl::Time deadline, bool* progress, bool* want_write);
  // Fills `iov` with the unsent bytes of the next requests; returns how many
  // entries. A blocking batch ends after its first READ: from then on a
  // payload may be coming back, and only a non-blocking send can interleave
  // with receiving it.
  int GatherRequests(bool block, iovec* iov) const;
  // Advances over whole requests, then within the current one.
  void AdvanceSent(size_t bytes);
  // True when request i's payload should go out with vmsplice/splice.
  bool Spliceable(size_t i) const;
  // Sends the rest of request sent_ (blocking, up to the deadline): its
  // header and token with sendmsg, its payload lent page by page.
  absl::Status SendSpliced(absl::Time deadline, bool* progress);

  // Receives what has arrived: response headers and messages through the
  // buffer (one recv brings many responses), READ payloads into local memory
  // (from the buffer, or straight from the socket when large). With nothing
  // left to send it blocks (up to the deadline) for whole parts, which costs
  // far fewer system calls than polling for each piece.
  absl::Status Receive(absl::Time deadline, bool* progress, bool* want_read);
  // Consumes the complete parts in the buffer (and the buffered bytes of a
  // part still arriving).
  absl::Status ParseBuffered(bool* progress);
  // Moves the receive state machine past a completed part.
  absl::Status Advance();

  absl::Status ProtocolError(absl::string_view what) const;
  std::string DeadlineMessage() const;
  PipelineOutcome& Ended(const absl::Status& status, PipelineOutcome& outcome);

  bool zero_copy_send_;  // cleared if no PageSender can be made
  // Set by Pump, cleared by Run: no call blocks.
  bool nonblocking_ = false;
  const absl::Duration no_progress_timeout_;
  std::optional<PageSender> pages_;
  ChunkSource& source_;
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
  // The requests in flight, oldest first: a ring that doubles up to the
  // deepest window the lane reaches and is then reused, so that a lane
  // allocates nothing per request (a deque allocated a block every few).
  class Window {
   public:
    bool empty() const { return size_ == 0; }
    size_t size() const { return size_; }
    InFlight& operator[](size_t i) { return slots_[(head_ + i) & mask_]; }
    const InFlight& operator[](size_t i) const {
      return slots_[(head_ + i) & mask_];
    }
    InFlight& front() { return (*this)[0]; }
    // A reset slot at the back; references to others stay valid only
    // until the next call (the ring may grow).
    InFlight& emplace_back();
    void pop_front() {
      head_ = (head_ + 1) & mask_;
      --size_;
    }
    void clear() { head_ = size_ = 0; }

   private:
    std::vector<InFlight> slots_;  // a power of two, or empty
    size_t mask_ = 0;
    size_t head_ = 0;
    size_t size_ = 0;
  };
  Window window_;
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

}  // namespace rdma_agent::tcp

#endif  // RDMA_AGENTD_BACKENDS_TCP_PIPELINE_H_

#ifndef RDMA_AGENTD_BACKENDS_TCP_BUFFERED_SOCKET_H_
#define RDMA_AGENTD_BACKENDS_TCP_BUFFERED_SOCKET_H_

// Buffered I/O for the two ends of a data connection, which both carry many
// small messages (request and response headers, tokens, small payloads)
// between large payloads:
//  - BufferedSocket: the receiving half. One recv takes in as many messages
//    as have arrived (not one per header, token and payload); large payloads
//    go straight to the caller's memory. Used by the data client (responses)
//    and the data server (requests).
//  - SendQueue: the sending half of the non-blocking data server. Answers
//    collect and go out together in one sendmsg when the socket takes them;
//    large payloads are sent from where they are, never copied.

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "backends/tcp/socket_util.h"

namespace rdma_agent::tcp {

// Reads a connected socket through a buffer. The owner decides when to wait
// (the data client bounds each wait with SO_RCVTIMEO; the data server never
// waits, its sockets are non-blocking): "nothing arrived yet" is an answer
// (0), not an error.
//
// Not thread-safe; the fd stays owned by the caller.
class BufferedSocket {
 public:
  // Size of the buffer: the most one recv takes in.
  static constexpr size_t kBufferBytes = 64 << 10;
  // ReadSome receives payloads of at least this many bytes straight into
  // the caller's memory when nothing is buffered; shorter ones go through
  // the buffer, whose one recv may bring the next messages along.
  static constexpr size_t kDirectBytes = kBufferBytes / 2;
  // While a large payload (kDirectBytes or more) is being read, a recv into
  // the buffer takes at most this much: a full-size one would pull most of
  // the payload through the buffer (an extra copy of every byte) instead of
  // letting it go straight to the caller, and large payloads tend to
  // follow each other. Enough for a request header and the longest token.
  static constexpr size_t kHeaderFillBytes = 1024;

  // Not attached to a socket (and without a buffer) until Reset.
  BufferedSocket() = default;
  explicit BufferedSocket(int fd) : fd_(fd) {}

  // Starts over on `fd`: whatever was buffered for the previous socket is
  // dropped (the buffer's memory is kept).
  void Reset(int fd);
  // Frees the buffer when nothing is buffered (an idle connection then holds
  // none); the next Receive allocates it again.
  void ReleaseIfEmpty();
  // Gives the socket a buffer of kBufferBytes to use instead of allocating
  // one (an owner that reads many short-lived connections reuses buffers:
  // a 64 KiB allocation makes glibc consolidate its small free chunks every
  // time). Whatever was buffered is dropped.
  void LendBuffer(std::unique_ptr<std::byte[]> buffer);
  // The buffer (lent or allocated), or null; the socket keeps none.
  std::unique_ptr<std::byte[]> TakeBuffer();

  int fd() const { return fd_; }
  // Bytes received and not yet consumed.
  size_t buffered() const { return end_ - begin_; }
  // The buffered bytes (valid until the next call; only when buffered() > 0).
  const std::byte* data() const { return in_.get() + begin_; }
  // Drops `size` buffered bytes (at most buffered()).
  void Consume(size_t size) { begin_ += size; }
  // Copies up to `size` buffered bytes to `out` and consumes them; returns
  // how many. Never touches the socket.
  size_t Take(void* out, size_t size);

  // Says that the next `size` bytes of the stream are a payload the caller
  // reads with Take and ReadSome: when large, the next recv into the buffer
  // stays small (kHeaderFillBytes).
  void ExpectPayload(uint64_t size) {
    if (size >= kDirectBytes) small_fill_ = true;
  }

  // One recv into the buffer's free room (a partial message is moved to the
  // front first; at most kHeaderFillBytes during or right after a large
  // payload). With `wait` it blocks until a byte arrives or the socket's
  // receive timeout (SO_RCVTIMEO) passes; without, it returns at once.
  // Returns the bytes received: 0 when none had arrived (or the timeout
  // passed). UNAVAILABLE when the peer closed, or the socket failed or was
  // shut down.
  absl::StatusOr<size_t> Receive(bool wait);
  // Up to `size` bytes of the stream into `out`: the buffered ones first;
  // with nothing buffered, one recv, straight into `out` when `size` >=
  // kDirectBytes (with `wait`, for all `size` bytes: MSG_WAITALL; without,
  // the same recv also buffers up to kHeaderFillBytes that follow), else
  // through the buffer. Returns the bytes delivered, 0 as for Receive.
  absl::StatusOr<size_t> ReadSome(void* out, size_t size, bool wait);
  // True once a recv found the peer's end of the stream (as opposed to a
  // failed or reset connection).
  bool peer_closed() const { return peer_closed_; }
  // The last recv returned less than it had room for: the socket held
  // nothing more at that moment, so asking again now would most likely
  // find nothing (a non-blocking owner can wait for readiness instead).
  bool drained() const { return drained_; }

 private:
  // Allocates the buffer if needed and makes room after the buffered bytes:
  // moves a partial message near the buffer's end to its front.
  void MakeRoom();
  // Receive, taking at most `limit` bytes.
  absl::StatusOr<size_t> ReceiveAtMost(bool wait, size_t limit);
  // Turns a failed or empty recv into the answer: 0 for "nothing yet".
  absl::StatusOr<size_t> RecvFailed(ssize_t n, int error);

  int fd_ = -1;
  std::unique_ptr<std::byte[]> in_;
  size_t begin_ = 0;
  size_t end_ = 0;
  // The next recv into the buffer takes at most kHeaderFillBytes: a large
  // payload is being read or was just read.
  bool small_fill_ = false;
  bool peer_closed_ = false;
  bool drained_ = false;
};

// What a non-blocking sender has yet to send on one connection, in order:
// small pieces copied into buffers (answers to many requests then leave in
// one sendmsg), large payloads by reference together with what keeps their
// memory alive, dropped once sent (sendmsg, or vmsplice + splice through a
// PageSender).
//
// Not thread-safe; the fd stays owned by the caller.
class SendQueue {
 public:
  // Most iovecs one sendmsg gets: room for 128 answers with a payload sent
  // from the mapping each (IOV_MAX is 1024).
  static constexpr int kMaxIov = 256;

  // Queues a copy of `size` bytes.
  void Append(const void* data, size_t size);
  // Queues `size` bytes at `data` without copying them; `keep_alive` keeps
  // them mapped until they are sent (or the queue is destroyed). With
  // `splice` they are lent page by page (PageSender) when Send is given one.
  void AppendReference(const std::byte* data, size_t size,
                       std::shared_ptr<const void> keep_alive, bool splice);

  // Sends as much as `fd` takes now; `pages` (may be null) carries the
  // references queued with `splice`. With `wait` (a blocking socket), each
  // sendmsg waits for room up to the socket's SO_SNDTIMEO. OK with whatever
  // is left still queued; UNAVAILABLE when the connection failed.
  absl::Status Send(int fd, PageSender* pages, bool wait = false);

  bool empty() const { return segments_.empty(); }
  // Copied bytes queued (what the queue costs in memory).
  size_t copied_bytes() const { return copied_bytes_; }
  // True while a queued reference has not been sent in full.
  bool holds_reference() const { return references_ > 0; }
  // Bytes of the references queued (sent or not, until each is done).
  size_t referenced_bytes() const { return referenced_bytes_; }
  // Marks the end of a message: everything appended so far.
  void EndMessage() { message_ends_.push_back(appended_); }
  // True when a message has been sent in part: closing now would cut it in
  // the middle (a peer must not take a clean close for the stream's end).
  bool partly_sent() const { return sent_ > last_whole_; }
  // Frees the buffers' memory when nothing is queued.
  void ReleaseIfEmpty();

 private:
  struct Segment {
    std::string copy;                 // copied bytes (when `data` is null)
    const std::byte* data = nullptr;  // referenced bytes
    size_t size = 0;                  // of `data`
    std::shared_ptr<const void> keep_alive;
    bool splice = false;
    size_t sent = 0;  // bytes of this segment gone (lent, for splice)

    const std::byte* bytes() const {
      return data != nullptr ? data
                             : reinterpret_cast<const std::byte*>(copy.data());
    }
    size_t length() const { return data != nullptr ? size : copy.size(); }
  };

  // Sends the front segment with `pages`; false when it has to wait.
  absl::StatusOr<bool> SendSpliced(int fd, PageSender& pages);
  // Counts `bytes` of the front segments as sent, dropping finished ones.
  void Advance(size_t bytes);
  void PopFront();

  std::deque<Segment> segments_;
  // The memory of the last copy buffer sent, for the next copies.
  std::string spare_;
  size_t copied_bytes_ = 0;
  int references_ = 0;
  size_t referenced_bytes_ = 0;
  // Stream offsets: bytes appended and sent, the ends of messages not yet
  // sent in full, and the end of the last message that was.
  uint64_t appended_ = 0;
  uint64_t sent_ = 0;
  std::deque<uint64_t> message_ends_;
  uint64_t last_whole_ = 0;
};

}  // namespace rdma_agent::tcp

#endif  // RDMA_AGENTD_BACKENDS_TCP_BUFFERED_SOCKET_H_

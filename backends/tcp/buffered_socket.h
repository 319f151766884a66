#ifndef RDMA_AGENTD_BACKENDS_TCP_BUFFERED_SOCKET_H_
#define RDMA_AGENTD_BACKENDS_TCP_BUFFERED_SOCKET_H_

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rdma_agent::tcp {

// Buffered I/O on a connected socket, for either end of a connection that
// carries many small messages: one recv takes in as many of them as have
// arrived (not one per header, token and payload), and answers wait in an
// output buffer until the owner has nothing more to read without blocking,
// then go out in one send. Large payloads bypass both buffers (no extra
// copy).
//
// Two ways to read. Blocking (Fill, Read, Skip), for a server thread that
// owns its connection: every blocking read first sends what is queued.
// Step by step (Receive, Take, ReadSome), for an owner that decides itself
// when to wait (the data client, which bounds each wait by a deadline with
// SO_RCVTIMEO): nothing is sent, and "nothing arrived yet" is an answer,
// not an error.
//
// Not thread-safe; the fd stays owned by the caller.
class BufferedSocket {
 public:
  // Reads and writes bigger than this go straight between the socket and
  // the caller's memory.
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
  explicit BufferedSocket(int fd);

  // Starts over on `fd`: whatever was buffered or queued for the previous
  // socket is dropped (the buffer's memory is kept).
  void Reset(int fd);

  int fd() const { return fd_; }
  // Bytes received and not yet consumed.
  size_t buffered() const { return end_ - begin_; }
  // The buffered bytes (valid until the next call).
  const std::byte* data() const { return in_.get() + begin_; }
  // Drops `size` buffered bytes (at most buffered()).
  void Consume(size_t size) { begin_ += size; }
  // Copies up to `size` buffered bytes to `out` and consumes them; returns
  // how many. Never touches the socket.
  size_t Take(void* out, size_t size);

  // Says that the next `size` bytes of the stream are a payload the caller
  // reads with Take and ReadSome: when large, the next recv into the buffer
  // stays small (kHeaderFillBytes). Read does this itself.
  void ExpectPayload(uint64_t size) {
    if (size >= kDirectBytes) small_fill_ = true;
  }

  // One recv into the buffer's free room (a partial message is moved to the
  // front first; at most kHeaderFillBytes during or right after a large
  // payload). With `wait` it blocks until a byte arrives or the
  // socket's receive timeout (SO_RCVTIMEO) passes; without, it returns at
  // once. Returns the bytes received: 0 when none had arrived (or the
  // timeout passed). UNAVAILABLE when the peer closed, or the socket failed
  // or was shut down. Sends nothing.
  absl::StatusOr<size_t> Receive(bool wait);
  // Up to `size` bytes of the stream into `out`: the buffered ones first;
  // with nothing buffered, one recv, straight into `out` when `size` >=
  // kDirectBytes (with `wait`, for all `size` bytes: MSG_WAITALL), else
  // through the buffer. Returns the bytes delivered, 0 as for Receive.
  absl::StatusOr<size_t> ReadSome(void* out, size_t size, bool wait);

  // Sends what is queued, then receives at least one more byte, blocking:
  // UNAVAILABLE when the peer closed or the socket failed or was shut down.
  // Every blocking read goes through here, so no answer waits while this
  // side waits for its peer.
  absl::Status Fill();
  // Copies `size` bytes out, from the buffer first, then straight from the
  // socket.
  absl::Status Read(void* out, size_t size);
  // Drops `size` bytes of the stream.
  absl::Status Skip(uint64_t size);

  // Queues bytes to send; sends what is queued first when they do not fit
  // (or, for `size` >= kBufferBytes, sends them directly after it).
  absl::Status Write(const void* data, size_t size);
  // Sends everything queued.
  absl::Status Flush();
  // Bytes queued, not yet sent.
  size_t unflushed() const { return out_.size(); }

 private:
  // Makes room after the buffered bytes: moves a partial message that
  // reaches the buffer's end to its front.
  void MakeRoom();

  int fd_ = -1;
  std::unique_ptr<std::byte[]> in_;
  size_t begin_ = 0;
  size_t end_ = 0;
  // The next recv into the buffer takes at most kHeaderFillBytes: a large
  // payload is being read or was just read.
  bool small_fill_ = false;
  std::string out_;
};

}  // namespace rdma_agent::tcp

#endif  // RDMA_AGENTD_BACKENDS_TCP_BUFFERED_SOCKET_H_

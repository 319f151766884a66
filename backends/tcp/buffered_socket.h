#ifndef RDMA_AGENTD_BACKENDS_TCP_BUFFERED_SOCKET_H_
#define RDMA_AGENTD_BACKENDS_TCP_BUFFERED_SOCKET_H_

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"

namespace rdma_agent::tcp {

// Buffered blocking I/O on a connected socket, for a server that answers
// many small requests: one recv takes in as many requests as have arrived
// (not one per header, token and payload), and answers wait in an output
// buffer until the server has nothing more to read without blocking, then
// go out in one send. Large payloads bypass both buffers (no extra copy).
// Not thread-safe; the fd stays owned by the caller.
class BufferedSocket {
 public:
  // Reads and writes bigger than this go straight between the socket and
  // the caller's memory.
  static constexpr size_t kBufferBytes = 64 << 10;

  explicit BufferedSocket(int fd);

  int fd() const { return fd_; }
  // Bytes received and not yet consumed.
  size_t buffered() const { return end_ - begin_; }
  // The buffered bytes (valid until the next call).
  const std::byte* data() const { return in_.get() + begin_; }

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
  const int fd_;
  std::unique_ptr<std::byte[]> in_;
  size_t begin_ = 0;
  size_t end_ = 0;
  std::string out_;
};

}  // namespace rdma_agent::tcp

#endif  // RDMA_AGENTD_BACKENDS_TCP_BUFFERED_SOCKET_H_

#include "backends/tcp/buffered_socket.h"

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "backends/tcp/socket_util.h"
#include "common/status_util.h"

namespace rdma_agent::tcp {

BufferedSocket::BufferedSocket(int fd)
    : fd_(fd), in_(new std::byte[kBufferBytes]) {}

void BufferedSocket::Reset(int fd) {
  if (in_ == nullptr) in_.reset(new std::byte[kBufferBytes]);
  fd_ = fd;
  begin_ = end_ = 0;
  small_fill_ = false;
  out_.clear();
}

size_t BufferedSocket::Take(void* out, size_t size) {
  const size_t n = std::min(size, buffered());
  if (n == 0) return 0;
  std::memcpy(out, in_.get() + begin_, n);
  begin_ += n;
  return n;
}

void BufferedSocket::MakeRoom() {
  if (begin_ == end_) {
    begin_ = end_ = 0;
  } else if (begin_ > 0 && kBufferBytes - end_ < kBufferBytes / 4) {
    // Keep the partial message, make room behind it, so that one recv still
    // takes in many messages.
    std::memmove(in_.get(), in_.get() + begin_, end_ - begin_);
    end_ -= begin_;
    begin_ = 0;
  }
}

absl::StatusOr<size_t> BufferedSocket::Receive(bool wait) {
  MakeRoom();
  const size_t room = small_fill_
                          ? std::min(kHeaderFillBytes, kBufferBytes - end_)
                          : kBufferBytes - end_;
  small_fill_ = false;
  while (true) {
    const ssize_t n =
        recv(fd_, in_.get() + end_, room, wait ? 0 : MSG_DONTWAIT);
    if (n > 0) {
      end_ += static_cast<size_t>(n);
      return static_cast<size_t>(n);
    }
    if (n == 0) return absl::UnavailableError("connection closed by peer");
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    if (errno != EINTR) {
      return ErrnoStatus(absl::StatusCode::kUnavailable, "recv", errno);
    }
  }
}

absl::StatusOr<size_t> BufferedSocket::ReadSome(void* out, size_t size,
                                                bool wait) {
  if (size == 0) return 0;
  if (buffered() > 0) return Take(out, size);
  if (size < kDirectBytes) {
    absl::StatusOr<size_t> received = Receive(wait);
    if (!received.ok() || *received == 0) return received;
    return Take(out, size);
  }
  while (true) {
    const ssize_t n =
        recv(fd_, out, size, wait ? MSG_WAITALL : MSG_DONTWAIT);
    if (n > 0) {
      small_fill_ = true;  // the next message's payload may go direct too
      return static_cast<size_t>(n);
    }
    if (n == 0) return absl::UnavailableError("connection closed by peer");
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    if (errno != EINTR) {
      return ErrnoStatus(absl::StatusCode::kUnavailable, "recv", errno);
    }
  }
}

absl::Status BufferedSocket::Fill() {
  // About to block: whoever sent the requests may be waiting for the answers.
  if (absl::Status status = Flush(); !status.ok()) return status;
  absl::StatusOr<size_t> received = Receive(/*wait=*/true);
  if (!received.ok()) return received.status();
  // Only a receive timeout ends a blocking recv with nothing, and a blocking
  // owner sets none: the socket is not what it expects.
  if (*received == 0) return absl::UnavailableError("receive timed out");
  return absl::OkStatus();
}

absl::Status BufferedSocket::Read(void* out, size_t size) {
  ExpectPayload(size);
  auto* p = static_cast<std::byte*>(out);
  const size_t from_buffer = std::min(size, buffered());
  std::memcpy(p, in_.get() + begin_, from_buffer);
  begin_ += from_buffer;
  p += from_buffer;
  size -= from_buffer;
  if (size == 0) return absl::OkStatus();
  if (size >= kDirectBytes) {
    small_fill_ = true;
    return ReadFull(fd_, p, size);
  }
  while (size > 0) {
    if (absl::Status status = Fill(); !status.ok()) return status;
    const size_t n = std::min(size, buffered());
    std::memcpy(p, in_.get() + begin_, n);
    begin_ += n;
    p += n;
    size -= n;
  }
  return absl::OkStatus();
}

absl::Status BufferedSocket::Skip(uint64_t size) {
  while (size > 0) {
    if (buffered() == 0) {
      if (absl::Status status = Fill(); !status.ok()) return status;
    }
    const size_t n =
        static_cast<size_t>(std::min<uint64_t>(size, buffered()));
    begin_ += n;
    size -= n;
  }
  return absl::OkStatus();
}

absl::Status BufferedSocket::Write(const void* data, size_t size) {
  if (out_.size() + size <= kBufferBytes) {
    out_.append(static_cast<const char*>(data), size);
    return absl::OkStatus();
  }
  if (size < kBufferBytes) {
    if (absl::Status status = Flush(); !status.ok()) return status;
    out_.append(static_cast<const char*>(data), size);
    return absl::OkStatus();
  }
  // Large: what is queued and these bytes in one call, no copy.
  iovec iov[2] = {{out_.data(), out_.size()},
                  {const_cast<void*>(data), size}};
  absl::Status status = WriteFull(fd_, iov, 2, 0);
  out_.clear();
  return status;
}

absl::Status BufferedSocket::Flush() {
  if (out_.empty()) return absl::OkStatus();
  iovec iov{out_.data(), out_.size()};
  absl::Status status = WriteFull(fd_, &iov, 1, 0);
  out_.clear();
  return status;
}

}  // namespace rdma_agent::tcp

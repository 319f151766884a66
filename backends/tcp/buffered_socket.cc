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

absl::Status BufferedSocket::Fill() {
  // About to block: whoever sent the requests may be waiting for the answers.
  if (absl::Status status = Flush(); !status.ok()) return status;
  if (begin_ == end_) {
    begin_ = end_ = 0;
  } else if (end_ == kBufferBytes) {
    // Keep the partial request, make room behind it.
    std::memmove(in_.get(), in_.get() + begin_, end_ - begin_);
    end_ -= begin_;
    begin_ = 0;
  }
  while (true) {
    const ssize_t n = recv(fd_, in_.get() + end_, kBufferBytes - end_, 0);
    if (n > 0) {
      end_ += static_cast<size_t>(n);
      return absl::OkStatus();
    }
    if (n == 0) return absl::UnavailableError("connection closed by peer");
    if (errno != EINTR) {
      return ErrnoStatus(absl::StatusCode::kUnavailable, "recv", errno);
    }
  }
}

absl::Status BufferedSocket::Read(void* out, size_t size) {
  auto* p = static_cast<std::byte*>(out);
  const size_t from_buffer = std::min(size, buffered());
  std::memcpy(p, in_.get() + begin_, from_buffer);
  begin_ += from_buffer;
  p += from_buffer;
  size -= from_buffer;
  if (size == 0) return absl::OkStatus();
  if (size >= kBufferBytes) return ReadFull(fd_, p, size);
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

#include "backends/tcp/buffered_socket.h"

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "common/status_util.h"

namespace rdma_agent::tcp {

void BufferedSocket::Reset(int fd) {
  fd_ = fd;
  begin_ = end_ = 0;
  small_fill_ = false;
  peer_closed_ = false;
  drained_ = false;
}

void BufferedSocket::ReleaseIfEmpty() {
  if (buffered() > 0) return;
  in_.reset();
  begin_ = end_ = 0;
}

void BufferedSocket::LendBuffer(std::unique_ptr<std::byte[]> buffer) {
  in_ = std::move(buffer);
  begin_ = end_ = 0;
}

std::unique_ptr<std::byte[]> BufferedSocket::TakeBuffer() {
  begin_ = end_ = 0;
  return std::move(in_);
}

size_t BufferedSocket::Take(void* out, size_t size) {
  const size_t n = std::min(size, buffered());
  if (n == 0) return 0;
  std::memcpy(out, in_.get() + begin_, n);
  begin_ += n;
  return n;
}

void BufferedSocket::MakeRoom() {
  if (in_ == nullptr) in_.reset(new std::byte[kBufferBytes]);
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

absl::StatusOr<size_t> BufferedSocket::RecvFailed(ssize_t n, int error) {
  drained_ = true;
  if (n == 0) {
    peer_closed_ = true;
    return absl::UnavailableError("connection closed by peer");
  }
  if (error == EAGAIN || error == EWOULDBLOCK) return 0;
  return ErrnoStatus(absl::StatusCode::kUnavailable, "recv", error);
}

absl::StatusOr<size_t> BufferedSocket::Receive(bool wait) {
  return ReceiveAtMost(wait, kBufferBytes);
}

absl::StatusOr<size_t> BufferedSocket::ReceiveAtMost(bool wait, size_t limit) {
  MakeRoom();
  const size_t room = std::min({limit, kBufferBytes - end_,
                                small_fill_ ? kHeaderFillBytes : kBufferBytes});
  small_fill_ = false;
  while (true) {
    const ssize_t n =
        recv(fd_, in_.get() + end_, room, wait ? 0 : MSG_DONTWAIT);
    if (n > 0) {
      end_ += static_cast<size_t>(n);
      drained_ = static_cast<size_t>(n) < room;
      return static_cast<size_t>(n);
    }
    if (n < 0 && errno == EINTR) continue;
    return RecvFailed(n, errno);
  }
}

absl::StatusOr<size_t> BufferedSocket::ReadSome(void* out, size_t size,
                                                bool wait) {
  if (size == 0) return 0;
  if (buffered() > 0) return Take(out, size);
  if (size < kDirectBytes) {
    // The rest of a payload: all of it, and after a large one only a
    // header's worth more (the next payload may go direct).
    const size_t limit = small_fill_ ? size + kHeaderFillBytes : kBufferBytes;
    small_fill_ = false;
    absl::StatusOr<size_t> received = ReceiveAtMost(wait, limit);
    if (!received.ok() || *received == 0) return received;
    return Take(out, size);
  }
  // Without waiting, the same recv also takes the start of what follows
  // (a header's worth) into the buffer: one system call per message
  // instead of two. Waiting (MSG_WAITALL) it must not: it would wait for
  // bytes that may never come.
  MakeRoom();
  iovec iov[2] = {{out, size},
                  {in_.get() + end_,
                   wait ? 0 : std::min(kHeaderFillBytes, kBufferBytes - end_)}};
  msghdr message{};
  message.msg_iov = iov;
  message.msg_iovlen = iov[1].iov_len > 0 ? 2 : 1;
  while (true) {
    const ssize_t n = recvmsg(fd_, &message, wait ? MSG_WAITALL : MSG_DONTWAIT);
    if (n > 0) {
      small_fill_ = true;  // the next message's payload may go direct too
      const size_t got = static_cast<size_t>(n);
      drained_ = got < size + iov[1].iov_len;
      if (got <= size) return got;
      end_ += got - size;
      return size;
    }
    if (n < 0 && errno == EINTR) continue;
    return RecvFailed(n, errno);
  }
}

void SendQueue::Append(const void* data, size_t size) {
  if (size == 0) return;
  // Into the last copy buffer while it is small, so that many answers make
  // one iovec; a new one otherwise (never moving bytes already queued).
  if (segments_.empty() || segments_.back().data != nullptr ||
      segments_.back().copy.size() >= BufferedSocket::kBufferBytes) {
    // Into the memory of a copy buffer already sent, if there is one.
    segments_.emplace_back().copy = std::move(spare_);
    segments_.back().copy.clear();
    spare_.clear();
  }
  segments_.back().copy.append(static_cast<const char*>(data), size);
  copied_bytes_ += size;
  appended_ += size;
}

void SendQueue::AppendReference(const std::byte* data, size_t size,
                                std::shared_ptr<const void> keep_alive,
                                bool splice) {
  if (size == 0) return;
  Segment& segment = segments_.emplace_back();
  segment.data = data;
  segment.size = size;
  segment.keep_alive = std::move(keep_alive);
  segment.splice = splice;
  ++references_;
  referenced_bytes_ += size;
  appended_ += size;
}

void SendQueue::ReleaseIfEmpty() {
  if (!segments_.empty()) return;
  // A deque keeps a block of its own; an idle connection keeps nothing.
  std::deque<Segment>().swap(segments_);
  std::deque<uint64_t>().swap(message_ends_);
  std::string().swap(spare_);
}

void SendQueue::PopFront() {
  Segment& front = segments_.front();
  if (front.data != nullptr) {
    --references_;
    referenced_bytes_ -= front.size;
  } else {
    copied_bytes_ -= front.copy.size();
    // Kept for the next copies: answers then cost no allocation.
    if (front.copy.capacity() > spare_.capacity()) {
      spare_ = std::move(front.copy);
    }
  }
  segments_.pop_front();
}

void SendQueue::Advance(size_t bytes) {
  sent_ += bytes;
  while (!message_ends_.empty() && message_ends_.front() <= sent_) {
    last_whole_ = message_ends_.front();
    message_ends_.pop_front();
  }
  while (bytes > 0) {
    Segment& front = segments_.front();
    const size_t rest = front.length() - front.sent;
    if (bytes < rest) {
      front.sent += bytes;
      return;
    }
    bytes -= rest;
    PopFront();
  }
}

absl::StatusOr<bool> SendQueue::SendSpliced(int fd, PageSender& pages) {
  Segment& front = segments_.front();
  absl::StatusOr<size_t> lent =
      pages.SendSome(fd, front.data + front.sent, front.size - front.sent,
                     /*more=*/segments_.size() > 1);
  if (!lent.ok()) return lent.status();
  // Lent bytes count as sent; the segment (and what keeps its pages) goes
  // only once the pipe has passed them all to the socket.
  front.sent += *lent;
  sent_ += *lent;
  if (front.sent < front.size || pages.pending() > 0) return false;
  front.sent = 0;  // Advance counts nothing more for it
  sent_ -= front.size;
  Advance(front.size);
  return true;
}

absl::Status SendQueue::Send(int fd, PageSender* pages, bool wait) {
  while (!segments_.empty()) {
    if (segments_.front().splice && pages != nullptr) {
      absl::StatusOr<bool> done = SendSpliced(fd, *pages);
      if (!done.ok()) return done.status();
      if (!*done) return absl::OkStatus();
      continue;
    }
    iovec iov[kMaxIov];
    int count = 0;
    size_t offered = 0;
    for (auto it = segments_.begin();
         it != segments_.end() && count < kMaxIov &&
         !(it->splice && pages != nullptr);
         ++it) {
      iov[count++] = {const_cast<std::byte*>(it->bytes()) + it->sent,
                      it->length() - it->sent};
      offered += it->length() - it->sent;
    }
    msghdr message{};
    message.msg_iov = iov;
    message.msg_iovlen = static_cast<size_t>(count);
    const ssize_t n =
        sendmsg(fd, &message, MSG_NOSIGNAL | (wait ? 0 : MSG_DONTWAIT));
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return absl::OkStatus();
      return ErrnoStatus(absl::StatusCode::kUnavailable, "send", errno);
    }
    Advance(static_cast<size_t>(n));
    // Took less than offered: the socket is full now. Asking again would
    // only find that out (EAGAIN); the owner waits for writability instead.
    if (static_cast<size_t>(n) < offered) return absl::OkStatus();
  }
  return absl::OkStatus();
}

}  // namespace rdma_agent::tcp

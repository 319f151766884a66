#include "backends/tcp/socket_util.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace rdma_agent::tcp {
namespace {

absl::Status ErrnoStatus(absl::StatusCode code, absl::string_view what,
                         int error) {
  return absl::Status(code, absl::StrCat(what, ": ", std::strerror(error)));
}

// Resolves `address` to socket addresses; the caller frees with freeaddrinfo.
absl::StatusOr<addrinfo*> Resolve(const HostPort& address, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* result = nullptr;
  const std::string port = std::to_string(address.port);
  const char* host =
      passive && IsWildcardHost(address.host) ? nullptr : address.host.c_str();
  const int rc = getaddrinfo(host, port.c_str(), &hints, &result);
  if (rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve ", JoinHostPort(address.host, address.port),
                     ": ", gai_strerror(rc)));
  }
  return result;
}

}  // namespace

void ConfigureDataSocket(int fd, int socket_buffer_bytes) {
  const int one = 1;
  // Responses and small requests must not wait for Nagle.
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  // A peer that vanished (host down, link cut) must not hold a serving thread
  // and the registration it pinned forever: keepalive probes find an idle
  // dead connection within ~45 s, and unacknowledged data gives up after
  // 60 s. Client ops are bounded by their deadline anyway.
  const int idle_seconds = 30, interval_seconds = 5, probes = 3;
  const unsigned int user_timeout_ms = 60000;
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle_seconds, sizeof(int));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval_seconds, sizeof(int));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(int));
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms,
             sizeof(user_timeout_ms));
  if (socket_buffer_bytes > 0) {
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &socket_buffer_bytes, sizeof(int));
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &socket_buffer_bytes, sizeof(int));
  }
}

absl::StatusOr<UniqueFd> ListenTcp(const HostPort& address,
                                   uint16_t* bound_port) {
  auto resolved = Resolve(address, /*passive=*/true);
  if (!resolved.ok()) return resolved.status();
  absl::Status last = absl::UnavailableError(
      absl::StrCat("no address to listen on for ", address.host));
  for (addrinfo* ai = *resolved; ai != nullptr; ai = ai->ai_next) {
    UniqueFd fd(socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC,
                       ai->ai_protocol));
    if (!fd) {
      last = ErrnoStatus(absl::StatusCode::kInternal, "socket", errno);
      continue;
    }
    const int one = 1;
    setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
      last = ErrnoStatus(
          absl::StatusCode::kUnavailable,
          absl::StrCat("bind ", JoinHostPort(address.host, address.port)),
          errno);
      continue;
    }
    if (listen(fd.get(), SOMAXCONN) != 0) {
      last = ErrnoStatus(absl::StatusCode::kInternal, "listen", errno);
      continue;
    }
    sockaddr_storage bound{};
    socklen_t length = sizeof(bound);
    getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &length);
    *bound_port = ntohs(bound.ss_family == AF_INET6
                            ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                            : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    freeaddrinfo(*resolved);
    return fd;
  }
  freeaddrinfo(*resolved);
  return last;
}

absl::StatusOr<UniqueFd> DialTcp(const HostPort& address, absl::Time deadline,
                                 int socket_buffer_bytes) {
  const std::string name = JoinHostPort(address.host, address.port);
  auto resolved = Resolve(address, /*passive=*/false);
  if (!resolved.ok()) return resolved.status();
  absl::Status last =
      absl::UnavailableError(absl::StrCat("no address for ", name));
  for (addrinfo* ai = *resolved; ai != nullptr; ai = ai->ai_next) {
    UniqueFd fd(socket(ai->ai_family,
                       ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK,
                       ai->ai_protocol));
    if (!fd) {
      last = ErrnoStatus(absl::StatusCode::kInternal, "socket", errno);
      continue;
    }
    // Before connect, so the window scale matches the buffer.
    ConfigureDataSocket(fd.get(), socket_buffer_bytes);
    if (connect(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) {
        last = ErrnoStatus(absl::StatusCode::kUnavailable,
                           absl::StrCat("connect to ", name), errno);
        continue;
      }
      // Wait for the handshake, never past the deadline.
      pollfd p{fd.get(), POLLOUT, 0};
      int ready = 0;
      while (true) {
        const absl::Duration left = deadline - absl::Now();
        if (left <= absl::ZeroDuration()) break;
        const timespec timeout = absl::ToTimespec(left);
        ready = ppoll(&p, 1, &timeout, nullptr);
        if (ready >= 0 || errno != EINTR) break;
      }
      if (ready <= 0) {
        freeaddrinfo(*resolved);
        return absl::DeadlineExceededError(
            absl::StrCat("deadline passed while connecting to ", name));
      }
      int error = 0;
      socklen_t length = sizeof(error);
      getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &error, &length);
      if (error != 0) {
        last = ErrnoStatus(absl::StatusCode::kUnavailable,
                           absl::StrCat("connect to ", name), error);
        continue;
      }
    }
    // Blocking from now on: each call says whether it may wait.
    const int flags = fcntl(fd.get(), F_GETFL);
    fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK);
    freeaddrinfo(*resolved);
    return fd;
  }
  freeaddrinfo(*resolved);
  return last;
}

void SetIoTimeout(int fd, bool receive, absl::Duration timeout) {
  const timeval tv = absl::ToTimeval(std::max(timeout, absl::Milliseconds(1)));
  setsockopt(fd, SOL_SOCKET, receive ? SO_RCVTIMEO : SO_SNDTIMEO, &tv,
             sizeof(tv));
}

absl::Status ReadFull(int fd, void* data, size_t size) {
  auto* p = static_cast<char*>(data);
  while (size > 0) {
    const ssize_t n = recv(fd, p, size, MSG_WAITALL);
    if (n > 0) {
      p += n;
      size -= static_cast<size_t>(n);
    } else if (n == 0) {
      return absl::UnavailableError("connection closed by peer");
    } else if (errno != EINTR) {
      return ErrnoStatus(absl::StatusCode::kUnavailable, "recv", errno);
    }
  }
  return absl::OkStatus();
}

absl::Status WriteFull(int fd, iovec* iov, int iov_count, int flags) {
  while (iov_count > 0) {
    msghdr message{};
    message.msg_iov = iov;
    message.msg_iovlen = static_cast<size_t>(iov_count);
    ssize_t n = sendmsg(fd, &message, MSG_NOSIGNAL | flags);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(absl::StatusCode::kUnavailable, "send", errno);
    }
    // Skip what was sent.
    while (iov_count > 0 && static_cast<size_t>(n) >= iov->iov_len) {
      n -= static_cast<ssize_t>(iov->iov_len);
      ++iov;
      --iov_count;
    }
    if (iov_count > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + n;
      iov->iov_len -= static_cast<size_t>(n);
    }
  }
  return absl::OkStatus();
}

absl::Status Discard(int fd, uint64_t size) {
  char scratch[64 * 1024];
  while (size > 0) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(size, sizeof(scratch)));
    if (absl::Status status = ReadFull(fd, scratch, n); !status.ok()) {
      return status;
    }
    size -= n;
  }
  return absl::OkStatus();
}

absl::StatusOr<PageSender> PageSender::Create() {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    return ErrnoStatus(absl::StatusCode::kInternal, "pipe2", errno);
  }
  UniqueFd read(fds[0]);
  UniqueFd write(fds[1]);
  const int capacity = fcntl(write.get(), F_SETPIPE_SZ, static_cast<int>(kPipeBytes));
  const int actual = capacity > 0 ? capacity : fcntl(write.get(), F_GETPIPE_SZ);
  if (actual <= 0) {
    return ErrnoStatus(absl::StatusCode::kInternal, "F_GETPIPE_SZ", errno);
  }
  return PageSender(std::move(read), std::move(write),
                    static_cast<size_t>(actual));
}

absl::Status PageSender::Send(int fd, const std::byte* data, size_t size,
                              bool more, size_t* sent) {
  auto failure = [](absl::string_view what, int error) {
    return error == EAGAIN || error == EWOULDBLOCK
               ? absl::DeadlineExceededError(
                     absl::StrCat(what, ": send timed out"))
               : ErrnoStatus(absl::StatusCode::kUnavailable, what, error);
  };
  size_t done = 0;
  while (done < size) {
    iovec iov{const_cast<std::byte*>(data + done),
              std::min(size - done, capacity_)};
    const ssize_t lent = vmsplice(write_.get(), &iov, 1, 0);
    if (lent < 0) {
      if (errno == EINTR) continue;
      return failure("vmsplice", errno);
    }
    for (ssize_t moved = 0; moved < lent;) {
      const bool last = done + static_cast<size_t>(lent) == size;
      const ssize_t n = splice(read_.get(), nullptr, fd, nullptr,
                               static_cast<size_t>(lent - moved),
                               SPLICE_F_MOVE | (more || !last ? SPLICE_F_MORE : 0));
      if (n < 0) {
        if (errno == EINTR) continue;
        *sent += done + static_cast<size_t>(moved);
        return failure("splice", errno);
      }
      if (n == 0) {
        *sent += done + static_cast<size_t>(moved);
        return absl::UnavailableError("splice: connection closed");
      }
      moved += n;
    }
    done += static_cast<size_t>(lent);
  }
  *sent += done;
  return absl::OkStatus();
}

bool IdleConnectionAlive(int fd) {
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, 0) == 0) return true;
  // Readable while idle: EOF, an error or bytes nobody asked for.
  return false;
}

}  // namespace rdma_agent::tcp

#include "backends/tcp/socket_util.h"

#include <arpa/inet.h>
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
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "backends/tcp/wire.h"
#include "common/status_util.h"

namespace rdma_agent::tcp {
namespace {

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
    return absl::UnavailableError(absl::StrCat(
        "cannot resolve ", JoinHostPort(address.host, address.port), ": ",
        gai_strerror(rc)));
  }
  return result;
}

}  // namespace

void ConfigureDataSocket(int fd, int socket_buffer_bytes) {
  const int one = 1;
  // Responses and small requests must not wait for Nagle.
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  // A peer that vanished (host down, link cut) must not hold a connection
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
    UniqueFd fd(
        socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
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

namespace {

// How often a wait of the client's dial looks at its stop check: the bound
// on how late a cancellation is noticed when nothing else wakes the wait.
constexpr absl::Duration kStopCheckInterval = absl::Milliseconds(20);

bool Stopped(const StopCheck& stopped) { return stopped && stopped(); }

// Waits until `fd` has one of `events` (then OK), `until` passes
// (DEADLINE_EXCEEDED) or `stopped` (CANCELLED).
absl::Status WaitForEvents(int fd, short events, absl::Time until,
                           const StopCheck& stopped) {
  while (true) {
    if (Stopped(stopped)) return absl::CancelledError("stopped");
    const absl::Duration left = until - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError("timed out");
    }
    const timespec timeout =
        absl::ToTimespec(std::min(left, kStopCheckInterval));
    pollfd p{fd, events, 0};
    const int ready = ppoll(&p, 1, &timeout, nullptr);
    if (ready > 0) return absl::OkStatus();
    if (ready < 0 && errno != EINTR) {
      return ErrnoStatus(absl::StatusCode::kUnavailable, "poll", errno);
    }
  }
}

// `host` without the brackets of a bracketed IPv6 literal.
absl::string_view Unbracketed(absl::string_view host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    return host.substr(1, host.size() - 2);
  }
  return host;
}

std::optional<PeerAddress> ParseIpLiteral(const HostPort& address) {
  const std::string host(Unbracketed(address.host));
  PeerAddress peer;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&peer.storage);
  if (inet_pton(AF_INET, host.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(address.port);
    peer.length = sizeof(sockaddr_in);
    return peer;
  }
  peer = PeerAddress();
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&peer.storage);
  if (inet_pton(AF_INET6, host.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(address.port);
    peer.length = sizeof(sockaddr_in6);
    return peer;
  }
  return std::nullopt;
}

// One getaddrinfo_a request. glibc writes into it until the lookup ends, so
// it must not move and must outlive the lookup.
struct NameLookup {
  std::string host;
  std::string port;
  addrinfo hints{};
  gaicb request{};
  gaicb* list[1] = {&request};
};

// Lookups that outlived their caller's wait, freed once glibc is done.
absl::Mutex orphans_mu(absl::kConstInit);
std::vector<std::unique_ptr<NameLookup>>* orphans ABSL_GUARDED_BY(orphans_mu) =
    nullptr;

void ReapFinishedLookups() {
  absl::MutexLock lock(&orphans_mu);
  if (orphans == nullptr) return;
  for (auto it = orphans->begin(); it != orphans->end();) {
    if (gai_error(&(*it)->request) == EAI_INPROGRESS) {
      ++it;
      continue;
    }
    if ((*it)->request.ar_result != nullptr) {
      freeaddrinfo((*it)->request.ar_result);
    }
    it = orphans->erase(it);
  }
}

void Orphan(std::unique_ptr<NameLookup> lookup) {
  absl::MutexLock lock(&orphans_mu);
  if (orphans == nullptr) {
    orphans = new std::vector<std::unique_ptr<NameLookup>>();
  }
  orphans->push_back(std::move(lookup));
}

absl::StatusOr<std::vector<PeerAddress>> ResolveName(const HostPort& address,
                                                     absl::Time until,
                                                     const StopCheck& stopped) {
  ReapFinishedLookups();
  auto lookup = std::make_unique<NameLookup>();
  lookup->host = address.host;
  lookup->port = std::to_string(address.port);
  lookup->hints.ai_family = AF_UNSPEC;
  lookup->hints.ai_socktype = SOCK_STREAM;
  lookup->hints.ai_flags = AI_NUMERICSERV;
  lookup->request.ar_name = lookup->host.c_str();
  lookup->request.ar_service = lookup->port.c_str();
  lookup->request.ar_request = &lookup->hints;
  const int started = getaddrinfo_a(GAI_NOWAIT, lookup->list, 1, nullptr);
  if (started != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot start the lookup: ", gai_strerror(started)));
  }
  int rc = EAI_INPROGRESS;
  absl::Status waited = absl::OkStatus();
  while ((rc = gai_error(&lookup->request)) == EAI_INPROGRESS) {
    if (Stopped(stopped)) {
      waited = absl::CancelledError("stopped");
      break;
    }
    const absl::Duration left = until - absl::Now();
    if (left <= absl::ZeroDuration()) {
      waited = absl::DeadlineExceededError("name resolution timed out");
      break;
    }
    const timespec slice = absl::ToTimespec(std::min(left, kStopCheckInterval));
    gai_suspend(lookup->list, 1, &slice);
  }
  if (!waited.ok()) {
    if (gai_cancel(&lookup->request) != EAI_CANCELED) Orphan(std::move(lookup));
    return waited;
  }
  if (rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve: ", gai_strerror(rc)));
  }
  std::vector<PeerAddress> addresses;
  for (addrinfo* ai = lookup->request.ar_result; ai != nullptr;
       ai = ai->ai_next) {
    if (ai->ai_addrlen > sizeof(sockaddr_storage)) continue;
    if (ai->ai_family != AF_INET && ai->ai_family != AF_INET6) continue;
    PeerAddress peer;
    std::memcpy(&peer.storage, ai->ai_addr, ai->ai_addrlen);
    peer.length = ai->ai_addrlen;
    addresses.push_back(peer);
  }
  freeaddrinfo(lookup->request.ar_result);
  if (addresses.empty()) {
    return absl::UnavailableError("the name has no IPv4/IPv6 address");
  }
  return addresses;
}

}  // namespace

bool IsIpLiteral(absl::string_view host) {
  return ParseIpLiteral(HostPort{std::string(host), 0}).has_value();
}

absl::StatusOr<std::vector<PeerAddress>> ResolvePeer(const HostPort& address,
                                                     absl::Time until,
                                                     const StopCheck& stopped) {
  if (std::optional<PeerAddress> literal = ParseIpLiteral(address)) {
    return std::vector<PeerAddress>{*literal};
  }
  return ResolveName(address, until, stopped);
}

absl::StatusOr<UniqueFd> OpenDataSocket(const PeerAddress& address,
                                        int socket_buffer_bytes) {
  UniqueFd fd(socket(address.family(),
                     SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, IPPROTO_TCP));
  if (!fd) {
    const int error = errno;
    const bool exhausted = error == EMFILE || error == ENFILE ||
                           error == ENOBUFS || error == ENOMEM;
    return ErrnoStatus(exhausted ? absl::StatusCode::kResourceExhausted
                                 : absl::StatusCode::kInternal,
                       "socket", error);
  }
  // Before connect, so the window scale matches the buffer.
  ConfigureDataSocket(fd.get(), socket_buffer_bytes);
  return fd;
}

absl::Status ConnectSocket(int fd, const PeerAddress& address, absl::Time until,
                           const StopCheck& stopped) {
  if (connect(fd, reinterpret_cast<const sockaddr*>(&address.storage),
              address.length) == 0) {
    return absl::OkStatus();
  }
  if (errno != EINPROGRESS) {
    return ErrnoStatus(absl::StatusCode::kUnavailable, "connect", errno);
  }
  if (absl::Status ready = WaitForEvents(fd, POLLOUT, until, stopped);
      !ready.ok()) {
    return ready;
  }
  if (Stopped(stopped)) return absl::CancelledError("stopped");
  int error = 0;
  socklen_t length = sizeof(error);
  getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length);
  if (error != 0) {
    return ErrnoStatus(absl::StatusCode::kUnavailable, "connect", error);
  }
  return absl::OkStatus();
}

absl::Status ReadServerHello(int fd, absl::Time until,
                             const StopCheck& stopped) {
  std::byte hello[kServerHelloBytes];
  size_t got = 0;
  while (got < sizeof(hello)) {
    if (absl::Status ready = WaitForEvents(fd, POLLIN, until, stopped);
        !ready.ok()) {
      return ready;
    }
    const ssize_t n = recv(fd, hello + got, sizeof(hello) - got, MSG_DONTWAIT);
    if (n == 0) {
      return absl::UnavailableError("closed before sending a hello");
    }
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return ErrnoStatus(absl::StatusCode::kUnavailable, "recv", errno);
    }
    got += static_cast<size_t>(n);
  }
  if (absl::Status valid = DecodeServerHello(hello); !valid.ok()) {
    return absl::UnavailableError(
        absl::StrCat("not an rdma-agentd data port (", valid.message(), ")"));
  }
  return absl::OkStatus();
}

void SetBlocking(int fd) {
  const int flags = fcntl(fd, F_GETFL);
  fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
}

absl::StatusOr<UniqueFd> DialTcp(const HostPort& address, absl::Time deadline,
                                 int socket_buffer_bytes) {
  const std::string name = JoinHostPort(address.host, address.port);
  auto in_context = [&](const absl::Status& status) {
    if (absl::IsDeadlineExceeded(status)) {
      return absl::DeadlineExceededError(
          absl::StrCat("deadline passed while connecting to ", name));
    }
    return Prefixed(status, absl::StrCat("connect to ", name));
  };
  auto resolved = ResolvePeer(address, deadline, nullptr);
  if (!resolved.ok()) return in_context(resolved.status());
  absl::Status last =
      absl::UnavailableError(absl::StrCat("no address for ", name));
  for (const PeerAddress& peer : *resolved) {
    auto fd = OpenDataSocket(peer, socket_buffer_bytes);
    if (!fd.ok()) {
      last = fd.status();
      continue;
    }
    const absl::Status connected =
        ConnectSocket(fd->get(), peer, deadline, nullptr);
    if (absl::IsDeadlineExceeded(connected)) return in_context(connected);
    if (!connected.ok()) {
      last = in_context(connected);
      continue;
    }
    // Blocking from now on: each call says whether it may wait.
    SetBlocking(fd->get());
    return std::move(*fd);
  }
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
    const size_t n =
        static_cast<size_t>(std::min<uint64_t>(size, sizeof(scratch)));
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
  const int capacity =
      fcntl(write.get(), F_SETPIPE_SZ, static_cast<int>(kPipeBytes));
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
      const ssize_t n = splice(
          read_.get(), nullptr, fd, nullptr, static_cast<size_t>(lent - moved),
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

absl::StatusOr<size_t> PageSender::SendSome(int fd, const std::byte* data,
                                            size_t size, bool more) {
  size_t lent = 0;
  while (true) {
    // What is in the pipe goes first: it precedes `data` in the stream.
    while (in_pipe_ > 0) {
      const bool last = lent == size && !more;
      const ssize_t n = splice(
          read_.get(), nullptr, fd, nullptr, in_pipe_,
          SPLICE_F_MOVE | SPLICE_F_NONBLOCK | (last ? 0 : SPLICE_F_MORE));
      if (n > 0) {
        in_pipe_ -= static_cast<size_t>(n);
        continue;
      }
      if (n == 0) return absl::UnavailableError("splice: connection closed");
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return lent;
      return ErrnoStatus(absl::StatusCode::kUnavailable, "splice", errno);
    }
    if (lent == size) return lent;
    // The pipe is empty, so this never waits.
    iovec iov{const_cast<std::byte*>(data + lent),
              std::min(size - lent, capacity_)};
    const ssize_t n = vmsplice(write_.get(), &iov, 1, SPLICE_F_NONBLOCK);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(absl::StatusCode::kUnavailable, "vmsplice", errno);
    }
    lent += static_cast<size_t>(n);
    in_pipe_ += static_cast<size_t>(n);
  }
}

bool IdleConnectionAlive(int fd) {
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, 0) == 0) return true;
  // Readable while idle: EOF, an error or bytes nobody asked for.
  return false;
}

}  // namespace rdma_agent::tcp

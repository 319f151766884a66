#include "daemon/peer_gate.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <grpcpp/server_context.h>
#include <grpcpp/support/server_interceptor.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/net_address.h"
#include "common/rate_limited_log.h"
#include "common/status_util.h"
#include "spdlog/spdlog.h"

namespace rdma_agent {
namespace {

// Bytes in flight per direction of one connection: Peer messages are at
// most 64 KiB, and most are a few hundred bytes.
constexpr size_t kBufferBytes = 16 << 10;

// How often connections past their arrival limit are looked for.
constexpr absl::Duration kScanInterval = absl::Milliseconds(50);

bool SetNonBlocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL);
  return flags >= 0 && ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0;
}

// "ipv4:10.0.0.2:5555" as gRPC would name it, and the source "10.0.0.2".
std::pair<std::string, std::string> NameAddress(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET6) {
    const auto& in6 = reinterpret_cast<const sockaddr_in6&>(ss);
    ::inet_ntop(AF_INET6, &in6.sin6_addr, host, sizeof(host));
    return {absl::StrCat("ipv6:[", host, "]:", ntohs(in6.sin6_port)),
            absl::StrCat("[", host, "]")};
  }
  const auto& in4 = reinterpret_cast<const sockaddr_in&>(ss);
  ::inet_ntop(AF_INET, &in4.sin_addr, host, sizeof(host));
  return {absl::StrCat("ipv4:", host, ":", ntohs(in4.sin_port)), host};
}

absl::StatusOr<UniqueFd> Listen(const std::string& listen, uint16_t* port) {
  auto address = ParseHostPort(listen);
  if (!address.ok()) return address.status();
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = absl::StrCat(address->port);
  const std::string host =
      IsWildcardHost(address->host) ? "0.0.0.0" : address->host;
  if (const int error =
          ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found);
      error != 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen for peers on ", listen, ": ", ::gai_strerror(error)));
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> owned(found,
                                                             ::freeaddrinfo);
  UniqueFd fd(::socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  const int one = 1;
  if (!fd ||
      ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) !=
          0 ||
      ::bind(fd.get(), found->ai_addr, found->ai_addrlen) != 0 ||
      ::listen(fd.get(), SOMAXCONN) != 0) {
    return ErrnoStatus(absl::StatusCode::kUnavailable,
                       absl::StrCat("cannot listen for peers on ", listen),
                       errno);
  }
  sockaddr_storage bound = {};
  socklen_t length = sizeof(bound);
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &length);
  *port = ntohs(bound.ss_family == AF_INET6
                    ? reinterpret_cast<sockaddr_in6&>(bound).sin6_port
                    : reinterpret_cast<sockaddr_in&>(bound).sin_port);
  return fd;
}

}  // namespace

// One admitted connection (outer: the peer's TCP socket) spliced to one
// connection to gRPC (inner).
struct PeerGate::Pipe {
  struct Buffer {
    char data[kBufferBytes];
    size_t begin = 0;
    size_t end = 0;
    bool empty() const { return begin == end; }
    bool full() const { return end == sizeof(data); }
  };

  uint64_t serial = 0;
  std::string name;    // "ipv4:A.B.C.D:P/N": gRPC's peer() without prefix
  std::string source;  // "A.B.C.D"
  UniqueFd outer;
  UniqueFd inner;
  absl::Time accepted;
  std::atomic<bool> arrived{false};
  Buffer to_inner;
  Buffer to_outer;
  bool outer_eof = false;
  bool inner_eof = false;
};

absl::StatusOr<std::unique_ptr<PeerGate>> PeerGate::Start(
    const std::string& listen, std::string backend_path,
    PeerListenerLimits limits) {
  if (limits.max_connections < 1 || limits.max_connections_per_source < 1 ||
      limits.call_arrival_timeout <= absl::ZeroDuration() ||
      limits.max_connection_age <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "--peer_max_connections and --peer_max_connections_per_source must "
        "be at least 1, --peer_call_arrival_timeout and "
        "--peer_max_connection_age positive");
  }
  if (backend_path.size() >= sizeof(sockaddr_un{}.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the Peer server's socket path ", backend_path, " is too long"));
  }
  UniqueFd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake) {
    return ErrnoStatus(absl::StatusCode::kInternal, "eventfd", errno);
  }
  std::unique_ptr<PeerGate> gate(
      new PeerGate(limits, std::move(backend_path), std::move(wake)));
  gate->epoll_ = UniqueFd(::epoll_create1(EPOLL_CLOEXEC));
  if (!gate->epoll_) {
    return ErrnoStatus(absl::StatusCode::kInternal, "epoll_create1", errno);
  }
  epoll_event event = {};
  event.events = EPOLLIN;
  event.data.u64 = 0;  // serials start at 1
  ::epoll_ctl(gate->epoll_.get(), EPOLL_CTL_ADD, gate->wake_.get(), &event);
  auto listener = Listen(listen, &gate->port_);
  if (!listener.ok()) return listener.status();
  gate->loop_ = std::thread([raw = gate.get()] { raw->Loop(); });
  AcceptLoop::Options options;
  options.name = absl::StrCat("Peer listener ", listen);
  auto accept = AcceptLoop::Start(
      std::move(*listener), options,
      [raw = gate.get()](UniqueFd connection, const sockaddr_storage& peer) {
        raw->Admit(std::move(connection), peer);
      });
  if (!accept.ok()) return accept.status();
  gate->accept_ = std::move(*accept);
  return gate;
}

PeerGate::PeerGate(PeerListenerLimits limits, std::string backend_path,
                   UniqueFd wake)
    : limits_(limits),
      backend_path_(std::move(backend_path)),
      wake_(std::move(wake)) {}

PeerGate::~PeerGate() {
  if (accept_ != nullptr) accept_->Stop();
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  const uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof(one));
  if (loop_.joinable()) loop_.join();
}

void PeerGate::Admit(UniqueFd connection, const sockaddr_storage& address) {
  static LogRateLimiter refused_log(absl::Seconds(10));
  const auto [original, source] = NameAddress(address);
  uint64_t serial;
  {
    absl::MutexLock lock(&mu_);
    const size_t from_source = per_source_[source];
    const char* over = nullptr;
    if (from_source >= limits_.max_connections_per_source) {
      over = "--peer_max_connections_per_source";
    } else if (pipes_.size() >= limits_.max_connections) {
      over = "--peer_max_connections";
    }
    if (over != nullptr) {
      if (from_source == 0) per_source_.erase(source);
      if (const auto suppressed = refused_log.Allow()) {
        spdlog::warn(
            "Peer listener: refused a connection from {} ({} held from it, "
            "{} in all; {}) ({} similar suppressed)",
            original, from_source, pipes_.size(), over, *suppressed);
      }
      return;  // closed with nothing read or sent
    }
    // Process-wide: abstract names are, and agents share a process in
    // tests.
    static std::atomic<uint64_t> next_serial{1};
    serial = next_serial++;
    ++per_source_[source];
    // Held now, so that concurrent admissions count it.
    auto pipe = std::make_unique<Pipe>();
    pipe->serial = serial;
    pipe->source = source;
    pipe->name = absl::StrCat(original, "/", serial);
    pipe->accepted = absl::Now();
    pipes_[serial] = std::move(pipe);
  }
  // The connection to gRPC binds an abstract address naming the peer, so
  // that gRPC's peer() names it.
  const std::string name = absl::StrCat(original, "/", serial);
  UniqueFd inner(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un local = {};
  local.sun_family = AF_UNIX;
  const size_t name_bytes = std::min(name.size(), sizeof(local.sun_path) - 1);
  std::memcpy(local.sun_path + 1, name.data(), name_bytes);
  sockaddr_un remote = {};
  remote.sun_family = AF_UNIX;
  std::memcpy(remote.sun_path, backend_path_.data(), backend_path_.size());
  // Non-blocking before connect: a Unix connect then fails (EAGAIN) when
  // gRPC's backlog is full rather than stalling the accept thread.
  const bool connected =
      inner && SetNonBlocking(inner.get()) &&
      ::bind(inner.get(), reinterpret_cast<sockaddr*>(&local),
             static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 +
                                    name_bytes)) == 0 &&
      ::connect(inner.get(), reinterpret_cast<sockaddr*>(&remote),
                sizeof(remote)) == 0 &&
      SetNonBlocking(connection.get());
  const int error = errno;
  absl::MutexLock lock(&mu_);
  auto it = pipes_.find(serial);
  if (it == pipes_.end()) return;  // cut meanwhile (stopping, or late)
  if (!connected) {
    spdlog::warn("Peer listener: cannot pass the connection from {} on: {}",
                 original, std::strerror(error));
    Close(serial);
    return;
  }
  Pipe& pipe = *it->second;
  pipe.outer = std::move(connection);
  pipe.inner = std::move(inner);
  Watch(pipe);
}

void PeerGate::Watch(Pipe& pipe) {
  // Level-triggered: read a side while its bytes have room to go, write it
  // while bytes wait for it.
  for (const bool outer : {true, false}) {
    const int fd = outer ? pipe.outer.get() : pipe.inner.get();
    const Pipe::Buffer& from = outer ? pipe.to_inner : pipe.to_outer;
    const Pipe::Buffer& to = outer ? pipe.to_outer : pipe.to_inner;
    const bool eof = outer ? pipe.outer_eof : pipe.inner_eof;
    epoll_event event = {};
    event.events = (!eof && !from.full() ? EPOLLIN : 0) |
                   (!to.empty() ? EPOLLOUT : 0) | EPOLLRDHUP;
    event.data.u64 = pipe.serial << 1 | (outer ? 0 : 1);
    if (::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, fd, &event) != 0) {
      ::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &event);
    }
  }
}

bool PeerGate::Pump(Pipe& pipe) {
  const auto write_out = [](int fd, Pipe::Buffer& buffer) {
    while (!buffer.empty()) {
      const ssize_t n = ::send(fd, buffer.data + buffer.begin,
                               buffer.end - buffer.begin, MSG_NOSIGNAL);
      if (n < 0) return errno == EAGAIN || errno == EINTR;
      buffer.begin += static_cast<size_t>(n);
    }
    buffer.begin = buffer.end = 0;
    return true;
  };
  const auto read_in = [](int fd, Pipe::Buffer& buffer, bool& eof) {
    if (eof || buffer.full()) return true;
    const ssize_t n = ::recv(fd, buffer.data + buffer.end,
                             sizeof(buffer.data) - buffer.end, 0);
    if (n == 0) eof = true;
    if (n < 0) return errno == EAGAIN || errno == EINTR;
    if (n > 0) buffer.end += static_cast<size_t>(n);
    return true;
  };
  const int outer = pipe.outer.get();
  const int inner = pipe.inner.get();
  if (!write_out(inner, pipe.to_inner) || !write_out(outer, pipe.to_outer) ||
      !read_in(outer, pipe.to_inner, pipe.outer_eof) ||
      !read_in(inner, pipe.to_outer, pipe.inner_eof) ||
      !write_out(inner, pipe.to_inner) || !write_out(outer, pipe.to_outer)) {
    return false;
  }
  // Either side gone and its last bytes passed on: gRPC never half-closes,
  // and a peer that did would have nothing more to say.
  return !(pipe.outer_eof && pipe.to_inner.empty()) &&
         !(pipe.inner_eof && pipe.to_outer.empty());
}

void PeerGate::Close(uint64_t serial) {
  auto it = pipes_.find(serial);
  if (it == pipes_.end()) return;
  auto source = per_source_.find(it->second->source);
  if (source != per_source_.end() && --source->second == 0) {
    per_source_.erase(source);
  }
  pipes_.erase(it);  // both fds close, leaving the epoll set
}

void PeerGate::Loop() {
  epoll_event events[64];
  absl::Time next_scan = absl::Now() + kScanInterval;
  while (true) {
    const int timeout_ms = static_cast<int>(std::max<int64_t>(
        0, absl::ToInt64Milliseconds(next_scan - absl::Now()) + 1));
    const int n = ::epoll_wait(epoll_.get(), events, 64, timeout_ms);
    absl::MutexLock lock(&mu_);
    if (stopping_) {
      pipes_.clear();
      per_source_.clear();
      return;
    }
    for (int i = 0; i < n; ++i) {
      const uint64_t serial = events[i].data.u64 >> 1;
      if (serial == 0) {
        uint64_t ignored;
        (void)!::read(wake_.get(), &ignored, sizeof(ignored));
        continue;
      }
      auto it = pipes_.find(serial);
      if (it == pipes_.end() || !it->second->inner) continue;
      Pipe& pipe = *it->second;
      if (Pump(pipe)) {
        Watch(pipe);
      } else {
        Close(serial);
      }
    }
    const absl::Time now = absl::Now();
    if (now < next_scan) continue;
    next_scan = now + kScanInterval;
    // A connection that has not delivered a whole request in time is cut:
    // half-sent calls, stalled TLS handshakes, idle strangers.
    std::vector<uint64_t> late;
    for (const auto& [serial, pipe] : pipes_) {
      if (!pipe->arrived.load() &&
          now - pipe->accepted > limits_.call_arrival_timeout) {
        late.push_back(serial);
      }
    }
    for (const uint64_t serial : late) {
      spdlog::debug(
          "Peer listener: closed {}: no complete request within {} "
          "(--peer_call_arrival_timeout)",
          pipes_[serial]->name,
          absl::FormatDuration(limits_.call_arrival_timeout));
      Close(serial);
    }
  }
}

void PeerGate::RequestArrived(absl::string_view grpc_peer) {
  absl::ConsumePrefix(&grpc_peer, "unix-abstract:");
  absl::MutexLock lock(&mu_);
  // The serial ends the name: look it up by it.
  const size_t slash = grpc_peer.rfind('/');
  if (slash == absl::string_view::npos) return;
  uint64_t serial = 0;
  for (char c : grpc_peer.substr(slash + 1)) {
    if (c < '0' || c > '9') return;
    serial = serial * 10 + static_cast<uint64_t>(c - '0');
  }
  auto it = pipes_.find(serial);
  if (it != pipes_.end() && it->second->name == grpc_peer) {
    it->second->arrived = true;
  }
}

namespace {

class ArrivalInterceptor : public grpc::experimental::Interceptor {
 public:
  ArrivalInterceptor(grpc::experimental::ServerRpcInfo* info,
                     const std::function<void(absl::string_view)>* arrived)
      : info_(info), arrived_(arrived) {}

  void Intercept(
      grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::POST_RECV_MESSAGE) &&
        info_->server_context() != nullptr) {
      (*arrived_)(info_->server_context()->peer());
    }
    methods->Proceed();
  }

 private:
  grpc::experimental::ServerRpcInfo* const info_;
  const std::function<void(absl::string_view)>* const arrived_;
};

class ArrivalInterceptorFactory
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit ArrivalInterceptorFactory(
      std::function<void(absl::string_view)> arrived)
      : arrived_(std::move(arrived)) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new ArrivalInterceptor(info, &arrived_);
  }

 private:
  const std::function<void(absl::string_view)> arrived_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
MakeArrivalInterceptor(std::function<void(absl::string_view)> arrived) {
  return std::make_unique<ArrivalInterceptorFactory>(std::move(arrived));
}

size_t PeerGate::connections() const {
  absl::MutexLock lock(&mu_);
  return pipes_.size();
}

}  // namespace rdma_agent

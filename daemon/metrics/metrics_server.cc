#include "daemon/metrics/metrics_server.h"

#include <netdb.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <deque>
#include <map>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/net_address.h"
#include "common/rate_limited_log.h"
#include "common/status_util.h"
#include "common/unique_fd.h"
#include "daemon/metrics/http_request.h"
#include "spdlog/spdlog.h"

namespace rdma_agent {
namespace {

// A request head is a line and a few headers; anything longer is refused.
constexpr size_t kMaxHeadBytes = 8192;
// What a client may still send after its answer before it is cut off.
constexpr size_t kMaxDrainBytes = 64 * 1024;
// Connections accepted per turn of the loop: a connect flood cannot keep
// the loop from answering the connections it already has.
constexpr int kAcceptsPerTurn = 64;
// How long accepting pauses when the process is out of fds or memory.
constexpr absl::Duration kAcceptPause = absl::Milliseconds(100);

constexpr uint64_t kListenerKey = 0;
constexpr uint64_t kWakeKey = 1;

bool OutOfResources(int err) {
  return err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM;
}

const char* Reason(int code) {
  switch (code) {
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 431:
      return "Request Header Fields Too Large";
    default:
      return "Service Unavailable";
  }
}

// A whole answer; the connection closes after it.
std::string Response(int code, absl::string_view content_type,
                     absl::string_view body, bool head_only = false) {
  std::string response = absl::StrCat(
      "HTTP/1.1 ", code, " ", Reason(code), "\r\nContent-Type: ", content_type,
      "\r\nContent-Length: ", body.size(), "\r\n",
      code == 405 ? "Allow: GET, HEAD\r\n" : "", "Connection: close\r\n\r\n");
  if (!head_only) absl::StrAppend(&response, body);
  return response;
}

std::string Error(int code) {
  return Response(code, "text/plain", absl::StrCat(Reason(code), "\n"));
}

// A non-blocking listening TCP socket on `listen`, and the port it got.
absl::StatusOr<UniqueFd> Listen(const std::string& listen, uint16_t* port) {
  auto address = ParseHostPort(listen);
  if (!address.ok()) {
    return Prefixed(absl::StatusCode::kInvalidArgument, address.status(),
                    "--metrics_listen");
  }
  const std::string host = address->host.empty() || address->host == "*"
                               ? std::string("0.0.0.0")
                               : address->host;
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const int resolved = ::getaddrinfo(
      host.c_str(), absl::StrCat(address->port).c_str(), &hints, &found);
  if (resolved != 0 || found == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "cannot serve metrics on ", listen, ": ", ::gai_strerror(resolved)));
  }
  const auto unavailable = [&](const char* what) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ",
                                               listen, ": ", what, ": ",
                                               std::strerror(errno)));
  };
  UniqueFd fd(::socket(found->ai_family,
                       SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd) {
    ::freeaddrinfo(found);
    return unavailable("socket");
  }
  const int on = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
  const int bound = ::bind(fd.get(), found->ai_addr, found->ai_addrlen);
  ::freeaddrinfo(found);
  if (bound != 0) return unavailable("bind");
  if (::listen(fd.get(), SOMAXCONN) != 0) return unavailable("listen");
  sockaddr_storage local = {};
  socklen_t length = sizeof(local);
  if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&local), &length) !=
      0) {
    return unavailable("getsockname");
  }
  *port = ntohs(local.ss_family == AF_INET6
                    ? reinterpret_cast<sockaddr_in6*>(&local)->sin6_port
                    : reinterpret_cast<sockaddr_in*>(&local)->sin_port);
  return fd;
}

}  // namespace

// The endpoint's one thread: every connection's state is touched only here.
class MetricsServer::Loop {
 public:
  Loop(UniqueFd listener, UniqueFd epoll, UniqueFd wake,
       const MetricsOptions& options, const AgentMetrics* metrics,
       std::function<bool()> serving)
      : listener_(std::move(listener)),
        epoll_(std::move(epoll)),
        wake_(std::move(wake)),
        options_(options),
        metrics_(metrics),
        serving_(std::move(serving)) {}

  absl::Status Start() {
    if (!Watch(kListenerKey, listener_.get(), EPOLLIN, EPOLL_CTL_ADD) ||
        !Watch(kWakeKey, wake_.get(), EPOLLIN, EPOLL_CTL_ADD)) {
      return ErrnoStatus(absl::StatusCode::kInternal, "epoll_ctl", errno);
    }
    thread_ = std::thread([this] { Run(); });
    return absl::OkStatus();
  }

  ~Loop() {
    if (thread_.joinable()) {
      const uint64_t one = 1;
      (void)!::write(wake_.get(), &one, sizeof(one));
      thread_.join();
    }
  }

 private:
  enum class Phase {
    kReading,       // the request head is coming
    kScrapeQueued,  // a /metrics request waits for its turn
    kWriting,       // the answer is going out
    kDraining,      // answered; waiting for the client to close
  };
  struct Connection {
    UniqueFd fd;
    absl::Time deadline;
    Phase phase = Phase::kReading;
    bool head_only = false;  // a HEAD request: no body
    std::string in;
    std::string out;
    size_t sent = 0;
    size_t drained = 0;
  };

  void Run() {
    epoll_event events[64];
    while (true) {
      const int ready = ::epoll_wait(epoll_.get(), events, 64, WaitMillis());
      if (ready < 0 && errno != EINTR) {
        spdlog::error("metrics endpoint: epoll_wait: {}", std::strerror(errno));
        return;
      }
      for (int i = 0; i < ready; ++i) {
        const uint64_t key = events[i].data.u64;
        if (key == kWakeKey) return;
        if (key == kListenerKey) {
          AcceptSome();
        } else {
          OnEvent(key, events[i].events);
        }
      }
      // At most one scrape per turn: health answers and reads never wait
      // behind more than one.
      ScrapeOne();
      const absl::Time now = absl::Now();
      CloseExpired(now);
      if (!listener_armed_ && now >= accept_paused_until_) {
        listener_armed_ =
            Watch(kListenerKey, listener_.get(), EPOLLIN, EPOLL_CTL_MOD);
      }
    }
  }

  // Until the next deadline: the oldest connection's, the accept pause's;
  // none while a scrape waits.
  int WaitMillis() const {
    if (!scrapes_.empty()) return 0;
    absl::Time next = absl::InfiniteFuture();
    if (!connections_.empty()) next = connections_.begin()->second.deadline;
    if (!listener_armed_) next = std::min(next, accept_paused_until_);
    if (next == absl::InfiniteFuture()) return -1;
    const double millis =
        std::ceil(absl::ToDoubleMilliseconds(next - absl::Now()));
    return static_cast<int>(std::clamp(millis, 0.0, 60000.0));
  }

  bool Watch(uint64_t key, int fd, uint32_t events, int op) {
    epoll_event event = {};
    event.events = events;
    event.data.u64 = key;
    return ::epoll_ctl(epoll_.get(), op, fd, &event) == 0;
  }

  void AcceptSome() {
    for (int i = 0; i < kAcceptsPerTurn; ++i) {
      UniqueFd fd(::accept4(listener_.get(), nullptr, nullptr,
                            SOCK_NONBLOCK | SOCK_CLOEXEC));
      if (!fd) {
        const int err = errno;
        if (err == EINTR || err == ECONNABORTED) continue;
        if (err == EAGAIN || err == EWOULDBLOCK) return;
        if (OutOfResources(err)) {
          // The connection stays queued; accepting resumes after a pause
          // instead of spinning on it.
          listener_armed_ =
              !Watch(kListenerKey, listener_.get(), 0, EPOLL_CTL_MOD);
          accept_paused_until_ = absl::Now() + kAcceptPause;
        }
        if (auto suppressed = accept_log_.Allow()) {
          spdlog::warn("metrics endpoint: accept: {} ({} similar not logged)",
                       std::strerror(err), *suppressed);
        }
        return;
      }
      if (connections_.size() >= options_.max_connections) MakeRoom();
      const uint64_t key = next_key_++;
      if (!Watch(key, fd.get(), EPOLLIN, EPOLL_CTL_ADD)) continue;
      Connection& connection = connections_[key];
      connection.fd = std::move(fd);
      connection.deadline = absl::Now() + options_.request_timeout;
    }
  }

  // Closes the oldest connection still sending its request (a slow or
  // stalled client), else the oldest of all.
  void MakeRoom() {
    if (connections_.empty()) return;
    for (const auto& [key, connection] : connections_) {
      if (connection.phase == Phase::kReading) {
        Close(key);
        return;
      }
    }
    Close(connections_.begin()->first);
  }

  void OnEvent(uint64_t key, uint32_t events) {
    auto it = connections_.find(key);
    if (it == connections_.end()) return;
    Connection& connection = it->second;
    switch (connection.phase) {
      case Phase::kReading:
        Read(key, connection);
        return;
      case Phase::kScrapeQueued:
        // Only errors and hang-ups are reported while it waits.
        if (events & (EPOLLERR | EPOLLHUP)) Close(key);
        return;
      case Phase::kWriting:
        Write(key, connection);
        return;
      case Phase::kDraining:
        Drain(key, connection);
        return;
    }
  }

  void Read(uint64_t key, Connection& connection) {
    char chunk[4096];
    bool ended = false;
    while (connection.in.size() <= kMaxHeadBytes) {
      const ssize_t got = ::recv(connection.fd.get(), chunk, sizeof(chunk), 0);
      if (got > 0) {
        connection.in.append(chunk, static_cast<size_t>(got));
        continue;
      }
      if (got < 0 && errno == EINTR) continue;
      ended = got == 0 || (errno != EAGAIN && errno != EWOULDBLOCK);
      break;
    }
    const HttpRequestHead head =
        ParseHttpRequestHead(connection.in, kMaxHeadBytes);
    switch (head.state) {
      case HttpRequestHead::State::kIncomplete:
        if (ended) Close(key);
        return;
      case HttpRequestHead::State::kBad:
        Answer(key, connection, Error(400));
        return;
      case HttpRequestHead::State::kTooLarge:
        Answer(key, connection, Error(431));
        return;
      case HttpRequestHead::State::kComplete:
        break;
    }
    connection.in = std::string();
    connection.head_only = head.method == "HEAD";
    if (head.method != "GET" && !connection.head_only) {
      Answer(key, connection, Error(405));
    } else if (head.path == "/healthz") {
      Answer(key, connection, Health(connection.head_only));
    } else if (head.path == "/metrics") {
      connection.phase = Phase::kScrapeQueued;
      Watch(key, connection.fd.get(), 0, EPOLL_CTL_MOD);
      scrapes_.push_back(key);
    } else {
      Answer(key, connection, Error(404));
    }
  }

  std::string Health(bool head_only) const {
    return serving_()
               ? Response(200, "text/plain", "ok\n", head_only)
               : Response(503, "text/plain", "shutting down\n", head_only);
  }

  void ScrapeOne() {
    while (!scrapes_.empty()) {
      const uint64_t key = scrapes_.front();
      scrapes_.pop_front();
      auto it = connections_.find(key);
      if (it == connections_.end()) continue;  // closed while it waited
      Answer(key, it->second,
             Response(200, "text/plain; version=0.0.4", metrics_->Scrape(),
                      it->second.head_only));
      return;
    }
  }

  void Answer(uint64_t key, Connection& connection, std::string response) {
    connection.phase = Phase::kWriting;
    connection.out = std::move(response);
    connection.sent = 0;
    if (!Watch(key, connection.fd.get(), EPOLLOUT, EPOLL_CTL_MOD)) {
      Close(key);
      return;
    }
    Write(key, connection);
  }

  void Write(uint64_t key, Connection& connection) {
    while (connection.sent < connection.out.size()) {
      const ssize_t sent =
          ::send(connection.fd.get(), connection.out.data() + connection.sent,
                 connection.out.size() - connection.sent, MSG_NOSIGNAL);
      if (sent > 0) {
        connection.sent += static_cast<size_t>(sent);
        continue;
      }
      if (sent < 0 && errno == EINTR) continue;
      if (sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      Close(key);
      return;
    }
    // All out: say so, then wait for the client to close, so that bytes it
    // sent after its request cannot turn the close into a reset that loses
    // the end of the answer.
    connection.out = std::string();
    ::shutdown(connection.fd.get(), SHUT_WR);
    connection.phase = Phase::kDraining;
    if (!Watch(key, connection.fd.get(), EPOLLIN, EPOLL_CTL_MOD)) Close(key);
  }

  void Drain(uint64_t key, Connection& connection) {
    char chunk[4096];
    while (true) {
      const ssize_t got = ::recv(connection.fd.get(), chunk, sizeof(chunk), 0);
      if (got > 0) {
        connection.drained += static_cast<size_t>(got);
        if (connection.drained > kMaxDrainBytes) break;
        continue;
      }
      if (got < 0 && errno == EINTR) continue;
      if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      break;
    }
    Close(key);
  }

  // Connections are kept in accept order and all live as long: the oldest
  // expire first.
  void CloseExpired(absl::Time now) {
    while (!connections_.empty() &&
           connections_.begin()->second.deadline <= now) {
      Close(connections_.begin()->first);
    }
  }

  void Close(uint64_t key) {
    // Closing the fd takes it out of the epoll set.
    connections_.erase(key);
  }

  const UniqueFd listener_;
  const UniqueFd epoll_;
  const UniqueFd wake_;
  const MetricsOptions options_;
  const AgentMetrics* const metrics_;
  const std::function<bool()> serving_;
  LogRateLimiter accept_log_{absl::Seconds(10)};
  // By accept order: the first is the oldest.
  std::map<uint64_t, Connection> connections_;
  std::deque<uint64_t> scrapes_;
  uint64_t next_key_ = kWakeKey + 1;
  bool listener_armed_ = true;
  absl::Time accept_paused_until_ = absl::InfinitePast();
  std::thread thread_;
};

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& listen, const MetricsOptions& options,
    const AgentMetrics* metrics, std::function<bool()> serving) {
  std::unique_ptr<MetricsServer> server(new MetricsServer());
  auto listener = Listen(listen, &server->port_);
  if (!listener.ok()) return listener.status();
  UniqueFd epoll(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll) {
    return ErrnoStatus(absl::StatusCode::kInternal, "epoll_create1", errno);
  }
  UniqueFd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake) return ErrnoStatus(absl::StatusCode::kInternal, "eventfd", errno);
  server->loop_ = std::make_unique<Loop>(std::move(*listener), std::move(epoll),
                                         std::move(wake), options, metrics,
                                         std::move(serving));
  absl::Status started = server->loop_->Start();
  if (!started.ok()) return started;
  return server;
}

MetricsServer::~MetricsServer() = default;

}  // namespace rdma_agent

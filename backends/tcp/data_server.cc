#include "backends/tcp/data_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <optional>
#include <string>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "backends/tcp/buffered_socket.h"
#include "backends/tcp/wire.h"
#include "common/accept_loop.h"
#include "common/log_text.h"
#include "common/status_util.h"
#include "spdlog/spdlog.h"

namespace rdma_agent::tcp {
namespace {

// How often connections are checked against their deadline: the precision
// of every timeout.
constexpr absl::Duration kWatchdogTick = absl::Milliseconds(50);
// Most bytes one turn takes in before the connection waits its turn again,
// so that a peer sending without pause cannot keep a loop to itself.
constexpr size_t kTurnBytes = 1 << 20;
// Answers (copied bytes) a connection may have queued before it is read no
// more until they drain: with the buffer, its memory bound.
constexpr size_t kMaxQueuedAnswerBytes = BufferedSocket::kBufferBytes;
// READ payloads sent from the mapping that may wait in a connection's queue
// before it is read no more: a few KV-sized ones leave in one sendmsg, while
// a large one is the only one queued, so that each request's timeout starts
// about when its predecessor's payload has gone. (They cost no memory: the
// queue pins the mapping.)
constexpr size_t kMaxQueuedPayloadBytes = 256 << 10;
// Payloads at least this large (a WRITE's rest still to receive, or READ
// answers still to send) go to a bulk thread when one is free.
constexpr uint64_t kBulkBytes = 1 << 20;
// Longest a bulk thread's blocking call waits for a slow peer before the
// connection goes back to the event loops (SO_RCVTIMEO / SO_SNDTIMEO).
constexpr absl::Duration kBulkSlice = absl::Milliseconds(20);
// Answers wait to go out together until the turn runs dry, or until the
// requests they answer carry this many bytes: a client keeps about 1 MiB
// per connection in flight, which then reopens several times per window.
constexpr uint64_t kAnswerFlushBytes = 256 << 10;
// READ payloads shorter than this are copied behind their header (many
// answers then leave in one iovec); longer ones are sent from the mapping,
// an iovec each (SendQueue::kMaxIov bounds them per sendmsg). At 2 KiB and
// up a copy costs more than the iovec: 4 KiB READs took 0.3-0.5 us less
// agent CPU per op from the mapping than copied (tcp_backend_bench read4k,
// three alternating runs: 4.31 -> 3.89 us/op on average).
constexpr uint64_t kCopyPayloadBytes = 2 << 10;
// An event loop wakes at least this often to see whether the server stops
// (the stop's eventfd wakes them at once; this is the backstop).
constexpr int kLoopWaitMs = 1000;
// Magic and version: the first bytes of every valid request, checked as
// soon as they arrive so that another protocol is turned away at once.
constexpr size_t kPrefixBytes = 6;

// The peer's host, the per-source cap's key; IPv4-mapped IPv6 addresses as
// IPv4, so a dual-stack listener counts one host once.
std::string SourceHost(const sockaddr_storage& address) {
  char text[INET6_ADDRSTRLEN] = "?";
  if (address.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&address);
    inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text));
  } else if (address.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&address);
    if (IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr)) {
      inet_ntop(AF_INET, &in6->sin6_addr.s6_addr[12], text, sizeof(text));
    } else {
      inet_ntop(AF_INET6, &in6->sin6_addr, text, sizeof(text));
    }
  }
  return text;
}

}  // namespace

// One accepted connection. Everything but `self`, `cut` (the server's mu_)
// and the deadline (atomics the timeouts read) belongs to the loop serving
// the connection right now: with EPOLLONESHOT there is at most one.
struct DataServer::Connection {
  UniqueFd fd;
  std::string source;  // the peer's address, the per-source cap's key
  std::list<std::unique_ptr<Connection>>::iterator self;  // in connections_
  // When the current phase must end, absl::ToUnixNanos; the connection is
  // cut (shutdown) past it.
  std::atomic<int64_t> deadline_ns{0};
  std::atomic<Phase> phase{Phase::kHandshake};
  bool cut = false;  // guarded by DataServer::mu_

  BufferedSocket in;
  SendQueue out;
  // Made on first use when zero-copy sending is on.
  std::optional<PageSender> pages;
  bool pages_failed = false;
  // Set once a request has named a registration with its token. Until
  // then the connection lives at most the handshake timeout from its accept
  // (an absolute deadline: refused requests do not extend it).
  bool trusted = false;
  // The peer has closed its end: no request can follow; the answers go out,
  // then the connection closes.
  bool peer_done = false;
  // A stranger's refused notification declared more payload than any this
  // agent takes: nothing of it is read, the answer goes out, then the
  // connection closes.
  bool closing = false;

  // The request being received: its header, then its token, then (WRITE)
  // its payload.
  enum class Part { kHeader, kToken, kPayload };
  Part part = Part::kHeader;
  // A byte of the current request has arrived.
  bool in_request = false;
  RequestHeader header;
  std::string token;
  // The request's verdict and, when it was granted, the registration it
  // pins until its bytes have moved.
  absl::Status verdict;
  std::shared_ptr<Registration> pinned;
  uint64_t payload_done = 0;
  // A granted kNotify request's payload, gathered before it is delivered
  // (bounded by DataServer::MaxNotificationPayload()).
  std::string notification;
  // Bytes of the requests answered since answers were last sent.
  uint64_t answered_unsent = 0;
  // What to wait for when Turn said kBulk and no bulk thread was free.
  Next bulk_fallback = Next::kRead;
  // The blocking calls' timeouts (kBulkSlice) are set on the socket.
  bool bulk_timeouts_set = false;

  void Enter(Phase next, absl::Duration timeout) {
    phase.store(next);
    deadline_ns.store(absl::ToUnixNanos(absl::Now() + timeout));
  }
  // No request can follow: what is answered goes out, then it closes.
  bool reading_done() const { return peer_done || closing; }
  // Its answers are not drained: its next requests are not read until
  // they are.
  bool Backlogged() const {
    return out.copied_bytes() >= kMaxQueuedAnswerBytes ||
           out.referenced_bytes() >= kMaxQueuedPayloadBytes;
  }
};

int DefaultMaxConnections() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 ||
      limit.rlim_cur == RLIM_INFINITY) {
    return DataServer::kMaxConnectionsCeiling;
  }
  const rlim_t quarter = limit.rlim_cur / 4;
  return static_cast<int>(std::max<rlim_t>(
      1, std::min<rlim_t>(DataServer::kMaxConnectionsCeiling, quarter)));
}

absl::StatusOr<std::unique_ptr<DataServer>> DataServer::Start(
    const HostPort& address, const BufferDirectory* directory,
    bool zero_copy_send, int socket_buffer_bytes) {
  DataServerOptions options;
  options.zero_copy_send = zero_copy_send;
  options.socket_buffer_bytes = socket_buffer_bytes;
  return Start(address, directory, options);
}

absl::StatusOr<std::unique_ptr<DataServer>> DataServer::Start(
    const HostPort& address, const BufferDirectory* directory,
    const DataServerOptions& options) {
  if (options.handshake_timeout <= absl::ZeroDuration() ||
      options.idle_timeout <= absl::ZeroDuration() ||
      options.request_timeout <= absl::ZeroDuration() ||
      options.max_connections_per_source < 1 || options.max_connections < 0 ||
      options.threads < 1 || options.bulk_threads < 0) {
    return absl::InvalidArgumentError(
        "tcp server limits out of range: timeouts must be positive, "
        "connections per source and threads >= 1, bulk threads and max "
        "connections >= 0 (0: derived from RLIMIT_NOFILE)");
  }
  DataServerOptions resolved = options;
  if (resolved.max_connections == 0) {
    resolved.max_connections = DefaultMaxConnections();
  }
  UniqueFd epoll(epoll_create1(EPOLL_CLOEXEC));
  UniqueFd wake(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  UniqueFd timer(timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK));
  if (!epoll || !wake || !timer) {
    return ErrnoStatus(absl::StatusCode::kResourceExhausted,
                       "tcp data plane: epoll, eventfd or timerfd", errno);
  }
  uint16_t port = 0;
  auto listener = ListenTcp(address, &port);
  if (!listener.ok()) return listener.status();
  std::unique_ptr<DataServer> server(
      new DataServer(port, directory, resolved, std::move(epoll),
                     std::move(wake), std::move(timer)));
  // The stop stays readable (level-triggered): it reaches every loop. The
  // timer is one-shot: one loop at a time runs the timeouts.
  epoll_event stop_event{};
  stop_event.events = EPOLLIN;
  stop_event.data.ptr = const_cast<UniqueFd*>(&server->wake_);
  epoll_event timer_event{};
  timer_event.events = EPOLLIN | EPOLLONESHOT;
  timer_event.data.ptr = const_cast<UniqueFd*>(&server->timer_);
  if (epoll_ctl(server->epoll_.get(), EPOLL_CTL_ADD, server->wake_.get(),
                &stop_event) != 0 ||
      epoll_ctl(server->epoll_.get(), EPOLL_CTL_ADD, server->timer_.get(),
                &timer_event) != 0) {
    return ErrnoStatus(absl::StatusCode::kResourceExhausted,
                       "tcp data plane: epoll_ctl", errno);
  }
  if (absl::Status started = server->StartLoops(); !started.ok()) {
    return started;  // the destructor joins the loops already started
  }
  spdlog::info(
      "tcp data plane: serving {} on {} event loops (at most {} connections, "
      "{} per source; timeouts: handshake {}, idle {}, request {})",
      JoinHostPort(address.host, port), resolved.threads,
      resolved.max_connections, resolved.max_connections_per_source,
      absl::FormatDuration(resolved.handshake_timeout),
      absl::FormatDuration(resolved.idle_timeout),
      absl::FormatDuration(resolved.request_timeout));
  AcceptLoop::Options loop_options;
  loop_options.name = "tcp data plane " + JoinHostPort(address.host, port);
  // What strangers can trigger is logged at most once a second.
  loop_options.log_interval = absl::Seconds(1);
  auto loop = AcceptLoop::Start(
      std::move(*listener), std::move(loop_options),
      [raw = server.get()](UniqueFd fd, const sockaddr_storage& peer) {
        raw->Admit(std::move(fd), SourceHost(peer));
      });
  if (!loop.ok()) return loop.status();
  server->accept_loop_ = std::move(*loop);
  return server;
}

DataServer::DataServer(uint16_t port, const BufferDirectory* directory,
                       DataServerOptions options, UniqueFd epoll, UniqueFd wake,
                       UniqueFd timer)
    : port_(port),
      directory_(directory),
      options_(std::move(options)),
      epoll_(std::move(epoll)),
      wake_(std::move(wake)),
      timer_(std::move(timer)) {}

absl::Status DataServer::StartLoops() {
  for (int i = 0; i < options_.threads; ++i) {
    try {
      loops_.emplace_back([this] { Loop(); });
    } catch (const std::system_error& e) {
      return absl::ResourceExhaustedError(
          absl::StrCat("tcp data plane: cannot start event loop ", i + 1,
                       " of ", options_.threads, ": ", e.what()));
    }
  }
  for (int i = 0; i < options_.bulk_threads; ++i) {
    try {
      bulk_threads_.emplace_back([this] { BulkLoop(); });
    } catch (const std::system_error& e) {
      return absl::ResourceExhaustedError(
          absl::StrCat("tcp data plane: cannot start bulk thread ", i + 1,
                       " of ", options_.bulk_threads, ": ", e.what()));
    }
  }
  return absl::OkStatus();
}

DataServer::~DataServer() {
  // No new connection once the accept loop has left.
  if (accept_loop_ != nullptr) accept_loop_->Stop();
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  const uint64_t one = 1;
  (void)!write(wake_.get(), &one, sizeof(one));
  for (std::thread& loop : loops_) loop.join();
  // A bulk thread may wait in a blocking call: shutting every connection
  // down ends it at once.
  {
    absl::MutexLock lock(&mu_);
    for (auto& connection : connections_) {
      shutdown(connection->fd.get(), SHUT_RDWR);
    }
  }
  {
    absl::MutexLock lock(&bulk_mu_);
    bulk_stopping_ = true;
  }
  for (std::thread& thread : bulk_threads_) thread.join();
  // Nothing serves anything now: closing the connections lets go of every
  // registration they pinned.
  std::list<std::unique_ptr<Connection>> remaining;
  {
    absl::MutexLock lock(&mu_);
    remaining.swap(connections_);
  }
}

const char* DataServer::PhaseText(Phase phase) {
  switch (phase) {
    case Phase::kHandshake:
      return "presented no valid token within the handshake timeout of its "
             "accept";
    case Phase::kIdle:
      return "idled past the idle timeout";
    case Phase::kRequest:
      break;
  }
  return "did not complete a request within the request timeout";
}

size_t DataServer::connections() {
  absl::MutexLock lock(&mu_);
  return connections_.size();
}

std::map<std::string, size_t> DataServer::ConnectionsBySource() {
  absl::MutexLock lock(&mu_);
  std::map<std::string, size_t> by_source;
  for (const auto& [source, count] : per_source_) {
    if (count > 0) by_source[source] = static_cast<size_t>(count);
  }
  return by_source;
}

void DataServer::Admit(UniqueFd fd, std::string source) {
  const char* refusal = nullptr;
  int count = 0;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    const auto found = per_source_.find(source);
    count = found == per_source_.end() ? 0 : found->second;
    if (connections_.size() >= static_cast<size_t>(options_.max_connections)) {
      refusal = "the data plane's connection cap";
      count = static_cast<int>(connections_.size());
    } else if (count >= options_.max_connections_per_source) {
      refusal = "the per-source connection cap";
    }
  }
  if (refusal != nullptr) {
    if (const auto suppressed = refused_log_.Allow()) {
      spdlog::warn(
          "tcp data plane: refused a connection from {}: {} connections, at "
          "{} ({} similar suppressed)",
          source, count, refusal, *suppressed);
    }
    return;  // closes `fd`: nothing sent
  }

  ConfigureDataSocket(fd.get(), options_.socket_buffer_bytes);
  const int flags = fcntl(fd.get(), F_GETFL);
  if (flags < 0 || fcntl(fd.get(), F_SETFL, flags | O_NONBLOCK) != 0) return;
  // The server speaks first (wire.h). 16 bytes always fit a new socket's
  // buffer, so this never waits.
  std::byte hello[kServerHelloBytes];
  EncodeServerHello(hello);
  if (send(fd.get(), hello, sizeof(hello), MSG_DONTWAIT | MSG_NOSIGNAL) !=
      static_cast<ssize_t>(sizeof(hello))) {
    return;  // the peer is already gone
  }

  auto owned = std::make_unique<Connection>();
  Connection& connection = *owned;
  connection.fd = std::move(fd);
  connection.source = source;
  connection.in.Reset(connection.fd.get());
  connection.pages_failed = !options_.zero_copy_send;
  connection.Enter(Phase::kHandshake, options_.handshake_timeout);
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    connections_.push_back(std::move(owned));
    connection.self = std::prev(connections_.end());
    ++per_source_[source];
    if (!timer_armed_) ArmTimerLocked(true);
  }
  // From here on a loop may serve (and close) it: not touched again here.
  epoll_event event{};
  event.events = EPOLLIN | EPOLLONESHOT;
  event.data.ptr = &connection;
  if (epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, connection.fd.get(), &event) !=
      0) {
    const int error = errno;
    if (const auto suppressed = refused_log_.Allow()) {
      spdlog::warn(
          "tcp data plane: refused a connection from {}: epoll_ctl: {} ({} "
          "similar suppressed)",
          source, std::strerror(error), *suppressed);
    }
    Close(connection);
  }
}

void DataServer::ArmTimerLocked(bool on) {
  itimerspec spec{};
  if (on) {
    spec.it_value = absl::ToTimespec(kWatchdogTick);
    spec.it_interval = spec.it_value;
  }
  timerfd_settime(timer_.get(), 0, &spec, nullptr);
  timer_armed_ = on;
}

void DataServer::Loop() {
  while (true) {
    // One event at a time: a connection taken by this loop is one no other
    // loop can serve until it is re-armed, so taking several would leave
    // the other loops idle while they wait here.
    epoll_event event{};
    const int n = epoll_wait(epoll_.get(), &event, 1, kLoopWaitMs);
    if (n < 0 && errno != EINTR) {
      spdlog::error("tcp data plane: epoll_wait: {}", std::strerror(errno));
      absl::SleepFor(absl::Milliseconds(10));
    }
    if (n <= 0) {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      continue;
    }
    if (event.data.ptr == &wake_) return;  // stays readable for the others
    if (event.data.ptr == &timer_) {
      uint64_t ticks = 0;
      (void)!read(timer_.get(), &ticks, sizeof(ticks));
      CutExpired();
      epoll_event again{};
      again.events = EPOLLIN | EPOLLONESHOT;
      again.data.ptr = const_cast<UniqueFd*>(&timer_);
      epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, timer_.get(), &again);
      continue;
    }
    auto& connection = *static_cast<Connection*>(event.data.ptr);
    Next next = Turn(connection);
    if (next == Next::kBulk) {
      if (HandToBulkThread(connection)) continue;
      next = connection.bulk_fallback;
    }
    Rearm(connection, next);
  }
}

bool DataServer::HandToBulkThread(Connection& c) {
  absl::MutexLock lock(&bulk_mu_);
  // Only to a free thread: a payload never waits behind another, so a slow
  // peer holding a bulk thread slows no one else down.
  if (bulk_free_ == 0 || bulk_stopping_) return false;
  --bulk_free_;
  bulk_queue_.push_back(&c);
  return true;
}

void DataServer::BulkLoop() {
  while (true) {
    Connection* c = nullptr;
    {
      absl::MutexLock lock(&bulk_mu_);
      ++bulk_free_;
      bulk_mu_.Await(absl::Condition(
          +[](DataServer* server)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(server->bulk_mu_) {
                 return server->bulk_stopping_ || !server->bulk_queue_.empty();
               },
          this));
      if (bulk_queue_.empty()) return;  // stopping
      c = bulk_queue_.back();
      bulk_queue_.pop_back();
    }
    // A connection that streams large payloads stays here, one payload
    // after the other, as it would with a thread of its own: handing it
    // back and forth between threads for every payload left its socket idle
    // at each hand-off.
    Next next = Next::kBulk;
    while (next == Next::kBulk) {
      if (!MoveBulk(*c)) {
        // The peer is slow (or gone): the loops carry on without blocking
        // (and find out if the connection failed).
        next = c->bulk_fallback;
        break;
      }
      next = Turn(*c);
    }
    Rearm(*c, next);
  }
}

bool DataServer::MoveBulk(Connection& c) {
  const int fd = c.fd.get();
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) return false;
  bool done = false;
  if (!c.bulk_timeouts_set) {
    // Only blocking calls see them; the loops' calls do not block.
    SetIoTimeout(fd, /*receive=*/true, kBulkSlice);
    SetIoTimeout(fd, /*receive=*/false, kBulkSlice);
    c.bulk_timeouts_set = true;
  }
  if (c.part == Connection::Part::kPayload && c.pinned != nullptr) {
    // The rest of a granted WRITE's payload, straight into the mapping.
    while (c.payload_done < c.header.length) {
      const ssize_t n =
          recv(fd, c.pinned->data() + c.header.offset + c.payload_done,
               c.header.length - c.payload_done, MSG_WAITALL);
      if (n <= 0) break;  // slow peer (timeout), EOF or error: the loops see
      c.payload_done += static_cast<size_t>(n);
    }
    done = c.payload_done == c.header.length;
  } else {
    // Queued READ answers, sent from the mapping.
    while (!c.out.empty()) {
      const size_t before = c.out.referenced_bytes() + c.out.copied_bytes();
      const bool ok = c.out
                          .Send(fd, c.pages.has_value() ? &*c.pages : nullptr,
                                /*wait=*/true)
                          .ok();
      if (!ok || c.out.referenced_bytes() + c.out.copied_bytes() == before) {
        break;
      }
    }
    done = c.out.empty();
  }
  // The loops' (and Turn's) calls must never block.
  fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  return done;
}

DataServer::Next DataServer::Turn(Connection& c) {
  size_t budget = kTurnBytes;
  bool received_any = false;
  // Sends what is queued as far as the socket takes it; false when the
  // connection failed. Called only when the turn would otherwise stop
  // reading (it waits, or the answers back up): one send then carries the
  // answers to everything that arrived meanwhile, not one per request.
  auto send = [&c]() -> bool {
    c.answered_unsent = 0;
    if (c.out.empty()) return true;
    if (!c.pages_failed && !c.pages.has_value() && c.out.holds_reference()) {
      // First payload to splice: the pipe is made now.
      auto created = PageSender::Create();
      if (created.ok()) c.pages.emplace(std::move(*created));
      c.pages_failed = !created.ok();
    }
    return c.out.Send(c.fd.get(), c.pages.has_value() ? &*c.pages : nullptr)
        .ok();
  };
  auto wait = [&]() -> Next {
    if (!send()) return Next::kClose;
    const Next next = c.out.empty() ? Next::kRead : Next::kReadWrite;
    if (c.part == Connection::Part::kPayload && c.pinned != nullptr &&
        c.header.length - c.payload_done >= kBulkBytes &&
        options_.bulk_threads > 0) {
      c.bulk_fallback = next;
      return Next::kBulk;
    }
    return next;
  };
  while (true) {
    const Served served =
        c.reading_done() ? Served::kNeedBytes : ServeBuffered(c);
    if (served == Served::kDrop) return Next::kClose;
    if (c.reading_done()) {
      // No request can follow: the answers go out, then it closes.
      if (!send()) return Next::kClose;
      return c.out.empty() ? Next::kClose : Next::kWrite;
    }
    if (c.Backlogged()) {
      if (!send()) return Next::kClose;
      // The socket took what it could: wait until it takes more before
      // reading another request.
      if (c.Backlogged()) {
        if (c.out.referenced_bytes() >= kBulkBytes &&
            options_.bulk_threads > 0) {
          c.bulk_fallback = Next::kWrite;
          return Next::kBulk;
        }
        return Next::kWrite;
      }
      continue;  // drained enough: serve the requests waiting in the buffer
    }
    // A peer streaming requests may never let the turn run dry: answers go
    // out once they cover kAnswerFlushBytes, so that its window reopens
    // while it is still sending (rather than after it has stopped).
    if (c.answered_unsent >= kAnswerFlushBytes && !send()) {
      return Next::kClose;
    }
    // Out of budget, or the last recv found the socket empty: wait for the
    // next readiness rather than ask again (re-arming reports at once what
    // arrived meanwhile), which saves a recv that would find nothing.
    if (budget == 0 || (received_any && c.in.drained())) return wait();
    // Take in more: a granted WRITE's payload straight into the mapping
    // when it is large, everything else through the buffer.
    const bool into_mapping =
        c.part == Connection::Part::kPayload && c.pinned != nullptr;
    absl::StatusOr<size_t> received =
        into_mapping
            ? c.in.ReadSome(c.pinned->data() + c.header.offset + c.payload_done,
                            c.header.length - c.payload_done, /*wait=*/false)
            : c.in.Receive(/*wait=*/false);
    if (!received.ok()) {
      if (!c.in.peer_closed()) return Next::kClose;
      // Every whole request already in has been served (ServeBuffered
      // stops only when backlogged or short of bytes); a partial one never
      // completes. The answers still go out.
      c.peer_done = true;
      continue;
    }
    if (*received == 0) return wait();
    if (into_mapping) c.payload_done += *received;
    budget -= std::min(budget, *received);
    received_any = true;
  }
}

DataServer::Served DataServer::ServeBuffered(Connection& c) {
  while (true) {
    switch (c.part) {
      case Connection::Part::kHeader: {
        if (c.Backlogged()) return Served::kBacklogged;
        const size_t got = c.in.buffered();
        if (got == 0) return Served::kNeedBytes;
        if (!c.in_request) {
          c.in_request = true;
          // A token holder's request is timed from its first byte; a
          // stranger's stays under the handshake timeout until its header
          // and token are in.
          if (c.trusted) c.Enter(Phase::kRequest, options_.request_timeout);
        }
        static const std::array<std::byte, kRequestHeaderBytes> expected = [] {
          std::array<std::byte, kRequestHeaderBytes> bytes;
          EncodeRequestHeader(RequestHeader{}, bytes.data());
          return bytes;
        }();
        absl::Status decoded_status;
        if (std::memcmp(c.in.data(), expected.data(),
                        std::min(got, kPrefixBytes)) != 0) {
          decoded_status = absl::InvalidArgumentError(absl::StrCat(
              "not a data-plane request: \"",
              LogSafe(
                  absl::string_view(reinterpret_cast<const char*>(c.in.data()),
                                    std::min<size_t>(got, kRequestHeaderBytes)),
                  64),
              "\""));
        } else if (got < kRequestHeaderBytes) {
          return Served::kNeedBytes;
        } else {
          absl::StatusOr<RequestHeader> decoded =
              DecodeRequestHeader(c.in.data());
          if (decoded.ok()) {
            c.header = *decoded;
          } else {
            decoded_status = decoded.status();
          }
        }
        if (!decoded_status.ok()) {
          // A peer that speaks something else cannot be resynchronised.
          if (const auto suppressed = garbage_log_.Allow()) {
            // The peer's bytes in the message are already LogSafe-escaped.
            spdlog::warn(
                "tcp data plane: closed a connection from {}: {} ({} similar "
                "suppressed)",
                c.source, std::string(decoded_status.message()), *suppressed);
          }
          return Served::kDrop;
        }
        c.in.Consume(kRequestHeaderBytes);
        c.token.clear();
        c.part = Connection::Part::kToken;
        break;
      }
      case Connection::Part::kToken: {
        const size_t n = std::min<size_t>(c.header.token_bytes - c.token.size(),
                                          c.in.buffered());
        if (n > 0) {
          c.token.append(reinterpret_cast<const char*>(c.in.data()), n);
          c.in.Consume(n);
        }
        if (c.token.size() < c.header.token_bytes) return Served::kNeedBytes;
        StartRequest(c);
        // Nothing after a refusal that ends the connection is read.
        if (c.closing) return Served::kNeedBytes;
        break;
      }
      case Connection::Part::kPayload: {
        const uint64_t rest = c.header.length - c.payload_done;
        if (c.header.kind == RequestKind::kNotify) {
          // Kept only when granted (and then bounded); a refused one's is
          // read and dropped, so the next request is found.
          const size_t n =
              static_cast<size_t>(std::min<uint64_t>(rest, c.in.buffered()));
          if (c.verdict.ok()) {
            c.notification.append(reinterpret_cast<const char*>(c.in.data()),
                                  n);
          }
          c.in.Consume(n);
          c.payload_done += n;
          if (c.payload_done < c.header.length) return Served::kNeedBytes;
          if (c.verdict.ok()) {
            DeliverNotification(c);
          } else {
            FinishRequest(c);
          }
          break;
        }
        if (c.pinned != nullptr) {
          c.payload_done += c.in.Take(
              c.pinned->data() + c.header.offset + c.payload_done, rest);
        } else {
          // Refused: read and dropped, so the next request is found.
          const size_t n =
              static_cast<size_t>(std::min<uint64_t>(rest, c.in.buffered()));
          c.in.Consume(n);
          c.payload_done += n;
        }
        if (c.payload_done < c.header.length) return Served::kNeedBytes;
        if (c.pinned != nullptr) {
          c.pinned->CountServed(c.header.length);
          served_.Count(/*write=*/true, c.header.length);
        }
        FinishRequest(c);
        break;
      }
    }
  }
}

void DataServer::Trust(Connection& c) {
  if (c.trusted) return;
  c.trusted = true;
  // The rest of this request (payload, answer) is timed as a request.
  c.Enter(Phase::kRequest, options_.request_timeout);
}

uint64_t DataServer::MaxNotificationPayload() const {
  if (options_.notifications == nullptr) return 0;
  // The sender's id (uint16 length, at most kMaxTokenBytes) and the data.
  return std::min<uint64_t>(
      kMaxNotificationPayloadBytes,
      2 + kMaxTokenBytes + uint64_t{options_.notifications->max_bytes()});
}

void DataServer::StartNotification(Connection& c) {
  c.pinned = nullptr;
  c.notification.clear();
  c.payload_done = 0;
  ServeRequest target;
  target.agent_epoch = c.header.epoch;
  target.buffer_id = c.header.buffer_id;
  target.token = std::move(c.token);
  target.requester = c.source;
  // Token first, before a byte of the payload is read or kept: a stranger
  // learns nothing (not even whether notifications are taken) and makes
  // the agent hold nothing. The registration is looked up again when the
  // notification is delivered.
  c.verdict = directory_->ResolveForNotification(target).status();
  c.token = std::move(target.token);  // its buffer, for the next request
  if (c.verdict.ok()) {
    Trust(c);
    if (options_.notifications == nullptr) {
      c.verdict = absl::UnimplementedError("this agent takes no notifications");
    } else if (c.header.length > MaxNotificationPayload()) {
      c.verdict = absl::InvalidArgumentError(absl::StrCat(
          "a notification payload of ", c.header.length,
          " bytes is longer than this agent takes (",
          options_.notifications->max_bytes(),
          " bytes of data, --max_notification_bytes, and the sender's id)"));
    }
  } else if (!c.trusted && c.header.length > MaxNotificationPayload()) {
    // A stranger announcing more than any notification this agent takes:
    // answered, and nothing more read from it.
    c.closing = true;
    FinishRequest(c);
    return;
  }
  if (c.header.length == 0) {
    if (c.verdict.ok()) {
      DeliverNotification(c);
    } else {
      FinishRequest(c);
    }
    return;
  }
  // Granted: gathered (at most MaxNotificationPayload()), then delivered.
  // Refused: read and dropped without being kept (a token holder's within
  // its request timeout, a stranger's within its handshake deadline).
  if (c.verdict.ok()) {
    c.notification.reserve(static_cast<size_t>(c.header.length));
  }
  c.part = Connection::Part::kPayload;
}

void DataServer::StartRequest(Connection& c) {
  if (c.header.kind == RequestKind::kNotify) {
    StartNotification(c);
    return;
  }
  ServeRequest request;
  request.agent_epoch = c.header.epoch;
  request.buffer_id = c.header.buffer_id;
  request.token = std::move(c.token);
  request.offset = c.header.offset;
  request.length = c.header.length;
  request.write = c.header.kind == RequestKind::kWrite;
  request.requester = c.source;
  // Pinned until the request's bytes have moved, and no later: a connection
  // cut mid-request (request timeout, shutdown) lets it go when it closes.
  auto registration = directory_->ResolveForPeer(request);
  c.token = std::move(request.token);  // its buffer, for the next request
  // Device memory is never advertised over tcp; a forged request naming it
  // is refused before anything would touch its (absent) mapping.
  if (registration.ok()) {
    if (absl::Status host = RequireHostMemory(
            **registration, "the tcp data plane cannot reach device memory");
        !host.ok()) {
      registration = host;
    }
  }
  c.verdict = registration.status();
  c.pinned = registration.ok() ? std::move(*registration) : nullptr;
  if (c.pinned != nullptr) Trust(c);
  if (request.write && c.header.length > 0) {
    c.part = Connection::Part::kPayload;
    c.payload_done = 0;
    if (c.pinned != nullptr) c.in.ExpectPayload(c.header.length);
    return;
  }
  FinishRequest(c);
}

void DataServer::DeliverNotification(Connection& c) {
  auto decoded = DecodeNotification(c.notification);
  if (!decoded.ok()) {
    c.verdict = decoded.status();
  } else if (options_.notifications == nullptr) {
    c.verdict = absl::UnimplementedError("this agent takes no notifications");
  } else {
    // Checked again by the sink: the buffer may have gone meanwhile.
    ServeRequest target;
    target.agent_epoch = c.header.epoch;
    target.buffer_id = c.header.buffer_id;
    target.token = c.token;
    target.requester = c.source;
    c.verdict = options_.notifications->Deliver(target, decoded->from_agent_id,
                                                decoded->data);
  }
  c.notification.clear();
  c.notification.shrink_to_fit();
  FinishRequest(c);
}

void DataServer::FinishRequest(Connection& c) {
  const absl::Status& status = c.verdict;
  const absl::string_view message = status.message().substr(
      0, std::min<size_t>(status.message().size(), kMaxMessageBytes));
  const bool send_payload =
      c.header.kind == RequestKind::kRead && c.pinned != nullptr;
  ResponseHeader response;
  response.request_id = c.header.request_id;
  response.code = static_cast<uint32_t>(status.code());
  response.message_bytes = static_cast<uint32_t>(message.size());
  response.payload_bytes = send_payload ? c.header.length : 0;
  std::byte response_bytes[kResponseHeaderBytes];
  EncodeResponseHeader(response, response_bytes);
  c.out.Append(response_bytes, sizeof(response_bytes));
  c.out.Append(message.data(), message.size());
  if (send_payload) {
    const std::byte* payload = c.pinned->data() + c.header.offset;
    if (c.header.length < kCopyPayloadBytes) {
      c.out.Append(payload, c.header.length);
    } else {
      // Sent from the mapping, which the queue keeps pinned until then.
      // Lent pages (splice) hold their own references: they stay valid even
      // if the registration is released before the peer has read them.
      c.out.AppendReference(
          payload, c.header.length, c.pinned,
          !c.pages_failed && c.header.length >= kSpliceMinBytes);
    }
    c.pinned->CountServed(c.header.length);
    served_.Count(/*write=*/false, c.header.length);
  }
  c.out.EndMessage();
  c.answered_unsent += c.header.length;
  c.pinned.reset();
  c.verdict = absl::OkStatus();
  c.part = Connection::Part::kHeader;
  c.in_request = false;
  // A stranger keeps the deadline it got at accept: well-formed but refused
  // requests buy it no time.
}

void DataServer::Rearm(Connection& c, Next next) {
  if (next == Next::kClose) {
    Close(c);
    return;
  }
  if (!c.in_request && c.out.empty()) {
    // Between requests, answers sent: a token holder may idle (pooled
    // connections) and keeps its buffers (freeing and allocating them for
    // every request cost more than a small request itself: ~5 us per 8 B
    // READ here); a stranger keeps its handshake timeout and no buffer.
    if (c.trusted) {
      c.Enter(Phase::kIdle, options_.idle_timeout);
    } else {
      c.in.ReleaseIfEmpty();
      c.out.ReleaseIfEmpty();
    }
  }
  epoll_event event{};
  event.events = static_cast<uint32_t>(EPOLLONESHOT) |
                 (next != Next::kWrite ? static_cast<uint32_t>(EPOLLIN) : 0) |
                 (next != Next::kRead ? static_cast<uint32_t>(EPOLLOUT) : 0);
  event.data.ptr = &c;
  // From here on another loop may serve (and close) it.
  if (epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, c.fd.get(), &event) != 0) {
    Close(c);
  }
}

void DataServer::Close(Connection& c) {
  if (c.out.partly_sent()) {
    // An answer cut in the middle: reset rather than close cleanly, so the
    // peer never takes the cut for the stream's end.
    const linger abort_on_close{1, 0};
    setsockopt(c.fd.get(), SOL_SOCKET, SO_LINGER, &abort_on_close,
               sizeof(abort_on_close));
  }
  std::unique_ptr<Connection> owned;
  {
    absl::MutexLock lock(&mu_);
    auto source = per_source_.find(c.source);
    if (source != per_source_.end() && --source->second == 0) {
      per_source_.erase(source);
    }
    owned = std::move(*c.self);
    connections_.erase(c.self);
  }
  // Closes the fd (which leaves the epoll set) and lets go of what the
  // connection pinned, outside the lock.
  owned.reset();
}

void DataServer::CutExpired() {
  absl::MutexLock lock(&mu_);
  if (connections_.empty()) {
    ArmTimerLocked(false);  // Admit arms it again
    return;
  }
  const int64_t now = absl::ToUnixNanos(absl::Now());
  for (auto& connection : connections_) {
    if (connection->cut || connection->deadline_ns.load() > now) continue;
    const Phase phase = connection->phase.load();
    // Its loop (or the next one to serve it) then finds the connection
    // failed and closes it, letting go of what it pinned. The fd stays
    // open until then: it is closed only after leaving connections_.
    connection->cut = true;
    shutdown(connection->fd.get(), SHUT_RDWR);
    if (phase == Phase::kIdle) {
      // Routine: pooled connections a peer stopped using.
      spdlog::debug("tcp data plane: closed a connection from {}: it {}",
                    connection->source, PhaseText(phase));
    } else if (const auto suppressed = timeout_log_.Allow()) {
      spdlog::warn(
          "tcp data plane: closed a connection from {}: it {} ({} similar "
          "suppressed)",
          connection->source, PhaseText(phase), *suppressed);
    }
  }
}

}  // namespace rdma_agent::tcp

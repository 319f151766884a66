#include "backends/tcp/data_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
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
#include "spdlog/spdlog.h"

namespace rdma_agent::tcp {
namespace {

// How often the watchdog looks for connections past their deadline: the
// precision of every timeout.
constexpr absl::Duration kWatchdogTick = absl::Milliseconds(50);
// Accept failures that are about resources (fds, memory) are retried after
// a pause growing from the first to the last value.

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

// Reads a request header into `out` (kRequestHeaderBytes), checking the
// magic and version as soon as they arrive, so that a stranger speaking
// another protocol is turned away on its first bytes rather than after 56.
// UNAVAILABLE when the connection ends or is cut first; INVALID_ARGUMENT
// (naming the bytes, escaped) when they are not a request.
absl::Status ReadRequestHeader(BufferedSocket& io, std::byte* out) {
  // Magic and version: the first bytes of every valid request.
  constexpr size_t kPrefixBytes = 6;
  std::byte expected[kRequestHeaderBytes];
  EncodeRequestHeader(RequestHeader{}, expected);
  while (true) {
    const size_t got = io.buffered();
    const size_t check = std::min(got, kPrefixBytes);
    if (std::memcmp(io.data(), expected, check) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "not a data-plane request: \"",
          LogSafe(absl::string_view(reinterpret_cast<const char*>(io.data()),
                                    std::min<size_t>(got, kRequestHeaderBytes)),
                  64),
          "\""));
    }
    if (got >= kRequestHeaderBytes) break;
    if (absl::Status status = io.Fill(); !status.ok()) return status;
  }
  return io.Read(out, kRequestHeaderBytes);
}

}  // namespace

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
      options.max_connections_per_source < 1 || options.max_connections < 0) {
    return absl::InvalidArgumentError(
        "tcp server limits out of range: timeouts must be positive, "
        "connections per source >= 1, max connections >= 0 (0: derived from "
        "RLIMIT_NOFILE)");
  }
  DataServerOptions resolved = options;
  if (resolved.max_connections == 0) {
    resolved.max_connections = DefaultMaxConnections();
  }
  uint16_t port = 0;
  auto listener = ListenTcp(address, &port);
  if (!listener.ok()) return listener.status();
  spdlog::info(
      "tcp data plane: serving {} (at most {} connections, {} per source; "
      "timeouts: handshake {}, idle {}, request {})",
      JoinHostPort(address.host, port), resolved.max_connections,
      resolved.max_connections_per_source,
      absl::FormatDuration(resolved.handshake_timeout),
      absl::FormatDuration(resolved.idle_timeout),
      absl::FormatDuration(resolved.request_timeout));
  std::unique_ptr<DataServer> server(new DataServer(port, directory, resolved));
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
                       DataServerOptions options)
    : port_(port), directory_(directory), options_(std::move(options)) {
  watchdog_thread_ = std::thread([this] { WatchdogLoop(); });
}

DataServer::~DataServer() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    // Unblocks every serving thread's recv/send; they then exit.
    for (auto& connection : connections_) {
      shutdown(connection->fd.get(), SHUT_RDWR);
    }
  }
  if (accept_loop_ != nullptr) accept_loop_->Stop();
  watchdog_thread_.join();
  // No new connection can appear now: the accept loop has left. Serving
  // threads still lock mu_ to say they finished, so join outside it.
  std::list<std::unique_ptr<Connection>> remaining;
  {
    absl::MutexLock lock(&mu_);
    remaining.swap(connections_);
  }
  for (auto& connection : remaining) connection->thread.join();
}

const char* DataServer::PhaseText(Phase phase) {
  switch (phase) {
    case Phase::kHandshake:
      return "sent no whole request (header and token) within the handshake "
             "timeout";
    case Phase::kIdle:
      return "idled past the idle timeout";
    case Phase::kRequest:
      break;
  }
  return "did not complete a request within the request timeout";
}

size_t DataServer::connections() {
  absl::MutexLock lock(&mu_);
  return connections_.size() - static_cast<size_t>(finished_);
}

std::map<std::string, size_t> DataServer::ConnectionsBySource() {
  absl::MutexLock lock(&mu_);
  std::map<std::string, size_t> by_source;
  for (const auto& [source, count] : per_source_) {
    if (count > 0) by_source[source] = static_cast<size_t>(count);
  }
  return by_source;
}

void DataServer::ReapFinishedLocked() {
  for (auto it = connections_.begin(); it != connections_.end();) {
    Connection& connection = **it;
    if (!connection.finished) {
      ++it;
      continue;
    }
    // The thread set `finished` as its last act under mu_: it is leaving.
    connection.thread.join();
    auto source = per_source_.find(connection.source);
    if (source != per_source_.end() && --source->second == 0) {
      per_source_.erase(source);
    }
    --finished_;
    it = connections_.erase(it);  // closes the fd
  }
}

void DataServer::Admit(UniqueFd fd, std::string source) {
  const char* refusal = nullptr;
  int count = 0;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    ReapFinishedLocked();
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
    return;  // closes `fd`: nothing sent, nothing spawned
  }

  ConfigureDataSocket(fd.get(), options_.socket_buffer_bytes);
  // The server speaks first (wire.h). 16 bytes always fit a new socket's
  // buffer, so this never blocks.
  std::byte hello[kServerHelloBytes];
  EncodeServerHello(hello);
  if (send(fd.get(), hello, sizeof(hello), MSG_DONTWAIT | MSG_NOSIGNAL) !=
      static_cast<ssize_t>(sizeof(hello))) {
    return;  // the peer is already gone
  }

  auto connection = std::make_unique<Connection>();
  connection->fd = std::move(fd);
  connection->source = source;
  connection->Enter(Phase::kHandshake, options_.handshake_timeout);
  Connection* raw = connection.get();
  absl::MutexLock lock(&mu_);
  if (stopping_) return;
  connections_.push_back(std::move(connection));
  try {
    raw->thread = std::thread([this, raw] { Serve(raw); });
  } catch (const std::system_error& e) {
    // Out of threads (or memory for a stack): refuse this one, keep serving.
    connections_.pop_back();
    if (const auto suppressed = refused_log_.Allow()) {
      spdlog::warn(
          "tcp data plane: refused a connection from {}: cannot start a "
          "thread: {} ({} similar suppressed)",
          source, e.what(), *suppressed);
    }
    return;
  }
  ++per_source_[source];
}

void DataServer::WatchdogLoop() {
  absl::MutexLock lock(&mu_);
  while (true) {
    if (connections_.empty()) {
      // Nothing to watch: sleep until a connection is admitted.
      mu_.Await(absl::Condition(
          +[](DataServer* server) {
            return server->stopping_ || !server->connections_.empty();
          },
          this));
    } else {
      // Woken early when a thread finished, so its fd goes back at once.
      mu_.AwaitWithTimeout(absl::Condition(
                               +[](DataServer* server) {
                                 return server->stopping_ ||
                                        server->finished_ > 0;
                               },
                               this),
                           kWatchdogTick);
    }
    if (stopping_) return;
    ReapFinishedLocked();
    const int64_t now = absl::ToUnixNanos(absl::Now());
    for (auto& connection : connections_) {
      if (connection->finished || connection->cut ||
          connection->deadline_ns.load() > now) {
        continue;
      }
      // Read first: once cut, the serving thread moves on.
      const Phase phase = connection->phase.load();
      // Unblocks the serving thread wherever it waits (recv, send, splice,
      // poll); it then drops the connection and what it pinned.
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
}

bool DataServer::ReceiveRequest(Connection* connection, BufferedSocket& io,
                                bool first, bool trusted,
                                RequestHeader* header, std::string* token) {
  const int fd = connection->fd.get();
  if (!first) {
    // Between requests: wait for the next one's first byte, at most the
    // idle timeout, or, on a connection that never named a registration
    // with its token, the handshake timeout (which then also covers header
    // and token): a stranger's well-formed but refused requests do not buy
    // it a long-lived slot. Timed so even when the request already waits in
    // `io` (pipelined): every request gets its own timeout.
    connection->Enter(
        trusted ? Phase::kIdle : Phase::kHandshake,
        trusted ? options_.idle_timeout : options_.handshake_timeout);
    if (io.buffered() == 0) {
      // Requests that arrived meanwhile are served before the answers so far
      // go out, so that one send carries the answers to all of them.
      absl::StatusOr<size_t> more = io.Receive(/*wait=*/false);
      if (!more.ok()) return false;
      if (*more == 0) {
        // Nothing more has arrived: the answers go out before waiting.
        if (!io.Flush().ok()) return false;
        pollfd p{fd, POLLIN, 0};
        if (poll(&p, 1, -1) < 0 && errno != EINTR) return false;
      }
    }
    if (trusted) connection->Enter(Phase::kRequest, options_.request_timeout);
  }
  std::byte bytes[kRequestHeaderBytes];
  const absl::Status received = ReadRequestHeader(io, bytes);
  absl::StatusOr<RequestHeader> decoded =
      received.ok() ? DecodeRequestHeader(bytes)
                    : absl::StatusOr<RequestHeader>(received);
  if (!decoded.ok()) {
    // A peer that speaks something else cannot be resynchronised: drop it.
    if (const auto suppressed = !absl::IsUnavailable(decoded.status())
                                    ? garbage_log_.Allow()
                                    : std::nullopt) {
      // The peer's bytes in the message are already LogSafe-escaped.
      spdlog::warn(
          "tcp data plane: closed a connection from {}: {} ({} similar "
          "suppressed)",
          connection->source, std::string(decoded.status().message()),
          *suppressed);
    }
    return false;
  }
  *header = *decoded;
  token->resize(header->token_bytes);
  if (!io.Read(token->data(), token->size()).ok()) return false;
  // The rest (payload, response) is timed as a request.
  if (!trusted) connection->Enter(Phase::kRequest, options_.request_timeout);
  return true;
}

void DataServer::Serve(Connection* connection) {
  const int fd = connection->fd.get();
  BufferedSocket io(fd);
  RequestHeader header;
  std::string token;
  // Made on first use; without it payloads are sent with send().
  std::optional<PageSender> pages;
  bool pages_failed = !options_.zero_copy_send;
  // Set once a request has named a registration with its token.
  bool trusted = false;
  for (bool first = true;; first = false) {
    if (!ReceiveRequest(connection, io, first, trusted, &header, &token)) {
      break;
    }

    ServeRequest request;
    request.agent_epoch = header.epoch;
    request.buffer_id = header.buffer_id;
    request.token = token;
    request.offset = header.offset;
    request.length = header.length;
    request.write = header.kind == RequestKind::kWrite;
    request.requester = connection->source;
    // Pinned until the end of this iteration, and no later: a connection cut
    // mid-request (request timeout, shutdown) lets it go by leaving the loop.
    auto registration = directory_->ResolveForPeer(request);
    trusted = trusted || registration.ok();

    if (request.write) {
      const absl::Status received =
          registration.ok()
              ? io.Read((*registration)->data() + request.offset,
                        request.length)
              : io.Skip(request.length);
      if (!received.ok()) break;
      if (registration.ok()) (*registration)->CountServed(request.length);
    }

    const absl::Status& status = registration.status();
    const std::string message(status.message().substr(
        0, std::min<size_t>(status.message().size(), kMaxMessageBytes)));
    ResponseHeader response;
    response.request_id = header.request_id;
    response.code = static_cast<uint32_t>(status.code());
    response.message_bytes = static_cast<uint32_t>(message.size());
    const bool send_payload = !request.write && registration.ok();
    response.payload_bytes = send_payload ? request.length : 0;
    std::byte response_bytes[kResponseHeaderBytes];
    EncodeResponseHeader(response, response_bytes);
    std::byte* payload =
        send_payload ? (*registration)->data() + request.offset : nullptr;
    bool splice_payload =
        send_payload && request.length >= kSpliceMinBytes && !pages_failed;
    if (splice_payload && !pages.has_value()) {
      auto created = PageSender::Create();
      if (created.ok()) pages.emplace(std::move(*created));
      pages_failed = !created.ok();
      splice_payload = created.ok();
    }
    // Small answers collect in `io` until no request is left to read.
    if (!io.Write(response_bytes, sizeof(response_bytes)).ok() ||
        !io.Write(message.data(), message.size()).ok()) {
      break;
    }
    if (send_payload && !splice_payload &&
        !io.Write(payload, request.length).ok()) {
      break;
    }
    if (splice_payload) {
      if (!io.Flush().ok()) break;
      // Lent pages hold their own references: they stay valid even if the
      // registration is released before the requester has read them.
      size_t sent = 0;
      if (!pages->Send(fd, payload, request.length, /*more=*/false, &sent)
               .ok()) {
        break;
      }
    }
    if (send_payload) (*registration)->CountServed(request.length);
  }
  // The fd is closed when the watchdog (or the destructor) reaps this
  // connection; until then it must stay open, since they may shut it down.
  shutdown(fd, SHUT_RDWR);
  absl::MutexLock lock(&mu_);
  connection->finished = true;
  ++finished_;
}

}  // namespace rdma_agent::tcp

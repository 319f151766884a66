#ifndef RDMA_AGENTD_BACKENDS_TCP_DATA_SERVER_H_
#define RDMA_AGENTD_BACKENDS_TCP_DATA_SERVER_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "backends/buffer_directory.h"
#include "backends/notification_sink.h"
#include "backends/tcp/socket_util.h"
#include "backends/tcp/wire.h"
#include "common/accept_loop.h"
#include "common/rate_limited_log.h"
#include "common/unique_fd.h"

namespace rdma_agent::tcp {

class BufferedSocket;

// Limits and timeouts of the serving side (flags --tcp_*; see README.md).
struct DataServerOptions {
  // READ payloads of at least kSpliceMinBytes go to the socket with
  // vmsplice/splice instead of send (see PageSender).
  bool zero_copy_send = false;
  // As in ConfigureDataSocket, for accepted connections.
  int socket_buffer_bytes = 0;
  // A new connection must have sent a whole valid request header by then.
  absl::Duration handshake_timeout = absl::Seconds(2);
  // Longest wait for the first byte of the next request on a connection.
  absl::Duration idle_timeout = absl::Seconds(120);
  // From a request's first byte to the last byte of its response: header,
  // token, WRITE payload, response. Past it the connection is cut and the
  // registration it pinned is let go.
  absl::Duration request_timeout = absl::Seconds(30);
  // Connections served at once from one source address.
  int max_connections_per_source = 64;
  // Connections served at once in all; 0: DefaultMaxConnections().
  int max_connections = 0;
  // Takes kNotify requests; nullptr: they are answered UNIMPLEMENTED.
  NotificationSink* notifications = nullptr;
};

// min(kMaxConnectionsCeiling, soft RLIMIT_NOFILE / 4): a quarter of the
// process's fds at most go to data connections (one each), leaving the rest
// to gRPC, registrations' memfds and the other backends, so that strangers
// filling the data plane cannot make the agent run out of fds.
int DefaultMaxConnections();

// The serving half of the TCP data plane: accepts peer connections and
// answers their READ/WRITE requests against this agent's registrations.
//
// Every request is checked with BufferDirectory::ResolveForPeer (epoch,
// buffer id, token, access, bounds) before a byte of the registration is
// touched; the resolved registration stays pinned while its bytes move.
// Payloads go between the socket and the registration's mapping directly.
// Requests of one connection are answered in order. A refused WRITE's payload
// is read and dropped so the connection stays usable.
//
// Strangers are refused cheaply: a connection over the per-source or total
// cap is closed at accept, before anything is sent or spawned; an accepted
// one gets the server hello (wire.h) at once and is closed when its first
// bytes are not a request, when no whole request header and token came
// within the handshake timeout (between requests too, until one of them has
// named a registration with its token), when it idles past the idle
// timeout, or when a request does not complete within the request timeout. One
// thread serves each accepted connection (bounded by the caps); a watchdog
// thread cuts connections past their deadline and reaps finished ones, so their
// fds go back at once. Accept failures (EMFILE...) back off from 10 ms to 1 s
// instead of spinning. What strangers trigger is logged at most once a
// second per kind.
class DataServer {
 public:
  // Largest total cap DefaultMaxConnections() derives.
  static constexpr int kMaxConnectionsCeiling = 4096;

  // Listens on `address` and serves until destroyed. `directory` must outlive
  // the server. INVALID_ARGUMENT for non-positive timeouts or negative caps.
  static absl::StatusOr<std::unique_ptr<DataServer>> Start(
      const HostPort& address, const BufferDirectory* directory,
      const DataServerOptions& options);
  // With default limits.
  static absl::StatusOr<std::unique_ptr<DataServer>> Start(
      const HostPort& address, const BufferDirectory* directory,
      bool zero_copy_send = false, int socket_buffer_bytes = 0);

  // Stops accepting, cuts every connection and waits for all serving threads
  // to leave registration memory.
  ~DataServer();

  DataServer(const DataServer&) = delete;
  DataServer& operator=(const DataServer&) = delete;

  // The port actually bound (useful when asked for port 0).
  uint16_t port() const { return port_; }
  // The limits in force (max_connections resolved).
  const DataServerOptions& options() const { return options_; }
  // Connections being served now (for tests and status).
  size_t connections();
  // The same by source address, for metrics.
  std::map<std::string, size_t> ConnectionsBySource();

 private:
  // What a connection is waiting for; says why it was cut.
  enum class Phase { kHandshake, kIdle, kRequest };
  // Why a connection cut in `phase` was cut, for the log.
  static const char* PhaseText(Phase phase);

  struct Connection {
    UniqueFd fd;
    std::string source;  // the peer's address, the per-source cap's key
    std::thread thread;
    // When the current phase must end, absl::ToUnixNanos; the watchdog cuts
    // the connection (shutdown) past it.
    std::atomic<int64_t> deadline_ns{0};
    std::atomic<Phase> phase{Phase::kHandshake};
    bool cut = false;       // by the watchdog; guarded by DataServer::mu_
    bool finished = false;  // thread done; guarded by DataServer::mu_

    void Enter(Phase next, absl::Duration timeout) {
      phase.store(next);
      deadline_ns.store(absl::ToUnixNanos(absl::Now() + timeout));
    }
  };

  DataServer(uint16_t port, const BufferDirectory* directory,
             DataServerOptions options);
  // Applies the caps to a just-accepted connection, greets it and spawns its
  // thread, or closes it.
  void Admit(UniqueFd fd, std::string source);
  void Serve(Connection* connection);
  // Reads the next request's header and token into `*header` and `*token`,
  // timing each wait by the phase it is in; false when the connection is to
  // be dropped (closed, cut, or not speaking the protocol).
  bool ReceiveRequest(Connection* connection, BufferedSocket& io, bool first,
                      bool trusted, RequestHeader* header, std::string* token);
  // Answers a kNotify request whose header and token were read: reads its
  // payload and hands it to the sink. False when the connection is to be
  // dropped; `*accepted` when the sink took it (the token was right).
  bool ServeNotification(Connection* connection, BufferedSocket& io,
                         const RequestHeader& header, const std::string& token,
                         bool* accepted);
  // Cuts connections past their deadline and reaps finished ones until
  // the server stops.
  void WatchdogLoop();
  // Joins and drops connections whose thread has finished.
  void ReapFinishedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Blocks for `timeout` or until the server stops; false when stopping.
  bool SleepUnlessStopping(absl::Duration timeout);

  const uint16_t port_;
  const BufferDirectory* const directory_;
  const DataServerOptions options_;

  // What strangers can trigger, each logged at most once per interval.
  LogRateLimiter refused_log_{absl::Seconds(1)};
  LogRateLimiter timeout_log_{absl::Seconds(1)};
  LogRateLimiter garbage_log_{absl::Seconds(1)};

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Connections whose thread finished and awaits a join.
  int finished_ ABSL_GUARDED_BY(mu_) = 0;
  std::list<std::unique_ptr<Connection>> connections_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int> per_source_ ABSL_GUARDED_BY(mu_);
  // Calls Admit for each accepted connection; stopped first at destruction.
  std::unique_ptr<AcceptLoop> accept_loop_;
  std::thread watchdog_thread_;
};

}  // namespace rdma_agent::tcp

#endif  // RDMA_AGENTD_BACKENDS_TCP_DATA_SERVER_H_

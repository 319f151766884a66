#ifndef RDMA_AGENTD_BACKENDS_TCP_DATA_SERVER_H_
#define RDMA_AGENTD_BACKENDS_TCP_DATA_SERVER_H_

#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "backends/buffer_directory.h"
#include "backends/notification_sink.h"
#include "backends/served_counter.h"
#include "backends/tcp/socket_util.h"
#include "backends/tcp/wire.h"
#include "common/accept_loop.h"
#include "common/rate_limited_log.h"
#include "common/unique_fd.h"

namespace rdma_agent::tcp {

// Limits and timeouts of the serving side (flags --tcp_*; see README.md).
struct DataServerOptions {
  // READ payloads of at least kSpliceMinBytes go to the socket with
  // vmsplice/splice instead of send (see PageSender).
  bool zero_copy_send = false;
  // As in ConfigureDataSocket, for accepted connections.
  int socket_buffer_bytes = 0;
  // A new connection must have presented a valid token (a request naming a
  // registration with it) by then, counted from its accept; refused
  // requests do not extend it.
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
  // Event-loop threads serving every connection. 2 keeps both cores of a
  // small host copying (two stripes of a transfer on two cores); more only
  // help with more cores.
  int threads = 2;
  // Takes kNotify requests, and bounds their payload (max_bytes(): the
  // agent's --max_notification_bytes); nullptr: they are answered
  // UNIMPLEMENTED (once their token is proven).
  NotificationSink* notifications = nullptr;
  // Threads that move large payloads (a WRITE still receiving, or READ
  // answers still sending, at least 1 MiB) with blocking calls, each bounded
  // by a short timeout, when one is free; otherwise the event loops move
  // them without blocking. Measured here: a 256 MiB op moved by the loops
  // alone runs ~20-30% slower than with blocking calls (several wake-ups
  // and system calls per socket buffer instead of one call per chunk). 0:
  // the loops move everything.
  int bulk_threads = 2;
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
// touched, and a kNotify with ResolveForNotification (epoch, id, token,
// WRITE access) before a byte of its payload is read; the resolved
// registration stays pinned while its bytes move.
// Payloads go between the socket and the registration's mapping directly
// (small ones through the connection's buffers). Requests of one connection
// are answered in order. A refused WRITE's payload is read and dropped so
// the connection stays usable.
//
// Threads: `threads` event loops share one epoll set of non-blocking
// connections. Each connection is served by one loop at a time
// (EPOLLONESHOT) for a bounded turn: it takes in what has arrived, serves
// every whole request, queues the answers and sends what the socket takes,
// then waits again; so no connection can stall another, and two busy
// connections are served on two cores, whichever they are. Payloads of
// 1 MiB and more go to a free bulk thread (blocking calls bounded by 20 ms,
// faster for bulk), or stay with the loops when none is free. A connection
// whose answers are not drained (more than a buffer of them, or a large
// READ payload still going out) is not read until they are: its memory
// stays bounded whatever the peer sends. One loop at a time also runs the
// timeouts (every 50 ms while connections exist).
//
// Strangers are refused cheaply: a connection over the per-source or total
// cap is closed at accept, before anything is sent; an accepted one gets
// the server hello (wire.h) at once and is closed when its first bytes are
// not a request, when it has not presented a valid token (a request naming
// a registration with it) within the handshake timeout of its accept (an
// absolute deadline: refused requests do not extend it), when it idles past
// the idle timeout, or when a request does not complete within the request
// timeout. A refused kNotify declaring more payload than any notification
// this agent takes ends a stranger's connection once answered. A closed
// connection's fd and buffers go back at once. Accept failures (EMFILE...)
// back off from 10 ms to 1 s instead of spinning. What strangers trigger is
// logged at most once a second per kind.
class DataServer {
 public:
  // Largest total cap DefaultMaxConnections() derives.
  static constexpr int kMaxConnectionsCeiling = 4096;

  // Listens on `address` and serves until destroyed. `directory` must outlive
  // the server. INVALID_ARGUMENT for non-positive timeouts, thread counts or
  // caps out of range; RESOURCE_EXHAUSTED when the event loops cannot be
  // started.
  static absl::StatusOr<std::unique_ptr<DataServer>> Start(
      const HostPort& address, const BufferDirectory* directory,
      const DataServerOptions& options);
  // With default limits.
  static absl::StatusOr<std::unique_ptr<DataServer>> Start(
      const HostPort& address, const BufferDirectory* directory,
      bool zero_copy_send = false, int socket_buffer_bytes = 0);

  // Stops accepting, stops the event loops and closes every connection,
  // letting go of what they pinned.
  ~DataServer();

  DataServer(const DataServer&) = delete;
  DataServer& operator=(const DataServer&) = delete;

  // The port actually bound (useful when asked for port 0).
  uint16_t port() const { return port_; }
  // The limits in force (max_connections resolved).
  const DataServerOptions& options() const { return options_; }
  // Connections being served now (for tests and status).
  size_t connections();
  // Requests served in full since start (metrics).
  ServedTotals served() const { return served_.totals(); }
  // The same by source address, for metrics.
  std::map<std::string, size_t> ConnectionsBySource();

 private:
  struct Connection;
  // What a connection is waiting for; says why it was cut.
  enum class Phase { kHandshake, kIdle, kRequest };
  // Why a connection cut in `phase` was cut, for the log.
  static const char* PhaseText(Phase phase);
  // What a turn left the connection waiting for.
  // kBulk: a large payload to move; handed to a bulk thread if one is free,
  // else waited for like Connection::bulk_fallback.
  enum class Next { kRead, kWrite, kReadWrite, kClose, kBulk };

  DataServer(uint16_t port, const BufferDirectory* directory,
             DataServerOptions options, UniqueFd epoll, UniqueFd wake,
             UniqueFd timer);
  // Starts the event loops and the bulk threads; RESOURCE_EXHAUSTED when a
  // thread cannot start.
  absl::Status StartLoops();
  // Gives `connection` to a free bulk thread; false when none is free.
  bool HandToBulkThread(Connection& connection);
  // One bulk thread: moves the large payloads of the connections handed to
  // it, then gives each back to the event loops.
  void BulkLoop();
  // Moves the connection's large payload with blocking calls while the peer
  // keeps up (each call bounded by kBulkSlice); true when it is all moved.
  bool MoveBulk(Connection& connection);
  // Applies the caps to a just-accepted connection, greets it and hands it
  // to the event loops, or closes it.
  void Admit(UniqueFd fd, std::string source);
  // One event loop: waits for ready connections (and the timer, and the
  // stop), serving each for one turn.
  void Loop();
  // Serves `connection` until it would wait or its turn's budget is spent;
  // says what it waits for next.
  Next Turn(Connection& connection);
  // Why ServeBuffered stopped.
  enum class Served {
    kNeedBytes,   // every whole request buffered is served
    kBacklogged,  // answers are not drained; requests wait in the buffer
    kDrop,        // the peer does not speak the protocol
  };
  // Serves the requests (and parts of requests) already buffered, queueing
  // their answers, until it needs more bytes or the answers back up.
  Served ServeBuffered(Connection& connection);
  // The request whose header and token have arrived: resolve it (pinning
  // its registration) and queue its answer, or start receiving its WRITE
  // payload.
  void StartRequest(Connection& connection);
  // StartRequest for a kNotify: checks its target (token, then WRITE
  // access) and its declared length before any of its payload is read.
  void StartNotification(Connection& connection);
  // The connection has presented a valid token: from now on it is timed by
  // phase (request, idle) instead of by its handshake deadline.
  void Trust(Connection& connection);
  // Longest kNotify payload taken: the sender's id and the sink's
  // max_bytes() (the agent's --max_notification_bytes).
  uint64_t MaxNotificationPayload() const;
  // Queues the answer to the request in progress and readies the
  // connection for the next one.
  void FinishRequest(Connection& connection);
  // Re-arms `connection` in the epoll set for `next`, or closes it.
  void Rearm(Connection& connection, Next next);
  void Close(Connection& connection);
  // Cuts connections past their deadline (shutdown: the loop serving it then
  // sees the error and closes it).
  void CutExpired();
  void ArmTimerLocked(bool on) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Hands a kNotify request's gathered payload to the sink and queues the
  // answer.
  void DeliverNotification(Connection& connection);

  const uint16_t port_;
  const BufferDirectory* const directory_;
  const DataServerOptions options_;
  const UniqueFd epoll_;
  const UniqueFd wake_;   // eventfd: readable once the server stops
  const UniqueFd timer_;  // timerfd: the timeouts' tick

  // What strangers can trigger, each logged at most once per interval.
  LogRateLimiter refused_log_{absl::Seconds(1)};
  LogRateLimiter timeout_log_{absl::Seconds(1)};
  LogRateLimiter garbage_log_{absl::Seconds(1)};

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool timer_armed_ ABSL_GUARDED_BY(mu_) = false;
  std::list<std::unique_ptr<Connection>> connections_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int> per_source_ ABSL_GUARDED_BY(mu_);
  // Calls Admit for each accepted connection; stopped first at destruction.
  std::unique_ptr<AcceptLoop> accept_loop_;
  std::vector<std::thread> loops_;

  // Connections handed to the bulk threads, and how many of them are free.
  absl::Mutex bulk_mu_;
  std::vector<Connection*> bulk_queue_ ABSL_GUARDED_BY(bulk_mu_);
  int bulk_free_ ABSL_GUARDED_BY(bulk_mu_) = 0;
  bool bulk_stopping_ ABSL_GUARDED_BY(bulk_mu_) = false;
  std::vector<std::thread> bulk_threads_;
  ServedCounter served_;
};

}  // namespace rdma_agent::tcp

#endif  // RDMA_AGENTD_BACKENDS_TCP_DATA_SERVER_H_

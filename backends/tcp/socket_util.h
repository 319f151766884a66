#ifndef RDMA_AGENTD_BACKENDS_TCP_SOCKET_UTIL_H_
#define RDMA_AGENTD_BACKENDS_TCP_SOCKET_UTIL_H_

#include <sys/socket.h>
#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/net_address.h"
#include "common/unique_fd.h"

namespace rdma_agent::tcp {

// A listening TCP socket on `address` (port 0 picks a free port), with
// SO_REUSEADDR. The port actually bound goes to `*bound_port`.
absl::StatusOr<UniqueFd> ListenTcp(const HostPort& address,
                                   uint16_t* bound_port);

// Connects to `address` without blocking past `deadline`, name resolution
// included: DEADLINE_EXCEEDED when it passes, UNAVAILABLE when the peer
// refuses or is unreachable. Reads nothing (not even a server hello). The
// returned socket is in blocking mode (callers pass MSG_DONTWAIT or set
// SO_RCVTIMEO/SO_SNDTIMEO to bound each call), with TCP_NODELAY.
// `socket_buffer_bytes` as in ConfigureDataSocket.
absl::StatusOr<UniqueFd> DialTcp(const HostPort& address, absl::Time deadline,
                                 int socket_buffer_bytes = 0);

// ---- Client side, step by step (the data client's dial) ----
//
// Each step waits no later than `until` and gives up soon (within ~20 ms)
// after `stopped()` turns true: DEADLINE_EXCEEDED when `until` passes,
// CANCELLED when stopped, UNAVAILABLE (with the precise reason, for logs)
// when the peer cannot be reached. A null `stopped` never stops.
using StopCheck = std::function<bool()>;

// One socket address of a peer.
struct PeerAddress {
  sockaddr_storage storage{};
  socklen_t length = 0;
  int family() const { return storage.ss_family; }
};

// True when `host` is an IPv4 or IPv6 literal (a bracketed one too), which
// needs no name resolution.
bool IsIpLiteral(absl::string_view host);

// `address` as socket addresses. An IP literal is parsed on the spot; a host
// name is resolved with getaddrinfo_a, waiting as said above. A lookup still
// running when the wait ends finishes in the background and is freed by a
// later call (glibc offers no way to stop it).
absl::StatusOr<std::vector<PeerAddress>> ResolvePeer(const HostPort& address,
                                                     absl::Time until,
                                                     const StopCheck& stopped);

// A non-blocking, close-on-exec TCP socket for `address`'s family, set up
// with ConfigureDataSocket. RESOURCE_EXHAUSTED when the process is out of
// descriptors or memory, INTERNAL otherwise.
absl::StatusOr<UniqueFd> OpenDataSocket(const PeerAddress& address,
                                        int socket_buffer_bytes);

// Connects non-blocking `fd` to `address` and waits for the TCP handshake.
// Shutting `fd` down from another thread also ends the wait.
absl::Status ConnectSocket(int fd, const PeerAddress& address, absl::Time until,
                           const StopCheck& stopped);

// Reads the kServerHelloBytes bytes a data server sends at accept from
// non-blocking `fd` and checks them (wire.h DecodeServerHello): UNAVAILABLE
// when the peer closes, resets, or sends anything but a valid hello.
absl::Status ReadServerHello(int fd, absl::Time until,
                             const StopCheck& stopped);

// Puts `fd` back into blocking mode.
void SetBlocking(int fd);

// Sets the socket options both ends of a data connection use: TCP_NODELAY,
// and keepalive / TCP_USER_TIMEOUT so that a vanished peer is noticed within
// about a minute even by a thread blocked on an idle connection. A positive
// `socket_buffer_bytes` fixes SO_SNDBUF and SO_RCVBUF (the kernel doubles it
// and caps it at net.core.wmem_max/rmem_max); 0 keeps kernel autotuning.
void ConfigureDataSocket(int fd, int socket_buffer_bytes = 0);

// Bounds the next blocking receives (SO_RCVTIMEO) or sends (SO_SNDTIMEO) on
// `fd` by `timeout` (at least 1 ms, since zero would mean "forever").
void SetIoTimeout(int fd, bool receive, absl::Duration timeout);

// Blocking reads/writes of exactly the given bytes (for blocking sockets).
// UNAVAILABLE when the connection ends or fails first.
absl::Status ReadFull(int fd, void* data, size_t size);
// `flags` are added to MSG_NOSIGNAL (e.g. MSG_MORE when a payload follows).
absl::Status WriteFull(int fd, iovec* iov, int iov_count, int flags = 0);
// Reads and drops `size` bytes.
absl::Status Discard(int fd, uint64_t size);

// Sends user memory into a TCP socket without the sender-side copy: vmsplice
// lends the pages to a pipe and splice moves them into the socket, whose
// buffers then reference them (loopback and NICs alike) until the bytes are
// consumed/acknowledged. The caller must keep the memory mapped and unchanged
// until the receiver has the bytes (for the data plane: until the response).
// One owner, not thread-safe.
class PageSender {
 public:
  // Bytes moved per vmsplice (the pipe's capacity).
  static constexpr size_t kPipeBytes = 1 << 20;

  // A pipe sized kPipeBytes (or the system's smaller maximum).
  static absl::StatusOr<PageSender> Create();

  // Sends `size` bytes at `data` into blocking socket `fd` (a send timeout
  // set with SetIoTimeout bounds it); `more` = more bytes of the same message
  // follow (MSG_MORE on the last piece). Adds what reached the socket to
  // `*sent`. DEADLINE_EXCEEDED on the send timeout, UNAVAILABLE when the
  // connection fails; after an error bytes may remain in the pipe, so the
  // connection and this sender must be dropped.
  absl::Status Send(int fd, const std::byte* data, size_t size, bool more,
                    size_t* sent);

  // The same for a non-blocking socket `fd`, as far as it takes bytes now:
  // first moves what an earlier call left in the pipe, then lends more of
  // `data` (the part of the payload not lent yet) and moves it on. Returns
  // how many bytes of `data` it lent; the payload has reached the socket once
  // all of it is lent and pending() is 0. UNAVAILABLE when the connection
  // fails (the sender must then be dropped with it).
  absl::StatusOr<size_t> SendSome(int fd, const std::byte* data, size_t size,
                                  bool more);
  // Bytes lent to the pipe and not yet in the socket.
  size_t pending() const { return in_pipe_; }

 private:
  PageSender(UniqueFd read, UniqueFd write, size_t capacity)
      : read_(std::move(read)), write_(std::move(write)), capacity_(capacity) {}
  UniqueFd read_;
  UniqueFd write_;
  size_t capacity_;
  size_t in_pipe_ = 0;  // SendSome's bytes still in the pipe
};

// True when an idle connection can be reused: the peer has not closed it and
// sent nothing unsolicited.
bool IdleConnectionAlive(int fd);

}  // namespace rdma_agent::tcp

#endif  // RDMA_AGENTD_BACKENDS_TCP_SOCKET_UTIL_H_

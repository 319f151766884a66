#ifndef RDMA_AGENTD_BACKENDS_TCP_SOCKET_UTIL_H_
#define RDMA_AGENTD_BACKENDS_TCP_SOCKET_UTIL_H_

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/unique_fd.h"

namespace rdma_agent::tcp {

struct HostPort {
  std::string host;
  uint16_t port = 0;
};

// Parses "host:port" or "[v6-literal]:port"; INVALID_ARGUMENT when malformed
// (a bare IPv6 literal is ambiguous and refused).
absl::StatusOr<HostPort> ParseHostPort(absl::string_view text);

// "host:port", bracketing IPv6 literals.
std::string FormatHostPort(absl::string_view host, uint16_t port);

// True for addresses that mean "every interface" ("", 0.0.0.0, ::, [::]).
bool IsWildcardHost(absl::string_view host);

// A listening TCP socket on `address` (port 0 picks a free port), with
// SO_REUSEADDR. The port actually bound goes to `*bound_port`.
absl::StatusOr<UniqueFd> ListenTcp(const HostPort& address, uint16_t* bound_port);

// Connects to `address` without blocking past `deadline`: DEADLINE_EXCEEDED
// when it passes, UNAVAILABLE when the peer refuses or is unreachable. The
// returned socket is in blocking mode (callers pass MSG_DONTWAIT or set
// SO_RCVTIMEO/SO_SNDTIMEO to bound each call), with TCP_NODELAY.
absl::StatusOr<UniqueFd> DialTcp(const HostPort& address, absl::Time deadline);

// Sets the socket options both ends of a data connection use.
void ConfigureDataSocket(int fd);

// Bounds the next blocking receives (SO_RCVTIMEO) or sends (SO_SNDTIMEO) on
// `fd` by `timeout` (at least 1 ms, since zero would mean "forever").
void SetIoTimeout(int fd, bool receive, absl::Duration timeout);

// Blocking reads/writes of exactly the given bytes (for blocking sockets).
// UNAVAILABLE when the connection ends or fails first.
absl::Status ReadFull(int fd, void* data, size_t size);
absl::Status WriteFull(int fd, iovec* iov, int iov_count);
// Reads and drops `size` bytes.
absl::Status Discard(int fd, uint64_t size);

// True when an idle connection can be reused: the peer has not closed it and
// sent nothing unsolicited.
bool IdleConnectionAlive(int fd);

}  // namespace rdma_agent::tcp

#endif  // RDMA_AGENTD_BACKENDS_TCP_SOCKET_UTIL_H_

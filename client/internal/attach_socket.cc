#include "client/internal/attach_socket.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/fd_message.h"
#include "common/status_util.h"

namespace rdma_agent::client::internal {
namespace {

absl::Status SocketError(absl::string_view what, int err) {
  // SO_SNDTIMEO/SO_RCVTIMEO expired (connect to a full backlog, say).
  if (err == EAGAIN || err == EWOULDBLOCK) {
    return absl::DeadlineExceededError(
        absl::StrCat(what, ": the attach socket did not answer in time"));
  }
  if (err == ENOENT || err == ECONNREFUSED || err == ECONNRESET ||
      err == EPIPE) {
    return ErrnoStatus(absl::StatusCode::kUnavailable, what, err);
  }
  if (err == EACCES || err == EPERM) {
    return ErrnoStatus(absl::StatusCode::kPermissionDenied, what, err);
  }
  return ErrnoStatus(absl::StatusCode::kInternal, what, err);
}

absl::StatusOr<UniqueFd> ConnectUnix(const std::string& path,
                                     absl::Duration timeout) {
  struct sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("attach socket path '", path, "' is empty or longer than ",
                     sizeof(addr.sun_path) - 1, " bytes"));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  UniqueFd sock(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!sock) return SocketError("socket", errno);
  // Bounds every later send/recv on this socket: the agent must not hang us.
  const struct timeval tv = absl::ToTimeval(timeout);
  if (::setsockopt(sock.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) != 0 ||
      ::setsockopt(sock.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) != 0) {
    return SocketError("setsockopt", errno);
  }
  if (::connect(sock.get(), reinterpret_cast<struct sockaddr*>(&addr),
                sizeof(addr)) != 0) {
    return SocketError(absl::StrCat("connecting to attach socket ", path),
                       errno);
  }
  return sock;
}

}  // namespace

absl::StatusOr<std::string> AttachSocketNextTo(absl::string_view target) {
  absl::string_view path = target;
  if (absl::ConsumePrefix(&path, "unix://")) {
    // unix:///abs/path: what follows the authority is the absolute path.
  } else if (!absl::ConsumePrefix(&path, "unix:")) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot find the attach socket next to non-unix target '",
                     target, "'; set the attach socket path explicitly"));
  }
  const size_t slash = path.rfind('/');
  if (slash == absl::string_view::npos) return std::string("attach.sock");
  return absl::StrCat(path.substr(0, slash + 1), "attach.sock");
}

absl::StatusOr<AttachReply> ExchangeOnAttachSocket(
    const std::string& path, const rdma::agent::v1::AttachRequest& request,
    int fd, absl::Duration timeout, bool keep_connection) {
  absl::StatusOr<UniqueFd> sock = ConnectUnix(path, timeout);
  if (!sock.ok()) return sock.status();
  absl::Status sent = SendFdMessage(sock->get(), request, fd);
  if (!sent.ok()) return sent;
  // Waiting here, rather than inside ReceiveFdMessage, tells a silent agent
  // (DEADLINE_EXCEEDED) apart from a broken one; SO_RCVTIMEO stays as the
  // bound of the reads that follow.
  struct pollfd pfd = {sock->get(), POLLIN, 0};
  int ready;
  do {
    ready = ::poll(&pfd, 1,
                   static_cast<int>(std::clamp<int64_t>(
                       absl::ToInt64Milliseconds(timeout), 0, INT32_MAX)));
  } while (ready < 0 && errno == EINTR);
  if (ready < 0) return SocketError("poll on the attach socket", errno);
  if (ready == 0) {
    return absl::DeadlineExceededError(
        absl::StrCat("no answer from the attach socket ", path, " within ",
                     absl::FormatDuration(timeout)));
  }
  AttachReply reply;
  absl::StatusOr<UniqueFd> received =
      ReceiveFdMessage(sock->get(), &reply.response);
  if (!received.ok()) return received.status();
  reply.fd = std::move(*received);
  if (keep_connection) reply.connection = std::move(*sock);
  return reply;
}

absl::Status ResponseStatus(const rdma::agent::v1::AttachResponse& response) {
  if (response.code() == 0) return absl::OkStatus();
  // Codes outside the gRPC range would not mean anything to callers.
  return StatusFromInt(response.code(), response.message());
}

}  // namespace rdma_agent::client::internal

#include "client/internal/attach_socket.h"

#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/strip.h"
#include "absl/strings/str_cat.h"
#include "common/fd_message.h"

namespace rdma_agent::client::internal {
namespace {

absl::Status SocketError(absl::string_view what, int err) {
  if (err == EAGAIN || err == EWOULDBLOCK) {
    return absl::DeadlineExceededError(
        absl::StrCat(what, ": no answer from the attach socket in time"));
  }
  if (err == ENOENT || err == ECONNREFUSED || err == ECONNRESET ||
      err == EPIPE) {
    return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(err)));
  }
  if (err == EACCES || err == EPERM) {
    return absl::PermissionDeniedError(
        absl::StrCat(what, ": ", std::strerror(err)));
  }
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(err)));
}

absl::StatusOr<UniqueFd> ConnectUnix(const std::string& path,
                                     absl::Duration timeout) {
  struct sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attach socket path '", path, "' is empty or longer than ",
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
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot find the attach socket next to non-unix target '", target,
        "'; set the attach socket path explicitly"));
  }
  const size_t slash = path.rfind('/');
  if (slash == absl::string_view::npos) return std::string("attach.sock");
  return absl::StrCat(path.substr(0, slash + 1), "attach.sock");
}

absl::StatusOr<AttachReply> ExchangeOnAttachSocket(
    const std::string& path, const rdma::agent::v1::AttachRequest& request,
    int fd, absl::Duration timeout) {
  absl::StatusOr<UniqueFd> sock = ConnectUnix(path, timeout);
  if (!sock.ok()) return sock.status();
  // fd_message maps errno to statuses without knowing about our timeouts, so
  // EAGAIN (SO_RCVTIMEO/SO_SNDTIMEO expired) is recognised here.
  errno = 0;
  absl::Status sent = SendFdMessage(sock->get(), request, fd);
  if (!sent.ok()) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      return SocketError("sending attach request", errno);
    }
    return sent;
  }
  AttachReply reply;
  errno = 0;
  absl::StatusOr<UniqueFd> received =
      ReceiveFdMessage(sock->get(), &reply.response);
  if (!received.ok()) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      return SocketError("waiting for the attach response", errno);
    }
    return received.status();
  }
  reply.fd = std::move(*received);
  return reply;
}

absl::Status ResponseStatus(const rdma::agent::v1::AttachResponse& response) {
  if (response.code() == 0) return absl::OkStatus();
  // Codes outside the gRPC range would not mean anything to callers.
  const bool known = response.code() > 0 && response.code() <= 16;
  return absl::Status(known ? static_cast<absl::StatusCode>(response.code())
                            : absl::StatusCode::kUnknown,
                      response.message());
}

}  // namespace rdma_agent::client::internal

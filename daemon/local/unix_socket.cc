#include "daemon/local/unix_socket.h"

#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/accept_loop.h"
#include "common/status_util.h"
#include "spdlog/spdlog.h"

namespace rdma_agent {
namespace {

absl::Status ErrnoError(absl::string_view what) {
  return ErrnoStatus(absl::StatusCode::kInternal, what, errno);
}

}  // namespace

absl::StatusOr<PeerCredentials> ReadPeerCredentials(int fd) {
  struct ucred cred;
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return ErrnoError("SO_PEERCRED");
  }
  return PeerCredentials{cred.pid, cred.uid, cred.gid};
}

absl::StatusOr<std::unique_ptr<UnixListener>> UnixListener::Start(
    const std::string& path, ConnectionHandler on_connection, mode_t mode) {
  struct sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("Unix socket path '", path, "' is empty or longer than ",
                     sizeof(addr.sun_path) - 1, " bytes"));
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);

  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) return ErrnoError("socket");
  // A socket file left by a dead agent would make bind fail; one a live
  // process still accepts on is never taken over (its clients would be cut
  // off from it).
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) {
    UniqueFd probe(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (probe &&
        ::connect(probe.get(), reinterpret_cast<struct sockaddr*>(&addr),
                  sizeof(addr)) == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          path, " is in use by a running process; not taking it over"));
    }
    ::unlink(path.c_str());
  }
  if (::bind(fd.get(), reinterpret_cast<struct sockaddr*>(&addr),
             sizeof(addr)) != 0) {
    return ErrnoError(absl::StrCat("bind ", path));
  }
  // Before listen(): nobody connects before the mode is in force.
  if (::chmod(path.c_str(), mode) != 0) {
    const absl::Status status = ErrnoError(absl::StrCat("chmod ", path));
    ::unlink(path.c_str());
    return status;
  }
  if (::listen(fd.get(), 128) != 0) {
    const absl::Status status = ErrnoError(absl::StrCat("listen ", path));
    ::unlink(path.c_str());
    return status;
  }
  std::unique_ptr<UnixListener> listener(
      new UnixListener(path, std::move(on_connection)));
  AcceptLoop::Options options;
  options.name = path;
  auto loop = AcceptLoop::Start(
      std::move(fd), std::move(options),
      [raw = listener.get()](UniqueFd connection, const sockaddr_storage&) {
        raw->OnAccepted(std::move(connection));
      });
  if (!loop.ok()) {
    ::unlink(path.c_str());
    return loop.status();
  }
  listener->loop_ = std::move(*loop);
  return listener;
}

UnixListener::UnixListener(std::string path, ConnectionHandler on_connection)
    : path_(std::move(path)), on_connection_(std::move(on_connection)) {}

UnixListener::~UnixListener() {
  loop_.reset();  // no connection is handed on after this
  ::unlink(path_.c_str());
}

void UnixListener::OnAccepted(UniqueFd connection) {
  auto peer = ReadPeerCredentials(connection.get());
  if (!peer.ok()) {
    if (auto suppressed = dropped_log_.Allow()) {
      spdlog::warn("dropping connection on {}: {} ({} more not logged)", path_,
                   peer.status().ToString(), *suppressed);
    }
    return;
  }
  on_connection_(std::move(connection), *peer);
}

}  // namespace rdma_agent

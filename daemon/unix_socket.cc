#include "daemon/unix_socket.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_util.h"
#include "spdlog/spdlog.h"

namespace rdma_agent {
namespace {

// Out of fds (or kernel memory), accept fails at once while the connection
// stays queued: without a pause the loop spins and logs as fast as it can.
// The pause doubles from kFirstPause to kLongestPause while it lasts; the
// first accept that works resets it.
constexpr absl::Duration kFirstPause = absl::Milliseconds(10);
constexpr absl::Duration kLongestPause = absl::Seconds(1);

bool OutOfResources(int err) {
  return err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM;
}

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
    const std::string& path, ConnectionHandler on_connection) {
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
  // A socket file left by a dead agent would make bind fail.
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) {
    ::unlink(path.c_str());
  }
  if (::bind(fd.get(), reinterpret_cast<struct sockaddr*>(&addr),
             sizeof(addr)) != 0) {
    return ErrnoError(absl::StrCat("bind ", path));
  }
  if (::chmod(path.c_str(), 0666) != 0) {
    const absl::Status status = ErrnoError(absl::StrCat("chmod ", path));
    ::unlink(path.c_str());
    return status;
  }
  if (::listen(fd.get(), 128) != 0) {
    const absl::Status status = ErrnoError(absl::StrCat("listen ", path));
    ::unlink(path.c_str());
    return status;
  }
  UniqueFd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake) {
    ::unlink(path.c_str());
    return ErrnoError("eventfd");
  }
  return std::unique_ptr<UnixListener>(new UnixListener(
      path, std::move(fd), std::move(wake), std::move(on_connection)));
}

UnixListener::UnixListener(std::string path, UniqueFd listen_fd,
                           UniqueFd wake_fd, ConnectionHandler on_connection)
    : path_(std::move(path)),
      listen_fd_(std::move(listen_fd)),
      wake_fd_(std::move(wake_fd)),
      on_connection_(std::move(on_connection)) {
  thread_ = std::thread([this] { AcceptLoop(); });
}

UnixListener::~UnixListener() {
  const uint64_t one = 1;
  if (::write(wake_fd_.get(), &one, sizeof(one)) < 0) {
    spdlog::warn("cannot wake accept loop of {}: {}", path_,
                 std::strerror(errno));
  }
  thread_.join();
  ::unlink(path_.c_str());
}

bool UnixListener::PauseUnlessStopped(absl::Duration pause) {
  struct pollfd wake = {wake_fd_.get(), POLLIN, 0};
  const int ready =
      ::poll(&wake, 1, static_cast<int>(absl::ToInt64Milliseconds(pause)));
  return !(ready > 0 && wake.revents != 0);
}

void UnixListener::AcceptLoop() {
  struct pollfd fds[2] = {{listen_fd_.get(), POLLIN, 0},
                          {wake_fd_.get(), POLLIN, 0}};
  absl::Duration pause = kFirstPause;
  bool starved = false;  // accept failed for want of fds since the last one
  while (true) {
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("poll on {} failed: {}", path_, std::strerror(errno));
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    UniqueFd connection(
        ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!connection) {
      const int err = errno;
      if (OutOfResources(err)) {
        if (auto suppressed = out_of_fds_log_.Allow()) {
          spdlog::warn(
              "accept on {} failed: {}; retrying in up to {} ({} more such "
              "failures not logged)",
              path_, std::strerror(err), absl::FormatDuration(kLongestPause),
              *suppressed);
        }
        starved = true;
        if (!PauseUnlessStopped(pause)) return;
        pause = std::min(pause * 2, kLongestPause);
      } else if (err != EINTR && err != EAGAIN && err != ECONNABORTED) {
        if (auto suppressed = other_errors_log_.Allow()) {
          spdlog::warn("accept on {} failed: {} ({} more not logged)", path_,
                       std::strerror(err), *suppressed);
        }
      }
      continue;
    }
    pause = kFirstPause;
    if (starved) {
      starved = false;
      if (recovered_log_.Allow()) spdlog::info("accepting on {} again", path_);
    }
    auto peer = ReadPeerCredentials(connection.get());
    if (!peer.ok()) {
      if (auto suppressed = other_errors_log_.Allow()) {
        spdlog::warn("dropping connection on {}: {} ({} more not logged)",
                     path_, peer.status().ToString(), *suppressed);
      }
      continue;
    }
    on_connection_(std::move(connection), *peer);
  }
}

}  // namespace rdma_agent

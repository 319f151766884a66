#include "daemon/local/caller_identity.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <cerrno>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/status_util.h"

namespace rdma_agent {
namespace {

// The default Unix socket buffer (~200 KiB) splits every ReadBuffer chunk
// into many wake-ups of the reader.
constexpr int kApiSocketBufferBytes = 4 << 20;

// Linux 6.5's option; older C library headers do not name it.
#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77
#endif

bool SameSocket(int fd, ino_t inode) {
  struct stat st;
  return ::fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode) && st.st_ino == inode;
}

}  // namespace

bool ConnectionOpen(const CallerConnection& connection) {
  return SameSocket(connection.fd, connection.inode);
}

bool ConnectionAlive(const CallerConnection& connection) {
  if (!ConnectionOpen(connection)) return false;
  struct pollfd end = {connection.fd, POLLRDHUP, 0};
  if (::poll(&end, 1, 0) == 1 &&
      (end.revents & (POLLHUP | POLLRDHUP | POLLERR | POLLNVAL)) != 0) {
    return false;
  }
  // The fd may have been closed and its number reused during the poll.
  return ConnectionOpen(connection);
}

absl::StatusOr<UniqueFd> OpenPeerPidfd(const CallerConnection& connection) {
  // gRPC may close the fd, and its number be reused, at any time: the pidfd
  // is the connection's only if the fd was that socket before and after.
  const absl::Status closed =
      absl::NotFoundError("the caller's connection has closed");
  if (!ConnectionOpen(connection)) return closed;
  int pidfd = -1;
  socklen_t length = sizeof(pidfd);
  if (::getsockopt(connection.fd, SOL_SOCKET, SO_PEERPIDFD, &pidfd, &length) !=
      0) {
    const int error = errno;
    if (error == ENOPROTOOPT) {
      return absl::UnimplementedError("this kernel has no SO_PEERPIDFD");
    }
    // ESRCH (or EINVAL before 6.9): the process that connected has exited.
    if (error == ESRCH || error == EINVAL || error == ENODATA) {
      return absl::NotFoundError("the caller's process has exited");
    }
    return ErrnoStatus(absl::StatusCode::kInternal, "SO_PEERPIDFD", error);
  }
  UniqueFd owned(pidfd);
  if (!ConnectionOpen(connection)) return closed;
  return owned;
}

bool CallerTable::Live(int fd, const Entry& entry) {
  return SameSocket(fd, entry.inode);
}

absl::Status CallerTable::Admit(int fd, const PeerCredentials& peer,
                                size_t max_per_user, size_t max_total) {
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    return ErrnoStatus(absl::StatusCode::kInternal, "fstat of a new connection",
                       errno);
  }
  absl::MutexLock lock(&mu_);
  // The new fd's number may be a closed connection's: drop it first.
  by_fd_.erase(fd);
  size_t mine = 0;
  for (auto it = by_fd_.begin(); it != by_fd_.end();) {
    if (!Live(it->first, it->second)) {
      by_fd_.erase(it++);
      continue;
    }
    if (it->second.peer.uid == peer.uid) ++mine;
    ++it;
  }
  if (mine >= max_per_user) {
    return absl::ResourceExhaustedError(
        absl::StrCat("user ", peer.uid, " already has ", mine,
                     " connections to the agent (limit ", max_per_user,
                     ", --max_connections_per_user)"));
  }
  if (by_fd_.size() >= max_total) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the agent already serves ", by_fd_.size(), " connections (limit ",
        max_total, ", --max_connections)"));
  }
  by_fd_[fd] = Entry{peer, st.st_ino};
  return absl::OkStatus();
}

size_t CallerTable::Connections(uid_t uid) const {
  absl::MutexLock lock(&mu_);
  size_t count = 0;
  for (const auto& [fd, entry] : by_fd_) {
    if (entry.peer.uid == uid && Live(fd, entry)) ++count;
  }
  return count;
}

absl::StatusOr<PeerCredentials> CallerTable::Lookup(
    const grpc::ServerContextBase& context) const {
  absl::StatusOr<CallerConnection> connection = Connection(context);
  if (!connection.ok()) return connection.status();
  return connection->peer;
}

absl::StatusOr<CallerConnection> CallerTable::Connection(
    const grpc::ServerContextBase& context) const {
  const std::string peer = context.peer();
  absl::string_view fd_text = peer;
  int fd = -1;
  if (!absl::ConsumePrefix(&fd_text, "fd:") ||
      !absl::SimpleAtoi(fd_text, &fd)) {
    return absl::UnauthenticatedError(
        absl::StrCat("cannot identify the caller (peer '", peer, "')"));
  }
  absl::MutexLock lock(&mu_);
  auto it = by_fd_.find(fd);
  if (it == by_fd_.end()) {
    return absl::UnauthenticatedError(
        absl::StrCat("no credentials for connection ", peer));
  }
  return CallerConnection{it->second.peer, fd, it->second.inode};
}

absl::Status AdmitApiConnection(int fd, const PeerCredentials& peer,
                                CallerTable* callers, size_t max_per_user,
                                size_t max_total) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) {
    return ErrnoStatus(absl::StatusCode::kInternal,
                       "cannot make connection non-blocking", errno);
  }
  ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &kApiSocketBufferBytes,
               sizeof(kApiSocketBufferBytes));
  return callers->Admit(fd, peer, max_per_user, max_total);
}

}  // namespace rdma_agent

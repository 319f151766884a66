#include "daemon/caller_identity.h"

#include <fcntl.h>
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

}  // namespace

bool CallerTable::Live(int fd, const Entry& entry) {
  struct stat st;
  return ::fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode) &&
         st.st_ino == entry.inode;
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
  return it->second.peer;
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

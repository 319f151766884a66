#include "tests/testing/fake_service_manager.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace rdma_agent::testing {

absl::StatusOr<FakeServiceManager> FakeServiceManager::Bind(
    const std::string& path) {
  sockaddr_un address = {};
  if (path.size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is too long"));
  }
  UniqueFd fd(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!fd) return absl::InternalError(std::strerror(errno));
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, path.c_str(), path.size());
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&address),
             sizeof(address)) != 0) {
    return absl::InternalError(
        absl::StrCat("bind ", path, ": ", std::strerror(errno)));
  }
  return FakeServiceManager(path, std::move(fd));
}

FakeServiceManager::~FakeServiceManager() {
  if (fd_) ::unlink(path_.c_str());
}

absl::StatusOr<std::string> FakeServiceManager::Next(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    const int64_t left_ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    pollfd pfd = {fd_.get(), POLLIN, 0};
    const int ready =
        ::poll(&pfd, 1, static_cast<int>(std::max<int64_t>(left_ms, 0)));
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) return absl::InternalError(std::strerror(errno));
    if (ready == 0) {
      return absl::DeadlineExceededError(absl::StrCat(
          "no notification within ", absl::FormatDuration(timeout)));
    }
    char buffer[4096];
    const ssize_t n = ::recv(fd_.get(), buffer, sizeof(buffer), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::InternalError(std::strerror(errno));
    return std::string(buffer, static_cast<size_t>(n));
  }
}

}  // namespace rdma_agent::testing

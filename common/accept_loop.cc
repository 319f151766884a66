#include "common/accept_loop.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/status_util.h"
#include "spdlog/spdlog.h"

namespace rdma_agent {
namespace {

constexpr absl::Duration kFirstPause = absl::Milliseconds(10);
constexpr absl::Duration kLongestPause = absl::Seconds(1);

bool OutOfResources(int err) {
  return err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM;
}

// Nothing (left) to accept: the peer gave up, or another wake-up took it.
bool Transient(int err) {
  return err == EAGAIN || err == EWOULDBLOCK || err == EINTR ||
         err == ECONNABORTED || err == EPROTO;
}

}  // namespace

absl::StatusOr<std::unique_ptr<AcceptLoop>> AcceptLoop::Start(UniqueFd listener,
                                                              Options options,
                                                              Handler handler) {
  const int flags = ::fcntl(listener.get(), F_GETFL);
  if (flags < 0 || ::fcntl(listener.get(), F_SETFL, flags | O_NONBLOCK) != 0) {
    return ErrnoStatus(absl::StatusCode::kInternal,
                       "making the listener non-blocking", errno);
  }
  UniqueFd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake) {
    return ErrnoStatus(absl::StatusCode::kInternal, "eventfd", errno);
  }
  return std::unique_ptr<AcceptLoop>(
      new AcceptLoop(std::move(listener), std::move(wake), std::move(options),
                     std::move(handler)));
}

AcceptLoop::AcceptLoop(UniqueFd listener, UniqueFd wake, Options options,
                       Handler handler)
    : listener_(std::move(listener)),
      wake_(std::move(wake)),
      options_(std::move(options)),
      handler_(std::move(handler)),
      out_of_fds_log_(options_.log_interval),
      other_errors_log_(options_.log_interval),
      recovered_log_(options_.log_interval) {
  thread_ = std::thread([this] { Run(); });
}

void AcceptLoop::Stop() {
  if (!thread_.joinable()) return;
  const uint64_t one = 1;
  if (::write(wake_.get(), &one, sizeof(one)) < 0) {
    spdlog::warn("cannot wake the accept loop of {}: {}", options_.name,
                 std::strerror(errno));
  }
  thread_.join();
}

bool AcceptLoop::PauseUnlessStopped(absl::Duration pause) {
  struct pollfd wake = {wake_.get(), POLLIN, 0};
  const int ready =
      ::poll(&wake, 1, static_cast<int>(absl::ToInt64Milliseconds(pause)));
  return !(ready > 0 && wake.revents != 0);
}

void AcceptLoop::Run() {
  struct pollfd fds[2] = {{listener_.get(), POLLIN, 0},
                          {wake_.get(), POLLIN, 0}};
  absl::Duration pause = kFirstPause;
  bool starved = false;  // accept failed for want of fds since the last one
  while (true) {
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("poll on {} failed: {}; no longer accepting", options_.name,
                    std::strerror(errno));
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    sockaddr_storage peer{};
    socklen_t length = sizeof(peer);
    UniqueFd connection(::accept4(listener_.get(),
                                  reinterpret_cast<sockaddr*>(&peer), &length,
                                  SOCK_CLOEXEC));
    if (!connection) {
      const int err = errno;
      if (Transient(err)) continue;
      LogRateLimiter& log =
          OutOfResources(err) ? out_of_fds_log_ : other_errors_log_;
      if (auto suppressed = log.Allow()) {
        spdlog::warn(
            "accept on {} failed: {}; retrying in up to {} ({} more such "
            "failures not logged)",
            options_.name, std::strerror(err),
            absl::FormatDuration(kLongestPause), *suppressed);
      }
      // The pending connection stays queued: retrying at once would spin.
      starved = true;
      if (!PauseUnlessStopped(pause)) return;
      pause = std::min(pause * 2, kLongestPause);
      continue;
    }
    pause = kFirstPause;
    if (starved) {
      starved = false;
      if (recovered_log_.Allow()) {
        spdlog::info("accepting on {} again", options_.name);
      }
    }
    handler_(std::move(connection), peer);
  }
}

}  // namespace rdma_agent

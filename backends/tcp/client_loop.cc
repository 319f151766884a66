#include "backends/tcp/client_loop.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "common/thread_name.h"

namespace rdma_agent::tcp {
namespace {

absl::Status Errno(absl::string_view what) {
  return absl::ResourceExhaustedError(
      absl::StrCat("tcp client loop: ", what, ": ", std::strerror(errno)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<ClientLoop>> ClientLoop::Start(
    absl::string_view thread_name) {
  std::unique_ptr<ClientLoop> loop(new ClientLoop());
  loop->epoll_.reset(epoll_create1(EPOLL_CLOEXEC));
  if (!loop->epoll_.valid()) return Errno("epoll_create1");
  loop->wake_.reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!loop->wake_.valid()) return Errno("eventfd");
  // The wake-up's data is null: no watcher.
  epoll_event event{};
  event.events = EPOLLIN;
  if (epoll_ctl(loop->epoll_.get(), EPOLL_CTL_ADD, loop->wake_.get(), &event) <
      0) {
    return Errno("epoll_ctl");
  }
  try {
    loop->thread_ = std::thread([raw = loop.get()] { raw->Loop(); });
  } catch (const std::system_error& error) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "tcp client loop: cannot start its thread: ", error.what()));
  }
  // Named before Start returns (not by the thread itself, later), so that
  // whoever counts threads by name right after sees it.
  NameThread(loop->thread_, thread_name);
  return loop;
}

ClientLoop::~ClientLoop() {
  if (thread_.joinable()) {
    const uint64_t one = 1;
    (void)!write(wake_.get(), &one, sizeof(one));
    thread_.join();
  }
}

absl::Status ClientLoop::Watch(int fd, bool write, Watcher* watcher) {
  return Control(EPOLL_CTL_ADD, fd, write, watcher);
}

absl::Status ClientLoop::Rearm(int fd, bool write, Watcher* watcher) {
  return Control(EPOLL_CTL_MOD, fd, write, watcher);
}

void ClientLoop::Forget(int fd) {
  epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, fd, nullptr);
}

absl::Status ClientLoop::Control(int op, int fd, bool write, Watcher* watcher) {
  epoll_event event{};
  event.events = EPOLLIN | EPOLLRDHUP | EPOLLONESHOT;
  if (write) event.events |= EPOLLOUT;
  event.data.ptr = watcher;
  if (epoll_ctl(epoll_.get(), op, fd, &event) < 0) {
    return absl::UnavailableError(
        absl::StrCat("tcp client loop: epoll_ctl: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

void ClientLoop::Loop() {
  constexpr int kEvents = 64;
  epoll_event events[kEvents];
  while (true) {
    const int ready = epoll_wait(epoll_.get(), events, kEvents, -1);
    if (ready < 0) {
      if (errno == EINTR) continue;
      return;  // EBADF/EINVAL: cannot happen with a valid set
    }
    for (int i = 0; i < ready; ++i) {
      auto* watcher = static_cast<Watcher*>(events[i].data.ptr);
      if (watcher == nullptr) return;  // the destructor's wake-up
      watcher->OnReady();
    }
  }
}

}  // namespace rdma_agent::tcp

#include "daemon/local/client_watcher.h"

#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_util.h"
#include "spdlog/spdlog.h"

namespace rdma_agent {
namespace {

// epoll data of the wake-up eventfd; watches are numbered from 1.
constexpr uint64_t kWakeHandle = 0;

int PidfdOpen(pid_t pid) {
#ifdef SYS_pidfd_open
  return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
#else
  errno = ENOSYS;
  return -1;
#endif
}

bool ProcessExited(int pidfd) {
  struct pollfd process = {pidfd, POLLIN, 0};
  return ::poll(&process, 1, 0) != 0;
}

absl::Status ClientGone() {
  return absl::NotFoundError(
      "the caller is gone (its process exited or its connection closed)");
}

}  // namespace

struct ClientWatcher::Watch {
  Key key;
  // Who registered, and the connection they came through.
  CallerConnection connection;
  v1::Lifetime lifetime = v1::LIFETIME_UNSPECIFIED;
  UniqueFd pidfd;  // process watches only
  // Registrations bound to the client and not released.
  absl::flat_hash_set<uint64_t> ids;
  // Tickets that will still bind into this watch.
  int pending = 0;
  QuotaCharge charge;
};

// ------------------------------------------------------------------ Ticket

ClientWatcher::Ticket::Ticket(Ticket&& other) noexcept
    : watcher_(other.watcher_),
      watch_(std::exchange(other.watch_, 0)),
      lifetime_(other.lifetime_),
      caller_(other.caller_) {}

ClientWatcher::Ticket& ClientWatcher::Ticket::operator=(
    Ticket&& other) noexcept {
  if (this != &other) {
    if (watch_ != 0) watcher_->Unreserve(watch_);
    watcher_ = other.watcher_;
    watch_ = std::exchange(other.watch_, 0);
    lifetime_ = other.lifetime_;
    caller_ = other.caller_;
  }
  return *this;
}

ClientWatcher::Ticket::~Ticket() {
  if (watch_ != 0) watcher_->Unreserve(watch_);
}

// ----------------------------------------------------------- ClientWatcher

absl::StatusOr<std::unique_ptr<ClientWatcher>> ClientWatcher::Start(
    Options options, BufferTable* buffers,
    std::shared_ptr<ResourceQuota> quota) {
  UniqueFd epoll(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll) {
    return ErrnoStatus(absl::StatusCode::kInternal, "epoll_create1", errno);
  }
  UniqueFd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake) return ErrnoStatus(absl::StatusCode::kInternal, "eventfd", errno);
  struct epoll_event event = {};
  event.events = EPOLLIN;
  event.data.u64 = kWakeHandle;
  if (::epoll_ctl(epoll.get(), EPOLL_CTL_ADD, wake.get(), &event) != 0) {
    return ErrnoStatus(absl::StatusCode::kInternal, "epoll_ctl", errno);
  }
  std::unique_ptr<ClientWatcher> watcher(
      new ClientWatcher(std::move(options), buffers, std::move(quota),
                        std::move(epoll), std::move(wake)));
  watcher->thread_ = std::thread(&ClientWatcher::Run, watcher.get());
  watcher->removal_listener_ = buffers->AddRemovalListener(
      [raw = watcher.get()](uint64_t id) { raw->Unbind(id); });
  return watcher;
}

ClientWatcher::ClientWatcher(Options options, BufferTable* buffers,
                             std::shared_ptr<ResourceQuota> quota,
                             UniqueFd epoll, UniqueFd wake)
    : options_(std::move(options)),
      buffers_(buffers),
      quota_(std::move(quota)),
      epoll_(std::move(epoll)),
      wake_(std::move(wake)) {}

ClientWatcher::~ClientWatcher() {
  // Waits out a call in progress: the table calls its listener under its
  // lock.
  buffers_->RemoveRemovalListener(removal_listener_);
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  Wake();
  if (thread_.joinable()) thread_.join();
}

void ClientWatcher::Wake() {
  const uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof(one));
}

size_t ClientWatcher::watched() const {
  absl::MutexLock lock(&mu_);
  return watches_.size();
}

size_t ClientWatcher::bound() const {
  absl::MutexLock lock(&mu_);
  return by_id_.size();
}

absl::StatusOr<UniqueFd> ClientWatcher::OpenProcess(
    const CallerConnection& connection) {
  std::vector<std::string> why_not;
  if (options_.methods.peer_pidfd) {
    absl::StatusOr<UniqueFd> pidfd = OpenPeerPidfd(connection);
    if (pidfd.ok() || absl::IsNotFound(pidfd.status())) return pidfd;
    why_not.push_back(std::string(pidfd.status().message()));
  } else {
    why_not.push_back("SO_PEERPIDFD is not used");
  }
  const pid_t pid = connection.peer.pid;
  if (!options_.methods.pidfd_open) {
    why_not.push_back("pidfd_open is not used");
    return absl::UnimplementedError(absl::StrJoin(why_not, "; "));
  }
  if (pid <= 0) {
    why_not.push_back("its pid is not visible in the agent's pid namespace");
    return absl::UnimplementedError(absl::StrJoin(why_not, "; "));
  }
  UniqueFd pidfd(PidfdOpen(pid));
  if (!pidfd) {
    const int error = errno;
    if (error == ESRCH) return ClientGone();
    why_not.push_back(absl::StrCat("pidfd_open: ", std::strerror(error)));
    return absl::UnimplementedError(absl::StrJoin(why_not, "; "));
  }
  // The pid is the caller's only while the caller lives; had it exited (and
  // its pid been reused), its end of the connection would have closed.
  if (!ConnectionAlive(connection)) return ClientGone();
  return pidfd;
}

absl::StatusOr<ClientWatcher::Ticket> ClientWatcher::Reserve(
    const CallerConnection& connection, v1::Lifetime lifetime) {
  const PeerCredentials& caller = connection.peer;
  if (lifetime == v1::LIFETIME_CLIENT_PROCESS) {
    absl::StatusOr<UniqueFd> pidfd = OpenProcess(connection);
    if (pidfd.ok()) {
      const Key key =
          caller.pid > 0
              ? Key{KeyKind::kProcess, static_cast<uint64_t>(caller.pid),
                    caller.uid}
              : Key{KeyKind::kProcessOfConnection,
                    static_cast<uint64_t>(connection.fd), connection.inode};
      absl::StatusOr<uint64_t> handle =
          JoinOrAdd(connection, key, std::move(*pidfd), lifetime);
      if (!handle.ok()) return handle.status();
      return Ticket(this, *handle, lifetime, caller);
    }
    if (!absl::IsUnimplemented(pidfd.status())) return pidfd.status();
    if (auto suppressed = fallback_log_.Allow()) {
      spdlog::info(
          "cannot watch process {} of uid {} ({}): its registrations with "
          "LIFETIME_CLIENT_PROCESS end with their connection instead ({} "
          "more not logged)",
          caller.pid, caller.uid, std::string(pidfd.status().message()),
          *suppressed);
    }
    lifetime = v1::LIFETIME_CLIENT_CONNECTION;
  }
  if (!ConnectionAlive(connection)) return ClientGone();
  absl::StatusOr<uint64_t> handle =
      JoinOrAdd(connection,
                Key{KeyKind::kConnection, static_cast<uint64_t>(connection.fd),
                    connection.inode},
                UniqueFd(), lifetime);
  if (!handle.ok()) return handle.status();
  return Ticket(this, *handle, lifetime, caller);
}

bool ClientWatcher::Alive(const Watch& watch) {
  return watch.pidfd ? !ProcessExited(watch.pidfd.get())
                     : ConnectionAlive(watch.connection);
}

absl::StatusOr<uint64_t> ClientWatcher::JoinOrAdd(
    const CallerConnection& connection, const Key& key, UniqueFd pidfd,
    v1::Lifetime lifetime) {
  bool wake = false;
  uint64_t handle = 0;
  {
    absl::MutexLock lock(&mu_);
    auto found = by_key_.find(key);
    // A watch whose client has just gone is the thread's to release; the
    // caller is then another client (e.g. a new process with a reused pid).
    if (found != by_key_.end() && Alive(*watches_.at(found->second))) {
      ++watches_.at(found->second)->pending;
      return found->second;
    }
    absl::StatusOr<QuotaCharge> charge =
        quota_->Reserve(connection.peer.uid, 1);
    if (!charge.ok()) return charge.status();
    auto watch = std::make_unique<Watch>();
    watch->key = key;
    watch->connection = connection;
    watch->lifetime = lifetime;
    watch->pidfd = std::move(pidfd);
    watch->pending = 1;
    watch->charge = std::move(*charge);
    handle = next_handle_++;
    if (watch->pidfd) {
      struct epoll_event event = {};
      event.events = EPOLLIN;
      event.data.u64 = handle;
      if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, watch->pidfd.get(),
                      &event) != 0) {
        const int error = errno;
        return ErrnoStatus(error == ENOSPC || error == ENOMEM
                               ? absl::StatusCode::kResourceExhausted
                               : absl::StatusCode::kInternal,
                           "cannot watch the calling process (epoll_ctl)",
                           error);
      }
    } else {
      // The thread polls connections only while there are some.
      wake = connection_watches_++ == 0;
    }
    by_key_[key] = handle;
    watches_[handle] = std::move(watch);
  }
  if (wake) Wake();
  return handle;
}

void ClientWatcher::Bind(Ticket ticket, uint64_t id) {
  const uint64_t handle = std::exchange(ticket.watch_, 0);
  {
    absl::MutexLock lock(&mu_);
    auto it = watches_.find(handle);
    if (it != watches_.end()) {
      --it->second->pending;
      it->second->ids.insert(id);
      by_id_[id] = handle;
      return;
    }
  }
  // The client went away after Reserve: as if it had gone just after this.
  Release(ticket.caller_, {id},
          ticket.lifetime_ == v1::LIFETIME_CLIENT_PROCESS
              ? "its process exited"
              : "its connection closed");
}

void ClientWatcher::Unreserve(uint64_t handle) {
  absl::MutexLock lock(&mu_);
  auto it = watches_.find(handle);
  if (it == watches_.end()) return;
  --it->second->pending;
  DropIfUnusedLocked(handle);
}

void ClientWatcher::Unbind(uint64_t id) {
  absl::MutexLock lock(&mu_);
  auto bound = by_id_.find(id);
  if (bound == by_id_.end()) return;
  const uint64_t handle = bound->second;
  by_id_.erase(bound);
  watches_.at(handle)->ids.erase(id);
  DropIfUnusedLocked(handle);
}

void ClientWatcher::DropIfUnusedLocked(uint64_t handle) {
  const Watch& watch = *watches_.at(handle);
  // Closing a pidfd and giving a charge back are quick: done here.
  if (watch.pending == 0 && watch.ids.empty()) TakeLocked(handle);
}

std::unique_ptr<ClientWatcher::Watch> ClientWatcher::TakeLocked(
    uint64_t handle) {
  auto it = watches_.find(handle);
  if (it == watches_.end()) return nullptr;
  std::unique_ptr<Watch> watch = std::move(it->second);
  watches_.erase(it);
  auto key = by_key_.find(watch->key);
  if (key != by_key_.end() && key->second == handle) by_key_.erase(key);
  for (uint64_t id : watch->ids) by_id_.erase(id);
  if (watch->pidfd) {
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, watch->pidfd.get(), nullptr);
  } else {
    --connection_watches_;
  }
  return watch;
}

std::vector<uint64_t> ClientWatcher::ClosedConnectionsLocked() const {
  std::vector<uint64_t> closed;
  for (const auto& [handle, watch] : watches_) {
    if (!watch->pidfd && !ConnectionAlive(watch->connection)) {
      closed.push_back(handle);
    }
  }
  return closed;
}

void ClientWatcher::Release(const PeerCredentials& caller,
                            const std::vector<uint64_t>& ids,
                            absl::string_view why) {
  std::vector<uint64_t> released;
  for (uint64_t id : ids) {
    // Exactly a Release by the owner: unpublished now, unmapped (and its
    // quota given back) when the last op pinning it ends. An id released
    // meanwhile is simply not found.
    if (buffers_->Remove(id, caller.uid).ok()) released.push_back(id);
  }
  if (released.empty()) return;
  std::sort(released.begin(), released.end());
  spdlog::info("uid {} pid {}: {}; released buffers {}", caller.uid, caller.pid,
               std::string(why), absl::StrJoin(released, ","));
}

void ClientWatcher::Run() {
  constexpr int kMaxEvents = 64;
  struct epoll_event events[kMaxEvents];
  absl::Time next_check = absl::InfiniteFuture();
  for (;;) {
    int timeout_ms = -1;
    if (next_check != absl::InfiniteFuture()) {
      timeout_ms = static_cast<int>(std::max<int64_t>(
          0, absl::ToInt64Milliseconds(next_check - absl::Now()) + 1));
    }
    const int n = ::epoll_wait(epoll_.get(), events, kMaxEvents, timeout_ms);
    if (n < 0 && errno != EINTR) {
      spdlog::error("client watcher: epoll_wait: {}", std::strerror(errno));
      absl::SleepFor(absl::Milliseconds(100));
    }
    std::vector<std::pair<std::unique_ptr<Watch>, const char*>> gone;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      for (int i = 0; i < n; ++i) {
        const uint64_t handle = events[i].data.u64;
        if (handle == kWakeHandle) {
          uint64_t count;
          (void)!::read(wake_.get(), &count, sizeof(count));
          continue;
        }
        // Absent when pruned since epoll_wait returned.
        if (auto watch = TakeLocked(handle)) {
          gone.emplace_back(std::move(watch), "its process exited");
        }
      }
      const absl::Time now = absl::Now();
      if (connection_watches_ == 0) {
        next_check = absl::InfiniteFuture();
      } else if (next_check == absl::InfiniteFuture()) {
        next_check = now + options_.connection_poll_interval;
      } else if (now >= next_check) {
        for (uint64_t handle : ClosedConnectionsLocked()) {
          gone.emplace_back(TakeLocked(handle), "its connection closed");
        }
        next_check = now + options_.connection_poll_interval;
      }
    }
    // Outside the lock: the table calls back under its own, and releasing
    // may unmap memory.
    for (const auto& [watch, why] : gone) {
      Release(watch->connection.peer,
              std::vector<uint64_t>(watch->ids.begin(), watch->ids.end()), why);
    }
  }
}

}  // namespace rdma_agent

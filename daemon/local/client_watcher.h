#ifndef RDMA_AGENTD_DAEMON_LOCAL_CLIENT_WATCHER_H_
#define RDMA_AGENTD_DAEMON_LOCAL_CLIENT_WATCHER_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "backends/buffer_table.h"
#include "common/rate_limited_log.h"
#include "common/unique_fd.h"
#include "daemon/limits/quota.h"
#include "daemon/local/caller_identity.h"
#include "rdma/agent/v1/types.pb.h"

namespace rdma_agent {

// How the agent may learn that a client process has exited, best first. The
// agent uses every one the kernel offers; tests turn some off to exercise
// the fallbacks.
struct ProcessWatchMethods {
  // SO_PEERPIDFD of the caller's connection (Linux 6.5): names exactly the
  // process that connected, in whatever pid namespace it is.
  bool peer_pidfd = true;
  // pidfd_open(2) of the SO_PEERCRED pid (Linux 5.3): needs that pid to be
  // visible to the agent (SO_PEERCRED says 0 when it is not).
  bool pidfd_open = true;
};

// Releases the registrations bound to a client (LIFETIME_CLIENT_PROCESS or
// LIFETIME_CLIENT_CONNECTION) when that client goes away, exactly as Release
// does: they leave the buffer table at once, and their memory (with its
// quota charges) goes when the last op using them has finished.
//
// One thread watches every client: an epoll set of pidfds (a pidfd becomes
// readable when its process exits, and cannot be confused by pid reuse),
// and, for connection-bound registrations, a check every
// `connection_poll_interval` that the connection's fd still refers to its
// socket (gRPC owns and closes it; the agent cannot hear the close
// otherwise). A watch is per client, not per registration: the
// registrations of one process share its pidfd. Each watch is admitted by
// the watched-clients quota of its user, and ends (its pidfd closed, its
// charge given back) as soon as nothing is bound to it any more: the buffer
// table tells the watcher of every release.
//
// Thread-safe. Lock order: the buffer table's lock, then the watcher's (the
// table reports releases under its lock); the watcher never calls the table
// while it holds its own.
class ClientWatcher {
 public:
  struct Options {
    ProcessWatchMethods methods;
    absl::Duration connection_poll_interval = absl::Seconds(1);
  };

  // A watch reserved for one Register before its memory is allocated:
  // passed to Bind with the new registration's id, or dropped to give the
  // reservation back. Move-only.
  class Ticket {
   public:
    Ticket(Ticket&& other) noexcept;
    Ticket& operator=(Ticket&& other) noexcept;
    Ticket(const Ticket&) = delete;
    Ticket& operator=(const Ticket&) = delete;
    ~Ticket();

    // The lifetime the watch keeps: the one asked for, or
    // LIFETIME_CLIENT_CONNECTION where the process cannot be watched.
    v1::Lifetime lifetime() const { return lifetime_; }

   private:
    friend class ClientWatcher;
    Ticket(ClientWatcher* watcher, uint64_t watch, v1::Lifetime lifetime,
           const PeerCredentials& caller)
        : watcher_(watcher),
          watch_(watch),
          lifetime_(lifetime),
          caller_(caller) {}

    ClientWatcher* watcher_ = nullptr;
    uint64_t watch_ = 0;  // 0 once bound or moved from
    v1::Lifetime lifetime_ = v1::LIFETIME_UNSPECIFIED;
    PeerCredentials caller_;
  };

  // Starts the watcher thread and listens to `buffers`' releases (its
  // only removal listener). `buffers` and `quota` must outlive it.
  static absl::StatusOr<std::unique_ptr<ClientWatcher>> Start(
      Options options, BufferTable* buffers,
      std::shared_ptr<ResourceQuota> quota);
  ClientWatcher(const ClientWatcher&) = delete;
  ClientWatcher& operator=(const ClientWatcher&) = delete;
  // Stops listening and the thread. Registrations still bound stay
  // registered (the agent drops them all when it stops anyway).
  ~ClientWatcher();

  // Reserves a watch of the client behind `connection` for `lifetime`
  // (LIFETIME_CLIENT_PROCESS or LIFETIME_CLIENT_CONNECTION); a client
  // already watched the same way is joined, not watched twice.
  // RESOURCE_EXHAUSTED (naming the flag) past the watched-clients quota;
  // NOT_FOUND when the client is already gone.
  absl::StatusOr<Ticket> Reserve(const CallerConnection& connection,
                                 v1::Lifetime lifetime);

  // Binds registration `id`, already in the buffer table and owned by the
  // ticket's caller, to the ticket's client. If the client went away
  // meanwhile, `id` is released now.
  void Bind(Ticket ticket, uint64_t id);

  // Clients watched now.
  size_t watched() const;
  // Registrations bound to clients now.
  size_t bound() const;

 private:
  // What a watch is keyed by, so that one client is watched once: a
  // process by its pid (and uid: a process may switch users between
  // connections, and each user is charged for its own watch), a process
  // whose pid the agent cannot see by the connection it was reached
  // through, a connection by its fd and inode.
  enum class KeyKind { kProcess, kProcessOfConnection, kConnection };
  using Key = std::tuple<KeyKind, uint64_t, uint64_t>;
  struct Watch;

  ClientWatcher(Options options, BufferTable* buffers,
                std::shared_ptr<ResourceQuota> quota, UniqueFd epoll,
                UniqueFd wake);

  // A pidfd of the process behind `connection`, by the first method that
  // works; UNIMPLEMENTED (saying why) when none can, NOT_FOUND when the
  // process is gone.
  absl::StatusOr<UniqueFd> OpenProcess(const CallerConnection& connection);
  // Joins the live watch under `key`, or adds a new one for `connection`
  // (with `pidfd` for a process); returns its handle.
  absl::StatusOr<uint64_t> JoinOrAdd(const CallerConnection& connection,
                                     const Key& key, UniqueFd pidfd,
                                     v1::Lifetime lifetime);
  // True while `watch`'s client is still there.
  static bool Alive(const Watch& watch);
  // Removes watch `handle` from every index; nullptr if it is not watched.
  std::unique_ptr<Watch> TakeLocked(uint64_t handle)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends watch `handle` if nothing is bound to it and no ticket will be.
  void DropIfUnusedLocked(uint64_t handle) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A ticket that was never bound goes.
  void Unreserve(uint64_t handle);
  // Registration `id` was released (told by the buffer table, under its
  // lock): it is bound no more.
  void Unbind(uint64_t id);
  // Releases `ids` of `caller`, logging one line for them.
  void Release(const PeerCredentials& caller, const std::vector<uint64_t>& ids,
               absl::string_view why);
  // The thread: waits for pidfds, wake-ups and connection checks.
  void Run();
  // Handles of connection watches whose connection has closed.
  std::vector<uint64_t> ClosedConnectionsLocked() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Wake();

  const Options options_;
  BufferTable* const buffers_;
  int removal_listener_ = -1;  // in buffers_' table, set by Start
  const std::shared_ptr<ResourceQuota> quota_;
  const UniqueFd epoll_;
  const UniqueFd wake_;  // eventfd: stop, or a connection watch was added
  LogRateLimiter fallback_log_{absl::Minutes(1)};

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_handle_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Watch>> watches_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<Key, uint64_t> by_key_ ABSL_GUARDED_BY(mu_);
  // The watch each bound registration id is bound to.
  absl::flat_hash_map<uint64_t, uint64_t> by_id_ ABSL_GUARDED_BY(mu_);
  size_t connection_watches_ ABSL_GUARDED_BY(mu_) = 0;

  std::thread thread_;  // last: started when everything above exists
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_LOCAL_CLIENT_WATCHER_H_

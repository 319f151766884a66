#ifndef RDMA_AGENTD_BACKENDS_TCP_NOTIFY_CLIENT_H_
#define RDMA_AGENTD_BACKENDS_TCP_NOTIFY_CLIENT_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "backends/buffer_directory.h"
#include "common/net_address.h"
#include "common/stop_token.h"
#include "common/unique_fd.h"

namespace rdma_agent::tcp {

// Bounds of the connections that carry notifications (flags
// --tcp_notify_connections_per_peer, --tcp_notify_max_connections).
struct NotifyClientOptions {
  // Connections to one peer's data port, in use and idle together: that
  // peer's notifications take turns on them. 2: one batch's notification
  // need not wait behind another's round trip.
  int connections_per_peer = 2;
  // The same to all peers together. A dial past it first closes the oldest
  // idle connection (to any peer), else waits.
  int max_connections = 64;
};

// Sends kNotify requests (wire.h) to other agents' data servers over a
// pooled, bounded set of connections: a notification checks out an idle
// connection to its peer (or dials one while the bounds allow, else waits
// for one), sends the request, reads its answer and, when the notification
// was granted, gives the connection back (otherwise it is closed: a server
// cuts a connection that never presented a valid token at its handshake
// deadline). So any number of notifications to one peer costs at most
// `connections_per_peer` connections (and ephemeral ports), never one each.
// Notifications are sent once the batch's ops have their answers, so they
// follow the bytes they announce whichever connection carries them.
//
// Idle connections are closed once they have idled `idle_timeout` (checked
// whenever a notification is sent, so at most max_connections fds linger
// while none is), or when found closed by the peer at checkout.
//
// Thread-safe.
class NotifyClient {
 public:
  // Bounds below 1 count as 1.
  NotifyClient(NotifyClientOptions options, absl::Duration idle_timeout,
               absl::Duration connect_timeout);
  ~NotifyClient() = default;
  NotifyClient(const NotifyClient&) = delete;
  NotifyClient& operator=(const NotifyClient&) = delete;

  // Sends one notification for `target` (epoch, buffer id, token) to the
  // data server at `peer` and returns the server's answer. Waits no later
  // than `stop.deadline()` (and `connect_timeout` for a dial), gives up soon
  // after `stop` is cancelled. A failure once the request was written says
  // that the notification may have arrived all the same; it is never sent
  // twice.
  absl::Status Send(const HostPort& peer, const ServeRequest& target,
                    absl::string_view from_agent_id, absl::string_view data,
                    const StopToken& stop);

  // Connections open now, in use and idle, by peer "host:port" (tests).
  std::map<std::string, int> OpenConnectionsByPeer() const;

 private:
  struct Idle {
    UniqueFd fd;
    absl::Time since;
    uint64_t next_request_id = 1;
  };
  struct Peer {
    std::vector<Idle> idle;  // oldest first
    int open = 0;            // in use and idle
  };
  // A connection checked out for one notification: pooled or to be dialled
  // (fd empty). Its slot is held until Return or Drop.
  struct Lease {
    UniqueFd fd;
    uint64_t next_request_id = 1;
  };

  // A pooled connection to `key`, or a slot to dial one; waits while the
  // bounds are reached.
  absl::StatusOr<Lease> Checkout(const std::string& key, const StopToken& stop);
  // Sends the request on `lease`'s connection and reads its answer (the
  // server's verdict); `*in_step` once the whole answer was read, so that
  // the connection may carry another request.
  absl::Status Exchange(Lease& lease, const std::string& name,
                        const ServeRequest& target,
                        absl::string_view from_agent_id, absl::string_view data,
                        const StopToken& stop, bool* in_step);
  // Gives a healthy connection back to the pool.
  void Return(const std::string& key, Lease lease);
  // Gives up a connection's slot (it is closed or never was dialled).
  void Drop(const std::string& key);
  // Moves idle connections past idle_timeout to `closing`.
  void ExpireLocked(absl::Time now, std::vector<UniqueFd>& closing)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Closes the oldest idle connection of any peer into `closing`; false
  // when none is idle.
  bool EvictOldestIdleLocked(std::vector<UniqueFd>& closing)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const NotifyClientOptions options_;
  const absl::Duration idle_timeout_;
  const absl::Duration connect_timeout_;

  mutable absl::Mutex mu_;
  std::map<std::string, Peer> peers_ ABSL_GUARDED_BY(mu_);
  int open_ ABSL_GUARDED_BY(mu_) = 0;
  // Bumped whenever a connection or slot is given back: waiters re-check.
  uint64_t returns_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace rdma_agent::tcp

#endif  // RDMA_AGENTD_BACKENDS_TCP_NOTIFY_CLIENT_H_

#ifndef RDMA_AGENTD_DAEMON_OPS_RING_SESSIONS_H_
#define RDMA_AGENTD_DAEMON_OPS_RING_SESSIONS_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/stop_token.h"
#include "common/unique_fd.h"
#include "daemon/limits/active_calls.h"
#include "daemon/limits/quota.h"
#include "daemon/local/unix_socket.h"
#include "daemon/ops/op_batch.h"
#include "daemon/ops/prepared_transfers.h"
#include "daemon/ops/transfers.h"
#include "rdma/agent/v1/attach.pb.h"

namespace rdma_agent {

// Most ring threads an agent may run (--ring_threads).
inline constexpr int kMaxRingThreads = 64;

// What ring sessions may ask for (flags --max_ring_entries,
// --max_ring_sessions_per_user, --max_ring_sessions), how many threads
// serve them (--ring_threads) and how they wait.
struct RingLimits {
  // Largest ring (submission slots; completion slots are as many). A ring of
  // N slots maps 512 + 608 N bytes, charged to its user's memory quota.
  uint32_t max_entries = 4096;
  // Sessions open at once, for one user and over all users. Each holds an
  // attach connection, a memfd and its mapping, and a place on a ring
  // thread: a process needs one per submitting thread at most, so 4 covers a
  // few worker threads per user, and 64 in all stays a quarter of the attach
  // connections' total (256), so rings never starve plain attach traffic.
  uint64_t max_sessions_per_user = 4;
  uint64_t max_sessions = 64;
  // A batch's timeout when its last entry sets none, and the largest one
  // (the daemon fills them from --default_submit_timeout and
  // --max_submit_timeout).
  absl::Duration default_timeout = absl::Seconds(30);
  absl::Duration max_timeout = absl::Hours(1);
  // Longest notification a batch may carry (the daemon fills it from
  // --max_notification_bytes).
  uint64_t max_notification_bytes = 4096;
  // Threads serving every session, started with the agent (1 to
  // kMaxRingThreads): each serves its sessions from one epoll set, so
  // threads do not grow with sessions. One, because a ring thread spins
  // after work and on a 2-core host a second spinning thread would take the
  // core the transfer workers and the backends' completion threads need,
  // while one thread takes a turn of every ring in microseconds. More only
  // on hosts with cores to spare and many busy sessions.
  int threads = 1;
  // How long a ring thread keeps looking at its rings after work before it
  // sets NEEDS_WAKEUP on them and sleeps.
  absl::Duration spin = absl::Microseconds(200);
};

// One open session as GetInfo reports it.
struct RingSessionInfo {
  uid_t uid = 0;
  pid_t pid = 0;
  uint32_t entries = 0;
  absl::Time opened;
  uint64_t batches_in_flight = 0;  // taken and not yet completed
  uint64_t ops_in_flight = 0;      // of those batches
  uint64_t ops_completed = 0;      // completions posted
  // Why the agent stopped the session (it is ending); empty while it runs.
  std::string stopped_reason;
};

// The shared-memory rings of local clients (docs/RING.md). A session is
// opened on an attach connection (AttachServer's open_ring), which it then
// keeps, and acts for that connection's uid. A fixed set of ring threads
// (RingLimits::threads) serves every session: each thread takes a turn of
// each of its sessions in round, spins briefly after work, then sets
// NEEDS_WAKEUP on its rings and sleeps in epoll on their connections
// (doorbells, closes) and its eventfd (batch ends, new sessions, shutdown).
// A session's batches run asynchronously: a batch of READs and WRITEs is
// prepared from its entries into the session's own reused vectors and
// posted to the backends (BackendRegistry::PostInPlace) by its ring thread,
// without protobuf and without a transfer; a batch with a notification
// (which may block) runs as a transfer of the agent's TransferTable. No
// thread waits for either: a batch's end, on the thread that ended it, only
// wakes the ring thread (a memory batch usually ends inside PostInPlace,
// and completes on the same turn), which alone writes the session's
// completions. So a session keeps being read while its batches run:
// several may be in flight, and a CANCEL entry reaches a running batch. The
// ring is hostile input: entries are copied out once and then checked
// (common/ring_protocol.h), and a client whose indices are impossible has
// its session stopped with a reason it can read. Thread-safe.
class RingSessions {
 public:
  // Starts `limits.threads` ring threads. `env`, `calls`, `transfers` and
  // `prepared` outlive the returned object.
  static absl::StatusOr<std::unique_ptr<RingSessions>> Start(
      const RingLimits& limits, const OpBatchEnvironment& env,
      ActiveCalls* calls, std::shared_ptr<ResourceQuota> bytes,
      TransferTable* transfers, const PreparedTransferTable* prepared);
  RingSessions(const RingSessions&) = delete;
  RingSessions& operator=(const RingSessions&) = delete;
  // Shutdown(CANCELLED) unless it has run.
  ~RingSessions();

  // Answers `request` on attach connection `connection` (the ring's memfd,
  // or why not) on the calling thread, then hands the connection and
  // `connection_charge` (its place in the attach-connection quota) to the
  // least loaded ring thread, which keeps both until the session ends: the
  // client closes the connection, the session is stopped or Shutdown is
  // called. Returns at once, without waiting for the session.
  void Open(UniqueFd connection, QuotaCharge connection_charge,
            const PeerCredentials& peer, const v1::OpenRing& request);

  // Refuses new sessions with `reason`, ends every session (each cancels
  // its running batches as a CANCEL would, their ops end CANCELLED, and
  // posts their completions once they have ended) and joins the ring
  // threads. Idempotent; the first reason wins.
  void Shutdown(const absl::Status& reason);

  // Sessions open now.
  int64_t open() const { return open_.load(std::memory_order_relaxed); }

  // The sessions open now, on every ring thread: `uid`'s, or every user's
  // when unset.
  std::vector<RingSessionInfo> List(std::optional<uid_t> uid) const;

 private:
  class Session;
  class Thread;

  RingSessions(const RingLimits& limits, const OpBatchEnvironment& env,
               ActiveCalls* calls, std::shared_ptr<ResourceQuota> bytes,
               TransferTable* transfers, const PreparedTransferTable* prepared);
  // The ring thread with the fewest sessions.
  Thread& LeastLoaded() const;
  // Drops `session` from the list and the count of open sessions.
  void Forget(const Session* session);

  const RingLimits limits_;
  const OpBatchEnvironment env_;
  ActiveCalls* const calls_;
  const std::shared_ptr<ResourceQuota> bytes_;
  TransferTable* const transfers_;
  const PreparedTransferTable* const prepared_;
  // Sessions open, by user: reserved before the memfd is created.
  const std::shared_ptr<ResourceQuota> sessions_;
  Cancellation stopping_;
  std::atomic<int64_t> open_{0};
  std::vector<std::unique_ptr<Thread>> threads_;
  mutable absl::Mutex mu_;
  // Set by Shutdown: no session is handed to a thread after it.
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status closed_reason_ ABSL_GUARDED_BY(mu_);
  std::list<Session*> open_sessions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_OPS_RING_SESSIONS_H_

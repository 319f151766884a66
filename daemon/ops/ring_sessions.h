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
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/stop_token.h"
#include "daemon/limits/active_calls.h"
#include "daemon/limits/quota.h"
#include "daemon/local/unix_socket.h"
#include "daemon/ops/op_batch.h"
#include "daemon/ops/prepared_transfers.h"
#include "daemon/ops/transfers.h"
#include "rdma/agent/v1/attach.pb.h"

namespace rdma_agent {

// What ring sessions may ask for (flags --max_ring_entries,
// --max_ring_sessions_per_user, --max_ring_sessions) and how they wait.
struct RingLimits {
  // Largest ring (submission slots; completion slots are as many). A ring of
  // N slots maps 512 + 608 N bytes, charged to its user's memory quota.
  uint32_t max_entries = 4096;
  // Sessions open at once, for one user and over all users. Each holds an
  // attach connection, a memfd and its mapping, and a serving thread: a
  // process needs one per submitting thread at most, so 4 covers a few
  // worker threads per user, and 64 in all stays a quarter of the attach
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
  // How long a session keeps looking at its ring after work before it sets
  // NEEDS_WAKEUP and sleeps on its connection.
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

// The shared-memory rings of local clients (docs/RING.md). Each session
// is served by the attach connection that opened it (AttachServer's
// serve_ring) and acts for that connection's uid. Its batches run
// asynchronously: a batch of READs and WRITEs is prepared from its entries
// into the session's own reused vectors and posted to the backends
// (BackendRegistry::PostInPlace) by the session's thread, without protobuf
// and without a transfer; a batch with a notification (which may block)
// runs as a transfer of the agent's TransferTable. No thread waits for
// either: a batch's end, on the thread that ended it, only wakes the session
// (a memory batch usually ends inside PostInPlace, and completes on the
// same turn), whose thread alone writes the completions. So the session
// keeps reading its ring while they run: several batches may be in flight,
// and a CANCEL entry reaches a running batch. The ring is hostile input:
// entries are copied out once and then checked (common/ring_protocol.h),
// and a client whose indices are impossible has its session stopped with a
// reason it can read. Thread-safe; sessions run concurrently on their own
// connections' threads.
class RingSessions {
 public:
  // `env`, `calls`, `transfers` and `prepared` outlive this object.
  RingSessions(const RingLimits& limits, const OpBatchEnvironment& env,
               ActiveCalls* calls, std::shared_ptr<ResourceQuota> bytes,
               TransferTable* transfers, const PreparedTransferTable* prepared);
  RingSessions(const RingSessions&) = delete;
  RingSessions& operator=(const RingSessions&) = delete;

  // Answers `request` on attach connection `fd` (the ring's memfd, or why
  // not), then serves the session until the client closes the connection,
  // the session is stopped or Shutdown is called. Returns once every batch
  // it took has ended: nothing of the session touches local memory or the
  // ring after.
  void Serve(int fd, const PeerCredentials& peer, const v1::OpenRing& request);

  // Every session ends at its next turn (woken now); it cancels its
  // running batches as a CANCEL would (their ops end CANCELLED) and posts
  // their completions before it goes. New sessions are refused with
  // `reason`.
  void Shutdown(const absl::Status& reason);

  // Sessions open now.
  int64_t open() const { return open_.load(std::memory_order_relaxed); }

  // The sessions open now: `uid`'s, or every user's when unset.
  std::vector<RingSessionInfo> List(std::optional<uid_t> uid) const;

 private:
  class Session;

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
  mutable absl::Mutex mu_;
  std::list<Session*> open_sessions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_OPS_RING_SESSIONS_H_

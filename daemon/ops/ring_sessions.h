#ifndef RDMA_AGENTD_DAEMON_OPS_RING_SESSIONS_H_
#define RDMA_AGENTD_DAEMON_OPS_RING_SESSIONS_H_

#include <atomic>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/stop_token.h"
#include "daemon/limits/active_calls.h"
#include "daemon/limits/quota.h"
#include "daemon/local/unix_socket.h"
#include "daemon/ops/op_batch.h"
#include "rdma/agent/v1/attach.pb.h"

namespace rdma_agent {

// What ring sessions may ask for (flags --max_ring_entries,
// --max_ring_sessions_per_user, --max_ring_sessions) and how they wait.
struct RingLimits {
  // Largest ring (submission slots; completion slots are as many). A ring of
  // N slots maps 512 + 352 N bytes, charged to its user's memory quota.
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
  // How long a session keeps looking at its ring after work before it sets
  // NEEDS_WAKEUP and sleeps on its connection.
  absl::Duration spin = absl::Microseconds(200);
};

// The shared-memory rings of local clients (docs/RING.md). Each session
// runs on the attach connection that opened it (AttachServer's serve_ring)
// and acts for that connection's uid: its entries become ops of one
// OpBatch per batch, checked and run exactly as a Submit's, counted toward
// the user's ops in flight. The ring is hostile input: entries are copied
// out once and then checked (common/ring_protocol.h), and a client whose
// indices are impossible has its session stopped with a reason it can read.
// Thread-safe; sessions run concurrently on their own connections' threads.
class RingSessions {
 public:
  // `env`, `calls` and `bytes` outlive this object.
  RingSessions(const RingLimits& limits, const OpBatchEnvironment& env,
               ActiveCalls* calls, std::shared_ptr<ResourceQuota> bytes);
  RingSessions(const RingSessions&) = delete;
  RingSessions& operator=(const RingSessions&) = delete;

  // Answers `request` on attach connection `fd` (the ring's memfd, or why
  // not), then serves the session until the client closes the connection,
  // the session is stopped or Shutdown is called.
  void Serve(int fd, const PeerCredentials& peer, const v1::OpenRing& request);

  // Every session ends at its next turn; a running batch is cancelled with
  // `reason` (its ops end with that code, as a Submit's at shutdown).
  void Shutdown(const absl::Status& reason);

  // Sessions open now.
  int64_t open() const { return open_.load(std::memory_order_relaxed); }

 private:
  class Session;

  const RingLimits limits_;
  const OpBatchEnvironment env_;
  ActiveCalls* const calls_;
  const std::shared_ptr<ResourceQuota> bytes_;
  // Sessions open, by user: reserved before the memfd is created.
  const std::shared_ptr<ResourceQuota> sessions_;
  Cancellation stopping_;
  std::atomic<int64_t> open_{0};
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_OPS_RING_SESSIONS_H_

#ifndef RDMA_AGENTD_DAEMON_LOCAL_ATTACH_TOKENS_H_
#define RDMA_AGENTD_DAEMON_LOCAL_ATTACH_TOKENS_H_

#include <sys/types.h>

#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "backends/registration.h"
#include "common/shared_memory.h"
#include "daemon/limits/quota.h"

namespace rdma_agent {

// Memory a client handed over on the attach socket (a memfd, or device
// memory as a dma-buf), waiting for the Register
// that names its token. Tokens are random, single-use, bound to the user
// that attached, and expire after `ttl`: a thread of this class unmaps and
// closes expired memory on time, whether or not anyone else attaches.
class AttachTokens {
 public:
  explicit AttachTokens(absl::Duration ttl);
  AttachTokens(const AttachTokens&) = delete;
  AttachTokens& operator=(const AttachTokens&) = delete;
  // Stops the expiry thread and drops everything still parked.
  ~AttachTokens();

  // Parks `memory` for `owner` with `charge` (its parked-attachment quota,
  // given back when the memory is taken or expires); returns its token.
  std::string Park(BufferMemory memory, uid_t owner, QuotaCharge charge);

  // Takes the memory parked under `token` by `caller`. NOT_FOUND when the
  // token is unknown, used, expired or another user's (which leaves it
  // parked for its owner).
  absl::StatusOr<BufferMemory> Take(const std::string& token, uid_t caller);

  // How many memories are parked now.
  size_t pending() const;

 private:
  struct Pending {
    // Declared first, destroyed last: the charge goes after the memory.
    QuotaCharge charge;
    BufferMemory memory;
    uid_t owner;
    absl::Time expires;
  };
  using PendingMap = absl::flat_hash_map<std::string, Pending>;

  // Moves expired entries out, for the caller to drop outside the lock.
  PendingMap TakeExpiredLocked(absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Time EarliestExpiryLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The expiry thread: sleeps until the earliest expiry (or a new Park, or
  // stop) and drops what has expired.
  void ExpireLoop();

  const absl::Duration ttl_;
  mutable absl::Mutex mu_;
  absl::CondVar changed_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  PendingMap pending_ ABSL_GUARDED_BY(mu_);
  std::thread expirer_;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_LOCAL_ATTACH_TOKENS_H_

#ifndef RDMA_AGENTD_DAEMON_ATTACH_TOKENS_H_
#define RDMA_AGENTD_DAEMON_ATTACH_TOKENS_H_

#include <sys/types.h>

#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/shared_memory.h"

namespace rdma_agent {

// Memory a client handed over on the attach socket, waiting for the Register
// that names its token. Tokens are random, single-use, bound to the user
// that attached, and expire after `ttl`.
class AttachTokens {
 public:
  AttachTokens(absl::Duration ttl, size_t max_pending_per_owner)
      : ttl_(ttl), max_pending_per_owner_(max_pending_per_owner) {}

  // Parks `memory` for `owner`; returns its token. RESOURCE_EXHAUSTED when
  // the owner has too many pending.
  absl::StatusOr<std::string> Park(SharedMemory memory, uid_t owner);

  // Takes the memory parked under `token` by `caller`. NOT_FOUND when the
  // token is unknown, used, expired or another user's.
  absl::StatusOr<SharedMemory> Take(const std::string& token, uid_t caller);

 private:
  struct Pending {
    SharedMemory memory;
    uid_t owner;
    absl::Time expires;
  };
  void DropExpiredLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const absl::Duration ttl_;
  const size_t max_pending_per_owner_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, Pending> pending_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_ATTACH_TOKENS_H_

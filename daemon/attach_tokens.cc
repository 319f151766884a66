#include "daemon/attach_tokens.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/random.h"

namespace rdma_agent {

void AttachTokens::DropExpiredLocked(absl::Time now) {
  absl::erase_if(pending_,
                 [now](const auto& entry) { return entry.second.expires <= now; });
}

absl::StatusOr<std::string> AttachTokens::Park(SharedMemory memory,
                                               uid_t owner) {
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  DropExpiredLocked(now);
  size_t owned = 0;
  for (const auto& [token, pending] : pending_) {
    if (pending.owner == owner) ++owned;
  }
  if (owned >= max_pending_per_owner_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "user ", owner, " has ", owned,
        " attached memories not yet registered (limit ",
        max_pending_per_owner_, ")"));
  }
  std::string token = absl::BytesToHexString(RandomBytes(16));
  pending_.emplace(token, Pending{std::move(memory), owner, now + ttl_});
  return token;
}

absl::StatusOr<SharedMemory> AttachTokens::Take(const std::string& token,
                                                uid_t caller) {
  absl::MutexLock lock(&mu_);
  DropExpiredLocked(absl::Now());
  auto it = pending_.find(token);
  if (it == pending_.end() || it->second.owner != caller) {
    return absl::NotFoundError(
        "attach token is unknown, already used or expired");
  }
  SharedMemory memory = std::move(it->second.memory);
  pending_.erase(it);
  return memory;
}

}  // namespace rdma_agent

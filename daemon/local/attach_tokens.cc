#include "daemon/local/attach_tokens.h"

#include <algorithm>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/random.h"

namespace rdma_agent {

AttachTokens::AttachTokens(absl::Duration ttl) : ttl_(ttl) {
  expirer_ = std::thread([this] { ExpireLoop(); });
}

AttachTokens::~AttachTokens() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    changed_.SignalAll();
  }
  expirer_.join();
  PendingMap dropped;
  {
    absl::MutexLock lock(&mu_);
    dropped.swap(pending_);
  }
}

AttachTokens::PendingMap AttachTokens::TakeExpiredLocked(absl::Time now) {
  PendingMap expired;
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (it->second.expires <= now) {
      expired.insert(pending_.extract(it++));
    } else {
      ++it;
    }
  }
  return expired;
}

absl::Time AttachTokens::EarliestExpiryLocked() const {
  absl::Time earliest = absl::InfiniteFuture();
  for (const auto& [token, pending] : pending_) {
    earliest = std::min(earliest, pending.expires);
  }
  return earliest;
}

void AttachTokens::ExpireLoop() {
  while (true) {
    PendingMap expired;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      // Recomputed under the lock each time, so a Park between two waits is
      // never missed.
      changed_.WaitWithDeadline(&mu_, EarliestExpiryLocked());
      if (stopping_) return;
      expired = TakeExpiredLocked(absl::Now());
    }
    // `expired` goes here: unmapping terabytes of address space takes a
    // while, and must not hold up Park and Take.
  }
}

std::string AttachTokens::Park(BufferMemory memory, uid_t owner,
                               QuotaCharge charge) {
  std::string token = absl::BytesToHexString(RandomBytes(16));
  absl::MutexLock lock(&mu_);
  pending_.emplace(token, Pending{std::move(charge), std::move(memory), owner,
                                  absl::Now() + ttl_});
  changed_.Signal();
  return token;
}

absl::StatusOr<BufferMemory> AttachTokens::Take(const std::string& token,
                                                uid_t caller) {
  PendingMap::node_type taken;
  {
    absl::MutexLock lock(&mu_);
    auto it = pending_.find(token);
    if (it == pending_.end() || it->second.owner != caller ||
        it->second.expires <= absl::Now()) {
      return absl::NotFoundError(
          "attach token is unknown, already used or expired");
    }
    taken = pending_.extract(it);
  }
  // The memory is no longer parked: its parked-attachment charge goes now,
  // its bytes charge stays with it.
  return std::move(taken.mapped().memory);
}

size_t AttachTokens::pending() const {
  absl::MutexLock lock(&mu_);
  return pending_.size();
}

}  // namespace rdma_agent

#ifndef RDMA_AGENTD_BACKENDS_BUFFER_TABLE_H_
#define RDMA_AGENTD_BACKENDS_BUFFER_TABLE_H_

#include <sys/types.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "backends/buffer_directory.h"
#include "backends/registration.h"

namespace rdma_agent {

// Buffer ids: a counter through Speck64/128 (a 64-bit block cipher) under a
// random key. Ids appear in remote contexts and answer every local user,
// so a plain counter would tell one user, from the gap between two of its
// own ids, how many buffers everyone else registered meanwhile. Through a
// keyed permutation the ids look random to whoever lacks the key (128 bits
// from the kernel's CSPRNG, never leaving the agent) and, being a
// permutation, never repeat in its life; 0 is skipped. Not thread-safe.
class BufferIdSequence {
 public:
  // A fresh random key.
  BufferIdSequence();
  // Speck64/128's key words k0, l0, l1, l2 (tests: the known answers).
  explicit BufferIdSequence(const std::array<uint32_t, 4>& key);

  // The next id: never 0, never one given before.
  uint64_t Next();
  // The cipher: high word x, low word y, as the Speck paper writes blocks.
  uint64_t Encrypt(uint64_t block) const;

 private:
  static constexpr int kRounds = 27;
  std::array<uint32_t, kRounds> round_keys_;
  uint64_t counter_ = 0;
};

// The one table of an agent's live registrations, by id, and the one place
// that decides whether a request may touch one:
//  - local callers (the agent's API) are scoped by owner: each registration
//    belongs to the local user that registered it, other users cannot tell a
//    foreign id from an unknown one (both NOT_FOUND), root sees every one;
//  - peers (and this agent's own memory backend) go through ResolveForPeer,
//    which checks epoch, id, token, access and range in the order and with
//    the messages BufferDirectory documents.
// The daemon owns one per agent; backend tests use one in place of an agent.
// Thread-safe.
class BufferTable : public BufferDirectory {
 public:
  // `epoch` is this agent's life: contexts from another life are stale.
  explicit BufferTable(uint64_t epoch) : epoch_(epoch) {}

  uint64_t epoch() const { return epoch_; }

  // A fresh id: never 0, never given before in this table's life, and
  // random-looking (BufferIdSequence), so that ids tell nothing of other
  // users' registrations.
  uint64_t NextId();

  // Publishes a fully built registration under its id. How many a user may
  // hold is the registration quota's business (charged before the memory is
  // mapped).
  void Add(std::shared_ptr<Registration> registration);

  // The registration `id` if `caller` may use it; NOT_FOUND otherwise.
  absl::StatusOr<std::shared_ptr<Registration>> Find(uint64_t id,
                                                     uid_t caller) const;

  // Unpublishes `id` if `caller` may use it; NOT_FOUND otherwise. The memory
  // lives on while ops still pin it.
  absl::Status Remove(uint64_t id, uid_t caller);

  // Listeners are told the id of every registration Remove unpublishes
  // (Clear tells nobody), under the table's lock, so that none can be told
  // after it was removed: each must be quick and must not call the table.
  // Add returns a handle for RemoveRemovalListener.
  int AddRemovalListener(std::function<void(uint64_t id)> listener);
  void RemoveRemovalListener(int handle);

  // The registrations `owner` made, in the order they were added (root's
  // own only: root lists everyone's with ListAll).
  std::vector<std::shared_ptr<Registration>> ListOwnedBy(uid_t owner) const;
  // Every registration, in the order they were added.
  std::vector<std::shared_ptr<Registration>> ListAll() const;

  // Drops every registration (shutdown).
  void Clear();

  // As BufferDirectory says; a registration resolved here counts as used.
  absl::StatusOr<std::shared_ptr<Registration>> ResolveForPeer(
      const ServeRequest& request) const override;
  // As BufferDirectory says; refusals are observed like ResolveForPeer's.
  absl::StatusOr<std::shared_ptr<Registration>> ResolveForNotification(
      const ServeRequest& target) const override;

  // Called with every refused peer request that names its requester (the
  // agent logs and counts them). Set before the table serves peers.
  using RefusalObserver =
      std::function<void(const ServeRequest&, const absl::Status&)>;
  void set_refusal_observer(RefusalObserver observer) {
    refusal_observer_ = std::move(observer);
  }

 private:
  // What the request is checked for once its registration is found.
  using Check = absl::Status (*)(const Registration&, const ServeRequest&);
  absl::StatusOr<std::shared_ptr<Registration>> Resolve(
      const ServeRequest& request, Check check) const;
  // Reports a refusal to the observer (when the request names its
  // requester).
  void Observe(const ServeRequest& request, const absl::Status& status) const;
  // The registrations `keep` selects, in the order they were added.
  template <typename Predicate>
  std::vector<std::shared_ptr<Registration>> ListIf(Predicate keep) const;

  static bool MayUse(const Registration& registration, uid_t caller) {
    return caller == 0 || registration.owner() == caller;
  }

  const uint64_t epoch_;
  RefusalObserver refusal_observer_;
  mutable absl::Mutex mu_;
  // A registration and when it was added: lists keep that order (ids are
  // random).
  struct Entry {
    std::shared_ptr<Registration> registration;
    uint64_t added = 0;
  };
  BufferIdSequence ids_ ABSL_GUARDED_BY(mu_);
  uint64_t added_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<uint64_t, Entry> buffers_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<int, std::function<void(uint64_t)>>> removal_listeners_
      ABSL_GUARDED_BY(mu_);
  int next_listener_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_BACKENDS_BUFFER_TABLE_H_

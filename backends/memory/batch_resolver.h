#ifndef RDMA_AGENTD_BACKENDS_MEMORY_BATCH_RESOLVER_H_
#define RDMA_AGENTD_BACKENDS_MEMORY_BATCH_RESOLVER_H_

#include <memory>

#include "absl/container/node_hash_map.h"
#include "absl/status/statusor.h"
#include "backends/backend.h"
#include "backends/buffer_directory.h"

namespace rdma_agent::memory {

// The remote sides of one batch of memory-backend ops: this agent's own
// registrations, found in its BufferDirectory as a peer's request would find
// them, with every check a peer's request gets.
//
// A batch of 1000 ops usually names a few buffers 1000 times. The
// directory's lookup (epoch, then id and token; a lock, a hash lookup and a
// pin) depends only on the op's context, so it runs once per distinct
// context; the checks that depend on the op (token, access for its
// direction, its range: CheckServeRequest) run for every op, and so does
// the one thing a lookup could answer differently later in the batch:
// whether the registration was released since (Registration::released()).
// Contexts are told apart by object: ops share one only when the agent
// parsed the same bytes for them (daemon/op_preparer.h), and a context
// differing in any byte (another token) is resolved on its own.
//
// One per batch a memory backend runs, on one thread; not thread-safe.
class BatchResolver {
 public:
  // `directory` must outlive the resolver.
  explicit BatchResolver(const BufferDirectory* directory)
      : directory_(directory) {}
  BatchResolver(const BatchResolver&) = delete;
  BatchResolver& operator=(const BatchResolver&) = delete;

  // The registration `op`'s remote side names, checked for `op` with
  // ResolveForPeer's codes and messages; pinned until the resolver is
  // destroyed. `op.remote` must stay alive (as it does while the op runs).
  absl::StatusOr<Registration*> Resolve(const Op& op);

  // How many times the directory was asked so far: once per distinct
  // context. A caller that must not be held up unawares (by the
  // directory's lock) sees when a Resolve went to the directory.
  size_t lookups() const { return contexts_.size(); }

 private:
  struct Context {
    // The context's request; offset, length and direction are set per op.
    ServeRequest request;
    // What the directory answered to its proof (epoch, id and token).
    absl::StatusOr<std::shared_ptr<Registration>> registration;
  };
  Context& Find(const v1::RemoteBuffer* remote);

  const BufferDirectory* const directory_;
  // node_hash_map: `last_` stays valid as contexts are added.
  absl::node_hash_map<const v1::RemoteBuffer*, Context> contexts_;
  // Consecutive ops usually share a context: no hash lookup for them.
  const v1::RemoteBuffer* last_remote_ = nullptr;
  Context* last_ = nullptr;
};

}  // namespace rdma_agent::memory

#endif  // RDMA_AGENTD_BACKENDS_MEMORY_BATCH_RESOLVER_H_

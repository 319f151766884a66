#ifndef RDMA_AGENTD_DAEMON_OPS_OP_PREPARER_H_
#define RDMA_AGENTD_DAEMON_OPS_OP_PREPARER_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/node_hash_map.h"
#include "absl/status/statusor.h"
#include "backends/backend.h"
#include "backends/buffer_table.h"
#include "daemon/ops/remote_handles.h"
#include "rdma/agent/v1/agent.pb.h"

namespace rdma_agent {

// Validates the ops of one Submit batch for one caller and resolves their
// buffers, with the codes and messages of the API contract: type, length,
// the remote context (ParseRemoteContext), the local buffer (the caller's
// own, BufferTable::Find), both ranges and both sides' access.
//
// What does not change between the ops of one batch is worked out once per
// batch: each distinct remote_context is parsed once (a batch of 1000 ops
// usually carries 1000 copies of a few contexts) and each local buffer id is
// looked up once. Everything that depends on the op itself (type, length,
// offsets against the sizes, access against the op's direction) is still
// checked for every op. Ops sharing a context share one parsed
// `Op::remote`. Token and epoch are not checked here: the serving side
// checks them for every op (BufferDirectory).
//
// One per batch, on one thread; not thread-safe.
// The serialized remote context a published name stands for (the
// directory's Resolve), checked for size; NOT_FOUND when nobody publishes
// it or `caller` may not see it.
using NameResolver = std::function<absl::StatusOr<std::string>(
    uid_t caller, const std::string& name)>;

// One op as the agent's own paths describe it, without protobuf: a ring
// entry, or a prepared transfer's op. Its remote side is either resolved
// already (`remote`) or named by the caller's imported `remote_handle`.
struct OpSpec {
  v1::OpType type = v1::OP_TYPE_UNSPECIFIED;
  uint64_t local_buffer_id = 0;
  uint64_t local_offset = 0;
  uint64_t length = 0;
  uint64_t remote_handle = 0;
  std::shared_ptr<const v1::RemoteBuffer> remote;  // set: used as it is
  uint64_t remote_offset = 0;
};

class OpPreparer {
 public:
  // `buffers`, `handles` and `names` must outlive the preparer; without
  // `handles` (nullptr), an op naming a remote_handle is refused as
  // unknown, and without `names` one naming a remote_name.
  OpPreparer(const BufferTable* buffers, uid_t caller,
             const RemoteHandleTable* handles = nullptr,
             const NameResolver* names = nullptr)
      : buffers_(buffers), caller_(caller), handles_(handles), names_(names) {}
  OpPreparer(const OpPreparer&) = delete;
  OpPreparer& operator=(const OpPreparer&) = delete;

  // Op `index` of the batch, validated and with its buffers resolved (the
  // local registration pinned), or why it is refused (without the "op N:"
  // prefix, which the caller adds).
  absl::StatusOr<Op> Prepare(const v1::Op& wire, size_t index);

  // The same for a plain description, with the same codes and messages:
  // its `remote` when set (a prepared transfer's ops are checked again at
  // every run, but their contexts are not looked up again), else its
  // remote_handle.
  absl::StatusOr<Op> Prepare(const OpSpec& spec, size_t index);

  // `wire` as a plain description whose remote side is `remote`.
  static OpSpec SpecOf(const v1::Op& wire,
                       std::shared_ptr<const v1::RemoteBuffer> remote);

  // Forgets what earlier ops looked up (and lets go of what that pinned),
  // keeping the room: a preparer reused batch after batch (a ring
  // session's) starts each batch afresh without allocating.
  void Clear();

  // The parsed context an op names: its remote_context, the caller's
  // imported remote_handle, or the context its remote_name stands for;
  // INVALID_ARGUMENT when it sets several or none.
  absl::StatusOr<std::shared_ptr<const v1::RemoteBuffer>> Remote(
      const v1::Op& wire);

 private:
  // Type and length, which need nothing looked up.
  static absl::Status CheckShape(v1::OpType type, uint64_t length);
  // The checks that follow the remote side's resolution.
  absl::StatusOr<Op> PrepareResolved(
      const OpSpec& spec, size_t index,
      const std::shared_ptr<const v1::RemoteBuffer>& remote);
  // The caller's imported `handle`, looked up on first sight.
  const absl::StatusOr<std::shared_ptr<const v1::RemoteBuffer>>& Handle(
      uint64_t handle);
  // The context published under `name`, resolved on first sight.
  const absl::StatusOr<std::shared_ptr<const v1::RemoteBuffer>>& Name(
      const std::string& name);
  // The parsed context for `bytes`, parsed on first sight.
  const absl::StatusOr<std::shared_ptr<const v1::RemoteBuffer>>& Context(
      const std::string& bytes);
  // The caller's registration `id`, looked up on first sight.
  const absl::StatusOr<std::shared_ptr<Registration>>& Local(uint64_t id);

  const BufferTable* const buffers_;
  const uid_t caller_;
  const RemoteHandleTable* const handles_;
  const NameResolver* const names_;
  // By name, resolved once per batch.
  absl::flat_hash_map<std::string,
                      absl::StatusOr<std::shared_ptr<const v1::RemoteBuffer>>>
      names_seen_;
  // By handle, for this caller.
  absl::flat_hash_map<uint64_t,
                      absl::StatusOr<std::shared_ptr<const v1::RemoteBuffer>>>
      handles_seen_;
  // By the exact bytes: equal bytes parse to an equal message, and a parse
  // error is the same for every op that carries them.
  absl::node_hash_map<std::string,
                      absl::StatusOr<std::shared_ptr<const v1::RemoteBuffer>>>
      contexts_;
  // The entry of the last op's context (node_hash_map: stays valid as
  // entries are added).
  const std::pair<const std::string,
                  absl::StatusOr<std::shared_ptr<const v1::RemoteBuffer>>>*
      last_context_ = nullptr;
  // By id, for this caller. A Release during the batch is seen as if it came
  // after the batch was validated (the ops pin what they found).
  absl::flat_hash_map<uint64_t, absl::StatusOr<std::shared_ptr<Registration>>>
      locals_;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_OPS_OP_PREPARER_H_

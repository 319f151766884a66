#ifndef RDMA_AGENTD_DAEMON_OPS_PREPARED_TRANSFERS_H_
#define RDMA_AGENTD_DAEMON_OPS_PREPARED_TRANSFERS_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/limits/quota.h"
#include "daemon/ops/op_preparer.h"
#include "daemon/ops/user_scoped_table.h"
#include "rdma/agent/v1/agent.pb.h"

namespace rdma_agent {

// What local users may make the agent keep for prepared transfers (flags
// --max_prepared_transfers_per_user, --max_prepared_transfers_total,
// --max_prepared_transfer_bytes_per_user,
// --max_prepared_transfer_bytes_total).
struct PreparedTransferLimits {
  uint64_t max_per_user = 1024;
  uint64_t max_total = 4096;
  // Bytes of agent memory: the copy of the ops, their plain descriptions
  // (with one resolved context pointer each), each distinct parsed context
  // and the table's share.
  uint64_t max_bytes_per_user = uint64_t{64} << 20;
  uint64_t max_bytes_total = uint64_t{256} << 20;

  static constexpr uint64_t kOverheadBytes = 256;
};

// A batch of ops validated once (PrepareTransfer) and run again by id.
// Immutable; shared by the table and by the batches running it.
struct PreparedTransfer {
  // The ops and notification as prepared (`timeout` unset): what a run
  // through OpBatch (Submit, a ring batch with NOTIFY) reports against.
  v1::SubmitRequest request;
  // Per op of `request`: the op as a plain description, its remote side
  // resolved when it was prepared. A run checks these again (OpPreparer)
  // and a ring's native run builds nothing else.
  std::vector<OpSpec> ops;
  // Given back when the last reference goes.
  QuotaCharge slot;
  QuotaCharge bytes;         // the copy of the ops
  QuotaCharge parsed_bytes;  // the distinct parsed contexts
};

// The prepared transfers of every local user, by id (UserScopedTable:
// another user's id reads as unknown). Thread-safe.
class PreparedTransferTable {
 public:
  explicit PreparedTransferTable(const PreparedTransferLimits& limits);

  // Validates every op of `request` with `preparer` (bound to `owner`) as
  // Submit would, and keeps them. Admission before allocation: the slot,
  // then the copy of the ops (estimated from above), then what resolving
  // them holds (each distinct parsed context), before it is kept. Fails
  // with the first bad op's status ("op N: ..."), or RESOURCE_EXHAUSTED
  // naming the flag. Contexts longer than `max_context_bytes` are refused
  // unparsed.
  absl::StatusOr<uint64_t> Prepare(uid_t owner,
                                   const v1::PrepareTransferRequest& request,
                                   OpPreparer& preparer,
                                   size_t max_context_bytes);

  // `owner`'s prepared transfer `id`; NOT_FOUND, the same for an unknown id
  // and another user's.
  absl::StatusOr<std::shared_ptr<const PreparedTransfer>> Find(
      uid_t owner, uint64_t id) const;

  // Drops it (runs already started keep it until they end); NOT_FOUND as
  // Find.
  absl::Status Release(uid_t owner, uint64_t id);

  size_t size() const { return table_.size(); }
  uint64_t bytes() const { return bytes_->used_total(); }

 private:
  std::shared_ptr<ResourceQuota> slots_;
  std::shared_ptr<ResourceQuota> bytes_;
  UserScopedTable<PreparedTransfer> table_;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_OPS_PREPARED_TRANSFERS_H_

#ifndef RDMA_AGENTD_DAEMON_OPS_REMOTE_HANDLES_H_
#define RDMA_AGENTD_DAEMON_OPS_REMOTE_HANDLES_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "backends/registry.h"
#include "daemon/limits/quota.h"
#include "daemon/ops/user_scoped_table.h"
#include "rdma/agent/v1/remote_buffer.pb.h"

namespace rdma_agent {

// What local users may make the agent keep for imported remotes (flags
// --max_remote_handles_per_user, --max_remote_handles_total,
// --max_remote_handle_bytes_per_user, --max_remote_handle_bytes_total).
struct RemoteHandleLimits {
  uint64_t max_per_user = 4096;
  uint64_t max_total = 16384;
  // Bytes of agent memory: each handle's parsed context, its route and the
  // table's own share (kOverheadBytes).
  uint64_t max_bytes_per_user = uint64_t{16} << 20;
  uint64_t max_bytes_total = uint64_t{64} << 20;

  // Charged to every handle besides its parsed context: the table's entry,
  // the record and their shared_ptr control blocks.
  static constexpr uint64_t kOverheadBytes = 256;
};

// A remote context imported once (ImportRemote): parsed, checked and routed.
// Immutable; shared by the table and by the batches whose ops name it.
struct ImportedRemote {
  std::shared_ptr<const v1::RemoteBuffer> remote;
  // This agent's backends that reach it, best first, when it was imported.
  std::vector<std::string> backends;
  // Given back when the last reference goes.
  QuotaCharge slot;
  QuotaCharge bytes;
};

// The imported remotes of every local user, by handle (UserScopedTable:
// another user's handle reads as unknown). Thread-safe.
class RemoteHandleTable {
 public:
  explicit RemoteHandleTable(const RemoteHandleLimits& limits);

  struct Imported {
    uint64_t handle = 0;
    std::shared_ptr<const ImportedRemote> remote;
  };
  // Imports `context` for `owner`. Admission first: the handle's slot is
  // reserved before anything is parsed, its bytes (measured on the parsed
  // message, which is bounded by `max_context_bytes`) before it is kept.
  // INVALID_ARGUMENT when the context is longer than `max_context_bytes`
  // or malformed (ParseRemoteContext); UNAVAILABLE when no backend of
  // `registry` reaches it; RESOURCE_EXHAUSTED past a limit, naming its flag.
  absl::StatusOr<Imported> Import(uid_t owner, const std::string& context,
                                  size_t max_context_bytes,
                                  const BackendRegistry& registry);

  // The parsed context `handle` names for `owner`; NOT_FOUND, the same for
  // an unknown handle and another user's.
  absl::StatusOr<std::shared_ptr<const v1::RemoteBuffer>> Find(
      uid_t owner, uint64_t handle) const;

  // Drops `owner`'s `handle` (batches holding it keep it until they end);
  // NOT_FOUND as Find.
  absl::Status Release(uid_t owner, uint64_t handle);

  std::vector<Imported> ListOwnedBy(uid_t owner) const;

  // Handles kept, and the bytes charged for them, over all users.
  size_t size() const { return table_.size(); }
  uint64_t bytes() const { return bytes_->used_total(); }

 private:
  std::shared_ptr<ResourceQuota> slots_;
  std::shared_ptr<ResourceQuota> bytes_;
  UserScopedTable<ImportedRemote> table_;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_OPS_REMOTE_HANDLES_H_

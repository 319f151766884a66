#include "daemon/ops/remote_handles.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log_text.h"
#include "daemon/ops/remote_context.h"

namespace rdma_agent {

RemoteHandleTable::RemoteHandleTable(const RemoteHandleLimits& limits)
    : slots_(ResourceQuota::Create("imported remote handles",
                                   "--max_remote_handles_per_user",
                                   "--max_remote_handles_total",
                                   {limits.max_per_user, limits.max_total})),
      bytes_(ResourceQuota::Create(
          "bytes of imported remote handles",
          "--max_remote_handle_bytes_per_user",
          "--max_remote_handle_bytes_total",
          {limits.max_bytes_per_user, limits.max_bytes_total})) {}

absl::StatusOr<RemoteHandleTable::Imported> RemoteHandleTable::Import(
    uid_t owner, const std::string& context, size_t max_context_bytes,
    const BackendRegistry& registry) {
  if (absl::Status size = CheckRemoteContextSize(context, max_context_bytes);
      !size.ok()) {
    return size;
  }
  auto slot = slots_->Reserve(owner, 1);
  if (!slot.ok()) return slot.status();
  // Parsed before its bytes are known; the parse is bounded by the size
  // check above, as a Submit's is, and freed at once if refused.
  auto remote = ParseRemoteContext(context, max_context_bytes);
  if (!remote.ok()) return remote.status();
  std::vector<std::string> backends;
  uint64_t bytes =
      (*remote)->SpaceUsedLong() + RemoteHandleLimits::kOverheadBytes;
  for (const Backend* backend : registry.Route(**remote)) {
    backends.push_back(backend->name());
    bytes += sizeof(std::string) + backend->name().size();
  }
  if (backends.empty()) {
    std::vector<std::string> advertised;
    for (const auto& endpoint : (*remote)->endpoints()) {
      advertised.push_back(LogSafe(endpoint.backend(), 32));
    }
    return absl::UnavailableError(
        absl::StrCat("no backend of this agent reaches remote buffer ",
                     (*remote)->buffer_id(), " (it advertises [",
                     absl::StrJoin(advertised, ", "), "])"));
  }
  auto charge = bytes_->Reserve(owner, bytes);
  if (!charge.ok()) return charge.status();
  auto imported = std::make_shared<ImportedRemote>();
  imported->remote = std::move(*remote);
  imported->backends = std::move(backends);
  imported->slot = std::move(*slot);
  imported->bytes = std::move(*charge);
  const uint64_t handle = table_.Add(owner, imported);
  return Imported{handle, std::move(imported)};
}

absl::StatusOr<std::shared_ptr<const v1::RemoteBuffer>> RemoteHandleTable::Find(
    uid_t owner, uint64_t handle) const {
  std::shared_ptr<const ImportedRemote> found = table_.Find(owner, handle);
  if (found == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("remote handle ", handle, " is not imported"));
  }
  return found->remote;
}

absl::Status RemoteHandleTable::Release(uid_t owner, uint64_t handle) {
  if (!table_.Remove(owner, handle)) {
    return absl::NotFoundError(
        absl::StrCat("remote handle ", handle, " is not imported"));
  }
  return absl::OkStatus();
}

std::vector<RemoteHandleTable::Imported> RemoteHandleTable::ListOwnedBy(
    uid_t owner) const {
  std::vector<Imported> owned;
  for (auto& [handle, remote] : table_.ListOwnedBy(owner)) {
    owned.push_back(Imported{handle, std::move(remote)});
  }
  return owned;
}

}  // namespace rdma_agent

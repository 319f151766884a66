#include "daemon/ops/prepared_transfers.h"

#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "daemon/ops/remote_context.h"

namespace rdma_agent {
namespace {

// The allocator's share of each heap block.
constexpr uint64_t kBlockBytes = 16;

// What a copy of `text` takes beyond its std::string.
uint64_t StringCopyBytes(const std::string& text) {
  return text.size() < 16 ? 0 : text.size() + 1 + kBlockBytes;
}

}  // namespace

PreparedTransferTable::PreparedTransferTable(
    const PreparedTransferLimits& limits)
    : slots_(ResourceQuota::Create("prepared transfers",
                                   "--max_prepared_transfers_per_user",
                                   "--max_prepared_transfers_total",
                                   {limits.max_per_user, limits.max_total})),
      bytes_(ResourceQuota::Create(
          "bytes of prepared transfers",
          "--max_prepared_transfer_bytes_per_user",
          "--max_prepared_transfer_bytes_total",
          {limits.max_bytes_per_user, limits.max_bytes_total})) {}

absl::StatusOr<uint64_t> PreparedTransferTable::Prepare(
    uid_t owner, const v1::PrepareTransferRequest& request,
    OpPreparer& preparer, size_t max_context_bytes) {
  auto slot = slots_->Reserve(owner, 1);
  if (!slot.ok()) return slot.status();
  // The copy of the ops (their known fields only) and one plain
  // description per op, estimated from above before anything is copied.
  const size_t count = static_cast<size_t>(request.ops_size());
  uint64_t copy_bytes =
      PreparedTransferLimits::kOverheadBytes + sizeof(PreparedTransfer) +
      StringCopyBytes(request.notification()) +
      count * (sizeof(v1::Op) + sizeof(void*) + kBlockBytes + sizeof(OpSpec));
  for (const v1::Op& op : request.ops()) {
    copy_bytes += StringCopyBytes(op.remote_context());
  }
  auto bytes = bytes_->Reserve(owner, copy_bytes);
  if (!bytes.ok()) return bytes.status();

  auto prepared = std::make_shared<PreparedTransfer>();
  prepared->ops.reserve(count);
  // Each distinct parsed context is charged once (ops sharing a context or
  // a handle share one).
  absl::flat_hash_set<const v1::RemoteBuffer*> distinct;
  uint64_t parsed_bytes = 0;
  for (size_t i = 0; i < count; ++i) {
    const v1::Op& wire = request.ops(static_cast<int>(i));
    absl::Status size =
        CheckRemoteContextSize(wire.remote_context(), max_context_bytes);
    auto remote =
        size.ok()
            ? preparer.Remote(wire)
            : absl::StatusOr<std::shared_ptr<const v1::RemoteBuffer>>(size);
    if (!remote.ok()) return AnnotateOp(remote.status(), i);
    OpSpec spec = OpPreparer::SpecOf(wire, *remote);
    // Checked as a Submit would check it now; what it pins is let go.
    absl::StatusOr<Op> op = preparer.Prepare(spec, i);
    if (!op.ok()) return AnnotateOp(op.status(), i);
    if (distinct.insert(remote->get()).second) {
      parsed_bytes += (*remote)->SpaceUsedLong() + kBlockBytes +
                      sizeof(std::shared_ptr<void>) * 2;
    }
    prepared->ops.push_back(std::move(spec));
  }
  auto parsed = bytes_->Reserve(owner, parsed_bytes);
  if (!parsed.ok()) return parsed.status();
  google::protobuf::RepeatedPtrField<v1::Op>& ops =
      *prepared->request.mutable_ops();
  ops.Reserve(static_cast<int>(count));
  for (const v1::Op& wire : request.ops()) {
    v1::Op& op = *ops.Add();
    op.set_type(wire.type());
    op.set_local_buffer_id(wire.local_buffer_id());
    op.set_local_offset(wire.local_offset());
    op.set_length(wire.length());
    op.set_remote_context(wire.remote_context());
    op.set_remote_offset(wire.remote_offset());
    op.set_remote_handle(wire.remote_handle());
  }
  prepared->request.set_notification(request.notification());
  prepared->slot = std::move(*slot);
  prepared->bytes = std::move(*bytes);
  prepared->parsed_bytes = std::move(*parsed);
  return table_.Add(owner, std::move(prepared));
}

absl::StatusOr<std::shared_ptr<const PreparedTransfer>>
PreparedTransferTable::Find(uid_t owner, uint64_t id) const {
  std::shared_ptr<const PreparedTransfer> found = table_.Find(owner, id);
  if (found == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("prepared transfer ", id, " is not prepared"));
  }
  return found;
}

absl::Status PreparedTransferTable::Release(uid_t owner, uint64_t id) {
  if (!table_.Remove(owner, id)) {
    return absl::NotFoundError(
        absl::StrCat("prepared transfer ", id, " is not prepared"));
  }
  return absl::OkStatus();
}

}  // namespace rdma_agent

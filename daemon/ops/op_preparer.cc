#include "daemon/ops/op_preparer.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/ops/remote_context.h"

namespace rdma_agent {

const absl::StatusOr<std::shared_ptr<const v1::RemoteBuffer>>&
OpPreparer::Context(const std::string& bytes) {
  // Consecutive ops mostly carry the same context: comparing the bytes
  // with the last op's is cheaper than hashing them.
  if (last_context_ != nullptr && last_context_->first == bytes) {
    return last_context_->second;
  }
  // Looked up by the op's own string: no copy unless it is new.
  auto it = contexts_.find(bytes);
  if (it == contexts_.end()) {
    it = contexts_.emplace(bytes, ParseRemoteContext(bytes)).first;
  }
  last_context_ = &*it;
  return it->second;
}

const absl::StatusOr<std::shared_ptr<Registration>>& OpPreparer::Local(
    uint64_t id) {
  auto it = locals_.find(id);
  if (it == locals_.end()) {
    absl::StatusOr<std::shared_ptr<Registration>> found =
        buffers_->Find(id, caller_);
    if (!found.ok()) {
      found = absl::NotFoundError(
          absl::StrCat("local buffer ", id, " is not registered"));
    }
    it = locals_.emplace(id, std::move(found)).first;
  }
  return it->second;
}

const absl::StatusOr<std::shared_ptr<const v1::RemoteBuffer>>&
OpPreparer::Handle(uint64_t handle) {
  auto it = handles_seen_.find(handle);
  if (it == handles_seen_.end()) {
    absl::StatusOr<std::shared_ptr<const v1::RemoteBuffer>> found =
        handles_ != nullptr
            ? handles_->Find(caller_, handle)
            : absl::NotFoundError(
                  absl::StrCat("remote handle ", handle, " is not imported"));
    it = handles_seen_.emplace(handle, std::move(found)).first;
  }
  return it->second;
}

const absl::StatusOr<std::shared_ptr<const v1::RemoteBuffer>>& OpPreparer::Name(
    const std::string& name) {
  auto it = names_seen_.find(name);
  if (it == names_seen_.end()) {
    absl::StatusOr<std::shared_ptr<const v1::RemoteBuffer>> found =
        absl::NotFoundError(
            absl::StrCat("remote name \"", name, "\" is not published"));
    if (names_ != nullptr) {
      absl::StatusOr<std::string> context = (*names_)(caller_, name);
      if (context.ok()) {
        found = Context(*context);
      } else {
        found = context.status();
      }
    }
    it = names_seen_.emplace(name, std::move(found)).first;
  }
  return it->second;
}

absl::StatusOr<std::shared_ptr<const v1::RemoteBuffer>> OpPreparer::Remote(
    const v1::Op& wire) {
  const int sides = (wire.remote_handle() != 0 ? 1 : 0) +
                    (!wire.remote_context().empty() ? 1 : 0) +
                    (!wire.remote_name().empty() ? 1 : 0);
  if (sides > 1) {
    return absl::InvalidArgumentError(
        "set one of remote_context, remote_handle and remote_name, not "
        "several");
  }
  if (wire.remote_handle() != 0) return Handle(wire.remote_handle());
  if (!wire.remote_name().empty()) return Name(wire.remote_name());
  if (wire.remote_context().empty()) {
    return absl::InvalidArgumentError(
        "remote_context is empty and no remote_handle or remote_name is set");
  }
  return Context(wire.remote_context());
}

absl::Status OpPreparer::CheckShape(v1::OpType type, uint64_t length) {
  if (type != v1::OP_TYPE_READ_INTO_LOCAL &&
      type != v1::OP_TYPE_WRITE_FROM_LOCAL) {
    return absl::InvalidArgumentError(
        "type must be OP_TYPE_READ_INTO_LOCAL or OP_TYPE_WRITE_FROM_LOCAL");
  }
  if (length == 0) {
    return absl::InvalidArgumentError("length must be positive");
  }
  return absl::OkStatus();
}

OpSpec OpPreparer::SpecOf(const v1::Op& wire,
                          std::shared_ptr<const v1::RemoteBuffer> remote) {
  OpSpec spec;
  spec.type = wire.type();
  spec.local_buffer_id = wire.local_buffer_id();
  spec.local_offset = wire.local_offset();
  spec.length = wire.length();
  spec.remote_handle = wire.remote_handle();
  spec.remote = std::move(remote);
  spec.remote_offset = wire.remote_offset();
  return spec;
}

void OpPreparer::Clear() {
  names_seen_.clear();
  handles_seen_.clear();
  contexts_.clear();
  last_context_ = nullptr;
  locals_.clear();
}

absl::StatusOr<Op> OpPreparer::Prepare(const v1::Op& wire, size_t index) {
  if (absl::Status shape = CheckShape(wire.type(), wire.length());
      !shape.ok()) {
    return shape;
  }
  auto remote = Remote(wire);
  if (!remote.ok()) return remote.status();
  return PrepareResolved(SpecOf(wire, nullptr), index, *remote);
}

absl::StatusOr<Op> OpPreparer::Prepare(const OpSpec& spec, size_t index) {
  if (absl::Status shape = CheckShape(spec.type, spec.length); !shape.ok()) {
    return shape;
  }
  if (spec.remote != nullptr) return PrepareResolved(spec, index, spec.remote);
  if (spec.remote_handle == 0) {
    // As an Op that names no remote side.
    return absl::InvalidArgumentError(
        "remote_context is empty and no remote_handle or remote_name is set");
  }
  const auto& remote = Handle(spec.remote_handle);
  if (!remote.ok()) return remote.status();
  return PrepareResolved(spec, index, *remote);
}

absl::StatusOr<Op> OpPreparer::PrepareResolved(
    const OpSpec& spec, size_t index,
    const std::shared_ptr<const v1::RemoteBuffer>& remote_context) {
  Op op;
  op.index = index;
  op.type = spec.type;
  const std::shared_ptr<const v1::RemoteBuffer>* remote = &remote_context;
  const auto& local = Local(spec.local_buffer_id);
  if (!local.ok()) return local.status();
  absl::Status status =
      CheckRange(spec.local_offset, spec.length, (*local)->size(), "local");
  if (!status.ok()) return status;
  status = CheckRange(spec.remote_offset, spec.length, (*remote)->size_bytes(),
                      "remote");
  if (!status.ok()) return status;
  const bool reads = op.reads_into_local();
  if (reads ? !(*local)->writable() : !(*local)->readable()) {
    return absl::PermissionDeniedError(absl::StrCat(
        "local buffer ", spec.local_buffer_id, " has access ",
        v1::Access_Name((*local)->access()), "; ",
        reads ? "reading into it needs WRITE" : "writing from it needs READ"));
  }
  if (reads ? !AllowsRead((*remote)->access())
            : !AllowsWrite((*remote)->access())) {
    return absl::PermissionDeniedError(absl::StrCat(
        "remote buffer ", (*remote)->buffer_id(), " has access ",
        v1::Access_Name((*remote)->access()), "; ",
        reads ? "reading it needs READ" : "writing into it needs WRITE"));
  }
  op.local = *local;
  op.local_offset = spec.local_offset;
  op.length = spec.length;
  op.remote = *remote;
  op.remote_offset = spec.remote_offset;
  return op;
}

}  // namespace rdma_agent

#include "daemon/ops/remote_context.h"

#include "absl/strings/str_cat.h"
#include "backends/registration.h"

namespace rdma_agent {

absl::Status CheckRemoteContextSize(const std::string& bytes,
                                    size_t max_bytes) {
  if (bytes.size() <= max_bytes) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "remote_context is ", bytes.size(), " bytes; this agent takes at most ",
      max_bytes,
      " (--max_remote_context_bytes): not a context an agent issued"));
}

absl::StatusOr<std::shared_ptr<const v1::RemoteBuffer>> ParseRemoteContext(
    const std::string& bytes, size_t max_bytes) {
  if (absl::Status size = CheckRemoteContextSize(bytes, max_bytes);
      !size.ok()) {
    return size;
  }
  if (bytes.empty()) {
    return absl::InvalidArgumentError("remote_context is empty");
  }
  auto remote = std::make_shared<v1::RemoteBuffer>();
  if (!remote->ParseFromString(bytes)) {
    return absl::InvalidArgumentError(
        "remote_context is not a serialized RemoteBuffer (malformed or "
        "truncated)");
  }
  const bool valid_access =
      AllowsRead(remote->access()) || AllowsWrite(remote->access());
  if (remote->agent_id().empty() || remote->agent_epoch() == 0 ||
      remote->size_bytes() == 0 || remote->token().empty() ||
      remote->endpoints().empty() || !valid_access) {
    return absl::InvalidArgumentError(
        "remote_context is incomplete (missing agent, epoch, size, token, "
        "access or endpoints): truncated or not issued by an agent");
  }
  return remote;
}

}  // namespace rdma_agent

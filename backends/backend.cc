#include "backends/backend.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"

namespace rdma_agent {

const v1::BackendEndpoint* FindEndpoint(const v1::RemoteBuffer& remote,
                                        absl::string_view backend) {
  for (const auto& endpoint : remote.endpoints()) {
    if (endpoint.backend() == backend) return &endpoint;
  }
  return nullptr;
}

absl::Status AnnotateOp(const absl::Status& status, size_t op_index) {
  if (status.ok()) return status;
  const std::string prefix = absl::StrCat("op ", op_index, ": ");
  if (absl::StartsWith(status.message(), prefix)) return status;
  return absl::Status(status.code(), absl::StrCat(prefix, status.message()));
}

ServeRequest ServeRequestFor(const Op& op) {
  ServeRequest request;
  request.agent_epoch = op.remote->agent_epoch();
  request.buffer_id = op.remote->buffer_id();
  request.token = op.remote->token();
  request.offset = op.remote_offset;
  request.length = op.length;
  request.write = !op.reads_into_local();
  return request;
}

ServeRequest NotificationTarget(const v1::RemoteBuffer& remote) {
  ServeRequest request;
  request.agent_epoch = remote.agent_epoch();
  request.buffer_id = remote.buffer_id();
  request.token = remote.token();
  request.proof_only = true;
  return request;
}

std::vector<absl::Status> Backend::Submit(absl::Span<const Op> ops,
                                          const StopToken& stop) {
  std::vector<absl::Status> statuses;
  absl::Notification ended;
  Post(ops, stop, [&statuses, &ended](std::vector<absl::Status> posted) {
    statuses = std::move(posted);
    ended.Notify();
  });
  ended.WaitForNotification();
  return statuses;
}

absl::Status Backend::Notify(const v1::RemoteBuffer&,
                             const v1::BackendEndpoint&, absl::string_view,
                             const StopToken&) {
  return absl::UnimplementedError(
      absl::StrCat("the ", name(), " backend carries no notifications"));
}

}  // namespace rdma_agent

#include "daemon/api/waiting_rpcs.h"

#include <algorithm>

namespace rdma_agent {

absl::StatusOr<absl::Duration> LongPollWait(
    const google::protobuf::Duration* wait, absl::Duration max_wait) {
  if (wait == nullptr) return absl::ZeroDuration();
  if (wait->seconds() < 0 || wait->nanos() < 0 || wait->nanos() > 999999999) {
    return absl::InvalidArgumentError(
        "wait must be a well-formed, non-negative Duration");
  }
  return std::min(
      absl::Seconds(wait->seconds()) + absl::Nanoseconds(wait->nanos()),
      max_wait);
}

grpc::ServerUnaryReactor* RefuseUnary(grpc::CallbackServerContext* context,
                                      const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace rdma_agent

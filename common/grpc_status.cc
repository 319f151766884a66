#include "common/grpc_status.h"

#include <string>

#include "common/status_util.h"

namespace rdma_agent {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  return StatusFromInt(status.error_code(), status.error_message());
}

}  // namespace rdma_agent

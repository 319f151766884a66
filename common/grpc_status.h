#ifndef RDMA_AGENTD_COMMON_GRPC_STATUS_H_
#define RDMA_AGENTD_COMMON_GRPC_STATUS_H_

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace rdma_agent {

// absl and gRPC share the code numbering; the message is kept as is.
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_COMMON_GRPC_STATUS_H_

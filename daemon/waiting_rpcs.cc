#include "daemon/waiting_rpcs.h"

namespace rdma_agent {

grpc::ServerUnaryReactor* RefuseUnary(grpc::CallbackServerContext* context,
                                      const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace rdma_agent

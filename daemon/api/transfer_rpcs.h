#ifndef RDMA_AGENTD_DAEMON_API_TRANSFER_RPCS_H_
#define RDMA_AGENTD_DAEMON_API_TRANSFER_RPCS_H_

#include <sys/types.h>

#include <memory>

#include "absl/time/time.h"
#include "daemon/limits/active_calls.h"
#include "daemon/ops/transfers.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/server_callback.h"
#include "rdma/agent/v1/agent.pb.h"

namespace rdma_agent {

// The transfer RPCs that wait, served without a thread (daemon/
// waiting_rpcs.h) from the TransferTable. The caller (RdmaAgentService) has
// identified the caller's user and admitted the call
// (ActiveCalls::StartWaiting); `call` is held until gRPC is done with it.

// GetTransfers for `uid`: INVALID_ARGUMENT for a bad request; NOT_FOUND for
// an id that is not one of uid's kept transfers; otherwise the named
// transfers, each distinct id once (in the order first named), once all
// have ended or `wait` (cut to `max_wait` and the call's deadline) has
// passed. Ends are reported (dropped) only by an answer that is sent: a poll
// its client cancelled reports nothing. The reply is sized from the
// transfers' kept byte counts before anything is copied, copied without the
// table's lock and charged to uid's transfer byte budget until the call is
// done: RESOURCE_EXHAUSTED naming the budget, nothing reported, when it does
// not fit (TransferTable::Poll::Report).
grpc::ServerUnaryReactor* ServeGetTransfers(
    grpc::CallbackServerContext* context,
    std::unique_ptr<ActiveCalls::Call> call, uid_t uid,
    const v1::GetTransfersRequest& request, v1::GetTransfersResponse* response,
    TransferTable* transfers, absl::Duration max_wait);

// WatchTransfers for `uid`: every end of uid's transfers, first those kept
// when it opens, until the client cancels, the stream falls too far behind
// (RESOURCE_EXHAUSTED) or the agent shuts down (UNAVAILABLE). An end counts
// as delivered once handed to gRPC (TransferTable::Stream::Delivered).
grpc::ServerWriteReactor<v1::TransferEvent>* ServeWatchTransfers(
    std::unique_ptr<ActiveCalls::Call> call, uid_t uid,
    TransferTable* transfers);

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_API_TRANSFER_RPCS_H_

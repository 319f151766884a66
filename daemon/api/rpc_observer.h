#ifndef RDMA_AGENTD_DAEMON_API_RPC_OBSERVER_H_
#define RDMA_AGENTD_DAEMON_API_RPC_OBSERVER_H_

#include <memory>

#include "common/rate_limited_log.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/server_interceptor.h"

namespace rdma_agent {

class AgentMetrics;
class CallerTable;

// Sees every RPC a server of the agent answers, in one place rather than in
// each handler: logs each at debug (method, caller, code, time), logs each
// error the client sees at warning with its caller (rate limited: a client
// in a loop cannot flood the journal), and counts it in the metrics (RPCs by
// method and code, Submit latency). A path that names no method compiled
// into the agent counts as method "unknown": callers choose paths, and each
// label value would be a series kept for the agent's life. gRPC runs server
// interceptors for the callback-API methods too (GetTransfers, WatchTransfers):
// they are seen when their status is sent, like the synchronous ones.
class RpcObserverFactory
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  // For the API server: callers named by uid and pid. Both must outlive the
  // server.
  RpcObserverFactory(const CallerTable* callers, AgentMetrics* metrics);
  // For the Peer server: callers named by address; errors stay at debug
  // (what a peer was refused is logged where it is decided, with the
  // buffer it asked for).
  explicit RpcObserverFactory(AgentMetrics* metrics);

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override;

 private:
  const CallerTable* const callers_;  // nullptr: the Peer server
  AgentMetrics* const metrics_;
  // Shared by every call: 20 lines at once, then one a second.
  LogRateLimiter error_log_{absl::Seconds(1), 20};
};

// Has the server `builder` builds log and count its RPCs through `observer`.
void ObserveRpcs(grpc::ServerBuilder& builder,
                 std::unique_ptr<RpcObserverFactory> observer);

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_API_RPC_OBSERVER_H_

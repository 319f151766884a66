#ifndef RDMA_AGENTD_DAEMON_API_NOTIFICATION_RPCS_H_
#define RDMA_AGENTD_DAEMON_API_NOTIFICATION_RPCS_H_

#include <sys/types.h>

#include <memory>

#include "absl/time/time.h"
#include "daemon/limits/active_calls.h"
#include "daemon/ops/notifications.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/server_callback.h"
#include "rdma/agent/v1/agent.pb.h"

namespace rdma_agent {

// The notification RPCs, served without a thread (daemon/waiting_rpcs.h)
// from the NotificationInbox. The caller (RdmaAgentService) has identified
// the caller's user and admitted the call; `call` is held until gRPC is done
// with it.

// GetNotifications for `uid`: INVALID_ARGUMENT for a bad request; otherwise
// up to max_count of uid's queued notifications (and about 2 MiB of them,
// one at least, so that the answer stays within what a gRPC client takes
// by default; the rest stay queued), at once when some are queued, else
// once one arrives or `wait` (cut to `max_wait` and the call's deadline)
// has passed.
grpc::ServerUnaryReactor* ServeGetNotifications(
    grpc::CallbackServerContext* context,
    std::unique_ptr<ActiveCalls::Call> call, uid_t uid,
    const v1::GetNotificationsRequest& request,
    v1::GetNotificationsResponse* response, NotificationInbox* inbox,
    absl::Duration max_wait);

// WatchNotifications for `uid`: uid's notifications as they arrive (first
// those queued), until the client cancels or the agent shuts down
// (UNAVAILABLE).
grpc::ServerWriteReactor<v1::NotificationEvent>* ServeWatchNotifications(
    std::unique_ptr<ActiveCalls::Call> call, uid_t uid,
    NotificationInbox* inbox);

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_API_NOTIFICATION_RPCS_H_

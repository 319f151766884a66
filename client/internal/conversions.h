#ifndef RDMA_AGENTD_CLIENT_INTERNAL_CONVERSIONS_H_
#define RDMA_AGENTD_CLIENT_INTERNAL_CONVERSIONS_H_

#include <vector>

#include "absl/time/time.h"
#include "client/rdma_agent_client.h"
#include "rdma/agent/v1/agent.pb.h"
#include "rdma/agent/v1/types.pb.h"

namespace rdma_agent::client::internal {

// True when `timeout` leaves a batch's bound to the agent's
// --default_submit_timeout (zero or infinite): the request carries none.
bool LeavesTimeoutToAgent(absl::Duration timeout);

// The request Submit and SubmitAsync send for `ops`. Negative timeouts are
// sent as they are: the agent rejects them.
v1::SubmitRequest SubmitRequestFor(const std::vector<OpSpec>& ops,
                                   absl::Duration timeout);
// Sets `request`'s timeout as SubmitRequestFor does.
void SetTimeout(absl::Duration timeout, v1::SubmitRequest& request);

NotificationResult FromProto(const v1::NotificationResult& result);
v1::NotificationResult ToProto(const NotificationResult& result);
Notification FromProto(const v1::Notification& notification);

OpResult FromProto(const v1::OpResult& result);
v1::OpResult ToProto(const OpResult& result);

// Unknown states (a newer agent) read as kFailed; UNSPECIFIED as kPending.
TransferState FromProto(v1::TransferState state);
v1::TransferState ToProto(TransferState state);

// Unset times read as InfinitePast, and back.
TransferResult FromProto(const v1::Transfer& transfer);
v1::Transfer ToProto(const TransferResult& result);

}  // namespace rdma_agent::client::internal

#endif  // RDMA_AGENTD_CLIENT_INTERNAL_CONVERSIONS_H_

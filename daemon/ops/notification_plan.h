#ifndef RDMA_AGENTD_DAEMON_OPS_NOTIFICATION_PLAN_H_
#define RDMA_AGENTD_DAEMON_OPS_NOTIFICATION_PLAN_H_

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "backends/backend.h"
#include "backends/registry.h"

namespace rdma_agent {

// One notification of a batch: for the owner of one remote buffer.
struct PlannedNotification {
  std::shared_ptr<const v1::RemoteBuffer> remote;
  // The backend to carry it: the one that ran the batch's last op on the
  // buffer. Empty when it must not be sent (then `status` says why).
  std::string backend;
  // OK: to be sent. ABORTED: an op of the batch on the buffer's agent did
  // not succeed, or an op was refused before it ran (its agent may be any).
  absl::Status status;
};

// The notifications of a batch whose ops `ran` ended with `outcomes` (one
// per op, in order): one per distinct remote buffer (agent, epoch, buffer
// id), in order of first appearance. A notification is sent to an agent
// only when every op of the batch on that agent succeeded, so the target
// reads every byte the batch moved there once it has the notification.
// `refused_op` is the first op of the batch refused before it ran (not in
// `ran`), if any: it blocks every notification, because its agent is not
// known for sure.
std::vector<PlannedNotification> PlanNotifications(
    absl::Span<const Op> ran, absl::Span<const OpOutcome> outcomes,
    std::optional<size_t> refused_op);

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_OPS_NOTIFICATION_PLAN_H_

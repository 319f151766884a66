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
  // The context of the batch's last op on the buffer: the one that names
  // the backend's endpoint it is sent to.
  std::shared_ptr<const v1::RemoteBuffer> remote;
  // The backend to carry it: the one that ran the batch's last op on the
  // buffer. Empty when it must not be sent (then `status` says why).
  std::string backend;
  // OK: to be sent. ABORTED: an op of the batch on the buffer's agent did
  // not succeed, or an op was refused before it ran (its agent may be any).
  absl::Status status;
};

// The notifications of a batch whose ops `ran` ended with `outcomes` (one
// per op, in order): one per distinct remote buffer, in order of first
// appearance, however many copies of its context the batch carries.
//
// A buffer is its agent's epoch and its id: the agent id written in a
// context is never checked by the agent serving it (a caller may change it
// in each copy), while the epoch is (an op under another epoch fails), and
// epochs are random 64-bit numbers drawn at each start, so they name one
// agent's life. The agent id reported is the context's.
//
// A notification is sent to an agent only when every op of the batch on
// that agent (its epoch) succeeded, so the target reads every byte the
// batch moved there once it has the notification. `refused_op` is the first
// op of the batch refused before it ran (not in `ran`), if any: it blocks
// every notification, because its agent is not known for sure.
std::vector<PlannedNotification> PlanNotifications(
    absl::Span<const Op> ran, absl::Span<const OpOutcome> outcomes,
    std::optional<size_t> refused_op);

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_OPS_NOTIFICATION_PLAN_H_

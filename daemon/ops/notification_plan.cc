#include "daemon/ops/notification_plan.h"

#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"

namespace rdma_agent {

std::vector<PlannedNotification> PlanNotifications(
    absl::Span<const Op> ran, absl::Span<const OpOutcome> outcomes,
    std::optional<size_t> refused_op) {
  // The first op on each agent (epoch) that did not succeed.
  absl::flat_hash_map<uint64_t, size_t> failed_on_agent;
  for (size_t k = 0; k < ran.size(); ++k) {
    if (!outcomes[k].status.ok()) {
      failed_on_agent.try_emplace(ran[k].remote->agent_epoch(), ran[k].index);
    }
  }
  std::vector<PlannedNotification> planned;
  // By (epoch, buffer id), never by the context's bytes or agent id.
  absl::flat_hash_map<std::pair<uint64_t, uint64_t>, size_t> position;
  for (size_t k = 0; k < ran.size(); ++k) {
    const v1::RemoteBuffer& remote = *ran[k].remote;
    auto [it, inserted] = position.try_emplace(
        std::make_pair(remote.agent_epoch(), remote.buffer_id()),
        planned.size());
    if (inserted) planned.push_back({nullptr, "", absl::OkStatus()});
    // The last op on the buffer names the backend, and its context the
    // endpoint.
    planned[it->second].remote = ran[k].remote;
    planned[it->second].backend = outcomes[k].backend;
  }
  for (PlannedNotification& notification : planned) {
    absl::Status blocked;
    if (refused_op.has_value()) {
      blocked = absl::AbortedError(absl::StrCat("not sent: op ", *refused_op,
                                                " of the batch was refused"));
    } else if (auto failed =
                   failed_on_agent.find(notification.remote->agent_epoch());
               failed != failed_on_agent.end()) {
      blocked = absl::AbortedError(
          absl::StrCat("not sent: op ", failed->second,
                       " of the batch on this agent did not succeed"));
    }
    if (!blocked.ok()) {
      notification.status = std::move(blocked);
      notification.backend.clear();
    }
  }
  return planned;
}

}  // namespace rdma_agent

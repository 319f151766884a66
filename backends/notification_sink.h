#ifndef RDMA_AGENTD_BACKENDS_NOTIFICATION_SINK_H_
#define RDMA_AGENTD_BACKENDS_NOTIFICATION_SINK_H_

#include <cstddef>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "backends/buffer_directory.h"

namespace rdma_agent {

// Where a backend hands the notifications peers send to the owners of this
// agent's registrations (Backend::Notify on the sending agent). The agent
// queues each for the owner of the buffer it names.
//
// Thread-safe: backends deliver from their serving threads.
class NotificationSink {
 public:
  virtual ~NotificationSink() = default;

  // `target` names the buffer (epoch, id, token, requester) and is checked
  // with BufferDirectory::ResolveForNotification, token first: a sender
  // without the token learns nothing, one whose token does not allow
  // writing the buffer is refused PERMISSION_DENIED. `from_agent_id` is the
  // sender's claim of its own id. OK once queued for the buffer's owner;
  // INVALID_ARGUMENT when `data` is longer than max_bytes().
  virtual absl::Status Deliver(const ServeRequest& target,
                               absl::string_view from_agent_id,
                               absl::string_view data) = 0;

  // The longest `data` Deliver takes (the agent's --max_notification_bytes):
  // serving sides refuse a longer notification before they read it.
  virtual size_t max_bytes() const = 0;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_BACKENDS_NOTIFICATION_SINK_H_

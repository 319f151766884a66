#ifndef RDMA_AGENTD_DAEMON_STATE_DIR_H_
#define RDMA_AGENTD_DAEMON_STATE_DIR_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rdma_agent {

// What the agent keeps across restarts and reboots (its id) lives in a state
// directory (/var/lib/rdma-agentd; systemd's StateDirectory=), not in the
// runtime directory, which systemd removes when the agent stops.

// Creates `dir` (one level) if missing and checks that this process may
// write it: an error saying why not (read-only file system, no permission,
// a parent missing).
absl::Status PrepareStateDir(const std::string& dir);

// True when both paths name the same existing directory.
bool IsSameDirectory(const std::string& a, const std::string& b);

// The agent id kept in <state_dir>/agent-id. When that is missing, an id left
// in <legacy_dir>/agent-id (where earlier versions kept it; empty: nowhere)
// is taken over, once: copied, then removed. Otherwise a new id is made.
// Written atomically: a crash leaves the old file or the new one.
absl::StatusOr<std::string> LoadOrCreateAgentId(const std::string& state_dir,
                                                const std::string& legacy_dir);

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_STATE_DIR_H_

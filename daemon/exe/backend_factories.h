#ifndef RDMA_AGENTD_DAEMON_EXE_BACKEND_FACTORIES_H_
#define RDMA_AGENTD_DAEMON_EXE_BACKEND_FACTORIES_H_

#include <string>

#include "absl/status/statusor.h"
#include "backends/backend.h"

namespace rdma_agent {

// The factory for backend `name` ("memory", "tcp", "ibverbs"), configured
// from that backend's flags. INVALID_ARGUMENT for an unknown name.
absl::StatusOr<BackendFactory> BackendFactoryFromFlags(const std::string& name);

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_EXE_BACKEND_FACTORIES_H_

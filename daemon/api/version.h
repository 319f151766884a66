#ifndef RDMA_AGENTD_DAEMON_API_VERSION_H_
#define RDMA_AGENTD_DAEMON_API_VERSION_H_

#include "common/version.h"

namespace rdma_agent {

// What GetInfo, --version and build_info report.
inline constexpr const char* kAgentVersion = kProjectVersion;

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_API_VERSION_H_

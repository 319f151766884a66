#ifndef RDMA_AGENTD_DAEMON_API_VERSION_H_
#define RDMA_AGENTD_DAEMON_API_VERSION_H_

namespace rdma_agent {

inline constexpr char kAgentVersion[] = "0.1.0";

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_API_VERSION_H_

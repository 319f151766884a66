#ifndef RDMA_AGENTD_COMMON_VERSION_H_
#define RDMA_AGENTD_COMMON_VERSION_H_

namespace rdma_agent {

// The project's version: rdma-agentd and rdma-agentctl are released together
// and report the same one.
inline constexpr char kProjectVersion[] = "0.1.0";

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_COMMON_VERSION_H_

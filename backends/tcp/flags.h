#ifndef RDMA_AGENTD_BACKENDS_TCP_FLAGS_H_
#define RDMA_AGENTD_BACKENDS_TCP_FLAGS_H_

#include "backends/backend.h"

namespace rdma_agent {

// A factory that spawns a TcpBackend configured by the --tcp_* flags
// (read when the factory runs, i.e. after flag parsing).
BackendFactory MakeTcpBackendFactoryFromFlags();

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_BACKENDS_TCP_FLAGS_H_

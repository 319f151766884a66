#ifndef RDMA_AGENTD_TESTS_TESTING_BACKEND_FACTORIES_H_
#define RDMA_AGENTD_TESTS_TESTING_BACKEND_FACTORIES_H_

// Test-only: the backends in-process agents are usually given, so that a
// test names what its agent runs rather than spelling out each factory.
// The ibverbs backend over the soft NIC is testing::IbverbsFactory
// (backends/testing/ibverbs_agent.h).

#include "backends/backend.h"

namespace rdma_agent::testing {

// The memory backend.
BackendFactory MemoryFactory();
// The tcp backend with its data port on 127.0.0.1, any free port.
BackendFactory LoopbackTcpFactory();

}  // namespace rdma_agent::testing

#endif  // RDMA_AGENTD_TESTS_TESTING_BACKEND_FACTORIES_H_

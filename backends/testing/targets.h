#ifndef RDMA_AGENTD_BACKENDS_TESTING_TARGETS_H_
#define RDMA_AGENTD_BACKENDS_TESTING_TARGETS_H_

// Test-only: the backends the contract suite runs against, each with what it
// needs to run (agents, a software fabric) and how it is configured.

#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <string>

#include "backends/backend.h"

namespace rdma_agent {
namespace testing {

// What the backends of one test's agents share (a software fabric...), and
// the factory of each agent's backend. Outlives the agents.
class TargetWorld {
 public:
  virtual ~TargetWorld() = default;
  virtual BackendFactory Factory(int agent) = 0;
};

// A backend under contract test.
struct BackendTarget {
  // Test name suffix: "memory", "tcp", "soft_ibverbs".
  std::string name;
  // Agents ops run between: 1 when the backend reaches only its own agent's
  // registrations (memory), else 2 (ops run from agent 0 against agent 1).
  int agents = 2;
  // Largest piece of an op the configured backend moves at once (message,
  // chunk, slice): the suite moves ops longer than this.
  uint64_t max_message_bytes = 0;
  std::function<std::unique_ptr<TargetWorld>()> make_world;
};

// Names the target in test parameters.
inline void PrintTo(const BackendTarget& target, std::ostream* os) {
  *os << target.name;
}

BackendTarget MemoryTarget();
BackendTarget TcpTarget();
// The ibverbs backend on the software RC NIC, one device per agent.
BackendTarget SoftIbverbsTarget();
// The same with several rails per agent: three devices of different link
// speeds on agent 0, two on agent 1, so that ops are striped unevenly and
// over fewer rails on the serving side.
BackendTarget SoftIbverbsRailsTarget();

}  // namespace testing
}  // namespace rdma_agent

#endif  // RDMA_AGENTD_BACKENDS_TESTING_TARGETS_H_

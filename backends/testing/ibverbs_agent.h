#ifndef RDMA_AGENTD_BACKENDS_TESTING_IBVERBS_AGENT_H_
#define RDMA_AGENTD_BACKENDS_TESTING_IBVERBS_AGENT_H_

// Test-only: TestAgents running the ibverbs backend, over the software NIC
// or any Verbs (the hardware test passes the real one).

#include <memory>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "backends/ibverbs/ibverbs_backend.h"
#include "backends/ibverbs/soft/soft_verbs.h"
#include "backends/testing/harness.h"

namespace rdma_agent {
namespace testing {

// Spawns an IbverbsBackend over the Verbs `make_verbs` returns.
BackendFactory IbverbsFactory(
    std::function<std::unique_ptr<verbs::Verbs>()> make_verbs,
    ibverbs::IbverbsOptions options = {});

// An agent `agent_id` whose ibverbs backend sees only `device` of `fabric`
// (which must outlive it); nullptr (and a test failure) if it cannot start.
std::unique_ptr<TestAgent> SoftIbverbsAgent(
    verbs::SoftFabric& fabric, const std::string& agent_id,
    const std::string& device, ibverbs::IbverbsOptions options = {});

// An agent whose ibverbs backend sees `devices` of `fabric`: one rail per
// device (which must outlive it); nullptr (and a test failure) if it
// cannot start.
std::unique_ptr<TestAgent> SoftIbverbsAgent(
    verbs::SoftFabric& fabric, const std::string& agent_id,
    const std::vector<std::string>& devices,
    ibverbs::IbverbsOptions options = {});

// The same over `verbs`.
std::unique_ptr<TestAgent> IbverbsAgent(std::unique_ptr<verbs::Verbs> verbs,
                                        const std::string& agent_id,
                                        ibverbs::IbverbsOptions options = {});

}  // namespace testing
}  // namespace rdma_agent

#endif  // RDMA_AGENTD_BACKENDS_TESTING_IBVERBS_AGENT_H_

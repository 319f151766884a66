#ifndef RDMA_AGENTD_TESTS_DAEMON_AGENT_GAUGES_H_
#define RDMA_AGENTD_TESTS_DAEMON_AGENT_GAUGES_H_

// The gauges a real rdma-agentd serves on its metrics endpoint (started with
// --metrics_listen=127.0.0.1:0), for tests that check that what a client
// left behind has been given back: rdma_agentd_rpcs_in_flight,
// rdma_agentd_ops_in_flight, rdma_agentd_transfers_in_flight,
// rdma_agentd_registrations, rdma_agentd_registered_bytes...

#include <string>

#include "absl/status/statusor.h"
#include "tests/testing/agent_process.h"

namespace rdma_agent::testing {

// The sum of every series of metric `name` (whatever its labels) in one
// scrape of `agent`'s /metrics; 0 when it has none (a gauge by user with no
// user left). UNAVAILABLE when the agent serves no metrics or cannot be
// scraped.
absl::StatusOr<double> ScrapeSum(AgentProcess& agent, const std::string& name);

}  // namespace rdma_agent::testing

#endif  // RDMA_AGENTD_TESTS_DAEMON_AGENT_GAUGES_H_

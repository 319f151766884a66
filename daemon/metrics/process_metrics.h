#ifndef RDMA_AGENTD_DAEMON_METRICS_PROCESS_METRICS_H_
#define RDMA_AGENTD_DAEMON_METRICS_PROCESS_METRICS_H_

#include <string>
#include <vector>

#include "prometheus/metric_family.h"

namespace rdma_agent {

// The standard process_* families of Prometheus clients, for this process,
// read from /proc at each scrape: process_cpu_seconds_total (user + system),
// process_resident_memory_bytes, process_virtual_memory_bytes,
// process_open_fds, process_max_fds, process_start_time_seconds and
// process_threads. `proc_self` is "/proc/self" but for tests. A family
// whose file cannot be read is left out.
std::vector<prometheus::MetricFamily> CollectProcessMetrics(
    const std::string& proc_self = "/proc/self");

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_METRICS_PROCESS_METRICS_H_

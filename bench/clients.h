#ifndef RDMA_AGENTD_BENCH_CLIENTS_H_
#define RDMA_AGENTD_BENCH_CLIENTS_H_

// Several client processes running ops through one agent at once: the
// aggregate rate and how evenly the agent shares it between them. The bench
// starts copies of itself (/proc/self/exe --client_child ...) and talks to
// each over its stdin/stdout:
//   child -> "ready"   buffers registered, warm-up batch done
//   parent -> "go"     sent to every child once all are ready
//   child -> "result ops=N seconds=S"   or "error MESSAGE" at any point

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace rdma_agent::bench {

struct ClientChildOptions {
  std::string local;   // agent that runs the ops
  std::string remote;  // agent that owns the remote buffer
  uint64_t op_bytes = 4096;
  int batch = 1000;
  absl::Duration duration = absl::Seconds(2);
};

// The child's side: registers its own buffers on both agents, WRITEs
// `batch` ops of `op_bytes` per Submit for `duration` after "go". Returns the
// process exit code.
int RunClientChild(const ClientChildOptions& options);

// What each child did, in ops per second of its own run.
struct ClientRates {
  std::vector<double> ops_per_second;
};

// Starts `count` children (`child_args` after argv[0]), starts them at once
// when all are ready and collects their rates. Fails (and kills what is
// left) if any child fails or nothing is heard within `timeout`.
absl::StatusOr<ClientRates> RunClients(
    int count, const std::vector<std::string>& child_args,
    absl::Duration timeout);

}  // namespace rdma_agent::bench

#endif  // RDMA_AGENTD_BENCH_CLIENTS_H_

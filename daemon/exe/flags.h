#ifndef RDMA_AGENTD_DAEMON_EXE_FLAGS_H_
#define RDMA_AGENTD_DAEMON_EXE_FLAGS_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/agent_options.h"

namespace rdma_agent {

// The flags read before anything else, so that every later refusal is
// logged as asked.
struct LoggingFlags {
  std::string level;
  std::string format;
  uint64_t open_files_limit = 0;
};
LoggingFlags LoggingFromFlags();

// Every other daemon flag (daemon/exe/flags.cc) as the agent's options,
// validated (AgentOptions::Validate). INVALID_ARGUMENT naming the flag.
absl::StatusOr<AgentOptions> AgentOptionsFromFlags();

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_EXE_FLAGS_H_

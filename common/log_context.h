#ifndef RDMA_AGENTD_COMMON_LOG_CONTEXT_H_
#define RDMA_AGENTD_COMMON_LOG_CONTEXT_H_

#include <sys/types.h>

#include <optional>
#include <string>

namespace rdma_agent {

// Who the log lines a thread writes now are about: the RPC and its caller.
// Code that logs on a caller's behalf sets it for those lines, so that
// structured log formats (--log_format=json) carry them as fields; text
// formats ignore it (the message names them).
struct LogContext {
  std::string method;  // "rdma.agent.v1.RdmaAgent/Submit"; empty: none
  std::optional<uid_t> uid;
  std::optional<pid_t> pid;
};

// The calling thread's context; empty outside any ScopedLogContext.
const LogContext& CurrentLogContext();

// Sets the calling thread's context for its own lifetime and restores the
// one before it when destroyed. Not copyable or movable: it lives in one
// scope of one thread.
class ScopedLogContext {
 public:
  explicit ScopedLogContext(LogContext context);
  ~ScopedLogContext();
  ScopedLogContext(const ScopedLogContext&) = delete;
  ScopedLogContext& operator=(const ScopedLogContext&) = delete;

 private:
  LogContext saved_;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_COMMON_LOG_CONTEXT_H_

#ifndef RDMA_AGENTD_DAEMON_EXE_MAIN_LOOP_H_
#define RDMA_AGENTD_DAEMON_EXE_MAIN_LOOP_H_

#include <signal.h>

#include <string>

#include "daemon/agent.h"
#include "daemon/exe/systemd_notifier.h"

namespace rdma_agent {

// The daemon's main thread once the agent serves: it takes the agent's
// signals synchronously (so shutdown runs as ordinary code, not in a signal
// handler) and pings systemd's watchdog. The pings come from this thread,
// not from a timer thread of their own, so that a stuck main thread stops
// them and systemd restarts the agent.

// Blocks SIGTERM, SIGINT and SIGHUP in the calling thread and returns them.
// Call it before any thread starts: threads inherit the mask, so these
// signals wait for ServeUntilStopSignal.
sigset_t BlockAgentSignals();

// What `systemctl status` shows while the agent serves: its socket and
// which backends are available.
std::string ServingStatus(const Agent& agent);

// Returns at SIGTERM or SIGINT, with the signal. Until then it pings the
// watchdog every half of its interval (when systemd asked for one) and
// answers SIGHUP with a log line: there is nothing to reload.
int ServeUntilStopSignal(const sigset_t& signals,
                         const SystemdNotifier& notifier);

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_EXE_MAIN_LOOP_H_

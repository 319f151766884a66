#ifndef RDMA_AGENTD_DAEMON_EXE_COMMAND_LINE_H_
#define RDMA_AGENTD_DAEMON_EXE_COMMAND_LINE_H_

namespace rdma_agent {

// Parses rdma-agentd's flags (abseil flags; --flagfile=FILE reads more).
// --help lists every flag an operator may set, the backends' included,
// grouped by the file that defines them; --helpfull adds abseil's own;
// --helpshort only the daemon's. These, --version (VersionText()) and
// --only_check_args print and exit 0. An unknown flag or a bad value exits 1,
// a stray argument 2, each with a message naming it. Returns only when the
// agent is to run.
void ParseCommandLineOrExit(int argc, char** argv);

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_EXE_COMMAND_LINE_H_

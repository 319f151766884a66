#ifndef RDMA_AGENTD_DAEMON_EXE_BUILD_INFO_H_
#define RDMA_AGENTD_DAEMON_EXE_BUILD_INFO_H_

#include <string>

namespace rdma_agent {

// What `rdma-agentd --version` prints: the version, then how this binary was
// built (compiler, Bazel compilation mode, optimization and assertions),
// then the source revision and build time, which only stamped builds know
// (`bazel build --config=release`):
//
//   rdma-agentd 0.1.0
//   built by gcc 12.2.0, -c opt (optimized, assertions off)
//   revision 0123456789ab (clean), built 2026-12-03 06:39:00 UTC
std::string VersionText();

// The source revision of a stamped build; "unknown" otherwise.
std::string BuildRevision();

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_EXE_BUILD_INFO_H_

#ifndef RDMA_AGENTD_DAEMON_EXE_BUILD_STAMP_H_
#define RDMA_AGENTD_DAEMON_EXE_BUILD_STAMP_H_

// Filled in at link time by build_stamp.cc (a Bazel linkstamp).
namespace rdma_agent::build_stamp {

// The source revision (tools/workspace_status.sh); "0" when not stamped.
extern const char kScmRevision[];
// "clean" or "modified"; empty or "redacted" when not known.
extern const char kScmStatus[];
// Seconds since the Unix epoch; 0 when not stamped.
extern const long long kTimestamp;

}  // namespace rdma_agent::build_stamp

#endif  // RDMA_AGENTD_DAEMON_EXE_BUILD_STAMP_H_

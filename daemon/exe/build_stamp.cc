// A Bazel linkstamp: compiled when a binary is linked, with the workspace
// status as macros. Under --stamp (--config=release) BUILD_SCM_REVISION and
// BUILD_TIMESTAMP are real; otherwise Bazel puts placeholders ("0", 0) there,
// so that unstamped binaries stay cacheable.
#include "daemon/exe/build_stamp.h"

#ifndef BUILD_SCM_REVISION
#define BUILD_SCM_REVISION "0"
#endif
#ifndef BUILD_SCM_STATUS
#define BUILD_SCM_STATUS ""
#endif
#ifndef BUILD_TIMESTAMP
#define BUILD_TIMESTAMP 0
#endif

namespace rdma_agent::build_stamp {

const char kScmRevision[] = BUILD_SCM_REVISION;
const char kScmStatus[] = BUILD_SCM_STATUS;
const long long kTimestamp = BUILD_TIMESTAMP;

}  // namespace rdma_agent::build_stamp

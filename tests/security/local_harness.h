#ifndef RDMA_AGENTD_TESTS_SECURITY_LOCAL_HARNESS_H_
#define RDMA_AGENTD_TESTS_SECURITY_LOCAL_HARNESS_H_

// What the local-attack tests share: a local_worker process as some user,
// the agent's memory and fd footprint read from /proc, and bounded polling.

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/eventually.h"
#include "tests/testing/process.h"

namespace rdma_agent::testing {

inline constexpr int kNobody = 65534;
inline constexpr int kOtherUser = 65533;

// A local_worker (see local_worker.cc) connected to `agent`, as `uid` (and
// gid `uid`) unless uid < 0.
class LocalWorker {
 public:
  static absl::StatusOr<LocalWorker> Start(const AgentProcess& agent, int uid);

  // Sends `command` and returns its answer line, or "<no answer: STATUS>".
  std::string Ask(absl::string_view command,
                  absl::Duration timeout = absl::Seconds(120));

 private:
  explicit LocalWorker(Subprocess process) : process_(std::move(process)) {}
  Subprocess process_;
};

// VmSize of process `pid` in bytes (0 if it cannot be read).
uint64_t VmSizeBytes(pid_t pid);
// How many fds process `pid` has open (-1 if it cannot be read).
int OpenFdCount(pid_t pid);
// Occurrences of `needle` in `text`.
size_t CountOf(absl::string_view text, absl::string_view needle);

// Starts a real agent (memory backend) whose runtime dir other users can
// reach, with `extra_flags`.
absl::StatusOr<std::unique_ptr<AgentProcess>> StartSharedAgent(
    std::vector<std::string> extra_flags = {});

}  // namespace rdma_agent::testing

#endif  // RDMA_AGENTD_TESTS_SECURITY_LOCAL_HARNESS_H_

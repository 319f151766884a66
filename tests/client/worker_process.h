#ifndef RDMA_AGENTD_TESTS_CLIENT_WORKER_PROCESS_H_
#define RDMA_AGENTD_TESTS_CLIENT_WORKER_PROCESS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/process.h"

namespace rdma_agent::testing {

// A client_worker process (see client_worker.cc for its commands) connected
// to `agent`, optionally running as another user.
class WorkerProcess {
 public:
  struct Options {
    int uid = -1;  // drop to this uid/gid first (needs root); -1: stay
    int gid = -1;
  };
  static absl::StatusOr<WorkerProcess> Start(const AgentProcess& agent,
                                             Options options);
  static absl::StatusOr<WorkerProcess> Start(const AgentProcess& agent) {
    return Start(agent, Options());
  }
  // For any agent (e.g. one in the test's own process): its gRPC target and
  // attach socket.
  static absl::StatusOr<WorkerProcess> Start(const std::string& target,
                                             const std::string& attach_socket,
                                             Options options);

  // Sends `command`, returns the answer line. Every answer must come within
  // `timeout`.
  absl::StatusOr<std::string> Call(absl::string_view command,
                                   absl::Duration timeout = absl::Seconds(120));
  // The answer, or "<transport error: STATUS>" when none came: for tests
  // that compare answers with EXPECT_EQ.
  std::string Answer(absl::string_view command,
                     absl::Duration timeout = absl::Seconds(120));
  // The answer split at spaces.
  absl::StatusOr<std::vector<std::string>> CallWords(
      absl::string_view command, absl::Duration timeout = absl::Seconds(120));

  Subprocess& process() { return process_; }

 private:
  explicit WorkerProcess(Subprocess process) : process_(std::move(process)) {}
  Subprocess process_;
};

// A registration a worker made, from its "ok ID CONTEXT" answer.
struct WorkerBuffer {
  std::string id;
  std::string context;  // base64
};
absl::StatusOr<WorkerBuffer> ParseRegistered(
    const std::vector<std::string>& words);

}  // namespace rdma_agent::testing

#endif  // RDMA_AGENTD_TESTS_CLIENT_WORKER_PROCESS_H_

#ifndef RDMA_AGENTD_TESTS_CLIENT_AGENT_PROCESS_H_
#define RDMA_AGENTD_TESTS_CLIENT_AGENT_PROCESS_H_

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tests/client/subprocess.h"

namespace rdma_agent::testing {

// A real rdma-agentd process (the //daemon:rdma-agentd runfile) with its own
// short runtime dir under /tmp and only the memory backend. Start returns once
// the agent has logged that it serves both of its sockets. The destructor
// kills it and removes the runtime dir.
class AgentProcess {
 public:
  // `extra_flags` are appended to the daemon's command line; the last
  // occurrence of a flag wins, so e.g. "--backends=memory,tcp" replaces the
  // default.
  static absl::StatusOr<std::unique_ptr<AgentProcess>> Start(
      std::vector<std::string> extra_flags = {},
      absl::Duration timeout = absl::Seconds(30));
  AgentProcess(const AgentProcess&) = delete;
  AgentProcess& operator=(const AgentProcess&) = delete;
  ~AgentProcess();

  // gRPC target of the agent ("unix:///tmp/rac.XXXXXX/agent.sock").
  std::string target() const { return "unix://" + socket_path(); }
  std::string socket_path() const { return runtime_dir_ + "/agent.sock"; }
  std::string attach_socket_path() const {
    return runtime_dir_ + "/attach.sock";
  }
  const std::string& runtime_dir() const { return runtime_dir_; }
  pid_t pid() const { return process_.pid(); }

  // True while the daemon process has not exited.
  bool Running() { return process_.Running(); }
  // SIGTERM, then waits: the daemon's exit code.
  absl::StatusOr<int> Stop(absl::Duration timeout = absl::Seconds(30));
  // The daemon's log so far (stdout and stderr).
  std::string Log() const;

 private:
  AgentProcess(std::string runtime_dir, std::string log_path,
               Subprocess process)
      : runtime_dir_(std::move(runtime_dir)),
        log_path_(std::move(log_path)),
        process_(std::move(process)) {}
  // Copies the daemon's output to the log until it ends.
  void DrainOutput();

  std::string runtime_dir_;
  std::string log_path_;
  Subprocess process_;
  std::thread drain_;
};

}  // namespace rdma_agent::testing

#endif  // RDMA_AGENTD_TESTS_CLIENT_AGENT_PROCESS_H_

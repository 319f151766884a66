#ifndef RDMA_AGENTD_TESTS_TESTING_AGENT_PROCESS_H_
#define RDMA_AGENTD_TESTS_TESTING_AGENT_PROCESS_H_

#include <signal.h>
#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/rdma_agent_client.h"
#include "tests/testing/process.h"

namespace rdma_agent::testing {

// A real rdma-agentd process (the //daemon:rdma-agentd runfile; a test using
// it lists that in `data`) in its own short runtime dir under /tmp,
// optionally inside a network namespace. Start returns once the daemon has
// logged that it serves its sockets and has answered GetInfo on client().
// The destructor kills it (SIGKILL), reaps it and removes the runtime dir.
class AgentProcess {
 public:
  struct Options {
    // --backends (comma list).
    std::string backends = "memory";
    // Non-empty: the daemon runs inside this network namespace
    // (`ip netns exec`; needs root).
    std::string netns;
    // Non-empty: the daemon runs under this command, e.g. {"unshare",
    // "--pid", "--kill-child", "--"} for a pid namespace of its own (needs
    // root). The command must end with the daemon when it is killed.
    std::vector<std::string> wrapper;
    // The Peer service listens on listen_host:0 (--peer_listen), and, with
    // the tcp backend, its data listener on listen_host:tcp_port
    // (--tcp_listen).
    std::string listen_host = "127.0.0.1";
    // --advertise_host; empty: not passed (the daemon picks its address).
    std::string advertise_host;
    // With the tcp backend: its data port; 0: a free one, learnt from
    // GetInfo (tcp_port()) and kept across Restart.
    uint16_t tcp_port = 0;
    // --log_level.
    std::string log_level = "debug";
    // Appended to the command line last: the last occurrence of a flag wins,
    // so these may replace any flag above.
    std::vector<std::string> extra_flags;
    // How long the daemon may take to serve, at Start and at Restart.
    absl::Duration start_timeout = absl::Seconds(30);
  };

  static absl::StatusOr<std::unique_ptr<AgentProcess>> Start(Options options);
  static absl::StatusOr<std::unique_ptr<AgentProcess>> Start() {
    return Start(Options());
  }
  AgentProcess(const AgentProcess&) = delete;
  AgentProcess& operator=(const AgentProcess&) = delete;
  ~AgentProcess();

  // gRPC target of the agent ("unix:///tmp/rat.XXXXXX/agent.sock").
  std::string target() const { return "unix://" + socket_path(); }
  std::string socket_path() const { return runtime_dir_ + "/agent.sock"; }
  std::string attach_socket_path() const {
    return runtime_dir_ + "/attach.sock";
  }
  const std::string& runtime_dir() const { return runtime_dir_; }
  // --state_dir: <runtime_dir>/state (the agent id, kept across Restart).
  std::string state_dir() const { return runtime_dir_ + "/state"; }
  pid_t pid() const { return process_ ? process_->pid() : -1; }
  // The tcp backend's data port (0 without the tcp backend).
  uint16_t tcp_port() const { return options_.tcp_port; }

  // A client connected by Start (and again by Restart); not to be used after
  // Kill or Stop.
  client::AgentClient& client() { return *client_; }
  // A new, separate client connection.
  absl::StatusOr<std::unique_ptr<client::AgentClient>> NewClient() const;

  // True while the daemon process has not exited.
  bool Running() { return process_ && process_->Running(); }
  // Drops client(), sends `signal` and waits: the daemon's exit code (or
  // 128+signal if the signal killed it).
  absl::StatusOr<int> Stop(int signal, absl::Duration timeout);
  absl::StatusOr<int> Stop() { return Stop(SIGTERM, absl::Seconds(30)); }
  // Drops client(), then SIGKILL and reap; the runtime dir stays for
  // Restart.
  void Kill();
  // Holds the daemon with SIGSTOP (its kernel still accepts connections; it
  // answers nothing) until Resume (SIGCONT); idempotent both ways. Stop,
  // Kill, Restart and the destructor work on a held daemon.
  void Hold();
  void Resume();
  bool held() const { return held_; }
  // Kills the daemon if it runs and starts it again with the same options in
  // the same runtime dir (same agent id, new epoch) and on the same tcp data
  // port; client() is connected anew.
  absl::Status Restart();

  // The daemon's output so far (stdout and stderr, every run), also kept in
  // TEST_UNDECLARED_OUTPUTS_DIR when set.
  std::string Log() const;

 private:
  AgentProcess(Options options, std::string runtime_dir, std::string log_path);
  // Spawns the daemon and waits until it serves and answers GetInfo.
  absl::Status Launch();
  // Copies the daemon's output to the log until it ends.
  void DrainOutput();
  // Waits for the daemon to end and for DrainOutput to finish.
  void Reap();

  Options options_;
  const std::string runtime_dir_;
  const std::string log_path_;
  std::optional<Subprocess> process_;  // empty until the first Launch
  bool held_ = false;                  // SIGSTOPped by Hold
  std::thread drain_;
  std::unique_ptr<client::AgentClient> client_;
};

// An rdma-agentd with the memory and tcp backends, listening on and
// advertising `host`, inside `netns` unless empty, with `extra_flags`; it
// logs at info level (debug would log every chunk of large transfers).
AgentProcess::Options TcpAgentOptions(
    const std::string& host = "127.0.0.1", const std::string& netns = "",
    std::vector<std::string> extra_flags = {});

}  // namespace rdma_agent::testing

#endif  // RDMA_AGENTD_TESTS_TESTING_AGENT_PROCESS_H_

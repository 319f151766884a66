#ifndef RDMA_AGENTD_TESTS_INTEGRATION_TCP_NETNS_H_
#define RDMA_AGENTD_TESTS_INTEGRATION_TCP_NETNS_H_

// Harness for cross-host tests of the TCP backend: "hosts" are network
// namespaces joined by a veth pair, each running its own rdma-agentd process.
// Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and the `ip` tool.

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/rdma_agent_client.h"

namespace rdma_agent::testing {

namespace v1 = ::rdma::agent::v1;

// OK when this process can create namespaces (euid 0 and `ip` works);
// otherwise a FAILED_PRECONDITION saying why, for the test to fail loudly.
absl::Status CheckNetnsPrivileges();

// Runs `argv` (no shell) to completion within `timeout`; INTERNAL with its
// output if it exits non-zero.
absl::StatusOr<std::string> RunCommand(const std::vector<std::string>& argv,
                                       absl::Duration timeout = absl::Seconds(20));

// Two namespaces joined by a veth pair: side 0 has 10.77.0.1/24, side 1
// 10.77.0.2/24 (addresses are per namespace, so concurrent pairs never
// clash); names embed the pid and a counter so they never collide. The
// destructor deletes both namespaces (and with them the veth pair). Create
// first deletes pairs left behind by test processes that no longer exist.
class NetnsPair {
 public:
  static absl::StatusOr<std::unique_ptr<NetnsPair>> Create();
  ~NetnsPair();
  NetnsPair(const NetnsPair&) = delete;
  NetnsPair& operator=(const NetnsPair&) = delete;

  const std::string& netns(int side) const { return netns_[side]; }
  const std::string& address(int side) const { return address_[side]; }
  const std::string& link(int side) const { return link_[side]; }
  // Sets side's veth end up or down (from inside its namespace).
  absl::Status SetLink(int side, bool up);
  // Makes `side` know the other side's MAC for good (a permanent neighbour
  // entry), so that when the other side goes silent, packets to it vanish
  // instead of failing neighbour resolution (EHOSTUNREACH): the peer "stops
  // answering" rather than becoming "unreachable".
  absl::Status PinNeighbour(int side);

 private:
  NetnsPair() = default;
  std::string netns_[2];
  std::string address_[2];
  std::string link_[2];
  bool created_[2] = {false, false};
};

// One rdma-agentd process (the //daemon:rdma-agentd runfile) with the memory
// and tcp backends, optionally inside a namespace, in its own runtime dir.
// Start returns once the agent answers GetInfo. The destructor kills it
// (SIGKILL), reaps it and removes the runtime dir.
class TcpAgentProcess {
 public:
  struct Options {
    std::string netns;  // empty: this process's namespace
    std::string host = "127.0.0.1";  // listen and advertise address
    uint16_t tcp_port = 0;           // 0: pick a free one
    std::vector<std::string> extra_flags;
  };
  static absl::StatusOr<std::unique_ptr<TcpAgentProcess>> Start(
      Options options);
  ~TcpAgentProcess();
  TcpAgentProcess(const TcpAgentProcess&) = delete;
  TcpAgentProcess& operator=(const TcpAgentProcess&) = delete;

  // SIGKILL and reap; the runtime dir stays for Restart.
  void Kill();
  // Starts the daemon again in the same runtime dir (same agent id, new
  // epoch) on the same data port; a new client is connected.
  absl::Status Restart();

  pid_t pid() const { return pid_; }
  uint16_t tcp_port() const { return options_.tcp_port; }
  std::string target() const { return "unix://" + runtime_dir_ + "/agent.sock"; }
  // A client connected to this agent (reconnected by Restart).
  client::AgentClient& client() { return *client_; }
  // A new, separate client connection.
  absl::StatusOr<std::unique_ptr<client::AgentClient>> NewClient() const;
  // The daemon's output so far.
  std::string Log() const;

 private:
  TcpAgentProcess(Options options, std::string runtime_dir)
      : options_(std::move(options)), runtime_dir_(std::move(runtime_dir)) {}
  absl::Status Launch();

  Options options_;
  std::string runtime_dir_;
  pid_t pid_ = -1;
  std::unique_ptr<client::AgentClient> client_;
};

// Fills `size` bytes with a pattern determined by (seed, absolute position),
// so any range can be checked without keeping a copy.
void FillPattern(std::byte* data, uint64_t size, uint64_t start, uint8_t seed);
// Index (relative to data) of the first byte that differs from the pattern,
// or -1 when all match.
int64_t FindPatternMismatch(const std::byte* data, uint64_t size,
                            uint64_t start, uint8_t seed);

}  // namespace rdma_agent::testing

#endif  // RDMA_AGENTD_TESTS_INTEGRATION_TCP_NETNS_H_

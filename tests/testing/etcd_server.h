#ifndef RDMA_AGENTD_TESTS_TESTING_ETCD_SERVER_H_
#define RDMA_AGENTD_TESTS_TESTING_ETCD_SERVER_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/directory/etcd_client.h"
#include "tests/testing/process.h"
#include "tests/testing/temp_dir.h"

namespace rdma_agent::testing {

// A real etcd server (Debian's etcd-server) on loopback, one member, its
// data in a temporary directory: what the directory tests publish into.
class EtcdServer {
 public:
  // Starts etcd on free ports and waits until it answers.
  static absl::StatusOr<std::unique_ptr<EtcdServer>> Start();
  ~EtcdServer();

  // "127.0.0.1:port" of the client listener.
  const std::string& endpoint() const { return endpoint_; }
  // The agent's --directory value for this server.
  std::string directory() const { return "etcd://" + endpoint_; }

  // SIGKILL; the data directory stays for Restart.
  void Kill();
  // Starts it again on the same ports and data, and waits until it answers.
  absl::Status Restart();

  // etcdctl (v3 API) against this server; its stdout, or an error with its
  // output when it fails.
  absl::StatusOr<std::string> Etcdctl(std::vector<std::string> args);

  // A client of this server, as the agent's directory uses.
  EtcdClient& client() { return *client_; }

 private:
  EtcdServer() = default;
  absl::Status Launch();

  std::optional<TempDir> dir_;
  std::string endpoint_;
  std::string peer_endpoint_;
  std::optional<Subprocess> process_;
  std::unique_ptr<EtcdClient> client_;
};

// A TCP port on 127.0.0.1 that nothing listened on a moment ago.
absl::StatusOr<uint16_t> FreeLoopbackPort();

}  // namespace rdma_agent::testing

#endif  // RDMA_AGENTD_TESTS_TESTING_ETCD_SERVER_H_

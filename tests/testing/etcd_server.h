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

// A real etcd server (Debian's etcd-server) on loopback (or an address of a
// network namespace), one member, its data in a temporary directory: what
// the directory tests publish into.
class EtcdServer {
 public:
  struct Options {
    // TLS with client certificates required: PEM paths of the server's
    // certificate (also used by etcdctl and client() as their client
    // certificate, so it must allow client use) and key, and the CA both
    // sides' certificates chain to. Empty: plain HTTP.
    std::string cert_file;
    std::string key_file;
    std::string ca_file;
    // More etcd flags (e.g. --auth-token-ttl=1).
    std::vector<std::string> extra_flags;
    // Non-empty: etcd (and etcdctl) run inside this network namespace,
    // listening on `host` there; client() then cannot reach it.
    std::string netns;
    std::string host = "127.0.0.1";
  };

  // Starts etcd on free ports and waits until it answers.
  static absl::StatusOr<std::unique_ptr<EtcdServer>> Start(Options options);
  static absl::StatusOr<std::unique_ptr<EtcdServer>> Start() {
    return Start(Options());
  }
  ~EtcdServer();

  // "host:port" of the client listener.
  const std::string& endpoint() const { return endpoint_; }
  // The agent's --directory value for this server.
  std::string directory() const { return "etcd://" + endpoint_; }

  // SIGKILL; the data directory stays for Restart.
  void Kill();
  // Starts it again on the same ports and data, and waits until it answers.
  absl::Status Restart();

  // etcdctl (v3 API) against this server (with the TLS material, and as
  // `etcdctl_user` once set: "name:password"); its stdout, or an error with
  // its output when it fails.
  absl::StatusOr<std::string> Etcdctl(std::vector<std::string> args);
  void set_etcdctl_user(std::string user) { etcdctl_user_ = std::move(user); }

  // A client of this server, as the agent's directory uses.
  EtcdClient& client() { return *client_; }

 private:
  explicit EtcdServer(Options options) : options_(std::move(options)) {}
  absl::Status Launch();
  std::string scheme() const {
    return options_.ca_file.empty() ? "http://" : "https://";
  }

  const Options options_;
  std::string etcdctl_user_;
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

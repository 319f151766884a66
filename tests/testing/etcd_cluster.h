#ifndef RDMA_AGENTD_TESTS_TESTING_ETCD_CLUSTER_H_
#define RDMA_AGENTD_TESTS_TESTING_ETCD_CLUSTER_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tests/testing/process.h"
#include "tests/testing/temp_dir.h"

namespace rdma_agent::testing {

// Real etcd servers (Debian's etcd-server) forming one cluster, each member
// a process with its own data directory, on loopback ports or alone in a
// network namespace ("host") on that namespace's address: what the
// directory's fault tests kill members of. Elections are quick
// (--heartbeat-interval=50, --election-timeout=500: loopback or veth
// latency).
class EtcdCluster {
 public:
  // Where one member runs.
  struct Host {
    // Empty: this process's namespace, on free ports of `address`; else
    // inside this namespace (`ip netns exec`; needs root), on etcd's own
    // ports (2379 client, 2380 peer) of `address` there.
    std::string netns;
    std::string address = "127.0.0.1";
  };

  // Starts one member per host and waits until the cluster answers.
  static absl::StatusOr<std::unique_ptr<EtcdCluster>> Start(
      std::vector<Host> hosts);
  // `members` members on loopback.
  static absl::StatusOr<std::unique_ptr<EtcdCluster>> Start(int members) {
    return Start(std::vector<Host>(members));
  }
  ~EtcdCluster();
  EtcdCluster(const EtcdCluster&) = delete;
  EtcdCluster& operator=(const EtcdCluster&) = delete;

  int size() const { return static_cast<int>(members_.size()); }
  // "address:port" of member `i`'s client listener.
  const std::string& endpoint(int i) const { return members_[i].endpoint; }
  // The agent's --directory value listing the members in `order` (every
  // member, from the first, when empty).
  std::string directory(std::vector<int> order = {}) const;
  // The member that leads now; NOT_FOUND while none does.
  absl::StatusOr<int> Leader();
  // SIGKILL to member `i`.
  void Kill(int i);
  // etcdctl (v3 API) against the members still running, run where the first
  // of them runs (so it reaches them all while their links are up); its
  // stdout.
  absl::StatusOr<std::string> Etcdctl(std::vector<std::string> args);

 private:
  struct Member {
    std::string name;
    std::string netns;
    std::string endpoint;
    std::string peer_endpoint;
    std::optional<Subprocess> process;
  };
  EtcdCluster() = default;

  std::optional<TempDir> dir_;
  std::vector<Member> members_;
};

}  // namespace rdma_agent::testing

#endif  // RDMA_AGENTD_TESTS_TESTING_ETCD_CLUSTER_H_

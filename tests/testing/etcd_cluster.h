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

// Real etcd servers (Debian's etcd-server) forming one cluster on loopback,
// each member a process with its own ports and data directory: what the
// directory's fault tests kill members of. Elections are quick
// (--heartbeat-interval=50, --election-timeout=500: loopback latency).
class EtcdCluster {
 public:
  // Starts `members` members and waits until every one answers.
  static absl::StatusOr<std::unique_ptr<EtcdCluster>> Start(int members);
  ~EtcdCluster();
  EtcdCluster(const EtcdCluster&) = delete;
  EtcdCluster& operator=(const EtcdCluster&) = delete;

  int size() const { return static_cast<int>(members_.size()); }
  // "127.0.0.1:port" of member `i`'s client listener.
  const std::string& endpoint(int i) const { return members_[i].endpoint; }
  // The agent's --directory value listing the members in `order` (every
  // member, from the first, when empty).
  std::string directory(std::vector<int> order = {}) const;
  // The member that leads now; NOT_FOUND while none does.
  absl::StatusOr<int> Leader();
  // SIGKILL to member `i`.
  void Kill(int i);
  // etcdctl (v3 API) against the members still running; its stdout.
  absl::StatusOr<std::string> Etcdctl(std::vector<std::string> args);

 private:
  struct Member {
    std::string name;
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

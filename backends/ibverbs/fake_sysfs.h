#ifndef RDMA_AGENTD_BACKENDS_IBVERBS_FAKE_SYSFS_H_
#define RDMA_AGENTD_BACKENDS_IBVERBS_FAKE_SYSFS_H_

// Test-only: a sysfs tree of plain files describing a NUMA host, for
// NumaTopology::Load and the backend's --ibverbs_sysfs_root.

#include <map>
#include <string>
#include <vector>

namespace rdma_agent::ibverbs::testing {

struct FakeHost {
  // distances[i][j]: from node i to node j; one node per row.
  std::vector<std::vector<int>> distances;
  // RDMA device name -> its node (-1 is written as sysfs writes it).
  std::map<std::string, int> rdma_devices;
  // PCI address -> its node.
  std::map<std::string, int> pci_devices;
};

// Writes `host` under a fresh directory of $TEST_TMPDIR (named after
// `name`) and returns that root.
std::string WriteFakeSysfs(const std::string& name, const FakeHost& host);

// The distances of a host with `nodes` nodes: 10 to itself, `remote` to
// every other one.
std::vector<std::vector<int>> UniformDistances(int nodes, int remote);

}  // namespace rdma_agent::ibverbs::testing

#endif  // RDMA_AGENTD_BACKENDS_IBVERBS_FAKE_SYSFS_H_

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
  // Where PCI devices sit in the PCI tree, as on a host: PCI address -> its
  // directory below devices/, from the root complex down, e.g.
  // "pci0000:3a/0000:3a:00.0/0000:3b:00.0/0000:3c:08.0/0000:3d:00.0". The
  // directory is made (with the device's numa_node, from pci_devices or the
  // RDMA device naming it) and bus/pci/devices/<address> links to it.
  std::map<std::string, std::string> pci_paths;
  // RDMA device name -> the PCI address of its function, one of pci_paths:
  // class/infiniband/<name>/device then links to that directory.
  std::map<std::string, std::string> rdma_pci;
};

// Writes `host` under a fresh directory of $TEST_TMPDIR (named after
// `name`) and returns that root.
std::string WriteFakeSysfs(const std::string& name, const FakeHost& host);

// The distances of a host with `nodes` nodes: 10 to itself, `remote` to
// every other one.
std::vector<std::vector<int>> UniformDistances(int nodes, int remote);

}  // namespace rdma_agent::ibverbs::testing

#endif  // RDMA_AGENTD_BACKENDS_IBVERBS_FAKE_SYSFS_H_

#ifndef RDMA_AGENTD_BACKENDS_IBVERBS_NUMA_TOPOLOGY_H_
#define RDMA_AGENTD_BACKENDS_IBVERBS_NUMA_TOPOLOGY_H_

// Where things sit on a NUMA host, as sysfs tells: the nodes and the
// distances between them (the firmware's SLIT: 10 local, larger is
// farther), the node of each RDMA device and of any PCI device, and where
// devices sit in the PCI tree (which NICs share a GPU's PCIe switch). The
// ibverbs backend pairs rails with memory by it (README.md, "Affinity").
//
// Nothing here fails: a file that is missing or unreadable (no NUMA, a
// container without /sys, a virtual device) makes the answer unknown (-1),
// and the caller then treats every choice as equally near. The root is
// injectable ("/sys" on a host) so that a test can describe any host with a
// tree of plain files.

#include <map>
#include <string>
#include <vector>

#include "absl/types/span.h"

namespace rdma_agent::ibverbs {

class NumaTopology {
 public:
  // Reads <sysfs_root>/devices/system/node/node*/distance. Devices' nodes
  // are read when asked for.
  static NumaTopology Load(std::string sysfs_root = "/sys");

  // The sysfs root it reads.
  const std::string& sysfs_root() const { return root_; }
  // NUMA nodes found, ascending; empty when sysfs says nothing.
  const std::vector<int>& nodes() const { return nodes_; }
  // Distance from node `from` to node `to` (10 for a node to itself on
  // ordinary firmware); -1 when either node or the distance is unknown.
  int Distance(int from, int to) const;

  // Node of RDMA device `device` (<root>/class/infiniband/<device>/device/
  // numa_node); -1 when unknown.
  int RdmaDeviceNode(const std::string& device) const;
  // Node of PCI device `bdf`, e.g. "0000:3b:00.0" (<root>/bus/pci/devices/
  // <bdf>/numa_node), such as a GPU whose memory is registered; -1 when
  // unknown.
  int PciDeviceNode(const std::string& bdf) const;

  // Where a device sits in the PCI tree: the components of its sysfs
  // directory's resolved path from its root complex down, e.g. {"pci0000:3a",
  // "0000:3a:00.0" (root port), "0000:3b:00.0" (switch upstream port),
  // "0000:3c:08.0" (downstream port), "0000:3d:00.0" (the device)}. Empty
  // when unknown (no such entry, or a device on no PCI bus).
  using PciPath = std::vector<std::string>;
  // Of RDMA device `device` (<root>/class/infiniband/<device>/device).
  PciPath RdmaDevicePciPath(const std::string& device) const;
  // Of PCI device `bdf` (<root>/bus/pci/devices/<bdf>).
  PciPath PciDevicePciPath(const std::string& bdf) const;

 private:
  std::string root_;
  std::vector<int> nodes_;
  // distance_[from][to], for the nodes whose distance file was read.
  std::map<int, std::map<int, int>> distance_;
};

// Which rails are nearest to memory on `memory_node`, given each rail's node
// (`rail_nodes`, -1 unknown): those at the smallest distance, plus every
// rail whose distance cannot be told (it is never left out on a guess).
// Every rail when `memory_node` is unknown, or when no rail's distance is
// known.
std::vector<bool> NearestRails(const NumaTopology& topology, int memory_node,
                               absl::Span<const int> rail_nodes);

// Of `candidates` (by rail; what NearestRails chose), those whose NICs are
// nearest `device` in the PCI tree: the rails whose path (`rail_paths`)
// shares the longest prefix with `device`'s, when that prefix goes below
// the root complex (a root port, hence a PCIe switch, in common: peer-to-
// peer traffic then stays off the CPU's host bridge). Rails whose path is
// unknown stay in (never left out on a guess). `candidates` as they are
// when `device`'s path is unknown or no candidate shares more than the root
// complex with it. `*on_switch` (when given) says whether the rails kept
// share a switch with `device`.
std::vector<bool> NearestInPciTree(
    const NumaTopology::PciPath& device,
    absl::Span<const NumaTopology::PciPath> rail_paths,
    std::vector<bool> candidates, bool* on_switch = nullptr);

}  // namespace rdma_agent::ibverbs

#endif  // RDMA_AGENTD_BACKENDS_IBVERBS_NUMA_TOPOLOGY_H_

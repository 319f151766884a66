// NumaTopology over fake sysfs trees: nodes, distances, devices' nodes, and
// what is unknown when files are missing; NearestRails' choice; devices'
// places in the PCI tree and NearestInPciTree's choice.
#include "backends/ibverbs/numa_topology.h"

#include <filesystem>
#include <fstream>

#include "backends/ibverbs/fake_sysfs.h"
#include "gtest/gtest.h"

namespace rdma_agent::ibverbs {
namespace {

using testing::FakeHost;
using testing::UniformDistances;
using testing::WriteFakeSysfs;

TEST(NumaTopologyTest, ReadsNodesDistancesAndDeviceNodes) {
  FakeHost host;
  host.distances = {{10, 21, 31}, {21, 10, 21}, {31, 21, 10}};
  host.rdma_devices = {{"mlx5_0", 0}, {"mlx5_1", 2}, {"virt0", -1}};
  host.pci_devices = {{"0000:3b:00.0", 1}};
  const NumaTopology topology =
      NumaTopology::Load(WriteFakeSysfs("three_nodes", host));
  EXPECT_EQ(topology.nodes(), std::vector<int>({0, 1, 2}));
  EXPECT_EQ(topology.Distance(0, 0), 10);
  EXPECT_EQ(topology.Distance(0, 2), 31);
  EXPECT_EQ(topology.Distance(2, 1), 21);
  EXPECT_EQ(topology.Distance(1, 2), 21);
  EXPECT_EQ(topology.Distance(0, 3), -1);
  EXPECT_EQ(topology.Distance(-1, 0), -1);
  EXPECT_EQ(topology.RdmaDeviceNode("mlx5_0"), 0);
  EXPECT_EQ(topology.RdmaDeviceNode("mlx5_1"), 2);
  EXPECT_EQ(topology.RdmaDeviceNode("virt0"), -1);
  EXPECT_EQ(topology.RdmaDeviceNode("mlx5_9"), -1);
  EXPECT_EQ(topology.PciDeviceNode("0000:3b:00.0"), 1);
  EXPECT_EQ(topology.PciDeviceNode("0000:af:00.0"), -1);
  // Names are one path component: nothing outside the tree is read.
  EXPECT_EQ(topology.RdmaDeviceNode("../infiniband/mlx5_0"), -1);
  EXPECT_EQ(topology.PciDeviceNode(".."), -1);
}

TEST(NumaTopologyTest, MissingOrMalformedFilesAreUnknown) {
  const NumaTopology empty = NumaTopology::Load("/nonexistent/sys");
  EXPECT_TRUE(empty.nodes().empty());
  EXPECT_EQ(empty.Distance(0, 0), -1);
  EXPECT_EQ(empty.RdmaDeviceNode("mlx5_0"), -1);

  FakeHost host;
  host.distances = {{10, 21}, {21, 10}};
  host.rdma_devices = {{"mlx5_0", 1}};
  const std::string root = WriteFakeSysfs("malformed", host);
  // A row with the wrong number of entries and a garbled numa_node.
  std::ofstream(root + "/devices/system/node/node1/distance") << "21\n";
  std::ofstream(root + "/class/infiniband/mlx5_0/device/numa_node") << "x\n";
  const NumaTopology topology = NumaTopology::Load(root);
  EXPECT_EQ(topology.nodes(), std::vector<int>({0, 1}));
  EXPECT_EQ(topology.Distance(0, 1), 21);
  EXPECT_EQ(topology.Distance(1, 0), -1);
  EXPECT_EQ(topology.RdmaDeviceNode("mlx5_0"), -1);
}

TEST(NumaTopologyTest, NearestRailsAreAtTheSmallestDistance) {
  FakeHost host;
  host.distances = {{10, 21, 31}, {21, 10, 21}, {31, 21, 10}};
  const NumaTopology topology =
      NumaTopology::Load(WriteFakeSysfs("nearest", host));
  const std::vector<int> rails = {0, 0, 1, 2};
  EXPECT_EQ(NearestRails(topology, 0, rails),
            std::vector<bool>({true, true, false, false}));
  EXPECT_EQ(NearestRails(topology, 2, rails),
            std::vector<bool>({false, false, false, true}));
  // No rail on the buffer's node: the next nearest.
  EXPECT_EQ(NearestRails(topology, 1, {0, 2, 0}),
            std::vector<bool>({true, true, true}));
  EXPECT_EQ(NearestRails(topology, 0, {1, 2}),
            std::vector<bool>({true, false}));
  // A rail whose node is unknown is never left out on a guess.
  EXPECT_EQ(NearestRails(topology, 0, {-1, 0, 2}),
            std::vector<bool>({true, true, false}));
  // Memory on an unknown node, or nothing known of the rails: all near.
  EXPECT_EQ(NearestRails(topology, -1, rails),
            std::vector<bool>({true, true, true, true}));
  EXPECT_EQ(NearestRails(topology, 0, {-1, -1}),
            std::vector<bool>({true, true}));
  // No distances at all (no NUMA in sysfs): all near.
  EXPECT_EQ(NearestRails(NumaTopology::Load("/nonexistent"), 0, rails),
            std::vector<bool>({true, true, true, true}));
}

// One root complex with a GPU and NICs n0, n1 under one PCIe switch, NIC
// n2 under another root port of the same root complex, n3 under another
// root complex.
FakeHost PciHost() {
  FakeHost host;
  host.distances = UniformDistances(1, 21);
  host.pci_paths = {
      {"0000:3d:00.0",
       "pci0000:3a/0000:3a:00.0/0000:3b:00.0/0000:3c:08.0/"
       "0000:3d:00.0"},  // the GPU
      {"0000:3e:00.0",
       "pci0000:3a/0000:3a:00.0/0000:3b:00.0/0000:3c:10.0/"
       "0000:3e:00.0"},
      {"0000:3f:00.0",
       "pci0000:3a/0000:3a:00.0/0000:3b:00.0/0000:3c:14.0/"
       "0000:3f:00.0"},
      {"0000:41:00.0", "pci0000:3a/0000:3a:02.0/0000:41:00.0"},
      {"0000:5e:00.0", "pci0000:5d/0000:5d:00.0/0000:5e:00.0"},
  };
  host.rdma_pci = {{"n0", "0000:3e:00.0"},
                   {"n1", "0000:3f:00.0"},
                   {"n2", "0000:41:00.0"},
                   {"n3", "0000:5e:00.0"}};
  host.rdma_devices = {{"n0", 0}, {"n1", 0}, {"n2", 0}, {"n3", 0}};
  host.pci_devices = {{"0000:3d:00.0", 0}};
  return host;
}

TEST(NumaTopologyTest, ReadsWhereDevicesSitInThePciTree) {
  const NumaTopology topology =
      NumaTopology::Load(WriteFakeSysfs("pci_tree", PciHost()));
  using Path = NumaTopology::PciPath;
  EXPECT_EQ(topology.PciDevicePciPath("0000:3d:00.0"),
            Path({"pci0000:3a", "0000:3a:00.0", "0000:3b:00.0", "0000:3c:08.0",
                  "0000:3d:00.0"}));
  EXPECT_EQ(topology.RdmaDevicePciPath("n2"),
            Path({"pci0000:3a", "0000:3a:02.0", "0000:41:00.0"}));
  // Through the links, as on a host.
  EXPECT_EQ(topology.RdmaDeviceNode("n3"), 0);
  EXPECT_EQ(topology.PciDeviceNode("0000:3d:00.0"), 0);
  EXPECT_EQ(topology.PciDevicePciPath("0000:af:00.0"), Path());
  EXPECT_EQ(topology.RdmaDevicePciPath("n9"), Path());
  EXPECT_EQ(topology.PciDevicePciPath(".."), Path());
  EXPECT_EQ(topology.RdmaDevicePciPath("../../bus"), Path());
  // An entry under no root complex (a plain directory) has no path.
  FakeHost flat;
  flat.rdma_devices = {{"v0", 0}};
  EXPECT_EQ(NumaTopology::Load(WriteFakeSysfs("pci_flat", flat))
                .RdmaDevicePciPath("v0"),
            Path());
}

TEST(NumaTopologyTest, NearestInPciTreeKeepsTheNicsUnderTheDevicesSwitch) {
  const NumaTopology topology =
      NumaTopology::Load(WriteFakeSysfs("pci_nearest", PciHost()));
  const NumaTopology::PciPath gpu = topology.PciDevicePciPath("0000:3d:00.0");
  std::vector<NumaTopology::PciPath> rails;
  for (const char* nic : {"n0", "n1", "n2", "n3"}) {
    rails.push_back(topology.RdmaDevicePciPath(nic));
  }
  const std::vector<bool> all(4, true);
  bool on_switch = false;
  EXPECT_EQ(NearestInPciTree(gpu, rails, all, &on_switch),
            std::vector<bool>({true, true, false, false}));
  EXPECT_TRUE(on_switch);
  // Only among the candidates (NUMA's choice).
  EXPECT_EQ(NearestInPciTree(gpu, rails, {false, true, true, true}),
            std::vector<bool>({false, true, false, false}));
  // Sharing the root complex only is no switch: candidates as they were.
  EXPECT_EQ(
      NearestInPciTree(gpu, rails, {false, false, true, true}, &on_switch),
      std::vector<bool>({false, false, true, true}));
  EXPECT_FALSE(on_switch);
  // A rail whose place is unknown is never left out on a guess.
  rails[3].clear();
  EXPECT_EQ(NearestInPciTree(gpu, rails, all),
            std::vector<bool>({true, true, false, true}));
  // The device's place unknown: candidates as they were.
  EXPECT_EQ(NearestInPciTree({}, rails, {true, false, true, true}),
            std::vector<bool>({true, false, true, true}));
}

TEST(NumaTopologyTest, UniformDistancesDescribeATwoSocketHost) {
  FakeHost host;
  host.distances = UniformDistances(2, 21);
  host.rdma_devices = {{"n0", 0}, {"n1", 1}};
  const NumaTopology topology =
      NumaTopology::Load(WriteFakeSysfs("two_sockets", host));
  EXPECT_EQ(topology.Distance(1, 0), 21);
  EXPECT_EQ(topology.Distance(1, 1), 10);
  EXPECT_EQ(NearestRails(
                topology, 1,
                {topology.RdmaDeviceNode("n0"), topology.RdmaDeviceNode("n1")}),
            std::vector<bool>({false, true}));
}

}  // namespace
}  // namespace rdma_agent::ibverbs

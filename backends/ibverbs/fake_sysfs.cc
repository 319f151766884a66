#include "backends/ibverbs/fake_sysfs.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace rdma_agent::ibverbs::testing {
namespace {

void WriteFile(const std::filesystem::path& path, const std::string& text) {
  std::filesystem::create_directories(path.parent_path());
  std::ofstream(path) << text << "\n";
}

}  // namespace

std::string WriteFakeSysfs(const std::string& name, const FakeHost& host) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::filesystem::path root =
      std::filesystem::path(tmp != nullptr ? tmp : "/tmp") / name / "sys";
  std::filesystem::remove_all(root);
  for (size_t i = 0; i < host.distances.size(); ++i) {
    WriteFile(
        root / "devices/system/node" / absl::StrCat("node", i) / "distance",
        absl::StrJoin(host.distances[i], " "));
  }
  // Devices in the PCI tree: real directories, linked to as sysfs does
  // (relative links, so that the tree can be resolved wherever it is).
  for (const auto& [bdf, path] : host.pci_paths) {
    const std::filesystem::path directory = root / "devices" / path;
    std::filesystem::create_directories(directory);
    const std::filesystem::path link = root / "bus/pci/devices" / bdf;
    std::filesystem::create_directories(link.parent_path());
    std::filesystem::create_directory_symlink(
        std::filesystem::relative(directory, link.parent_path()), link);
  }
  for (const auto& [device, bdf] : host.rdma_pci) {
    const std::filesystem::path link = root / "class/infiniband" / device;
    std::filesystem::create_directories(link);
    std::filesystem::create_directory_symlink(
        std::filesystem::relative(root / "bus/pci/devices" / bdf, link),
        link / "device");
  }
  // numa_node files, through the links where there are links.
  for (const auto& [device, node] : host.rdma_devices) {
    WriteFile(root / "class/infiniband" / device / "device/numa_node",
              absl::StrCat(node));
  }
  for (const auto& [bdf, node] : host.pci_devices) {
    WriteFile(root / "bus/pci/devices" / bdf / "numa_node", absl::StrCat(node));
  }
  return root.string();
}

std::vector<std::vector<int>> UniformDistances(int nodes, int remote) {
  std::vector<std::vector<int>> distances(nodes, std::vector<int>(nodes));
  for (int i = 0; i < nodes; ++i) {
    for (int j = 0; j < nodes; ++j) distances[i][j] = i == j ? 10 : remote;
  }
  return distances;
}

}  // namespace rdma_agent::ibverbs::testing

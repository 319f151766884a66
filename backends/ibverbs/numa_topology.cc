#include "backends/ibverbs/numa_topology.h"

#include <dirent.h>
#include <stdlib.h>

#include <algorithm>
#include <fstream>
#include <limits>
#include <memory>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace rdma_agent::ibverbs {
namespace {

// The first line of `path`; empty when it cannot be read.
std::string FirstLine(const std::string& path) {
  std::ifstream file(path);
  std::string line;
  if (file) std::getline(file, line);
  return line;
}

// An integer file such as numa_node; -1 when missing or malformed (sysfs
// itself says -1 for a device without a node).
int ReadNode(const std::string& path) {
  int node = -1;
  if (!absl::SimpleAtoi(FirstLine(path), &node) || node < 0) return -1;
  return node;
}

// A name that is one path component: device names and bus addresses come
// from outside, and must not walk the tree.
bool IsPlainName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." &&
         name.find('/') == std::string::npos;
}

// Nodes listed as "node<N>" directories under `dir`, ascending.
std::vector<int> ListNodes(const std::string& dir) {
  std::vector<int> nodes;
  std::unique_ptr<DIR, int (*)(DIR*)> handle(opendir(dir.c_str()), closedir);
  if (handle == nullptr) return nodes;
  while (const dirent* entry = readdir(handle.get())) {
    const std::string name = entry->d_name;
    int node = -1;
    if (absl::StartsWith(name, "node") &&
        absl::SimpleAtoi(name.substr(4), &node) && node >= 0) {
      nodes.push_back(node);
    }
  }
  std::sort(nodes.begin(), nodes.end());
  return nodes;
}

// The PCI path of the device whose sysfs entry (a symlink on a host) is
// `entry`: its resolved path's components from the root complex's
// ("pci<domain>:<bus>") down; empty when it does not resolve or is under no
// root complex.
NumaTopology::PciPath ResolvePciPath(const std::string& entry) {
  std::unique_ptr<char, void (*)(void*)> resolved(
      ::realpath(entry.c_str(), nullptr), ::free);
  if (resolved == nullptr) return {};
  std::vector<std::string> components =
      absl::StrSplit(resolved.get(), '/', absl::SkipEmpty());
  auto root = std::find_if(
      components.begin(), components.end(), [](const std::string& name) {
        return absl::StartsWith(name, "pci") && name.find(':') != name.npos;
      });
  if (root == components.end()) return {};
  return NumaTopology::PciPath(root, components.end());
}

}  // namespace

NumaTopology NumaTopology::Load(std::string sysfs_root) {
  NumaTopology topology;
  topology.root_ = std::move(sysfs_root);
  const std::string dir = topology.root_ + "/devices/system/node";
  topology.nodes_ = ListNodes(dir);
  // Each node's distance file lists its distance to every node, in the
  // order of the node numbers.
  for (int from : topology.nodes_) {
    std::istringstream line(
        FirstLine(absl::StrCat(dir, "/node", from, "/distance")));
    std::vector<int> row;
    for (int value; line >> value;) row.push_back(value);
    if (row.size() != topology.nodes_.size()) continue;  // unknown
    for (size_t i = 0; i < row.size(); ++i) {
      topology.distance_[from][topology.nodes_[i]] = row[i];
    }
  }
  return topology;
}

int NumaTopology::Distance(int from, int to) const {
  auto row = distance_.find(from);
  if (row == distance_.end()) return -1;
  auto cell = row->second.find(to);
  return cell == row->second.end() ? -1 : cell->second;
}

int NumaTopology::RdmaDeviceNode(const std::string& device) const {
  if (!IsPlainName(device)) return -1;
  return ReadNode(
      absl::StrCat(root_, "/class/infiniband/", device, "/device/numa_node"));
}

int NumaTopology::PciDeviceNode(const std::string& bdf) const {
  if (!IsPlainName(bdf)) return -1;
  return ReadNode(absl::StrCat(root_, "/bus/pci/devices/", bdf, "/numa_node"));
}

NumaTopology::PciPath NumaTopology::RdmaDevicePciPath(
    const std::string& device) const {
  if (!IsPlainName(device)) return {};
  return ResolvePciPath(
      absl::StrCat(root_, "/class/infiniband/", device, "/device"));
}

NumaTopology::PciPath NumaTopology::PciDevicePciPath(
    const std::string& bdf) const {
  if (!IsPlainName(bdf)) return {};
  return ResolvePciPath(absl::StrCat(root_, "/bus/pci/devices/", bdf));
}

std::vector<bool> NearestInPciTree(
    const NumaTopology::PciPath& device,
    absl::Span<const NumaTopology::PciPath> rail_paths,
    std::vector<bool> candidates, bool* on_switch) {
  if (on_switch != nullptr) *on_switch = false;
  if (device.empty()) return candidates;
  // Components in common with `device`'s path, from the root complex down.
  const auto shared = [&](const NumaTopology::PciPath& path) {
    const size_t n = std::min(path.size(), device.size());
    size_t common = 0;
    while (common < n && path[common] == device[common]) ++common;
    return common;
  };
  size_t best = 0;
  for (size_t i = 0; i < candidates.size() && i < rail_paths.size(); ++i) {
    if (candidates[i]) best = std::max(best, shared(rail_paths[i]));
  }
  // The root complex alone is no switch: the CPU carries the traffic then,
  // as it does for every NIC of the node.
  if (best < 2) return candidates;
  if (on_switch != nullptr) *on_switch = true;
  for (size_t i = 0; i < candidates.size() && i < rail_paths.size(); ++i) {
    if (candidates[i] && !rail_paths[i].empty()) {
      candidates[i] = shared(rail_paths[i]) == best;
    }
  }
  return candidates;
}

std::vector<bool> NearestRails(const NumaTopology& topology, int memory_node,
                               absl::Span<const int> rail_nodes) {
  std::vector<int> distance(rail_nodes.size(), -1);
  int nearest = std::numeric_limits<int>::max();
  if (memory_node >= 0) {
    for (size_t i = 0; i < rail_nodes.size(); ++i) {
      if (rail_nodes[i] < 0) continue;
      distance[i] = topology.Distance(memory_node, rail_nodes[i]);
      if (distance[i] >= 0) nearest = std::min(nearest, distance[i]);
    }
  }
  std::vector<bool> near(rail_nodes.size());
  for (size_t i = 0; i < rail_nodes.size(); ++i) {
    near[i] = distance[i] < 0 || distance[i] == nearest;
  }
  return near;
}

}  // namespace rdma_agent::ibverbs

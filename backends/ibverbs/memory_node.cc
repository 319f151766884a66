#include "backends/ibverbs/memory_node.h"

#include <numaif.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <vector>

namespace rdma_agent::ibverbs {
namespace {

// Node ids get_mempolicy may report in its mask: the kernel's largest
// MAX_NUMNODES (CONFIG_NODES_SHIFT 10).
constexpr unsigned long kMaxNodes = 1024;
constexpr size_t kBitsPerWord = 8 * sizeof(unsigned long);

// The one node `mask` holds; -1 when it holds none or several.
int SingleNode(const std::vector<unsigned long>& mask) {
  int node = -1;
  for (size_t word = 0; word < mask.size(); ++word) {
    for (size_t bit = 0; bit < kBitsPerWord; ++bit) {
      if ((mask[word] >> bit & 1UL) == 0) continue;
      if (node >= 0) return -1;
      node = static_cast<int>(word * kBitsPerWord + bit);
    }
  }
  return node;
}

class KernelMemoryNodeLocator : public MemoryNodeLocator {
 public:
  explicit KernelMemoryNodeLocator(size_t max_samples)
      : max_samples_(std::max<size_t>(max_samples, 1)),
        page_(static_cast<uintptr_t>(sysconf(_SC_PAGESIZE))) {}

  int NodeOf(const void* data, size_t size) const override {
    if (data == nullptr || size == 0) return -1;
    const uintptr_t first = reinterpret_cast<uintptr_t>(data) & ~(page_ - 1);
    const uintptr_t last =
        (reinterpret_cast<uintptr_t>(data) + size - 1) & ~(page_ - 1);
    const size_t pages = (last - first) / page_ + 1;
    const size_t samples = std::min(pages, max_samples_);
    std::vector<void*> addresses(samples);
    for (size_t i = 0; i < samples; ++i) {
      // Evenly spread, the first and (with two or more) the last included.
      const size_t page = samples == 1 ? 0 : i * (pages - 1) / (samples - 1);
      addresses[i] = reinterpret_cast<void*>(first + page * page_);
    }
    std::vector<int> status(samples, -1);
    // nodes == nullptr: nothing moves, status gets each page's node or a
    // negative errno (-ENOENT: not placed yet; -EFAULT: not mapped memory).
    if (move_pages(0, samples, addresses.data(), nullptr, status.data(), 0) ==
        0) {
      std::map<int, size_t> pages_on;
      for (int node : status) {
        if (node >= 0) ++pages_on[node];
      }
      int best = -1;
      size_t most = 0;
      for (const auto& [node, count] : pages_on) {
        if (count > most) {
          best = node;
          most = count;
        }
      }
      if (best >= 0) return best;
    }
    return PolicyNode(addresses.front());
  }

 private:
  // The node the policy of `address` places it on, when it names exactly
  // one (MPOL_BIND / MPOL_PREFERRED to one node); -1 otherwise (the default
  // policy places a page on the node of the CPU that first touches it).
  static int PolicyNode(void* address) {
    int mode = 0;
    std::vector<unsigned long> mask(kMaxNodes / kBitsPerWord, 0);
    if (get_mempolicy(&mode, mask.data(), kMaxNodes, address, MPOL_F_ADDR) !=
        0) {
      return -1;
    }
    if (mode != MPOL_BIND && mode != MPOL_PREFERRED) return -1;
    return SingleNode(mask);
  }

  const size_t max_samples_;
  const uintptr_t page_;
};

}  // namespace

std::unique_ptr<MemoryNodeLocator> MakeKernelMemoryNodeLocator(
    size_t max_samples) {
  return std::make_unique<KernelMemoryNodeLocator>(max_samples);
}

}  // namespace rdma_agent::ibverbs

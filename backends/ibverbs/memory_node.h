#ifndef RDMA_AGENTD_BACKENDS_IBVERBS_MEMORY_NODE_H_
#define RDMA_AGENTD_BACKENDS_IBVERBS_MEMORY_NODE_H_

// Which NUMA node a buffer's memory is on, for pairing it with the rails
// nearest to it (README.md, "Affinity"). An interface so that tests can
// place buffers on the nodes of a host they describe.

#include <cstddef>
#include <memory>

namespace rdma_agent::ibverbs {

class MemoryNodeLocator {
 public:
  virtual ~MemoryNodeLocator() = default;
  // The node most of [data, data + size) is on; -1 when it cannot be told
  // (no NUMA, pages not placed yet without a policy binding them, memory
  // that is not the host's, such as a device's). Must not touch or fault
  // in the memory. Thread-safe.
  virtual int NodeOf(const void* data, size_t size) const = 0;
};

// Asks the kernel: move_pages(2) without target nodes reports where pages
// are, for at most `max_samples` pages spread evenly over the buffer (the
// node most of them are on wins; ties to the lower node). When none of
// them is placed yet, the memory policy of the first page
// (get_mempolicy(2), MPOL_F_ADDR) answers if it binds or prefers exactly one
// node.
std::unique_ptr<MemoryNodeLocator> MakeKernelMemoryNodeLocator(
    size_t max_samples = 64);

}  // namespace rdma_agent::ibverbs

#endif  // RDMA_AGENTD_BACKENDS_IBVERBS_MEMORY_NODE_H_

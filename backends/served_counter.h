#ifndef RDMA_AGENTD_BACKENDS_SERVED_COUNTER_H_
#define RDMA_AGENTD_BACKENDS_SERVED_COUNTER_H_

#include <atomic>
#include <cstdint>

namespace rdma_agent {

// Ops and bytes a backend served since start: the serving side of ops that
// requesters (peers, or this agent's own clients through the memory
// backend) ran against this agent's buffers. The requester counts the op
// too; the serving agent's busy buffers would otherwise look idle.
struct ServedTotals {
  uint64_t read_ops = 0;  // the requester read a local buffer
  uint64_t read_bytes = 0;
  uint64_t write_ops = 0;  // the requester wrote into a local buffer
  uint64_t write_bytes = 0;
};

// Counts them on the serving path: lock-free, thread-safe, never reset.
class ServedCounter {
 public:
  // One op served in full: `write` when the requester wrote into the buffer.
  void Count(bool write, uint64_t bytes) {
    (write ? write_ops_ : read_ops_).fetch_add(1, std::memory_order_relaxed);
    (write ? write_bytes_ : read_bytes_)
        .fetch_add(bytes, std::memory_order_relaxed);
  }
  ServedTotals totals() const {
    return {read_ops_.load(std::memory_order_relaxed),
            read_bytes_.load(std::memory_order_relaxed),
            write_ops_.load(std::memory_order_relaxed),
            write_bytes_.load(std::memory_order_relaxed)};
  }

 private:
  std::atomic<uint64_t> read_ops_{0};
  std::atomic<uint64_t> read_bytes_{0};
  std::atomic<uint64_t> write_ops_{0};
  std::atomic<uint64_t> write_bytes_{0};
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_BACKENDS_SERVED_COUNTER_H_

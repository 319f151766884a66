#ifndef RDMA_AGENTD_COMMON_RANDOM_H_
#define RDMA_AGENTD_COMMON_RANDOM_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace rdma_agent {

// `size` bytes from getrandom(2): unguessable, for capability tokens.
std::string RandomBytes(size_t size);

// A random non-zero 64-bit value (epochs).
uint64_t RandomNonZeroU64();

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_COMMON_RANDOM_H_

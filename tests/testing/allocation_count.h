#ifndef RDMA_AGENTD_TESTS_TESTING_ALLOCATION_COUNT_H_
#define RDMA_AGENTD_TESTS_TESTING_ALLOCATION_COUNT_H_

#include <cstdint>

namespace rdma_agent::testing {

// Heap allocations (every operator new, any thread) since the process
// started. A test binary that links //tests/testing:allocation_count has
// the global allocation functions replaced by counting ones; compare two
// readings around the code under test.
int64_t Allocations();

// From now on, counts only the allocations for which `filter` answers true
// (e.g. those on some threads, while a test measures); nullptr counts all.
// `filter` runs inside operator new: it must not allocate.
void CountOnly(bool (*filter)());

}  // namespace rdma_agent::testing

#endif  // RDMA_AGENTD_TESTS_TESTING_ALLOCATION_COUNT_H_

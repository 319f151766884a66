#ifndef RDMA_AGENTD_TESTS_TESTING_ALLOCATION_COUNT_H_
#define RDMA_AGENTD_TESTS_TESTING_ALLOCATION_COUNT_H_

#include <cstdint>
#include <string>
#include <vector>

namespace rdma_agent::testing {

// Heap allocations (every operator new, any thread) since the process
// started. A test binary that links //tests/testing:allocation_count has
// the global allocation functions replaced by counting ones; compare two
// readings around the code under test.
int64_t Allocations();

// From now on, counts only the allocations made on the calling thread or on
// threads whose names (PR_GET_NAME) start with one of `name_prefixes`: one
// side of a path (e.g. the requesting side's posting, worker and completion
// threads) when both sides live in the test process. The first call's
// prefixes stand for the process; later calls only add their thread.
void CountOnlyOn(std::vector<std::string> name_prefixes);

}  // namespace rdma_agent::testing

#endif  // RDMA_AGENTD_TESTS_TESTING_ALLOCATION_COUNT_H_

#ifndef RDMA_AGENTD_TESTS_FUZZ_FUZZ_CHECK_H_
#define RDMA_AGENTD_TESTS_FUZZ_FUZZ_CHECK_H_

#include <cstdio>
#include <cstdlib>

// The oracle of a fuzz target: a broken promise aborts, which libFuzzer
// reports as a crash (and saves the input) and the replay driver as a failed
// test. Unlike assert(), it stays on in optimised builds.
#define FUZZ_CHECK(condition)                                          \
  do {                                                                 \
    if (!(condition)) {                                                \
      std::fprintf(stderr, "%s:%d: FUZZ_CHECK failed: %s\n", __FILE__, \
                   __LINE__, #condition);                              \
      std::abort();                                                    \
    }                                                                  \
  } while (false)

#endif  // RDMA_AGENTD_TESTS_FUZZ_FUZZ_CHECK_H_

#ifndef RDMA_AGENTD_TESTS_FUZZ_FUZZ_DRIVER_H_
#define RDMA_AGENTD_TESTS_FUZZ_FUZZ_DRIVER_H_

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace rdma_agent::testing {

// Deterministic mutations of seed inputs, so that fuzz targets run as
// bounded, repeatable unit tests with g++ (no libFuzzer in this toolchain).
class Mutator {
 public:
  explicit Mutator(uint32_t seed) : random_(seed) {}

  // One mutation of `input`: flipped bits, overwritten, inserted or erased
  // bytes, truncation, duplication of a slice, or fresh random bytes.
  std::string Mutate(const std::string& input);

  uint64_t Next() { return random_(); }

 private:
  std::mt19937_64 random_;
};

}  // namespace rdma_agent::testing

#endif  // RDMA_AGENTD_TESTS_FUZZ_FUZZ_DRIVER_H_

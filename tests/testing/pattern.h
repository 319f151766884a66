#ifndef RDMA_AGENTD_TESTS_TESTING_PATTERN_H_
#define RDMA_AGENTD_TESTS_TESTING_PATTERN_H_

// Test bytes that depend on (seed, position) with no short period, so a copy
// from the wrong offset or buffer cannot pass for the right one, and any
// range can be checked without keeping a copy.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/types/span.h"

namespace rdma_agent::testing {

// Word `word_index` (bytes 8*word_index.. in little-endian order) of pattern
// `seed`.
inline uint64_t PatternWord(uint64_t seed, uint64_t word_index) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + word_index + 1;  // splitmix64
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Byte `position` of pattern `seed`.
inline std::byte PatternByte(uint64_t seed, uint64_t position) {
  return static_cast<std::byte>(PatternWord(seed, position / 8) >>
                                (8 * (position % 8)));
}

// Writes pattern `seed`, positions [first, first + bytes.size()), into bytes.
void FillPattern(absl::Span<std::byte> bytes, uint64_t seed,
                 uint64_t first = 0);

// Pattern `seed`, positions [first, first + size), as a string.
std::string PatternString(uint64_t seed, uint64_t first, size_t size);

// Index in `bytes` of the first byte that is not pattern `seed` at position
// first + index; nullopt when every byte matches.
std::optional<uint64_t> FindMismatch(absl::Span<const std::byte> bytes,
                                     uint64_t seed, uint64_t first = 0);

// Where a buffer's bytes stop matching what is expected of them: bytes
// [offset, offset+length) hold pattern `inside_seed` from position
// `inside_from` on; every other byte holds pattern `outside_seed` at its own
// position. nullopt if every byte matches; else the first bad position.
std::optional<uint64_t> FirstMismatch(absl::Span<const std::byte> bytes,
                                      uint64_t inside_seed,
                                      uint64_t inside_from, uint64_t offset,
                                      uint64_t length, uint64_t outside_seed);

}  // namespace rdma_agent::testing

#endif  // RDMA_AGENTD_TESTS_TESTING_PATTERN_H_

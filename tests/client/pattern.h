#ifndef RDMA_AGENTD_TESTS_CLIENT_PATTERN_H_
#define RDMA_AGENTD_TESTS_CLIENT_PATTERN_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "absl/types/span.h"

namespace rdma_agent::testing {

// Test bytes that depend on (seed, position) with no short period, so a copy
// from the wrong offset or buffer cannot pass for the right one.
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
inline void FillPattern(absl::Span<std::byte> bytes, uint64_t seed,
                        uint64_t first = 0) {
  size_t i = 0;
  // Byte by byte up to a word boundary of the pattern, then whole words.
  for (; i < bytes.size() && (first + i) % 8 != 0; ++i) {
    bytes[i] = PatternByte(seed, first + i);
  }
  for (; i + 8 <= bytes.size(); i += 8) {
    const uint64_t word = PatternWord(seed, (first + i) / 8);
    unsigned char little_endian[8];
    for (int b = 0; b < 8; ++b) {
      little_endian[b] = static_cast<unsigned char>(word >> (8 * b));
    }
    std::memcpy(bytes.data() + i, little_endian, 8);
  }
  for (; i < bytes.size(); ++i) bytes[i] = PatternByte(seed, first + i);
}

inline std::string PatternString(uint64_t seed, uint64_t first, size_t size) {
  std::string text(size, '\0');
  FillPattern(absl::MakeSpan(reinterpret_cast<std::byte*>(text.data()), size),
              seed, first);
  return text;
}

// Where a buffer's bytes stop matching what is expected of them: bytes
// [offset, offset+length) hold pattern `inside_seed` from position
// `inside_from` on; every other byte holds pattern `outside_seed` at its own
// position. nullopt if every byte matches; else the first bad position.
inline std::optional<uint64_t> FirstMismatch(absl::Span<const std::byte> bytes,
                                             uint64_t inside_seed,
                                             uint64_t inside_from,
                                             uint64_t offset, uint64_t length,
                                             uint64_t outside_seed) {
  constexpr size_t kChunk = 64 << 10;
  std::vector<std::byte> expected(kChunk);
  // Compares [begin, end) of `bytes` with pattern `seed` from `from` on.
  auto compare = [&](uint64_t begin, uint64_t end, uint64_t seed,
                     uint64_t from) -> std::optional<uint64_t> {
    for (uint64_t at = begin; at < end; at += kChunk) {
      const size_t n =
          static_cast<size_t>(std::min<uint64_t>(kChunk, end - at));
      FillPattern(absl::MakeSpan(expected.data(), n), seed,
                  from + (at - begin));
      if (std::memcmp(bytes.data() + at, expected.data(), n) != 0) {
        for (size_t i = 0; i < n; ++i) {
          if (bytes[at + i] != expected[i]) return at + i;
        }
      }
    }
    return std::nullopt;
  };
  const uint64_t size = bytes.size();
  const uint64_t inside_begin = std::min(offset, size);
  const uint64_t inside_end =
      std::min(size, inside_begin + std::min(length, size));
  if (auto bad = compare(0, inside_begin, outside_seed, 0)) return bad;
  if (auto bad = compare(inside_begin, inside_end, inside_seed, inside_from)) {
    return bad;
  }
  return compare(inside_end, size, outside_seed, inside_end);
}

}  // namespace rdma_agent::testing

#endif  // RDMA_AGENTD_TESTS_CLIENT_PATTERN_H_

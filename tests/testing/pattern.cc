#include "tests/testing/pattern.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace rdma_agent::testing {

void FillPattern(absl::Span<std::byte> bytes, uint64_t seed, uint64_t first) {
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

std::string PatternString(uint64_t seed, uint64_t first, size_t size) {
  std::string text(size, '\0');
  FillPattern(absl::MakeSpan(reinterpret_cast<std::byte*>(text.data()), size),
              seed, first);
  return text;
}

std::optional<uint64_t> FindMismatch(absl::Span<const std::byte> bytes,
                                     uint64_t seed, uint64_t first) {
  // Compared a chunk at a time against a generated copy: memcmp is fast, and
  // only a chunk that differs is searched byte by byte.
  constexpr size_t kChunk = 64 << 10;
  std::vector<std::byte> expected(std::min<size_t>(kChunk, bytes.size()));
  for (uint64_t at = 0; at < bytes.size(); at += kChunk) {
    const size_t n =
        static_cast<size_t>(std::min<uint64_t>(kChunk, bytes.size() - at));
    FillPattern(absl::MakeSpan(expected.data(), n), seed, first + at);
    if (std::memcmp(bytes.data() + at, expected.data(), n) != 0) {
      for (size_t i = 0; i < n; ++i) {
        if (bytes[at + i] != expected[i]) return at + i;
      }
    }
  }
  return std::nullopt;
}

std::optional<uint64_t> FirstMismatch(absl::Span<const std::byte> bytes,
                                      uint64_t inside_seed,
                                      uint64_t inside_from, uint64_t offset,
                                      uint64_t length, uint64_t outside_seed) {
  const uint64_t size = bytes.size();
  const uint64_t inside_begin = std::min(offset, size);
  const uint64_t inside_end =
      std::min(size, inside_begin + std::min(length, size));
  if (auto bad =
          FindMismatch(bytes.subspan(0, inside_begin), outside_seed, 0)) {
    return bad;
  }
  if (auto bad =
          FindMismatch(bytes.subspan(inside_begin, inside_end - inside_begin),
                       inside_seed, inside_from)) {
    return inside_begin + *bad;
  }
  if (auto bad =
          FindMismatch(bytes.subspan(inside_end), outside_seed, inside_end)) {
    return inside_end + *bad;
  }
  return std::nullopt;
}

}  // namespace rdma_agent::testing

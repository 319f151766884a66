#include "tests/testing/pattern.h"

#include <vector>

#include "gtest/gtest.h"

namespace rdma_agent::testing {
namespace {

TEST(PatternTest, FillMatchesPatternByteAtAnyStart) {
  std::vector<std::byte> bytes(37);
  for (uint64_t first : {0, 1, 7, 8, 13}) {
    FillPattern(absl::MakeSpan(bytes), 5, first);
    for (size_t i = 0; i < bytes.size(); ++i) {
      ASSERT_EQ(bytes[i], PatternByte(5, first + i)) << first << " " << i;
    }
  }
}

TEST(PatternTest, SeedsAndPositionsDiffer) {
  EXPECT_NE(PatternString(1, 0, 64), PatternString(2, 0, 64));
  EXPECT_NE(PatternString(1, 0, 64), PatternString(1, 1, 64));
}

TEST(PatternTest, FindMismatchFindsTheFirstWrongByteFromAnyStart) {
  std::vector<std::byte> bytes(100000);
  FillPattern(absl::MakeSpan(bytes), 6, 77);
  EXPECT_EQ(FindMismatch(bytes, 6, 77), std::nullopt);
  EXPECT_EQ(FindMismatch({}, 6, 77), std::nullopt);
  for (uint64_t position : {0ul, 65535ul, 65536ul, 99999ul}) {
    const std::byte saved = bytes[position];
    bytes[position] ^= std::byte{0x80};
    EXPECT_EQ(FindMismatch(bytes, 6, 77), position);
    bytes[position] = saved;
  }
  // Another seed, or the same pattern one position off, fails at once.
  EXPECT_EQ(FindMismatch(bytes, 7, 77), 0u);
  EXPECT_EQ(FindMismatch(bytes, 6, 78), 0u);
}

TEST(PatternTest, FirstMismatchFindsEveryWrongByte) {
  // 200000 bytes: pattern 9 except [70001, 70001+130000) = pattern 4 from 3.
  std::vector<std::byte> bytes(200000);
  FillPattern(absl::MakeSpan(bytes), 9);
  FillPattern(absl::MakeSpan(bytes).subspan(70001, 130000), 4, 3);
  auto check = [&] { return FirstMismatch(bytes, 4, 3, 70001, 130000, 9); };
  EXPECT_EQ(check(), std::nullopt);
  for (uint64_t position : {0ul, 70000ul, 70001ul, 150000ul, 199999ul}) {
    const std::byte saved = bytes[position];
    bytes[position] ^= std::byte{1};
    EXPECT_EQ(check(), position);
    bytes[position] = saved;
  }
  // Wrong source offset: caught at the first byte of the range.
  EXPECT_EQ(FirstMismatch(bytes, 4, 4, 70001, 130000, 9), 70001u);
}

}  // namespace
}  // namespace rdma_agent::testing

#include "client/internal/units.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rdma_agent::client::internal {
namespace {

using ::testing::HasSubstr;

TEST(ParseByteSizeTest, TakesBytesAndBinarySuffixes) {
  EXPECT_EQ(*ParseByteSize("0"), 0u);
  EXPECT_EQ(*ParseByteSize("4099"), 4099u);
  EXPECT_EQ(*ParseByteSize("17B"), 17u);
  for (const char* four_k : {"4k", "4K", "4Ki", "4KiB", "4kib"}) {
    EXPECT_EQ(*ParseByteSize(four_k), 4096u) << four_k;
  }
  EXPECT_EQ(*ParseByteSize("3M"), 3u << 20);
  EXPECT_EQ(*ParseByteSize("1GiB"), 1u << 30);
  EXPECT_EQ(*ParseByteSize("2T"), uint64_t{2} << 40);
  EXPECT_EQ(*ParseByteSize("1PiB"), uint64_t{1} << 50);
  EXPECT_EQ(*ParseByteSize("18446744073709551615"), ~uint64_t{0});
  EXPECT_EQ(*ParseByteSize("16777215T"), uint64_t{16777215} << 40);
}

TEST(ParseByteSizeTest, RefusesNegativeOverflowingAndAmbiguousText) {
  EXPECT_THAT(ParseByteSize("-5").status().message(),
              HasSubstr("-5 is negative"));
  EXPECT_THAT(ParseByteSize("-0k").status().message(),
              HasSubstr("is negative"));
  EXPECT_THAT(ParseByteSize("18446744073709551616").status().message(),
              HasSubstr("more than 2^64-1 bytes"));
  EXPECT_THAT(ParseByteSize("16777216T").status().message(),
              HasSubstr("16777216T is more than 2^64-1 bytes"));
  for (const char* bad : {"", "k", "lots", "1.5G", "4kB", "4MB", "4X", "4 k",
                          "0x10", "4KiBB", "+4"}) {
    EXPECT_THAT(ParseByteSize(bad).status().message(),
                HasSubstr("is not a size"))
        << bad;
  }
}

TEST(ParseDurationTest, TakesSecondsOrUnits) {
  EXPECT_EQ(*ParseDuration("5"), absl::Seconds(5));
  EXPECT_EQ(*ParseDuration("2.5"), absl::Milliseconds(2500));
  EXPECT_EQ(*ParseDuration("0"), absl::ZeroDuration());
  EXPECT_EQ(*ParseDuration("500ms"), absl::Milliseconds(500));
  EXPECT_EQ(*ParseDuration("1m30s"), absl::Seconds(90));
}

TEST(ParseDurationTest, RefusesNegativeInfiniteAndOtherText) {
  EXPECT_THAT(ParseDuration("-1").status().message(),
              HasSubstr("-1 is negative"));
  EXPECT_THAT(ParseDuration("-2s").status().message(),
              HasSubstr("is negative"));
  for (const char* bad : {"", "soon", "inf", "nan", "5 parsecs", "1e999"}) {
    EXPECT_THAT(ParseDuration(bad).status().message(),
                HasSubstr("is not a duration"))
        << bad;
  }
}

}  // namespace
}  // namespace rdma_agent::client::internal

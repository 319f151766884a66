#include "client/internal/progress.h"

#include <cstdio>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rdma_agent::client::internal {
namespace {

TEST(ProgressTextTest, SizesRateAndEta) {
  EXPECT_EQ(HumanBytes(512), "512 B");
  EXPECT_EQ(HumanBytes(1536), "1.5 KiB");
  EXPECT_EQ(HumanBytes(3.0 * (1 << 30)), "3.0 GiB");
  EXPECT_EQ(ProgressText(0, 1 << 30, absl::Seconds(1)), "0 B / 1.0 GiB");
  // A quarter in 2 s: 128 MiB/s, 6 s to go.
  EXPECT_EQ(ProgressText(256 << 20, 1 << 30, absl::Seconds(2)),
            "256.0 MiB / 1.0 GiB  128.0 MiB/s  ETA 6s");
}

// What a ProgressLine wrote.
class Captured {
 public:
  Captured() : file_(std::tmpfile()) {}
  ~Captured() { std::fclose(file_); }
  FILE* file() { return file_; }
  std::string Text() {
    std::fflush(file_);
    std::rewind(file_);
    std::string text;
    char buffer[256];
    size_t n;
    while ((n = std::fread(buffer, 1, sizeof(buffer), file_)) > 0) {
      text.append(buffer, n);
    }
    return text;
  }

 private:
  FILE* const file_;
};

TEST(ProgressLineTest, ShortWorkShowsNothingLongWorkShowsTheLine) {
  const absl::Time start = absl::FromUnixSeconds(1000);
  {
    Captured out;
    ProgressLine line(100, /*enabled=*/true, /*forced=*/false, out.file(),
                      start);
    line.Update(50, start + absl::Milliseconds(500));
    line.Finish(100, start + absl::Milliseconds(900));
    EXPECT_EQ(out.Text(), "");
  }
  {
    Captured out;
    ProgressLine line(4096, /*enabled=*/true, /*forced=*/false, out.file(),
                      start);
    line.Update(1024, start + absl::Seconds(2));
    line.Update(2048, start + absl::Seconds(2) + absl::Milliseconds(10));
    line.Finish(4096, start + absl::Seconds(4));
    const std::string text = out.Text();
    EXPECT_THAT(text, ::testing::HasSubstr("\r1.0 KiB / 4.0 KiB  512 B/s"));
    EXPECT_THAT(text, ::testing::Not(::testing::HasSubstr("2.0 KiB /")))
        << "redrawn at most ten times a second";
    EXPECT_THAT(text, ::testing::EndsWith("4.0 KiB in 4s (1.0 KiB/s)" +
                                          std::string(35, ' ') + "\n"));
  }
  {
    Captured out;
    ProgressLine line(100, /*enabled=*/false, /*forced=*/false, out.file(),
                      start);
    line.Update(50, start + absl::Seconds(5));
    line.Finish(100, start + absl::Seconds(9));
    EXPECT_EQ(out.Text(), "");
  }
}

TEST(ProgressLineTest, ForcedShowsFromTheStart) {
  const absl::Time start = absl::FromUnixSeconds(1000);
  Captured out;
  ProgressLine line(100, /*enabled=*/false, /*forced=*/true, out.file(), start);
  line.Update(50, start + absl::Milliseconds(100));
  line.Finish(100, start + absl::Milliseconds(200));
  EXPECT_THAT(out.Text(), ::testing::HasSubstr("50 B / 100 B"));
  EXPECT_THAT(out.Text(), ::testing::HasSubstr("100 B in 200ms"));
}

}  // namespace
}  // namespace rdma_agent::client::internal

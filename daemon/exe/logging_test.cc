#include "daemon/exe/logging.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "spdlog/details/log_msg.h"

namespace rdma_agent {
namespace {

using ::testing::HasSubstr;
using ::testing::MatchesRegex;

std::string Format(LogFormat format, spdlog::level::level_enum level,
                   const std::string& text) {
  spdlog::details::log_msg msg("rdma-agentd", level, text);
  spdlog::memory_buf_t out;
  MakeLogFormatter(format)->format(msg, out);
  return std::string(out.data(), out.size());
}

TEST(ParseLogLevelTest, KnownLevelsInAnyCase) {
  EXPECT_EQ(*ParseLogLevel("debug"), spdlog::level::debug);
  EXPECT_EQ(*ParseLogLevel("WARN"), spdlog::level::warn);
  EXPECT_EQ(*ParseLogLevel("Warning"), spdlog::level::warn);
  EXPECT_EQ(*ParseLogLevel("error"), spdlog::level::err);
  EXPECT_EQ(*ParseLogLevel("off"), spdlog::level::off);
}

TEST(ParseLogLevelTest, UnknownLevelIsRefusedListingTheValidOnes) {
  auto level = ParseLogLevel("verbose");
  ASSERT_FALSE(level.ok());
  EXPECT_EQ(level.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(level.status().message(), HasSubstr("\"verbose\""));
  EXPECT_THAT(level.status().message(),
              HasSubstr("trace, debug, info, warn, error, critical or off"));
  EXPECT_FALSE(ParseLogLevel("").ok());
}

TEST(LogFormatTest, JournalLinesCarryTheSyslogPriorityAndNoTimestamp) {
  EXPECT_EQ(Format(LogFormat::kJournal, spdlog::level::warn, "op failed"),
            "<4>op failed\n");
  EXPECT_EQ(Format(LogFormat::kJournal, spdlog::level::info, "x"), "<6>x\n");
  EXPECT_EQ(Format(LogFormat::kJournal, spdlog::level::debug, "x"), "<7>x\n");
  EXPECT_EQ(Format(LogFormat::kJournal, spdlog::level::err, "x"), "<3>x\n");
  EXPECT_EQ(Format(LogFormat::kJournal, spdlog::level::critical, "x"),
            "<2>x\n");
}

TEST(LogFormatTest, PlainLinesHaveUtcTimestampsAndNoColourCodes) {
  const std::string line =
      Format(LogFormat::kPlain, spdlog::level::warn, "op failed");
  EXPECT_THAT(line, MatchesRegex("[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9:.]+Z "
                                 "warning op failed\n"));
  EXPECT_EQ(line.find('\x1b'), std::string::npos);
}

TEST(LogFormatTest, AutoPicksJournalOnlyForTheStreamJournaldNamed) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  struct stat st;
  ASSERT_EQ(::fstat(fds[1], &st), 0);
  ::unsetenv("JOURNAL_STREAM");
  EXPECT_EQ(*ParseLogFormat("auto", fds[1]), LogFormat::kPlain);
  ::setenv("JOURNAL_STREAM", absl::StrCat(st.st_dev, ":", st.st_ino).c_str(),
           1);
  EXPECT_TRUE(IsJournalStream(fds[1]));
  EXPECT_EQ(*ParseLogFormat("auto", fds[1]), LogFormat::kJournal);
  // Inherited by a child whose stderr went elsewhere: not the journal.
  ::setenv("JOURNAL_STREAM",
           absl::StrCat(st.st_dev, ":", st.st_ino + 1).c_str(), 1);
  EXPECT_EQ(*ParseLogFormat("auto", fds[1]), LogFormat::kPlain);
  ::unsetenv("JOURNAL_STREAM");
  EXPECT_EQ(*ParseLogFormat("journal", fds[1]), LogFormat::kJournal);
  EXPECT_FALSE(ParseLogFormat("json", fds[1]).ok());
  ::close(fds[0]);
  ::close(fds[1]);
}

}  // namespace
}  // namespace rdma_agent

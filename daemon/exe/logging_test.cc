#include "daemon/exe/logging.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "common/log_context.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "spdlog/details/log_msg.h"

namespace rdma_agent {
namespace {

using ::testing::HasSubstr;
using ::testing::MatchesRegex;
using ::testing::Not;

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

TEST(LogFormatTest, JsonLinesAreOneObjectWithTheCallerWhereKnown) {
  EXPECT_THAT(Format(LogFormat::kJson, spdlog::level::info, "serving"),
              MatchesRegex("\\{\"time\":\"[0-9]{4}-[0-9]{2}-[0-9]{2}T"
                           "[0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{6}Z\",\"level\":"
                           "\"info\",\"message\":\"serving\"\\}\n"));
  LogContext context;
  context.method = "rdma.agent.v1.RdmaAgent/Submit";
  context.uid = 1000;
  context.pid = 4242;
  {
    const ScopedLogContext scoped(context);
    const std::string line = Format(LogFormat::kJson, spdlog::level::warn,
                                    "a \"quoted\"\tline\\\x01\xff");
    EXPECT_THAT(line, HasSubstr("\"level\":\"warning\",\"message\":\"a "
                                "\\\"quoted\\\"\\u0009line\\\\\\u0001\\u00ff\","
                                "\"method\":\"rdma.agent.v1.RdmaAgent/Submit\","
                                "\"uid\":1000,\"pid\":4242}\n"));
  }
  // The scope ended: no caller any more.
  EXPECT_THAT(Format(LogFormat::kJson, spdlog::level::info, "x"),
              Not(HasSubstr("uid")));
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
  EXPECT_EQ(*ParseLogFormat("json", fds[1]), LogFormat::kJson);
  EXPECT_EQ(*ParseLogFormat("JSON", fds[1]), LogFormat::kJson);
  EXPECT_FALSE(ParseLogFormat("yaml", fds[1]).ok());
  ::close(fds[0]);
  ::close(fds[1]);
}

}  // namespace
}  // namespace rdma_agent

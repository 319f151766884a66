// What rdma-agentd logs, read from a real agent process: a client ending its
// own stream is not a warning, and --log_format=json writes one JSON object
// a line with time, level and message, and the caller's uid and pid and the
// method where the line is about an RPC.

#include <signal.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/rdma_agent_client.h"
#include "gmock/gmock.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/eventually.h"
#include "tests/testing/process.h"

namespace rdma_agent::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::MatchesRegex;
using ::testing::Not;

// The lines of `log` that mention `what`.
std::vector<std::string> LinesWith(const std::string& log,
                                   absl::string_view what) {
  std::vector<std::string> lines;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    if (absl::StrContains(line, what)) lines.emplace_back(line);
  }
  return lines;
}

TEST(DaemonLogsTest, AClientEndingItsWatchIsNotAWarning) {
  AgentProcess::Options options;
  options.log_level = "info";
  auto agent = AgentProcess::Start(options);
  ASSERT_TRUE(agent.ok()) << agent.status();
  // rdma-agentctl watch, ended by Ctrl-C, as an operator ends it.
  Subprocess::Options watch_options;
  watch_options.argv = {RunfilePath("client/rdma-agentctl"),
                        "--target=" + (*agent)->target(), "watch"};
  watch_options.pipe_stdio = true;
  auto watch = Subprocess::Spawn(watch_options);
  ASSERT_TRUE(watch.ok()) << watch.status();
  // The stream is open once the agent counts it among its calls; a short
  // wait stands in (the agent logs nothing at info when it opens).
  absl::SleepFor(absl::Seconds(1));
  watch->Signal(SIGINT);
  auto code = watch->Wait(absl::Seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  // And a library watch, dropped.
  {
    auto stream = (*agent)->client().WatchTransfers();
    ASSERT_TRUE(stream.ok()) << stream.status();
    absl::SleepFor(absl::Milliseconds(300));
  }
  // A real failure still warns: the log is read after it.
  EXPECT_FALSE((*agent)->client().Release(424242).ok());
  ASSERT_TRUE(Eventually(
      [&] { return absl::StrContains((*agent)->Log(), "Release from"); },
      absl::Seconds(10)));
  const std::string log = (*agent)->Log();
  EXPECT_THAT(LinesWith(log, "WatchTransfers"), ::testing::IsEmpty()) << log;
  EXPECT_THAT(log, Not(HasSubstr("CANCELLED")));
  EXPECT_THAT(log, MatchesRegex("(.|\n)* warning [^\n]*Release from uid "
                                "[0-9]+ pid [0-9]+ failed: NOT_FOUND(.|\n)*"));
}

TEST(DaemonLogsTest, JsonFormatIsOneObjectALine) {
  AgentProcess::Options options;
  options.log_level = "debug";
  options.extra_flags = {"--log_format=json"};
  auto agent = AgentProcess::Start(options);
  ASSERT_TRUE(agent.ok()) << agent.status();
  EXPECT_FALSE((*agent)->client().Release(424242).ok());
  ASSERT_TRUE(Eventually(
      [&] { return absl::StrContains((*agent)->Log(), "Release from"); },
      absl::Seconds(10)));
  bool saw_serving = false;
  bool saw_release = false;
  for (absl::string_view line :
       absl::StrSplit((*agent)->Log(), '\n', absl::SkipEmpty())) {
    google::protobuf::Struct object;
    ASSERT_TRUE(
        google::protobuf::util::JsonStringToMessage(std::string(line), &object)
            .ok())
        << line;
    const auto& fields = object.fields();
    ASSERT_TRUE(fields.contains("time")) << line;
    EXPECT_THAT(fields.at("time").string_value(),
                MatchesRegex("[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9:.]+Z"))
        << line;
    ASSERT_TRUE(fields.contains("level")) << line;
    EXPECT_THAT(fields.at("level").string_value(),
                MatchesRegex("debug|info|warning|error|critical"))
        << line;
    ASSERT_TRUE(fields.contains("message")) << line;
    const std::string& message = fields.at("message").string_value();
    saw_serving = saw_serving || absl::StrContains(message, "serving unix://");
    if (absl::StrContains(message, "Release from")) {
      saw_release = true;
      EXPECT_EQ(fields.at("level").string_value(), "warning") << line;
      ASSERT_TRUE(fields.contains("method")) << line;
      EXPECT_EQ(fields.at("method").string_value(),
                "rdma.agent.v1.RdmaAgent/Release");
      ASSERT_TRUE(fields.contains("uid")) << line;
      EXPECT_EQ(fields.at("uid").number_value(), ::geteuid());
      ASSERT_TRUE(fields.contains("pid")) << line;
      EXPECT_EQ(fields.at("pid").number_value(), ::getpid());
    }
  }
  EXPECT_TRUE(saw_serving);
  EXPECT_TRUE(saw_release);
}

}  // namespace
}  // namespace rdma_agent::testing

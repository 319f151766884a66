#include "tests/testing/process.h"

#include <stdlib.h>

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rdma_agent::testing {
namespace {

using ::absl::StatusCode;
using ::testing::HasSubstr;

TEST(ProcessTest, RunToCompletionFeedsStdinAndCapturesBothOutputs) {
  auto result = RunToCompletion({"/bin/sh", "-c", "cat; echo oops >&2; exit 3"},
                                "hello\n", absl::Seconds(20));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->exit_code, 3);
  EXPECT_EQ(result->out, "hello\n");
  EXPECT_EQ(result->err, "oops\n");
}

TEST(ProcessTest, RunToCompletionKillsAChildPastItsTimeout) {
  const absl::Time start = absl::Now();
  auto result = RunToCompletion({"/bin/sleep", "30"}, "", absl::Seconds(1));
  EXPECT_EQ(result.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST(ProcessTest, BareNamesAreFoundInPath) {
  auto out = RunCommand({"echo", "found"});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, "found\n");
  EXPECT_EQ(RunCommand({"no-such-tool-rdma-agentd-test"}).status().code(),
            StatusCode::kNotFound);
}

TEST(ProcessTest, RunCommandFailsWithTheOutputOnNonZeroExit) {
  auto out = RunCommand({"/bin/sh", "-c", "echo why; exit 1"});
  EXPECT_EQ(out.status().code(), StatusCode::kInternal);
  EXPECT_THAT(out.status().message(), HasSubstr("exit 1"));
  EXPECT_THAT(out.status().message(), HasSubstr("why"));
}

TEST(ProcessTest, EnvironmentEntriesAreAddedAndReplaceTheirNames) {
  ::setenv("RDMA_AGENTD_PROCESS_TEST_KEPT", "kept", 1);
  ::setenv("RDMA_AGENTD_PROCESS_TEST_REPLACED", "old", 1);
  Subprocess::Options options;
  options.argv = {"/bin/sh", "-c",
                  "echo \"$RDMA_AGENTD_PROCESS_TEST_KEPT "
                  "$RDMA_AGENTD_PROCESS_TEST_REPLACED "
                  "$RDMA_AGENTD_PROCESS_TEST_ADDED\""};
  options.pipe_stdio = true;
  options.env = {"RDMA_AGENTD_PROCESS_TEST_REPLACED=new",
                 "RDMA_AGENTD_PROCESS_TEST_ADDED=added"};
  auto child = Subprocess::Spawn(std::move(options));
  ASSERT_TRUE(child.ok()) << child.status();
  auto line = child->ReadLine(absl::Seconds(20));
  ASSERT_TRUE(line.ok()) << line.status();
  EXPECT_EQ(*line, "kept new added");
  EXPECT_EQ(child->Wait(absl::Seconds(20)).value_or(-1), 0);
}

TEST(ProcessTest, WaitForLineSeesEveryLineUpToTheOneWanted) {
  Subprocess::Options options;
  options.argv = {"/bin/sh", "-c",
                  "echo one; echo two >&2; echo ready now; echo after; "
                  "read line; echo \"got $line\""};
  options.pipe_stdio = true;
  options.stderr_to_stdout = true;
  auto child = Subprocess::Spawn(std::move(options));
  ASSERT_TRUE(child.ok()) << child.status();
  std::vector<std::string> seen;
  ASSERT_TRUE(
      child
          ->WaitForLine("ready", absl::Seconds(20),
                        [&](const std::string& line) { seen.push_back(line); })
          .ok());
  EXPECT_THAT(seen, ::testing::ElementsAre("one", "two", "ready now"));
  auto after = child->ReadLine(absl::Seconds(20));
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(*after, "after");
  ASSERT_TRUE(child->WriteLine("input").ok());
  auto got = child->ReadLine(absl::Seconds(20));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "got input");
  // Output has ended: the wanted line never comes.
  EXPECT_EQ(child->WaitForLine("ready", absl::Seconds(20)).code(),
            StatusCode::kUnavailable);
  auto code = child->Wait(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
}

TEST(ProcessTest, WaitForLineGivesUpAtItsTimeout) {
  Subprocess::Options options;
  options.argv = {"/bin/sleep", "30"};
  options.pipe_stdio = true;
  auto child = Subprocess::Spawn(std::move(options));
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_EQ(child->WaitForLine("ready", absl::Milliseconds(200)).code(),
            StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(child->Running());
  child->Signal(SIGKILL);
  auto code = child->Wait(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 128 + SIGKILL);
}

}  // namespace
}  // namespace rdma_agent::testing

// Local attack 11: a caller-chosen label with a newline and terminal escapes
// must not forge a line in the agent's log or reach an operator's terminal:
// it shows up escaped, inside the one line that logs the registration.

#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/security/local_harness.h"

namespace rdma_agent::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr char kForged[] = "[2026-01-01 00:00:00.000] [info] uid 0 released";

TEST(LocalLogTest, LabelsCannotForgeLogLinesOrSmuggleEscapes) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run another user";
  auto agent = StartSharedAgent();
  ASSERT_TRUE(agent.ok()) << agent.status();
  auto attacker = LocalWorker::Start(**agent, kNobody);
  ASSERT_TRUE(attacker.ok()) << attacker.status();

  const std::string label =
      absl::StrCat("innocent\n", kForged, " buffer 424242\r\x1b[2K\x1b[31mred");
  const std::string registered = attacker->Ask(
      absl::StrCat("allocate 4096 ", absl::BytesToHexString(label)));
  ASSERT_THAT(registered, StartsWith("ok ")) << registered;

  std::string log;
  ASSERT_TRUE(Eventually(
      [&] {
        log = (*agent)->Log();
        return absl::StrContains(log, "registered buffer");
      },
      absl::Seconds(10)));
  // One line holds the whole label, escaped.
  EXPECT_THAT(log, HasSubstr(absl::StrCat("innocent\\n", kForged)));
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    EXPECT_FALSE(absl::StartsWith(line, kForged)) << "forged line: " << line;
  }
  EXPECT_FALSE(absl::StrContains(log, "\x1b")) << "raw escape in the log";
  EXPECT_FALSE(absl::StrContains(log, "\r")) << "raw carriage return";
}

}  // namespace
}  // namespace rdma_agent::testing

// rdma-agentd's command line: --help lists every flag (the backends' too),
// --version says what was built, and mistakes exit non-zero naming them.
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "daemon/api/version.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/process.h"

#define STRINGIFY_(x) #x
#define STRINGIFY(x) STRINGIFY_(x)

namespace rdma_agent {
namespace {

using ::rdma_agent::testing::RunfilePath;
using ::rdma_agent::testing::RunResult;
using ::rdma_agent::testing::RunToCompletion;
using ::testing::HasSubstr;
using ::testing::IsSubsetOf;
using ::testing::Not;
using ::testing::StartsWith;

// None of these runs may start an agent; should one, it stays out of the
// host's directories.
RunResult RunAgentd(std::vector<std::string> flags) {
  std::vector<std::string> argv = {RunfilePath("daemon/rdma-agentd"),
                                   "--runtime_dir=/nonexistent/run",
                                   "--state_dir=/nonexistent/state"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  auto result = RunToCompletion(argv, "", absl::Seconds(20));
  EXPECT_TRUE(result.ok()) << result.status();
  return result.ok() ? *result : RunResult{};
}

// The flags a help text lists ("    --name (help); default: ...").
std::set<std::string> ListedFlags(const std::string& help) {
  std::set<std::string> flags;
  for (absl::string_view line : absl::StrSplit(help, '\n')) {
    if (absl::StartsWith(line, "    --")) {
      line.remove_prefix(6);
      flags.insert(std::string(line.substr(0, line.find(' '))));
    }
  }
  return flags;
}

TEST(DaemonCliTest, HelpListsEveryFlagGroupedByFile) {
  const RunResult help = RunAgentd({"--help"});
  EXPECT_EQ(help.exit_code, 0) << help.err;
  for (const char* expected :
       {"Flags from daemon/exe/flags.cc:", "--runtime_dir", "--state_dir",
        "--backends", "--shutdown_grace",
        "Flags from backends/tcp/flags.cc:", "--tcp_listen",
        "Flags from backends/ibverbs/flags.cc:", "--ibverbs_device",
        "--flagfile"}) {
    EXPECT_THAT(help.out, HasSubstr(expected));
  }
  EXPECT_THAT(help.out, StartsWith("rdma-agentd: the per-host RDMA"));

  const RunResult full = RunAgentd({"--helpfull"});
  EXPECT_EQ(full.exit_code, 0) << full.err;
  EXPECT_THAT(full.out, HasSubstr("--tcp_listen"));
  // Nothing an operator may set is left to --helpfull.
  EXPECT_THAT(ListedFlags(full.out), IsSubsetOf(ListedFlags(help.out)));
}

TEST(DaemonCliTest, HelpshortListsTheDaemonsOwnFlags) {
  const RunResult help = RunAgentd({"--helpshort"});
  EXPECT_EQ(help.exit_code, 0) << help.err;
  EXPECT_THAT(help.out, HasSubstr("--runtime_dir"));
  EXPECT_THAT(help.out, Not(HasSubstr("--tcp_listen")));
}

TEST(DaemonCliTest, VersionSaysWhatWasBuilt) {
  const RunResult version = RunAgentd({"--version"});
  EXPECT_EQ(version.exit_code, 0) << version.err;
  const std::vector<std::string> lines =
      absl::StrSplit(version.out, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 3u) << version.out;
  EXPECT_EQ(lines[0], std::string("rdma-agentd ") + kAgentVersion);
  // Built in the same mode as this test.
  const std::regex built(R"(built by (gcc|clang) \S+.*, -c )" +
                         std::string(STRINGIFY(RDMA_AGENTD_COMPILATION_MODE)) +
                         R"( \((not )?optimized, assertions (on|off)\))");
  EXPECT_TRUE(std::regex_match(lines[1], built)) << lines[1];
  EXPECT_THAT(lines[2], StartsWith("revision "));
}

TEST(DaemonCliTest, UnknownFlagIsNamed) {
  const RunResult result = RunAgentd({"--no_such_flag=1"});
  EXPECT_NE(result.exit_code, 0);
  EXPECT_THAT(result.err,
              HasSubstr("Unknown command line flag 'no_such_flag'"));
}

TEST(DaemonCliTest, BadValueIsNamed) {
  const RunResult result = RunAgentd({"--max_rpcs=many"});
  EXPECT_NE(result.exit_code, 0);
  EXPECT_THAT(result.err, HasSubstr("'many'"));
  EXPECT_THAT(result.err, HasSubstr("'max_rpcs'"));
}

TEST(DaemonCliTest, StrayArgumentIsRefused) {
  // E.g. a flag file's path given without --flagfile=.
  const RunResult result = RunAgentd({"/etc/rdma-agentd.flags"});
  EXPECT_EQ(result.exit_code, 2);
  EXPECT_THAT(result.err,
              HasSubstr("unexpected argument '/etc/rdma-agentd.flags'"));
}

}  // namespace
}  // namespace rdma_agent

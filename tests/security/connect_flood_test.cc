// One local user floods the API socket with connections at nice 19; root's
// health probe (what the DaemonSet's probes run: rdma-agentctl health with a
// 5 s timeout, a new connection each time) must keep answering SERVING
// within its timeout. A real rdma-agentd; root for the second user.

#include <unistd.h>

#include <algorithm>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/security/local_harness.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/process.h"

namespace rdma_agent::testing {
namespace {

struct Flood {
  int threads;
  int hold;
  bool hello;
};

class ConnectFloodTest : public ::testing::TestWithParam<Flood> {};

TEST_P(ConnectFloodTest, RootsHealthProbesAnswerWithinFiveSeconds) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a second user";
  auto agent = StartSharedAgent();
  ASSERT_TRUE(agent.ok()) << agent.status();
  const Flood flood = GetParam();
  Subprocess::Options spawn;
  spawn.argv = {"nice",
                "-n",
                "19",
                RunfilePath("tests/security/connect_flooder"),
                absl::StrCat("--uid=", kOtherUser),
                absl::StrCat("--gid=", kOtherUser),
                "--socket=" + (*agent)->socket_path(),
                "--try_socket=" + (*agent)->runtime_dir() + "/probe.sock",
                absl::StrCat("--threads=", flood.threads),
                absl::StrCat("--hold=", flood.hold),
                absl::StrCat("--hello=", flood.hello ? "true" : "false")};
  spawn.pipe_stdio = true;
  auto flooder = Subprocess::Spawn(std::move(spawn));
  ASSERT_TRUE(flooder.ok()) << flooder.status();
  auto started = flooder->ReadLine(absl::Seconds(30));
  ASSERT_TRUE(started.ok()) << started.status();
  ASSERT_TRUE(absl::StartsWith(*started, "flooding")) << *started;
  // The probe socket is the agent's and root's only.
  EXPECT_TRUE(absl::EndsWith(*started, "tried Permission denied")) << *started;
  // Let the flood build up, then probe as the DaemonSet does.
  constexpr int kProbes = 15;
  absl::SleepFor(absl::Seconds(2));
  int failed = 0;
  absl::Duration slowest;
  for (int probe = 0; probe < kProbes; ++probe) {
    const absl::Time start = absl::Now();
    auto result = RunToCompletion(
        {RunfilePath("client/rdma-agentctl"), "--target=" + (*agent)->target(),
         "--timeout=5s", "health"},
        "", absl::Seconds(30));
    const absl::Duration took = absl::Now() - start;
    slowest = std::max(slowest, took);
    std::cerr << "probe " << probe << ": " << absl::FormatDuration(took)
              << "\n";
    ASSERT_TRUE(result.ok()) << result.status();
    if (result->exit_code != 0 || took > absl::Seconds(5)) {
      ++failed;
      ADD_FAILURE() << "probe " << probe << " after "
                    << absl::FormatDuration(took) << ": exit "
                    << result->exit_code << " " << result->err;
    }
    absl::SleepFor(absl::Milliseconds(500));
  }
  ASSERT_TRUE(flooder->WriteLine("count").ok());
  auto connects = flooder->ReadLine(absl::Seconds(30));
  ASSERT_TRUE(connects.ok()) << connects.status();
  flooder->CloseStdin();
  EXPECT_TRUE(flooder->Wait(absl::Seconds(30)).ok());
  EXPECT_EQ(failed, 0) << "slowest probe " << absl::FormatDuration(slowest)
                       << "; the flooder's " << *connects;
  std::cerr << "slowest probe " << absl::FormatDuration(slowest)
            << "; the flooder's " << *connects << "\n";
  // The agent still serves its flooder's victims afterwards.
  EXPECT_TRUE((*agent)->client().GetInfo().ok());
}

INSTANTIATE_TEST_SUITE_P(Floods, ConnectFloodTest,
                         ::testing::Values(Flood{16, 0, true},
                                           Flood{16, 128, true}),
                         [](const ::testing::TestParamInfo<Flood>& info) {
                           return absl::StrCat(
                               "Threads", info.param.threads, "Hold",
                               info.param.hold,
                               info.param.hello ? "Preface" : "Silent");
                         });

}  // namespace
}  // namespace rdma_agent::testing

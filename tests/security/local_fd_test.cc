// Local attack 4: one user registers tiny buffers as fast as it can, or
// floods the agent's socket with connections, to use up the agent's fds and
// mappings. Each user is capped well below what the agent can hold (the
// defaults come from its open-file limit), so other users keep registering;
// and when fds do run out, the accept loop backs off, logs it a few times
// rather than millions, and serves again once the flood is gone. Real
// agents; needs root to run other users.

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/rdma_agent_client.h"
#include "common/unique_fd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/security/local_harness.h"

namespace rdma_agent::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
namespace v1 = ::rdma::agent::v1;

class LocalFdTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root to run other users";
  }

  void StartAgent() {
    auto agent = StartSharedAgent();
    ASSERT_TRUE(agent.ok()) << agent.status();
    agent_ = std::move(*agent);
  }

  // A number the agent logged at start right after `prefix`.
  uint64_t LoggedNumber(const std::string& prefix) {
    const std::string log = agent_->Log();
    const size_t at = log.find(prefix);
    uint64_t value = 0;
    if (at == std::string::npos) return 0;
    const std::string rest = log.substr(at + prefix.size(), 24);
    (void)absl::SimpleAtoi(rest.substr(0, rest.find_first_not_of("0123456789")),
                           &value);
    return value;
  }

  void ExpectRegistersAndMovesBytes(LocalWorker& worker) {
    for (const char* how : {"attach 65536", "allocate 4096"}) {
      SCOPED_TRACE(how);
      const std::string registered = worker.Ask(how);
      ASSERT_THAT(registered, StartsWith("ok ")) << registered;
      const std::string id = registered.substr(3);
      EXPECT_EQ(worker.Ask(absl::StrCat("writebuf ", id, " 5eed")),
                "status OK");
      EXPECT_EQ(worker.Ask(absl::StrCat("readbuf ", id, " 2")),
                "status OK 5eed");
    }
  }

  std::unique_ptr<AgentProcess> agent_;
};

TEST_F(LocalFdTest, OneUserRegisteringUntilRefusedLeavesRoomForOthers) {
  StartAgent();
  // The defaults, derived from the agent's open-file limit, are logged at
  // start: per user a quarter of the total, the total below the fd limit.
  EXPECT_TRUE(Eventually(
      [&] { return absl::StrContains(agent_->Log(), "admission limits"); },
      absl::Seconds(5)));
  const uint64_t open_files = LoggedNumber("from ");
  const uint64_t per_user = LoggedNumber("registrations ");
  const uint64_t total =
      LoggedNumber(absl::StrCat("registrations ", per_user, " / "));
  EXPECT_GT(per_user, 0u) << agent_->Log();
  EXPECT_LE(per_user, total / 4);
  EXPECT_LT(total, open_files);

  auto attacker = LocalWorker::Start(*agent_, kNobody);
  ASSERT_TRUE(attacker.ok()) << attacker.status();
  auto other = LocalWorker::Start(*agent_, kOtherUser);
  ASSERT_TRUE(other.ok()) << other.status();
  auto root = LocalWorker::Start(*agent_, -1);
  ASSERT_TRUE(root.ok()) << root.status();

  // The reproduced attack: ~20,000 4 KiB buffers.
  const std::string filled = attacker->Ask("fill_registrations 4096 20000");
  EXPECT_THAT(filled, StartsWith(absl::StrCat("registered ", per_user,
                                              " RESOURCE_EXHAUSTED")));
  EXPECT_THAT(filled, HasSubstr("--max_buffers_per_user"));
  // Far from the fd limit: the others' registrations do not fail.
  EXPECT_LT(static_cast<uint64_t>(OpenFdCount(agent_->pid())),
            open_files - open_files / 4);
  ExpectRegistersAndMovesBytes(*other);
  ExpectRegistersAndMovesBytes(*root);

  // Released, the attacker's quota is its own again.
  EXPECT_EQ(attacker->Ask("release_all"), absl::StrCat("released ", per_user));
  EXPECT_TRUE(Eventually(
      [&] { return absl::StartsWith(attacker->Ask("allocate 4096"), "ok "); },
      absl::Seconds(10)));
}

// A Unix socket connection to `path` that does not block (0 if refused).
UniqueFd ConnectNonBlocking(const std::string& path) {
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  struct sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
  if (!fd || ::connect(fd.get(), reinterpret_cast<struct sockaddr*>(&addr),
                       sizeof(addr)) != 0) {
    return UniqueFd();
  }
  return fd;
}

TEST_F(LocalFdTest, ConnectionFloodBacksOffLogsRarelyAndRecovers) {
  // Started with 256 fds, and connection caps high enough that the fd limit
  // is reached first (as with many users, each within its own cap).
  auto agent =
      StartSharedAgent({"--open_files_limit=256", "--max_connections=100000",
                        "--max_connections_per_user=100000"});
  ASSERT_TRUE(agent.ok()) << agent.status();
  agent_ = std::move(*agent);
  const size_t log_before = agent_->Log().size();

  // Far more connections than the agent has fds (the backlog refuses some
  // while the agent catches up: keep trying); held open for a while.
  std::vector<UniqueFd> flood;
  auto out_of_fds = [&] {
    return absl::StrContains(agent_->Log(), "Too many open files");
  };
  Eventually(
      [&] {
        UniqueFd fd = ConnectNonBlocking(agent_->socket_path());
        if (fd) flood.push_back(std::move(fd));
        return flood.size() >= 600 || (flood.size() > 256 && out_of_fds());
      },
      absl::Seconds(20));
  ASSERT_GT(flood.size(), 256u);
  ASSERT_TRUE(Eventually(out_of_fds, absl::Seconds(10)))
      << "the flood never ran the agent out of fds";
  absl::SleepFor(absl::Seconds(3));  // the flood lasts: the loop must not spin
  const std::string during = agent_->Log();
  EXPECT_LE(CountOf(during, "Too many open files"), 3u);
  EXPECT_LT(during.size() - log_before, 16u * 1024);

  flood.clear();
  // Serves again by itself: a new caller registers and moves bytes.
  bool served = Eventually(
      [&] {
        auto client = agent_->NewClient();
        if (!client.ok()) return false;
        auto registration =
            (*client)->AllocateUnmapped(4096, v1::ACCESS_READ_WRITE);
        if (!registration.ok()) return false;
        if (!(*client)->WriteBuffer(registration->id, 0, "back").ok()) {
          return false;
        }
        auto data = (*client)->ReadBuffer(registration->id, 0, 4);
        return data.ok() && *data == "back";
      },
      absl::Seconds(30));
  EXPECT_TRUE(served) << agent_->Log().substr(log_before);
  EXPECT_TRUE(agent_->Running());
  // And says so, once.
  EXPECT_TRUE(Eventually(
      [&] { return absl::StrContains(agent_->Log(), "accepting on"); },
      absl::Seconds(10)));
}

}  // namespace
}  // namespace rdma_agent::testing

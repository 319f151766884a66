// rdma-agentd in a real memory cgroup of 4 GiB, as the DaemonSet runs it
// (limits.memory: 4Gi): the cgroup bounds the memory the agent allocates
// itself, never memory a client hands over, whose pages are charged to the
// client's own cgroup. Needs root (it creates the cgroup); uses cgroup v2's
// memory.max where the memory controller is on v2, else v1's
// memory.limit_in_bytes.

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/rdma_agent_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/agent_process.h"

namespace rdma_agent::testing {
namespace {

namespace v1 = ::rdma::agent::v1;
using ::testing::HasSubstr;

constexpr uint64_t kGiB = uint64_t{1} << 30;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

bool WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  out.close();
  return out.good();
}

// A memory cgroup of its own with a limit, removed when destroyed (once
// the processes put in it have ended).
class MemoryCgroup {
 public:
  static absl::StatusOr<std::unique_ptr<MemoryCgroup>> Create(uint64_t limit) {
    const std::string name = absl::StrCat("rdma-agentd-test-", ::getpid());
    std::string dir;
    std::string limit_file;
    if (absl::StrContains(ReadFile("/sys/fs/cgroup/cgroup.controllers"),
                          "memory")) {
      dir = "/sys/fs/cgroup/" + name;  // v2: the root enables memory below it
      limit_file = "memory.max";
    } else if (::access("/sys/fs/cgroup/memory", F_OK) == 0) {
      dir = "/sys/fs/cgroup/memory/" + name;  // v1
      limit_file = "memory.limit_in_bytes";
    } else {
      return absl::UnavailableError("no memory cgroup controller");
    }
    if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
      return absl::UnavailableError(
          absl::StrCat("mkdir ", dir, ": ", std::strerror(errno)));
    }
    auto cgroup = std::unique_ptr<MemoryCgroup>(new MemoryCgroup(dir));
    if (!WriteFile(absl::StrCat(dir, "/", limit_file), absl::StrCat(limit))) {
      return absl::UnavailableError(
          absl::StrCat("cannot set ", dir, "/", limit_file));
    }
    return cgroup;
  }
  ~MemoryCgroup() { ::rmdir(dir_.c_str()); }

  const std::string& dir() const { return dir_; }
  // A wrapper command (AgentProcess::Options::wrapper) that moves itself
  // into this cgroup and then becomes the command after it.
  std::vector<std::string> Wrapper() const {
    return {"sh", "-c",
            absl::StrCat("echo $$ > ", dir_, "/cgroup.procs && exec \"$@\""),
            "sh"};
  }

 private:
  explicit MemoryCgroup(std::string dir) : dir_(std::move(dir)) {}
  const std::string dir_;
};

uint64_t PhysicalMemory() {
  return static_cast<uint64_t>(::sysconf(_SC_PHYS_PAGES)) *
         static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
}

class CgroupLimitsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root to create a cgroup";
    // The default per-user limit is a quarter of the host's memory.
    if (PhysicalMemory() / 4 < 2 * kGiB + kGiB / 2) {
      GTEST_SKIP() << "needs 10 GiB of memory for a 2 GiB per-user default";
    }
    auto cgroup = MemoryCgroup::Create(4 * kGiB);
    if (!cgroup.ok()) GTEST_SKIP() << cgroup.status();
    cgroup_ = std::move(*cgroup);
    AgentProcess::Options options;
    options.wrapper = cgroup_->Wrapper();
    options.log_level = "info";
    auto agent = AgentProcess::Start(options);
    ASSERT_TRUE(agent.ok()) << agent.status();
    agent_ = std::move(*agent);
    ASSERT_THAT(ReadFile(absl::StrCat("/proc/", agent_->pid(), "/cgroup")),
                HasSubstr(cgroup_->dir().substr(cgroup_->dir().rfind('/'))));
  }

  // Declared first: removed after the agent has ended.
  std::unique_ptr<MemoryCgroup> cgroup_;
  std::unique_ptr<AgentProcess> agent_;
};

TEST_F(CgroupLimitsTest, ClientMemoryIsNotBoundByTheAgentsCgroup) {
  // A KV cache: the application's 2 GiB, handed over as a memfd (sparse:
  // nothing here touches its pages).
  auto cache = agent_->client().Attach(2 * kGiB, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(cache.ok()) << cache.status();
  EXPECT_EQ(cache->size(), 2 * kGiB);
}

TEST_F(CgroupLimitsTest, MemoryTheAgentAllocatesIsBoundByItsCgroup) {
  // 7/8 of 4 GiB for all users, a quarter of that for one: 896 MiB.
  const uint64_t per_user = (4 * kGiB - 4 * kGiB / 8) / 4;
  auto too_much =
      agent_->client().Allocate(per_user + 4096, v1::ACCESS_READ_WRITE);
  ASSERT_FALSE(too_much.ok());
  EXPECT_EQ(too_much.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(too_much.status().message(),
              HasSubstr("--max_agent_allocated_bytes_per_user"));
  EXPECT_THAT(too_much.status().message(), HasSubstr(absl::StrCat(per_user)));
  auto fits = agent_->client().Allocate(per_user, v1::ACCESS_READ_WRITE);
  EXPECT_TRUE(fits.ok()) << fits.status();
}

TEST_F(CgroupLimitsTest, StartupSaysWhereEachMemoryLimitComesFrom) {
  const std::string log = agent_->Log();
  EXPECT_THAT(
      log, HasSubstr(absl::StrCat(
               "agent-allocated bytes ", (4 * kGiB - 4 * kGiB / 8) / 4, " / ",
               4 * kGiB - 4 * kGiB / 8,
               " (7/8 of the agent's cgroup memory limit of ", 4 * kGiB, ")")));
  EXPECT_THAT(log, HasSubstr(absl::StrCat(
                       "registered bytes ", PhysicalMemory() / 4, " / ",
                       PhysicalMemory(), " (the host's physical memory)")));
  // 3.5 GiB of a bigger host: said at start.
  EXPECT_THAT(log, HasSubstr("is far below the host's"));
}

}  // namespace
}  // namespace rdma_agent::testing

#include "daemon/limits/quota.h"

#include <sys/resource.h>

#include <cstdlib>
#include <fstream>
#include <limits>
#include <optional>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rdma_agent {
namespace {

using ::testing::HasSubstr;

std::shared_ptr<ResourceQuota> TestQuota(uint64_t per_user, uint64_t total) {
  return ResourceQuota::Create("widgets", "max_widgets_per_user",
                               "max_widgets_total", {per_user, total});
}

TEST(ResourceQuotaTest, PerUserLimitRefusesOnlyThatUser) {
  auto quota = TestQuota(2, 10);
  auto a = quota->Reserve(1000, 1);
  auto b = quota->Reserve(1000, 1);
  ASSERT_TRUE(a.ok() && b.ok());
  auto refused = quota->Reserve(1000, 1);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(), HasSubstr("per-user limit of 2"));
  EXPECT_THAT(refused.status().message(), HasSubstr("--max_widgets_per_user"));
  EXPECT_EQ(quota->used(1000), 2u);
  // Another user is not affected.
  EXPECT_TRUE(quota->Reserve(1001, 2).ok());
}

TEST(ResourceQuotaTest, TotalLimitRefusesEveryone) {
  auto quota = TestQuota(4, 6);
  auto a = quota->Reserve(1, 4);
  ASSERT_TRUE(a.ok());
  auto b = quota->Reserve(2, 2);
  ASSERT_TRUE(b.ok());
  auto refused = quota->Reserve(3, 1);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(), HasSubstr("limit of 6"));
  EXPECT_THAT(refused.status().message(), HasSubstr("--max_widgets_total"));
  EXPECT_EQ(quota->used(3), 0u);
  EXPECT_EQ(quota->used_total(), 6u);
}

TEST(ResourceQuotaTest, ChargesGiveBackExactlyOnce) {
  auto quota = TestQuota(100, 100);
  {
    auto charge = quota->Reserve(7, 30);
    ASSERT_TRUE(charge.ok());
    QuotaCharge moved = std::move(*charge);
    EXPECT_EQ(quota->used(7), 30u);
    QuotaCharge assigned;
    assigned = std::move(moved);
    EXPECT_EQ(quota->used(7), 30u);
    assigned.Reset();
    EXPECT_EQ(quota->used(7), 0u);
    assigned.Reset();  // nothing left to give back
  }
  EXPECT_EQ(quota->used_total(), 0u);
}

TEST(ResourceQuotaTest, HugeAmountsAreRefusedWithoutWrapping) {
  auto quota = TestQuota(uint64_t{1} << 40, uint64_t{1} << 41);
  auto held = quota->Reserve(5, 4096);
  ASSERT_TRUE(held.ok());
  EXPECT_FALSE(quota->Reserve(5, std::numeric_limits<uint64_t>::max()).ok());
  EXPECT_FALSE(
      quota->Reserve(5, std::numeric_limits<uint64_t>::max() - 100).ok());
  EXPECT_EQ(quota->used(5), 4096u);
}

TEST(ResourceQuotaTest, ChargeMayOutliveItsOwnerReference) {
  auto quota = TestQuota(1, 1);
  auto charge = quota->Reserve(1, 1);
  ASSERT_TRUE(charge.ok());
  std::weak_ptr<ResourceQuota> weak = quota;
  quota.reset();
  EXPECT_FALSE(weak.expired());  // the charge keeps it
  charge->Reset();
  EXPECT_TRUE(weak.expired());
}

TEST(DeriveQuotaLimitsTest, PerUserIsAQuarterOfTotalAndFitsTheProcess) {
  HostLimits host;
  host.open_files = 20000;
  host.max_map_count = 65530;
  host.memory_bytes = uint64_t{16} << 30;
  const QuotaLimits limits = DeriveQuotaLimits({}, host);
  // 20000 fds minus a quarter for sockets: 15000 fd-and-mapping objects.
  EXPECT_EQ(limits.registrations.total + limits.pending_attach.total, 15000u);
  EXPECT_EQ(limits.registrations.total, 11250u);
  EXPECT_EQ(limits.registrations.per_user, 11250u / 4);
  EXPECT_EQ(limits.pending_attach.per_user, limits.pending_attach.total / 4);
  EXPECT_EQ(limits.bytes.total, uint64_t{16} << 30);
  EXPECT_EQ(limits.bytes.per_user, uint64_t{4} << 30);
  EXPECT_EQ(limits.attach_connections.total, 256u);
  EXPECT_EQ(limits.attach_connections.per_user, 64u);
  // A pidfd each, out of the 5000 fds of the reserve: capped at 1024.
  EXPECT_EQ(limits.watched_clients.total, 1024u);
  EXPECT_EQ(limits.watched_clients.per_user, 256u);
}

TEST(DeriveQuotaLimitsTest, MapCountBoundsWhenFdsArePlenty) {
  HostLimits host;
  host.open_files = 1 << 20;
  host.max_map_count = 65530;
  host.memory_bytes = uint64_t{1} << 30;
  const QuotaLimits limits = DeriveQuotaLimits({}, host);
  EXPECT_LE(limits.registrations.total + limits.pending_attach.total,
            65530u - 65530u / 4);
}

TEST(DeriveQuotaLimitsTest, TinyLimitsStillLeaveAReserveAndAllowSomething) {
  HostLimits host;
  host.open_files = 64;
  host.max_map_count = 65530;
  host.memory_bytes = uint64_t{1} << 30;
  const QuotaLimits limits = DeriveQuotaLimits({}, host);
  EXPECT_LE(limits.registrations.total + limits.pending_attach.total, 32u);
  EXPECT_GE(limits.registrations.per_user, 1u);
  EXPECT_GE(limits.pending_attach.per_user, 1u);
  // A quarter of the 32-fd reserve.
  EXPECT_EQ(limits.watched_clients.total, 8u);
  EXPECT_GE(limits.watched_clients.per_user, 1u);
}

TEST(DeriveQuotaLimitsTest, SetLimitsAreKeptAndPerUserNeverExceedsTotal) {
  HostLimits host;
  host.open_files = 20000;
  host.max_map_count = 65530;
  host.memory_bytes = uint64_t{16} << 30;
  QuotaLimits set;
  set.registrations = {500, 100};  // per user above total: lowered
  set.bytes.total = 4096;          // per user derived from it
  const QuotaLimits limits = DeriveQuotaLimits(set, host);
  EXPECT_EQ(limits.registrations.total, 100u);
  EXPECT_EQ(limits.registrations.per_user, 100u);
  EXPECT_EQ(limits.bytes.total, 4096u);
  EXPECT_EQ(limits.bytes.per_user, 1024u);
}

TEST(DeriveQuotaLimitsTest, TheAgentsCgroupBoundsOnlyWhatItAllocates) {
  HostLimits host;
  host.open_files = 20000;
  host.max_map_count = 65530;
  host.memory_bytes = uint64_t{64} << 30;
  host.cgroup_memory_bytes = uint64_t{4} << 30;
  const QuotaLimits limits = DeriveQuotaLimits({}, host);
  EXPECT_EQ(limits.bytes.total, uint64_t{64} << 30);
  EXPECT_EQ(limits.bytes.per_user, uint64_t{16} << 30);
  EXPECT_EQ(limits.agent_allocated.total, uint64_t{3584} << 20);
  EXPECT_EQ(limits.agent_allocated.per_user, uint64_t{896} << 20);
  const MemoryLimitOrigins origins = DescribeMemoryLimits({}, host);
  EXPECT_EQ(origins.registered, "the host's physical memory");
  EXPECT_EQ(origins.agent_allocated,
            "7/8 of the agent's cgroup memory limit of 4294967296");
  // A cgroup limit above the host's memory changes nothing.
  host.cgroup_memory_bytes = uint64_t{128} << 30;
  EXPECT_EQ(DeriveQuotaLimits({}, host).agent_allocated.total,
            uint64_t{64} << 30);
  EXPECT_EQ(DescribeMemoryLimits({}, host).agent_allocated,
            "the host's physical memory");
}

TEST(DeriveQuotaLimitsTest, MemlockBoundsRegistrationsOnlyWhereANicPins) {
  HostLimits host;
  host.open_files = 20000;
  host.max_map_count = 65530;
  host.memory_bytes = uint64_t{64} << 30;
  host.memlock_bytes = uint64_t{8} << 20;
  EXPECT_EQ(DeriveQuotaLimits({}, host).bytes.total, uint64_t{64} << 30);
  host.memory_pinned = true;
  const QuotaLimits limits = DeriveQuotaLimits({}, host);
  EXPECT_EQ(limits.bytes.total, uint64_t{8} << 20);
  EXPECT_EQ(limits.agent_allocated.total, uint64_t{64} << 30);
  EXPECT_THAT(DescribeMemoryLimits({}, host).registered,
              HasSubstr("RLIMIT_MEMLOCK of 8388608"));
  // A flag wins, and is named.
  QuotaLimits asked;
  asked.bytes.total = uint64_t{1} << 40;
  asked.agent_allocated.total = uint64_t{1} << 30;
  EXPECT_EQ(DeriveQuotaLimits(asked, host).bytes.total, uint64_t{1} << 40);
  const MemoryLimitOrigins origins = DescribeMemoryLimits(asked, host);
  EXPECT_EQ(origins.registered, "--max_registered_bytes_total");
  EXPECT_EQ(origins.agent_allocated, "--max_agent_allocated_bytes_total");
}

TEST(SetOpenFileLimitTest, SetsTheSoftLimitWithinTheHardOne) {
  struct rlimit saved = {};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &saved), 0);
  ASSERT_GE(saved.rlim_max, 512u);
  EXPECT_EQ(SetOpenFileLimit(256), 256u);
  EXPECT_EQ(ReadHostLimits().open_files, 256u);
  // 0 raises it to the hard limit; more than the hard limit is capped.
  EXPECT_EQ(SetOpenFileLimit(0), saved.rlim_max);
  EXPECT_EQ(SetOpenFileLimit(saved.rlim_max + 1), saved.rlim_max);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &saved), 0);
}

class CgroupMemoryLimitTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/cgroup-test.XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    root_ = pattern;
  }
  void TearDown() override { (void)std::system(("rm -rf " + root_).c_str()); }
  void Write(const std::string& relative, const std::string& text) {
    const std::string path = root_ + relative;
    (void)std::system(("mkdir -p " + path.substr(0, path.rfind('/'))).c_str());
    std::ofstream(path) << text;
  }
  std::string root_;
};

TEST_F(CgroupMemoryLimitTest, V2MemoryMaxOfTheProcesssCgroup) {
  Write("/system.slice/rdma-agentd.service/memory.max", "8589934592\n");
  EXPECT_EQ(CgroupMemoryLimit("0::/system.slice/rdma-agentd.service\n", root_),
            uint64_t{8} << 30);
}

TEST_F(CgroupMemoryLimitTest, NoLimitIsNone) {
  Write("/a/memory.max", "max\n");
  EXPECT_EQ(CgroupMemoryLimit("0::/a\n", root_), std::nullopt);
  // v1's "unlimited": LLONG_MAX rounded down to a page.
  Write("/memory/b/memory.limit_in_bytes", "9223372036854771712\n");
  EXPECT_EQ(CgroupMemoryLimit("4:memory:/b\n0::/\n", root_), std::nullopt);
  EXPECT_EQ(CgroupMemoryLimit("", root_), std::nullopt);
  EXPECT_EQ(CgroupMemoryLimit("0::/missing\n", root_), std::nullopt);
}

TEST_F(CgroupMemoryLimitTest, V1MemoryControllerWhenV2HasNone) {
  Write("/memory/docker/abc/memory.limit_in_bytes", "1073741824\n");
  EXPECT_EQ(CgroupMemoryLimit("9:cpu,cpuacct:/docker/abc\n"
                              "4:memory:/docker/abc\n0::/\n",
                              root_),
            uint64_t{1} << 30);
}

TEST(HostLimitsTest, ReadsSomethingPlausible) {
  const HostLimits host = ReadHostLimits();
  EXPECT_GT(host.open_files, 0u);
  EXPECT_GT(host.max_map_count, 0u);
  EXPECT_GT(host.memory_bytes, uint64_t{1} << 20);
}

}  // namespace
}  // namespace rdma_agent

// The libibverbs implementation where this host has no RDMA device (the CI
// case): it reports none, and the backend and the daemon's factory report
// the backend unavailable with a reason instead of failing.
#include "backends/ibverbs/real_verbs.h"

#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/time/time.h"
#include "backends/ibverbs/flags.h"
#include "backends/ibverbs/ibverbs_backend.h"
#include "gtest/gtest.h"

ABSL_DECLARE_FLAG(bool, ibverbs_enable);
ABSL_DECLARE_FLAG(int32_t, ibverbs_mtu);
ABSL_DECLARE_FLAG(int32_t, ibverbs_retry_cnt);
ABSL_DECLARE_FLAG(int32_t, ibverbs_sq_depth);
ABSL_DECLARE_FLAG(std::vector<std::string>, ibverbs_devices);
ABSL_DECLARE_FLAG(std::string, ibverbs_device);
ABSL_DECLARE_FLAG(absl::Duration, ibverbs_rail_cooldown);
ABSL_DECLARE_FLAG(std::string, ibverbs_numa_policy);
ABSL_DECLARE_FLAG(double, ibverbs_numa_near_share);
ABSL_DECLARE_FLAG(std::string, ibverbs_sysfs_root);

namespace rdma_agent::ibverbs {
namespace {

bool HostHasDevices() {
  auto names = verbs::MakeRealVerbs()->ListDevices();
  return names.ok() && !names->empty();
}

TEST(RealVerbsTest, ListsDevicesWithoutFailing) {
  auto names = verbs::MakeRealVerbs()->ListDevices();
  ASSERT_TRUE(names.ok()) << names.status();
}

TEST(RealVerbsTest, OpeningAnUnknownDeviceIsNotFound) {
  EXPECT_EQ(verbs::MakeRealVerbs()->OpenDevice("no_such_dev0").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(RealVerbsTest, BackendIsUnavailableWithoutDevices) {
  if (HostHasDevices()) GTEST_SKIP() << "this host has an RDMA device";
  BackendEnvironment env;
  env.identity.agent_id = "a";
  auto backend = IbverbsBackend::Create(env, {}, verbs::MakeRealVerbs());
  ASSERT_TRUE(backend.ok()) << backend.status();
  EXPECT_FALSE((*backend)->available());
  EXPECT_NE((*backend)->unavailable_reason().find("no RDMA device"),
            std::string::npos)
      << (*backend)->unavailable_reason();
  EXPECT_EQ((*backend)->transport_info().devices_size(), 0);
  v1::RemoteBuffer remote;
  remote.add_endpoints()->set_backend("ibverbs");
  EXPECT_FALSE((*backend)->CanReach(remote));
}

TEST(RealVerbsTest, FlagsFactorySpawnsAnUnavailableBackendHere) {
  if (HostHasDevices()) GTEST_SKIP() << "this host has an RDMA device";
  BackendEnvironment env;
  auto backend = MakeIbverbsBackendFactoryFromFlags()(env);
  ASSERT_TRUE(backend.ok()) << backend.status();
  EXPECT_EQ((*backend)->name(), "ibverbs");
  EXPECT_EQ((*backend)->transport_level(), v1::TRANSPORT_LEVEL_NIC);
  EXPECT_FALSE((*backend)->available());
}

TEST(FlagsTest, FlagsBecomeOptions) {
  absl::SetFlag(&FLAGS_ibverbs_enable, false);
  absl::SetFlag(&FLAGS_ibverbs_mtu, 2048);
  absl::SetFlag(&FLAGS_ibverbs_sq_depth, 64);
  auto options = IbverbsOptionsFromFlags();
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_FALSE(options->enabled);
  EXPECT_EQ(options->qp.mtu_bytes, 2048u);
  EXPECT_EQ(options->qp.sq_depth, 64u);
  EXPECT_FALSE(options->qp.timeout.has_value());  // profile default
  absl::SetFlag(&FLAGS_ibverbs_retry_cnt, 9);
  EXPECT_EQ(IbverbsOptionsFromFlags().status().code(),
            absl::StatusCode::kInvalidArgument);
  BackendEnvironment env;
  EXPECT_EQ(MakeIbverbsBackendFactoryFromFlags()(env).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::SetFlag(&FLAGS_ibverbs_retry_cnt, -1);
  absl::SetFlag(&FLAGS_ibverbs_enable, true);
  absl::SetFlag(&FLAGS_ibverbs_mtu, 0);
  absl::SetFlag(&FLAGS_ibverbs_sq_depth, 0);
}

TEST(FlagsTest, DevicesListAndTheSingleDeviceFlag) {
  absl::SetFlag(&FLAGS_ibverbs_devices,
                std::vector<std::string>({"mlx5_0", "mlx5_1"}));
  auto options = IbverbsOptionsFromFlags();
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->devices, std::vector<std::string>({"mlx5_0", "mlx5_1"}));
  // Both at once is a configuration mistake.
  absl::SetFlag(&FLAGS_ibverbs_device, "mlx5_2");
  EXPECT_EQ(IbverbsOptionsFromFlags().status().code(),
            absl::StatusCode::kInvalidArgument);
  // The old flag alone is a list of one.
  absl::SetFlag(&FLAGS_ibverbs_devices, std::vector<std::string>());
  options = IbverbsOptionsFromFlags();
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->devices, std::vector<std::string>({"mlx5_2"}));
  absl::SetFlag(&FLAGS_ibverbs_device, "");
  options = IbverbsOptionsFromFlags();
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_TRUE(options->devices.empty());  // every device
  EXPECT_EQ(options->stripe_threshold_bytes, 64u << 10);
  absl::SetFlag(&FLAGS_ibverbs_rail_cooldown, absl::Seconds(60));
  EXPECT_EQ(IbverbsOptionsFromFlags().status().code(),
            absl::StatusCode::kInvalidArgument)
      << "cooldown above its maximum";
  absl::SetFlag(&FLAGS_ibverbs_rail_cooldown, absl::Seconds(1));
}

TEST(FlagsTest, NumaAffinityFlags) {
  auto options = IbverbsOptionsFromFlags();
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->numa_policy, IbverbsOptions::NumaPolicy::kNearest);
  EXPECT_DOUBLE_EQ(options->numa_near_share, 0.5);
  EXPECT_EQ(options->sysfs_root, "/sys");
  absl::SetFlag(&FLAGS_ibverbs_numa_policy, "all");
  absl::SetFlag(&FLAGS_ibverbs_numa_near_share, 0.25);
  absl::SetFlag(&FLAGS_ibverbs_sysfs_root, "/tmp/host/sys");
  options = IbverbsOptionsFromFlags();
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->numa_policy, IbverbsOptions::NumaPolicy::kAll);
  EXPECT_DOUBLE_EQ(options->numa_near_share, 0.25);
  EXPECT_EQ(options->sysfs_root, "/tmp/host/sys");
  absl::SetFlag(&FLAGS_ibverbs_numa_policy, "closest");
  EXPECT_EQ(IbverbsOptionsFromFlags().status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::SetFlag(&FLAGS_ibverbs_numa_policy, "nearest");
  absl::SetFlag(&FLAGS_ibverbs_numa_near_share, 1.5);
  EXPECT_EQ(IbverbsOptionsFromFlags().status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::SetFlag(&FLAGS_ibverbs_numa_near_share, 0.5);
  absl::SetFlag(&FLAGS_ibverbs_sysfs_root, "/sys");
}

}  // namespace
}  // namespace rdma_agent::ibverbs

// The backend's transfers on real RDMA devices (NICs, or soft-RoCE:
// `rdma link add rxe0 type rxe netdev eth0`). Two agents in this process
// share the host's devices and move bytes NIC to NIC (loopback through the
// devices). Skips where there is no device, and the multi-rail cases where
// fewer than two ports are ACTIVE; see backends/ibverbs/README.md.
//
// RDMA_AGENT_TEST_DEVICES=mlx5_0,mlx5_1 picks the devices (default: all;
// RDMA_AGENT_TEST_DEVICE, one device, is still understood);
// RDMA_AGENT_TEST_GID_INDEX the GID index (RoCE).
//
// Every case also runs on a three-device software NIC, so that what the
// cases check is itself checked where there is no hardware.
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"

#include "backends/ibverbs/ibverbs_backend.h"
#include "backends/ibverbs/real_verbs.h"
#include "backends/testing/harness.h"
#include "backends/testing/ibverbs_agent.h"
#include "gtest/gtest.h"

namespace rdma_agent::ibverbs {
namespace {

using ::rdma_agent::testing::IbverbsAgent;
using ::rdma_agent::testing::MakeOp;
using ::rdma_agent::testing::SoftIbverbsAgent;
using ::rdma_agent::testing::TestAgent;
using ::rdma_agent::testing::TestBuffer;

enum class Nic { kHardware, kSoft };

class HardwareTest : public ::testing::TestWithParam<Nic> {
 protected:
  void SetUp() override {
    if (GetParam() == Nic::kSoft) {
      const std::vector<std::string> devices = {"soft_0", "soft_1", "soft_2"};
      for (const std::string& device : devices) {
        verbs::SoftDeviceConfig config;
        config.name = device;
        ASSERT_TRUE(fabric_.AddDevice(config).ok());
      }
      a_ = SoftIbverbsAgent(fabric_, "hw-a", devices);
      b_ = SoftIbverbsAgent(fabric_, "hw-b", devices);
      ASSERT_NE(a_, nullptr);
      ASSERT_NE(b_, nullptr);
      return;
    }
    auto names = verbs::MakeRealVerbs()->ListDevices();
    if (!names.ok() || names->empty()) {
      GTEST_SKIP() << "no RDMA device on this host (ibv_get_device_list "
                      "found none): the hardware test needs a NIC or "
                      "soft-RoCE (rdma link add rxe0 type rxe netdev "
                      "eth0); see backends/ibverbs/README.md";
    }
    IbverbsOptions options;
    if (const char* devices = std::getenv("RDMA_AGENT_TEST_DEVICES")) {
      options.devices = absl::StrSplit(devices, ',', absl::SkipEmpty());
    } else if (const char* device = std::getenv("RDMA_AGENT_TEST_DEVICE")) {
      options.devices = {device};
    }
    if (const char* gid = std::getenv("RDMA_AGENT_TEST_GID_INDEX")) {
      options.qp.gid_index = std::atoi(gid);
    }
    a_ = IbverbsAgent(verbs::MakeRealVerbs(), "hw-a", options);
    b_ = IbverbsAgent(verbs::MakeRealVerbs(), "hw-b", options);
    ASSERT_NE(a_, nullptr);
    ASSERT_NE(b_, nullptr);
    if (!a_->backend<IbverbsBackend>().available()) {
      GTEST_SKIP() << "RDMA device present but unusable: "
                   << a_->backend<IbverbsBackend>().unavailable_reason();
    }
  }

  verbs::SoftFabric fabric_;  // kSoft only; outlives the agents
  std::unique_ptr<TestAgent> a_;
  std::unique_ptr<TestAgent> b_;
};

INSTANTIATE_TEST_SUITE_P(Nics, HardwareTest,
                         ::testing::Values(Nic::kHardware, Nic::kSoft),
                         [](const ::testing::TestParamInfo<Nic>& info) {
                           return info.param == Nic::kSoft ? "SoftNic"
                                                           : "Hardware";
                         });

TEST_P(HardwareTest, MovesExactBytesAtOddOffsets) {
  const uint64_t kSize = 8 << 20;
  TestBuffer local = a_->Register(kSize, v1::ACCESS_READ_WRITE, 3);
  TestBuffer remote = b_->Register(kSize, v1::ACCESS_READ_WRITE, 101);
  const uint64_t max = a_->backend<IbverbsBackend>().params().max_message_bytes;
  struct Case {
    v1::OpType type;
    uint64_t local_offset, length, remote_offset;
  };
  const std::vector<Case> cases = {
      {v1::OP_TYPE_WRITE_FROM_LOCAL, 1, 1, 3},
      {v1::OP_TYPE_WRITE_FROM_LOCAL, 7, 4097, 11},
      {v1::OP_TYPE_READ_INTO_LOCAL, 13, 1 << 20, 99},
      {v1::OP_TYPE_WRITE_FROM_LOCAL, 5, std::min<uint64_t>(max + 3, kSize - 5),
       0},
      {v1::OP_TYPE_READ_INTO_LOCAL, 0, kSize, 0},
  };
  for (const Case& c : cases) {
    std::vector<uint8_t> local_before(local.bytes(), local.bytes() + kSize);
    std::vector<uint8_t> remote_before(remote.bytes(), remote.bytes() + kSize);
    auto results = a_->backend<IbverbsBackend>().Submit(
        {MakeOp(0, c.type, local, c.local_offset, c.length, remote,
                c.remote_offset)},
        absl::Now() + absl::Seconds(30));
    ASSERT_TRUE(results[0].ok()) << results[0];
    const bool write = c.type == v1::OP_TYPE_WRITE_FROM_LOCAL;
    const std::vector<uint8_t>& dst_before =
        write ? remote_before : local_before;
    const std::vector<uint8_t>& src = write ? local_before : remote_before;
    const uint8_t* dst = write ? remote.bytes() : local.bytes();
    const uint64_t dst_offset = write ? c.remote_offset : c.local_offset;
    const uint64_t src_offset = write ? c.local_offset : c.remote_offset;
    for (uint64_t i = 0; i < kSize; ++i) {
      const bool inside = i >= dst_offset && i < dst_offset + c.length;
      ASSERT_EQ(dst[i],
                inside ? src[i - dst_offset + src_offset] : dst_before[i])
          << "byte " << i;
    }
    for (uint64_t i = 0; i < kSize; i += 101) local.bytes()[i] ^= 0x3c;
  }
}

TEST_P(HardwareTest, ManyOpsAndAccessErrors) {
  TestBuffer local = a_->Register(1 << 20, v1::ACCESS_READ_WRITE, 1);
  TestBuffer read_only = b_->Register(1 << 20, v1::ACCESS_READ, 2);
  std::vector<Op> ops;
  for (uint64_t i = 0; i < 4096; ++i) {
    ops.push_back(MakeOp(i, v1::OP_TYPE_READ_INTO_LOCAL, local, i * 256, 256,
                         read_only, i * 256));
  }
  for (const absl::Status& status : a_->backend<IbverbsBackend>().Submit(
           ops, absl::Now() + absl::Seconds(60))) {
    ASSERT_TRUE(status.ok()) << status;
  }
  EXPECT_EQ(0, std::memcmp(local.bytes(), read_only.bytes(), 1 << 20));
  auto refused = a_->backend<IbverbsBackend>().Submit(
      {MakeOp(0, v1::OP_TYPE_WRITE_FROM_LOCAL, local, 0, 64, read_only, 0)},
      absl::Now() + absl::Seconds(30));
  EXPECT_EQ(refused[0].code(), absl::StatusCode::kPermissionDenied);
}

// Every rail of the host carries a share of a large op, and the bytes land
// exactly; small ops spread over the rails too.
TEST_P(HardwareTest, StripesOverEveryRail) {
  IbverbsBackend& backend = a_->backend<IbverbsBackend>();
  const std::vector<std::string> rails = backend.rail_names();
  if (rails.size() < 2) {
    GTEST_SKIP() << "one ACTIVE port (" << rails[0]
                 << "): striping needs two rails or more (a second NIC, or "
                    "a second soft-RoCE device on another netdev)";
  }
  const uint64_t kSize = 64 << 20;
  TestBuffer local = a_->Register(kSize, v1::ACCESS_READ_WRITE, 5);
  TestBuffer remote = b_->Register(kSize, v1::ACCESS_READ_WRITE, 77);
  std::map<std::string, uint64_t> before;
  for (const std::string& rail : rails) before[rail] = backend.rail_bytes(rail);

  // One op large enough to be striped, at odd offsets.
  const uint64_t length = kSize - 4099;
  std::vector<uint8_t> remote_before(remote.bytes(), remote.bytes() + kSize);
  auto results = backend.Submit(
      {MakeOp(0, v1::OP_TYPE_WRITE_FROM_LOCAL, local, 3, length, remote, 7)},
      absl::Now() + absl::Seconds(60));
  ASSERT_TRUE(results[0].ok()) << results[0];
  for (uint64_t i = 0; i < kSize; ++i) {
    const bool inside = i >= 7 && i < 7 + length;
    ASSERT_EQ(remote.bytes()[i],
              inside ? local.bytes()[i - 7 + 3] : remote_before[i])
        << "byte " << i;
  }
  for (const std::string& rail : rails) {
    EXPECT_GT(backend.rail_bytes(rail), before[rail])
        << rail << " carried nothing of a " << length << "-byte op";
    before[rail] = backend.rail_bytes(rail);
  }

  // Many small ops in one batch: no rail is left idle.
  std::vector<Op> ops;
  for (uint64_t i = 0; i < 1024; ++i) {
    ops.push_back(MakeOp(i, v1::OP_TYPE_READ_INTO_LOCAL, local, i * 4096, 4096,
                         remote, i * 4096 + 1));
  }
  for (const absl::Status& status :
       backend.Submit(ops, absl::Now() + absl::Seconds(60))) {
    ASSERT_TRUE(status.ok()) << status;
  }
  EXPECT_EQ(0, std::memcmp(local.bytes(), remote.bytes() + 1, 1024 * 4096));
  for (const std::string& rail : rails) {
    EXPECT_GT(backend.rail_bytes(rail), before[rail])
        << rail << " carried none of 1024 small ops";
  }
}

}  // namespace
}  // namespace rdma_agent::ibverbs

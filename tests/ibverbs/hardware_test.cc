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
#include <fcntl.h>
#include <linux/udmabuf.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <unistd.h>

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
#include "common/unique_fd.h"
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

// Device memory through ibv_reg_dmabuf_mr must move exactly the bytes
// asked, as either side of an op. On hardware the dma-buf is a real one,
// made from a memfd by the kernel's udmabuf driver (the stand-in for GPU
// memory); skips without /dev/udmabuf or when the NIC's driver does not
// take dma-bufs. On the soft NIC the memfd itself stands in for it.
TEST_P(HardwareTest, MovesBytesThroughADmaBufMr) {
  constexpr uint64_t kBytes = 4 << 20;
  constexpr uint64_t kOffset = 64 << 10;  // the registered range's start
  constexpr uint64_t kLength = 2 << 20;
  UniqueFd memfd(::memfd_create("hardware-dmabuf", MFD_ALLOW_SEALING));
  ASSERT_TRUE(memfd.valid());
  ASSERT_EQ(::ftruncate(memfd.get(), kBytes), 0);
  // udmabuf wants the memfd sealed against shrinking.
  ASSERT_EQ(::fcntl(memfd.get(), F_ADD_SEALS, F_SEAL_SHRINK), 0);
  UniqueFd dmabuf;
  if (GetParam() == Nic::kSoft) {
    dmabuf.reset(::dup(memfd.get()));
  } else {
    UniqueFd udmabuf(::open("/dev/udmabuf", O_RDWR | O_CLOEXEC));
    if (!udmabuf) {
      GTEST_SKIP() << "no /dev/udmabuf (modprobe udmabuf) to make a dma-buf "
                      "from host memory: "
                   << std::strerror(errno);
    }
    udmabuf_create create = {};
    create.memfd = static_cast<__u32>(memfd.get());
    create.offset = 0;
    create.size = kBytes;
    dmabuf.reset(::ioctl(udmabuf.get(), UDMABUF_CREATE, &create));
  }
  ASSERT_TRUE(dmabuf.valid()) << "dma-buf: " << std::strerror(errno);
  auto* view = static_cast<uint8_t*>(::mmap(
      nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd.get(), 0));
  ASSERT_NE(view, MAP_FAILED);
  for (uint64_t i = 0; i < kBytes; ++i) view[i] = static_cast<uint8_t>(i * 5);

  DeviceMemory::Description description;
  description.offset = kOffset;
  description.length = kLength;
  description.kind = v1::MEMORY_KIND_OTHER;
  auto memory = DeviceMemory::Adopt(
      std::move(dmabuf), description,
      [](uint64_t) -> absl::StatusOr<std::unique_ptr<MappingCharge>> {
        return nullptr;
      });
  ASSERT_TRUE(memory.ok()) << memory.status();
  const uint64_t id = a_->table().NextId();
  auto registration = std::make_shared<Registration>(
      id, /*owner=*/0, v1::ACCESS_READ_WRITE, "dmabuf", "dmabuf-token",
      std::move(*memory), /*agent_allocated=*/false);
  auto context = std::make_shared<v1::RemoteBuffer>();
  context->set_agent_id(a_->identity().agent_id);
  context->set_agent_epoch(a_->identity().epoch);
  context->set_buffer_id(id);
  context->set_size_bytes(kLength);
  context->set_access(v1::ACCESS_READ_WRITE);
  context->set_token("dmabuf-token");
  context->set_memory_kind(v1::MEMORY_KIND_OTHER);
  v1::BackendEndpoint* endpoint = context->add_endpoints();
  auto state = a_->backend<IbverbsBackend>().Register(*registration, endpoint);
  if (!state.ok() && absl::IsInvalidArgument(state.status())) {
    ::munmap(view, kBytes);
    GTEST_SKIP() << "the device does not register dma-bufs: " << state.status();
  }
  ASSERT_TRUE(state.ok()) << state.status();
  endpoint->set_backend("ibverbs");
  registration->AddBackend("ibverbs", std::move(*state));
  a_->table().Add(registration);
  TestBuffer device{registration, context, 0};
  TestBuffer host = b_->Register(kLength, v1::ACCESS_READ_WRITE, 9);

  // Device memory as the local side, then as the remote side.
  auto results = a_->backend<IbverbsBackend>().Submit(
      {MakeOp(0, v1::OP_TYPE_READ_INTO_LOCAL, device, 100, 300000, host, 7)},
      absl::Now() + absl::Seconds(30));
  ASSERT_TRUE(results[0].ok()) << results[0];
  EXPECT_EQ(0, std::memcmp(view + kOffset + 100, host.bytes() + 7, 300000));
  EXPECT_EQ(view[kOffset + 99], static_cast<uint8_t>((kOffset + 99) * 5));
  EXPECT_EQ(view[kOffset + 100 + 300000],
            static_cast<uint8_t>((kOffset + 100 + 300000) * 5));
  results = b_->backend<IbverbsBackend>().Submit(
      {MakeOp(0, v1::OP_TYPE_READ_INTO_LOCAL, host, 0, kLength, device, 0)},
      absl::Now() + absl::Seconds(30));
  ASSERT_TRUE(results[0].ok()) << results[0];
  EXPECT_EQ(0, std::memcmp(host.bytes(), view + kOffset, kLength));
  ::munmap(view, kBytes);
}

}  // namespace
}  // namespace rdma_agent::ibverbs

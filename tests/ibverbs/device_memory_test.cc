// Device memory end to end, through the API and the client library, between
// in-process agents with memory, tcp and ibverbs (software RC NIC) backends.
// A memfd stands in for the dma-buf (the soft NIC maps it as a real NIC
// reaches GPU memory), and the test maps it too, to check every byte.
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backends/ibverbs/ibverbs_backend.h"
#include "backends/ibverbs/soft/soft_verbs.h"
#include "backends/testing/ibverbs_agent.h"
#include "client/internal/attach_socket.h"
#include "client/rdma_agent_client.h"
#include "common/unique_fd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "rdma/agent/v1/attach.pb.h"
#include "rdma/agent/v1/remote_buffer.pb.h"
#include "tests/testing/agent_fixture.h"
#include "tests/testing/backend_factories.h"

namespace rdma_agent {
namespace {

using client::AgentClient;
using client::DeviceMemorySpec;
using client::OpResult;
using client::OpSpec;
using ibverbs::IbverbsOptions;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::InProcessAgent;

constexpr uint64_t kSize = 256 * 1024;
// Not page-aligned: the registered range starts inside the dma-buf's second
// page, as a tensor inside a CUDA allocation does.
constexpr uint64_t kOffset = 4096 + 512;
// Bytes of the dma-buf past the registered range, which no op may touch.
constexpr uint64_t kTail = 4096;

char PatternByte(uint8_t seed, uint64_t i) {
  return static_cast<char>(seed + i * 7 + (i >> 11));
}

std::string Pattern(uint8_t seed, uint64_t length) {
  std::string bytes(length, '\0');
  for (uint64_t i = 0; i < length; ++i) bytes[i] = PatternByte(seed, i);
  return bytes;
}

// A memfd posing as a GPU allocation's dma-buf, mapped here so the test sees
// what the NIC wrote; registered as CUDA device memory [kOffset, kOffset +
// kSize).
class FakeDeviceAllocation {
 public:
  explicit FakeDeviceAllocation(uint8_t seed)
      : fd_(::memfd_create("fake-gpu-allocation", MFD_CLOEXEC)),
        bytes_(kOffset + kSize + kTail) {
    EXPECT_TRUE(fd_.valid());
    EXPECT_EQ(::ftruncate(fd_.get(), static_cast<off_t>(bytes_)), 0);
    void* map = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED,
                       fd_.get(), 0);
    EXPECT_NE(map, MAP_FAILED);
    map_ = static_cast<char*>(map);
    const std::string fill = Pattern(seed, bytes_);
    std::memcpy(map_, fill.data(), bytes_);
  }
  ~FakeDeviceAllocation() { ::munmap(map_, bytes_); }

  DeviceMemorySpec Spec(uint32_t device_index = 1) const {
    DeviceMemorySpec spec;
    spec.dmabuf_fd = fd_.get();
    spec.offset = kOffset;
    spec.length = kSize;
    spec.kind = v1::MEMORY_KIND_CUDA;
    spec.device_index = device_index;
    return spec;
  }
  // The whole allocation, registered range and the bytes around it.
  std::string All() const { return std::string(map_, bytes_); }
  // Bytes [offset, offset + length) of the registered range.
  std::string Registered(uint64_t offset, uint64_t length) const {
    return std::string(map_ + kOffset + offset, length);
  }

 private:
  UniqueFd fd_;
  uint64_t bytes_;
  char* map_ = nullptr;
};

class DeviceMemoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* name : {"nic_a", "nic_b"}) {
      verbs::SoftDeviceConfig config;
      config.name = name;
      ASSERT_TRUE(fabric_->AddDevice(config).ok());
    }
  }

  // memory + tcp + ibverbs on `device`; empty: ibverbs disabled (a host
  // without a NIC).
  // `tweak` adjusts the options (limits) before the agent starts.
  std::unique_ptr<InProcessAgent> StartAgent(
      const std::string& device,
      const std::function<void(AgentOptions&)>& tweak = nullptr) {
    AgentOptions options;
    if (tweak) tweak(options);
    options.backends.push_back(testing::MemoryFactory());
    options.backends.push_back(testing::LoopbackTcpFactory());
    std::shared_ptr<verbs::SoftFabric> fabric = fabric_;
    IbverbsOptions ib;
    ib.enabled = !device.empty();
    ib.qp.timeout = 8;  // ~1 ms per try: a cut path fails fast
    ib.qp.retry_cnt = 2;
    options.backends.push_back(testing::IbverbsFactory(
        [fabric, device] {
          return fabric->MakeVerbs({device.empty() ? "-" : device});
        },
        ib));
    auto agent = InProcessAgent::Start(std::move(options));
    EXPECT_TRUE(agent.ok()) << agent.status();
    return agent.ok() ? std::move(*agent) : nullptr;
  }

  static std::unique_ptr<AgentClient> Connect(InProcessAgent& agent) {
    client::ConnectOptions options;
    options.target = agent.agent().target();
    auto client = AgentClient::Connect(options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? std::move(*client) : nullptr;
  }

  static client::Buffer HostBuffer(AgentClient& client, uint8_t seed) {
    auto buffer = client.Attach(kSize, v1::ACCESS_READ_WRITE, "host");
    EXPECT_TRUE(buffer.ok()) << buffer.status();
    const std::string fill = Pattern(seed, kSize);
    std::memcpy(buffer->data(), fill.data(), kSize);
    return std::move(*buffer);
  }

  static std::string Bytes(const client::Buffer& buffer) {
    return std::string(reinterpret_cast<const char*>(buffer.data()),
                       buffer.size());
  }

  static OpResult RunOne(AgentClient& client, const OpSpec& op) {
    auto results = client.Submit({op}, absl::Seconds(20));
    EXPECT_TRUE(results.ok()) << results.status();
    if (!results.ok() || results->size() != 1) return {results.status(), ""};
    return (*results)[0];
  }

  std::shared_ptr<verbs::SoftFabric> fabric_ =
      std::make_shared<verbs::SoftFabric>();
};

TEST_F(DeviceMemoryTest, RegistersWithTheNicOnlyAndTheContextSaysSo) {
  auto agent = StartAgent("nic_a");
  ASSERT_NE(agent, nullptr);
  auto client = Connect(*agent);
  FakeDeviceAllocation gpu(1);
  auto registered = client->RegisterDeviceMemory(
      gpu.Spec(), v1::ACCESS_READ_WRITE, "weights");
  ASSERT_TRUE(registered.ok()) << registered.status();
  EXPECT_THAT(registered->backends, ElementsAre("ibverbs"));
  EXPECT_EQ(registered->size, kSize);
  EXPECT_EQ(registered->lifetime, v1::LIFETIME_CLIENT_PROCESS);

  v1::RemoteBuffer context;
  ASSERT_TRUE(context.ParseFromString(registered->remote_context));
  EXPECT_EQ(context.memory_kind(), v1::MEMORY_KIND_CUDA);
  EXPECT_EQ(context.device_index(), 1u);
  EXPECT_EQ(context.size_bytes(), kSize);
  ASSERT_EQ(context.endpoints_size(), 1);
  EXPECT_EQ(context.endpoints(0).backend(), "ibverbs");
  // Addressed from the MRs' iova (0), not from any address of the agent.
  EXPECT_EQ(context.endpoints(0).ibverbs().address(), 0u);

  auto listed = client->ListBuffers();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].memory_kind(), v1::MEMORY_KIND_CUDA);
  EXPECT_EQ((*listed)[0].device_index(), 1u);
  EXPECT_EQ((*listed)[0].pci_bus_id(), "");
  EXPECT_FALSE((*listed)[0].agent_allocated());
  EXPECT_TRUE(client->Release(registered->id).ok());
}

TEST_F(DeviceMemoryTest, ThePciAddressReachesTheAgentInSysfsForm) {
  auto agent = StartAgent("nic_a");
  ASSERT_NE(agent, nullptr);
  auto client = Connect(*agent);
  FakeDeviceAllocation gpu(2);
  DeviceMemorySpec spec = gpu.Spec();
  spec.pci_bus_id = "00000000:3B:00.0";  // as nvidia-smi prints it
  auto registered = client->RegisterDeviceMemory(spec, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(registered.ok()) << registered.status();
  auto listed = client->ListBuffers();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].pci_bus_id(), "0000:3b:00.0");
}

TEST_F(DeviceMemoryTest, OpsBetweenAgentsMoveExactlyTheirBytesOverTheNic) {
  auto a = StartAgent("nic_a");
  auto b = StartAgent("nic_b");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  auto client_a = Connect(*a);
  auto client_b = Connect(*b);
  FakeDeviceAllocation gpu(1);
  auto device =
      client_a->RegisterDeviceMemory(gpu.Spec(), v1::ACCESS_READ_WRITE, "gpu");
  ASSERT_TRUE(device.ok()) << device.status();
  client::Buffer host_b = HostBuffer(*client_b, 2);

  // A reads B's host memory into its device memory.
  std::string expected_gpu = gpu.All();
  std::memcpy(expected_gpu.data() + kOffset + 1000,
              Pattern(2, kSize).data() + 3000, 70000);
  OpResult read =
      RunOne(*client_a, {v1::OP_TYPE_READ_INTO_LOCAL, device->id, 1000, 70000,
                         host_b.remote_context(), 3000});
  EXPECT_TRUE(read.status.ok()) << read.status;
  EXPECT_EQ(read.backend, "ibverbs");
  EXPECT_TRUE(gpu.All() == expected_gpu) << "device memory bytes differ";

  // A writes from its device memory into B's host memory.
  std::string expected_b = Bytes(host_b);
  std::memcpy(expected_b.data() + 128, gpu.Registered(50000, 9000).data(),
              9000);
  OpResult write =
      RunOne(*client_a, {v1::OP_TYPE_WRITE_FROM_LOCAL, device->id, 50000, 9000,
                         host_b.remote_context(), 128});
  EXPECT_TRUE(write.status.ok()) << write.status;
  EXPECT_EQ(write.backend, "ibverbs");
  EXPECT_TRUE(Bytes(host_b) == expected_b) << "host memory bytes differ";

  // B reaches A's device memory as a remote buffer, both ways.
  const std::string b_before = Bytes(host_b);
  expected_b = b_before;
  std::memcpy(expected_b.data(), gpu.Registered(kSize - 4096, 4096).data(),
              4096);
  OpResult remote_read =
      RunOne(*client_b, {v1::OP_TYPE_READ_INTO_LOCAL, host_b.id(), 0, 4096,
                         device->remote_context, kSize - 4096});
  EXPECT_TRUE(remote_read.status.ok()) << remote_read.status;
  EXPECT_EQ(remote_read.backend, "ibverbs");
  EXPECT_TRUE(Bytes(host_b) == expected_b);

  expected_gpu = gpu.All();
  std::memcpy(expected_gpu.data() + kOffset, Bytes(host_b).data() + 200, 5000);
  OpResult remote_write =
      RunOne(*client_b, {v1::OP_TYPE_WRITE_FROM_LOCAL, host_b.id(), 200, 5000,
                         device->remote_context, 0});
  EXPECT_TRUE(remote_write.status.ok()) << remote_write.status;
  EXPECT_TRUE(gpu.All() == expected_gpu) << "device memory bytes differ";

  // Out of range on the device memory: refused, nothing moved.
  expected_gpu = gpu.All();
  OpResult outside =
      RunOne(*client_b, {v1::OP_TYPE_WRITE_FROM_LOCAL, host_b.id(), 0, 4096,
                         device->remote_context, kSize - 100});
  EXPECT_EQ(outside.status.code(), absl::StatusCode::kOutOfRange)
      << outside.status;
  EXPECT_TRUE(gpu.All() == expected_gpu);
}

TEST_F(DeviceMemoryTest, SameHostOpsOnDeviceMemoryGoThroughTheNic) {
  auto agent = StartAgent("nic_a");
  ASSERT_NE(agent, nullptr);
  auto client = Connect(*agent);
  FakeDeviceAllocation gpu(3);
  auto device =
      client->RegisterDeviceMemory(gpu.Spec(0), v1::ACCESS_READ_WRITE, "gpu");
  ASSERT_TRUE(device.ok()) << device.status();
  client::Buffer host = HostBuffer(*client, 4);

  // Host memory (local) from device memory (remote): the memory backend
  // cannot reach it, the NIC loops back.
  std::string expected = Bytes(host);
  std::memcpy(expected.data() + 10, gpu.Registered(20, 30000).data(), 30000);
  OpResult read = RunOne(*client, {v1::OP_TYPE_READ_INTO_LOCAL, host.id(), 10,
                                   30000, device->remote_context, 20});
  EXPECT_TRUE(read.status.ok()) << read.status;
  EXPECT_EQ(read.backend, "ibverbs");
  EXPECT_TRUE(Bytes(host) == expected);

  // Device memory (local) from host memory (remote), whose context also
  // advertises memory and tcp: only the NIC registered the local side.
  std::string expected_gpu = gpu.All();
  std::memcpy(expected_gpu.data() + kOffset + 100, Bytes(host).data(), 8192);
  OpResult local_device =
      RunOne(*client, {v1::OP_TYPE_READ_INTO_LOCAL, device->id, 100, 8192,
                       host.remote_context(), 0});
  EXPECT_TRUE(local_device.status.ok()) << local_device.status;
  EXPECT_EQ(local_device.backend, "ibverbs");
  EXPECT_TRUE(gpu.All() == expected_gpu);
}

TEST_F(DeviceMemoryTest, TheAgentNeverCopiesDeviceMemoryItself) {
  auto agent = StartAgent("nic_a");
  ASSERT_NE(agent, nullptr);
  auto client = Connect(*agent);
  FakeDeviceAllocation gpu(5);
  auto device =
      client->RegisterDeviceMemory(gpu.Spec(2), v1::ACCESS_READ_WRITE, "gpu");
  ASSERT_TRUE(device.ok()) << device.status();
  const std::string before = gpu.All();

  auto read = client->ReadBuffer(device->id, 0, 16);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(read.status().message(),
              HasSubstr(absl::StrCat("ReadBuffer: buffer ", device->id,
                                     " is CUDA device memory (device 2)")));
  const absl::Status write = client->WriteBuffer(device->id, 0, "bytes");
  EXPECT_EQ(write.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(write.message(), HasSubstr("CUDA device memory (device 2)"));

  // No dma-buf (or mapping) is handed out on the attach socket either.
  v1::AttachRequest open;
  open.mutable_open()->set_buffer_id(device->id);
  auto reply = client::internal::ExchangeOnAttachSocket(
      agent->runtime_dir() + "/attach.sock", open, -1, absl::Seconds(10));
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_FALSE(reply->fd.valid());
  const absl::Status opened = client::internal::ResponseStatus(reply->response);
  EXPECT_EQ(opened.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(opened.message(), HasSubstr("CUDA device memory (device 2)"));
  EXPECT_TRUE(gpu.All() == before);
}

TEST_F(DeviceMemoryTest, AnAgentWithoutANicRefusesAndCannotReachDeviceMemory) {
  auto with_nic = StartAgent("nic_a");
  auto without = StartAgent("");
  ASSERT_NE(with_nic, nullptr);
  ASSERT_NE(without, nullptr);
  auto client_nic = Connect(*with_nic);
  auto client_tcp = Connect(*without);
  FakeDeviceAllocation gpu(6);

  auto refused =
      client_tcp->RegisterDeviceMemory(gpu.Spec(1), v1::ACCESS_READ_WRITE);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("is CUDA device memory (device 1), which only NIC "
                        "backends (ibverbs) can register"));
  auto listed = client_tcp->ListBuffers();
  ASSERT_TRUE(listed.ok());
  EXPECT_TRUE(listed->empty());

  // The NIC agent's device memory is out of the tcp-only agent's reach.
  auto device =
      client_nic->RegisterDeviceMemory(gpu.Spec(1), v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(device.ok()) << device.status();
  client::Buffer host = HostBuffer(*client_tcp, 7);
  const std::string before = Bytes(host);
  OpResult op = RunOne(*client_tcp, {v1::OP_TYPE_READ_INTO_LOCAL, host.id(), 0,
                                     4096, device->remote_context, 0});
  EXPECT_EQ(op.status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(op.status.message(),
              HasSubstr("op 0: the remote buffer is CUDA device memory "
                        "(device 1), which only NIC backends reach (it "
                        "advertises [ibverbs])"));
  EXPECT_TRUE(Bytes(host) == before);
}

TEST_F(DeviceMemoryTest, TheAttachSocketChecksDeviceMemoryBeforeParkingIt) {
  auto agent = StartAgent("nic_a");
  ASSERT_NE(agent, nullptr);
  auto client = Connect(*agent);
  FakeDeviceAllocation gpu(8);
  auto refuse = [&](DeviceMemorySpec spec, absl::string_view why) {
    auto registered = client->RegisterDeviceMemory(spec, v1::ACCESS_READ_WRITE);
    EXPECT_EQ(registered.status().code(), absl::StatusCode::kInvalidArgument)
        << why << ": " << registered.status();
    EXPECT_THAT(registered.status().message(), HasSubstr(why));
  };
  DeviceMemorySpec host = gpu.Spec();
  host.kind = v1::MEMORY_KIND_HOST;
  refuse(host, "is not MEMORY_KIND_CUDA");
  DeviceMemorySpec empty = gpu.Spec();
  empty.length = 0;
  refuse(empty, "length must be positive");
  DeviceMemorySpec overflowing = gpu.Spec();
  overflowing.offset = UINT64_MAX - 10;
  refuse(overflowing, "overflows");
  DeviceMemorySpec past_end = gpu.Spec();
  past_end.length = kSize + kTail + 1;
  refuse(past_end, "ends past the dma-buf");
  // The PCI address names a sysfs entry: nothing but an address passes.
  for (const char* malformed :
       {"../../../../etc", "0000:3b:00.0/../..", "0000:3b:00", "GPU-1234"}) {
    DeviceMemorySpec bad_address = gpu.Spec();
    bad_address.pci_bus_id = malformed;
    refuse(bad_address, "is not a PCI address");
  }

  // No fd at all (the client library would not send that).
  v1::AttachRequest bare;
  bare.mutable_attach_device_memory()->set_length(4096);
  bare.mutable_attach_device_memory()->set_kind(v1::MEMORY_KIND_ROCM);
  auto reply = client::internal::ExchangeOnAttachSocket(
      agent->runtime_dir() + "/attach.sock", bare, -1, absl::Seconds(10));
  ASSERT_TRUE(reply.ok()) << reply.status();
  const absl::Status no_fd = client::internal::ResponseStatus(reply->response);
  EXPECT_EQ(no_fd.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(no_fd.message(), HasSubstr("no dma-buf file descriptor"));

  auto listed = client->ListBuffers();
  ASSERT_TRUE(listed.ok());
  EXPECT_TRUE(listed->empty());
}

TEST_F(DeviceMemoryTest, DeviceMemoryCountsAgainstTheLimitsLikeHostMemory) {
  auto agent = StartAgent("nic_a", [](AgentOptions& options) {
    options.api.max_buffer_bytes = kSize;
    options.quotas.bytes.per_user = kSize + kSize / 2;
  });
  ASSERT_NE(agent, nullptr);
  auto client = Connect(*agent);
  FakeDeviceAllocation gpu(9);
  DeviceMemorySpec too_big = gpu.Spec();
  too_big.length = kSize + 1;
  auto refused = client->RegisterDeviceMemory(too_big, v1::ACCESS_READ);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("--max_buffer_bytes"));

  auto first = client->RegisterDeviceMemory(gpu.Spec(), v1::ACCESS_READ);
  ASSERT_TRUE(first.ok()) << first.status();
  auto over_quota = client->RegisterDeviceMemory(gpu.Spec(), v1::ACCESS_READ);
  EXPECT_EQ(over_quota.status().code(), absl::StatusCode::kResourceExhausted);
  // Released, its bytes are given back.
  ASSERT_TRUE(client->Release(first->id).ok());
  auto again = client->RegisterDeviceMemory(gpu.Spec(), v1::ACCESS_READ);
  EXPECT_TRUE(again.ok()) << again.status();
}

TEST_F(DeviceMemoryTest, ANicFailureOnDeviceMemoryIsNotRetriedOverTcp) {
  auto a = StartAgent("nic_a");
  auto b = StartAgent("nic_b");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  auto client_a = Connect(*a);
  auto client_b = Connect(*b);
  FakeDeviceAllocation gpu(10);
  auto device =
      client_a->RegisterDeviceMemory(gpu.Spec(4), v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(device.ok()) << device.status();
  // B's host memory is reachable over tcp too; only the NIC path is cut.
  client::Buffer host_b = HostBuffer(*client_b, 11);
  fabric_->SetReachable("nic_b", false);
  const std::string before = gpu.All();
  OpResult op = RunOne(*client_a, {v1::OP_TYPE_READ_INTO_LOCAL, device->id, 0,
                                   4096, host_b.remote_context(), 0});
  EXPECT_EQ(op.status.code(), absl::StatusCode::kUnavailable) << op.status;
  EXPECT_EQ(op.backend, "ibverbs");
  EXPECT_THAT(op.status.message(),
              HasSubstr("the local buffer is CUDA device memory (device 4), "
                        "which no other backend reaches"));
  EXPECT_TRUE(gpu.All() == before);
}

}  // namespace
}  // namespace rdma_agent

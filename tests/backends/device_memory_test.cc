// Device memory (a dma-buf; a memfd stands in) below the agent: what
// DeviceMemory accepts, what a device-memory Registration answers, and that
// the backends that copy bytes themselves (memory, tcp) neither register it
// nor touch it, even when a forged context names it. The ibverbs path and the
// API are tests/ibverbs/device_memory_test.cc.
#include "backends/device_memory.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends/memory/memory_backend.h"
#include "backends/registry.h"
#include "backends/tcp/tcp_backend.h"
#include "backends/testing/harness.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rdma_agent {
namespace {

using ::absl::StatusCode;
using ::testing::HasSubstr;
using testing::In;
using testing::MakeOp;
using testing::Snapshot;
using testing::TestAgent;
using testing::TestBuffer;

constexpr uint64_t kSize = 8192;

absl::StatusOr<std::unique_ptr<MappingCharge>> AdmitAll(uint64_t) {
  return nullptr;
}

UniqueFd Memfd(uint64_t size) {
  UniqueFd fd(::memfd_create("device-memory-test", MFD_CLOEXEC));
  EXPECT_TRUE(fd.valid());
  EXPECT_EQ(::ftruncate(fd.get(), static_cast<off_t>(size)), 0);
  return fd;
}

DeviceMemory::Description Cuda(uint64_t offset, uint64_t length,
                               uint32_t device = 3) {
  DeviceMemory::Description description;
  description.offset = offset;
  description.length = length;
  description.kind = v1::MEMORY_KIND_CUDA;
  description.device_index = device;
  return description;
}

absl::Status AdoptStatus(UniqueFd fd, const DeviceMemory::Description& d) {
  return DeviceMemory::Adopt(std::move(fd), d, AdmitAll).status();
}

TEST(DeviceMemoryTest, AdoptsARangeOfTheDmaBuf) {
  auto memory =
      DeviceMemory::Adopt(Memfd(kSize), Cuda(4096, kSize - 4096), AdmitAll);
  ASSERT_TRUE(memory.ok()) << memory.status();
  EXPECT_GE(memory->fd(), 0);
  EXPECT_EQ(memory->offset(), 4096u);
  EXPECT_EQ(memory->size(), kSize - 4096);
  EXPECT_EQ(memory->kind(), v1::MEMORY_KIND_CUDA);
  EXPECT_EQ(memory->device_index(), 3u);
}

TEST(DeviceMemoryTest, RefusesWhatIsNoDeviceMemoryRange) {
  EXPECT_EQ(AdoptStatus(UniqueFd(), Cuda(0, kSize)).code(),
            StatusCode::kInvalidArgument);
  DeviceMemory::Description host = Cuda(0, kSize);
  host.kind = v1::MEMORY_KIND_HOST;
  const absl::Status as_host = AdoptStatus(Memfd(kSize), host);
  EXPECT_EQ(as_host.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(as_host.message(), HasSubstr("AttachMemory"));
  DeviceMemory::Description unknown = Cuda(0, kSize);
  unknown.kind = static_cast<v1::MemoryKind>(42);
  EXPECT_EQ(AdoptStatus(Memfd(kSize), unknown).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(AdoptStatus(Memfd(kSize), Cuda(0, 0)).code(),
            StatusCode::kInvalidArgument);
  const absl::Status overflow = AdoptStatus(Memfd(kSize), Cuda(UINT64_MAX, 2));
  EXPECT_EQ(overflow.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(overflow.message(), HasSubstr("overflows"));
  const absl::Status past_end = AdoptStatus(Memfd(kSize), Cuda(4096, kSize));
  EXPECT_EQ(past_end.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(past_end.message(), HasSubstr("ends past the dma-buf's 8192"));
  int pair[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, pair), 0);
  UniqueFd keep(pair[1]);
  const absl::Status socket = AdoptStatus(UniqueFd(pair[0]), Cuda(0, 1));
  EXPECT_EQ(socket.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(socket.message(), HasSubstr("not a dma-buf"));
}

TEST(DeviceMemoryTest, AdmissionSeesTheLengthAndItsRefusalStands) {
  uint64_t asked = 0;
  auto refused = DeviceMemory::Adopt(
      Memfd(kSize), Cuda(4096, 100),
      [&](uint64_t bytes) -> absl::StatusOr<std::unique_ptr<MappingCharge>> {
        asked = bytes;
        return absl::ResourceExhaustedError("over quota");
      });
  EXPECT_EQ(asked, 100u);
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
}

TEST(DeviceMemoryTest, KeepsThePciAddressInSysfsForm) {
  DeviceMemory::Description description = Cuda(0, kSize);
  description.pci_bus_id = "00000000:3B:00.0";
  auto memory = DeviceMemory::Adopt(Memfd(kSize), description, AdmitAll);
  ASSERT_TRUE(memory.ok()) << memory.status();
  EXPECT_EQ(memory->pci_bus_id(), "0000:3b:00.0");
  auto without = DeviceMemory::Adopt(Memfd(kSize), Cuda(0, kSize), AdmitAll);
  ASSERT_TRUE(without.ok()) << without.status();
  EXPECT_EQ(without->pci_bus_id(), "");
}

TEST(DeviceMemoryTest, RefusesAMalformedPciAddressBeforeCharging) {
  DeviceMemory::Description description = Cuda(0, kSize);
  description.pci_bus_id = "../../../etc";
  bool charged = false;
  auto memory = DeviceMemory::Adopt(
      Memfd(kSize), description,
      [&](uint64_t) -> absl::StatusOr<std::unique_ptr<MappingCharge>> {
        charged = true;
        return nullptr;
      });
  EXPECT_EQ(memory.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(memory.status().message(), HasSubstr("../../../etc"));
  EXPECT_THAT(memory.status().message(), HasSubstr("0000:3b:00.0"));
  EXPECT_FALSE(charged);
}

TEST(NormalizePciBusIdTest, TakesTheFormsToolsPrint) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"0000:3b:00.0", "0000:3b:00.0"},      // sysfs
      {"0000:3B:00.0", "0000:3b:00.0"},      // cuDeviceGetPCIBusId
      {"00000000:3B:00.0", "0000:3b:00.0"},  // nvidia-smi, NVML
      {"3b:00.0", "0000:3b:00.0"},           // lspci
      {" 0000:AF:1f.7\n", "0000:af:1f.7"},   // read from a command's output
      {"10000:01:00.0", "10000:01:00.0"},    // a VMD domain
      {"", ""},                              // none given
  };
  for (const auto& [text, sysfs] : cases) {
    auto normal = NormalizePciBusId(text);
    ASSERT_TRUE(normal.ok()) << text << ": " << normal.status();
    EXPECT_EQ(*normal, sysfs) << text;
  }
}

TEST(NormalizePciBusIdTest, RefusesAnythingElse) {
  for (const char* text :
       {"..", "../0000:3b:00.0", "0000:3b:00.0/..", "0000:3b:00", "3b",
        "0000:3b:20.0",  // device past 1f
        "0000:3b:00.8",  // function past 7
        "0000:3b:0.0", "0000:3bb:00.0", "000000000:3b:00.0", "0000:3b:00.0.1",
        "0:0:3b:00.0", "0x00:3b:00.0", "0000:3b:00.-", "gpu0",
        "0000:3b :00.0"}) {
    auto normal = NormalizePciBusId(text);
    EXPECT_EQ(normal.status().code(), StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(normal.status().message(), HasSubstr("PCI bus id")) << text;
  }
}

TEST(DeviceMemoryTest, MessagesNameTheMemory) {
  EXPECT_EQ(DescribeMemory(v1::MEMORY_KIND_HOST, 0), "host memory");
  EXPECT_EQ(DescribeMemory(v1::MEMORY_KIND_CUDA, 1),
            "CUDA device memory (device 1)");
  EXPECT_EQ(DescribeMemory(v1::MEMORY_KIND_ROCM, 2),
            "ROCm device memory (device 2)");
  EXPECT_EQ(DescribeMemory(v1::MEMORY_KIND_OTHER, 0),
            "device memory (device 0)");
}

// A device-memory registration of `size` bytes in `agent`'s table, and a
// context naming it that borrows `host`'s endpoint: what a forger would
// send (the right token, the wrong transport).
struct ForgedDevice {
  std::shared_ptr<Registration> registration;
  std::shared_ptr<v1::RemoteBuffer> context;
};

ForgedDevice AddDeviceBuffer(TestAgent& agent, const TestBuffer& host) {
  auto memory = DeviceMemory::Adopt(Memfd(kSize), Cuda(0, kSize), AdmitAll);
  EXPECT_TRUE(memory.ok()) << memory.status();
  const uint64_t id = agent.table().NextId();
  const std::string token = absl::StrCat("device-token-", id);
  ForgedDevice forged;
  forged.registration = std::make_shared<Registration>(
      id, /*owner=*/0, v1::ACCESS_READ_WRITE, "device", token,
      std::move(*memory), /*agent_allocated=*/false);
  agent.table().Add(forged.registration);
  forged.context = std::make_shared<v1::RemoteBuffer>(*host.context);
  forged.context->set_buffer_id(id);
  forged.context->set_token(token);
  forged.context->set_memory_kind(v1::MEMORY_KIND_CUDA);
  forged.context->set_device_index(3);
  return forged;
}

TEST(DeviceMemoryRegistrationTest, HasNoMappingAndSaysWhatItIs) {
  auto memory = DeviceMemory::Adopt(Memfd(kSize), Cuda(0, kSize), AdmitAll);
  ASSERT_TRUE(memory.ok());
  Registration registration(7, 0, v1::ACCESS_READ, "gpu", "token",
                            std::move(*memory), false);
  EXPECT_EQ(registration.host_memory(), nullptr);
  ASSERT_NE(registration.device_memory(), nullptr);
  EXPECT_EQ(registration.data(), nullptr);
  EXPECT_EQ(registration.fd(), -1);
  EXPECT_EQ(registration.size(), kSize);
  EXPECT_EQ(registration.memory_kind(), v1::MEMORY_KIND_CUDA);
  EXPECT_EQ(registration.device_index(), 3u);
  const absl::Status refused = RequireHostMemory(registration, "no copying");
  EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(refused.message(),
            "buffer 7 is CUDA device memory (device 3); no copying");
}

std::unique_ptr<TestAgent> MemoryAgent() {
  auto agent =
      TestAgent::Create("agent-m",
                        [](const BackendEnvironment& env)
                            -> absl::StatusOr<std::unique_ptr<Backend>> {
                          return std::make_unique<memory::MemoryBackend>(env);
                        });
  EXPECT_TRUE(agent.ok()) << agent.status();
  return agent.ok() ? std::move(*agent) : nullptr;
}

TEST(MemoryBackendDeviceMemoryTest, NeitherRegistersNorTouchesDeviceMemory) {
  auto agent = MemoryAgent();
  ASSERT_NE(agent, nullptr);
  TestBuffer host = agent->Register(kSize, v1::ACCESS_READ_WRITE, 5);
  ForgedDevice device = AddDeviceBuffer(*agent, host);
  Backend& backend = agent->backend();
  EXPECT_TRUE(backend.CanRegister(*host.registration));
  EXPECT_FALSE(backend.CanRegister(*device.registration));
  v1::BackendEndpoint endpoint;
  EXPECT_EQ(backend.Register(*device.registration, &endpoint).status().code(),
            StatusCode::kFailedPrecondition);

  // A forged context puts device memory on the remote side; a routing
  // mistake would put it on the local side. Both are refused, and the host
  // buffer keeps its bytes.
  const std::vector<uint8_t> before = Snapshot(host);
  TestBuffer forged_remote{device.registration, device.context, 0};
  TestBuffer device_local{device.registration, host.context, 0};
  std::vector<Op> ops = {
      MakeOp(0, v1::OP_TYPE_READ_INTO_LOCAL, host, 0, 64, forged_remote, 0),
      MakeOp(1, v1::OP_TYPE_WRITE_FROM_LOCAL, device_local, 0, 64, host, 0)};
  std::vector<absl::Status> results =
      backend.Submit(ops, StopToken(In(absl::Seconds(10))));
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results[0].code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(
      results[0].message(),
      HasSubstr("remote buffer " + std::to_string(device.registration->id()) +
                " is CUDA device memory (device 3)"));
  EXPECT_EQ(results[1].code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(results[1].message(), HasSubstr("local buffer"));
  EXPECT_EQ(Snapshot(host), before);
}

std::unique_ptr<TestAgent> TcpAgent(const std::string& id) {
  tcp::TcpOptions options;
  options.listen = "127.0.0.1:0";
  auto agent =
      TestAgent::Create(id,
                        [options](const BackendEnvironment& env)
                            -> absl::StatusOr<std::unique_ptr<Backend>> {
                          auto backend = tcp::TcpBackend::Create(options, env);
                          if (!backend.ok()) return backend.status();
                          return std::unique_ptr<Backend>(std::move(*backend));
                        });
  EXPECT_TRUE(agent.ok()) << agent.status();
  return agent.ok() ? std::move(*agent) : nullptr;
}

TEST(TcpBackendDeviceMemoryTest, NeitherRegistersNorServesDeviceMemory) {
  auto requester = TcpAgent("agent-r");
  auto server = TcpAgent("agent-s");
  ASSERT_NE(requester, nullptr);
  ASSERT_NE(server, nullptr);
  TestBuffer local = requester->Register(kSize, v1::ACCESS_READ_WRITE, 1);
  TestBuffer served = server->Register(kSize, v1::ACCESS_READ_WRITE, 2);
  ForgedDevice device = AddDeviceBuffer(*server, served);
  EXPECT_FALSE(server->backend().CanRegister(*device.registration));
  v1::BackendEndpoint endpoint;
  EXPECT_EQ(server->backend()
                .Register(*device.registration, &endpoint)
                .status()
                .code(),
            StatusCode::kFailedPrecondition);

  // The forged context points the server's data plane at device memory, in
  // both directions: refused before any byte moves.
  const std::vector<uint8_t> before = Snapshot(local);
  TestBuffer forged_remote{device.registration, device.context, 0};
  std::vector<Op> ops = {
      MakeOp(0, v1::OP_TYPE_READ_INTO_LOCAL, local, 0, 4096, forged_remote, 0),
      MakeOp(1, v1::OP_TYPE_WRITE_FROM_LOCAL, local, 0, 4096, forged_remote,
             0)};
  std::vector<absl::Status> results =
      requester->backend().Submit(ops, StopToken(In(absl::Seconds(10))));
  ASSERT_EQ(results.size(), 2u);
  for (const absl::Status& result : results) {
    EXPECT_EQ(result.code(), StatusCode::kFailedPrecondition) << result;
    EXPECT_THAT(result.message(), HasSubstr("CUDA device memory (device 3)"));
  }
  EXPECT_EQ(Snapshot(local), before);

  // Device memory on the local side never leaves through tcp either.
  TestBuffer device_local{device.registration, served.context, 0};
  std::vector<Op> outgoing = {
      MakeOp(0, v1::OP_TYPE_WRITE_FROM_LOCAL, device_local, 0, 64, served, 0)};
  results =
      server->backend().Submit(outgoing, StopToken(In(absl::Seconds(10))));
  ASSERT_EQ(results.size(), 1u);
  EXPECT_EQ(results[0].code(), StatusCode::kFailedPrecondition);
}

TEST(RegistryDeviceMemoryTest, WithoutANicBackendRegistrationFailsNamingKind) {
  std::vector<std::unique_ptr<Backend>> backends;
  BackendEnvironment env;
  backends.push_back(std::make_unique<memory::MemoryBackend>(env));
  BackendRegistry registry(std::move(backends));
  auto memory = DeviceMemory::Adopt(Memfd(kSize), Cuda(0, kSize, 1), AdmitAll);
  ASSERT_TRUE(memory.ok());
  Registration registration(9, 0, v1::ACCESS_READ_WRITE, "gpu", "token",
                            std::move(*memory), false);
  v1::RemoteBuffer context;
  const absl::Status status = registry.RegisterWithAll(registration, &context);
  EXPECT_EQ(status.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(status.message(),
              HasSubstr("buffer 9 is CUDA device memory (device 1), which "
                        "only NIC backends (ibverbs) can register"));
  EXPECT_EQ(context.endpoints_size(), 0);
  EXPECT_TRUE(registration.backend_names().empty());
}

}  // namespace
}  // namespace rdma_agent

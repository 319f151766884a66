// NUMA affinity of the ibverbs backend on the software RC NIC, on hosts a
// fake sysfs tree describes: which rails carry an op's bytes (per-rail
// counters on the requester, per-device served bytes on the responder)
// given where both buffers are, when far rails join (large ops on an
// asymmetric host, failover when the near ones go), and the cases where
// every rail is used (policy `all`, old contexts, unknown nodes); and device
// memory, placed by its device's PCI address (node, then PCIe switch) and
// never by the host locator. Every byte is checked, inside and outside each
// op's range.
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "backends/device_memory.h"
#include "backends/ibverbs/fake_sysfs.h"
#include "backends/ibverbs/ibverbs_backend.h"
#include "backends/ibverbs/memory_node.h"
#include "backends/ibverbs/soft/soft_verbs.h"
#include "backends/testing/harness.h"
#include "backends/testing/ibverbs_agent.h"
#include "common/unique_fd.h"
#include "gtest/gtest.h"

namespace rdma_agent::ibverbs {
namespace {

using ::rdma_agent::testing::Apply;
using ::rdma_agent::testing::FirstChangedByte;
using ::rdma_agent::testing::FirstDifference;
using ::rdma_agent::testing::FirstWrongByte;
using ::rdma_agent::testing::In;
using ::rdma_agent::testing::MakeOp;
using ::rdma_agent::testing::Refill;
using ::rdma_agent::testing::Snapshot;
using ::rdma_agent::testing::SoftIbverbsAgent;
using ::rdma_agent::testing::TestAgent;
using ::rdma_agent::testing::TestBuffer;
using testing::FakeHost;
using testing::UniformDistances;
using testing::WriteFakeSysfs;
using verbs::SoftDeviceConfig;
using verbs::SoftFabric;

constexpr v1::OpType kRead = v1::OP_TYPE_READ_INTO_LOCAL;
constexpr v1::OpType kWrite = v1::OP_TYPE_WRITE_FROM_LOCAL;

// Places every buffer registered from now on on one node (a test's stand-in
// for the kernel's answer).
class PlacedMemory : public MemoryNodeLocator {
 public:
  explicit PlacedMemory(int node) : node_(node) {}
  void Place(int node) { node_ = node; }
  int NodeOf(const void* data, size_t) const override {
    ++queries_;
    if (data == nullptr) ++null_queries_;
    return node_;
  }
  int queries() const { return queries_; }
  // Asked about no memory at all (what device memory's data() is).
  int null_queries() const { return null_queries_; }

 private:
  std::atomic<int> node_;
  mutable std::atomic<int> queries_{0};
  mutable std::atomic<int> null_queries_{0};
};

class NumaAffinityTest : public ::testing::Test {
 protected:
  // Devices `prefix`0..n-1, each throttled to `rate` bytes/s; `nodes[i]` is
  // device i's node in the host's sysfs tree (-1 or past the end: none).
  std::vector<std::string> AddHost(const std::string& prefix, size_t n,
                                   const std::vector<int>& nodes,
                                   uint64_t rate = 256 << 20) {
    std::vector<std::string> names;
    for (size_t i = 0; i < n; ++i) {
      SoftDeviceConfig config;
      config.name = absl::StrCat(prefix, i);
      config.bytes_per_second = rate;
      EXPECT_TRUE(fabric_.AddDevice(config).ok()) << config.name;
      if (i < nodes.size() && nodes[i] >= 0) {
        host_.rdma_devices[config.name] = nodes[i];
      }
      names.push_back(config.name);
    }
    return names;
  }

  // An agent over `devices` on the host described so far, its buffers on
  // `memory`'s node.
  std::unique_ptr<TestAgent> Agent(const std::string& id,
                                   const std::vector<std::string>& devices,
                                   std::shared_ptr<PlacedMemory> memory,
                                   IbverbsOptions options = Fast()) {
    options.sysfs_root = WriteFakeSysfs(id, host_);
    options.memory_locator = std::move(memory);
    return SoftIbverbsAgent(fabric_, id, devices, std::move(options));
  }

  static IbverbsOptions Fast() {
    IbverbsOptions options;
    options.qp.timeout = 8;  // ~1 ms per try: a lost peer shows quickly
    options.qp.retry_cnt = 2;
    options.qp.max_message_bytes = 256 << 10;  // a rail's piece: many WRs
    return options;
  }

  // Runs `ops` from `a` and checks every byte of every buffer they touch
  // against what they must leave.
  static void RunAndCheck(TestAgent& a, const std::vector<Op>& ops,
                          const std::vector<const TestBuffer*>& buffers) {
    std::vector<std::vector<uint8_t>> images;
    for (const TestBuffer* buffer : buffers) {
      Refill(*buffer);
      images.push_back(Snapshot(*buffer));
    }
    const auto image_of =
        [&](const Registration* registration) -> std::vector<uint8_t>& {
      for (size_t i = 0; i < buffers.size(); ++i) {
        if (buffers[i]->registration.get() == registration) return images[i];
      }
      ADD_FAILURE() << "an op's buffer is not among those checked";
      return images[0];
    };
    for (const Op& op : ops) {
      Apply(op, image_of(op.local.get()),
            image_of(RegistrationOf(op, buffers)));
    }
    const auto results =
        a.backend<IbverbsBackend>().Submit(ops, In(absl::Seconds(60)));
    for (size_t i = 0; i < results.size(); ++i) {
      ASSERT_TRUE(results[i].ok()) << "op " << i << ": " << results[i];
    }
    for (size_t i = 0; i < buffers.size(); ++i) {
      EXPECT_EQ(FirstDifference(*buffers[i], images[i]), std::nullopt)
          << "buffer " << i;
    }
  }

  // The registration an op's remote context names, among `buffers`.
  static const Registration* RegistrationOf(
      const Op& op, const std::vector<const TestBuffer*>& buffers) {
    for (const TestBuffer* buffer : buffers) {
      if (buffer->context->agent_id() == op.remote->agent_id() &&
          buffer->context->buffer_id() == op.remote->buffer_id()) {
        return buffer->registration.get();
      }
    }
    return nullptr;
  }

  // Bytes each of `backend`'s rails moved as requester, in rail order.
  static std::vector<uint64_t> RailBytes(const IbverbsBackend& backend) {
    std::vector<uint64_t> bytes;
    for (const std::string& rail : backend.rail_names()) {
      bytes.push_back(backend.rail_bytes(rail));
    }
    return bytes;
  }
  // Bytes each of `devices` served as responder.
  std::vector<uint64_t> Served(const std::vector<std::string>& devices) const {
    std::vector<uint64_t> bytes;
    for (const std::string& device : devices) {
      bytes.push_back(fabric_.bytes_served(device));
    }
    return bytes;
  }
  // Which of `bytes` are positive.
  static std::vector<bool> Carried(const std::vector<uint64_t>& bytes) {
    std::vector<bool> carried;
    for (uint64_t b : bytes) carried.push_back(b > 0);
    return carried;
  }
  static uint64_t Sum(const std::vector<uint64_t>& bytes) {
    uint64_t sum = 0;
    for (uint64_t b : bytes) sum += b;
    return sum;
  }
  // Per-rail bytes moved since `before`.
  static std::vector<uint64_t> Since(const std::vector<uint64_t>& now,
                                     const std::vector<uint64_t>& before) {
    std::vector<uint64_t> delta;
    for (size_t i = 0; i < now.size(); ++i) delta.push_back(now[i] - before[i]);
    return delta;
  }

  SoftFabric fabric_;
  FakeHost host_ = [] {
    FakeHost host;
    host.distances = UniformDistances(2, 21);
    return host;
  }();
};

// Two sockets (distances 10/21), four NICs on each: x0-x3 on node 0,
// x4-x7 on node 1, on both hosts.
class TwoSocketTest : public NumaAffinityTest {
 protected:
  static constexpr std::initializer_list<int> kNodes = {0, 0, 0, 0, 1, 1, 1, 1};
  void SetUp() override {
    a_devices_ = AddHost("a", 8, kNodes, Rate());
    b_devices_ = AddHost("b", 8, kNodes, Rate());
  }
  virtual uint64_t Rate() const { return 256 << 20; }

  const std::vector<bool> kNode0 = {true,  true,  true,  true,
                                    false, false, false, false};
  const std::vector<bool> kNode1 = {false, false, false, false,
                                    true,  true,  true,  true};
  const std::vector<bool> kEvery = std::vector<bool>(8, true);
  std::vector<std::string> a_devices_;
  std::vector<std::string> b_devices_;
  std::shared_ptr<PlacedMemory> a_memory_ = std::make_shared<PlacedMemory>(1);
  std::shared_ptr<PlacedMemory> b_memory_ = std::make_shared<PlacedMemory>(1);
};

TEST_F(TwoSocketTest, ContextsAndGetInfoSayWhichRailsAreNear) {
  auto a = Agent("agent-a", a_devices_, a_memory_);
  const TestBuffer on_1 = a->Register(1 << 16, v1::ACCESS_READ_WRITE, 1);
  a_memory_->Place(0);
  const TestBuffer on_0 = a->Register(1 << 16, v1::ACCESS_READ_WRITE, 2);
  const v1::IbverbsEndpoint& ib1 = on_1.context->endpoints(0).ibverbs();
  ASSERT_EQ(ib1.rails_size(), 8);
  EXPECT_EQ(
      std::vector<uint32_t>(ib1.near_rails().begin(), ib1.near_rails().end()),
      std::vector<uint32_t>({4, 5, 6, 7}));
  ASSERT_TRUE(ib1.has_numa_node());
  EXPECT_EQ(ib1.numa_node(), 1);
  const v1::IbverbsEndpoint& ib0 = on_0.context->endpoints(0).ibverbs();
  EXPECT_EQ(
      std::vector<uint32_t>(ib0.near_rails().begin(), ib0.near_rails().end()),
      std::vector<uint32_t>({0, 1, 2, 3}));
  EXPECT_EQ(ib0.numa_node(), 0);
  const auto info = a->backend<IbverbsBackend>().transport_info();
  const auto& attributes = info.attributes();
  EXPECT_EQ(attributes.at("numa_policy"), "nearest");
  EXPECT_EQ(attributes.at("numa_nodes"), "0,1");
  EXPECT_EQ(attributes.at("numa_distances"), "10 21; 21 10");
  EXPECT_EQ(attributes.at("rail.a2:1.numa_node"), "0");
  EXPECT_EQ(attributes.at("rail.a5:1.numa_node"), "1");
}

TEST_F(TwoSocketTest, ContextsNameNearRailsAmongThoseActiveAtRegister) {
  auto a = Agent("agent-a", a_devices_, a_memory_);
  ASSERT_TRUE(fabric_.Unplug("a5").ok());
  ASSERT_TRUE(fabric_.Unplug("a1").ok());
  // Until a port event or a look has told the backend, wait for it.
  IbverbsBackend& backend = a->backend<IbverbsBackend>();
  const absl::Time until = absl::Now() + absl::Seconds(5);
  while (
      absl::Now() < until &&
      (backend.transport_info().attributes().at("rail.a5:1.health") == "ok" ||
       backend.transport_info().attributes().at("rail.a1:1.health") == "ok")) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  const TestBuffer buffer = a->Register(1 << 16, v1::ACCESS_READ_WRITE, 3);
  const v1::IbverbsEndpoint& ib = buffer.context->endpoints(0).ibverbs();
  std::vector<std::string> listed;
  for (const v1::IbverbsRail& rail : ib.rails())
    listed.push_back(rail.device());
  EXPECT_EQ(listed,
            std::vector<std::string>({"a0", "a2", "a3", "a4", "a6", "a7"}));
  // a4, a6 and a7, as indices into the rails listed.
  EXPECT_EQ(
      std::vector<uint32_t>(ib.near_rails().begin(), ib.near_rails().end()),
      std::vector<uint32_t>({3, 4, 5}));
}

TEST_F(TwoSocketTest, OnlyRailsNearBothBuffersCarryTheirBytes) {
  auto a = Agent("agent-a", a_devices_, a_memory_);
  auto b = Agent("agent-b", b_devices_, b_memory_);
  const uint64_t kSize = 8 << 20;
  const TestBuffer near = a->Register(kSize, v1::ACCESS_READ_WRITE, 11);
  const TestBuffer far = b->Register(kSize, v1::ACCESS_READ_WRITE, 12);
  IbverbsBackend& backend = a->backend<IbverbsBackend>();
  // Large ops both ways, then small ones: node 1's rails only, both sides.
  RunAndCheck(*a, {MakeOp(0, kWrite, near, 3, kSize - 10, far, 7)},
              {&near, &far});
  RunAndCheck(*a, {MakeOp(0, kRead, near, 1, kSize - 5, far, 2)},
              {&near, &far});
  std::vector<Op> small;
  for (uint64_t i = 0; i < 40; ++i) {
    small.push_back(MakeOp(i, i % 2 ? kRead : kWrite, near, i * 4096 + 1, 3001,
                           far, (39 - i) * 4096 + 5));
  }
  RunAndCheck(*a, small, {&near, &far});
  const std::vector<uint64_t> bytes = RailBytes(backend);
  EXPECT_EQ(Carried(bytes), kNode1);
  EXPECT_EQ(Sum(bytes), 2 * kSize - 15 + 40 * 3001);
  EXPECT_EQ(Carried(Served(b_devices_)), kNode1);
  // Striped over the four near pairs evenly (equal links).
  for (size_t i = 4; i < 8; ++i) {
    EXPECT_GT(bytes[i], (2 * kSize) / 4 * 9 / 10) << "rail " << i;
  }
}

TEST_F(TwoSocketTest, EachSideUsesTheRailsNearItsOwnBuffer) {
  auto a = Agent("agent-a", a_devices_, a_memory_);
  b_memory_->Place(0);
  auto b = Agent("agent-b", b_devices_, b_memory_);
  const uint64_t kSize = 4 << 20;
  const TestBuffer local = a->Register(kSize, v1::ACCESS_READ_WRITE, 21);
  const TestBuffer remote = b->Register(kSize, v1::ACCESS_READ_WRITE, 22);
  // A's buffer on node 1, B's on node 0: A's x4-x7 pair with B's x0-x3.
  RunAndCheck(
      *a,
      {MakeOp(0, kWrite, local, 0, kSize / 2, remote, 0),
       MakeOp(1, kRead, local, kSize / 2 + 9, 1000, remote, kSize / 2 + 77)},
      {&local, &remote});
  EXPECT_EQ(Carried(RailBytes(a->backend<IbverbsBackend>())), kNode1);
  EXPECT_EQ(Carried(Served(b_devices_)), kNode0);
}

TEST_F(TwoSocketTest, OpsOfOneBatchEachGoNearTheirOwnBuffers) {
  auto a = Agent("agent-a", a_devices_, a_memory_);
  auto b = Agent("agent-b", b_devices_, b_memory_);
  const uint64_t kSize = 4 << 20;
  a_memory_->Place(0);
  const TestBuffer on_0 = a->Register(kSize, v1::ACCESS_READ_WRITE, 31);
  a_memory_->Place(1);
  const TestBuffer on_1 = a->Register(kSize, v1::ACCESS_READ_WRITE, 32);
  const TestBuffer remote = b->Register(2 * kSize, v1::ACCESS_READ_WRITE, 33);
  const uint64_t kFirst = kSize - 4097;
  const uint64_t kSecond = kSize / 2 + 3;
  RunAndCheck(*a,
              {MakeOp(0, kWrite, on_0, 1, kFirst, remote, 0),
               MakeOp(1, kWrite, on_1, 5, kSecond, remote, kSize + 1)},
              {&on_0, &on_1, &remote});
  // Each op's bytes on its own buffer's node: node 0's rails moved exactly
  // the first op, node 1's the second; B's node-1 rails served both.
  const std::vector<uint64_t> bytes = RailBytes(a->backend<IbverbsBackend>());
  EXPECT_EQ(bytes[0] + bytes[1] + bytes[2] + bytes[3], kFirst);
  EXPECT_EQ(bytes[4] + bytes[5] + bytes[6] + bytes[7], kSecond);
  EXPECT_EQ(Carried(bytes), kEvery);
  EXPECT_EQ(Carried(Served(b_devices_)), kNode1);
}

TEST_F(TwoSocketTest, PolicyAllUsesEveryRail) {
  IbverbsOptions all = Fast();
  all.numa_policy = IbverbsOptions::NumaPolicy::kAll;
  auto a = Agent("agent-a", a_devices_, a_memory_, all);
  auto b = Agent("agent-b", b_devices_, b_memory_, all);
  const uint64_t kSize = 8 << 20;
  const TestBuffer near = a->Register(kSize, v1::ACCESS_READ_WRITE, 41);
  const TestBuffer far = b->Register(kSize, v1::ACCESS_READ_WRITE, 42);
  const v1::IbverbsEndpoint& ib = far.context->endpoints(0).ibverbs();
  EXPECT_EQ(ib.near_rails_size(), 0);
  EXPECT_FALSE(ib.has_numa_node());
  RunAndCheck(*a, {MakeOp(0, kWrite, near, 0, kSize, far, 0)}, {&near, &far});
  EXPECT_EQ(Carried(RailBytes(a->backend<IbverbsBackend>())), kEvery);
  EXPECT_EQ(Carried(Served(b_devices_)), kEvery);
  EXPECT_EQ(a->backend<IbverbsBackend>().transport_info().attributes().at(
                "numa_policy"),
            "all");
}

TEST_F(TwoSocketTest, AContextWithoutAffinityUsesEveryRemoteRail) {
  auto a = Agent("agent-a", a_devices_, a_memory_);
  auto b = Agent("agent-b", b_devices_, b_memory_);
  const uint64_t kSize = 8 << 20;
  const TestBuffer near = a->Register(kSize, v1::ACCESS_READ_WRITE, 51);
  const TestBuffer far = b->Register(kSize, v1::ACCESS_READ_WRITE, 52);
  // As an agent from before affinity writes it.
  const TestBuffer old_style = far.WithContext([](v1::RemoteBuffer& context) {
    v1::IbverbsEndpoint* ib = context.mutable_endpoints(0)->mutable_ibverbs();
    ib->clear_near_rails();
    ib->clear_numa_node();
  });
  RunAndCheck(*a, {MakeOp(0, kRead, near, 4, kSize - 4, old_style, 0)},
              {&near, &old_style});
  // This agent still keeps to its own near rails; the peer's are all used.
  EXPECT_EQ(Carried(RailBytes(a->backend<IbverbsBackend>())), kNode1);
  EXPECT_EQ(Carried(Served(b_devices_)), kEvery);
  // Indices past the context's rails name nothing: every rail too.
  const TestBuffer forged = far.WithContext([](v1::RemoteBuffer& context) {
    v1::IbverbsEndpoint* ib = context.mutable_endpoints(0)->mutable_ibverbs();
    ib->clear_near_rails();
    ib->add_near_rails(8);
    ib->add_near_rails(1000);
  });
  const std::vector<uint64_t> served = Served(b_devices_);
  RunAndCheck(*a, {MakeOp(0, kWrite, near, 0, kSize, forged, 0)},
              {&near, &forged});
  EXPECT_EQ(Carried(Since(Served(b_devices_), served)), kEvery);
}

TEST_F(TwoSocketTest, UnknownNodesUseEveryRail) {
  // The buffer's node unknown (not placed yet, device memory...).
  a_memory_->Place(-1);
  auto a = Agent("agent-a", a_devices_, a_memory_);
  auto b = Agent("agent-b", b_devices_, b_memory_);
  const uint64_t kSize = 8 << 20;
  const TestBuffer near = a->Register(kSize, v1::ACCESS_READ_WRITE, 61);
  const TestBuffer far = b->Register(kSize, v1::ACCESS_READ_WRITE, 62);
  EXPECT_EQ(near.context->endpoints(0).ibverbs().near_rails_size(), 0);
  EXPECT_FALSE(near.context->endpoints(0).ibverbs().has_numa_node());
  RunAndCheck(*a, {MakeOp(0, kWrite, near, 0, kSize, far, 0)}, {&near, &far});
  EXPECT_EQ(Carried(RailBytes(a->backend<IbverbsBackend>())), kEvery);
  EXPECT_EQ(Carried(Served(b_devices_)), kNode1);
}

TEST_F(NumaAffinityTest, UnknownDeviceNodesUseEveryRail) {
  // A host whose sysfs says nothing of its NICs.
  const std::vector<std::string> a_devices = AddHost("a", 4, {});
  const std::vector<std::string> b_devices = AddHost("b", 4, {});
  auto a = Agent("agent-a", a_devices, std::make_shared<PlacedMemory>(1));
  auto b = Agent("agent-b", b_devices, std::make_shared<PlacedMemory>(0));
  const uint64_t kSize = 4 << 20;
  const TestBuffer near = a->Register(kSize, v1::ACCESS_READ_WRITE, 71);
  const TestBuffer far = b->Register(kSize, v1::ACCESS_READ_WRITE, 72);
  EXPECT_EQ(far.context->endpoints(0).ibverbs().near_rails_size(), 0);
  RunAndCheck(*a, {MakeOp(0, kRead, near, 0, kSize, far, 0)}, {&near, &far});
  EXPECT_EQ(Carried(RailBytes(a->backend<IbverbsBackend>())),
            std::vector<bool>(4, true));
  EXPECT_EQ(Carried(Served(b_devices)), std::vector<bool>(4, true));
}

// One NIC on the buffer's node, three on the other: far rails join large
// ops (the near one is a quarter of the speed), small ones stay near.
TEST_F(NumaAffinityTest, AnAsymmetricHostAddsFarRailsToLargeOpsOnly) {
  const std::vector<std::string> a_devices = AddHost("a", 4, {1, 0, 0, 0});
  const std::vector<std::string> b_devices = AddHost("b", 4, {1, 0, 0, 0});
  auto memory = std::make_shared<PlacedMemory>(1);
  auto a = Agent("agent-a", a_devices, memory);
  auto b = Agent("agent-b", b_devices, memory);
  const uint64_t kSize = 8 << 20;
  const TestBuffer near = a->Register(kSize, v1::ACCESS_READ_WRITE, 81);
  const TestBuffer far = b->Register(kSize, v1::ACCESS_READ_WRITE, 82);
  IbverbsBackend& backend = a->backend<IbverbsBackend>();
  std::vector<Op> small;
  for (uint64_t i = 0; i < 24; ++i) {
    small.push_back(MakeOp(i, i % 3 ? kWrite : kRead, near, i * 8192 + 3, 5000,
                           far, i * 8192 + 1));
  }
  RunAndCheck(*a, small, {&near, &far});
  EXPECT_EQ(RailBytes(backend), std::vector<uint64_t>({24 * 5000, 0, 0, 0}));
  EXPECT_EQ(Served(b_devices), std::vector<uint64_t>({24 * 5000, 0, 0, 0}));
  const std::vector<uint64_t> before = RailBytes(backend);
  RunAndCheck(*a, {MakeOp(0, kWrite, near, 1, kSize - 1, far, 0)},
              {&near, &far});
  const std::vector<uint64_t> large = Since(RailBytes(backend), before);
  EXPECT_EQ(Carried(large), std::vector<bool>(4, true));
  EXPECT_EQ(Sum(large), kSize - 1);
  EXPECT_EQ(Carried(Served(b_devices)), std::vector<bool>(4, true));
}

TEST_F(NumaAffinityTest, NearShareZeroKeepsLargeOpsNearToo) {
  const std::vector<std::string> a_devices = AddHost("a", 4, {1, 0, 0, 0});
  const std::vector<std::string> b_devices = AddHost("b", 4, {1, 0, 0, 0});
  auto memory = std::make_shared<PlacedMemory>(1);
  IbverbsOptions options = Fast();
  options.numa_near_share = 0;
  auto a = Agent("agent-a", a_devices, memory, options);
  auto b = Agent("agent-b", b_devices, memory, options);
  const uint64_t kSize = 4 << 20;
  const TestBuffer near = a->Register(kSize, v1::ACCESS_READ_WRITE, 91);
  const TestBuffer far = b->Register(kSize, v1::ACCESS_READ_WRITE, 92);
  RunAndCheck(*a, {MakeOp(0, kRead, near, 0, kSize, far, 0)}, {&near, &far});
  EXPECT_EQ(RailBytes(a->backend<IbverbsBackend>()),
            std::vector<uint64_t>({kSize, 0, 0, 0}));
  EXPECT_EQ(Served(b_devices), std::vector<uint64_t>({kSize, 0, 0, 0}));
}

// A GPU allocation as the NIC sees it: a memfd stands in for the dma-buf
// (the soft NIC maps it, as a real one reaches GPU memory), mapped here too
// so that the test sees every byte the NIC moved.
class FakeGpuMemory {
 public:
  FakeGpuMemory(uint64_t size, uint8_t seed)
      : fd_(::memfd_create("fake-gpu-memory", MFD_CLOEXEC)), size_(size) {
    EXPECT_TRUE(fd_.valid());
    EXPECT_EQ(::ftruncate(fd_.get(), static_cast<off_t>(size_)), 0);
    void* map = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED,
                       fd_.get(), 0);
    EXPECT_NE(map, MAP_FAILED);
    bytes_ = static_cast<uint8_t*>(map);
    for (uint64_t i = 0; i < size_; ++i) {
      bytes_[i] = static_cast<uint8_t>(seed + i * 13 + (i >> 12));
    }
  }
  ~FakeGpuMemory() { ::munmap(bytes_, size_); }
  FakeGpuMemory(const FakeGpuMemory&) = delete;
  FakeGpuMemory& operator=(const FakeGpuMemory&) = delete;

  // All of it as CUDA device memory of the device at `pci_bus_id` (empty:
  // none given), on an fd of its own as the attach socket gives the agent.
  DeviceMemory Adopt(const std::string& pci_bus_id) const {
    DeviceMemory::Description description;
    description.length = size_;
    description.kind = v1::MEMORY_KIND_CUDA;
    description.pci_bus_id = pci_bus_id;
    auto memory = DeviceMemory::Adopt(
        UniqueFd(::dup(fd_.get())), description,
        [](uint64_t) -> absl::StatusOr<std::unique_ptr<MappingCharge>> {
          return nullptr;
        });
    EXPECT_TRUE(memory.ok()) << memory.status();
    return *std::move(memory);
  }
  std::vector<uint8_t> Image() const {
    return std::vector<uint8_t>(bytes_, bytes_ + size_);
  }
  std::optional<uint64_t> FirstDifference(
      const std::vector<uint8_t>& image) const {
    for (uint64_t i = 0; i < size_; ++i) {
      if (i >= image.size() || bytes_[i] != image[i]) return i;
    }
    return std::nullopt;
  }

 private:
  UniqueFd fd_;
  uint64_t size_;
  uint8_t* bytes_ = nullptr;
};

// The two-socket host with a GPU on node 1. Its PCIe switch has two NICs
// besides it (a4, a5); a6 sits under another root port of the same root
// complex, a7 under another root complex: all four on node 1.
class TwoSocketGpuTest : public TwoSocketTest {
 protected:
  static constexpr char kGpu[] = "0000:af:00.0";
  static constexpr uint64_t kSize = 4 << 20;

  void SetUp() override {
    TwoSocketTest::SetUp();
    host_.pci_devices[kGpu] = 1;
  }
  // Describes the PCI tree of a's node-1 NICs and the GPU.
  void AddPciTree() {
    host_.pci_paths = {
        {kGpu, "pci0000:ac/0000:ac:00.0/0000:ad:00.0/0000:ae:00.0/" + Gpu()},
        {"0000:b1:00.0",
         "pci0000:ac/0000:ac:00.0/0000:ad:00.0/0000:ae:04.0/0000:b1:00.0"},
        {"0000:b2:00.0",
         "pci0000:ac/0000:ac:00.0/0000:ad:00.0/0000:ae:08.0/0000:b2:00.0"},
        {"0000:c1:00.0", "pci0000:ac/0000:ac:02.0/0000:c1:00.0"},
        {"0000:d9:00.0", "pci0000:d7/0000:d7:00.0/0000:d8:00.0/0000:d9:00.0"},
    };
    // b's host is built the same way.
    host_.rdma_pci = {{"a4", "0000:b1:00.0"}, {"a5", "0000:b2:00.0"},
                      {"a6", "0000:c1:00.0"}, {"a7", "0000:d9:00.0"},
                      {"b4", "0000:b1:00.0"}, {"b5", "0000:b2:00.0"},
                      {"b6", "0000:c1:00.0"}, {"b7", "0000:d9:00.0"}};
  }
  static std::string Gpu() { return kGpu; }

  // Runs `ops` from `a` (their local buffer `gpu`'s registration, their
  // remote `remote`) and checks every byte of both.
  static void RunAndCheckDevice(TestAgent& a, const std::vector<Op>& ops,
                                const FakeGpuMemory& gpu,
                                const TestBuffer& remote) {
    Refill(remote);
    std::vector<uint8_t> gpu_image = gpu.Image();
    std::vector<uint8_t> remote_image = Snapshot(remote);
    for (const Op& op : ops) Apply(op, gpu_image, remote_image);
    const auto results =
        a.backend<IbverbsBackend>().Submit(ops, In(absl::Seconds(60)));
    for (size_t i = 0; i < results.size(); ++i) {
      ASSERT_TRUE(results[i].ok()) << "op " << i << ": " << results[i];
    }
    EXPECT_EQ(gpu.FirstDifference(gpu_image), std::nullopt);
    EXPECT_EQ(FirstDifference(remote, remote_image), std::nullopt);
  }

  // A large write from the GPU and a large read into it, then small ones:
  // what each affinity test moves.
  static std::vector<std::vector<Op>> Batches(const TestBuffer& local,
                                              const TestBuffer& remote) {
    std::vector<Op> small;
    for (uint64_t i = 0; i < 16; ++i) {
      small.push_back(MakeOp(i, i % 2 ? kRead : kWrite, local, i * 8192 + 3,
                             3001, remote, (15 - i) * 8192 + 1));
    }
    return {{MakeOp(0, kWrite, local, 5, kSize - 9, remote, 2)},
            {MakeOp(0, kRead, local, 1, kSize - 3, remote, 3)},
            small};
  }
  static constexpr uint64_t kBatchBytes = (kSize - 9) + (kSize - 3) + 16 * 3001;

  std::vector<uint64_t> Run(TestAgent& a, const FakeGpuMemory& gpu,
                            const TestBuffer& local, const TestBuffer& remote) {
    const std::vector<uint64_t> before = RailBytes(a.backend<IbverbsBackend>());
    for (const std::vector<Op>& ops : Batches(local, remote)) {
      RunAndCheckDevice(a, ops, gpu, remote);
    }
    return Since(RailBytes(a.backend<IbverbsBackend>()), before);
  }
};

TEST_F(TwoSocketGpuTest, DeviceMemoryGoesOverTheRailsNearItsGpu) {
  // The host locator would say node 0: device memory never asks it.
  a_memory_->Place(0);
  auto a = Agent("agent-a", a_devices_, a_memory_);
  auto b = Agent("agent-b", b_devices_, b_memory_);
  FakeGpuMemory gpu(kSize, 5);
  // As nvidia-smi prints it.
  const TestBuffer local =
      a->RegisterDevice(gpu.Adopt("00000000:AF:00.0"), v1::ACCESS_READ_WRITE);
  const TestBuffer remote = b->Register(kSize, v1::ACCESS_READ_WRITE, 6);
  EXPECT_EQ(local.registration->pci_bus_id(), kGpu);
  const v1::IbverbsEndpoint& ib = local.context->endpoints(0).ibverbs();
  EXPECT_EQ(
      std::vector<uint32_t>(ib.near_rails().begin(), ib.near_rails().end()),
      std::vector<uint32_t>({4, 5, 6, 7}));
  ASSERT_TRUE(ib.has_numa_node());
  EXPECT_EQ(ib.numa_node(), 1);
  EXPECT_EQ(a_memory_->null_queries(), 0);
  EXPECT_EQ(a_memory_->queries(), 0);

  const std::vector<uint64_t> bytes = Run(*a, gpu, local, remote);
  EXPECT_EQ(Carried(bytes), kNode1);
  EXPECT_EQ(Sum(bytes), kBatchBytes);
  EXPECT_EQ(Carried(Served(b_devices_)), kNode1);
}

TEST_F(TwoSocketGpuTest, DeviceMemoryWithoutAKnownGpuUsesEveryRail) {
  auto a = Agent("agent-a", a_devices_, a_memory_);
  auto b = Agent("agent-b", b_devices_, b_memory_);
  const TestBuffer remote = b->Register(kSize, v1::ACCESS_READ_WRITE, 7);
  // No PCI address given, and one this host's sysfs does not know (a
  // malformed one never gets here: tests/ibverbs/device_memory_test.cc).
  for (const std::string& pci_bus_id :
       {std::string(), std::string("0000:3b:00.0")}) {
    SCOPED_TRACE(pci_bus_id.empty() ? "no PCI address" : pci_bus_id);
    FakeGpuMemory gpu(kSize, 8);
    const TestBuffer local =
        a->RegisterDevice(gpu.Adopt(pci_bus_id), v1::ACCESS_READ_WRITE);
    const v1::IbverbsEndpoint& ib = local.context->endpoints(0).ibverbs();
    EXPECT_EQ(ib.near_rails_size(), 0);
    EXPECT_FALSE(ib.has_numa_node());
    const std::vector<uint64_t> bytes = Run(*a, gpu, local, remote);
    EXPECT_EQ(Carried(bytes), kEvery);
    EXPECT_EQ(Sum(bytes), kBatchBytes);
  }
  EXPECT_EQ(a_memory_->queries(), 0);
}

TEST_F(TwoSocketGpuTest, NicsOnTheGpusPcieSwitchAreNearest) {
  AddPciTree();
  // Default options: two NICs of eight are below --ibverbs_numa_near_share
  // of the link speed, yet large ops stay on the switch too (the others
  // would reach the GPU's memory through the CPU).
  auto a = Agent("agent-a", a_devices_, a_memory_);
  auto b = Agent("agent-b", b_devices_, b_memory_);
  FakeGpuMemory gpu(kSize, 9);
  const TestBuffer local =
      a->RegisterDevice(gpu.Adopt(kGpu), v1::ACCESS_READ_WRITE);
  const TestBuffer remote = b->Register(kSize, v1::ACCESS_READ_WRITE, 10);
  const v1::IbverbsEndpoint& ib = local.context->endpoints(0).ibverbs();
  EXPECT_EQ(
      std::vector<uint32_t>(ib.near_rails().begin(), ib.near_rails().end()),
      std::vector<uint32_t>({4, 5}));
  EXPECT_EQ(ib.numa_node(), 1);
  EXPECT_TRUE(ib.near_rails_only());
  const std::vector<bool> kSwitch = {false, false, false, false,
                                     true,  true,  false, false};
  const std::vector<uint64_t> bytes = Run(*a, gpu, local, remote);
  EXPECT_EQ(Carried(bytes), kSwitch);
  EXPECT_EQ(Sum(bytes), kBatchBytes);
  // The peer's host buffer still on its own node's rails.
  EXPECT_EQ(Carried(Served(b_devices_)), kNode1);
  // Host memory on the same agent is placed as before: all of node 1.
  const TestBuffer host = a->Register(1 << 16, v1::ACCESS_READ_WRITE, 11);
  const v1::IbverbsEndpoint& host_ib = host.context->endpoints(0).ibverbs();
  EXPECT_EQ(std::vector<uint32_t>(host_ib.near_rails().begin(),
                                  host_ib.near_rails().end()),
            std::vector<uint32_t>({4, 5, 6, 7}));
  EXPECT_FALSE(host_ib.near_rails_only());
}

TEST_F(TwoSocketGpuTest, PeersServeAGpuBufferFromTheNicsOnItsSwitch) {
  AddPciTree();
  auto a = Agent("agent-a", a_devices_, a_memory_);
  auto b = Agent("agent-b", b_devices_, b_memory_);
  FakeGpuMemory gpu(kSize, 12);
  const TestBuffer on_gpu =
      b->RegisterDevice(gpu.Adopt(kGpu), v1::ACCESS_READ_WRITE);
  const TestBuffer host = a->Register(kSize, v1::ACCESS_READ_WRITE, 13);
  // A large write into the GPU's memory and a large read out of it.
  std::vector<uint8_t> gpu_image = gpu.Image();
  Refill(host);
  std::vector<uint8_t> host_image = Snapshot(host);
  const std::vector<Op> ops = {MakeOp(0, kWrite, host, 7, kSize / 2, on_gpu, 1),
                               MakeOp(1, kRead, host, kSize / 2 + 7,
                                      kSize / 2 - 11, on_gpu, kSize / 2 + 5)};
  for (const Op& op : ops) Apply(op, host_image, gpu_image);
  const auto results =
      a->backend<IbverbsBackend>().Submit(ops, In(absl::Seconds(60)));
  for (size_t i = 0; i < results.size(); ++i) {
    ASSERT_TRUE(results[i].ok()) << "op " << i << ": " << results[i];
  }
  EXPECT_EQ(gpu.FirstDifference(gpu_image), std::nullopt);
  EXPECT_EQ(FirstDifference(host, host_image), std::nullopt);
  // b's NICs on the GPU's switch served every byte (large ops too); a's
  // host buffer is on node 1, its four rails carried them.
  EXPECT_EQ(Sum(Served(b_devices_)), kSize - 11);
  EXPECT_EQ(Carried(Served(b_devices_)),
            std::vector<bool>(
                {false, false, false, false, true, true, false, false}));
  EXPECT_EQ(Carried(RailBytes(a->backend<IbverbsBackend>())), kNode1);
}

// Links of 8 MiB/s, so that a 32 MiB op takes a second over four rails:
// the near NICs are unplugged while it runs.
class TwoSocketFailoverTest : public TwoSocketTest {
 protected:
  uint64_t Rate() const override { return 8 << 20; }
};

TEST_F(TwoSocketFailoverTest, FarRailsTakeOverWhenTheNearOnesGo) {
  IbverbsOptions options = Fast();
  options.rail_cooldown = absl::Minutes(10);
  options.rail_max_cooldown = absl::Minutes(10);
  auto a = Agent("agent-a", a_devices_, a_memory_, options);
  auto b = Agent("agent-b", b_devices_, b_memory_, options);
  const uint64_t kLength = (32u << 20) + 5;
  const TestBuffer near = a->Register(kLength + 64, v1::ACCESS_READ_WRITE, 101);
  const TestBuffer far = b->Register(kLength + 64, v1::ACCESS_READ_WRITE, 102);
  IbverbsBackend& backend = a->backend<IbverbsBackend>();
  absl::Status status = absl::UnknownError("not run");
  absl::Notification done;
  std::thread submit([&] {
    status = backend.Submit({MakeOp(0, kWrite, near, 3, kLength, far, 7)},
                            In(absl::Seconds(60)))[0];
    done.Notify();
  });
  while (fabric_.bytes_moved("a4") < (512u << 10) && !done.HasBeenNotified()) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_FALSE(done.HasBeenNotified())
      << "the transfer ended before the cables were pulled";
  for (int i = 4; i < 8; ++i) {
    EXPECT_TRUE(fabric_.Unplug(absl::StrCat("a", i)).ok());
  }
  submit.join();
  // Over RDMA still: no UNAVAILABLE for the registry to retry on tcp.
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(FirstWrongByte(far, near.seed, 3, 7, kLength), std::nullopt);
  EXPECT_EQ(FirstChangedByte(near), std::nullopt);
  const std::vector<uint64_t> bytes = RailBytes(backend);
  EXPECT_EQ(Sum(bytes), kLength);
  EXPECT_GT(bytes[4], 0u);
  // Each near rail's rest went to a far rail of its own.
  for (int i = 0; i < 4; ++i) {
    EXPECT_GT(bytes[i], 0u) << "far rail a" << i << " took over";
  }
  // The peer's near rails still served everything.
  EXPECT_EQ(Carried(Served(b_devices_)), kNode1);
  // The next op goes over the far rails at once, the peer's still near.
  const uint64_t errors_before = [&] {
    uint64_t errors = 0;
    const auto info = backend.transport_info();
    for (int i = 0; i < 8; ++i) {
      errors += std::stoull(
          info.attributes().at(absl::StrCat("rail.a", i, ":1.errors")));
    }
    return errors;
  }();
  const std::vector<uint64_t> before = RailBytes(backend);
  RunAndCheck(*a, {MakeOp(0, kRead, near, 0, 4 << 20, far, 9)}, {&near, &far});
  EXPECT_EQ(Carried(Since(RailBytes(backend), before)), kNode0);
  EXPECT_EQ(Carried(Served(b_devices_)), kNode1);
  uint64_t errors_after = 0;
  const auto info = backend.transport_info();
  for (int i = 0; i < 8; ++i) {
    errors_after += std::stoull(
        info.attributes().at(absl::StrCat("rail.a", i, ":1.errors")));
  }
  EXPECT_EQ(errors_after, errors_before) << "no WR failed on the second op";
}

}  // namespace
}  // namespace rdma_agent::ibverbs

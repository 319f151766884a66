// The ibverbs backend with several rails (devices) per agent on the software
// RC NIC: what GetInfo and contexts say of the rails, how ops are striped
// over them (in proportion to link speed, small ops spread, a peer with
// fewer rails, agents with one rail), and every byte checked, inside and
// outside each op's range.
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "backends/ibverbs/ibverbs_backend.h"
#include "backends/ibverbs/soft/soft_verbs.h"
#include "backends/testing/harness.h"
#include "backends/testing/ibverbs_agent.h"
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
using verbs::SoftDeviceConfig;
using verbs::SoftFabric;

constexpr v1::OpType kRead = v1::OP_TYPE_READ_INTO_LOCAL;
constexpr v1::OpType kWrite = v1::OP_TYPE_WRITE_FROM_LOCAL;

// EDR lanes: 4x = 103.125 Gb/s, 2x = half of it.
constexpr uint8_t kEdr = 32;
constexpr uint8_t k4x = 2;
constexpr uint8_t k2x = 16;

SoftDeviceConfig Device(const std::string& name, uint8_t width = k4x) {
  SoftDeviceConfig config;
  config.name = name;
  config.active_speed = kEdr;
  config.active_width = width;
  return config;
}

IbverbsOptions Fast() {
  IbverbsOptions options;
  options.qp.timeout = 8;  // ~1 ms per try: a lost peer shows quickly
  options.qp.retry_cnt = 2;
  return options;
}

class MultiRailTest : public ::testing::Test {
 protected:
  void Add(const SoftDeviceConfig& config) {
    ASSERT_TRUE(fabric_.AddDevice(config).ok()) << config.name;
  }
  // Adds devices `prefix`0..n-1 (all 4x EDR unless `widths` says).
  std::vector<std::string> AddDevices(const std::string& prefix, size_t n,
                                      std::vector<uint8_t> widths = {}) {
    std::vector<std::string> names;
    for (size_t i = 0; i < n; ++i) {
      names.push_back(absl::StrCat(prefix, i));
      Add(Device(names.back(), i < widths.size() ? widths[i] : k4x));
    }
    return names;
  }
  std::unique_ptr<TestAgent> Agent(const std::string& id,
                                   const std::vector<std::string>& devices,
                                   IbverbsOptions options = Fast()) {
    return SoftIbverbsAgent(fabric_, id, devices, std::move(options));
  }

  // Runs one op from `a` and checks every byte of both buffers: the
  // destination changed exactly in the op's range, to the source's bytes;
  // the source not at all. Buffers are refilled with their patterns first.
  static void MoveAndCheck(TestAgent& a, v1::OpType type,
                           const TestBuffer& near, uint64_t near_offset,
                           uint64_t length, const TestBuffer& far,
                           uint64_t far_offset) {
    SCOPED_TRACE(absl::StrCat(type == kRead ? "read" : "write", " local ",
                              near_offset, " +", length, " remote ",
                              far_offset));
    Refill(near);
    Refill(far);
    const auto results = a.backend<IbverbsBackend>().Submit(
        {MakeOp(0, type, near, near_offset, length, far, far_offset)},
        In(absl::Seconds(60)));
    ASSERT_EQ(results.size(), 1u);
    ASSERT_TRUE(results[0].ok()) << results[0];
    const TestBuffer& dst = type == kRead ? near : far;
    const TestBuffer& src = type == kRead ? far : near;
    EXPECT_EQ(
        FirstWrongByte(dst, src.seed, type == kRead ? far_offset : near_offset,
                       type == kRead ? near_offset : far_offset, length),
        std::nullopt);
    EXPECT_EQ(FirstChangedByte(src), std::nullopt);
  }

  // Bytes each of `backend`'s rails moved, in rail order.
  static std::vector<uint64_t> RailBytes(const IbverbsBackend& backend) {
    std::vector<uint64_t> bytes;
    for (const std::string& rail : backend.rail_names()) {
      bytes.push_back(backend.rail_bytes(rail));
    }
    return bytes;
  }

  SoftFabric fabric_;
};

// --- Rails: discovery, GetInfo, contexts ----------------------------------

TEST_F(MultiRailTest, GetInfoListsEveryRailWithItsStateAndCounters) {
  SoftDeviceConfig numa = Device("a1", k2x);
  numa.numa_node = 1;
  Add(Device("a0"));
  Add(numa);
  Add(Device("a2"));
  auto a = Agent("agent-a", {"a0", "a1", "a2"});
  ASSERT_NE(a, nullptr);
  IbverbsBackend& backend = a->backend<IbverbsBackend>();
  ASSERT_TRUE(backend.available()) << backend.unavailable_reason();
  EXPECT_EQ(backend.rail_names(),
            std::vector<std::string>({"a0:1", "a1:1", "a2:1"}));
  v1::TransportInfo info = backend.transport_info();
  ASSERT_EQ(info.devices_size(), 3);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(info.devices(i).name(), absl::StrCat("a", i));
    EXPECT_EQ(info.devices(i).port(), 1u);
    EXPECT_EQ(info.devices(i).state(), "ACTIVE");
    EXPECT_EQ(info.devices(i).gids_size(), 1);
  }
  EXPECT_DOUBLE_EQ(info.devices(0).speed_gbps(), 103.125);
  EXPECT_DOUBLE_EQ(info.devices(1).speed_gbps(), 51.5625);
  const auto& attributes = info.attributes();
  EXPECT_EQ(attributes.at("rails"), "3");
  EXPECT_EQ(attributes.at("rail.a1:1.numa_node"), "1");
  EXPECT_EQ(attributes.at("rail.a0:1.numa_node"), "-1");
  EXPECT_EQ(attributes.at("rail.a1:1.speed_gbps"), "51.5625");
  for (const char* rail : {"a0:1", "a1:1", "a2:1"}) {
    const std::string prefix = absl::StrCat("rail.", rail, ".");
    EXPECT_EQ(attributes.at(prefix + "bytes"), "0");
    EXPECT_EQ(attributes.at(prefix + "work_requests"), "0");
    EXPECT_EQ(attributes.at(prefix + "errors"), "0");
    EXPECT_EQ(attributes.at(prefix + "reposted_bytes"), "0");
    EXPECT_EQ(attributes.at(prefix + "health"), "ok");
  }
  // A pulled cable shows at once, before any op finds out.
  ASSERT_TRUE(fabric_.Unplug("a2").ok());
  info = backend.transport_info();
  EXPECT_EQ(info.devices(2).state(), "DOWN");
  EXPECT_EQ(info.devices(0).state(), "ACTIVE");
}

TEST_F(MultiRailTest, ContextsListEveryRailAndTheFirstInTheOldFields) {
  AddDevices("a", 3, {k4x, k2x, k4x});
  Add(Device("c0"));
  auto a = Agent("agent-a", {"a0", "a1", "a2"});
  auto c = Agent("agent-c", {"c0"});
  const TestBuffer buffer = a->Register(4096, v1::ACCESS_READ_WRITE, 1);
  const v1::IbverbsEndpoint& ib = buffer.context->endpoints(0).ibverbs();
  // What an agent that knows of one port per agent reads: the first rail.
  EXPECT_EQ(ib.device(), "a0");
  EXPECT_EQ(ib.port(), 1u);
  EXPECT_EQ(ib.gid().size(), 16u);
  EXPECT_EQ(ib.rkey(), 0u);
  ASSERT_EQ(ib.rails_size(), 3);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(ib.rails(i).device(), absl::StrCat("a", i));
    EXPECT_EQ(ib.rails(i).port(), 1u);
    EXPECT_EQ(ib.rails(i).gid().size(), 16u);
    EXPECT_EQ(ib.rails(i).max_message_bytes(), 1u << 30);
  }
  EXPECT_EQ(ib.rails(0).gid(), ib.gid());
  EXPECT_DOUBLE_EQ(ib.rails(1).speed_gbps(), 51.5625);
  // A single-rail agent's context is what it always was.
  const TestBuffer single = c->Register(4096, v1::ACCESS_READ_WRITE, 2);
  EXPECT_EQ(single.context->endpoints(0).ibverbs().rails_size(), 0);
  EXPECT_EQ(single.context->endpoints(0).ibverbs().device(), "c0");
  // A rail with a malformed GID makes the context unusable over ibverbs.
  auto broken = std::make_shared<v1::RemoteBuffer>(*buffer.context);
  broken->mutable_endpoints(0)->mutable_ibverbs()->mutable_rails(2)->set_gid(
      "short");
  EXPECT_TRUE(c->backend<IbverbsBackend>().CanReach(*buffer.context));
  EXPECT_FALSE(c->backend<IbverbsBackend>().CanReach(*broken));
}

TEST_F(MultiRailTest, DevicesAndPortOptionsChooseTheRails) {
  AddDevices("a", 2);
  SoftDeviceConfig down = Device("a2");
  down.port_state = IBV_PORT_DOWN;
  Add(down);
  // Every port of every device the Verbs sees is a rail, a port DOWN at
  // start too (GetInfo says so); contexts list only the ACTIVE ones.
  auto all = Agent("agent-all", {"a0", "a1", "a2"});
  EXPECT_EQ(all->backend<IbverbsBackend>().rail_names(),
            std::vector<std::string>({"a0:1", "a1:1", "a2:1"}));
  const v1::TransportInfo info =
      all->backend<IbverbsBackend>().transport_info();
  ASSERT_EQ(info.devices_size(), 3);
  EXPECT_EQ(info.devices(2).state(), "DOWN");
  const TestBuffer buffer = all->Register(4096, v1::ACCESS_READ_WRITE, 1);
  const v1::IbverbsEndpoint& ib = buffer.context->endpoints(0).ibverbs();
  ASSERT_EQ(ib.rails_size(), 2);
  EXPECT_EQ(ib.rails(0).device(), "a0");
  EXPECT_EQ(ib.rails(1).device(), "a1");
  IbverbsOptions chosen = Fast();
  chosen.devices = {"a1", "a2"};
  auto some = Agent("agent-some", {"a0", "a1", "a2"}, chosen);
  EXPECT_EQ(some->backend<IbverbsBackend>().rail_names(),
            std::vector<std::string>({"a1:1", "a2:1"}));
  // Only the DOWN one: nothing a context could offer peers.
  IbverbsOptions down_only = Fast();
  down_only.devices = {"a2"};
  auto none_up = Agent("agent-down", {"a2"}, down_only);
  EXPECT_FALSE(none_up->backend<IbverbsBackend>().available());
  IbverbsOptions no_port = Fast();
  no_port.port = 2;
  auto none = Agent("agent-none", {"a0", "a1"}, no_port);
  EXPECT_FALSE(none->backend<IbverbsBackend>().available());
  EXPECT_NE(none->backend<IbverbsBackend>().unavailable_reason().find(
                "no usable RDMA port"),
            std::string::npos)
      << none->backend<IbverbsBackend>().unavailable_reason();
}

TEST_F(MultiRailTest, OneRailAndManyRailAgentsWorkBothWays) {
  const std::vector<std::string> a_devices = AddDevices("a", 4);
  Add(Device("c0"));
  auto a = Agent("agent-a", a_devices);
  auto c = Agent("agent-c", {"c0"});
  const uint64_t kSize = (3 << 20) + 777;
  TestBuffer on_a = a->Register(kSize, v1::ACCESS_READ_WRITE, 11);
  TestBuffer on_c = c->Register(kSize, v1::ACCESS_READ_WRITE, 12);
  // Many rails to one: every rail of A pairs with c0.
  MoveAndCheck(*a, kWrite, on_a, 3, kSize - 10, on_c, 5);
  MoveAndCheck(*a, kRead, on_a, 7, kSize - 9, on_c, 1);
  for (uint64_t bytes : RailBytes(a->backend<IbverbsBackend>())) {
    EXPECT_GT(bytes, 0u) << "every rail of the requester carried a piece";
  }
  // One rail to many: c0 pairs with every rail of A.
  MoveAndCheck(*c, kWrite, on_c, 1, kSize - 1, on_a, 0);
  MoveAndCheck(*c, kRead, on_c, 0, kSize - 3, on_a, 2);
  EXPECT_EQ(a->backend<IbverbsBackend>().responder_count(), 4u);
  // A context as an agent that knows nothing of rails reads it: A's first
  // rail only.
  TestBuffer old_style = on_a.WithContext([](v1::RemoteBuffer& context) {
    context.mutable_endpoints(0)->mutable_ibverbs()->clear_rails();
  });
  const std::vector<uint64_t> before = RailBytes(a->backend<IbverbsBackend>());
  MoveAndCheck(*c, kWrite, on_c, 9, kSize - 20, old_style, 11);
  // Over the lane C already has to A's first rail.
  EXPECT_EQ(c->backend<IbverbsBackend>().requester_count(), 4u);
  EXPECT_EQ(RailBytes(a->backend<IbverbsBackend>()), before)
      << "A's rails carried nothing as requester";
}

// --- Striping ------------------------------------------------------------

TEST_F(MultiRailTest, LargeOpsAreSplitInProportionToLinkSpeed) {
  // Two 4x and two 2x links on each side: shares 2:2:1:1.
  const std::vector<std::string> a_devices =
      AddDevices("a", 4, {k4x, k4x, k2x, k2x});
  const std::vector<std::string> b_devices =
      AddDevices("b", 4, {k4x, k4x, k2x, k2x});
  IbverbsOptions options = Fast();
  options.qp.max_message_bytes = 256 << 10;  // several WRs per piece
  auto a = Agent("agent-a", a_devices, options);
  auto b = Agent("agent-b", b_devices, options);
  const uint64_t kLength = (24u << 20) + 4097;
  TestBuffer near = a->Register(kLength + 64, v1::ACCESS_READ_WRITE, 21);
  TestBuffer far = b->Register(kLength + 64, v1::ACCESS_READ_WRITE, 22);
  MoveAndCheck(*a, kWrite, near, 13, kLength, far, 51);
  std::vector<uint64_t> bytes = RailBytes(a->backend<IbverbsBackend>());
  ASSERT_EQ(bytes.size(), 4u);
  EXPECT_EQ(bytes[0] + bytes[1] + bytes[2] + bytes[3], kLength);
  for (size_t i = 0; i < 4; ++i) {
    const double want = i < 2 ? 1.0 / 3 : 1.0 / 6;
    EXPECT_NEAR(static_cast<double>(bytes[i]) / kLength, want, 0.001)
        << "rail " << i;
    // What the soft NIC saw cross each device, as requester.
    EXPECT_EQ(fabric_.bytes_moved(a_devices[i]), bytes[i]);
  }
  MoveAndCheck(*a, kRead, near, 63, kLength, far, 1);
  bytes = RailBytes(a->backend<IbverbsBackend>());
  EXPECT_EQ(bytes[0] + bytes[1] + bytes[2] + bytes[3], 2 * kLength);
  EXPECT_NEAR(static_cast<double>(bytes[1]) / bytes[3], 2.0, 0.01);
  // One queue pair per rail pair, each a session on B; one polling thread
  // per device however many QPs it has.
  EXPECT_EQ(a->backend<IbverbsBackend>().requester_count(), 4u);
  EXPECT_EQ(b->backend<IbverbsBackend>().responder_count(), 4u);
  EXPECT_EQ(a->backend<IbverbsBackend>().completion_threads(), 4u);
  EXPECT_EQ(b->backend<IbverbsBackend>().completion_threads(), 4u);
}

TEST_F(MultiRailTest, SmallOpsAreSpreadOverTheRails) {
  const std::vector<std::string> a_devices = AddDevices("a", 4);
  const std::vector<std::string> b_devices = AddDevices("b", 4);
  auto a = Agent("agent-a", a_devices);
  auto b = Agent("agent-b", b_devices);
  constexpr uint64_t kOps = 40;
  constexpr uint64_t kLength = 3001;  // below the stripe threshold
  TestBuffer near = a->Register(kOps * 4096, v1::ACCESS_READ_WRITE, 31);
  TestBuffer far = b->Register(kOps * 4096, v1::ACCESS_READ_WRITE, 32);
  std::vector<Op> ops;
  for (uint64_t i = 0; i < kOps; ++i) {
    // Reverse placement so that a mix-up between ops would show.
    ops.push_back(MakeOp(i, kWrite, near, i * 4096 + 1, kLength, far,
                         (kOps - 1 - i) * 4096 + 3));
  }
  // What the ops must leave, every byte of both buffers.
  std::vector<uint8_t> near_image = Snapshot(near);
  std::vector<uint8_t> far_image = Snapshot(far);
  for (const Op& op : ops) Apply(op, near_image, far_image);
  const auto results =
      a->backend<IbverbsBackend>().Submit(ops, In(absl::Seconds(60)));
  for (uint64_t i = 0; i < kOps; ++i) {
    ASSERT_TRUE(results[i].ok()) << "op " << i << ": " << results[i];
  }
  EXPECT_EQ(FirstDifference(far, far_image), std::nullopt);
  EXPECT_EQ(FirstDifference(near, near_image), std::nullopt);
  // Each op whole on one rail, and the rails evenly loaded.
  for (uint64_t bytes : RailBytes(a->backend<IbverbsBackend>())) {
    EXPECT_EQ(bytes, kOps / 4 * kLength);
  }
}

TEST_F(MultiRailTest, APeerWithFewerRailsSharesThem) {
  const std::vector<std::string> a_devices = AddDevices("a", 4);
  const std::vector<std::string> b_devices = AddDevices("b", 2);
  IbverbsOptions options = Fast();
  options.qp.max_message_bytes = 1 << 20;
  auto a = Agent("agent-a", a_devices, options);
  auto b = Agent("agent-b", b_devices, options);
  const uint64_t kLength = (16u << 20) + 3;
  TestBuffer on_a = a->Register(kLength + 16, v1::ACCESS_READ_WRITE, 41);
  TestBuffer on_b = b->Register(kLength + 16, v1::ACCESS_READ_WRITE, 42);
  MoveAndCheck(*a, kWrite, on_a, 5, kLength, on_b, 7);
  MoveAndCheck(*a, kRead, on_a, 1, kLength, on_b, 2);
  // Four pairs, each half of one of B's rails: equal shares.
  const std::vector<uint64_t> a_bytes = RailBytes(a->backend<IbverbsBackend>());
  for (uint64_t bytes : a_bytes) {
    EXPECT_NEAR(static_cast<double>(bytes) / (2 * kLength), 0.25, 0.001);
  }
  EXPECT_EQ(b->backend<IbverbsBackend>().responder_count(), 4u);
  // The other way: each of B's two rails serves two of A's.
  MoveAndCheck(*b, kWrite, on_b, 3, kLength, on_a, 9);
  const std::vector<uint64_t> b_bytes = RailBytes(b->backend<IbverbsBackend>());
  ASSERT_EQ(b_bytes.size(), 2u);
  EXPECT_NEAR(static_cast<double>(b_bytes[0]) / kLength, 0.5, 0.001);
  EXPECT_EQ(b->backend<IbverbsBackend>().requester_count(), 4u);
}

TEST_F(MultiRailTest, OddOffsetsAndSizesAcrossRailsAndMessageSizes) {
  const std::vector<std::string> a_devices =
      AddDevices("a", 3, {k4x, k2x, k4x});
  const std::vector<std::string> b_devices = AddDevices("b", 2, {k2x, k4x});
  IbverbsOptions a_options = Fast();
  a_options.qp.max_message_bytes = 3 * 4096;
  a_options.stripe_threshold_bytes = 8192;
  IbverbsOptions b_options = Fast();
  b_options.qp.max_message_bytes = 5000;  // the smaller one wins
  auto a = Agent("agent-a", a_devices, a_options);
  auto b = Agent("agent-b", b_devices, b_options);
  const uint64_t kSize = 1 << 20;
  TestBuffer near = a->Register(kSize, v1::ACCESS_READ_WRITE, 51);
  TestBuffer far = b->Register(kSize, v1::ACCESS_READ_WRITE, 52);
  struct Case {
    v1::OpType type;
    uint64_t local_offset, length, remote_offset;
  };
  const std::vector<Case> cases = {
      {kWrite, 1, 1, 3},
      {kRead, 3, 8191, 17},
      {kWrite, 7, 8192, 11},
      {kRead, 99, 8193, 4099},
      {kWrite, 333, 65537, 77777},
      {kRead, 12347, 300007, 131071},
      {kWrite, 0, kSize, 0},
      {kRead, 0, kSize, 0},
      {kWrite, kSize - 1, 1, kSize - 1},
  };
  for (const Case& c : cases) {
    MoveAndCheck(*a, c.type, near, c.local_offset, c.length, far,
                 c.remote_offset);
  }
  for (uint64_t bytes : RailBytes(a->backend<IbverbsBackend>())) {
    EXPECT_GT(bytes, 0u);
  }
}

// --- Failover -------------------------------------------------------------

// Devices a0..a3 and b0..b3 whose links carry 8 MiB/s each, so that a
// 32 MiB op takes about a second over four rails: a cable pulled once a
// rail has moved its first half MiB is pulled mid-transfer.
class FailoverTest : public MultiRailTest {
 protected:
  static constexpr uint64_t kRate = 8 << 20;
  static constexpr uint64_t kLength = (32u << 20) + 5;

  void SetUp() override {
    for (const char* side : {"a", "b"}) {
      for (int i = 0; i < 4; ++i) {
        SoftDeviceConfig config = Device(absl::StrCat(side, i));
        config.bytes_per_second = kRate;
        Add(config);
        (side[0] == 'a' ? a_devices_ : b_devices_).push_back(config.name);
      }
    }
  }

  static IbverbsOptions Options(absl::Duration cooldown) {
    IbverbsOptions options = Fast();
    options.qp.max_message_bytes = 256 << 10;  // a rail's piece: many WRs
    options.rail_cooldown = cooldown;
    options.rail_max_cooldown = cooldown;
    return options;
  }

  // Runs `op` on `a` while pulling `unplug`'s cable once `moved()` says
  // half a MiB went through it; the op's status.
  absl::Status SubmitAndUnplug(TestAgent& a, const Op& op,
                               const std::function<uint64_t()>& moved,
                               const std::string& unplug) {
    absl::Status result = absl::UnknownError("not run");
    absl::Notification done;
    std::thread submit([&] {
      result =
          a.backend<IbverbsBackend>().Submit({op}, In(absl::Seconds(60)))[0];
      done.Notify();
    });
    while (moved() < (512u << 10) && !done.HasBeenNotified()) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    EXPECT_FALSE(done.HasBeenNotified())
        << "the transfer ended before the cable was pulled";
    EXPECT_TRUE(fabric_.Unplug(unplug).ok());
    submit.join();
    return result;
  }

  static std::string Attribute(const IbverbsBackend& backend,
                               const std::string& key) {
    const auto info = backend.transport_info();
    auto it = info.attributes().find(key);
    return it == info.attributes().end() ? "" : it->second;
  }
  static uint64_t Counter(const IbverbsBackend& backend,
                          const std::string& key) {
    return std::stoull("0" + Attribute(backend, key));
  }

  std::vector<std::string> a_devices_;
  std::vector<std::string> b_devices_;
};

TEST_F(FailoverTest, RequesterRailUnpluggedMidTransferFailsOverToTheOthers) {
  auto a = Agent("agent-a", a_devices_, Options(absl::Minutes(10)));
  auto b = Agent("agent-b", b_devices_, Options(absl::Minutes(10)));
  TestBuffer near = a->Register(kLength + 64, v1::ACCESS_READ_WRITE, 61);
  TestBuffer far = b->Register(kLength + 64, v1::ACCESS_READ_WRITE, 62);
  IbverbsBackend& backend = a->backend<IbverbsBackend>();
  const absl::Status status = SubmitAndUnplug(
      *a, MakeOp(0, kWrite, near, 3, kLength, far, 7),
      [&] { return fabric_.bytes_moved("a2"); }, "a2");
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(FirstWrongByte(far, near.seed, 3, 7, kLength), std::nullopt);
  EXPECT_EQ(FirstChangedByte(near), std::nullopt);
  // a2 carried part of its piece; the rest went over the other rails, and
  // every byte moved exactly once.
  const std::vector<uint64_t> bytes = RailBytes(backend);
  EXPECT_LT(bytes[2], kLength / 4);
  EXPECT_GT(bytes[0] + bytes[1] + bytes[3], 3 * (kLength / 4));
  EXPECT_EQ(bytes[0] + bytes[1] + bytes[2] + bytes[3], kLength);
  EXPECT_GT(Counter(backend, "rail.a2:1.errors"), 0u);
  EXPECT_GT(Counter(backend, "rail.a2:1.reposted_bytes"), 0u);
  EXPECT_EQ(Counter(backend, "rail.a0:1.errors"), 0u);
  // Its port is DOWN: the rail itself is left out.
  EXPECT_EQ(Attribute(backend, "rail.a2:1.health").rfind("cooling down", 0), 0u)
      << Attribute(backend, "rail.a2:1.health");
  EXPECT_EQ(backend.transport_info().devices(2).state(), "DOWN");
  // The next op goes over the three others without trying a2 again.
  const uint64_t errors = Counter(backend, "rail.a2:1.errors");
  MoveAndCheck(*a, kRead, near, 1, kLength / 2, far, 9);
  EXPECT_EQ(RailBytes(backend)[2], bytes[2]);
  EXPECT_EQ(Counter(backend, "rail.a2:1.errors"), errors);
}

TEST_F(FailoverTest, APostedBatchFailsOverWhenARailIsUnpluggedMidTransfer) {
  auto a = Agent("agent-a", a_devices_, Options(absl::Minutes(10)));
  auto b = Agent("agent-b", b_devices_, Options(absl::Minutes(10)));
  TestBuffer near = a->Register(kLength + 64, v1::ACCESS_READ_WRITE, 81);
  TestBuffer far = b->Register(kLength + 64, v1::ACCESS_READ_WRITE, 82);
  IbverbsBackend& backend = a->backend<IbverbsBackend>();
  // Posted from this thread, which then pulls the cable: nobody waits on
  // the batch, and the failed rail's bytes are posted again from the
  // poller's word alone.
  const std::vector<Op> ops = {MakeOp(0, kWrite, near, 3, kLength, far, 7)};
  absl::Status result = absl::UnknownError("done not called");
  absl::Notification done;
  backend.Post(ops, In(absl::Seconds(60)),
               [&](std::vector<absl::Status> statuses) {
                 result = statuses.at(0);
                 done.Notify();
               });
  ASSERT_FALSE(done.HasBeenNotified()) << "Post waited for the transfer";
  while (fabric_.bytes_moved("a1") < (512u << 10) && !done.HasBeenNotified()) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_FALSE(done.HasBeenNotified())
      << "the transfer ended before the cable was pulled";
  ASSERT_TRUE(fabric_.Unplug("a1").ok());
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(60)));
  ASSERT_TRUE(result.ok()) << result;
  EXPECT_EQ(FirstWrongByte(far, near.seed, 3, 7, kLength), std::nullopt);
  EXPECT_EQ(FirstChangedByte(near), std::nullopt);
  const std::vector<uint64_t> bytes = RailBytes(backend);
  EXPECT_LT(bytes[1], kLength / 4);
  EXPECT_EQ(bytes[0] + bytes[1] + bytes[2] + bytes[3], kLength);
  EXPECT_GT(Counter(backend, "rail.a1:1.reposted_bytes"), 0u);
}

TEST_F(FailoverTest, ResponderRailUnpluggedMidTransferFailsOverToTheOthers) {
  auto a = Agent("agent-a", a_devices_, Options(absl::Minutes(10)));
  auto b = Agent("agent-b", b_devices_, Options(absl::Minutes(10)));
  TestBuffer near = a->Register(kLength + 64, v1::ACCESS_READ_WRITE, 71);
  TestBuffer far = b->Register(kLength + 64, v1::ACCESS_READ_WRITE, 72);
  IbverbsBackend& backend = a->backend<IbverbsBackend>();
  // A READ: the unplugged responder's NIC is where the bytes come from.
  const absl::Status status = SubmitAndUnplug(
      *a, MakeOp(0, kRead, near, 5, kLength, far, 1),
      [&] { return fabric_.bytes_served("b2"); }, "b2");
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(FirstWrongByte(near, far.seed, 1, 5, kLength), std::nullopt);
  EXPECT_EQ(FirstChangedByte(far), std::nullopt);
  const std::vector<uint64_t> bytes = RailBytes(backend);
  EXPECT_EQ(bytes[0] + bytes[1] + bytes[2] + bytes[3], kLength);
  EXPECT_LT(fabric_.bytes_served("b2"), kLength / 4);
  // The requester's port is fine: the pair cools down, not the rail.
  EXPECT_EQ(Attribute(backend, "rail.a2:1.health"), "ok");
  EXPECT_EQ(Attribute(backend, "rail.a2:1.lanes_cooling_down"), "1");
  EXPECT_GT(Counter(backend, "rail.a2:1.reposted_bytes"), 0u);
  // The next op leaves b2 out (no other rail of A tries it) and still
  // uses a2, with another of B's rails.
  const uint64_t served = fabric_.bytes_served("b2");
  uint64_t errors = 0;
  for (int i = 0; i < 4; ++i) {
    errors += Counter(backend, absl::StrCat("rail.a", i, ":1.errors"));
  }
  MoveAndCheck(*a, kWrite, near, 2, kLength / 2, far, 3);
  EXPECT_EQ(fabric_.bytes_served("b2"), served);
  uint64_t errors_after = 0;
  for (int i = 0; i < 4; ++i) {
    errors_after += Counter(backend, absl::StrCat("rail.a", i, ":1.errors"));
  }
  EXPECT_EQ(errors_after, errors);
  EXPECT_GT(RailBytes(backend)[2], bytes[2]);
}

TEST_F(MultiRailTest, EveryRailDownIsUnavailable) {
  const std::vector<std::string> a_devices = AddDevices("a", 2);
  const std::vector<std::string> b_devices = AddDevices("b", 2);
  IbverbsOptions options = Fast();
  options.rail_cooldown = absl::Minutes(10);
  options.rail_max_cooldown = absl::Minutes(10);
  auto a = Agent("agent-a", a_devices, options);
  auto b = Agent("agent-b", b_devices, options);
  TestBuffer near = a->Register(1 << 20, v1::ACCESS_READ_WRITE, 81);
  TestBuffer far = b->Register(1 << 20, v1::ACCESS_READ_WRITE, 82);
  IbverbsBackend& backend = a->backend<IbverbsBackend>();
  const auto run = [&] {
    return backend.Submit({MakeOp(0, kWrite, near, 1, (1 << 20) - 9, far, 3),
                           MakeOp(1, kRead, near, 7, 100, far, 11)},
                          In(absl::Seconds(30)));
  };
  // The peer's rails go dark.
  ASSERT_TRUE(fabric_.Unplug("b0").ok());
  ASSERT_TRUE(fabric_.Unplug("b1").ok());
  for (const absl::Status& status : run()) {
    EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
    EXPECT_NE(status.message().find("no other RDMA rail to agent agent-b"),
              std::string::npos)
        << status;
  }
  EXPECT_EQ(FirstChangedByte(far), std::nullopt);
  EXPECT_EQ(FirstChangedByte(near), std::nullopt);
  // Then this agent's: nothing is tried, there is no ACTIVE port.
  ASSERT_TRUE(fabric_.Unplug("a0").ok());
  ASSERT_TRUE(fabric_.Unplug("a1").ok());
  for (const absl::Status& status : run()) {
    EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  }
  for (const absl::Status& status : run()) {
    EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
    EXPECT_NE(status.message().find("ACTIVE port"), std::string::npos)
        << status;
  }
  EXPECT_EQ(FirstChangedByte(far), std::nullopt);
  EXPECT_EQ(FirstChangedByte(near), std::nullopt);
}

// A rail that comes back is used again: its cooldown runs out (20 ms here),
// then this agent's rail is back once its port is ACTIVE, and the peer's
// once a probe over it completed.
TEST_F(MultiRailTest, ReplugBringsRailsBackOnEitherSide) {
  const std::vector<std::string> a_devices = AddDevices("a", 3);
  const std::vector<std::string> b_devices = AddDevices("b", 3);
  IbverbsOptions options = Fast();
  options.rail_cooldown = absl::Milliseconds(20);
  options.rail_max_cooldown = absl::Milliseconds(20);
  auto a = Agent("agent-a", a_devices, options);
  auto b = Agent("agent-b", b_devices, options);
  const uint64_t kSize = 3 << 20;
  TestBuffer near = a->Register(kSize, v1::ACCESS_READ_WRITE, 91);
  TestBuffer far = b->Register(kSize, v1::ACCESS_READ_WRITE, 92);
  IbverbsBackend& backend = a->backend<IbverbsBackend>();
  // Striped ops until `back()` says the rail carried bytes again.
  const auto until_used = [&](const std::function<bool()>& back) {
    for (int round = 0; round < 2000; ++round) {
      MoveAndCheck(*a, round % 2 ? kRead : kWrite, near, round % 7, kSize - 8,
                   far, round % 5);
      if (back()) return true;
      absl::SleepFor(absl::Milliseconds(5));
    }
    return false;
  };

  // This agent's a1.
  ASSERT_TRUE(fabric_.Unplug("a1").ok());
  MoveAndCheck(*a, kWrite, near, 0, kSize, far, 0);  // fails over
  const uint64_t a1_before = backend.rail_bytes("a1:1");
  MoveAndCheck(*a, kWrite, near, 1, kSize - 1, far, 0);
  EXPECT_EQ(backend.rail_bytes("a1:1"), a1_before) << "left out while down";
  ASSERT_TRUE(fabric_.Replug("a1").ok());
  EXPECT_TRUE(until_used([&] {
    return backend.rail_bytes("a1:1") > a1_before;
  })) << "a1 never carried bytes again";

  // The peer's b1.
  ASSERT_TRUE(fabric_.Unplug("b1").ok());
  MoveAndCheck(*a, kRead, near, 0, kSize, far, 0);  // fails over
  const uint64_t b1_before = fabric_.bytes_served("b1");
  ASSERT_TRUE(fabric_.Replug("b1").ok());
  EXPECT_TRUE(until_used([&] {
    return fabric_.bytes_served("b1") > b1_before;
  })) << "b1 never carried bytes again";
}

// A cable pulled between batches is seen at planning (the port is looked
// at every 100 ms): the next batch goes over the other rails without a WR
// failing first.
TEST_F(MultiRailTest, ARailWhosePortIsDownIsLeftOutBeforeAnyWrFails) {
  const std::vector<std::string> a_devices = AddDevices("a", 2);
  const std::vector<std::string> b_devices = AddDevices("b", 2);
  auto a = Agent("agent-a", a_devices);
  auto b = Agent("agent-b", b_devices);
  TestBuffer near = a->Register(1 << 20, v1::ACCESS_READ_WRITE, 111);
  TestBuffer far = b->Register(1 << 20, v1::ACCESS_READ_WRITE, 112);
  IbverbsBackend& backend = a->backend<IbverbsBackend>();
  MoveAndCheck(*a, kWrite, near, 1, (1 << 20) - 1, far, 0);
  ASSERT_GT(backend.rail_bytes("a1:1"), 0u);
  ASSERT_TRUE(fabric_.Unplug("a1").ok());
  absl::SleepFor(absl::Milliseconds(150));  // past the port's next look
  const uint64_t a1_bytes = backend.rail_bytes("a1:1");
  MoveAndCheck(*a, kRead, near, 0, (1 << 20) - 3, far, 2);
  EXPECT_EQ(backend.rail_bytes("a1:1"), a1_bytes);
  const auto info = backend.transport_info();
  EXPECT_EQ(info.attributes().at("rail.a1:1.errors"), "0");
  EXPECT_EQ(info.attributes().at("rail.a1:1.health").rfind("cooling down", 0),
            0u);
}

// A port DOWN when the agent starts is a rail that carries nothing; once it
// comes up (a port event) its rail carries bytes, and contexts registered
// afterwards list it.
TEST_F(MultiRailTest, APortThatComesUpLaterIsUsed) {
  for (const bool events : {true, false}) {
    SCOPED_TRACE(events ? "port events" : "no port events: the look");
    const std::string round = events ? "e" : "n";
    std::vector<std::string> a_devices;
    for (int i = 0; i < 2; ++i) {
      SoftDeviceConfig config = Device(absl::StrCat("a", round, i));
      config.async_events = events;
      if (i == 1) config.port_state = IBV_PORT_DOWN;
      Add(config);
      a_devices.push_back(config.name);
    }
    const std::vector<std::string> b_devices = AddDevices("b" + round, 2);
    auto a = Agent("agent-a" + round, a_devices);
    auto b = Agent("agent-b" + round, b_devices);
    IbverbsBackend& backend = a->backend<IbverbsBackend>();
    ASSERT_TRUE(backend.available()) << backend.unavailable_reason();
    const std::string late = a_devices[1] + ":1";
    const uint64_t kSize = 2 << 20;
    TestBuffer near = a->Register(kSize, v1::ACCESS_READ_WRITE, 131);
    TestBuffer far = b->Register(kSize, v1::ACCESS_READ_WRITE, 132);
    EXPECT_EQ(near.context->endpoints(0).ibverbs().rails_size(), 0)
        << "one ACTIVE rail: the single-rail context";
    MoveAndCheck(*a, kWrite, near, 1, kSize - 1, far, 0);
    EXPECT_EQ(backend.rail_bytes(late), 0u);
    EXPECT_EQ(
        backend.transport_info().attributes().at("rail." + late + ".errors"),
        "0");

    ASSERT_TRUE(fabric_.SetPortState(a_devices[1], IBV_PORT_ACTIVE).ok());
    // In use after the event, or after the next look (100 ms).
    bool used = false;
    for (int attempt = 0; attempt < 200 && !used; ++attempt) {
      MoveAndCheck(*a, attempt % 2 ? kRead : kWrite, near, attempt % 5,
                   kSize - 8, far, attempt % 3);
      used = backend.rail_bytes(late) > 0;
      if (!used) absl::SleepFor(absl::Milliseconds(10));
    }
    EXPECT_TRUE(used) << late << " never carried bytes";
    EXPECT_EQ(
        backend.transport_info().attributes().at("rail." + late + ".errors"),
        "0");
    // Registered now, a context lists both rails.
    const TestBuffer later = a->Register(4096, v1::ACCESS_READ_WRITE, 133);
    EXPECT_EQ(later.context->endpoints(0).ibverbs().rails_size(), 2);
  }
}

// A pulled cable's port event leaves the rail out at once: GetInfo says it
// is cooling down before any op ran, and the next op's WRs all go over the
// other rail, none failing.
TEST_F(MultiRailTest, APortEventLeavesTheRailOutBeforeAnyWrFails) {
  const std::vector<std::string> a_devices = AddDevices("a", 2);
  const std::vector<std::string> b_devices = AddDevices("b", 2);
  IbverbsOptions options = Fast();
  options.rail_cooldown = absl::Minutes(10);
  options.rail_max_cooldown = absl::Minutes(10);
  auto a = Agent("agent-a", a_devices, options);
  auto b = Agent("agent-b", b_devices, options);
  TestBuffer near = a->Register(1 << 20, v1::ACCESS_READ_WRITE, 141);
  TestBuffer far = b->Register(1 << 20, v1::ACCESS_READ_WRITE, 142);
  IbverbsBackend& backend = a->backend<IbverbsBackend>();
  MoveAndCheck(*a, kWrite, near, 1, (1 << 20) - 1, far, 0);
  ASSERT_GT(backend.rail_bytes("a1:1"), 0u);
  const auto health = [&] {
    return backend.transport_info().attributes().at("rail.a1:1.health");
  };
  ASSERT_EQ(health(), "ok");
  ASSERT_TRUE(fabric_.Unplug("a1").ok());
  // No op runs meanwhile: only the event can have told the backend.
  const absl::Time until = absl::Now() + absl::Seconds(5);
  while (health() == "ok" && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_NE(health().find("IBV_EVENT_PORT_ERR"), std::string::npos) << health();
  const uint64_t a1_bytes = backend.rail_bytes("a1:1");
  MoveAndCheck(*a, kRead, near, 0, (1 << 20) - 3, far, 2);
  EXPECT_EQ(backend.rail_bytes("a1:1"), a1_bytes);
  EXPECT_EQ(backend.transport_info().attributes().at("rail.a1:1.errors"), "0");
}

// Cut short while one rail's WRs wait for a peer that never answers
// (transport timeout 0: until ERR) and the other's wait for a slow link: at
// the deadline, or at a cancellation, every lane's queue pair is moved to
// ERR and drained, so that once Submit has returned no rail touches the
// ops' memory.
TEST_F(MultiRailTest, CutShortWithARailDownTouchesNothingAfterwards) {
  for (const bool cancel : {false, true}) {
    SCOPED_TRACE(cancel ? "cancelled" : "deadline");
    const std::string round = cancel ? "c" : "d";
    std::vector<std::string> a_devices;
    std::vector<std::string> b_devices;
    for (int i = 0; i < 2; ++i) {
      for (auto* devices : {&a_devices, &b_devices}) {
        SoftDeviceConfig config =
            Device(absl::StrCat(devices == &a_devices ? "a" : "b", round, i));
        config.bytes_per_second = 1 << 20;  // 1 MiB/s: the op needs seconds
        Add(config);
        devices->push_back(config.name);
      }
    }
    IbverbsOptions options = Fast();
    options.qp.timeout = 0;  // unanswered WRs wait until ERR
    options.qp.max_message_bytes = 64 << 10;
    auto a = Agent("agent-a" + round, a_devices, options);
    auto b = Agent("agent-b" + round, b_devices, options);
    const uint64_t kLength = (4u << 20) + 11;
    TestBuffer near = a->Register(2 * kLength + 64, v1::ACCESS_READ_WRITE, 101);
    TestBuffer far = b->Register(2 * kLength + 64, v1::ACCESS_READ_WRITE, 102);
    const std::vector<Op> ops = {
        MakeOp(0, kRead, near, 1, kLength, far, 3),
        MakeOp(1, kWrite, near, kLength + 5, kLength, far, kLength + 7)};
    // Connected first, so that the cut finds WRs on both lanes.
    ASSERT_TRUE(a->backend<IbverbsBackend>()
                    .Submit({MakeOp(0, kWrite, near, 0, 1 << 17, far, 0)},
                            In(absl::Seconds(30)))[0]
                    .ok());
    Refill(near);
    Refill(far);
    const std::vector<uint8_t> near_before = Snapshot(near);
    const std::vector<uint8_t> far_before = Snapshot(far);
    fabric_.SetReachable(b_devices[1], false);
    Cancellation cancellation;
    std::thread canceller;
    if (cancel) {
      canceller = std::thread([&] {
        absl::SleepFor(absl::Milliseconds(300));
        cancellation.Cancel(absl::CancelledError("the client went away"));
      });
    }
    const auto results = a->backend<IbverbsBackend>().Submit(
        ops, StopToken(In(cancel ? absl::Seconds(60) : absl::Milliseconds(300)),
                       &cancellation));
    std::memset(near.bytes(), 0x7e, near.size());
    const std::vector<uint8_t> sentinel = Snapshot(near);
    if (canceller.joinable()) canceller.join();
    for (const absl::Status& status : results) {
      EXPECT_EQ(status.code(), cancel ? absl::StatusCode::kCancelled
                                      : absl::StatusCode::kDeadlineExceeded)
          << status;
    }
    // Whatever the links still held would have landed by now.
    fabric_.SetReachable(b_devices[1], true);
    absl::SleepFor(absl::Milliseconds(300));
    EXPECT_EQ(FirstDifference(near, sentinel), std::nullopt)
        << "local memory written after Submit returned";
    // Remote bytes: their own, or what the WRITE read before the return;
    // nothing of the READ's range changed.
    for (uint64_t i = 0; i < kLength; ++i) {
      const uint64_t at = kLength + 7 + i;
      const uint8_t got = far.bytes()[at];
      ASSERT_TRUE(got == far_before[at] || got == near_before[kLength + 5 + i])
          << "remote byte " << at << " came from local memory after return";
    }
    EXPECT_EQ(0, std::memcmp(far.bytes(), far_before.data(), kLength + 7));
    // The backend carries on.
    MoveAndCheck(*a, kWrite, near, 9, 1 << 16, far, 13);
  }
}

}  // namespace
}  // namespace rdma_agent::ibverbs

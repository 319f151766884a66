// The ibverbs backend against the software RC NIC, several agents in one
// process: data correctness, back-pressure, every error path, reconnects,
// release during in-flight ops, and the deadline drain.
#include "backends/ibverbs/ibverbs_backend.h"

#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "backends/buffer_table.h"
#include "backends/ibverbs/soft/soft_verbs.h"
#include "backends/testing/harness.h"
#include "backends/testing/ibverbs_agent.h"
#include "gtest/gtest.h"

namespace rdma_agent::ibverbs {
namespace {

using ::rdma_agent::testing::In;
using ::rdma_agent::testing::MakeOp;
using ::rdma_agent::testing::Snapshot;
using ::rdma_agent::testing::SoftIbverbsAgent;
using ::rdma_agent::testing::TestAgent;
using ::rdma_agent::testing::TestBuffer;
using verbs::SoftDeviceConfig;
using verbs::SoftFabric;
using verbs::SoftFault;

constexpr v1::OpType kRead = v1::OP_TYPE_READ_INTO_LOCAL;
constexpr v1::OpType kWrite = v1::OP_TYPE_WRITE_FROM_LOCAL;

// Checks that `after` equals `before` except [offset, offset + length),
// which must equal source[source_offset..].
void ExpectOnlyRangeChanged(const std::vector<uint8_t>& before,
                            const TestBuffer& after, uint64_t offset,
                            uint64_t length, const std::vector<uint8_t>& source,
                            uint64_t source_offset) {
  for (uint64_t i = 0; i < before.size(); ++i) {
    const bool inside = i >= offset && i < offset + length;
    const uint8_t want =
        inside ? source[i - offset + source_offset] : before[i];
    ASSERT_EQ(after.bytes()[i], want)
        << "byte " << i << (inside ? " (inside" : " (outside") << " [" << offset
        << ", +" << length << "))";
  }
}

class IbverbsBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* name : {"nic_a", "nic_b", "nic_c"}) {
      SoftDeviceConfig config;
      config.name = name;
      ASSERT_TRUE(fabric_.AddDevice(config).ok());
    }
  }

  static IbverbsOptions Fast() {
    IbverbsOptions options;
    options.qp.timeout = 8;  // ~1 ms per try: retry-exceeds quickly
    options.qp.retry_cnt = 2;
    return options;
  }

  std::unique_ptr<TestAgent> Node(const std::string& id,
                                  const std::string& device,
                                  IbverbsOptions options = Fast()) {
    return SoftIbverbsAgent(fabric_, id, device, std::move(options));
  }

  SoftFabric fabric_;
};

TEST_F(IbverbsBackendTest, ReportsDeviceAndProfile) {
  auto a = Node("agent-a", "nic_a");
  IbverbsBackend& backend = a->backend<IbverbsBackend>();
  EXPECT_TRUE(backend.available()) << backend.unavailable_reason();
  EXPECT_EQ(backend.name(), "ibverbs");
  EXPECT_EQ(backend.transport_level(), v1::TRANSPORT_LEVEL_NIC);
  const v1::TransportInfo info = backend.transport_info();
  ASSERT_EQ(info.devices_size(), 1);
  const v1::DeviceInfo& device = info.devices(0);
  EXPECT_EQ(device.name(), "nic_a");
  EXPECT_EQ(device.port(), 1u);
  EXPECT_EQ(device.link_layer(), "Ethernet");
  EXPECT_EQ(device.state(), "ACTIVE");
  EXPECT_EQ(device.mtu_bytes(), 4096u);
  EXPECT_EQ(device.profile(), "generic");
  EXPECT_GT(device.speed_gbps(), 0);
  ASSERT_EQ(device.gids_size(), 1);
  EXPECT_EQ(device.gids(0).substr(0, 8), "0:fe80::");
  EXPECT_EQ(info.attributes().at("sq_depth"), "256");
  EXPECT_EQ(info.attributes().at("path_mtu_bytes"), "1024");
  EXPECT_FALSE(info.attributes().at("peer_address").empty());
}

TEST_F(IbverbsBackendTest, Mlx5DevicesGetTheMlx5Profile) {
  SoftDeviceConfig config;
  config.name = "mlx5_0";
  config.vendor_id = 0x02c9;
  ASSERT_TRUE(fabric_.AddDevice(config).ok());
  IbverbsOptions options;
  options.qp.gid_index = 0;  // the soft device has one GID
  auto node = Node("agent-m", "mlx5_0", options);
  EXPECT_EQ(node->backend<IbverbsBackend>().profile_name(), "mlx5");
  EXPECT_EQ(node->backend<IbverbsBackend>().params().sq_depth, 1024u);
  EXPECT_EQ(node->backend<IbverbsBackend>().params().mtu_bytes, 4096u);
  EXPECT_EQ(node->backend<IbverbsBackend>().params().max_message_bytes,
            8u << 20);
}

TEST_F(IbverbsBackendTest, Mlx5OnRoceWithoutGidThreeIsUnavailable) {
  SoftDeviceConfig config;
  config.name = "mlx5_1";
  config.vendor_id = 0x02c9;
  ASSERT_TRUE(fabric_.AddDevice(config).ok());
  auto node = Node("agent-m", "mlx5_1", IbverbsOptions());
  EXPECT_FALSE(node->backend<IbverbsBackend>().available());
  EXPECT_NE(node->backend<IbverbsBackend>().unavailable_reason().find(
                "no GID at index 3"),
            std::string::npos)
      << node->backend<IbverbsBackend>().unavailable_reason();
}

TEST_F(IbverbsBackendTest, InfinibandPortsRouteByLid) {
  for (const char* name : {"ib_0", "ib_1"}) {
    SoftDeviceConfig config;
    config.name = name;
    config.link_layer = IBV_LINK_LAYER_INFINIBAND;
    config.vendor_id = 0x02c9;  // mlx5: GID index 0 on InfiniBand
    ASSERT_TRUE(fabric_.AddDevice(config).ok());
  }
  auto a = Node("agent-a", "ib_0");
  auto b = Node("agent-b", "ib_1");
  ASSERT_TRUE(a->backend<IbverbsBackend>().available())
      << a->backend<IbverbsBackend>().unavailable_reason();
  EXPECT_EQ(
      a->backend<IbverbsBackend>().transport_info().devices(0).link_layer(),
      "InfiniBand");
  EXPECT_EQ(a->backend<IbverbsBackend>().params().gid_index, 0);
  TestBuffer local = a->Register(4096, v1::ACCESS_READ_WRITE, 1);
  TestBuffer remote = b->Register(4096, v1::ACCESS_READ_WRITE, 2);
  EXPECT_NE(remote.context->endpoints(0).ibverbs().lid(), 0u);
  const auto results = a->backend<IbverbsBackend>().Submit(
      {MakeOp(0, kRead, local, 1, 4000, remote, 3)}, In(absl::Seconds(10)));
  ASSERT_TRUE(results[0].ok()) << results[0];
  EXPECT_EQ(0, std::memcmp(local.bytes() + 1, remote.bytes() + 3, 4000));
}

TEST_F(IbverbsBackendTest, EfaIsUnavailableWithAReason) {
  SoftDeviceConfig config;
  config.name = "efa_0";
  config.vendor_id = 0x1d0f;
  ASSERT_TRUE(fabric_.AddDevice(config).ok());
  auto node = Node("agent-e", "efa_0");
  EXPECT_FALSE(node->backend<IbverbsBackend>().available());
  EXPECT_NE(node->backend<IbverbsBackend>().unavailable_reason().find(
                "no RC queue pairs"),
            std::string::npos)
      << node->backend<IbverbsBackend>().unavailable_reason();
}

TEST_F(IbverbsBackendTest, UnavailableWithoutDeviceOrWhenDisabled) {
  BackendEnvironment env;
  env.identity.agent_id = "x";
  SoftFabric empty;
  auto none = IbverbsBackend::Create(env, {}, empty.MakeVerbs());
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE((*none)->available());
  EXPECT_NE((*none)->unavailable_reason().find("no RDMA device"),
            std::string::npos);
  EXPECT_EQ((*none)->transport_info().devices_size(), 0);

  IbverbsOptions disabled;
  disabled.enabled = false;
  auto off = IbverbsBackend::Create(env, disabled, fabric_.MakeVerbs());
  ASSERT_TRUE(off.ok());
  EXPECT_FALSE((*off)->available());
  EXPECT_NE((*off)->unavailable_reason().find("disabled"), std::string::npos);

  IbverbsOptions missing;
  missing.devices = {"mlx5_9"};
  auto wrong = IbverbsBackend::Create(env, missing, fabric_.MakeVerbs());
  ASSERT_TRUE(wrong.ok());
  EXPECT_FALSE((*wrong)->available());
  EXPECT_NE((*wrong)->unavailable_reason().find("mlx5_9 not found"),
            std::string::npos);

  SoftDeviceConfig down;
  down.name = "nic_down";
  down.port_state = IBV_PORT_DOWN;
  ASSERT_TRUE(fabric_.AddDevice(down).ok());
  auto inactive =
      IbverbsBackend::Create(env, {}, fabric_.MakeVerbs({"nic_down"}));
  ASSERT_TRUE(inactive.ok());
  EXPECT_FALSE((*inactive)->available());
  EXPECT_NE((*inactive)->unavailable_reason().find("is DOWN"),
            std::string::npos);

  auto memory = SharedMemory::Allocate(64, "x");
  ASSERT_TRUE(memory.ok());
  Registration registration(1, 0, v1::ACCESS_READ, "", "t", std::move(*memory),
                            true);
  v1::BackendEndpoint endpoint;
  EXPECT_EQ((*inactive)->Register(registration, &endpoint).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(IbverbsBackendTest, BadOptionsAreInvalidArguments) {
  BackendEnvironment env;
  IbverbsOptions profile;
  profile.profile = "cxl";
  EXPECT_EQ(
      IbverbsBackend::Create(env, profile, fabric_.MakeVerbs()).status().code(),
      absl::StatusCode::kInvalidArgument);
  IbverbsOptions mtu;
  mtu.qp.mtu_bytes = 3000;
  EXPECT_EQ(
      IbverbsBackend::Create(env, mtu, fabric_.MakeVerbs()).status().code(),
      absl::StatusCode::kInvalidArgument);
}

TEST_F(IbverbsBackendTest, RegisterAdvertisesAddressAndPeerButNoKey) {
  auto a = Node("agent-a", "nic_a");
  TestBuffer buffer = a->Register(4096, v1::ACCESS_READ_WRITE, 1);
  ASSERT_EQ(buffer.context->endpoints_size(), 1);
  const v1::IbverbsEndpoint& ib = buffer.context->endpoints(0).ibverbs();
  EXPECT_EQ(ib.device(), "nic_a");
  EXPECT_EQ(ib.port(), 1u);
  EXPECT_EQ(ib.gid().size(), 16u);
  // The context is no NIC capability: peers get an rkey for their own PD
  // in return for the token.
  EXPECT_EQ(ib.rkey(), 0u);
  EXPECT_EQ(ib.address(),
            reinterpret_cast<uint64_t>(buffer.registration->data()));
  EXPECT_EQ(ib.peer_address(), a->backend<IbverbsBackend>().peer_address());
  EXPECT_EQ(ib.max_message_bytes(), 1u << 30);
  EXPECT_TRUE(a->backend<IbverbsBackend>().CanReach(*buffer.context));
  v1::RemoteBuffer no_ib = *buffer.context;
  no_ib.clear_endpoints();
  no_ib.add_endpoints()->set_backend("tcp");
  EXPECT_FALSE(a->backend<IbverbsBackend>().CanReach(no_ib));
}

TEST_F(IbverbsBackendTest, MovesExactBytesAtOddOffsetsAcrossMaxMessageSize) {
  IbverbsOptions small = Fast();
  small.qp.max_message_bytes = 4096;  // forces many WRs per op
  auto a = Node("agent-a", "nic_a", small);
  IbverbsOptions smaller_remote = Fast();
  smaller_remote.qp.max_message_bytes = 3000;  // the remote's max wins
  auto b = Node("agent-b", "nic_b", smaller_remote);
  const uint64_t kSize = 256 << 10;
  TestBuffer local = a->Register(kSize, v1::ACCESS_READ_WRITE, 3);
  TestBuffer remote = b->Register(kSize, v1::ACCESS_READ_WRITE, 101);

  struct Case {
    v1::OpType type;
    uint64_t local_offset, length, remote_offset;
  };
  const std::vector<Case> cases = {
      {kWrite, 1, 1, 3},
      {kWrite, 7, 2999, 11},
      {kWrite, 13, 3000, 4097},
      {kWrite, 5, 3001, 9001},
      {kRead, 3, 4095, 17},
      {kRead, 99, 4096, 4099},
      {kRead, 1, 4097, 12345},
      {kWrite, 333, 3 * 4096 + 5, 77777},
      {kRead, 12347, 100003, 131071},
      {kWrite, 0, kSize, 0},
      {kRead, 0, kSize, 0},
      {kWrite, kSize - 1, 1, kSize - 1},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message()
                 << (c.type == kRead ? "read" : "write") << " local "
                 << c.local_offset << " len " << c.length << " remote "
                 << c.remote_offset);
    const std::vector<uint8_t> local_before = Snapshot(local);
    const std::vector<uint8_t> remote_before = Snapshot(remote);
    const Op op = MakeOp(0, c.type, local, c.local_offset, c.length, remote,
                         c.remote_offset);
    const std::vector<absl::Status> results =
        a->backend<IbverbsBackend>().Submit({op}, In(absl::Seconds(20)));
    ASSERT_EQ(results.size(), 1u);
    ASSERT_TRUE(results[0].ok()) << results[0];
    if (c.type == kWrite) {
      ExpectOnlyRangeChanged(remote_before, remote, c.remote_offset, c.length,
                             local_before, c.local_offset);
      EXPECT_EQ(Snapshot(local), local_before);
    } else {
      ExpectOnlyRangeChanged(local_before, local, c.local_offset, c.length,
                             remote_before, c.remote_offset);
      EXPECT_EQ(Snapshot(remote), remote_before);
    }
    // Scramble so that the next case does not see equal buffers.
    for (uint64_t i = 0; i < kSize; i += 97) local.bytes()[i] ^= 0x5a;
  }
  EXPECT_EQ(a->backend<IbverbsBackend>().connections_established(), 1u);
  EXPECT_EQ(b->backend<IbverbsBackend>().responder_count(), 1u);
}

TEST_F(IbverbsBackendTest, PollerWorksSpinningOnlyAndBlockingOnly) {
  for (absl::Duration busy : {absl::ZeroDuration(), absl::Seconds(30)}) {
    SCOPED_TRACE(absl::FormatDuration(busy));
    IbverbsOptions options = Fast();
    options.busy_poll = busy;  // 0: always arm and block on the channel
    options.qp.mtu_bytes = 512;
    auto a = Node("agent-a", "nic_a", options);
    auto b = Node("agent-b", "nic_b", options);
    EXPECT_EQ(a->backend<IbverbsBackend>().transport_info().attributes().at(
                  "path_mtu_bytes"),
              "512");
    TestBuffer local = a->Register(1 << 16, v1::ACCESS_READ_WRITE, 1);
    TestBuffer remote = b->Register(1 << 16, v1::ACCESS_READ_WRITE, 2);
    std::vector<Op> ops;
    for (size_t i = 0; i < 64; ++i) {
      ops.push_back(MakeOp(i, kRead, local, i * 1024, 1000, remote, i * 1024));
    }
    for (const absl::Status& status :
         a->backend<IbverbsBackend>().Submit(ops, In(absl::Seconds(20)))) {
      ASSERT_TRUE(status.ok()) << status;
    }
    for (size_t i = 0; i < 64; ++i) {
      ASSERT_EQ(0, std::memcmp(local.bytes() + i * 1024,
                               remote.bytes() + i * 1024, 1000));
    }
  }
}

TEST_F(IbverbsBackendTest, ManyOpsObeyTheSendQueueDepth) {
  IbverbsOptions shallow = Fast();
  shallow.qp.sq_depth = 8;
  auto a = Node("agent-a", "nic_a", shallow);
  auto b = Node("agent-b", "nic_b");
  const uint64_t kOps = 5000;
  TestBuffer local = a->Register(kOps * 64, v1::ACCESS_READ_WRITE, 5);
  TestBuffer remote = b->Register(kOps * 64, v1::ACCESS_READ_WRITE, 9);
  const std::vector<uint8_t> source = Snapshot(local);
  std::vector<Op> ops;
  for (uint64_t i = 0; i < kOps; ++i) {
    // Reverse placement so a mix-up between ops would show.
    ops.push_back(
        MakeOp(i, kWrite, local, i * 64, 64, remote, (kOps - 1 - i) * 64));
  }
  const std::vector<absl::Status> results =
      a->backend<IbverbsBackend>().Submit(ops, In(absl::Seconds(60)));
  ASSERT_EQ(results.size(), kOps);
  for (uint64_t i = 0; i < kOps; ++i) {
    ASSERT_TRUE(results[i].ok()) << "op " << i << ": " << results[i];
  }
  for (uint64_t i = 0; i < kOps; ++i) {
    ASSERT_EQ(0, std::memcmp(remote.bytes() + (kOps - 1 - i) * 64,
                             source.data() + i * 64, 64))
        << "op " << i;
  }
  EXPECT_LE(fabric_.max_outstanding_seen(), 8);
  EXPECT_EQ(fabric_.max_outstanding_seen(), 8);  // the queue was kept full
}

TEST_F(IbverbsBackendTest, ConcurrentSubmitsShareOneQueuePair) {
  auto a = Node("agent-a", "nic_a");
  auto b = Node("agent-b", "nic_b");
  TestBuffer local = a->Register(1 << 20, v1::ACCESS_READ_WRITE, 1);
  TestBuffer remote = b->Register(1 << 20, v1::ACCESS_READ_WRITE, 2);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int k = 0; k < 50; ++k) {
        const uint64_t offset = (t * 50 + k) * 4096;
        const Op op = MakeOp(0, kWrite, local, offset, 4096, remote, offset);
        if (!a->backend<IbverbsBackend>()
                 .Submit({op}, In(absl::Seconds(30)))[0]
                 .ok()) {
          ++failures;
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(0, std::memcmp(local.bytes(), remote.bytes(), 200 * 4096));
  EXPECT_EQ(a->backend<IbverbsBackend>().connections_established(), 1u);
}

TEST_F(IbverbsBackendTest, RemoteNicRefusesAccessTheMrDoesNotGrant) {
  auto a = Node("agent-a", "nic_a");
  auto b = Node("agent-b", "nic_b");
  TestBuffer local = a->Register(4096, v1::ACCESS_READ_WRITE, 1);
  TestBuffer read_only = b->Register(4096, v1::ACCESS_READ, 2);
  const std::vector<uint8_t> before = Snapshot(read_only);
  // The agent would refuse this op; the NIC refuses it too.
  const auto results = a->backend<IbverbsBackend>().Submit(
      {MakeOp(0, kWrite, local, 0, 100, read_only, 0)}, In(absl::Seconds(10)));
  EXPECT_EQ(results[0].code(), absl::StatusCode::kPermissionDenied)
      << results[0];
  EXPECT_NE(results[0].message().find("IBV_WC_REM_ACCESS_ERR"),
            std::string::npos);
  EXPECT_EQ(Snapshot(read_only), before);
  // The QP went to ERR with it; the next submit reconnects and works.
  const auto again = a->backend<IbverbsBackend>().Submit(
      {MakeOp(0, kRead, local, 0, 100, read_only, 0)}, In(absl::Seconds(10)));
  EXPECT_TRUE(again[0].ok()) << again[0];
  EXPECT_EQ(0, std::memcmp(local.bytes(), before.data(), 100));
  EXPECT_EQ(a->backend<IbverbsBackend>().connections_established(), 2u);
}

TEST_F(IbverbsBackendTest, RemoteRangeOutsideTheGrantIsOutOfRange) {
  // Ranges arrive validated against the context (backend.h); a context that
  // overstates the buffer's size is caught against the remote's grant.
  auto a = Node("agent-a", "nic_a");
  auto b = Node("agent-b", "nic_b");
  TestBuffer local = a->Register(8192, v1::ACCESS_READ_WRITE, 1);
  TestBuffer remote = b->Register(4096, v1::ACCESS_READ_WRITE, 2);
  auto inflated = std::make_shared<v1::RemoteBuffer>(*remote.context);
  inflated->set_size_bytes(uint64_t{1} << 40);
  remote.context = inflated;
  const uint8_t before = remote.bytes()[4095];
  const auto results = a->backend<IbverbsBackend>().Submit(
      {MakeOp(0, kWrite, local, 0, 100, remote, 4000),
       MakeOp(1, kRead, local, 0, 1, remote, 1 << 20)},
      In(absl::Seconds(10)));
  EXPECT_EQ(results[0].code(), absl::StatusCode::kOutOfRange) << results[0];
  EXPECT_EQ(results[1].code(), absl::StatusCode::kOutOfRange) << results[1];
  EXPECT_EQ(remote.bytes()[4095], before);
}

TEST_F(IbverbsBackendTest, UnknownRemoteDeviceIsNotFound) {
  auto a = Node("agent-a", "nic_a");
  auto b = Node("agent-b", "nic_b");
  TestBuffer local = a->Register(4096, v1::ACCESS_READ_WRITE, 1);
  TestBuffer remote = b->Register(4096, v1::ACCESS_READ_WRITE, 2);
  auto other = std::make_shared<v1::RemoteBuffer>(*remote.context);
  other->mutable_endpoints(0)->mutable_ibverbs()->set_device("nic_c");
  const auto results = a->backend<IbverbsBackend>().Submit(
      {MakeOp(0, kWrite, local, 0, 10, TestBuffer{remote.registration, other},
              0)},
      In(absl::Seconds(10)));
  EXPECT_EQ(results[0].code(), absl::StatusCode::kNotFound) << results[0];
}

TEST_F(IbverbsBackendTest, UnreachablePeerAgentIsUnavailable) {
  auto a = Node("agent-a", "nic_a");
  auto b = Node("agent-b", "nic_b");
  TestBuffer local = a->Register(4096, v1::ACCESS_READ_WRITE, 1);
  TestBuffer remote = b->Register(4096, v1::ACCESS_READ_WRITE, 2);
  auto moved = std::make_shared<v1::RemoteBuffer>(*remote.context);
  // Port 1 on loopback: nobody listens there.
  moved->mutable_endpoints(0)->mutable_ibverbs()->set_peer_address(
      "127.0.0.1:1");
  const auto results = a->backend<IbverbsBackend>().Submit(
      {MakeOp(0, kWrite, local, 0, 10, TestBuffer{remote.registration, moved},
              0)},
      In(absl::Seconds(10)));
  EXPECT_EQ(results[0].code(), absl::StatusCode::kUnavailable) << results[0];
}

TEST_F(IbverbsBackendTest, SilentPeerDoesNotHoldUpHandshakesWithOthers) {
  auto a = Node("agent-a", "nic_a");
  auto b = Node("agent-b", "nic_b");
  TestBuffer local = a->Register(4096, v1::ACCESS_READ_WRITE, 1);
  TestBuffer remote = b->Register(4096, v1::ACCESS_READ_WRITE, 2);
  // A "peer" that accepts TCP connections (in the kernel backlog) and never
  // answers: its handshake can only end at the deadline.
  const int silent = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(silent, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(silent, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(silent, 8), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(silent, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  auto context = std::make_shared<v1::RemoteBuffer>(*remote.context);
  context->set_agent_id("agent-silent");
  context->mutable_endpoints(0)->mutable_ibverbs()->set_peer_address(
      "127.0.0.1:" + std::to_string(ntohs(addr.sin_port)));
  const TestBuffer silent_buffer{remote.registration, context};

  absl::Status stuck;
  std::thread slow([&] {
    stuck = a->backend<IbverbsBackend>().Submit(
        {MakeOp(0, kWrite, local, 0, 8, silent_buffer, 0)},
        In(absl::Seconds(3)))[0];
  });
  // Wait until the slow handshake is knocking (a connection is pending).
  pollfd pending = {silent, POLLIN, 0};
  ASSERT_EQ(poll(&pending, 1, 5000), 1);
  const absl::Time start = absl::Now();
  const absl::Status fast = a->backend<IbverbsBackend>().Submit(
      {MakeOp(0, kWrite, local, 0, 8, remote, 0)}, In(absl::Seconds(10)))[0];
  const absl::Duration took = absl::Now() - start;
  EXPECT_TRUE(fast.ok()) << fast;
  EXPECT_LT(took, absl::Seconds(2));
  slow.join();
  EXPECT_EQ(stuck.code(), absl::StatusCode::kDeadlineExceeded) << stuck;
  close(silent);
}

TEST_F(IbverbsBackendTest, RestartedPeerGetsANewQpAndTheOldOneIsDropped) {
  auto a = Node("agent-a", "nic_a");
  auto b = Node("agent-b", "nic_b");
  TestBuffer local = a->Register(4096, v1::ACCESS_READ_WRITE, 1);
  TestBuffer old_remote = b->Register(4096, v1::ACCESS_READ_WRITE, 2);
  ASSERT_TRUE(a->backend<IbverbsBackend>()
                  .Submit({MakeOp(0, kWrite, local, 0, 8, old_remote, 0)},
                          In(absl::Seconds(10)))[0]
                  .ok());
  EXPECT_EQ(a->backend<IbverbsBackend>().requester_count(), 1u);
  old_remote = TestBuffer{};
  b.reset();  // the agent restarts: same id and device, new epoch
  b = Node("agent-b", "nic_b");
  TestBuffer remote = b->Register(4096, v1::ACCESS_READ_WRITE, 3);
  const auto results = a->backend<IbverbsBackend>().Submit(
      {MakeOp(0, kRead, local, 0, 4096, remote, 0)}, In(absl::Seconds(10)));
  ASSERT_TRUE(results[0].ok()) << results[0];
  EXPECT_EQ(0, std::memcmp(local.bytes(), remote.bytes(), 4096));
  EXPECT_EQ(a->backend<IbverbsBackend>().connections_established(), 2u);
  EXPECT_EQ(a->backend<IbverbsBackend>().requester_count(),
            1u);  // the dead QP was dropped
}

TEST_F(IbverbsBackendTest, LocalBufferWithoutMrIsFailedPrecondition) {
  auto a = Node("agent-a", "nic_a");
  auto b = Node("agent-b", "nic_b");
  TestBuffer remote = b->Register(4096, v1::ACCESS_READ_WRITE, 2);
  auto memory = SharedMemory::Allocate(4096, "bare");
  ASSERT_TRUE(memory.ok());
  TestBuffer bare{
      std::make_shared<Registration>(77, 0, v1::ACCESS_READ_WRITE, "", "t",
                                     std::move(*memory), true),
      nullptr};
  const auto results = a->backend<IbverbsBackend>().Submit(
      {MakeOp(0, kWrite, bare, 0, 10, remote, 0)}, In(absl::Seconds(10)));
  EXPECT_EQ(results[0].code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(IbverbsBackendTest, LostWorkRequestIsUnavailableThenReconnects) {
  auto a = Node("agent-a", "nic_a");
  auto b = Node("agent-b", "nic_b");
  TestBuffer local = a->Register(8192, v1::ACCESS_READ_WRITE, 1);
  TestBuffer remote = b->Register(8192, v1::ACCESS_READ_WRITE, 2);
  ASSERT_TRUE(a->backend<IbverbsBackend>()
                  .Submit({MakeOp(0, kWrite, local, 0, 8, remote, 0)},
                          In(absl::Seconds(10)))[0]
                  .ok());
  SoftFault drop;
  drop.action = SoftFault::Action::kDrop;
  drop.device = "nic_a";
  fabric_.InjectFault(drop);
  const std::vector<uint8_t> before = Snapshot(remote);
  const auto lost = a->backend<IbverbsBackend>().Submit(
      {MakeOp(0, kWrite, local, 100, 50, remote, 100),
       MakeOp(1, kWrite, local, 200, 50, remote, 200)},
      In(absl::Seconds(10)));
  EXPECT_EQ(lost[0].code(), absl::StatusCode::kUnavailable) << lost[0];
  EXPECT_NE(lost[0].message().find("IBV_WC_RETRY_EXC_ERR"), std::string::npos);
  // Behind the lost WR on the same QP: flushed.
  EXPECT_EQ(lost[1].code(), absl::StatusCode::kUnavailable) << lost[1];
  EXPECT_NE(lost[1].message().find("IBV_WC_WR_FLUSH_ERR"), std::string::npos);
  EXPECT_EQ(Snapshot(remote), before);

  const auto again = a->backend<IbverbsBackend>().Submit(
      {MakeOp(0, kWrite, local, 100, 50, remote, 100)}, In(absl::Seconds(10)));
  EXPECT_TRUE(again[0].ok()) << again[0];
  EXPECT_EQ(0, std::memcmp(remote.bytes() + 100, local.bytes() + 100, 50));
  EXPECT_EQ(a->backend<IbverbsBackend>().connections_established(), 2u);
}

TEST_F(IbverbsBackendTest, CompletionErrorsMapToContractCodes) {
  auto a = Node("agent-a", "nic_a");
  auto b = Node("agent-b", "nic_b");
  TestBuffer local = a->Register(4096, v1::ACCESS_READ_WRITE, 1);
  TestBuffer remote = b->Register(4096, v1::ACCESS_READ_WRITE, 2);
  const std::vector<std::pair<ibv_wc_status, absl::StatusCode>> cases = {
      {IBV_WC_REM_ACCESS_ERR, absl::StatusCode::kPermissionDenied},
      {IBV_WC_RETRY_EXC_ERR, absl::StatusCode::kUnavailable},
      {IBV_WC_RNR_RETRY_EXC_ERR, absl::StatusCode::kUnavailable},
      {IBV_WC_REM_INV_REQ_ERR, absl::StatusCode::kInvalidArgument},
      {IBV_WC_LOC_PROT_ERR, absl::StatusCode::kInternal},
      {IBV_WC_REM_OP_ERR, absl::StatusCode::kInternal},
  };
  for (const auto& [status, code] : cases) {
    SoftFault fail;
    fail.action = SoftFault::Action::kFail;
    fail.status = status;
    fabric_.InjectFault(fail);
    const auto results = a->backend<IbverbsBackend>().Submit(
        {MakeOp(0, kRead, local, 0, 10, remote, 0)}, In(absl::Seconds(10)));
    EXPECT_EQ(results[0].code(), code)
        << verbs::WcStatusName(status) << ": " << results[0];
    EXPECT_NE(results[0].message().find(verbs::WcStatusName(status)),
              std::string::npos);
  }
  // Each failure broke the QP; every following submit reconnected.
  EXPECT_EQ(a->backend<IbverbsBackend>().connections_established(),
            cases.size());
}

TEST_F(IbverbsBackendTest, UnpluggedRemoteDeviceIsUnavailable) {
  auto a = Node("agent-a", "nic_a");
  auto b = Node("agent-b", "nic_b");
  TestBuffer local = a->Register(4096, v1::ACCESS_READ_WRITE, 1);
  TestBuffer remote = b->Register(4096, v1::ACCESS_READ_WRITE, 2);
  fabric_.SetReachable("nic_b", false);
  const auto results = a->backend<IbverbsBackend>().Submit(
      {MakeOp(0, kRead, local, 0, 10, remote, 0)}, In(absl::Seconds(10)));
  EXPECT_EQ(results[0].code(), absl::StatusCode::kUnavailable) << results[0];
  fabric_.SetReachable("nic_b", true);
  EXPECT_TRUE(a->backend<IbverbsBackend>()
                  .Submit({MakeOp(0, kRead, local, 0, 10, remote, 0)},
                          In(absl::Seconds(10)))[0]
                  .ok());
}

TEST_F(IbverbsBackendTest, AStuckPeerDoesNotHoldUpOpsToOthersInTheBatch) {
  IbverbsOptions options = Fast();
  options.qp.sq_depth = 2;
  options.qp.timeout = 0;  // WRs to a dark port wait until ERR
  auto a = Node("agent-a", "nic_a", options);
  auto b = Node("agent-b", "nic_b");
  auto c = Node("agent-c", "nic_c");
  TestBuffer local = a->Register(4096, v1::ACCESS_READ_WRITE, 1);
  TestBuffer to_b = b->Register(4096, v1::ACCESS_READ_WRITE, 2);
  TestBuffer to_c = c->Register(4096, v1::ACCESS_READ_WRITE, 3);
  fabric_.SetReachable("nic_b", false);
  std::vector<Op> ops;
  for (size_t i = 0; i < 5; ++i) {
    ops.push_back(MakeOp(i, kWrite, local, i, 10, to_b, i));
  }
  ops.push_back(MakeOp(5, kWrite, local, 100, 1000, to_c, 200));
  // Long enough for the handshake with C on a loaded machine.
  const auto results =
      a->backend<IbverbsBackend>().Submit(ops, In(absl::Seconds(2)));
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(results[i].code(), absl::StatusCode::kDeadlineExceeded)
        << i << ": " << results[i];
  }
  EXPECT_TRUE(results[5].ok()) << results[5];
  EXPECT_EQ(0, std::memcmp(to_c.bytes() + 200, local.bytes() + 100, 1000));
}

TEST_F(IbverbsBackendTest, RemoteReleaseDuringAnOpIsRefusedByTheNic) {
  auto a = Node("agent-a", "nic_a");
  auto b = Node("agent-b", "nic_b");
  TestBuffer local = a->Register(4096, v1::ACCESS_READ_WRITE, 1);
  TestBuffer remote = b->Register(4096, v1::ACCESS_READ_WRITE, 2);
  ASSERT_TRUE(a->backend<IbverbsBackend>()
                  .Submit({MakeOp(0, kWrite, local, 0, 8, remote, 0)},
                          In(absl::Seconds(10)))[0]
                  .ok());
  SoftFault delay;
  delay.action = SoftFault::Action::kDelay;
  delay.delay = absl::Milliseconds(300);
  fabric_.InjectFault(delay);
  const Op op = MakeOp(0, kWrite, local, 0, 4096, remote, 0);
  absl::Status result;
  std::thread submit([&] {
    result =
        a->backend<IbverbsBackend>().Submit({op}, In(absl::Seconds(10)))[0];
  });
  // The remote agent releases while the WR waits on the wire: its MR is
  // deregistered, so the write must not land.
  std::weak_ptr<Registration> watch = remote.registration;
  b->Release(remote);
  remote = TestBuffer{};
  EXPECT_TRUE(watch.expired());
  submit.join();
  EXPECT_EQ(result.code(), absl::StatusCode::kPermissionDenied) << result;
}

TEST_F(IbverbsBackendTest, PeerServiceAnswersOnAnExternalListener) {
  // As the agent does it: the backend's peer_services() on a server the
  // backend does not own.
  BackendEnvironment env;
  env.identity.agent_id = "agent-ext";
  env.identity.epoch = 42;
  BufferTable directory(42);
  env.directory = &directory;
  IbverbsOptions options = Fast();
  options.max_responders = 1;
  auto backend =
      IbverbsBackend::Create(env, options, fabric_.MakeVerbs({"nic_b"}));
  ASSERT_TRUE(backend.ok());
  // Backends open no listener of their own: without an address to
  // advertise, Start() refuses.
  EXPECT_EQ((*backend)->Start("").code(),
            absl::StatusCode::kFailedPrecondition);
  // The agent's address: Start() adds no listener of its own.
  ASSERT_TRUE((*backend)->Start("set-by-the-agent:1").ok());
  // A registration whose token the handshake proves.
  auto memory = SharedMemory::Allocate(4096, "proof");
  ASSERT_TRUE(memory.ok());
  auto registration =
      std::make_shared<Registration>(7, 0, v1::ACCESS_READ_WRITE, "proof",
                                     "token-7", std::move(*memory), true);
  v1::BackendEndpoint endpoint;
  auto state = (*backend)->Register(*registration, &endpoint);
  ASSERT_TRUE(state.ok()) << state.status();
  registration->AddBackend("ibverbs", std::move(*state));
  directory.Add(registration);
  EXPECT_EQ((*backend)->peer_address(), "set-by-the-agent:1");
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &port);
  for (grpc::Service* service : (*backend)->peer_services()) {
    builder.RegisterService(service);
  }
  auto server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto stub = v1::Peer::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  const auto call = [&](const v1::ConnectQueuePairRequest& request) {
    grpc::ClientContext context;
    v1::ConnectQueuePairResponse response;
    return std::make_pair(stub->ConnectQueuePair(&context, request, &response),
                          response);
  };
  v1::ConnectQueuePairRequest request;
  request.set_agent_id("agent-a");
  request.set_expected_epoch(42);
  request.set_remote_device("nic_b");
  request.set_buffer_id(7);
  request.set_token("token-7");
  request.mutable_requester()->set_qp_num(0);
  EXPECT_EQ(call(request).first.error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  v1::QueuePairEndpoint* side = request.mutable_requester();
  side->set_device("nic_a");
  side->set_port(1);
  side->set_gid(std::string(16, '\x01'));
  side->set_qp_num(12345);
  side->set_mtu_bytes(1024);
  side->set_max_rd_atomic(4);
  request.set_expected_epoch(41);
  EXPECT_EQ(call(request).first.error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  request.set_expected_epoch(42);
  request.set_remote_device("nic_c");
  EXPECT_EQ(call(request).first.error_code(), grpc::StatusCode::NOT_FOUND);

  // A well-formed request gets an RTS responder QP back.
  request.set_remote_device("nic_b");
  auto [status, response] = call(request);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.responder().device(), "nic_b");
  EXPECT_NE(response.responder().qp_num(), 0u);
  EXPECT_EQ(response.responder().gid().size(), 16u);
  EXPECT_EQ(response.session().size(), 16u);
  EXPECT_EQ(response.grant().buffer_id(), 7u);
  EXPECT_NE(response.grant().rkey(), 0u);
  EXPECT_EQ(response.grant().size_bytes(), 4096u);
  EXPECT_EQ((*backend)->responder_count(), 1u);
  EXPECT_EQ((*backend)->grant_count(), 1u);
  // A reconnect presenting the session's handle replaces it (and its
  // grants), under the same handle.
  request.set_session(response.session());
  auto [again, reconnected] = call(request);
  ASSERT_TRUE(again.ok()) << again.error_message();
  EXPECT_EQ(reconnected.session(), response.session());
  EXPECT_EQ((*backend)->responder_count(), 1u);
  EXPECT_EQ((*backend)->grant_count(), 1u);
  // Anyone without it, whatever agent id it claims, would be another
  // session: past max_responders (1 here).
  request.clear_session();
  EXPECT_EQ(call(request).first.error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  request.set_agent_id("agent-z");
  EXPECT_EQ(call(request).first.error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ((*backend)->responder_count(), 1u);
  server->Shutdown();
  ASSERT_TRUE(directory.Remove(7, /*caller=*/0).ok());
  registration.reset();
  EXPECT_EQ((*backend)->grant_count(), 0u);
}

// How a Submit is cut short with WRs on the wire: at its deadline, or by its
// cancellation (the client went away, the agent shuts down). Every way must
// end the Submit promptly, move the QPs carrying its WRs to ERR and drain
// them, so that nothing touches memory afterwards, and leave the backend
// able to reconnect.
struct StopCase {
  std::string name;
  absl::Duration deadline;             // from the Submit's start
  std::optional<absl::Status> cancel;  // fired 100 ms in, when set
  absl::StatusCode code;               // what the cut ops report
};

class IbverbsStopTest : public IbverbsBackendTest,
                        public ::testing::WithParamInterface<StopCase> {
 protected:
  // Runs `ops` on `backend`, cut short as the case says; returns the
  // results after checking they carry the case's code.
  std::vector<absl::Status> SubmitCutShort(IbverbsBackend& backend,
                                           const std::vector<Op>& ops) {
    const StopCase& stop = GetParam();
    Cancellation cancellation;
    std::thread canceller;
    if (stop.cancel.has_value()) {
      canceller = std::thread([&] {
        absl::SleepFor(absl::Milliseconds(100));
        cancellation.Cancel(*stop.cancel);
      });
    }
    const absl::Time start = absl::Now();
    std::vector<absl::Status> results =
        backend.Submit(ops, StopToken(start + stop.deadline, &cancellation));
    took_ = absl::Now() - start;
    if (canceller.joinable()) canceller.join();
    for (size_t i = 0; i < results.size(); ++i) {
      EXPECT_EQ(results[i].code(), stop.code) << i << ": " << results[i];
      if (stop.cancel.has_value()) {
        EXPECT_TRUE(
            absl::StrContains(results[i].message(), stop.cancel->message()))
            << results[i];
      }
    }
    return results;
  }

  absl::Duration took_;
};

TEST_P(IbverbsStopTest, MovesQpToErrorDrainsAndNextSubmitWorks) {
  auto a = Node("agent-a", "nic_a");
  auto b = Node("agent-b", "nic_b");
  TestBuffer local = a->Register(8192, v1::ACCESS_READ_WRITE, 1);
  TestBuffer remote = b->Register(8192, v1::ACCESS_READ_WRITE, 2);
  ASSERT_TRUE(a->backend<IbverbsBackend>()
                  .Submit({MakeOp(0, kRead, local, 0, 8, remote, 0)},
                          In(absl::Seconds(10)))[0]
                  .ok());
  const uint64_t ok_before = fabric_.wrs_completed_ok();
  SoftFault delay;
  delay.action = SoftFault::Action::kDelay;
  delay.delay = absl::Seconds(1);
  delay.count = 2;
  fabric_.InjectFault(delay);
  const std::vector<uint8_t> local_before = Snapshot(local);
  const std::vector<uint8_t> remote_before = Snapshot(remote);
  SubmitCutShort(a->backend<IbverbsBackend>(),
                 {MakeOp(0, kRead, local, 10, 100, remote, 1000),
                  MakeOp(1, kWrite, local, 2000, 100, remote, 3000)});
  EXPECT_LT(took_, absl::Milliseconds(900));  // not the 1 s delayed WRs
  // Nothing signals "a flushed WR did not run later", so wait out the
  // injected delay and check that no byte moved.
  absl::SleepFor(absl::Milliseconds(1200));
  EXPECT_EQ(Snapshot(local), local_before);
  EXPECT_EQ(Snapshot(remote), remote_before);
  EXPECT_EQ(fabric_.wrs_completed_ok(), ok_before);
  const auto again = a->backend<IbverbsBackend>().Submit(
      {MakeOp(0, kRead, local, 10, 100, remote, 1000)}, In(absl::Seconds(10)));
  EXPECT_TRUE(again[0].ok()) << again[0];
  EXPECT_EQ(0, std::memcmp(local.bytes() + 10, remote.bytes() + 1000, 100));
  EXPECT_EQ(a->backend<IbverbsBackend>().connections_established(), 2u);
}

TEST_P(IbverbsStopTest, EndsTheWaitForSendQueueCredits) {
  IbverbsOptions shallow = Fast();
  shallow.qp.sq_depth = 2;
  shallow.qp.timeout = 0;  // a lost WR is never retried out: only ERR ends it
  auto a = Node("agent-a", "nic_a", shallow);
  auto b = Node("agent-b", "nic_b");
  TestBuffer local = a->Register(4096, v1::ACCESS_READ_WRITE, 1);
  TestBuffer remote = b->Register(4096, v1::ACCESS_READ_WRITE, 2);
  SoftFault drop;
  drop.action = SoftFault::Action::kDrop;
  drop.count = -1;
  fabric_.InjectFault(drop);
  std::vector<Op> ops;
  for (size_t i = 0; i < 5; ++i) {
    ops.push_back(MakeOp(i, kWrite, local, i * 10, 10, remote, i * 10));
  }
  SubmitCutShort(a->backend<IbverbsBackend>(), ops);
  EXPECT_LT(took_, absl::Seconds(1));
  fabric_.ClearFaults();
  EXPECT_TRUE(a->backend<IbverbsBackend>()
                  .Submit({MakeOp(0, kWrite, local, 0, 10, remote, 0)},
                          In(absl::Seconds(10)))[0]
                  .ok());
}

INSTANTIATE_TEST_SUITE_P(
    Stops, IbverbsStopTest,
    ::testing::Values(
        StopCase{"Deadline", absl::Milliseconds(200), std::nullopt,
                 absl::StatusCode::kDeadlineExceeded},
        StopCase{"ClientGone", absl::Seconds(30),
                 absl::CancelledError("the client went away"),
                 absl::StatusCode::kCancelled},
        StopCase{"ShuttingDown", absl::Seconds(30),
                 absl::UnavailableError("the agent is shutting down"),
                 absl::StatusCode::kUnavailable}),
    [](const ::testing::TestParamInfo<StopCase>& info) {
      return info.param.name;
    });

}  // namespace
}  // namespace rdma_agent::ibverbs

// Routing between agents in one process, each with memory, tcp and ibverbs
// (on the software RC NIC) backends: ibverbs is chosen over tcp when both
// sides have it, tcp when the peer has no NIC, and tcp again when the NIC
// path fails with UNAVAILABLE.
#include <memory>
#include <string>
#include <vector>

#include "backends/ibverbs/ibverbs_backend.h"
#include "backends/ibverbs/soft/soft_verbs.h"
#include "backends/testing/ibverbs_agent.h"
#include "gtest/gtest.h"
#include "tests/testing/agent_fixture.h"
#include "tests/testing/backend_factories.h"

namespace rdma_agent {
namespace {

using ibverbs::IbverbsOptions;
using testing::InProcessAgent;

constexpr uint64_t kSize = 1 << 20;

class RoutingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* name : {"nic_a", "nic_b", "nic_a1", "nic_b1"}) {
      verbs::SoftDeviceConfig config;
      config.name = name;
      ASSERT_TRUE(fabric_->AddDevice(config).ok());
    }
  }

  // memory + tcp + ibverbs on `device` (empty: ibverbs disabled, as on a
  // host without a NIC).
  std::unique_ptr<InProcessAgent> StartAgent(const std::string& device) {
    return StartAgent(std::vector<std::string>({device}));
  }

  // The same with a rail per device of `devices`.
  std::unique_ptr<InProcessAgent> StartAgent(
      const std::vector<std::string>& devices,
      absl::Duration rail_cooldown = absl::Seconds(1)) {
    AgentOptions options;
    options.backends.push_back(testing::MemoryFactory());
    options.backends.push_back(testing::LoopbackTcpFactory());
    std::shared_ptr<verbs::SoftFabric> fabric = fabric_;
    const bool enabled = !devices.empty() && !devices.front().empty();
    IbverbsOptions ib;
    ib.enabled = enabled;
    ib.qp.timeout = 8;  // ~1 ms per try: a dead path fails fast
    ib.qp.retry_cnt = 2;
    ib.rail_cooldown = rail_cooldown;
    ib.rail_max_cooldown = rail_cooldown;
    options.backends.push_back(testing::IbverbsFactory(
        [fabric, devices, enabled] {
          return fabric->MakeVerbs(enabled ? devices
                                           : std::vector<std::string>{"-"});
        },
        ib));
    auto agent = InProcessAgent::Start(std::move(options));
    EXPECT_TRUE(agent.ok()) << agent.status();
    return agent.ok() ? std::move(*agent) : nullptr;
  }

  // Registers kSize bytes filled with a pattern from `seed`.
  static v1::RegisterResponse Buffer(InProcessAgent& agent, uint8_t seed) {
    auto response = agent.Allocate(kSize);
    EXPECT_TRUE(response.ok()) << response.status();
    std::string data(kSize, '\0');
    for (uint64_t i = 0; i < kSize; ++i) {
      data[i] = static_cast<char>(seed + i * 13 + (i >> 9));
    }
    grpc::ClientContext context;
    v1::WriteBufferRequest request;
    request.set_buffer_id(response->buffer_id());
    request.set_data(data);
    v1::WriteBufferResponse ignored;
    EXPECT_TRUE(agent.stub().WriteBuffer(&context, request, &ignored).ok());
    return *response;
  }

  static std::string Contents(InProcessAgent& agent, uint64_t id) {
    grpc::ClientContext context;
    v1::ReadBufferRequest request;
    request.set_buffer_id(id);
    request.set_length(kSize);
    v1::ReadBufferResponse response;
    EXPECT_TRUE(agent.stub().ReadBuffer(&context, request, &response).ok());
    return response.data();
  }

  static v1::SubmitResponse Submit(InProcessAgent& agent,
                                   const std::vector<v1::Op>& ops,
                                   absl::Duration timeout = absl::Seconds(20)) {
    grpc::ClientContext context;
    v1::SubmitRequest request;
    for (const v1::Op& op : ops) *request.add_ops() = op;
    request.mutable_timeout()->set_seconds(absl::ToInt64Seconds(timeout));
    request.mutable_timeout()->set_nanos(static_cast<int32_t>(
        absl::ToInt64Nanoseconds(timeout % absl::Seconds(1))));
    v1::SubmitResponse response;
    const absl::Status status =
        FromGrpcStatus(agent.stub().Submit(&context, request, &response));
    EXPECT_TRUE(status.ok()) << status;
    return response;
  }

  static v1::Op MakeOp(v1::OpType type, uint64_t local, uint64_t local_offset,
                       uint64_t length, const v1::RegisterResponse& remote,
                       uint64_t remote_offset) {
    v1::Op op;
    op.set_type(type);
    op.set_local_buffer_id(local);
    op.set_local_offset(local_offset);
    op.set_length(length);
    op.set_remote_context(remote.remote_context());
    op.set_remote_offset(remote_offset);
    return op;
  }

  // Checks that `after` is `before` with [offset, +length) replaced by
  // source[source_offset, +length).
  static void ExpectSpliced(const std::string& before, const std::string& after,
                            uint64_t offset, uint64_t length,
                            const std::string& source, uint64_t source_offset) {
    ASSERT_EQ(after.size(), before.size());
    EXPECT_EQ(after.substr(0, offset), before.substr(0, offset));
    EXPECT_EQ(after.substr(offset, length),
              source.substr(source_offset, length));
    EXPECT_EQ(after.substr(offset + length), before.substr(offset + length));
  }

  // Outlives the agents (declared first); their backends share it.
  std::shared_ptr<verbs::SoftFabric> fabric_ =
      std::make_shared<verbs::SoftFabric>();
};

TEST_F(RoutingTest, IbverbsIsChosenOverTcpWhenBothSidesHaveIt) {
  auto a = StartAgent("nic_a");
  auto b = StartAgent("nic_b");
  ASSERT_TRUE(a && b);
  const v1::RegisterResponse local = Buffer(*a, 1);
  const v1::RegisterResponse remote = Buffer(*b, 77);
  EXPECT_EQ(std::vector<std::string>(remote.backends().begin(),
                                     remote.backends().end()),
            std::vector<std::string>({"memory", "ibverbs", "tcp"}));
  const std::string local_before = Contents(*a, local.buffer_id());
  const std::string remote_before = Contents(*b, remote.buffer_id());

  const v1::SubmitResponse response =
      Submit(*a, {MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL, local.buffer_id(), 3,
                         70001, remote, 11),
                  MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, local.buffer_id(), 500001,
                         12345, remote, 700003)});
  ASSERT_EQ(response.results_size(), 2);
  for (const v1::OpResult& result : response.results()) {
    EXPECT_EQ(result.code(), 0) << result.message();
    EXPECT_EQ(result.backend(), "ibverbs");
  }
  ExpectSpliced(remote_before, Contents(*b, remote.buffer_id()), 11, 70001,
                local_before, 3);
  ExpectSpliced(local_before, Contents(*a, local.buffer_id()), 500001, 12345,
                remote_before, 700003);
}

TEST_F(RoutingTest, TcpWhenThePeerHasNoNic) {
  auto a = StartAgent("nic_a");
  auto c = StartAgent("");  // ibverbs unavailable there
  ASSERT_TRUE(a && c);
  const v1::RegisterResponse local = Buffer(*a, 1);
  const v1::RegisterResponse remote = Buffer(*c, 55);
  EXPECT_EQ(std::vector<std::string>(remote.backends().begin(),
                                     remote.backends().end()),
            std::vector<std::string>({"memory", "tcp"}));
  const std::string local_before = Contents(*a, local.buffer_id());
  const std::string remote_before = Contents(*c, remote.buffer_id());
  const v1::SubmitResponse response =
      Submit(*a, {MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL, local.buffer_id(), 9,
                         4099, remote, 1)});
  ASSERT_EQ(response.results_size(), 1);
  EXPECT_EQ(response.results(0).code(), 0) << response.results(0).message();
  EXPECT_EQ(response.results(0).backend(), "tcp");
  ExpectSpliced(remote_before, Contents(*c, remote.buffer_id()), 1, 4099,
                local_before, 9);
}

TEST_F(RoutingTest, RetriesOnTcpWhenTheNicPathIsUnavailable) {
  auto a = StartAgent("nic_a");
  auto b = StartAgent("nic_b");
  ASSERT_TRUE(a && b);
  const v1::RegisterResponse local = Buffer(*a, 1);
  const v1::RegisterResponse remote = Buffer(*b, 99);
  const std::string local_before = Contents(*a, local.buffer_id());
  const std::string remote_before = Contents(*b, remote.buffer_id());
  // The remote port goes dark: RDMA retry-exceeds (UNAVAILABLE).
  fabric_->SetReachable("nic_b", false);
  const v1::SubmitResponse response =
      Submit(*a, {MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL, local.buffer_id(), 17,
                         100000, remote, 33)});
  ASSERT_EQ(response.results_size(), 1);
  EXPECT_EQ(response.results(0).code(), 0) << response.results(0).message();
  EXPECT_EQ(response.results(0).backend(), "tcp");
  ExpectSpliced(remote_before, Contents(*b, remote.buffer_id()), 33, 100000,
                local_before, 17);

  // Back up: the NIC is used again (after reconnecting).
  fabric_->SetReachable("nic_b", true);
  const v1::SubmitResponse again =
      Submit(*a, {MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, local.buffer_id(), 0, 10,
                         remote, 0)});
  EXPECT_EQ(again.results(0).code(), 0) << again.results(0).message();
  EXPECT_EQ(again.results(0).backend(), "ibverbs");
}

TEST_F(RoutingTest, DeadlineOnTheNicIsReportedAndLeavesMemoryAlone) {
  auto a = StartAgent("nic_a");
  auto b = StartAgent("nic_b");
  ASSERT_TRUE(a && b);
  const v1::RegisterResponse local = Buffer(*a, 1);
  const v1::RegisterResponse remote = Buffer(*b, 42);
  const std::string remote_before = Contents(*b, remote.buffer_id());
  verbs::SoftFault delay;
  delay.action = verbs::SoftFault::Action::kDelay;
  delay.delay = absl::Seconds(1);
  fabric_->InjectFault(delay);
  const v1::SubmitResponse response =
      Submit(*a,
             {MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL, local.buffer_id(), 0, 1000,
                     remote, 0)},
             absl::Milliseconds(200));
  ASSERT_EQ(response.results_size(), 1);
  EXPECT_EQ(response.results(0).code(),
            static_cast<int>(absl::StatusCode::kDeadlineExceeded))
      << response.results(0).message();
  EXPECT_EQ(response.results(0).backend(), "ibverbs");
  // Nothing signals "the flushed WR did not run later": outwait the delay.
  absl::SleepFor(absl::Milliseconds(1200));
  EXPECT_EQ(Contents(*b, remote.buffer_id()), remote_before);
}

TEST_F(RoutingTest, EveryRailDownFallsBackToTcpAndAReplugBringsIbverbsBack) {
  // Two rails each; the peer's rails go dark one after the other.
  auto a = StartAgent({"nic_a", "nic_a1"}, absl::Milliseconds(20));
  auto b = StartAgent({"nic_b", "nic_b1"}, absl::Milliseconds(20));
  ASSERT_TRUE(a && b);
  const v1::RegisterResponse local = Buffer(*a, 1);
  const v1::RegisterResponse remote = Buffer(*b, 123);
  const std::string local_before = Contents(*a, local.buffer_id());
  std::string remote_before = Contents(*b, remote.buffer_id());
  // One rail left: still ibverbs, every byte where it belongs.
  fabric_->SetReachable("nic_b1", false);
  v1::SubmitResponse response =
      Submit(*a, {MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL, local.buffer_id(), 5,
                         700001, remote, 9)});
  ASSERT_EQ(response.results_size(), 1);
  EXPECT_EQ(response.results(0).code(), 0) << response.results(0).message();
  EXPECT_EQ(response.results(0).backend(), "ibverbs");
  ExpectSpliced(remote_before, Contents(*b, remote.buffer_id()), 9, 700001,
                local_before, 5);
  // None left: UNAVAILABLE from ibverbs, and the registry's retry on tcp.
  remote_before = Contents(*b, remote.buffer_id());
  fabric_->SetReachable("nic_b", false);
  response = Submit(*a, {MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL, local.buffer_id(),
                                1001, 300007, remote, 77)});
  ASSERT_EQ(response.results_size(), 1);
  EXPECT_EQ(response.results(0).code(), 0) << response.results(0).message();
  EXPECT_EQ(response.results(0).backend(), "tcp");
  ExpectSpliced(remote_before, Contents(*b, remote.buffer_id()), 77, 300007,
                local_before, 1001);
  // Both back: ibverbs again once the rails' cooldowns ran out and their
  // probes answered (a few ops at most).
  fabric_->SetReachable("nic_b", true);
  fabric_->SetReachable("nic_b1", true);
  std::string backend;
  for (int round = 0; round < 500 && backend != "ibverbs"; ++round) {
    absl::SleepFor(absl::Milliseconds(10));
    remote_before = Contents(*b, remote.buffer_id());
    response =
        Submit(*a, {MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL, local.buffer_id(),
                           round, 200003, remote, round + 3)});
    ASSERT_EQ(response.results_size(), 1);
    ASSERT_EQ(response.results(0).code(), 0) << response.results(0).message();
    backend = response.results(0).backend();
    ExpectSpliced(remote_before, Contents(*b, remote.buffer_id()), round + 3,
                  200003, local_before, round);
  }
  EXPECT_EQ(backend, "ibverbs");
}

}  // namespace
}  // namespace rdma_agent

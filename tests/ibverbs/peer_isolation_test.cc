// What a peer can reach over ibverbs, played by the test with raw Peer calls
// and its own queue pairs on the software RC NIC: nothing without the proof
// of a registration; with it, only that registration, with its access, for
// as long as it is registered; and nothing of an agent that merely called it
// (a rogue responder).
#include <grpcpp/grpcpp.h>

#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends/ibverbs/backend_probe.h"
#include "backends/ibverbs/connection.h"
#include "backends/ibverbs/ibverbs_backend.h"
#include "backends/ibverbs/soft/soft_verbs.h"
#include "backends/testing/harness.h"
#include "backends/testing/ibverbs_agent.h"
#include "common/stop_token.h"
#include "gtest/gtest.h"
#include "rdma/agent/v1/peer.grpc.pb.h"

namespace rdma_agent::ibverbs {
namespace {

using ::rdma_agent::testing::IbverbsAgent;
using ::rdma_agent::testing::MakeOp;
using ::rdma_agent::testing::Snapshot;
using ::rdma_agent::testing::SoftIbverbsAgent;
using ::rdma_agent::testing::TestAgent;
using ::rdma_agent::testing::TestBuffer;
using testing::IbverbsBackendProbe;
using verbs::SoftDeviceConfig;
using verbs::SoftFabric;

constexpr size_t kRogueBytes = 64 << 10;

QueuePairParams FastParams() {
  QueuePairParams params;
  params.mtu_bytes = 1024;
  params.timeout = 8;  // ~1 ms per try
  params.retry_cnt = 2;
  params.sq_depth = 16;
  return params;
}

IbverbsOptions FastOptions() {
  IbverbsOptions options;
  options.qp.timeout = 8;
  options.qp.retry_cnt = 2;
  return options;
}

// A peer that does not run the agent's code: its own device, PD, memory and
// queue pairs, and raw calls to the target's Peer service.
class RoguePeer {
 public:
  RoguePeer(SoftFabric& fabric, const std::string& device, std::string agent_id)
      : agent_id_(std::move(agent_id)), memory_(kRogueBytes) {
    verbs_ = fabric.MakeVerbs({device});
    device_ = std::move(*verbs_->OpenDevice(device));
    pd_ = std::move(*device_->AllocateProtectionDomain());
    for (size_t i = 0; i < memory_.size(); ++i) memory_[i] = 0xee;
    mr_ = std::move(*pd_->RegisterMemory(memory_.data(), memory_.size(),
                                         IBV_ACCESS_LOCAL_WRITE |
                                             IBV_ACCESS_REMOTE_READ |
                                             IBV_ACCESS_REMOTE_WRITE));
    local_.device = device_.get();
    local_.pd = pd_.get();
    local_.port = 1;
    local_.lid = device_->QueryPort(1)->lid;
    local_.gid = *device_->QueryGid(1, 0);
    local_.global_routing = true;
  }

  // A fresh QP (refusing or accepting inbound RDMA).
  std::unique_ptr<QueuePairConnection> NewQueuePair(
      QueuePairConnection::Inbound inbound) {
    auto created = QueuePairConnection::Create(local_, FastParams(),
                                               absl::Microseconds(50),
                                               absl::Seconds(5), inbound);
    EXPECT_TRUE(created.ok()) << created.status();
    return created.ok() ? std::move(*created) : nullptr;
  }

  struct Attempt {
    grpc::Status status;
    v1::ConnectQueuePairResponse response;
    std::unique_ptr<QueuePairConnection>
        connection;  // connected when status is OK
  };

  // ConnectQueuePair with `target`, proving (buffer_id, token), on its
  // rail `remote_device` (empty: its first).
  Attempt Connect(TestAgent& target, uint64_t epoch, uint64_t buffer_id,
                  const std::string& token,
                  const std::string& remote_device = "") {
    Attempt attempt;
    attempt.connection = NewQueuePair(QueuePairConnection::Inbound::kRefuse);
    v1::ConnectQueuePairRequest request;
    request.set_agent_id(agent_id_);
    request.set_agent_epoch(1);
    request.set_expected_epoch(epoch);
    request.set_remote_device(!remote_device.empty()
                                  ? remote_device
                                  : target.backend<IbverbsBackend>()
                                        .transport_info()
                                        .devices(0)
                                        .name());
    *request.mutable_requester() = attempt.connection->local_endpoint();
    request.set_buffer_id(buffer_id);
    request.set_token(token);
    grpc::ClientContext context;
    attempt.status =
        Stub(target).ConnectQueuePair(&context, request, &attempt.response);
    if (attempt.status.ok()) {
      const absl::Status connected =
          attempt.connection->ConnectTo(attempt.response.responder());
      EXPECT_TRUE(connected.ok()) << connected;
    } else {
      attempt.connection.reset();
    }
    return attempt;
  }

  // Connects with the proof of `buffer` (which must hold).
  Attempt ConnectWith(TestAgent& target, const TestBuffer& buffer) {
    Attempt attempt =
        Connect(target, buffer.context->agent_epoch(),
                buffer.context->buffer_id(), buffer.context->token());
    EXPECT_TRUE(attempt.status.ok()) << attempt.status.error_message();
    return attempt;
  }

  grpc::Status Grant(TestAgent& target, const std::string& session,
                     uint64_t epoch, uint64_t buffer_id,
                     const std::string& token,
                     v1::GrantBufferResponse* response) {
    v1::GrantBufferRequest request;
    request.set_agent_id(agent_id_);
    request.set_expected_epoch(epoch);
    request.set_session(session);
    request.set_buffer_id(buffer_id);
    request.set_token(token);
    grpc::ClientContext context;
    return Stub(target).GrantBuffer(&context, request, response);
  }

  // One hand-built RDMA WR of `length` bytes between memory_[local_offset..]
  // and (remote_addr, rkey) on `connection`; its completion's status.
  absl::Status Rdma(QueuePairConnection& connection, ibv_wr_opcode opcode,
                    uint64_t remote_addr, uint32_t rkey, uint32_t length,
                    uint64_t local_offset = 0) {
    auto tracker = std::make_shared<OpTracker>(1);
    ibv_sge sge = {};
    sge.addr = reinterpret_cast<uint64_t>(memory_.data() + local_offset);
    sge.length = length;
    sge.lkey = mr_->lkey();
    ibv_send_wr wr = {};
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = opcode;
    wr.wr.rdma.remote_addr = remote_addr;
    wr.wr.rdma.rkey = rkey;
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    tracker->PostingFinished(
        0, connection.Post(wr, tracker, 0, nullptr, deadline));
    EXPECT_TRUE(tracker->WaitAllDone(deadline));
    return tracker->Results()[0];
  }

  std::vector<uint8_t>& memory() { return memory_; }
  uint32_t rkey() const { return mr_->rkey(); }
  const LocalPort& local() const { return local_; }

 private:
  v1::Peer::Stub& Stub(TestAgent& target) {
    if (stub_ == nullptr) {
      stub_ = v1::Peer::NewStub(
          grpc::CreateChannel(target.backend<IbverbsBackend>().peer_address(),
                              grpc::InsecureChannelCredentials()));
    }
    return *stub_;
  }

  const std::string agent_id_;
  std::unique_ptr<verbs::Verbs> verbs_;
  std::unique_ptr<verbs::Device> device_;
  std::unique_ptr<verbs::ProtectionDomain> pd_;
  std::vector<uint8_t> memory_;
  std::unique_ptr<verbs::MemoryRegion> mr_;
  LocalPort local_;
  std::unique_ptr<v1::Peer::Stub> stub_;
};

uint64_t AddressOf(const TestBuffer& buffer) {
  return reinterpret_cast<uint64_t>(buffer.registration->data());
}

void ExpectNoEpoch(const std::string& text, uint64_t epoch) {
  EXPECT_EQ(text.find(absl::StrCat(epoch)), std::string::npos) << text;
  EXPECT_EQ(text.find(absl::StrCat(absl::Hex(epoch))), std::string::npos)
      << text;
}

class PeerIsolationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* name : {"nic_a", "nic_b", "nic_r", "nic_s"}) {
      SoftDeviceConfig config;
      config.name = name;
      ASSERT_TRUE(fabric_.AddDevice(config).ok());
    }
    b_ = SoftIbverbsAgent(fabric_, "agent-b", "nic_b", FastOptions());
    ASSERT_NE(b_, nullptr);
  }

  SoftFabric fabric_;
  std::unique_ptr<TestAgent> b_;
};

TEST_F(PeerIsolationTest, HandshakeWithoutProofIsRefusedAndCreatesNothing) {
  TestBuffer buffer = b_->Register(4096, v1::ACCESS_READ_WRITE, 1);
  const uint64_t epoch = buffer.context->agent_epoch();
  const uint64_t id = buffer.context->buffer_id();
  const std::string& token = buffer.context->token();
  RoguePeer rogue(fabric_, "nic_r", "agent-r");
  const size_t qps_before = fabric_.live_queue_pairs();

  RoguePeer::Attempt no_token = rogue.Connect(*b_, epoch, id, "");
  RoguePeer::Attempt wrong_token =
      rogue.Connect(*b_, epoch, id, std::string(token.size(), 'x'));
  RoguePeer::Attempt unknown_id = rogue.Connect(*b_, epoch, id + 1000, token);
  for (const RoguePeer::Attempt* attempt :
       {&no_token, &wrong_token, &unknown_id}) {
    EXPECT_EQ(attempt->status.error_code(), grpc::StatusCode::NOT_FOUND)
        << attempt->status.error_message();
    // One message for all three: nothing tells which ids exist.
    EXPECT_EQ(attempt->status.error_message(),
              unknown_id.status.error_message());
    ExpectNoEpoch(attempt->status.error_message(), epoch);
  }
  RoguePeer::Attempt stale = rogue.Connect(*b_, epoch ^ 0x77, id, token);
  EXPECT_EQ(stale.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(stale.status.error_message().find("stale"), std::string::npos);
  ExpectNoEpoch(stale.status.error_message(), epoch);

  // Nothing was allocated on the target: no session, no grant, no QP.
  EXPECT_EQ(b_->backend<IbverbsBackend>().responder_count(), 0u);
  EXPECT_EQ(b_->backend<IbverbsBackend>().grant_count(), 0u);
  EXPECT_EQ(fabric_.live_queue_pairs(), qps_before);

  // GrantBuffer checks the proof before the session, with the same answers.
  v1::GrantBufferResponse ignored;
  grpc::Status grant =
      rogue.Grant(*b_, std::string(16, 's'), epoch, id, "wrong", &ignored);
  EXPECT_EQ(grant.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(grant.error_message(), unknown_id.status.error_message());
  grant =
      rogue.Grant(*b_, std::string(16, 's'), epoch ^ 0x77, id, token, &ignored);
  EXPECT_EQ(grant.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  ExpectNoEpoch(grant.error_message(), epoch);
  // With the proof but no session of its own, nothing either.
  grant = rogue.Grant(*b_, std::string(16, 's'), epoch, id, token, &ignored);
  EXPECT_EQ(grant.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(b_->backend<IbverbsBackend>().grant_count(), 0u);

  // The proof opens a session with exactly one grant.
  RoguePeer::Attempt good = rogue.ConnectWith(*b_, buffer);
  ASSERT_TRUE(good.status.ok());
  EXPECT_EQ(b_->backend<IbverbsBackend>().responder_count(), 1u);
  EXPECT_EQ(b_->backend<IbverbsBackend>().grant_count(), 1u);
  EXPECT_EQ(good.response.grant().address(), AddressOf(buffer));
  EXPECT_EQ(good.response.grant().size_bytes(), 4096u);
}

TEST_F(PeerIsolationTest, PeerGrantedOneBufferCannotReachAnother) {
  TestBuffer granted = b_->Register(4096, v1::ACCESS_READ_WRITE, 1);
  TestBuffer other = b_->Register(4096, v1::ACCESS_READ_WRITE, 2);
  const std::vector<uint8_t> other_before = Snapshot(other);
  RoguePeer rogue(fabric_, "nic_r", "agent-r");
  // Another peer is granted `other`: an MR with remote access exists for
  // it, in that peer's PD.
  RoguePeer second(fabric_, "nic_s", "agent-s");
  RoguePeer::Attempt second_session = second.ConnectWith(*b_, other);
  ASSERT_TRUE(second_session.status.ok());
  const uint32_t other_rkey = second_session.response.grant().rkey();

  // The granted buffer works, with the rkey of the rogue's session.
  RoguePeer::Attempt session = rogue.ConnectWith(*b_, granted);
  ASSERT_TRUE(session.status.ok());
  const v1::BufferGrant& grant = session.response.grant();
  ASSERT_TRUE(rogue
                  .Rdma(*session.connection, IBV_WR_RDMA_READ, grant.address(),
                        grant.rkey(), 4096)
                  .ok());
  EXPECT_EQ(0, std::memcmp(rogue.memory().data(), granted.bytes(), 4096));

  // Hand-built WRs at `other`: the other peer's rkey, the agent's own
  // (local) key, and the granted rkey with other's address. Each is refused
  // by the NIC and breaks the QP, so the rogue reconnects between them.
  struct Try {
    const char* what;
    ibv_wr_opcode opcode;
    uint32_t rkey;
  };
  const std::vector<Try> tries = {
      {"another peer's rkey, write", IBV_WR_RDMA_WRITE, other_rkey},
      {"another peer's rkey, read", IBV_WR_RDMA_READ, other_rkey},
      {"the agent's own key, write", IBV_WR_RDMA_WRITE,
       IbverbsBackendProbe::LocalKey(b_->backend<IbverbsBackend>(),
                                     *other.registration)},
      {"the agent's own key, read", IBV_WR_RDMA_READ,
       IbverbsBackendProbe::LocalKey(b_->backend<IbverbsBackend>(),
                                     *other.registration)},
      {"the granted rkey, write", IBV_WR_RDMA_WRITE, grant.rkey()},
      {"the granted rkey, read", IBV_WR_RDMA_READ, grant.rkey()},
  };
  for (const Try& t : tries) {
    SCOPED_TRACE(t.what);
    ASSERT_NE(t.rkey, 0u);
    RoguePeer::Attempt fresh = rogue.ConnectWith(*b_, granted);
    ASSERT_TRUE(fresh.status.ok());
    std::fill(rogue.memory().begin(), rogue.memory().end(), 0xee);
    const absl::Status refused =
        rogue.Rdma(*fresh.connection, t.opcode, AddressOf(other), t.rkey, 64);
    EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied) << refused;
    EXPECT_NE(refused.message().find("IBV_WC_REM_ACCESS_ERR"),
              std::string::npos)
        << refused;
    EXPECT_EQ(Snapshot(other), other_before);
    EXPECT_EQ(rogue.memory()[0], 0xee);  // nothing was read either
  }
  // Nor can the rogue's session be granted `other` without its token.
  RoguePeer::Attempt fresh = rogue.ConnectWith(*b_, granted);
  v1::GrantBufferResponse ignored;
  EXPECT_EQ(
      rogue
          .Grant(*b_, fresh.response.session(), other.context->agent_epoch(),
                 other.context->buffer_id(), "not-the-token", &ignored)
          .error_code(),
      grpc::StatusCode::NOT_FOUND);
  // With it, it can: GrantBuffer answers an rkey that works on its QP.
  v1::GrantBufferResponse granted_other;
  ASSERT_TRUE(rogue
                  .Grant(*b_, fresh.response.session(),
                         other.context->agent_epoch(),
                         other.context->buffer_id(), other.context->token(),
                         &granted_other)
                  .ok());
  EXPECT_TRUE(rogue
                  .Rdma(*fresh.connection, IBV_WR_RDMA_READ,
                        granted_other.grant().address(),
                        granted_other.grant().rkey(), 64)
                  .ok());
  EXPECT_EQ(0, std::memcmp(rogue.memory().data(), other.bytes(), 64));
}

TEST_F(PeerIsolationTest, ReadOnlyGrantCannotBeWritten) {
  TestBuffer read_only = b_->Register(4096, v1::ACCESS_READ, 3);
  const std::vector<uint8_t> before = Snapshot(read_only);
  RoguePeer rogue(fabric_, "nic_r", "agent-r");
  RoguePeer::Attempt session = rogue.ConnectWith(*b_, read_only);
  ASSERT_TRUE(session.status.ok());
  const v1::BufferGrant& grant = session.response.grant();
  ASSERT_TRUE(rogue
                  .Rdma(*session.connection, IBV_WR_RDMA_READ, grant.address(),
                        grant.rkey(), 128)
                  .ok());
  const absl::Status refused =
      rogue.Rdma(*session.connection, IBV_WR_RDMA_WRITE, grant.address(),
                 grant.rkey(), 128);
  EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied) << refused;
  EXPECT_EQ(Snapshot(read_only), before);
}

TEST_F(PeerIsolationTest, WriteOnlyGrantCannotBeRead) {
  TestBuffer write_only = b_->Register(4096, v1::ACCESS_WRITE, 4);
  RoguePeer rogue(fabric_, "nic_r", "agent-r");
  RoguePeer::Attempt session = rogue.ConnectWith(*b_, write_only);
  ASSERT_TRUE(session.status.ok());
  const v1::BufferGrant& grant = session.response.grant();
  const absl::Status refused = rogue.Rdma(*session.connection, IBV_WR_RDMA_READ,
                                          grant.address(), grant.rkey(), 64);
  EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied) << refused;
  EXPECT_EQ(rogue.memory()[0], 0xee);
}

TEST_F(PeerIsolationTest, ReleasingARegistrationRevokesThePeersAccess) {
  TestBuffer buffer = b_->Register(4096, v1::ACCESS_READ_WRITE, 5);
  RoguePeer rogue(fabric_, "nic_r", "agent-r");
  RoguePeer::Attempt session = rogue.ConnectWith(*b_, buffer);
  ASSERT_TRUE(session.status.ok());
  const v1::BufferGrant grant = session.response.grant();
  ASSERT_TRUE(rogue
                  .Rdma(*session.connection, IBV_WR_RDMA_READ, grant.address(),
                        grant.rkey(), 64)
                  .ok());
  EXPECT_EQ(b_->backend<IbverbsBackend>().grant_count(), 1u);
  // The agent releases it (no op pins it): every MR of it is deregistered.
  std::weak_ptr<Registration> watch = buffer.registration;
  b_->Release(buffer);
  buffer = TestBuffer{};
  ASSERT_TRUE(watch.expired());
  EXPECT_EQ(b_->backend<IbverbsBackend>().grant_count(), 0u);
  const absl::Status refused = rogue.Rdma(*session.connection, IBV_WR_RDMA_READ,
                                          grant.address(), grant.rkey(), 64);
  EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied) << refused;
}

TEST_F(PeerIsolationTest, GrantsAndSessionsAreBounded) {
  IbverbsOptions small = FastOptions();
  small.max_responders = 1;
  small.max_grants_per_peer = 2;
  auto c = SoftIbverbsAgent(fabric_, "agent-c", "nic_a", small);
  ASSERT_NE(c, nullptr);
  std::vector<TestBuffer> buffers;
  for (uint8_t i = 0; i < 3; ++i) {
    buffers.push_back(c->Register(4096, v1::ACCESS_READ_WRITE, i));
  }
  RoguePeer rogue(fabric_, "nic_r", "agent-r");
  RoguePeer::Attempt session = rogue.ConnectWith(*c, buffers[0]);
  ASSERT_TRUE(session.status.ok());
  v1::GrantBufferResponse response;
  const auto grant = [&](const TestBuffer& buffer) {
    return rogue.Grant(
        *c, session.response.session(), buffer.context->agent_epoch(),
        buffer.context->buffer_id(), buffer.context->token(), &response);
  };
  EXPECT_TRUE(grant(buffers[1]).ok());
  // Asking again for a granted buffer costs nothing.
  EXPECT_TRUE(grant(buffers[1]).ok());
  EXPECT_EQ(grant(buffers[2]).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(c->backend<IbverbsBackend>().grant_count(), 2u);
  // A second peer would be a second session: over the bound.
  RoguePeer second(fabric_, "nic_s", "agent-s");
  RoguePeer::Attempt refused = second.Connect(
      *c, buffers[2].context->agent_epoch(), buffers[2].context->buffer_id(),
      buffers[2].context->token());
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(c->backend<IbverbsBackend>().responder_count(), 1u);
}

// With several rails, each (peer rail, rail) pair is a session of its own:
// a PD on that rail's device. What one session was granted is no key on
// another rail's session, even for the same peer and buffer.
TEST_F(PeerIsolationTest, ASessionOnOneRailGrantsNothingOnAnother) {
  for (const char* name : {"nic_b2", "nic_b3"}) {
    SoftDeviceConfig config;
    config.name = name;
    ASSERT_TRUE(fabric_.AddDevice(config).ok());
  }
  auto c = SoftIbverbsAgent(fabric_, "agent-c",
                            std::vector<std::string>({"nic_b2", "nic_b3"}),
                            FastOptions());
  ASSERT_NE(c, nullptr);
  TestBuffer buffer = c->Register(4096, v1::ACCESS_READ_WRITE, 11);
  const std::vector<uint8_t> before = Snapshot(buffer);
  RoguePeer rogue(fabric_, "nic_r", "agent-r");
  const auto connect = [&](const std::string& device) {
    return rogue.Connect(*c, buffer.context->agent_epoch(),
                         buffer.context->buffer_id(), buffer.context->token(),
                         device);
  };
  RoguePeer::Attempt first = connect("nic_b2");
  RoguePeer::Attempt second = connect("nic_b3");
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  ASSERT_TRUE(second.status.ok()) << second.status.error_message();
  EXPECT_EQ(first.response.responder().device(), "nic_b2");
  EXPECT_EQ(second.response.responder().device(), "nic_b3");
  EXPECT_EQ(c->backend<IbverbsBackend>().responder_count(), 2u);
  EXPECT_EQ(c->backend<IbverbsBackend>().grant_count(), 2u);
  // Each rkey works on its own session's QP...
  ASSERT_TRUE(rogue
                  .Rdma(*second.connection, IBV_WR_RDMA_READ, AddressOf(buffer),
                        second.response.grant().rkey(), 64)
                  .ok());
  // ...and not on the other's.
  std::fill(rogue.memory().begin(), rogue.memory().end(), 0xee);
  const absl::Status refused =
      rogue.Rdma(*second.connection, IBV_WR_RDMA_WRITE, AddressOf(buffer),
                 first.response.grant().rkey(), 64);
  EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied) << refused;
  EXPECT_EQ(Snapshot(buffer), before);
  // A rail the agent does not have is refused like an unknown device.
  RoguePeer::Attempt none = connect("nic_b");
  EXPECT_EQ(none.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(none.status.error_message().find("nic_b2:1, nic_b3:1"),
            std::string::npos)
      << none.status.error_message();
}

// A stranger's forged context naming a buffer id this agent already holds a
// grant for (with another context's token) does not ride on that grant.
TEST_F(PeerIsolationTest, CachedGrantNeedsTheTokenThatEarnedIt) {
  auto a = SoftIbverbsAgent(fabric_, "agent-a", "nic_a", FastOptions());
  TestBuffer local = a->Register(4096, v1::ACCESS_READ_WRITE, 6);
  TestBuffer remote = b_->Register(4096, v1::ACCESS_READ_WRITE, 7);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  ASSERT_TRUE(a->backend<IbverbsBackend>()
                  .Submit({MakeOp(0, v1::OP_TYPE_READ_INTO_LOCAL, local, 0, 64,
                                  remote, 0)},
                          deadline)[0]
                  .ok());
  auto forged = std::make_shared<v1::RemoteBuffer>(*remote.context);
  forged->set_token("forged-token");
  TestBuffer forged_buffer{remote.registration, forged};
  const std::vector<uint8_t> before = Snapshot(remote);
  const auto results = a->backend<IbverbsBackend>().Submit(
      {MakeOp(0, v1::OP_TYPE_WRITE_FROM_LOCAL, local, 0, 64, forged_buffer, 0),
       MakeOp(1, v1::OP_TYPE_READ_INTO_LOCAL, local, 0, 64, remote, 0)},
      deadline);
  EXPECT_EQ(results[0].code(), absl::StatusCode::kNotFound) << results[0];
  EXPECT_TRUE(results[1].ok()) << results[1];  // the real context still works
  EXPECT_EQ(Snapshot(remote), before);
  EXPECT_EQ(a->backend<IbverbsBackend>().connections_established(), 1u);
}

// A peer answering this agent's handshake (here: a fake Peer service) gets a
// QP connected to this agent's requester QP. Through it, it cannot read or
// write this agent's memory, even knowing the exact key and address.
class RogueResponder : public v1::Peer::Service {
 public:
  explicit RogueResponder(RoguePeer* rogue) : rogue_(rogue) {}

  grpc::Status ConnectQueuePair(
      grpc::ServerContext*, const v1::ConnectQueuePairRequest* request,
      v1::ConnectQueuePairResponse* response) override {
    std::unique_ptr<QueuePairConnection> connection =
        rogue_->NewQueuePair(QueuePairConnection::Inbound::kAccept);
    const absl::Status connected = connection->ConnectTo(request->requester());
    if (!connected.ok()) {
      return grpc::Status(grpc::StatusCode::INTERNAL,
                          std::string(connected.message()));
    }
    *response->mutable_responder() = connection->local_endpoint();
    response->set_session(std::string(16, 'r'));
    v1::BufferGrant* grant = response->mutable_grant();
    grant->set_buffer_id(request->buffer_id());
    grant->set_rkey(rogue_->rkey());
    grant->set_address(reinterpret_cast<uint64_t>(rogue_->memory().data()));
    grant->set_size_bytes(kRogueBytes);
    absl::MutexLock lock(&mu_);
    connection_ = std::move(connection);
    return grpc::Status::OK;
  }

  // Hangs until Unblock() (at most 10 s): a peer slow to grant.
  grpc::Status GrantBuffer(grpc::ServerContext*, const v1::GrantBufferRequest*,
                           v1::GrantBufferResponse*) override {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&unblocked_), absl::Seconds(10));
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "too slow");
  }
  void Unblock() {
    absl::MutexLock lock(&mu_);
    unblocked_ = true;
  }

  // The QP of the last handshake, connected to the requester's.
  std::unique_ptr<QueuePairConnection> TakeConnection() {
    absl::MutexLock lock(&mu_);
    return std::move(connection_);
  }

 private:
  RoguePeer* const rogue_;
  absl::Mutex mu_;
  std::unique_ptr<QueuePairConnection> connection_ ABSL_GUARDED_BY(mu_);
  bool unblocked_ ABSL_GUARDED_BY(mu_) = false;
};

// A fake agent serving `service` on a listener of its own, and contexts of
// its buffers pointing at it.
struct FakeAgent {
  FakeAgent(RoguePeer& rogue, grpc::Service* service) {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port);
    builder.RegisterService(service);
    server = builder.BuildAndStart();
    EXPECT_NE(server, nullptr);
    address = absl::StrCat("127.0.0.1:", port);
    gid = std::string(reinterpret_cast<const char*>(rogue.local().gid.raw), 16);
  }
  ~FakeAgent() { server->Shutdown(); }

  TestBuffer Context(uint64_t buffer_id) const {
    auto context = std::make_shared<v1::RemoteBuffer>();
    context->set_agent_id("agent-rogue");
    context->set_agent_epoch(99);
    context->set_buffer_id(buffer_id);
    context->set_size_bytes(kRogueBytes);
    context->set_access(v1::ACCESS_READ_WRITE);
    context->set_token("rogue-token");
    v1::BackendEndpoint* endpoint = context->add_endpoints();
    endpoint->set_backend("ibverbs");
    v1::IbverbsEndpoint* ib = endpoint->mutable_ibverbs();
    ib->set_device("nic_r");
    ib->set_port(1);
    ib->set_gid(gid);
    ib->set_peer_address(address);
    return TestBuffer{nullptr, context};
  }

  std::unique_ptr<grpc::Server> server;
  std::string address;
  std::string gid;
};

TEST_F(PeerIsolationTest, RogueResponderCannotReachTheRequestersMemory) {
  RoguePeer rogue(fabric_, "nic_r", "agent-rogue");
  RogueResponder service(&rogue);
  service.Unblock();
  FakeAgent fake(rogue, &service);
  // A context the rogue made up, pointing at itself.
  const TestBuffer rogue_buffer = fake.Context(1);

  for (const ibv_wr_opcode opcode : {IBV_WR_RDMA_WRITE, IBV_WR_RDMA_READ}) {
    SCOPED_TRACE(opcode == IBV_WR_RDMA_WRITE ? "rogue writes" : "rogue reads");
    // A fresh agent each time: the refused access also breaks its QP (RC
    // semantics), which its next Submit would only find out by failing.
    auto a = SoftIbverbsAgent(fabric_, "agent-a", "nic_a", FastOptions());
    TestBuffer local = a->Register(4096, v1::ACCESS_READ_WRITE, 8);
    const std::vector<uint8_t> before = Snapshot(local);
    // The agent writes to the rogue: the rogue's QP is then connected to
    // the agent's requester QP, which stays up.
    ASSERT_TRUE(a->backend<IbverbsBackend>()
                    .Submit({MakeOp(0, v1::OP_TYPE_WRITE_FROM_LOCAL, local, 0,
                                    64, rogue_buffer, 0)},
                            absl::Now() + absl::Seconds(10))[0]
                    .ok());
    EXPECT_EQ(0, std::memcmp(rogue.memory().data(), local.bytes(), 64));
    std::unique_ptr<QueuePairConnection> back = service.TakeConnection();
    ASSERT_NE(back, nullptr);
    std::fill(rogue.memory().begin(), rogue.memory().end(), 0x5a);
    // The exact lkey and address of the agent's buffer.
    const absl::Status refused =
        rogue.Rdma(*back, opcode, AddressOf(local),
                   IbverbsBackendProbe::LocalKey(a->backend<IbverbsBackend>(),
                                                 *local.registration),
                   64);
    EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied) << refused;
    EXPECT_EQ(Snapshot(local), before);
    EXPECT_EQ(rogue.memory()[0], 0x5a);
  }
}

// A Submit cancelled while a peer is slow to answer GrantBuffer returns at
// once with CANCELLED, not when the peer answers.
TEST_F(PeerIsolationTest, CancellationCutsAGrantRequestShort) {
  RoguePeer rogue(fabric_, "nic_r", "agent-rogue");
  RogueResponder service(&rogue);
  FakeAgent fake(rogue, &service);
  auto a = SoftIbverbsAgent(fabric_, "agent-a", "nic_a", FastOptions());
  TestBuffer local = a->Register(4096, v1::ACCESS_READ_WRITE, 9);
  // Buffer 1 is granted by the handshake; buffer 2 needs GrantBuffer.
  const TestBuffer first = fake.Context(1);
  const TestBuffer second = fake.Context(2);
  Cancellation cancellation;
  std::thread canceller([&] {
    absl::SleepFor(absl::Milliseconds(300));
    cancellation.Cancel(absl::CancelledError("client went away"));
  });
  const absl::Time start = absl::Now();
  const auto results = a->backend<IbverbsBackend>().Submit(
      {MakeOp(0, v1::OP_TYPE_WRITE_FROM_LOCAL, local, 0, 64, first, 0),
       MakeOp(1, v1::OP_TYPE_WRITE_FROM_LOCAL, local, 0, 64, second, 0)},
      StopToken(absl::Now() + absl::Seconds(30), &cancellation));
  const absl::Duration took = absl::Now() - start;
  canceller.join();
  service.Unblock();
  EXPECT_TRUE(results[0].ok()) << results[0];
  EXPECT_EQ(results[1].code(), absl::StatusCode::kCancelled) << results[1];
  EXPECT_LT(took, absl::Seconds(3));
}

}  // namespace
}  // namespace rdma_agent::ibverbs

// Responder sessions as a peer holding a token can and cannot steer them:
// sessions are named by the handle the responder issued, never by the
// agent id a caller claims; they are bounded per caller address and in
// total, expire when idle, and go with the registrations that admitted
// them. Peers are played with their own soft-NIC queue pairs and calls to
// the backend's responder half with a chosen caller address.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "backends/ibverbs/connection.h"
#include "backends/ibverbs/ibverbs_backend.h"
#include "backends/ibverbs/soft/soft_verbs.h"
#include "backends/testing/harness.h"
#include "backends/testing/ibverbs_agent.h"
#include "gtest/gtest.h"
#include "tests/testing/eventually.h"

namespace rdma_agent::ibverbs {
namespace {

using ::rdma_agent::testing::Eventually;
using ::rdma_agent::testing::MakeOp;
using ::rdma_agent::testing::SoftIbverbsAgent;
using ::rdma_agent::testing::TestAgent;
using ::rdma_agent::testing::TestBuffer;
using verbs::SoftDeviceConfig;
using verbs::SoftFabric;

constexpr size_t kPeerBytes = 4096;

IbverbsOptions FastOptions() {
  IbverbsOptions options;
  options.qp.timeout = 8;  // ~1 ms per try
  options.qp.retry_cnt = 2;
  return options;
}

// A peer that does not run the agent's code: its own device, memory and
// queue pairs, calling the target's responder half as if from `source`.
class Caller {
 public:
  Caller(SoftFabric& fabric, const std::string& device, std::string agent_id,
         std::string source)
      : agent_id_(std::move(agent_id)),
        source_(std::move(source)),
        memory_(kPeerBytes, 0xee) {
    verbs_ = fabric.MakeVerbs({device});
    device_ = std::move(*verbs_->OpenDevice(device));
    pd_ = std::move(*device_->AllocateProtectionDomain());
    mr_ = std::move(*pd_->RegisterMemory(memory_.data(), memory_.size(),
                                         IBV_ACCESS_LOCAL_WRITE));
    local_.device = device_.get();
    local_.pd = pd_.get();
    local_.port = 1;
    local_.lid = device_->QueryPort(1)->lid;
    local_.gid = *device_->QueryGid(1, 0);
    local_.global_routing = true;
  }

  struct Session {
    absl::Status status;
    v1::ConnectQueuePairResponse response;
    std::unique_ptr<QueuePairConnection> connection;
  };

  // ConnectQueuePair proving `buffer`, claiming `agent_id_` and the
  // requester rail `device`:1, reconnecting `session` when not empty.
  Session Connect(TestAgent& target, const TestBuffer& buffer,
                  const std::string& session = "",
                  const std::string& device = "nic_x") {
    Session result;
    QueuePairParams params;
    params.mtu_bytes = 1024;
    params.timeout = 8;
    params.retry_cnt = 2;
    params.sq_depth = 16;
    auto created = QueuePairConnection::Create(
        local_, params, absl::Microseconds(50), absl::Seconds(5),
        QueuePairConnection::Inbound::kRefuse);
    EXPECT_TRUE(created.ok()) << created.status();
    if (!created.ok()) return result;
    v1::ConnectQueuePairRequest request;
    request.set_agent_id(agent_id_);
    request.set_agent_epoch(1);
    request.set_expected_epoch(buffer.context->agent_epoch());
    request.set_remote_device(
        target.backend<IbverbsBackend>().transport_info().devices(0).name());
    *request.mutable_requester() = (*created)->local_endpoint();
    // The rail it claims to call from: what the old session key used.
    request.mutable_requester()->set_device(device);
    request.set_buffer_id(buffer.context->buffer_id());
    request.set_token(buffer.context->token());
    request.set_session(session);
    auto answer =
        target.backend<IbverbsBackend>().AcceptQueuePair(request, source_);
    result.status = answer.status();
    if (!answer.ok()) return result;
    result.response = *answer;
    EXPECT_TRUE((*created)->ConnectTo(answer->responder()).ok());
    result.connection = std::move(*created);
    return result;
  }

  absl::Status Grant(TestAgent& target, const std::string& session,
                     const TestBuffer& buffer) {
    v1::GrantBufferRequest request;
    request.set_agent_id(agent_id_);
    request.set_expected_epoch(buffer.context->agent_epoch());
    request.set_session(session);
    request.set_buffer_id(buffer.context->buffer_id());
    request.set_token(buffer.context->token());
    return target.backend<IbverbsBackend>()
        .GrantBuffer(request, source_)
        .status();
  }

  // Reads the first `length` bytes the session's grant names into memory_.
  absl::Status Read(const Session& session, uint32_t length = 64) {
    auto tracker = std::make_shared<OpTracker>(1);
    ibv_sge sge = {};
    sge.addr = reinterpret_cast<uint64_t>(memory_.data());
    sge.length = length;
    sge.lkey = mr_->lkey();
    ibv_send_wr wr = {};
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_READ;
    wr.wr.rdma.remote_addr = session.response.grant().address();
    wr.wr.rdma.rkey = session.response.grant().rkey();
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    tracker->PostingFinished(
        0, session.connection->Post(wr, tracker, 0, nullptr, deadline));
    EXPECT_TRUE(tracker->WaitAllDone(deadline));
    return tracker->Results()[0];
  }

  const std::vector<uint8_t>& memory() const { return memory_; }

 private:
  const std::string agent_id_;
  const std::string source_;
  std::unique_ptr<verbs::Verbs> verbs_;
  std::unique_ptr<verbs::Device> device_;
  std::unique_ptr<verbs::ProtectionDomain> pd_;
  std::vector<uint8_t> memory_;
  std::unique_ptr<verbs::MemoryRegion> mr_;
  LocalPort local_;
};

class PeerSessionsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* name : {"nic_a", "nic_b", "nic_r", "nic_s", "nic_t"}) {
      SoftDeviceConfig config;
      config.name = name;
      ASSERT_TRUE(fabric_.AddDevice(config).ok());
    }
  }

  std::unique_ptr<TestAgent> StartB(IbverbsOptions options = FastOptions()) {
    return SoftIbverbsAgent(fabric_, "agent-b", "nic_b", options);
  }

  SoftFabric fabric_;
};

// A second token holder claiming the victim's agent id and rail gets a
// session of its own: the victim's QP, PD and grant keep working.
TEST_F(PeerSessionsTest, ForgedAgentIdDoesNotReachAnotherPeersSession) {
  auto b = StartB();
  ASSERT_NE(b, nullptr);
  TestBuffer victims = b->Register(kPeerBytes, v1::ACCESS_READ_WRITE, 1);
  TestBuffer attackers = b->Register(kPeerBytes, v1::ACCESS_READ_WRITE, 2);
  Caller victim(fabric_, "nic_r", "agent-a", "ipv4:10.0.0.1:4000");
  Caller attacker(fabric_, "nic_s", "agent-a", "ipv4:10.0.0.66:4000");

  Caller::Session session = victim.Connect(*b, victims);
  ASSERT_TRUE(session.status.ok()) << session.status;
  ASSERT_TRUE(victim.Read(session).ok());
  EXPECT_EQ(0, std::memcmp(victim.memory().data(), victims.bytes(), 64));

  // Same claimed agent id and rail, its own valid token.
  Caller::Session forged = attacker.Connect(*b, attackers);
  ASSERT_TRUE(forged.status.ok()) << forged.status;
  EXPECT_NE(forged.response.session(), session.response.session());
  EXPECT_EQ(b->backend<IbverbsBackend>().responder_count(), 2u)
      << "the forged agent id replaced the victim's session";
  EXPECT_EQ(b->backend<IbverbsBackend>().grant_count(), 2u);
  // The victim's QP and grant still work.
  const absl::Status read = victim.Read(session);
  EXPECT_TRUE(read.ok()) << read;

  // Guessing the victim's handle is a new session, never the victim's.
  Caller::Session guessed =
      attacker.Connect(*b, attackers, std::string(16, 'g'));
  ASSERT_TRUE(guessed.status.ok()) << guessed.status;
  EXPECT_NE(guessed.response.session(), session.response.session());
  EXPECT_TRUE(victim.Read(session).ok());
  // Nor can it be granted anything on the victim's session without the
  // handle.
  EXPECT_EQ(attacker.Grant(*b, std::string(16, 'g'), attackers).code(),
            absl::StatusCode::kNotFound);

  // The victim reconnects with its handle: same session, new QP.
  Caller::Session again =
      victim.Connect(*b, victims, session.response.session());
  ASSERT_TRUE(again.status.ok()) << again.status;
  EXPECT_EQ(again.response.session(), session.response.session());
  EXPECT_EQ(b->backend<IbverbsBackend>().responder_count(), 3u);
  EXPECT_TRUE(victim.Read(again).ok());
  // The attacker's sessions were untouched by it.
  EXPECT_TRUE(attacker.Read(forged).ok());
  EXPECT_TRUE(attacker.Grant(*b, forged.response.session(), victims).ok())
      << "a token holder may be granted on its own session";
}

// One token and one caller address cannot fill the table: past the
// per-source bound it is refused, naming the flag, and a new peer from
// elsewhere still connects.
TEST_F(PeerSessionsTest, OneTokenCannotLockOutNewPeers) {
  IbverbsOptions options = FastOptions();
  options.max_responders = 8;
  options.max_responders_per_source = 3;
  auto b = StartB(options);
  ASSERT_NE(b, nullptr);
  TestBuffer leaked = b->Register(kPeerBytes, v1::ACCESS_READ, 3);
  TestBuffer shared = b->Register(kPeerBytes, v1::ACCESS_READ, 4);
  Caller attacker(fabric_, "nic_s", "agent-x", "ipv4:10.0.0.66:4000");
  size_t admitted = 0;
  absl::Status refused;
  for (int i = 0; i < 20; ++i) {
    Caller::Session session =
        attacker.Connect(*b, leaked, "", absl::StrCat("nic_", i));
    if (session.status.ok()) {
      ++admitted;
    } else {
      refused = session.status;
    }
  }
  EXPECT_EQ(admitted, 3u);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(),
                                "--ibverbs_max_responders_per_source"))
      << refused;
  // The same attacker from another port of the same host is the same
  // source.
  Caller other_port(fabric_, "nic_t", "agent-y", "ipv4:10.0.0.66:4999");
  EXPECT_EQ(other_port.Connect(*b, leaked).status.code(),
            absl::StatusCode::kResourceExhausted);

  // A new peer elsewhere gets in.
  Caller newcomer(fabric_, "nic_r", "agent-c", "ipv4:10.0.0.2:4000");
  Caller::Session session = newcomer.Connect(*b, shared);
  ASSERT_TRUE(session.status.ok()) << session.status;
  EXPECT_TRUE(newcomer.Read(session).ok());
  EXPECT_EQ(b->backend<IbverbsBackend>().responder_count(), 4u);
}

// A session goes (QP, PD, grants) once every registration proven for it is
// released.
TEST_F(PeerSessionsTest, SessionsGoWithTheBuffersThatAdmittedThem) {
  auto b = StartB();
  ASSERT_NE(b, nullptr);
  TestBuffer first = b->Register(kPeerBytes, v1::ACCESS_READ, 5);
  TestBuffer second = b->Register(kPeerBytes, v1::ACCESS_READ, 6);
  const size_t qps_before = fabric_.live_queue_pairs();
  Caller peer(fabric_, "nic_r", "agent-a", "ipv4:10.0.0.1:4000");
  Caller::Session session = peer.Connect(*b, first);
  ASSERT_TRUE(session.status.ok()) << session.status;
  ASSERT_TRUE(peer.Grant(*b, session.response.session(), second).ok());
  EXPECT_EQ(b->backend<IbverbsBackend>().responder_count(), 1u);

  // One of its buffers released: still admitted by the other.
  b->Release(first);
  first = TestBuffer{};
  EXPECT_EQ(b->backend<IbverbsBackend>().grant_count(), 1u);
  EXPECT_EQ(b->backend<IbverbsBackend>().responder_count(), 1u);

  b->Release(second);
  second = TestBuffer{};
  EXPECT_TRUE(Eventually([&] {
    return b->backend<IbverbsBackend>().responder_count() == 0;
  })) << "a session outlived every buffer that admitted it";
  // Its responder QP is gone too (the caller's own QP remains). The sweep
  // drops a session from its map first and destroys its QP after letting
  // go of its lock: the count follows a moment later.
  EXPECT_TRUE(Eventually([&] {
    return fabric_.live_queue_pairs() == qps_before + 1;
  })) << fabric_.live_queue_pairs()
      << " live QPs, " << qps_before + 1 << " expected";
}

// A session nobody names for the idle timeout goes; GrantBuffer keeps it.
TEST_F(PeerSessionsTest, IdleSessionsExpire) {
  IbverbsOptions options = FastOptions();
  options.responder_idle_timeout = absl::Milliseconds(400);
  auto b = StartB(options);
  ASSERT_NE(b, nullptr);
  TestBuffer buffer = b->Register(kPeerBytes, v1::ACCESS_READ, 7);
  Caller peer(fabric_, "nic_r", "agent-a", "ipv4:10.0.0.1:4000");
  Caller::Session session = peer.Connect(*b, buffer);
  ASSERT_TRUE(session.status.ok()) << session.status;
  EXPECT_EQ(session.response.session_idle_timeout_ms(), 400u);
  // Named every 100 ms for a second: kept.
  for (int i = 0; i < 10; ++i) {
    ASSERT_TRUE(peer.Grant(*b, session.response.session(), buffer).ok())
        << "round " << i;
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(peer.Read(session).ok());
  // Then left alone.
  EXPECT_TRUE(Eventually([&] {
    return b->backend<IbverbsBackend>().responder_count() == 0;
  })) << "an idle session was kept";
  EXPECT_EQ(peer.Grant(*b, session.response.session(), buffer).code(),
            absl::StatusCode::kNotFound);
}

// An agent using a session keeps it alive past the responder's idle
// timeout, and reconnects (with bytes intact) once it has let it expire.
TEST_F(PeerSessionsTest, RequesterKeepsItsSessionAndComesBackAfterExpiry) {
  IbverbsOptions options = FastOptions();
  options.responder_idle_timeout = absl::Milliseconds(600);
  auto b = StartB(options);
  // Its own lanes expire before the responder's session would.
  IbverbsOptions requester = FastOptions();
  requester.requester_idle_timeout = absl::Milliseconds(300);
  auto a = SoftIbverbsAgent(fabric_, "agent-a", "nic_a", requester);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  TestBuffer local = a->Register(kPeerBytes, v1::ACCESS_READ_WRITE, 8);
  TestBuffer remote = b->Register(kPeerBytes, v1::ACCESS_READ_WRITE, 9);
  const auto read = [&] {
    return a->backend<IbverbsBackend>().Submit(
        {MakeOp(0, v1::OP_TYPE_READ_INTO_LOCAL, local, 0, kPeerBytes, remote,
                0)},
        absl::Now() + absl::Seconds(10))[0];
  };
  for (int i = 0; i < 12; ++i) {
    const absl::Status status = read();
    ASSERT_TRUE(status.ok()) << "round " << i << ": " << status;
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_EQ(a->backend<IbverbsBackend>().connections_established(), 1u);
  EXPECT_EQ(b->backend<IbverbsBackend>().responder_count(), 1u);
  EXPECT_EQ(0, std::memcmp(local.bytes(), remote.bytes(), kPeerBytes));

  ASSERT_TRUE(Eventually(
      [&] { return b->backend<IbverbsBackend>().responder_count() == 0; }));
  std::memset(local.bytes(), 0, kPeerBytes);
  // The first Submit after may find its QP gone; the next one reconnects.
  absl::Status status = read();
  if (!status.ok()) status = read();
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_EQ(0, std::memcmp(local.bytes(), remote.bytes(), kPeerBytes));
  EXPECT_EQ(b->backend<IbverbsBackend>().responder_count(), 1u);
}

// A port nothing listens on (bound, then closed): dialling it is refused.
int ClosedPort() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address = {};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)),
            0);
  socklen_t length = sizeof(address);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  ::close(fd);
  return ntohs(address.sin_port);
}

// Contexts a local caller forges, each naming another agent at an address
// nothing answers, leave at most the bound of requester state, and it
// goes when idle; real peers still work.
TEST_F(PeerSessionsTest, ForgedContextsDoNotGrowRequesterState) {
  IbverbsOptions options = FastOptions();
  options.max_requester_peers = 4;
  options.requester_idle_timeout = absl::Milliseconds(500);
  options.connect_timeout = absl::Seconds(2);
  auto a = SoftIbverbsAgent(fabric_, "agent-a", "nic_a", options);
  auto b = StartB();
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  IbverbsBackend& backend = a->backend<IbverbsBackend>();
  TestBuffer local = a->Register(kPeerBytes, v1::ACCESS_READ_WRITE, 10);
  TestBuffer remote = b->Register(kPeerBytes, v1::ACCESS_READ_WRITE, 11);
  const auto read = [&](const TestBuffer& from) {
    return backend.Submit(
        {MakeOp(0, v1::OP_TYPE_READ_INTO_LOCAL, local, 0, kPeerBytes, from, 0)},
        absl::Now() + absl::Seconds(10))[0];
  };
  ASSERT_TRUE(read(remote).ok());
  const int closed = ClosedPort();
  for (int i = 0; i < 24; ++i) {
    TestBuffer forged = remote.WithContext([&](v1::RemoteBuffer& context) {
      context.set_agent_id(absl::StrCat("ghost-", i));
      context.mutable_endpoints(0)->mutable_ibverbs()->set_peer_address(
          absl::StrCat("127.0.0.1:", closed + (i % 3 == 0 ? 0 : i)));
    });
    const absl::Time start = absl::Now();
    const absl::Status status = read(forged);
    EXPECT_FALSE(status.ok());
    // Refused at once, or at worst one handshake's timeout.
    EXPECT_LT(absl::Now() - start, options.connect_timeout + absl::Seconds(1))
        << status;
    EXPECT_LE(backend.requester_peers(), 4u) << "after " << i + 1;
    EXPECT_LE(backend.peer_channels(), 4u) << "after " << i + 1;
  }
  // The real peer: its state may have been made room of, never refused.
  std::memset(local.bytes(), 0, kPeerBytes);
  const absl::Status status = read(remote);
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_EQ(0, std::memcmp(local.bytes(), remote.bytes(), kPeerBytes));
  // Idle state goes by itself.
  EXPECT_TRUE(Eventually([&] {
    return backend.requester_peers() == 0 && backend.peer_channels() == 0 &&
           backend.requester_count() == 0;
  })) << backend.requester_peers()
      << " peers, " << backend.peer_channels() << " channels";
}

// peer_links labels come from what peers claim: bounded, the rest summed
// under "other".
TEST_F(PeerSessionsTest, PeerLinkLabelsAreBounded) {
  IbverbsOptions options = FastOptions();
  options.max_peer_link_labels = 3;
  auto b = StartB(options);
  ASSERT_NE(b, nullptr);
  TestBuffer buffer = b->Register(kPeerBytes, v1::ACCESS_READ, 12);
  std::vector<std::unique_ptr<Caller>> callers;
  std::vector<Caller::Session> sessions;
  for (int i = 0; i < 10; ++i) {
    callers.push_back(
        std::make_unique<Caller>(fabric_, "nic_r", absl::StrCat("claimed-", i),
                                 absl::StrCat("ipv4:10.0.1.", i, ":4000")));
    sessions.push_back(callers.back()->Connect(*b, buffer));
    ASSERT_TRUE(sessions.back().status.ok()) << sessions.back().status;
  }
  size_t labels = 0;
  size_t links = 0;
  bool other = false;
  for (const auto& link : b->backend<IbverbsBackend>().peer_links()) {
    if (link.direction != "in") continue;
    ++labels;
    links += link.count;
    other |= link.peer == "other";
  }
  EXPECT_EQ(labels, 3u);
  EXPECT_TRUE(other);
  EXPECT_EQ(links, 10u);
}

}  // namespace
}  // namespace rdma_agent::ibverbs

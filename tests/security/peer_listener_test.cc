// The Peer listener is reachable by any host on the network: it listens only
// where peers are told to dial unless asked otherwise, and a stranger cannot
// make it take large messages. In-process agents on the software NIC (the
// real daemon has no NIC here, so it opens no Peer listener).

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "backends/ibverbs/ibverbs_backend.h"
#include "backends/ibverbs/soft/soft_verbs.h"
#include "backends/memory/memory_backend.h"
#include "common/unique_fd.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "rdma/agent/v1/peer.grpc.pb.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"
#include "tests/testing/agent_fixture.h"
#include "tests/testing/eventually.h"
#include "tests/testing/temp_dir.h"

namespace rdma_agent {
namespace {

using ::rdma_agent::ibverbs::IbverbsBackend;
using ::rdma_agent::ibverbs::IbverbsOptions;
using ::rdma_agent::testing::InProcessAgent;

// Options of an agent with one soft-NIC ibverbs backend (which serves the
// Peer service).
AgentOptions IbverbsAgentOptions(const std::string& peer_listen,
                                 const std::string& advertise_host) {
  auto fabric = std::make_shared<verbs::SoftFabric>();
  verbs::SoftDeviceConfig config;
  config.name = "nic_a";
  EXPECT_TRUE(fabric->AddDevice(config).ok());
  AgentOptions options;
  options.peer_listen = peer_listen;
  options.advertise_host = advertise_host;
  options.backends.push_back([fabric](const BackendEnvironment& env)
                                 -> absl::StatusOr<std::unique_ptr<Backend>> {
    auto backend =
        IbverbsBackend::Create(env, IbverbsOptions(), fabric->MakeVerbs({}));
    if (!backend.ok()) return backend.status();
    return std::unique_ptr<Backend>(std::move(*backend));
  });
  return options;
}

std::unique_ptr<InProcessAgent> StartAgent(const std::string& peer_listen,
                                           const std::string& advertise_host) {
  auto agent =
      InProcessAgent::Start(IbverbsAgentOptions(peer_listen, advertise_host));
  EXPECT_TRUE(agent.ok()) << agent.status();
  return agent.ok() ? std::move(*agent) : nullptr;
}

bool Accepts(const std::string& host, uint16_t port) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in address = {};
  address.sin_family = AF_INET;
  address.sin_port = htons(port);
  ::inet_pton(AF_INET, host.c_str(), &address.sin_addr);
  return ::connect(fd.get(), reinterpret_cast<sockaddr*>(&address),
                   sizeof(address)) == 0;
}

TEST(PeerListenerTest, ListensOnlyOnTheAdvertisedAddressByDefault) {
  auto agent = StartAgent("", "127.0.0.9");
  ASSERT_NE(agent, nullptr);
  EXPECT_EQ(agent->agent().peer_address(), "127.0.0.9:7470");
  EXPECT_TRUE(Accepts("127.0.0.9", 7470));
  EXPECT_FALSE(Accepts("127.0.0.1", 7470))
      << "the Peer listener also serves an address peers were not told of";
}

TEST(PeerListenerTest, ListenerOnOneAddressAdvertisesThatAddressAndItsPort) {
  // No --advertise_host: the detected host would be a closed port for a
  // listener bound to 127.0.0.7 only.
  testing::TempDir dir;
  AgentOptions options = IbverbsAgentOptions("127.0.0.7:0", "");
  options.runtime_dir = dir.path();
  auto agent = Agent::Start(std::move(options));
  ASSERT_TRUE(agent.ok()) << agent.status();
  const std::string address = (*agent)->peer_address();
  ASSERT_TRUE(absl::StartsWith(address, "127.0.0.7:")) << address;
  EXPECT_NE(address, "127.0.0.7:0") << "the port bound, not the one asked";
  EXPECT_TRUE(Accepts(
      "127.0.0.7",
      static_cast<uint16_t>(std::stoi(address.substr(address.find(':') + 1)))));

  // An operator's --advertise_host wins (NAT): it is told, not guessed.
  auto chosen = StartAgent("127.0.0.7:0", "10.20.30.40");
  ASSERT_NE(chosen, nullptr);
  EXPECT_TRUE(absl::StartsWith(chosen->agent().peer_address(), "10.20.30.40:"))
      << chosen->agent().peer_address();
}

TEST(PeerListenerTest, RefusesLargeMessagesFromStrangers) {
  auto agent = StartAgent("127.0.0.1:0", "127.0.0.1");
  ASSERT_NE(agent, nullptr);
  auto stub = v1::Peer::NewStub(grpc::CreateChannel(
      agent->agent().peer_address(), grpc::InsecureChannelCredentials()));
  v1::ConnectQueuePairRequest request;
  request.set_agent_id(std::string(1 << 20, 'x'));
  v1::ConnectQueuePairResponse response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(10));
  const grpc::Status status =
      stub->ConnectQueuePair(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << status.error_message();
  // A well-formed, small request is still answered (refused for its
  // missing proof, not for its size).
  request.set_agent_id("agent-x");
  grpc::ClientContext again;
  const grpc::Status small = stub->ConnectQueuePair(&again, request, &response);
  EXPECT_NE(small.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << small.error_message();
}

TEST(PeerListenerTest, PeerRpcsAreLoggedAtDebugWithTheCallersAddress) {
  auto agent = StartAgent("127.0.0.1:0", "127.0.0.1");
  ASSERT_NE(agent, nullptr);
  auto stream = std::make_shared<std::ostringstream>();
  auto previous = spdlog::default_logger();
  auto logger = std::make_shared<spdlog::logger>(
      "capture", std::make_shared<spdlog::sinks::ostream_sink_mt>(*stream));
  logger->set_level(spdlog::level::debug);
  spdlog::set_default_logger(logger);
  auto stub = v1::Peer::NewStub(grpc::CreateChannel(
      agent->agent().peer_address(), grpc::InsecureChannelCredentials()));
  // Well formed, with a guessed buffer id and token.
  v1::ConnectQueuePairRequest request;
  request.set_agent_id("agent-stranger");
  request.set_buffer_id(1);
  request.set_token(std::string(16, 'g'));
  request.mutable_requester()->set_qp_num(77);
  request.mutable_requester()->set_gid(std::string(16, '\1'));
  v1::ConnectQueuePairResponse response;
  grpc::ClientContext context;
  const grpc::Status status =
      stub->ConnectQueuePair(&context, request, &response);
  EXPECT_FALSE(status.ok());
  spdlog::set_default_logger(previous);
  const std::string log = stream->str();
  // gRPC sees the call on the listener's splice, whose Unix address names
  // the caller (daemon/peer_gate.h).
  EXPECT_TRUE(absl::StrContains(log,
                                "rdma.agent.v1.Peer/ConnectQueuePair from peer "
                                "unix-abstract:ipv4:127.0.0.1:"))
      << log;
  // The refusal itself is logged once, where it is decided, with the
  // requester: a warning naming the agent and its address.
  EXPECT_TRUE(absl::StrContains(
      log, "refused a request from agent agent-stranger at ipv4:127.0.0.1:"))
      << log;
}

// A TCP connection to 127.0.0.1:`port` from `source` (another loopback
// address: another host as the listener sees it); -1 when refused.
int ConnectFrom(const std::string& source, uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in local = {};
  local.sin_family = AF_INET;
  ::inet_pton(AF_INET, source.c_str(), &local.sin_addr);
  sockaddr_in remote = {};
  remote.sin_family = AF_INET;
  remote.sin_port = htons(port);
  ::inet_pton(AF_INET, "127.0.0.1", &remote.sin_addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&local), sizeof(local)) != 0 ||
      ::connect(fd, reinterpret_cast<sockaddr*>(&remote), sizeof(remote)) !=
          0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// True once the other side closed `fd` (what it sent before is read and
// dropped).
bool ClosedByPeer(int fd) {
  char buffer[4096];
  while (true) {
    const ssize_t n = ::recv(fd, buffer, sizeof(buffer), MSG_DONTWAIT);
    if (n == 0) return true;
    if (n < 0) return errno != EAGAIN && errno != EWOULDBLOCK;
  }
}

// A stranger opens many connections from one address, each a gRPC call
// that never finishes arriving (the HTTP/2 preface, SETTINGS, then half a
// HEADERS frame). The listener keeps at most its per-source cap of them,
// closes each one that has not delivered a request within the arrival
// limit, and a real peer handshakes and moves bytes all the while.
TEST(PeerListenerTest, HalfSentCallsFromOneSourceDoNotLockOutPeers) {
  auto fabric = std::make_shared<verbs::SoftFabric>();
  for (const char* name : {"nic_a", "nic_b"}) {
    verbs::SoftDeviceConfig config;
    config.name = name;
    ASSERT_TRUE(fabric->AddDevice(config).ok());
  }
  const auto start = [&](const std::string& device, PeerListenerLimits limits) {
    AgentOptions options;
    options.peer_listen = "127.0.0.1:0";
    options.advertise_host = "127.0.0.1";
    options.peer_listener = limits;
    options.backends.push_back([fabric, device](const BackendEnvironment& env)
                                   -> absl::StatusOr<std::unique_ptr<Backend>> {
      IbverbsOptions ib;
      ib.qp.timeout = 8;
      ib.qp.retry_cnt = 2;
      auto backend =
          IbverbsBackend::Create(env, ib, fabric->MakeVerbs({device}));
      if (!backend.ok()) return backend.status();
      return std::unique_ptr<Backend>(std::move(*backend));
    });
    auto agent = InProcessAgent::Start(std::move(options));
    EXPECT_TRUE(agent.ok()) << agent.status();
    return agent.ok() ? std::move(*agent) : nullptr;
  };
  PeerListenerLimits limits;
  limits.max_connections = 16;
  limits.max_connections_per_source = 4;
  limits.call_arrival_timeout = absl::Seconds(2);
  auto a = start("nic_a", PeerListenerLimits());
  auto b = start("nic_b", limits);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const std::string address = b->agent().peer_address();
  const auto port =
      static_cast<uint16_t>(std::stoi(address.substr(address.rfind(':') + 1)));

  constexpr int kStrangers = 40;
  std::vector<UniqueFd> strangers;
  // The preface, an empty SETTINGS frame, and the first 9 bytes of a
  // HEADERS frame announcing 64 bytes that never come.
  const std::string half_call =
      std::string("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") +
      std::string("\x00\x00\x00\x04\x00\x00\x00\x00\x00", 9) +
      std::string("\x00\x00\x40\x01\x04\x00\x00\x00\x01", 9);
  for (int i = 0; i < kStrangers; ++i) {
    UniqueFd fd(ConnectFrom("127.0.0.2", port));
    ASSERT_TRUE(fd) << "the kernel refused connection " << i;
    (void)::send(fd.get(), half_call.data(), half_call.size(), MSG_NOSIGNAL);
    strangers.push_back(std::move(fd));
  }
  const absl::Time opened = absl::Now();
  // All but the per-source cap are closed at once.
  ASSERT_TRUE(testing::Eventually(
      [&] {
        int closed = 0;
        for (const UniqueFd& fd : strangers) closed += ClosedByPeer(fd.get());
        return closed >= kStrangers - 4;
      },
      absl::Seconds(1)))
      << "the listener keeps more than 4 connections from one address";

  // Meanwhile a real peer handshakes and writes.
  auto local = a->Allocate(4096);
  auto remote = b->Allocate(4096);
  ASSERT_TRUE(local.ok() && remote.ok());
  grpc::ClientContext context;
  v1::SubmitRequest request;
  v1::Op* op = request.add_ops();
  op->set_type(v1::OP_TYPE_WRITE_FROM_LOCAL);
  op->set_local_buffer_id(local->buffer_id());
  op->set_length(4096);
  op->set_remote_context(remote->remote_context());
  request.mutable_timeout()->set_seconds(10);
  v1::SubmitResponse response;
  ASSERT_TRUE(a->stub().Submit(&context, request, &response).ok());
  ASSERT_EQ(response.results_size(), 1);
  EXPECT_EQ(response.results(0).code(), 0) << response.results(0).message();
  EXPECT_EQ(response.results(0).backend(), "ibverbs");

  // The half-sent calls it kept are cut at the arrival limit.
  EXPECT_TRUE(testing::Eventually(
      [&] {
        for (const UniqueFd& fd : strangers) {
          if (!ClosedByPeer(fd.get())) return false;
        }
        return true;
      },
      absl::Seconds(8)))
      << "half-sent calls outlived the arrival limit";
  EXPECT_GE(absl::Now() - opened, absl::Milliseconds(1500))
      << "cut before their time";
}

}  // namespace
}  // namespace rdma_agent

// The Peer listener is reachable by any host on the network: it listens only
// where peers are told to dial unless asked otherwise, and a stranger cannot
// make it take large messages. In-process agents on the software NIC (the
// real daemon has no NIC here, so it opens no Peer listener).

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <memory>
#include <sstream>
#include <string>

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
  EXPECT_TRUE(absl::StrContains(
      log, "rdma.agent.v1.Peer/ConnectQueuePair from peer ipv4:127.0.0.1:"))
      << log;
  // The refusal itself is logged once, where it is decided, with the
  // requester: a warning naming the agent and its address.
  EXPECT_TRUE(absl::StrContains(
      log, "refused a request from agent agent-stranger at ipv4:127.0.0.1:"))
      << log;
}

}  // namespace
}  // namespace rdma_agent

// Mutual TLS on the Peer service: certificates are made at test time with
// the openssl CLI. Two agents with certificates from one CA move bytes over
// (soft) ibverbs; callers without a certificate, with one from another CA,
// or agents without TLS, are refused by the TLS handshake before any Peer
// method runs.
#include "backends/peer_tls.h"

#include <grpcpp/grpcpp.h>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "backends/ibverbs/ibverbs_backend.h"
#include "backends/ibverbs/soft/soft_verbs.h"
#include "gtest/gtest.h"
#include "rdma/agent/v1/peer.grpc.pb.h"
#include "tests/testing/agent_fixture.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/test_pki.h"

namespace rdma_agent {
namespace {

using ibverbs::IbverbsBackend;
using ibverbs::IbverbsOptions;
using testing::InProcessAgent;
using testing::TestPki;

constexpr uint64_t kSize = 64 << 10;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// TLS material of certificate `name` trusting `ca`.
PeerTls Tls(const TestPki& pki, const std::string& name, const std::string& ca,
            const std::string& server_name = "") {
  auto tls = LoadPeerTls(pki.Path(name + ".pem"), pki.Path(name + ".key"),
                         pki.Path(ca + ".pem"), server_name);
  EXPECT_TRUE(tls.ok()) << tls.status();
  return tls.ok() ? *tls : PeerTls();
}

class PeerTlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto dir = testing::MakeShortTempDir();
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = *dir;
    pki_ = std::make_unique<TestPki>(dir_);
    ASSERT_TRUE(pki_->MakeCa("ca")) << ReadFile(dir_ + "/openssl.log");
    ASSERT_TRUE(pki_->MakeCa("other_ca"));
    ASSERT_TRUE(pki_->MakeCert("agent", "ca", "IP:127.0.0.1"))
        << ReadFile(dir_ + "/openssl.log");
    // Valid only for a name, not for the address peers dial.
    ASSERT_TRUE(pki_->MakeCert("named", "ca", "DNS:rdma-agent"));
    ASSERT_TRUE(pki_->MakeCert("stranger", "other_ca", "IP:127.0.0.1"));
    for (const char* name : {"nic_a", "nic_b"}) {
      verbs::SoftDeviceConfig config;
      config.name = name;
      ASSERT_TRUE(fabric_->AddDevice(config).ok());
    }
  }
  void TearDown() override { testing::RemoveTree(dir_); }

  // An agent `agent_id` whose only backend is ibverbs on soft `device`.
  std::unique_ptr<InProcessAgent> StartAgent(const std::string& device,
                                             const PeerTls& tls,
                                             const std::string& agent_id) {
    AgentOptions options;
    options.agent_id = agent_id;
    options.peer_listen = "127.0.0.1:0";
    options.advertise_host = "127.0.0.1";
    options.peer_tls = tls;
    std::shared_ptr<verbs::SoftFabric> fabric = fabric_;
    options.backends.push_back([fabric, device](const BackendEnvironment& env)
                                   -> absl::StatusOr<std::unique_ptr<Backend>> {
      IbverbsOptions ib;
      ib.qp.timeout = 8;
      ib.qp.retry_cnt = 2;
      ib.connect_timeout = absl::Seconds(3);
      auto backend =
          IbverbsBackend::Create(env, ib, fabric->MakeVerbs({device}));
      if (!backend.ok()) return backend.status();
      return std::unique_ptr<Backend>(std::move(*backend));
    });
    auto agent = InProcessAgent::Start(std::move(options));
    EXPECT_TRUE(agent.ok()) << agent.status();
    return agent.ok() ? std::move(*agent) : nullptr;
  }

  static v1::OpResult WriteTo(InProcessAgent& from, uint64_t local,
                              const v1::RegisterResponse& remote) {
    grpc::ClientContext context;
    v1::SubmitRequest request;
    v1::Op* op = request.add_ops();
    op->set_type(v1::OP_TYPE_WRITE_FROM_LOCAL);
    op->set_local_buffer_id(local);
    op->set_length(kSize);
    op->set_remote_context(remote.remote_context());
    request.mutable_timeout()->set_seconds(10);
    v1::SubmitResponse response;
    const absl::Status status =
        FromGrpcStatus(from.stub().Submit(&context, request, &response));
    EXPECT_TRUE(status.ok()) << status;
    return response.results_size() == 1 ? response.results(0) : v1::OpResult();
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

  static void Fill(InProcessAgent& agent, uint64_t id, char seed) {
    grpc::ClientContext context;
    v1::WriteBufferRequest request;
    request.set_buffer_id(id);
    std::string data(kSize, '\0');
    for (uint64_t i = 0; i < kSize; ++i) {
      data[i] = static_cast<char>(seed + i * 7);
    }
    request.set_data(data);
    v1::WriteBufferResponse ignored;
    EXPECT_TRUE(agent.stub().WriteBuffer(&context, request, &ignored).ok());
  }

  // Agents a -> b: a writes a buffer into b's over ibverbs; the result.
  // Under mTLS an agent is who its certificate names: each one's id is its
  // certificate's name unless given.
  v1::OpResult MoveBytes(const PeerTls& a_tls, const PeerTls& b_tls,
                         bool* landed, const std::string& a_id = "agent",
                         const std::string& b_id = "agent") {
    auto a = StartAgent("nic_a", a_tls, a_id);
    auto b = StartAgent("nic_b", b_tls, b_id);
    EXPECT_TRUE(a != nullptr && b != nullptr);
    if (a == nullptr || b == nullptr) return v1::OpResult();
    auto local = a->Allocate(kSize);
    auto remote = b->Allocate(kSize);
    EXPECT_TRUE(local.ok() && remote.ok());
    Fill(*a, local->buffer_id(), 3);
    const v1::OpResult result = WriteTo(*a, local->buffer_id(), *remote);
    *landed =
        Contents(*b, remote->buffer_id()) == Contents(*a, local->buffer_id());
    return result;
  }

  // B's Peer address and a proof-less request for a raw client.
  static v1::ConnectQueuePairRequest StrangerRequest(
      const std::string& agent_id = "agent-stranger") {
    v1::ConnectQueuePairRequest request;
    request.set_agent_id(agent_id);
    request.set_expected_epoch(1);
    request.set_buffer_id(1);
    request.set_token("guess");
    v1::QueuePairEndpoint* side = request.mutable_requester();
    side->set_device("nic_x");
    side->set_gid(std::string(16, '\x01'));
    side->set_qp_num(4242);
    side->set_mtu_bytes(1024);
    return request;
  }

  static grpc::Status CallPeer(const std::string& address,
                               std::shared_ptr<grpc::ChannelCredentials> creds,
                               const std::string& agent_id = "agent-stranger") {
    auto stub = v1::Peer::NewStub(grpc::CreateChannel(address, creds));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(5));
    v1::ConnectQueuePairResponse response;
    return stub->ConnectQueuePair(&context, StrangerRequest(agent_id),
                                  &response);
  }

  std::string dir_;
  std::unique_ptr<TestPki> pki_;
  std::shared_ptr<verbs::SoftFabric> fabric_ =
      std::make_shared<verbs::SoftFabric>();
};

TEST_F(PeerTlsTest, TwoAgentsWithCertificatesFromOneCaMoveBytes) {
  bool landed = false;
  const v1::OpResult result =
      MoveBytes(Tls(*pki_, "agent", "ca"), Tls(*pki_, "agent", "ca"), &landed);
  EXPECT_EQ(result.code(), 0) << result.message();
  EXPECT_EQ(result.backend(), "ibverbs");
  EXPECT_TRUE(landed);
}

TEST_F(PeerTlsTest, ServerNameOverrideAcceptsACertificateForThatName) {
  bool landed = false;
  // The certificate names "rdma-agent", not 127.0.0.1: verified against the
  // configured name it passes...
  v1::OpResult result = MoveBytes(Tls(*pki_, "named", "ca", "rdma-agent"),
                                  Tls(*pki_, "named", "ca", "rdma-agent"),
                                  &landed, "named", "named");
  EXPECT_EQ(result.code(), 0) << result.message();
  EXPECT_TRUE(landed);
  // ...and against the address dialled it does not.
  result = MoveBytes(Tls(*pki_, "named", "ca"), Tls(*pki_, "named", "ca"),
                     &landed, "named", "named");
  EXPECT_EQ(result.code(), static_cast<int>(absl::StatusCode::kUnavailable))
      << result.message();
  EXPECT_FALSE(landed);
}

TEST_F(PeerTlsTest, AgentWithoutTlsOrFromAnotherCaCannotConnect) {
  bool landed = true;
  v1::OpResult result =
      MoveBytes(PeerTls(), Tls(*pki_, "agent", "ca"), &landed);
  EXPECT_EQ(result.code(), static_cast<int>(absl::StatusCode::kUnavailable))
      << result.message();
  EXPECT_FALSE(landed);
  landed = true;
  // The stranger trusts the right CA but presents another CA's certificate.
  result = MoveBytes(Tls(*pki_, "stranger", "ca"), Tls(*pki_, "agent", "ca"),
                     &landed);
  EXPECT_EQ(result.code(), static_cast<int>(absl::StatusCode::kUnavailable))
      << result.message();
  EXPECT_FALSE(landed);
}

TEST_F(PeerTlsTest, RawClientsWithoutAValidCertificateAreRefused) {
  auto b = StartAgent("nic_b", Tls(*pki_, "agent", "ca"), "agent");
  ASSERT_NE(b, nullptr);
  const std::string address = b->agent().peer_address();
  ASSERT_FALSE(address.empty());
  const std::string ca = ReadFile(pki_->Path("ca.pem"));

  // Plaintext.
  grpc::Status status = CallPeer(address, grpc::InsecureChannelCredentials());
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << status.error_message();
  // TLS without a client certificate.
  grpc::SslCredentialsOptions no_cert;
  no_cert.pem_root_certs = ca;
  status = CallPeer(address, grpc::SslCredentials(no_cert));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << status.error_message();
  // A client certificate from another CA.
  grpc::SslCredentialsOptions other_ca;
  other_ca.pem_root_certs = ca;
  other_ca.pem_cert_chain = ReadFile(pki_->Path("stranger.pem"));
  other_ca.pem_private_key = ReadFile(pki_->Path("stranger.key"));
  status = CallPeer(address, grpc::SslCredentials(other_ca));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << status.error_message();
  // Control: the CA's certificate gets through TLS to the service, which
  // then refuses the proof-less request itself.
  grpc::SslCredentialsOptions good;
  good.pem_root_certs = ca;
  good.pem_cert_chain = ReadFile(pki_->Path("agent.pem"));
  good.pem_private_key = ReadFile(pki_->Path("agent.key"));
  status = CallPeer(address, grpc::SslCredentials(good), "agent");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << status.error_message();
}

// Under mTLS the agent id a caller claims is the one its certificate names
// (subject CN, or a subjectAltName DNS name or URI): an agent whose
// certificate names another agent is refused before anything else.
TEST_F(PeerTlsTest, CertificateMustNameTheAgentIdItClaims) {
  ASSERT_TRUE(pki_->MakeCert("agent-a", "ca", "IP:127.0.0.1"));
  ASSERT_TRUE(pki_->MakeCert("agent-b", "ca", "IP:127.0.0.1"));
  // Names agent-a by a URI, with a CN of no agent.
  ASSERT_TRUE(pki_->MakeCert("uri-cert", "ca",
                             "IP:127.0.0.1,URI:spiffe://rdma/agent-u"));
  bool landed = true;
  // agent-a presenting agent-b's certificate (any valid certificate of the
  // CA): refused, nothing written.
  v1::OpResult result =
      MoveBytes(Tls(*pki_, "agent-b", "ca"), Tls(*pki_, "agent-b", "ca"),
                &landed, "agent-a", "agent-b");
  EXPECT_EQ(result.code(),
            static_cast<int>(absl::StatusCode::kPermissionDenied))
      << result.message();
  EXPECT_NE(result.message().find("agent-a"), std::string::npos)
      << result.message();
  EXPECT_FALSE(landed);
  // Each with its own: bytes move.
  result = MoveBytes(Tls(*pki_, "agent-a", "ca"), Tls(*pki_, "agent-b", "ca"),
                     &landed, "agent-a", "agent-b");
  EXPECT_EQ(result.code(), 0) << result.message();
  EXPECT_TRUE(landed);
  // A URI subjectAltName names the agent too.
  result = MoveBytes(Tls(*pki_, "uri-cert", "ca"), Tls(*pki_, "agent-b", "ca"),
                     &landed, "spiffe://rdma/agent-u", "agent-b");
  EXPECT_EQ(result.code(), 0) << result.message();
  EXPECT_TRUE(landed);

  // Raw calls: the claim is checked first, for every Peer method.
  auto b = StartAgent("nic_b", Tls(*pki_, "agent-b", "ca"), "agent-b");
  ASSERT_NE(b, nullptr);
  grpc::SslCredentialsOptions as_a;
  as_a.pem_root_certs = ReadFile(pki_->Path("ca.pem"));
  as_a.pem_cert_chain = ReadFile(pki_->Path("agent-a.pem"));
  as_a.pem_private_key = ReadFile(pki_->Path("agent-a.key"));
  const auto creds = grpc::SslCredentials(as_a);
  grpc::Status status = CallPeer(b->agent().peer_address(), creds, "agent-b");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED)
      << status.error_message();
  status = CallPeer(b->agent().peer_address(), creds, "agent-a");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << status.error_message();
  auto stub =
      v1::Peer::NewStub(grpc::CreateChannel(b->agent().peer_address(), creds));
  for (const char* method : {"GrantBuffer", "Notify"}) {
    SCOPED_TRACE(method);
    grpc::ClientContext context;
    grpc::Status answer;
    if (std::string(method) == "GrantBuffer") {
      v1::GrantBufferRequest request;
      request.set_agent_id("agent-b");
      v1::GrantBufferResponse response;
      answer = stub->GrantBuffer(&context, request, &response);
    } else {
      v1::NotifyRequest request;
      request.set_agent_id("agent-b");
      v1::NotifyResponse response;
      answer = stub->Notify(&context, request, &response);
    }
    EXPECT_EQ(answer.error_code(), grpc::StatusCode::PERMISSION_DENIED)
        << answer.error_message();
  }
}

TEST(PeerTlsFilesTest, AllThreeFilesOrNone) {
  EXPECT_FALSE(LoadPeerTls("", "", "")->enabled());
  EXPECT_EQ(LoadPeerTls("/x.pem", "", "").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LoadPeerTls("", "", "", "name").status().code(),
            absl::StatusCode::kInvalidArgument);
  const auto missing = LoadPeerTls("/nonexistent/c.pem", "/nonexistent/k.pem",
                                   "/nonexistent/ca.pem");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("/nonexistent/c.pem"),
            std::string::npos);
}

}  // namespace
}  // namespace rdma_agent

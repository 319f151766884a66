// Admission in one in-process agent: what a user may hold is charged before
// the memory exists and given back exactly when it goes; refusals are
// RESOURCE_EXHAUSTED naming the limit's flag, and leave nothing behind.

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "common/fd_message.h"
#include "common/unique_fd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "rdma/agent/v1/attach.pb.h"
#include "tests/testing/agent_fixture.h"

namespace rdma_agent {
namespace {

using ::rdma_agent::FromGrpcStatus;
using ::rdma_agent::testing::InProcessAgent;
using ::testing::HasSubstr;

class AdmissionTest : public ::testing::Test {
 protected:
  void Start(AgentOptions options) {
    auto fixture = InProcessAgent::Start(std::move(options));
    ASSERT_TRUE(fixture.ok()) << fixture.status();
    fixture_ = std::move(*fixture);
  }

  // Attaches a sealed memfd of `size` bytes: the response (token or error).
  v1::AttachResponse Attach(uint64_t size) {
    UniqueFd sock(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    struct sockaddr_un addr = {};
    addr.sun_family = AF_UNIX;
    const std::string& path = fixture_->agent().attach_socket_path();
    std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
    EXPECT_EQ(::connect(sock.get(), reinterpret_cast<struct sockaddr*>(&addr),
                        sizeof(addr)),
              0);
    UniqueFd memfd(::memfd_create("test", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    EXPECT_EQ(::ftruncate(memfd.get(), static_cast<off_t>(size)), 0);
    EXPECT_EQ(::fcntl(memfd.get(), F_ADD_SEALS, F_SEAL_SHRINK), 0);
    v1::AttachRequest request;
    request.mutable_attach();
    EXPECT_TRUE(SendFdMessage(sock.get(), request, memfd.get()).ok());
    v1::AttachResponse response;
    EXPECT_TRUE(ReceiveFdMessage(sock.get(), &response).ok());
    return response;
  }

  absl::Status RegisterToken(const std::string& token) {
    grpc::ClientContext context;
    v1::RegisterRequest request;
    request.set_attach_token(token);
    request.set_access(v1::ACCESS_READ_WRITE);
    v1::RegisterResponse response;
    return FromGrpcStatus(
        fixture_->stub().Register(&context, request, &response));
  }

  absl::Status Release(uint64_t id) {
    grpc::ClientContext context;
    v1::ReleaseRequest request;
    request.set_buffer_id(id);
    v1::ReleaseResponse response;
    return FromGrpcStatus(
        fixture_->stub().Release(&context, request, &response));
  }

  std::unique_ptr<InProcessAgent> fixture_;
};

TEST_F(AdmissionTest, BytesAreChargedUntilTheMemoryGoes) {
  AgentOptions options;
  options.quotas.bytes.per_user = 8192;
  options.quotas.bytes.total = 1 << 20;
  Start(std::move(options));
  auto first = fixture_->Allocate(8192);
  ASSERT_TRUE(first.ok()) << first.status();
  auto refused = fixture_->Allocate(1);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("--max_registered_bytes_per_user"));
  // Attached memory counts the same, and is refused before it is mapped.
  const v1::AttachResponse attached = Attach(4096);
  EXPECT_EQ(attached.code(),
            static_cast<int>(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(attached.message(), HasSubstr("--max_registered_bytes_per_user"));

  ASSERT_TRUE(Release(first->buffer_id()).ok());
  EXPECT_TRUE(fixture_->Allocate(8192).ok());
}

TEST_F(AdmissionTest, ParkedBytesStayChargedOnceRegistered) {
  AgentOptions options;
  options.quotas.bytes.per_user = 8192;
  options.quotas.bytes.total = 1 << 20;
  Start(std::move(options));
  const v1::AttachResponse attached = Attach(8192);
  ASSERT_EQ(attached.code(), 0) << attached.message();
  // Parked: the bytes are taken already.
  EXPECT_EQ(fixture_->Allocate(1).status().code(),
            absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(RegisterToken(attached.attach_token()).ok());
  // Registered: still taken.
  EXPECT_EQ(fixture_->Allocate(1).status().code(),
            absl::StatusCode::kResourceExhausted);
}

TEST_F(AdmissionTest, ARefusedRegisterEndsItsAttachment) {
  AgentOptions options;
  options.quotas.registrations.per_user = 1;
  options.quotas.registrations.total = 4;
  Start(std::move(options));
  auto held = fixture_->Allocate(4096);
  ASSERT_TRUE(held.ok()) << held.status();
  const v1::AttachResponse attached = Attach(4096);
  ASSERT_EQ(attached.code(), 0) << attached.message();

  const absl::Status refused = RegisterToken(attached.attach_token());
  ASSERT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.message(), HasSubstr("--max_buffers_per_user"));
  // The token went with the refusal: nothing stays parked for it.
  ASSERT_TRUE(Release(held->buffer_id()).ok());
  EXPECT_EQ(RegisterToken(attached.attach_token()).code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(fixture_->Allocate(4096).ok());
}

TEST_F(AdmissionTest, ParkedAttachmentsAreCappedPerUser) {
  AgentOptions options;
  options.quotas.pending_attach.per_user = 2;
  options.quotas.pending_attach.total = 8;
  Start(std::move(options));
  const v1::AttachResponse first = Attach(4096);
  ASSERT_EQ(first.code(), 0) << first.message();
  ASSERT_EQ(Attach(4096).code(), 0);
  const v1::AttachResponse refused = Attach(4096);
  EXPECT_EQ(refused.code(),
            static_cast<int>(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(refused.message(), HasSubstr("--max_pending_attach_per_user"));
  // Registering one frees its parking place.
  ASSERT_TRUE(RegisterToken(first.attach_token()).ok());
  EXPECT_EQ(Attach(4096).code(), 0);
}

TEST_F(AdmissionTest, DefaultsAreDerivedAndFilledIn) {
  Start(AgentOptions{});
  const AgentOptions& in_force = fixture_->agent().options();
  EXPECT_GT(in_force.quotas.registrations.total, 0u);
  EXPECT_LE(in_force.quotas.registrations.per_user,
            in_force.quotas.registrations.total / 4);
  EXPECT_LE(in_force.quotas.pending_attach.per_user,
            in_force.quotas.pending_attach.total / 4);
  EXPECT_LE(in_force.quotas.bytes.per_user, in_force.quotas.bytes.total / 4);
  EXPECT_EQ(in_force.quotas.attach_connections.total, 256u);
  EXPECT_EQ(in_force.quotas.attach_connections.per_user, 64u);
}

}  // namespace
}  // namespace rdma_agent

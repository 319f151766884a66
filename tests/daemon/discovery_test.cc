// What grpcurl relies on: server reflection lists the API, and the standard
// health service answers SERVING. Called with raw bytes so that the test does
// not depend on generated code for those services.
#include <string>

#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/byte_buffer.h"
#include "gtest/gtest.h"
#include "tests/testing/agent_fixture.h"

namespace rdma_agent {
namespace {

using ::rdma_agent::testing::InProcessAgent;
using ::testing::HasSubstr;

std::string ToString(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string out;
  for (const auto& slice : slices) {
    out.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  return out;
}

grpc::ByteBuffer FromString(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

// Runs one request/response exchange on `method` and returns the response.
std::string Exchange(const std::string& target, const std::string& method,
                     const std::string& request, grpc::Status* status) {
  grpc::GenericStub stub(
      grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(10));
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(&context, method, &cq);
  void* tag;
  bool ok;
  auto step = [&](intptr_t expected) {
    EXPECT_TRUE(cq.Next(&tag, &ok));
    EXPECT_EQ(reinterpret_cast<intptr_t>(tag), expected);
    return ok;
  };
  call->StartCall(reinterpret_cast<void*>(1));
  EXPECT_TRUE(step(1));
  call->Write(FromString(request), reinterpret_cast<void*>(2));
  EXPECT_TRUE(step(2));
  call->WritesDone(reinterpret_cast<void*>(3));
  EXPECT_TRUE(step(3));
  grpc::ByteBuffer response;
  call->Read(&response, reinterpret_cast<void*>(4));
  const bool got_response = step(4);
  call->Finish(status, reinterpret_cast<void*>(5));
  step(5);
  return got_response ? ToString(response) : "";
}

TEST(DiscoveryTest, HealthServiceAnswersServing) {
  auto fixture = InProcessAgent::Start();
  ASSERT_TRUE(fixture.ok()) << fixture.status();
  grpc::Status status;
  // HealthCheckRequest{service: ""} is empty; HealthCheckResponse{status:
  // SERVING} is field 1 = 1.
  const std::string response =
      Exchange((*fixture)->agent().target(), "/grpc.health.v1.Health/Check", "",
               &status);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response, std::string("\x08\x01", 2));
}

TEST(DiscoveryTest, HealthKnowsTheApiByName) {
  auto fixture = InProcessAgent::Start();
  ASSERT_TRUE(fixture.ok()) << fixture.status();
  // HealthCheckRequest{service: "rdma.agent.v1.RdmaAgent"}: field 1.
  const std::string service = "rdma.agent.v1.RdmaAgent";
  const std::string request =
      std::string("\x0a") + static_cast<char>(service.size()) + service;
  grpc::Status status;
  EXPECT_EQ(Exchange((*fixture)->agent().target(),
                     "/grpc.health.v1.Health/Check", request, &status),
            std::string("\x08\x01", 2));  // SERVING
  ASSERT_TRUE(status.ok()) << status.error_message();
  // An unknown service is NOT_FOUND, as the protocol says.
  const std::string unknown = std::string("\x0a\x03") + "foo";
  Exchange((*fixture)->agent().target(), "/grpc.health.v1.Health/Check",
           unknown, &status);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST(DiscoveryTest, ReflectionResolvesTheHealthService) {
  auto fixture = InProcessAgent::Start();
  ASSERT_TRUE(fixture.ok()) << fixture.status();
  // ServerReflectionRequest{file_containing_symbol: "grpc.health.v1.Health"}
  // (field 4), what grpcurl sends before calling a method.
  const std::string symbol = "grpc.health.v1.Health";
  grpc::Status status;
  const std::string response = Exchange(
      (*fixture)->agent().target(),
      "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
      std::string("\x22") + static_cast<char>(symbol.size()) + symbol, &status);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_THAT(response, HasSubstr("grpc/health/v1/health.proto"));
  EXPECT_THAT(response, HasSubstr("HealthCheckRequest"));
  EXPECT_THAT(response, ::testing::Not(HasSubstr("not found")));
}

TEST(DiscoveryTest, ReflectionListsTheApi) {
  auto fixture = InProcessAgent::Start();
  ASSERT_TRUE(fixture.ok()) << fixture.status();
  grpc::Status status;
  // ServerReflectionRequest{list_services: ""}: field 7, empty string.
  const std::string response =
      Exchange((*fixture)->agent().target(),
               "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
               std::string("\x3a\x00", 2), &status);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_THAT(response, HasSubstr("rdma.agent.v1.RdmaAgent"));
  EXPECT_THAT(response, HasSubstr("grpc.health.v1.Health"));
  EXPECT_THAT(response, ::testing::Not(HasSubstr("rdma.agent.v1.Peer")))
      << "the Peer service must never be served next to RdmaAgent";
}

}  // namespace
}  // namespace rdma_agent

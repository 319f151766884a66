#include "daemon/ops/remote_context.h"

#include <string>

#include "gtest/gtest.h"

namespace rdma_agent {
namespace {

v1::RemoteBuffer Complete() {
  v1::RemoteBuffer remote;
  remote.set_agent_id("agent-a");
  remote.set_agent_epoch(42);
  remote.set_buffer_id(7);
  remote.set_size_bytes(4096);
  remote.set_access(v1::ACCESS_READ);
  remote.set_token("0123456789abcdef");
  remote.add_endpoints()->set_backend("memory");
  remote.mutable_endpoints(0)->mutable_memory();
  return remote;
}

TEST(RemoteContextTest, ParsesAContextAnAgentIssued) {
  auto parsed = ParseRemoteContext(Complete().SerializeAsString());
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ((*parsed)->agent_id(), "agent-a");
  EXPECT_EQ((*parsed)->buffer_id(), 7u);
  EXPECT_EQ((*parsed)->endpoints_size(), 1);
}

TEST(RemoteContextTest, RefusesEmptyAndMalformedBytes) {
  EXPECT_EQ(ParseRemoteContext("").status().code(),
            absl::StatusCode::kInvalidArgument);
  // A length-delimited field (agent_id) claiming more bytes than follow.
  EXPECT_EQ(ParseRemoteContext(std::string("\x0a\x20short", 7)).status().code(),
            absl::StatusCode::kInvalidArgument);
  const std::string whole = Complete().SerializeAsString();
  EXPECT_EQ(
      ParseRemoteContext(whole.substr(0, whole.size() - 3)).status().code(),
      absl::StatusCode::kInvalidArgument);
}

TEST(RemoteContextTest, RefusesEachMissingField) {
  const auto clear = {
      +[](v1::RemoteBuffer& r) { r.clear_agent_id(); },
      +[](v1::RemoteBuffer& r) { r.clear_agent_epoch(); },
      +[](v1::RemoteBuffer& r) { r.clear_size_bytes(); },
      +[](v1::RemoteBuffer& r) { r.clear_token(); },
      +[](v1::RemoteBuffer& r) { r.clear_endpoints(); },
      +[](v1::RemoteBuffer& r) { r.set_access(v1::ACCESS_UNSPECIFIED); },
      +[](v1::RemoteBuffer& r) { r.set_access(static_cast<v1::Access>(77)); },
  };
  int field = 0;
  for (auto mutate : clear) {
    v1::RemoteBuffer remote = Complete();
    mutate(remote);
    EXPECT_EQ(ParseRemoteContext(remote.SerializeAsString()).status().code(),
              absl::StatusCode::kInvalidArgument)
        << "field " << field;
    ++field;
  }
}

// A context longer than the cap is refused before it is parsed, naming the
// flag; one padded to exactly the cap (an unknown field) still parses.
TEST(RemoteContextTest, RefusesAContextPastTheCapUnparsed) {
  v1::RemoteBuffer remote = Complete();
  const std::string small = remote.SerializeAsString();
  EXPECT_TRUE(ParseRemoteContext(small, small.size()).ok());
  auto refused = ParseRemoteContext(small, small.size() - 1);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("--max_remote_context_bytes"),
            absl::string_view::npos)
      << refused.status();
  // Megabytes of endpoints: refused by the default cap at once.
  for (int i = 0; i < 200000; ++i) remote.add_endpoints();
  const std::string huge = remote.SerializeAsString();
  ASSERT_GT(huge.size(), kMaxRemoteContextBytesLimit / 4);
  EXPECT_EQ(
      ParseRemoteContext(huge, kDefaultMaxRemoteContextBytes).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(
      CheckRemoteContextSize(small, kDefaultMaxRemoteContextBytes).ok());
  EXPECT_FALSE(
      CheckRemoteContextSize(huge, kDefaultMaxRemoteContextBytes).ok());
}

}  // namespace
}  // namespace rdma_agent

#include "client/internal/context_text.h"

#include <string>

#include "absl/strings/escaping.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "rdma/agent/v1/remote_buffer.pb.h"

namespace rdma_agent::client::internal {
namespace {

using ::testing::HasSubstr;
namespace v1 = ::rdma::agent::v1;

std::string SampleContext() {
  v1::RemoteBuffer context;
  context.set_agent_id("agent-1");
  context.set_agent_epoch(42);
  context.set_buffer_id(7);
  context.set_size_bytes(4096);
  context.set_access(v1::ACCESS_READ);
  context.set_token(std::string("\x01\xab\x00\xff", 4));
  v1::BackendEndpoint* endpoint = context.add_endpoints();
  endpoint->set_backend("ibverbs");
  endpoint->mutable_ibverbs()->set_gid(std::string(15, '\0') + "\x01");
  endpoint->mutable_ibverbs()->set_rkey(99);
  return context.SerializeAsString();
}

TEST(ContextTextTest, PrintsTokenAndGidAsHex) {
  auto text = RemoteContextToText(SampleContext());
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_THAT(*text, HasSubstr("agent_id: \"agent-1\"\n"));
  EXPECT_THAT(*text, HasSubstr("agent_epoch: 42\n"));
  EXPECT_THAT(*text, HasSubstr("buffer_id: 7\n"));
  EXPECT_THAT(*text, HasSubstr("access: ACCESS_READ\n"));
  EXPECT_THAT(*text, HasSubstr("token: \"01ab00ff\"\n"));
  EXPECT_THAT(*text, HasSubstr("gid: \"00000000000000000000000000000001\"\n"));
  EXPECT_THAT(*text, HasSubstr("rkey: 99\n"));
}

TEST(ContextTextTest, RejectsEmptyAndTruncatedContexts) {
  EXPECT_EQ(RemoteContextToText("").status().code(),
            absl::StatusCode::kInvalidArgument);
  const std::string context = SampleContext();
  EXPECT_EQ(RemoteContextToText(context.substr(0, context.size() - 2))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RemoteContextToText("\xff\xff\xff").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ContextTextTest, DecodesStandardAndWebSafeBase64) {
  const std::string raw = SampleContext() + "\xfb\xff";  // forces + / or - _
  EXPECT_EQ(*DecodeBase64(absl::Base64Escape(raw)), raw);
  EXPECT_EQ(*DecodeBase64(absl::WebSafeBase64Escape(raw)), raw);
  EXPECT_EQ(*DecodeBase64("  " + absl::Base64Escape(raw) + "\n"), raw);
  EXPECT_EQ(DecodeBase64("").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeBase64("not base64!").status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rdma_agent::client::internal

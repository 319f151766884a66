#include "daemon/directory/directory.h"

#include <string>

#include "absl/time/clock.h"
#include "daemon/directory/agent_record.h"
#include "daemon/directory/directory_options.h"
#include "gtest/gtest.h"

namespace rdma_agent {
namespace {

using absl::StatusCode;

DirectoryOptions Etcd(std::string address) {
  DirectoryOptions options;
  options.address = std::move(address);
  return options;
}

TEST(DirectoryOptionsTest, AcceptsLocalAndEtcdEndpoints) {
  EXPECT_TRUE(DirectoryOptions().Validate().ok());
  DirectoryOptions options = Etcd("etcd://10.0.0.5:2379,etcd-1.example:2379");
  ASSERT_TRUE(options.Validate().ok()) << options.Validate();
  EXPECT_EQ(options.EtcdEndpoints(),
            (std::vector<std::string>{"10.0.0.5:2379", "etcd-1.example:2379"}));
  EXPECT_TRUE(DirectoryOptions().EtcdEndpoints().empty());
}

TEST(DirectoryOptionsTest, RefusesMalformedOptionsByFlag) {
  struct Case {
    DirectoryOptions options;
    const char* flag;
  };
  std::vector<Case> cases;
  cases.push_back({Etcd("consul://x:1"), "--directory must be"});
  cases.push_back({Etcd("etcd://"), "names no endpoint"});
  cases.push_back({Etcd("etcd://host"), "is not host:port"});
  cases.push_back({Etcd("etcd://host:0"), "is not host:port"});
  cases.push_back({Etcd("etcd://host:99999"), "is not host:port"});
  for (const char* prefix : {"", "/", "x", "/a/"}) {
    DirectoryOptions options;
    options.prefix = prefix;
    cases.push_back({options, "--directory_prefix"});
  }
  for (absl::Duration ttl : {absl::Seconds(1), absl::Hours(2)}) {
    DirectoryOptions options;
    options.lease_ttl = ttl;
    cases.push_back({options, "--directory_lease_ttl"});
  }
  DirectoryOptions slow;
  slow.call_timeout = absl::Seconds(20);
  cases.push_back({slow, "--directory_call_timeout"});
  DirectoryOptions half_cert;
  half_cert.cert_file = "/c.pem";
  cases.push_back({half_cert, "--directory_cert_file and"});
  DirectoryOptions cert_without_ca = half_cert;
  cert_without_ca.key_file = "/k.pem";
  cases.push_back({cert_without_ca, "needs --directory_ca_file"});
  DirectoryOptions user_only;
  user_only.user = "agent";
  cases.push_back({user_only, "--directory_user and"});
  DirectoryOptions none_listed;
  none_listed.max_listed_agents = 0;
  cases.push_back({none_listed, "--directory_max_listed_agents"});
  for (const Case& c : cases) {
    const absl::Status status = c.options.Validate();
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << c.flag;
    EXPECT_NE(status.message().find(c.flag), std::string::npos) << status;
    EXPECT_EQ(OpenDirectory(c.options).status().code(),
              StatusCode::kInvalidArgument);
  }
}

TEST(DirectoryOptionsTest, UnreadablePasswordFileIsRefusedAtOpen) {
  DirectoryOptions options = Etcd("etcd://127.0.0.1:2379");
  options.user = "agent";
  options.password_file = "/nonexistent/password";
  const absl::Status status = OpenDirectory(options).status();
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("--directory_password_file"),
            std::string::npos)
      << status;
}

v1::AgentRecord Record(const std::string& id) {
  v1::AgentRecord record;
  record.mutable_info()->set_agent_id(id);
  record.mutable_info()->set_epoch(0x1234567890abcdefULL);
  record.mutable_info()->set_hostname("host-a");
  v1::BackendInfo* tcp = record.mutable_info()->add_backends();
  tcp->set_name("tcp");
  tcp->mutable_transport_info()->add_addresses("10.0.0.5:40001");
  record.mutable_start_time()->set_seconds(1764842400);
  record.set_peer_address("10.0.0.5:7470");
  return record;
}

TEST(AgentRecordTest, RoundTripsThroughReadableJson) {
  const v1::AgentRecord record = Record("agent-a");
  const std::string json = EncodeAgentRecord(record);
  // Readable with etcdctl: field names as in the proto, the epoch in full.
  EXPECT_NE(json.find("\"agent_id\":\"agent-a\""), std::string::npos) << json;
  EXPECT_NE(json.find("10.0.0.5:40001"), std::string::npos) << json;
  auto back = DecodeAgentRecord(json);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->SerializeAsString(), record.SerializeAsString());
}

TEST(AgentRecordTest, IgnoresFieldsOfNewerAgents) {
  auto back = DecodeAgentRecord(
      R"({"info":{"agent_id":"b"},"field_of_the_future":{"x":1}})");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->info().agent_id(), "b");
}

TEST(AgentRecordTest, RefusesGarbageOversizeAndAnonymousRecords) {
  EXPECT_EQ(DecodeAgentRecord("not json").status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeAgentRecord(R"({"info":{"hostname":"h"}})").status().code(),
            StatusCode::kInvalidArgument);
  std::string big = R"({"info":{"agent_id":"c","hostname":")";
  big.append(kMaxAgentRecordBytes, 'h');
  big += "\"}}";
  const absl::Status status = DecodeAgentRecord(big).status();
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("over the limit"), std::string::npos);
}

TEST(LocalDirectoryTest, KnowsThisAgentWhileItIsPublished) {
  auto directory = OpenDirectory(DirectoryOptions());
  ASSERT_TRUE(directory.ok()) << directory.status();
  EXPECT_EQ((*directory)->name(), "local");
  auto empty = (*directory)->ListAgents(absl::InfiniteFuture());
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->agents_size(), 0);

  ASSERT_TRUE((*directory)->PublishAgent(Record("agent-a")).ok());
  auto listed = (*directory)->ListAgents(absl::InfiniteFuture());
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->agents_size(), 1);
  EXPECT_EQ(listed->agents(0).info().agent_id(), "agent-a");
  EXPECT_EQ(listed->directory(), "local");

  (*directory)->Withdraw();
  (*directory)->Withdraw();
  EXPECT_EQ((*directory)->ListAgents(absl::InfiniteFuture())->agents_size(), 0);
}

TEST(EtcdDirectoryTest, UnreachableEtcdIsUnavailableWithinTheCallTimeout) {
  // Port 1 on loopback: nothing listens, connections are refused at once.
  DirectoryOptions options = Etcd("etcd://127.0.0.1:1,127.0.0.1:2");
  options.call_timeout = absl::Milliseconds(500);
  auto directory = OpenDirectory(options);
  ASSERT_TRUE(directory.ok()) << directory.status();
  const absl::Time start = absl::Now();
  const absl::Status published = (*directory)->PublishAgent(Record("a"));
  EXPECT_EQ(published.code(), StatusCode::kUnavailable) << published;
  EXPECT_NE(published.message().find("127.0.0.1:"), std::string::npos);
  const auto listed = (*directory)->ListAgents(absl::Now() + absl::Seconds(5));
  EXPECT_EQ(listed.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(listed.status().message().find("etcd://127.0.0.1:1"),
            std::string::npos)
      << listed.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(4));
  // Withdrawing what never got published returns at once.
  (*directory)->Withdraw();
}

}  // namespace
}  // namespace rdma_agent

// The C++ client library (//client:client) against a real rdma-agentd
// process: mapping of Allocate/Attach buffers, RAII release, chunked
// ReadBuffer/WriteBuffer, per-op Submit results, and its error paths.

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/internal/attach_socket.h"
#include "client/rdma_agent_client.h"
#include "client/ring.h"
#include "common/unique_fd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "rdma/agent/v1/remote_buffer.pb.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/pattern.h"

namespace rdma_agent::testing {
namespace {

using client::AgentClient;
using client::Buffer;
using client::ConnectOptions;
using client::OpResult;
using client::OpSpec;
using client::SubmitOptions;
namespace v1 = ::rdma::agent::v1;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

constexpr uint64_t kMiB = 1 << 20;

std::vector<uint64_t> ListedIds(AgentClient& client) {
  auto buffers = client.ListBuffers();
  EXPECT_TRUE(buffers.ok()) << buffers.status();
  std::vector<uint64_t> ids;
  if (buffers.ok()) {
    for (const v1::BufferInfo& info : *buffers) ids.push_back(info.buffer_id());
  }
  return ids;
}

std::string AsString(absl::Span<const std::byte> bytes) {
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

class ClientLibraryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto agent = AgentProcess::Start();
    ASSERT_TRUE(agent.ok()) << agent.status();
    agent_ = std::move(*agent);
    client_ = Connect();
    ASSERT_NE(client_, nullptr);
  }

  std::unique_ptr<AgentClient> Connect(ConnectOptions options = {}) {
    options.target = agent_->target();
    auto client = AgentClient::Connect(options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? std::move(*client) : nullptr;
  }

  std::unique_ptr<AgentProcess> agent_;
  std::unique_ptr<AgentClient> client_;
};

TEST(AttachSocketNextToTest, SitsNextToTheAgentSocket) {
  EXPECT_EQ(*client::internal::AttachSocketNextTo("unix:///run/x/agent.sock"),
            "/run/x/attach.sock");
  EXPECT_EQ(*client::internal::AttachSocketNextTo("unix:/tmp/a/b.sock"),
            "/tmp/a/attach.sock");
  EXPECT_EQ(*client::internal::AttachSocketNextTo("unix:agent.sock"),
            "attach.sock");
  EXPECT_EQ(
      client::internal::AttachSocketNextTo("dns:///host:1234").status().code(),
      absl::StatusCode::kInvalidArgument);
}

TEST(ConnectTest, UnreachableAgentIsUnavailable) {
  ConnectOptions options;
  options.target = "unix:///tmp/no-rdma-agentd-here/agent.sock";
  options.connect_timeout = absl::Milliseconds(300);
  auto client = AgentClient::Connect(options);
  EXPECT_EQ(client.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(client.status().message(), HasSubstr(options.target));
}

TEST_F(ClientLibraryTest, GetInfoNamesTheMemoryBackend) {
  auto info = client_->GetInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_FALSE(info->agent_id().empty());
  EXPECT_NE(info->epoch(), 0u);
  ASSERT_EQ(info->backends_size(), 1);
  EXPECT_EQ(info->backends(0).name(), "memory");
}

// Both kinds of buffers are the agent's bytes, not a copy: what the process
// writes in its mapping ReadBuffer returns, and what WriteBuffer writes the
// mapping shows.
void ExpectSharedWithTheAgent(AgentClient& client, Buffer& buffer) {
  ASSERT_NE(buffer.data(), nullptr);
  EXPECT_EQ(buffer.bytes().data(), buffer.data());
  EXPECT_EQ(buffer.bytes().size(), buffer.size());
  // Zero-filled to start with.
  EXPECT_EQ(AsString(buffer.bytes()), std::string(buffer.size(), '\0'));

  FillPattern(buffer.bytes().subspan(5, 1000), 3);
  auto read = client.ReadBuffer(buffer.id(), 0, buffer.size());
  ASSERT_TRUE(read.ok()) << read.status();
  std::string expected(buffer.size(), '\0');
  expected.replace(5, 1000, PatternString(3, 0, 1000));
  EXPECT_TRUE(*read == expected);

  const std::string data = PatternString(4, 0, 333);
  ASSERT_TRUE(client.WriteBuffer(buffer.id(), 2001, data).ok());
  expected.replace(2001, 333, data);
  EXPECT_TRUE(AsString(buffer.bytes()) == expected);

  v1::RemoteBuffer context;
  ASSERT_TRUE(context.ParseFromString(buffer.remote_context()));
  EXPECT_EQ(context.buffer_id(), buffer.id());
  EXPECT_EQ(context.size_bytes(), buffer.size());
  EXPECT_EQ(context.access(), v1::ACCESS_READ_WRITE);
  EXPECT_EQ(buffer.backends(), std::vector<std::string>{"memory"});
}

TEST_F(ClientLibraryTest, AllocatedBufferIsMappedAndShared) {
  auto buffer = client_->Allocate(4099, v1::ACCESS_READ_WRITE, "allocated");
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_EQ(buffer->size(), 4099u);
  ExpectSharedWithTheAgent(*client_, *buffer);
  auto listed = client_->ListBuffers();
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].label(), "allocated");
  EXPECT_TRUE((*listed)[0].agent_allocated());
}

TEST_F(ClientLibraryTest, AttachedBufferIsMappedAndShared) {
  auto buffer = client_->Attach(4099, v1::ACCESS_READ_WRITE, "attached");
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_EQ(buffer->size(), 4099u);
  ExpectSharedWithTheAgent(*client_, *buffer);
  auto listed = client_->ListBuffers();
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].label(), "attached");
  EXPECT_FALSE((*listed)[0].agent_allocated());
}

// This agent runs the memory backend only: device memory has nowhere to go.
// (Device memory over a NIC: tests/ibverbs/device_memory_test.cc.)
TEST_F(ClientLibraryTest, DeviceMemoryNeedsANicBackend) {
  client::DeviceMemorySpec spec;
  spec.dmabuf_fd = -1;
  spec.length = 4096;
  auto no_fd = client_->RegisterDeviceMemory(spec, v1::ACCESS_READ_WRITE);
  EXPECT_EQ(no_fd.status().code(), absl::StatusCode::kInvalidArgument);

  UniqueFd memfd(::memfd_create("client-dmabuf", MFD_CLOEXEC));
  ASSERT_TRUE(memfd.valid());
  ASSERT_EQ(::ftruncate(memfd.get(), 8192), 0);
  spec.dmabuf_fd = memfd.get();
  spec.offset = 4096;
  spec.kind = v1::MEMORY_KIND_ROCM;
  spec.device_index = 1;
  auto refused = client_->RegisterDeviceMemory(spec, v1::ACCESS_READ_WRITE);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("ROCm device memory (device 1), which only NIC "
                        "backends (ibverbs) can register"));
  auto listed = client_->ListBuffers();
  ASSERT_TRUE(listed.ok());
  EXPECT_THAT(*listed, IsEmpty());
}

TEST_F(ClientLibraryTest, MappedBuffersLiveWithTheProcessUnlessAskedOtherwise) {
  // Buffer releases itself; the agent does it if this process dies first.
  auto allocated = client_->Allocate(100, v1::ACCESS_READ_WRITE);
  auto attached = client_->Attach(100, v1::ACCESS_READ_WRITE);
  // Handed to something that outlives this process.
  auto kept =
      client_->Allocate(100, v1::ACCESS_READ_WRITE, "kept", v1::LIFETIME_AGENT);
  // For tools: never released automatically.
  auto unmapped = client_->AllocateUnmapped(100, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(allocated.ok() && attached.ok() && kept.ok() && unmapped.ok());
  EXPECT_EQ(allocated->lifetime(), v1::LIFETIME_CLIENT_PROCESS);
  EXPECT_EQ(attached->lifetime(), v1::LIFETIME_CLIENT_PROCESS);
  EXPECT_EQ(kept->lifetime(), v1::LIFETIME_AGENT);
  EXPECT_EQ(unmapped->lifetime, v1::LIFETIME_AGENT);
  auto listed = client_->ListBuffers();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 4u);
  EXPECT_EQ((*listed)[0].lifetime(), v1::LIFETIME_CLIENT_PROCESS);
  EXPECT_EQ((*listed)[1].lifetime(), v1::LIFETIME_CLIENT_PROCESS);
  EXPECT_EQ((*listed)[2].lifetime(), v1::LIFETIME_AGENT);
  EXPECT_EQ((*listed)[3].lifetime(), v1::LIFETIME_AGENT);
  EXPECT_EQ((*listed)[3].owner_pid(), static_cast<uint32_t>(::getpid()));
  ASSERT_TRUE(client_->Release(unmapped->id).ok());
}

TEST_F(ClientLibraryTest, AllUsersListingIsForRoot) {
  auto mine = client_->Allocate(100, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(mine.ok()) << mine.status();
  auto all = client_->ListBuffers(/*all_users=*/true);
  if (::geteuid() == 0) {
    ASSERT_TRUE(all.ok()) << all.status();
    ASSERT_EQ(all->size(), 1u);
    EXPECT_EQ((*all)[0].buffer_id(), mine->id());
  } else {
    EXPECT_EQ(all.status().code(), absl::StatusCode::kPermissionDenied);
  }
}

TEST_F(ClientLibraryTest, DestructorReleasesAndMoveTransfersOwnership) {
  uint64_t id = 0;
  {
    auto buffer = client_->Attach(100, v1::ACCESS_READ_WRITE);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    id = buffer->id();
    Buffer moved = std::move(*buffer);
    // The moved-from buffer owns nothing: its destruction releases nothing.
    EXPECT_EQ(buffer->data(), nullptr);
    EXPECT_EQ(buffer->size(), 0u);
    { Buffer sink = std::move(*buffer); }
    EXPECT_EQ(ListedIds(*client_), std::vector<uint64_t>{id});
    EXPECT_EQ(moved.id(), id);
  }
  EXPECT_THAT(ListedIds(*client_), IsEmpty());
  EXPECT_EQ(client_->Release(id).code(), absl::StatusCode::kNotFound);
}

TEST_F(ClientLibraryTest, ExplicitReleaseHappensOnce) {
  auto buffer = client_->Allocate(100, v1::ACCESS_READ);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  const uint64_t id = buffer->id();
  ASSERT_TRUE(buffer->Release().ok());
  EXPECT_EQ(buffer->Release().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(ListedIds(*client_), IsEmpty());
  // The mapping outlives the registration until the Buffer goes.
  buffer->data()[99] = std::byte{1};
  EXPECT_EQ(client_->ReadBuffer(id, 0, 1).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(ClientLibraryTest, BufferOutlivesItsClient) {
  auto buffer = client_->Allocate(100, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  client_.reset();
  buffer->data()[0] = std::byte{7};
  auto other = Connect();
  ASSERT_NE(other, nullptr);
  EXPECT_EQ(ListedIds(*other), std::vector<uint64_t>{buffer->id()});
  { Buffer gone = std::move(*buffer); }
  EXPECT_THAT(ListedIds(*other), IsEmpty());
}

TEST_F(ClientLibraryTest, ReadAndWriteBufferAreChunked) {
  ConnectOptions options;
  options.transfer_chunk_bytes = 4096;
  auto client = Connect(options);
  ASSERT_NE(client, nullptr);
  auto buffer = client->Allocate(3 * kMiB + 11, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  const std::string data = PatternString(9, 0, 3 * kMiB + 5);
  ASSERT_TRUE(client->WriteBuffer(buffer->id(), 3, data).ok());
  // Zeros outside the written range: compare against an explicit image.
  std::string expected(buffer->size(), '\0');
  expected.replace(3, data.size(), data);
  EXPECT_TRUE(AsString(buffer->bytes()) == expected);
  auto back = client->ReadBuffer(buffer->id(), 1, buffer->size() - 1);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == expected.substr(1));
}

TEST_F(ClientLibraryTest, ReadAndWriteBufferErrors) {
  auto buffer = client_->Allocate(64, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_EQ(client_->ReadBuffer(buffer->id(), UINT64_MAX, 2).status().code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(client_->WriteBuffer(buffer->id(), UINT64_MAX, "ab").code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(client_->ReadBuffer(buffer->id(), 60, 5).status().code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(client_->WriteBuffer(buffer->id(), 64, "a").code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(client_->ReadBuffer(buffer->id() + 1000, 0, 1).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->WriteBuffer(buffer->id() + 1000, 0, "a").code(),
            absl::StatusCode::kNotFound);
  // Nothing was written by the failed calls.
  EXPECT_EQ(AsString(buffer->bytes()), std::string(64, '\0'));
}

TEST_F(ClientLibraryTest, SubmitAnswersOneResultPerOp) {
  auto source = client_->Attach(1000, v1::ACCESS_READ);
  ASSERT_TRUE(source.ok()) << source.status();
  auto target = client_->Allocate(1000, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(target.ok()) << target.status();
  FillPattern(source->bytes(), 11);

  std::vector<OpSpec> ops(3);
  for (OpSpec& op : ops) {
    op.type = v1::OP_TYPE_READ_INTO_LOCAL;
    op.local_buffer_id = target->id();
    op.remote_context = source->remote_context();
  }
  ops[0].local_offset = 1;
  ops[0].remote_offset = 2;
  ops[0].length = 10;
  ops[1].local_offset = 500;
  ops[1].remote_offset = 995;  // 995 + 10 > 1000
  ops[1].length = 10;
  ops[2].type = v1::OP_TYPE_WRITE_FROM_LOCAL;  // into a READ-only buffer
  ops[2].length = 10;
  auto results = client_->Submit(ops, absl::Seconds(10));
  ASSERT_TRUE(results.ok()) << results.status();
  ASSERT_EQ(results->size(), 3u);
  EXPECT_TRUE((*results)[0].status.ok()) << (*results)[0].status;
  EXPECT_EQ((*results)[0].backend, "memory");
  EXPECT_EQ((*results)[1].status.code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*results)[2].status.code(), absl::StatusCode::kPermissionDenied);
  std::string expected(1000, '\0');
  expected.replace(1, 10, PatternString(11, 2, 10));
  EXPECT_TRUE(AsString(target->bytes()) == expected);
  EXPECT_EQ(FirstMismatch(source->bytes(), 0, 0, 0, 0, 11), std::nullopt);

  // The agent's default timeout when none is given.
  auto default_timeout = client_->Submit({ops[0]}, absl::ZeroDuration());
  ASSERT_TRUE(default_timeout.ok()) << default_timeout.status();
  EXPECT_TRUE((*default_timeout)[0].status.ok());
}

TEST_F(ClientLibraryTest, OpsNameImportedRemotesAndPreparedTransfers) {
  auto source = client_->Attach(1000, v1::ACCESS_READ);
  ASSERT_TRUE(source.ok()) << source.status();
  auto target = client_->Attach(1000, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(target.ok()) << target.status();
  FillPattern(source->bytes(), 12);
  FillPattern(target->bytes(), 13);

  auto handle = client_->ImportRemote(source->remote_context());
  ASSERT_TRUE(handle.ok()) << handle.status();
  EXPECT_NE(handle->handle, 0u);
  EXPECT_EQ(handle->buffer_id, source->id());
  EXPECT_EQ(handle->size, 1000u);
  EXPECT_EQ(handle->access, v1::ACCESS_READ);
  EXPECT_EQ(handle->backends, std::vector<std::string>{"memory"});
  auto listed = client_->ListRemotes();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].handle, handle->handle);

  OpSpec op;
  op.type = v1::OP_TYPE_READ_INTO_LOCAL;
  op.local_buffer_id = target->id();
  op.local_offset = 10;
  op.length = 20;
  op.remote_handle = handle->handle;
  op.remote_offset = 30;
  auto results = client_->Submit({op}, absl::Seconds(10));
  ASSERT_TRUE(results.ok()) << results.status();
  ASSERT_TRUE((*results)[0].status.ok()) << (*results)[0].status;
  EXPECT_EQ(FirstMismatch(target->bytes(), 12, 30, 10, 20, 13), std::nullopt);

  // The same op prepared, run synchronously and asynchronously, after the
  // source changed: each run reads it again.
  op.local_offset = 500;
  op.remote_offset = 0;
  auto prepared = client_->PrepareTransfer({op});
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  FillPattern(source->bytes(), 14);
  auto run = client_->SubmitPrepared(*prepared);
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_EQ(run->results.size(), 1u);
  EXPECT_TRUE(run->results[0].status.ok()) << run->results[0].status;
  std::string expected = PatternString(13, 0, 1000);
  expected.replace(10, 20, PatternString(12, 30, 20));
  expected.replace(500, 20, PatternString(14, 0, 20));
  EXPECT_TRUE(AsString(target->bytes()) == expected);
  FillPattern(source->bytes(), 15);
  auto transfer = client_->SubmitPreparedAsync(*prepared);
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  auto ended = transfer->Wait(absl::Seconds(10));
  ASSERT_TRUE(ended.ok()) << ended.status();
  EXPECT_TRUE(ended->ok());
  expected.replace(500, 20, PatternString(15, 0, 20));
  EXPECT_TRUE(AsString(target->bytes()) == expected);

  // A run naming a notification of its own is refused: the prepared one
  // is sent.
  SubmitOptions with_notification;
  with_notification.notification = "n";
  EXPECT_EQ(
      client_->SubmitPrepared(*prepared, with_notification).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(client_->ReleasePrepared(*prepared).ok());
  EXPECT_EQ(client_->SubmitPrepared(*prepared).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->ReleasePrepared(*prepared).code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(client_->ReleaseRemote(handle->handle).ok());
  EXPECT_EQ(client_->ReleaseRemote(handle->handle).code(),
            absl::StatusCode::kNotFound);
}

// A ring session with a real rdma-agentd process: bytes land in this
// process's mapping; then the agent is killed mid-session and every ring
// call fails UNAVAILABLE at once instead of hanging.
TEST_F(ClientLibraryTest, ARingWorksAndEndsWhenItsAgentIsKilled) {
  auto source = client_->Attach(4096, v1::ACCESS_READ);
  ASSERT_TRUE(source.ok()) << source.status();
  auto target = client_->Attach(4096, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(target.ok()) << target.status();
  FillPattern(source->bytes(), 21);
  FillPattern(target->bytes(), 22);
  auto handle = client_->ImportRemote(source->remote_context());
  ASSERT_TRUE(handle.ok()) << handle.status();
  auto ring = client_->OpenRing(16);
  ASSERT_TRUE(ring.ok()) << ring.status();
  client::RingOp op;
  op.type = v1::OP_TYPE_READ_INTO_LOCAL;
  op.local_buffer_id = target->id();
  op.local_offset = 100;
  op.length = 200;
  op.remote_handle = handle->handle;
  op.remote_offset = 300;
  op.user_tag = 5;
  ASSERT_TRUE((*ring)->Submit({&op, 1}).ok());
  std::vector<client::RingCompletion> ends;
  auto got = (*ring)->Wait(&ends, absl::Seconds(10));
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_EQ(ends[0].user_tag, 5u);
  EXPECT_TRUE(ends[0].status.ok()) << ends[0].status;
  EXPECT_EQ(FirstMismatch(target->bytes(), 21, 300, 100, 200, 22),
            std::nullopt);

  client_.reset();
  agent_->Kill();
  const absl::Time start = absl::Now();
  ends.clear();
  auto after = (*ring)->Wait(&ends, absl::Seconds(30));
  EXPECT_EQ(after.status().code(), absl::StatusCode::kUnavailable)
      << after.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ((*ring)->Submit({&op, 1}).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ((*ring)->status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(ClientLibraryTest, SubmitOfAnEmptyBatchIsInvalid) {
  auto results = client_->Submit({}, absl::Seconds(1));
  EXPECT_EQ(results.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ClientLibraryTest, AllocateReleasesTheRegistrationWhenMappingFails) {
  ConnectOptions options;
  options.attach_socket = agent_->runtime_dir() + "/no-attach.sock";
  auto client = Connect(options);
  ASSERT_NE(client, nullptr);
  auto buffer = client->Allocate(100, v1::ACCESS_READ_WRITE);
  EXPECT_EQ(buffer.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(ListedIds(*client), IsEmpty());
  EXPECT_EQ(client->Attach(100, v1::ACCESS_READ_WRITE).status().code(),
            absl::StatusCode::kUnavailable);
}

TEST_F(ClientLibraryTest, SilentAttachSocketIsADeadline) {
  // A socket that takes connections (backlog) but never answers.
  const std::string path = agent_->runtime_dir() + "/silent.sock";
  UniqueFd listener(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  struct sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  ASSERT_EQ(::bind(listener.get(), reinterpret_cast<struct sockaddr*>(&addr),
                   sizeof(addr)),
            0);
  ASSERT_EQ(::listen(listener.get(), 8), 0);
  ConnectOptions options;
  options.attach_socket = path;
  options.rpc_timeout = absl::Seconds(2);
  auto client = Connect(options);
  ASSERT_NE(client, nullptr);
  const absl::Time start = absl::Now();
  EXPECT_EQ(client->Attach(100, v1::ACCESS_READ_WRITE).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(client->Allocate(100, v1::ACCESS_READ_WRITE).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  // The registration Allocate made was rolled back.
  EXPECT_THAT(ListedIds(*client), IsEmpty());
}

TEST_F(ClientLibraryTest, BadSizesAreInvalid) {
  EXPECT_EQ(client_->Allocate(0, v1::ACCESS_READ_WRITE).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->Attach(0, v1::ACCESS_READ_WRITE).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ListedIds(*client_), IsEmpty());
}

TEST_F(ClientLibraryTest, NonUnixTargetNeedsAnExplicitAttachSocket) {
  ConnectOptions options;
  options.target = "dns:///localhost:1";
  options.connect_timeout = absl::ZeroDuration();  // lazy: nothing listens
  auto client = AgentClient::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_EQ((*client)->attach_socket(), "");
  EXPECT_EQ((*client)->Attach(8, v1::ACCESS_READ).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rdma_agent::testing

// Notifications to the remote side through real in-process agents, for
// each backend that can carry them (memory: the target is the initiating
// agent itself; tcp; ibverbs on the software RC NIC): the owner of the
// target buffer receives exactly one notification per batch, and once it
// has it, the batch's bytes are in its buffer (checked byte by byte, with
// the bytes around the op's range untouched). Failed ops, a restarted
// target, a passed deadline and an oversized notification send nothing, and
// the initiator's results say so.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends/ibverbs/ibverbs_backend.h"
#include "backends/ibverbs/soft/soft_verbs.h"
#include "backends/testing/ibverbs_agent.h"
#include "gtest/gtest.h"
#include "tests/testing/agent_fixture.h"
#include "tests/testing/backend_factories.h"

namespace rdma_agent {
namespace {

using ibverbs::IbverbsOptions;
using testing::InProcessAgent;

constexpr uint64_t kSize = 1 << 20;

class NotificationsApiTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    for (const char* name : {"nic_a", "nic_b"}) {
      verbs::SoftDeviceConfig config;
      config.name = name;
      ASSERT_TRUE(fabric_->AddDevice(config).ok());
    }
    a_ = StartAgent("nic_a");
    ASSERT_NE(a_, nullptr);
    if (GetParam() == "memory") {
      b_ = a_.get();
    } else {
      owned_b_ = StartAgent("nic_b");
      ASSERT_NE(owned_b_, nullptr);
      b_ = owned_b_.get();
    }
    a_id_ = Info(*a_).agent_id();
  }

  // memory + tcp (+ ibverbs on `device` when the parameter is "ibverbs").
  std::unique_ptr<InProcessAgent> StartAgent(const std::string& device,
                                             AgentOptions options = {}) {
    options.backends.push_back(testing::MemoryFactory());
    options.backends.push_back(testing::LoopbackTcpFactory());
    if (GetParam() == "ibverbs") {
      std::shared_ptr<verbs::SoftFabric> fabric = fabric_;
      options.backends.push_back(testing::IbverbsFactory(
          [fabric, device] { return fabric->MakeVerbs({device}); }));
    }
    auto agent = InProcessAgent::Start(std::move(options));
    EXPECT_TRUE(agent.ok()) << agent.status();
    return agent.ok() ? std::move(*agent) : nullptr;
  }

  static v1::AgentInfo Info(InProcessAgent& agent) {
    grpc::ClientContext context;
    v1::AgentInfo info;
    EXPECT_TRUE(agent.stub().GetInfo(&context, {}, &info).ok());
    return info;
  }

  // Registers kSize bytes filled with a pattern from `seed`; returns the
  // registration and its contents.
  static v1::RegisterResponse Buffer(InProcessAgent& agent, uint8_t seed,
                                     std::string* contents) {
    auto response = agent.Allocate(kSize);
    EXPECT_TRUE(response.ok()) << response.status();
    std::string data(kSize, '\0');
    for (uint64_t i = 0; i < kSize; ++i) {
      data[i] = static_cast<char>(seed + i * 7 + (i >> 11));
    }
    grpc::ClientContext context;
    v1::WriteBufferRequest request;
    request.set_buffer_id(response->buffer_id());
    request.set_data(data);
    v1::WriteBufferResponse ignored;
    EXPECT_TRUE(agent.stub().WriteBuffer(&context, request, &ignored).ok());
    if (contents != nullptr) *contents = std::move(data);
    return *response;
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

  static v1::Op MakeOp(v1::OpType type, uint64_t local, uint64_t local_offset,
                       uint64_t length, const v1::RegisterResponse& remote,
                       uint64_t remote_offset) {
    v1::Op op;
    op.set_type(type);
    op.set_local_buffer_id(local);
    op.set_local_offset(local_offset);
    op.set_length(length);
    op.set_remote_context(remote.remote_context());
    op.set_remote_offset(remote_offset);
    return op;
  }

  static v1::SubmitRequest Request(const std::vector<v1::Op>& ops,
                                   const std::string& notification) {
    v1::SubmitRequest request;
    for (const v1::Op& op : ops) *request.add_ops() = op;
    request.mutable_timeout()->set_seconds(30);
    request.set_notification(notification);
    return request;
  }

  static absl::StatusOr<v1::SubmitResponse> Submit(
      InProcessAgent& agent, const v1::SubmitRequest& request) {
    grpc::ClientContext context;
    v1::SubmitResponse response;
    absl::Status status =
        FromGrpcStatus(agent.stub().Submit(&context, request, &response));
    if (!status.ok()) return status;
    return response;
  }

  static v1::GetNotificationsResponse Notifications(InProcessAgent& agent,
                                                    int64_t wait_ms = 0) {
    grpc::ClientContext context;
    v1::GetNotificationsRequest request;
    request.mutable_wait()->set_nanos(static_cast<int32_t>(wait_ms * 1000000));
    v1::GetNotificationsResponse response;
    const absl::Status status = FromGrpcStatus(
        agent.stub().GetNotifications(&context, request, &response));
    EXPECT_TRUE(status.ok()) << status;
    return response;
  }

  std::string Expected() const {
    return GetParam() == "memory" ? "memory" : GetParam();
  }

  // Outlives the agents (declared first); their backends share it.
  std::shared_ptr<verbs::SoftFabric> fabric_ =
      std::make_shared<verbs::SoftFabric>();
  std::unique_ptr<InProcessAgent> a_;
  std::unique_ptr<InProcessAgent> owned_b_;
  InProcessAgent* b_ = nullptr;  // a_ itself for the memory backend
  std::string a_id_;
};

TEST_P(NotificationsApiTest, OwnerHasTheBytesOnceItHasTheNotification) {
  std::string local_bytes, remote_before;
  const v1::RegisterResponse local = Buffer(*a_, 1, &local_bytes);
  const v1::RegisterResponse remote = Buffer(*b_, 90, &remote_before);
  constexpr uint64_t kFrom = 4097, kTo = 70001, kLength = 300001;
  auto response = Submit(
      *a_, Request({MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL, local.buffer_id(),
                           kFrom, kLength, remote, kTo)},
                   "kv block 7 ready"));
  ASSERT_TRUE(response.ok()) << response.status();
  ASSERT_EQ(response->results(0).code(), 0) << response->ShortDebugString();
  EXPECT_EQ(response->results(0).backend(), Expected());
  ASSERT_EQ(response->notifications_size(), 1);
  const v1::NotificationResult& sent = response->notifications(0);
  EXPECT_EQ(sent.code(), 0) << sent.ShortDebugString();
  EXPECT_EQ(sent.backend(), Expected());
  EXPECT_EQ(sent.buffer_id(), remote.buffer_id());
  EXPECT_EQ(sent.agent_id(), Info(*b_).agent_id());

  const v1::GetNotificationsResponse got = Notifications(*b_);
  ASSERT_EQ(got.notifications_size(), 1);
  EXPECT_EQ(got.dropped(), 0u);
  const v1::Notification& notification = got.notifications(0);
  EXPECT_EQ(notification.from_agent_id(), a_id_);
  EXPECT_EQ(notification.buffer_id(), remote.buffer_id());
  EXPECT_EQ(notification.data(), "kv block 7 ready");
  // Having the notification, the owner sees every byte, and nothing else
  // changed.
  const std::string after = Contents(*b_, remote.buffer_id());
  ASSERT_EQ(after.size(), kSize);
  EXPECT_EQ(after.substr(0, kTo), remote_before.substr(0, kTo));
  EXPECT_EQ(after.substr(kTo, kLength), local_bytes.substr(kFrom, kLength));
  EXPECT_EQ(after.substr(kTo + kLength), remote_before.substr(kTo + kLength));
  // Exactly once.
  EXPECT_EQ(Notifications(*b_).notifications_size(), 0);
}

TEST_P(NotificationsApiTest, ReadsNotifyTooAndEachBufferGetsOne) {
  const v1::RegisterResponse local = Buffer(*a_, 1, nullptr);
  std::string x_bytes;
  const v1::RegisterResponse x = Buffer(*b_, 2, &x_bytes);
  const v1::RegisterResponse y = Buffer(*b_, 3, nullptr);
  auto response =
      Submit(*a_, Request({MakeOp(v1::OP_TYPE_READ_INTO_LOCAL,
                                  local.buffer_id(), 0, 4096, x, 0),
                           MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL,
                                  local.buffer_id(), 8192, 100, y, 5),
                           MakeOp(v1::OP_TYPE_READ_INTO_LOCAL,
                                  local.buffer_id(), 4096, 10, x, 4096)},
                          "done"));
  ASSERT_TRUE(response.ok()) << response.status();
  for (const auto& result : response->results()) ASSERT_EQ(result.code(), 0);
  ASSERT_EQ(response->notifications_size(), 2);
  EXPECT_EQ(response->notifications(0).buffer_id(), x.buffer_id());
  EXPECT_EQ(response->notifications(1).buffer_id(), y.buffer_id());
  const v1::GetNotificationsResponse got = Notifications(*b_);
  ASSERT_EQ(got.notifications_size(), 2);
  EXPECT_EQ(got.notifications(0).buffer_id(), x.buffer_id());
  EXPECT_EQ(got.notifications(1).buffer_id(), y.buffer_id());
  EXPECT_EQ(got.notifications(1).sequence(),
            got.notifications(0).sequence() + 1);
  // The read landed before the initiator's Submit returned.
  EXPECT_EQ(Contents(*a_, local.buffer_id()).substr(0, 4106),
            x_bytes.substr(0, 4106));
}

TEST_P(NotificationsApiTest, FailedOpOnTheAgentSendsNothing) {
  const v1::RegisterResponse local = Buffer(*a_, 1, nullptr);
  const v1::RegisterResponse kept = Buffer(*b_, 2, nullptr);
  const v1::RegisterResponse gone = Buffer(*b_, 3, nullptr);
  {
    grpc::ClientContext context;
    v1::ReleaseRequest release;
    release.set_buffer_id(gone.buffer_id());
    v1::ReleaseResponse ignored;
    ASSERT_TRUE(b_->stub().Release(&context, release, &ignored).ok());
  }
  auto response =
      Submit(*a_, Request({MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL,
                                  local.buffer_id(), 0, 64, kept, 0),
                           MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL,
                                  local.buffer_id(), 0, 64, gone, 0)},
                          "never"));
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->results(0).code(), 0);
  EXPECT_EQ(response->results(1).code(),
            static_cast<int>(absl::StatusCode::kNotFound))
      << response->ShortDebugString();
  ASSERT_EQ(response->notifications_size(), 2);
  for (const auto& sent : response->notifications()) {
    EXPECT_EQ(sent.code(), static_cast<int>(absl::StatusCode::kAborted))
        << sent.ShortDebugString();
    EXPECT_NE(sent.message().find("op 1"), std::string::npos) << sent.message();
    EXPECT_EQ(sent.backend(), "");
  }
  EXPECT_EQ(Notifications(*b_, 100).notifications_size(), 0);
}

TEST_P(NotificationsApiTest, PassedDeadlineSendsNothing) {
  const v1::RegisterResponse local = Buffer(*a_, 1, nullptr);
  const v1::RegisterResponse remote = Buffer(*b_, 2, nullptr);
  v1::SubmitRequest request =
      Request({MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL, local.buffer_id(), 0, kSize,
                      remote, 0)},
              "late");
  request.mutable_timeout()->set_seconds(0);
  request.mutable_timeout()->set_nanos(1);
  auto response = Submit(*a_, request);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->results(0).code(),
            static_cast<int>(absl::StatusCode::kDeadlineExceeded));
  ASSERT_EQ(response->notifications_size(), 1);
  EXPECT_NE(response->notifications(0).code(), 0);
  EXPECT_EQ(Notifications(*b_, 100).notifications_size(), 0);
}

TEST_P(NotificationsApiTest, AsyncTransferReportsItsNotification) {
  const v1::RegisterResponse local = Buffer(*a_, 1, nullptr);
  const v1::RegisterResponse remote = Buffer(*b_, 2, nullptr);
  grpc::ClientContext submit_context;
  v1::SubmitAsyncResponse submitted;
  ASSERT_TRUE(
      a_->stub()
          .SubmitAsync(&submit_context,
                       Request({MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL,
                                       local.buffer_id(), 0, 4096, remote, 0)},
                               "async"),
                       &submitted)
          .ok());
  // The owner's long poll wakes with it.
  const v1::GetNotificationsResponse got = Notifications(*b_, 900);
  ASSERT_EQ(got.notifications_size(), 1);
  EXPECT_EQ(got.notifications(0).data(), "async");
  grpc::ClientContext context;
  v1::GetTransfersRequest request;
  request.add_transfer_ids(submitted.transfer_id());
  request.mutable_wait()->set_seconds(20);
  v1::GetTransfersResponse transfers;
  ASSERT_TRUE(a_->stub().GetTransfers(&context, request, &transfers).ok());
  const v1::Transfer& transfer = transfers.transfers(0);
  EXPECT_EQ(transfer.state(), v1::TRANSFER_STATE_DONE);
  ASSERT_EQ(transfer.notifications_size(), 1);
  EXPECT_EQ(transfer.notifications(0).code(), 0);
  EXPECT_EQ(transfer.notifications(0).backend(), Expected());
}

TEST_P(NotificationsApiTest, WatchStreamReceivesIt) {
  const v1::RegisterResponse local = Buffer(*a_, 1, nullptr);
  const v1::RegisterResponse remote = Buffer(*b_, 2, nullptr);
  grpc::ClientContext watch_context;
  auto watch = b_->stub().WatchNotifications(&watch_context, {});
  // The stream is open once the agent has seen it; a GetInfo on the same
  // channel after it is ordered behind on the agent.
  absl::SleepFor(absl::Milliseconds(100));
  auto response =
      Submit(*a_, Request({MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL,
                                  local.buffer_id(), 0, 16, remote, 0)},
                          "streamed"));
  ASSERT_TRUE(response.ok()) << response.status();
  ASSERT_EQ(response->notifications(0).code(), 0);
  v1::NotificationEvent event;
  ASSERT_TRUE(watch->Read(&event));
  EXPECT_EQ(event.notification().data(), "streamed");
  EXPECT_EQ(event.notification().from_agent_id(), a_id_);
  watch_context.TryCancel();
  while (watch->Read(&event)) {
  }
  EXPECT_EQ(watch->Finish().error_code(), grpc::StatusCode::CANCELLED);
}

TEST_P(NotificationsApiTest, OversizedNotificationIsRefusedWhole) {
  const v1::RegisterResponse local = Buffer(*a_, 1, nullptr);
  const v1::RegisterResponse remote = Buffer(*b_, 2, nullptr);
  const v1::SubmitRequest request =
      Request({MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL, local.buffer_id(), 0, 16,
                      remote, 0)},
              std::string(4097, 'n'));
  auto response = Submit(*a_, request);
  EXPECT_EQ(response.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(response.status().message().find("Submit: the notification is "
                                             "4097 bytes; at most 4096"),
            std::string::npos)
      << response.status();
  grpc::ClientContext context;
  v1::SubmitAsyncResponse ignored;
  const absl::Status async =
      FromGrpcStatus(a_->stub().SubmitAsync(&context, request, &ignored));
  EXPECT_EQ(async.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(async.message().find("SubmitAsync: the notification"),
            std::string::npos)
      << async;
  EXPECT_EQ(Notifications(*b_).notifications_size(), 0);
}

TEST_P(NotificationsApiTest, RestartedTargetGetsNothing) {
  if (GetParam() == "memory") GTEST_SKIP() << "the target is the initiator";
  const v1::RegisterResponse local = Buffer(*a_, 1, nullptr);
  const v1::RegisterResponse remote = Buffer(*b_, 2, nullptr);
  ASSERT_TRUE(owned_b_->Restart().ok());
  auto response =
      Submit(*a_, Request({MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL,
                                  local.buffer_id(), 0, 16, remote, 0)},
                          "stale"));
  ASSERT_TRUE(response.ok()) << response.status();
  // The restarted agent listens elsewhere (UNAVAILABLE) or answers that
  // the context is stale (FAILED_PRECONDITION): either way the op failed.
  EXPECT_NE(response->results(0).code(), 0);
  ASSERT_EQ(response->notifications_size(), 1);
  EXPECT_EQ(response->notifications(0).code(),
            static_cast<int>(absl::StatusCode::kAborted));
  EXPECT_EQ(Notifications(*b_, 100).notifications_size(), 0);
}

INSTANTIATE_TEST_SUITE_P(Backends, NotificationsApiTest,
                         ::testing::Values("memory", "tcp", "ibverbs"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace rdma_agent

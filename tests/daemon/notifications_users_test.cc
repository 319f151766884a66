// Notifications go to the owner of the target buffer and to nobody else:
// two other local users (client_worker processes that drop to uids 65533
// and 65534 before connecting) each own a buffer that root's batches write
// into with a notification; each user gets exactly its own, and root, who
// sent them, gets none. Needs root to switch users.

#include <unistd.h>

#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/client/worker_process.h"
#include "tests/testing/agent_fixture.h"

namespace rdma_agent::testing {
namespace {

constexpr int kFirst = 65533;
constexpr int kSecond = 65534;
constexpr int kReadWrite = 3;  // v1::ACCESS_READ_WRITE

WorkerProcess StartWorker(InProcessAgent& agent, int uid) {
  WorkerProcess::Options options;
  options.uid = uid;
  options.gid = uid;
  auto worker = WorkerProcess::Start(
      agent.agent().target(), agent.agent().attach_socket_path(), options);
  EXPECT_TRUE(worker.ok()) << worker.status();
  return std::move(*worker);
}

TEST(NotificationsUsersTest, EachOwnerGetsOnlyItsOwn) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run other users";
  auto agent = InProcessAgent::Start();
  ASSERT_TRUE(agent.ok()) << agent.status();
  WorkerProcess first = StartWorker(**agent, kFirst);
  WorkerProcess second = StartWorker(**agent, kSecond);
  auto local = (*agent)->Allocate(4096);
  ASSERT_TRUE(local.ok()) << local.status();

  for (auto [worker, text] :
       {std::pair{&first, "for-first"}, std::pair{&second, "for-second"}}) {
    auto words = worker->CallWords(absl::StrCat("allocate 4096 ", kReadWrite));
    ASSERT_TRUE(words.ok()) << words.status();
    auto target = ParseRegistered(*words);
    ASSERT_TRUE(target.ok()) << target.status();
    std::string context;
    ASSERT_TRUE(absl::Base64Unescape(target->context, &context));
    grpc::ClientContext call;
    v1::SubmitRequest request;
    v1::Op* op = request.add_ops();
    op->set_type(v1::OP_TYPE_WRITE_FROM_LOCAL);
    op->set_local_buffer_id(local->buffer_id());
    op->set_length(64);
    op->set_remote_context(context);
    request.set_notification(text);
    v1::SubmitResponse response;
    ASSERT_TRUE((*agent)->stub().Submit(&call, request, &response).ok());
    ASSERT_EQ(response.results(0).code(), 0) << response.ShortDebugString();
    ASSERT_EQ(response.notifications(0).code(), 0)
        << response.ShortDebugString();
  }

  EXPECT_EQ(first.Answer("notifications 2000"),
            "notifications 1 for-first dropped 0");
  EXPECT_EQ(second.Answer("notifications 2000"),
            "notifications 1 for-second dropped 0");
  // Each once; and the sender has none of them.
  EXPECT_EQ(first.Answer("notifications 0"), "notifications 0 - dropped 0");
  grpc::ClientContext call;
  v1::GetNotificationsResponse mine;
  ASSERT_TRUE((*agent)->stub().GetNotifications(&call, {}, &mine).ok());
  EXPECT_EQ(mine.notifications_size(), 0);
}

}  // namespace
}  // namespace rdma_agent::testing

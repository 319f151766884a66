// Clients that mistreat the memory they attached, or the attach socket, must
// not crash the agent: after each, the agent still answers, and the memory it
// was handed keeps serving ops (the agent holds its own mapping).

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/internal/attach_socket.h"
#include "common/unique_fd.h"
#include "gtest/gtest.h"
#include "rdma/agent/v1/attach.pb.h"
#include "tests/client/worker_process.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/pattern.h"

namespace rdma_agent::testing {
namespace {

namespace v1 = ::rdma::agent::v1;
constexpr int kReadWrite = 3;  // v1::ACCESS_READ_WRITE
constexpr uint64_t kSize = (1 << 20) + 3;

class MisbehavingClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto agent = AgentProcess::Start();
    ASSERT_TRUE(agent.ok()) << agent.status();
    agent_ = std::move(*agent);
    auto reader = WorkerProcess::Start(*agent_);
    ASSERT_TRUE(reader.ok()) << reader.status();
    reader_.emplace(std::move(*reader));
    auto buffer =
        reader_->CallWords(absl::StrCat("allocate ", kSize, " ", kReadWrite));
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    auto parsed = ParseRegistered(*buffer);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    local_ = *parsed;
  }

  // The agent answers, and the reader can still pull all of `context` (a
  // buffer filled with pattern `seed`) into its own buffer.
  void ExpectAgentServes(const std::string& context, uint64_t seed) {
    ASSERT_TRUE(agent_->Running()) << agent_->Log();
    EXPECT_EQ(reader_->Answer("info"), "status OK");
    EXPECT_EQ(reader_->Answer(absl::StrCat("fill ", local_.id, " 1")), "ok");
    auto result = reader_->CallWords(
        absl::StrCat("submit read ", local_.id, " 0 ", kSize, " 0 ", context));
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_GE(result->size(), 2u);
    EXPECT_EQ((*result)[1], "OK") << absl::StrJoin(*result, " ");
    EXPECT_EQ(reader_->Answer(absl::StrCat("verify ", local_.id, " ", seed,
                                           " 0 0 ", kSize, " 1")),
              "ok");
  }

  std::unique_ptr<AgentProcess> agent_;
  std::optional<WorkerProcess> reader_;
  WorkerBuffer local_;
};

TEST_F(MisbehavingClientTest, UnmappedClosedAndShrunkMemoryKeepsServing) {
  auto dropper = WorkerProcess::Start(*agent_);
  ASSERT_TRUE(dropper.ok()) << dropper.status();
  // Attaches a memfd with pattern 5, tries to shrink it (the seal refuses),
  // then unmaps and closes it.
  auto words =
      dropper->CallWords(absl::StrCat("attach_and_drop ", kSize, " 5"));
  ASSERT_TRUE(words.ok()) << words.status();
  ASSERT_EQ(words->size(), 4u) << absl::StrJoin(*words, " ");
  ASSERT_EQ((*words)[0], "ok");
  EXPECT_EQ((*words)[3], "EPERM");
  const std::string dropped_id = (*words)[1];
  const std::string dropped_context = (*words)[2];
  ExpectAgentServes(dropped_context, 5);

  // Writes into it land in the agent's mapping of the memory, which its
  // owner can still read over gRPC: bytes 7..10 from pattern 2, the ones
  // around them still pattern 5.
  ASSERT_EQ(reader_->Answer(absl::StrCat("fill ", local_.id, " 2")), "ok");
  auto result = reader_->CallWords(
      absl::StrCat("submit write ", local_.id, " 0 4 7 ", dropped_context));
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_GE(result->size(), 2u);
  EXPECT_EQ((*result)[1], "OK");
  const std::string expected = absl::StrCat(
      PatternString(5, 6, 1), PatternString(2, 0, 4), PatternString(5, 11, 1));
  EXPECT_EQ(dropper->Answer(absl::StrCat("readbuf ", dropped_id, " 6 6")),
            absl::StrCat("status OK ", absl::BytesToHexString(expected)));
  EXPECT_EQ(dropper->Answer(absl::StrCat("release ", dropped_id)), "status OK");
}

TEST_F(MisbehavingClientTest, KilledClientsMemoryKeepsServing) {
  auto victim = WorkerProcess::Start(*agent_);
  ASSERT_TRUE(victim.ok()) << victim.status();
  // Agent lifetime: the registration is meant to outlive its client (with
  // the default, process lifetime, the agent would release it at the kill).
  auto words = victim->CallWords(
      absl::StrCat("attach ", kSize, " ", kReadWrite, " agent"));
  ASSERT_TRUE(words.ok()) << words.status();
  auto attached = ParseRegistered(*words);
  ASSERT_TRUE(attached.ok()) << attached.status();
  ASSERT_EQ(victim->Answer(absl::StrCat("fill ", attached->id, " 9")), "ok");
  // SIGKILL: the process's mapping and fd go without any Release.
  victim->process().Signal(SIGKILL);
  auto code = victim->process().Wait(absl::Seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 128 + SIGKILL);
  ExpectAgentServes(attached->context, 9);
}

// Speaks to the attach socket by hand.
UniqueFd ConnectAttach(const std::string& path) {
  UniqueFd sock(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  struct sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  if (::connect(sock.get(), reinterpret_cast<struct sockaddr*>(&addr),
                sizeof(addr)) != 0) {
    ADD_FAILURE() << "connect " << path << ": " << std::strerror(errno);
  }
  return sock;
}

TEST_F(MisbehavingClientTest, BrokenAttachConversationsAreRefusedOrDropped) {
  const std::string path = agent_->attach_socket_path();
  {
    // Half a length prefix, then gone.
    UniqueFd sock = ConnectAttach(path);
    ASSERT_EQ(::write(sock.get(), "\x05\x00", 2), 2);
  }
  {
    // A frame that claims 1 GiB.
    UniqueFd sock = ConnectAttach(path);
    ASSERT_EQ(::write(sock.get(), "\x00\x00\x00\x40", 4), 4);
  }
  auto exchange = [&](int fd) {
    v1::AttachRequest request;
    request.mutable_attach();
    auto reply = client::internal::ExchangeOnAttachSocket(path, request, fd,
                                                          absl::Seconds(30));
    EXPECT_TRUE(reply.ok()) << reply.status();
    return reply.ok() ? client::internal::ResponseStatus(reply->response)
                      : reply.status();
  };
  // No fd, a pipe instead of a memfd, an unsealed memfd, an empty one.
  EXPECT_EQ(exchange(-1).code(), absl::StatusCode::kInvalidArgument);
  int pipe_fds[2];
  ASSERT_EQ(::pipe2(pipe_fds, O_CLOEXEC), 0);
  UniqueFd pipe_read(pipe_fds[0]), pipe_write(pipe_fds[1]);
  EXPECT_EQ(exchange(pipe_read.get()).code(),
            absl::StatusCode::kInvalidArgument);
  UniqueFd unsealed(
      ::memfd_create("unsealed", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  ASSERT_EQ(::ftruncate(unsealed.get(), 4096), 0);
  EXPECT_EQ(exchange(unsealed.get()).code(),
            absl::StatusCode::kInvalidArgument);
  UniqueFd empty(::memfd_create("empty", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  ASSERT_EQ(::fcntl(empty.get(), F_ADD_SEALS, F_SEAL_SHRINK), 0);
  EXPECT_EQ(exchange(empty.get()).code(), absl::StatusCode::kInvalidArgument);

  ASSERT_TRUE(agent_->Running()) << agent_->Log();
  EXPECT_EQ(reader_->Answer("info"), "status OK");
  // And a well-formed attach still works afterwards.
  EXPECT_EQ(
      reader_->Answer(absl::StrCat("attach 4096 ", kReadWrite)).substr(0, 3),
      "ok ");
}

}  // namespace
}  // namespace rdma_agent::testing

// Strangers on a real rdma-agentd's tcp data plane that speak the protocol:
// well-formed requests without a valid token. A kNotify must be refused on
// its header and token, before its payload is read or buffered; refused
// requests must not buy a connection time beyond the handshake timeout,
// which for a connection that never presented a valid token is an absolute
// deadline from accept; so such strangers cannot keep real peers out.
// Attackers bind 127.0.0.2 and up: on loopback, distinct sources.

#include <sys/resource.h>

#include <atomic>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "backends/tcp/wire.h"
#include "client/rdma_agent_client.h"
#include "gtest/gtest.h"
#include "rdma/agent/v1/remote_buffer.pb.h"
#include "tests/security/raw_data_peer.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/eventually.h"
#include "tests/testing/process.h"

namespace rdma_agent::testing {
namespace {

namespace v1 = ::rdma::agent::v1;
using tcp::RequestHeader;
using tcp::RequestKind;

constexpr int64_t kMiB = 1 << 20;

// A request naming a buffer the stranger guesses, with a guessed token.
std::string GuessedRead(uint64_t request_id) {
  RequestHeader header;
  header.kind = RequestKind::kRead;
  header.request_id = request_id;
  header.epoch = 1;
  header.buffer_id = 1;
  header.length = 16;
  header.token_bytes = 5;
  return RawDataConnection::Request(header, "guess");
}

class DataServerStrangersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &limit_), 0);
    rlimit raised = limit_;
    raised.rlim_cur = limit_.rlim_max;
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &raised), 0);
  }

  void TearDown() override {
    if (HasFailure()) {
      if (victim_) ADD_FAILURE() << "attacked agent's log:\n" << victim_->Log();
      if (peer_) ADD_FAILURE() << "peer agent's log:\n" << peer_->Log();
    }
    victim_.reset();
    peer_.reset();
    setrlimit(RLIMIT_NOFILE, &limit_);
  }

  void StartVictim(std::vector<std::string> flags) {
    auto victim =
        AgentProcess::Start(TcpAgentOptions("127.0.0.1", "", std::move(flags)));
    ASSERT_TRUE(victim.ok()) << victim.status();
    victim_ = std::move(*victim);
  }

  rlimit limit_{};
  std::unique_ptr<AgentProcess> victim_;
  std::unique_ptr<AgentProcess> peer_;
};

// The defect: the kNotify branch reserved and read the whole declared
// payload (up to 1 MiB) and proved the token only once it was in, holding
// it until the request timeout.
TEST_F(DataServerStrangersTest, TokenlessNotifyIsRefusedBeforeItsPayload) {
  // A long handshake timeout: a connection closed within seconds was closed
  // for its refusal, not for its deadline.
  ASSERT_NO_FATAL_FAILURE(StartVictim({"--tcp_handshake_timeout=30s"}));
  auto owned = victim_->client().AllocateUnmapped(4096, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(owned.ok()) << owned.status();
  const pid_t pid = victim_->pid();
  const int64_t rss_before = ProcessStatusBytes(pid, "VmRSS");
  ASSERT_GT(rss_before, 0);

  constexpr int kConnections = 256;
  constexpr uint64_t kDeclared = 1 << 20;
  // The stranger knows the epoch and the buffer id (an old context, say),
  // not the token.
  v1::RemoteBuffer context;
  ASSERT_TRUE(context.ParseFromString(owned->remote_context));
  RequestHeader header;
  header.kind = RequestKind::kNotify;
  header.epoch = context.agent_epoch();
  header.buffer_id = owned->id;
  header.length = kDeclared;
  header.token_bytes = 0;
  // All but the last byte: an agent that reads payloads first holds all of
  // it while it waits for that byte.
  const std::string attack =
      RawDataConnection::Request(header, "", std::string(kDeclared - 1, 'n'));
  std::vector<RawDataConnection> strangers;
  for (int i = 0; i < kConnections; ++i) {
    // 32 per source: under the per-source cap of 64.
    auto connection = RawDataConnection::Dial(
        victim_->tcp_port(), absl::StrCat("127.0.0.", 2 + i / 32));
    ASSERT_TRUE(connection.ok())
        << "connection " << i << ": " << connection.status();
    // Refused at once, the agent closes the connection while the payload is
    // still coming: the send then fails, which is what we want.
    (void)connection->Send(attack);
    strangers.push_back(std::move(*connection));
  }
  const absl::Time sent = absl::Now();
  absl::SleepFor(absl::Milliseconds(500));
  const int64_t grown = ProcessStatusBytes(pid, "VmRSS") - rss_before;
  std::cout << kConnections << " tokenless kNotify of " << kDeclared
            << " bytes: agent RSS grew by " << grown / kMiB << " MiB\n";
  EXPECT_LT(grown, 48 * kMiB)
      << "the agent's RSS grew by " << grown / kMiB << " MiB for "
      << kConnections << " tokenless notifications of " << kDeclared
      << " bytes";

  for (int i = 0; i < kConnections; ++i) {
    const absl::Duration left =
        std::max(sent + absl::Seconds(10) - absl::Now(), absl::Seconds(1));
    auto answer = strangers[i].ReadAnswer(left);
    ASSERT_TRUE(answer.ok())
        << "connection " << i << " got no answer to its tokenless kNotify "
        << absl::FormatDuration(absl::Now() - sent)
        << " after sending it: " << answer.status();
    EXPECT_EQ(answer->header.code,
              static_cast<uint32_t>(absl::StatusCode::kNotFound))
        << answer->message;
    ASSERT_TRUE(strangers[i].WaitClosed(
        std::max(sent + absl::Seconds(10) - absl::Now(), absl::Seconds(1))))
        << "connection " << i << " still open";
  }
  // Refused and closed well before the 30 s handshake timeout.
  EXPECT_LT(absl::Now() - sent, absl::Seconds(10));
}

// The defect: every refused request re-armed the handshake timeout, so a
// stranger sending one now and then kept its connection forever.
TEST_F(DataServerStrangersTest, RefusedRequestsDoNotExtendAStrangersDeadline) {
  ASSERT_NO_FATAL_FAILURE(StartVictim({"--tcp_handshake_timeout=2s"}));
  auto stranger = RawDataConnection::Dial(victim_->tcp_port(), "127.0.0.2");
  ASSERT_TRUE(stranger.ok()) << stranger.status();
  const absl::Time accepted = absl::Now();
  int refused = 0;
  absl::Duration lasted = absl::ZeroDuration();
  for (uint64_t id = 1; absl::Now() - accepted < absl::Seconds(10); ++id) {
    if (!stranger->Send(GuessedRead(id)).ok()) break;
    auto answer = stranger->ReadAnswer(absl::Seconds(3));
    if (!answer.ok()) break;
    EXPECT_NE(answer->header.code, 0u);
    ++refused;
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(stranger->WaitClosed(absl::Seconds(1)));
  lasted = absl::Now() - accepted;
  EXPECT_GT(refused, 3) << "the stranger's requests were not answered";
  // 2 s from accept, cut on the 50 ms watchdog tick; generous margin for a
  // loaded machine.
  EXPECT_LT(lasted, absl::Seconds(5))
      << "a stranger sending refused requests kept its connection for "
      << lasted << " (" << refused << " refused requests)";
  EXPECT_GT(lasted, absl::Milliseconds(1500));
}

// The defect's consequence: strangers sending refused requests held every
// slot of the connection cap forever, so a real peer's Submit failed
// UNAVAILABLE for as long as they liked.
TEST_F(DataServerStrangersTest,
       StrangersWithRefusedRequestsCannotKeepAPeerOut) {
  constexpr int kCap = 32;
  ASSERT_NO_FATAL_FAILURE(
      StartVictim({absl::StrCat("--tcp_max_connections=", kCap),
                   "--tcp_handshake_timeout=2s"}));
  auto peer = AgentProcess::Start(TcpAgentOptions());
  ASSERT_TRUE(peer.ok()) << peer.status();
  peer_ = std::move(*peer);
  auto remote =
      victim_->client().AllocateUnmapped(1 << 20, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(remote.ok()) << remote.status();
  auto local = peer_->client().AllocateUnmapped(1 << 20, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(local.ok()) << local.status();

  std::vector<RawDataConnection> strangers;
  for (int i = 0; i < kCap; ++i) {
    auto connection = RawDataConnection::Dial(victim_->tcp_port(), "127.0.0.2");
    ASSERT_TRUE(connection.ok())
        << "connection " << i << ": " << connection.status();
    strangers.push_back(std::move(*connection));
  }
  // Every stranger sends a refused request every ~200 ms, and never dials
  // again once cut.
  std::atomic<bool> stop{false};
  std::atomic<int> alive{kCap};
  std::thread swarm([&] {
    std::vector<bool> cut(strangers.size(), false);
    for (uint64_t id = 1; !stop.load() && alive.load() > 0; ++id) {
      for (size_t i = 0; i < strangers.size(); ++i) {
        if (cut[i]) continue;
        if (!strangers[i].Send(GuessedRead(id)).ok() ||
            !strangers[i].ReadAnswer(absl::Seconds(1)).ok()) {
          cut[i] = true;
          alive.fetch_sub(1);
        }
      }
      absl::SleepFor(absl::Milliseconds(200));
    }
  });

  client::OpSpec op;
  op.type = v1::OP_TYPE_WRITE_FROM_LOCAL;
  op.local_buffer_id = local->id;
  op.length = 64 << 10;
  op.remote_context = remote->remote_context;
  absl::Status last = absl::UnknownError("not tried");
  const absl::Time start = absl::Now();
  const bool got_through = Eventually(
      [&] {
        auto results = peer_->client().Submit({op}, absl::Seconds(5));
        last = results.ok() ? (*results)[0].status : results.status();
        if (!last.ok()) absl::SleepFor(absl::Milliseconds(200));
        return last.ok();
      },
      absl::Seconds(12));
  const absl::Duration waited = absl::Now() - start;
  EXPECT_TRUE(got_through) << "the peer's Submit still fails after " << waited
                           << " of strangers (" << alive.load() << " of "
                           << kCap << " still connected): " << last;
  // Every stranger finds itself cut (the swarm tries each every ~200 ms).
  EXPECT_TRUE(Eventually([&] { return alive.load() == 0; }, absl::Seconds(5)))
      << alive.load() << " strangers outlived their deadline";
  stop.store(true);
  swarm.join();
}

}  // namespace
}  // namespace rdma_agent::testing

// CancelTransfer in the middle of a 1 GiB asynchronous transfer between two
// hosts: two rdma-agentd processes in two network namespaces joined by veth
// (tcp backend), the link throttled to 1 Gbit/s with tc's token bucket so
// that the 1 GiB READ takes seconds and the cancel lands mid-flight.
// Both buffers are memfds mapped here (the client library's Attach).
//
// Once CancelTransfer answers CANCELLED: no byte of the local buffer changes
// any more (a snapshot taken at once still matches seconds later), every
// byte holds either what it held or what the op was moving into it, the
// remote agent sees the transfer's data connections closed, and a new
// transfer on the same buffers moves exactly its ranges, leaving every byte
// outside them as it was. Root only (namespaces, tc), like tcp_netns_test.

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/netns.h"
#include "tests/integration/tcp_checks.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/eventually.h"
#include "tests/testing/pattern.h"
#include "tests/testing/process.h"
#include "tests/testing/transfer_calls.h"

namespace rdma_agent::testing {
namespace {

constexpr uint64_t kGiB = 1ull << 30;
// Bytes of the local buffer before and after the op's range.
constexpr uint64_t kGuard = 4096;
constexpr uint64_t kLocalSeed = 1, kRemoteSeed = 2;

// Data connections `netns`'s agent serves on `port`: "peer:port" of each.
absl::StatusOr<std::vector<std::string>> ServedConnections(
    const std::string& netns, uint16_t port) {
  auto out =
      RunCommand({"ip", "netns", "exec", netns, "ss", "-Htn", "state",
                  "established", absl::StrCat("( sport = :", port, " )")});
  if (!out.ok()) return out.status();
  std::vector<std::string> peers;
  for (absl::string_view line : absl::StrSplit(*out, '\n')) {
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, ' ', absl::SkipWhitespace());
    if (fields.size() >= 4) peers.emplace_back(fields.back());
  }
  return peers;
}

// Positions of `bytes` (the local buffer from its offset `first`) that hold
// neither pattern kLocalSeed at their own position nor pattern kRemoteSeed
// at the position the op reads them from (`first` - kGuard + i): the first
// such one.
std::optional<uint64_t> FindNeitherOldNorMoved(
    absl::Span<const std::byte> bytes, uint64_t first) {
  constexpr uint64_t kChunk = 64 << 10;
  for (uint64_t at = 0; at < bytes.size(); at += kChunk) {
    const auto chunk = bytes.subspan(at, std::min(kChunk, bytes.size() - at));
    const uint64_t position = first + at;
    if (!FindMismatch(chunk, kLocalSeed, position).has_value() ||
        !FindMismatch(chunk, kRemoteSeed, position - kGuard).has_value()) {
      continue;
    }
    for (uint64_t i = 0; i < chunk.size(); ++i) {
      if (chunk[i] != PatternByte(kLocalSeed, position + i) &&
          chunk[i] != PatternByte(kRemoteSeed, position + i - kGuard)) {
        return at + i;
      }
    }
  }
  return std::nullopt;
}

// Index of the first byte where `a` and `b` (same size) differ; nullopt if
// none. memcmp first: these are GiB-sized, and tests build unoptimised.
std::optional<uint64_t> FirstDifference(absl::Span<const std::byte> a,
                                        absl::Span<const std::byte> b) {
  if (std::memcmp(a.data(), b.data(), a.size()) == 0) return std::nullopt;
  constexpr uint64_t kChunk = 64 << 10;
  for (uint64_t at = 0;; at += kChunk) {
    const uint64_t n = std::min<uint64_t>(kChunk, a.size() - at);
    if (std::memcmp(a.data() + at, b.data() + at, n) == 0) continue;
    for (uint64_t i = 0;; ++i) {
      if (a[at + i] != b[at + i]) return at + i;
    }
  }
}

class TransfersNetnsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Not root: fail loudly, never pass silently.
    ASSERT_TRUE(CheckNetnsPrivileges().ok()) << CheckNetnsPrivileges();
    auto pair = NetnsPair::Create();
    ASSERT_TRUE(pair.ok()) << pair.status();
    pair_ = std::move(*pair);
    // b sends the READ's payload: its end of the link is throttled.
    auto throttled = RunCommand(
        {"tc", "-n", pair_->netns(1), "qdisc", "add", "dev", pair_->link(1),
         "root", "tbf", "rate", "1gbit", "burst", "256kb", "latency", "100ms"});
    ASSERT_TRUE(throttled.ok())
        << "tc's token bucket (sch_tbf) is needed to keep the 1 GiB "
           "transfer in flight: "
        << throttled.status();
    for (int side = 0; side < 2; ++side) {
      auto agent = AgentProcess::Start(
          TcpAgentOptions(pair_->address(side), pair_->netns(side)));
      ASSERT_TRUE(agent.ok()) << agent.status();
      agents_[side] = std::move(*agent);
    }
  }

  void TearDown() override {
    if (HasFailure()) {
      for (auto& agent : agents_) {
        if (agent) ADD_FAILURE() << "agent log:\n" << agent->Log();
      }
    }
    // Agents first (they live in the namespaces), then the namespaces.
    agents_[0].reset();
    agents_[1].reset();
    pair_.reset();
  }

  std::unique_ptr<NetnsPair> pair_;
  std::unique_ptr<AgentProcess> agents_[2];
};

TEST_F(TransfersNetnsTest, CancelMidFlightOfOneGibibyteAcrossHosts) {
  AgentProcess& a = *agents_[0];
  AgentProcess& b = *agents_[1];
  auto local =
      a.client().Attach(kGiB + 2 * kGuard, v1::ACCESS_READ_WRITE, "local");
  ASSERT_TRUE(local.ok()) << local.status();
  auto remote = b.client().Attach(kGiB, v1::ACCESS_READ_WRITE, "remote");
  ASSERT_TRUE(remote.ok()) << remote.status();
  {
    std::thread fill_remote([&] { FillPattern(remote->bytes(), kRemoteSeed); });
    FillPattern(local->bytes(), kLocalSeed);
    fill_remote.join();
  }
  auto stub = v1::RdmaAgent::NewStub(a.client().channel());

  auto id = SubmitAsync(
      *stub, MakeBatch({MakeWireOp(v1::OP_TYPE_READ_INTO_LOCAL, *local, kGuard,
                                   kGiB, *remote, 0)},
                       absl::Minutes(10)));
  ASSERT_TRUE(id.ok()) << id.status();
  // Mid-flight: bytes have started to land (a word of the remote's pattern
  // where the op puts it, at 1 MiB steps).
  const absl::Span<const std::byte> bytes = local->bytes();
  const auto landed = [&] {
    for (uint64_t at = 0; at < kGiB; at += 1 << 20) {
      if (!FindMismatch(bytes.subspan(kGuard + at, 8), kRemoteSeed, at)) {
        return true;
      }
    }
    return false;
  };
  ASSERT_TRUE(Eventually(landed, absl::Seconds(60)))
      << "the transfer never moved a byte";
  auto serving = ServedConnections(pair_->netns(1), b.tcp_port());
  ASSERT_TRUE(serving.ok()) << serving.status();
  ASSERT_FALSE(serving->empty()) << "b serves the transfer on no connection";

  auto cancelled = CancelTransfer(*stub, *id);
  // At once: what the local buffer holds now must never change again.
  std::vector<std::byte> snapshot(bytes.size());
  std::memcpy(snapshot.data(), bytes.data(), bytes.size());
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_EQ(cancelled->state(), v1::TRANSFER_STATE_CANCELLED)
      << DescribeFailures(*cancelled);
  ASSERT_EQ(cancelled->results_size(), 1);
  EXPECT_EQ(cancelled->results(0).code(), 1) << cancelled->results(0).message();
  EXPECT_EQ(cancelled->results(0).backend(), "tcp");
  EXPECT_TRUE(cancelled->has_start_time());

  // The snapshot: guards untouched, every byte of the range old or moved,
  // and the op cut short (some of the range still old).
  const absl::Span<const std::byte> image = absl::MakeConstSpan(snapshot);
  EXPECT_EQ(FindMismatch(image.subspan(0, kGuard), kLocalSeed), std::nullopt);
  EXPECT_EQ(
      FindMismatch(image.subspan(kGuard + kGiB), kLocalSeed, kGuard + kGiB),
      std::nullopt);
  const auto neither =
      FindNeitherOldNorMoved(image.subspan(kGuard, kGiB), kGuard);
  EXPECT_EQ(neither, std::nullopt)
      << "byte " << kGuard + *neither << " holds neither its own nor the "
      << "remote's byte";
  EXPECT_TRUE(FindMismatch(image.subspan(kGuard, kGiB), kRemoteSeed, 0))
      << "the whole GiB had arrived: the cancel did not land mid-flight";

  // The remote agent sees the transfer's connections closed.
  absl::StatusOr<std::vector<std::string>> left;
  EXPECT_TRUE(Eventually(
      [&] {
        left = ServedConnections(pair_->netns(1), b.tcp_port());
        return left.ok() && left->empty();
      },
      absl::Seconds(30)))
      << "b still serves "
      << (left.ok() ? absl::StrCat(left->size()) : left.status().ToString())
      << " connections of the cancelled transfer";

  // Seconds later the local buffer is still exactly the snapshot.
  absl::SleepFor(absl::Seconds(2));
  const auto changed = FirstDifference(snapshot, bytes);
  EXPECT_EQ(changed, std::nullopt)
      << "local byte " << *changed << " changed after CancelTransfer returned";

  // A new transfer on the same buffers: a READ of 64 MiB + 3 at odd offsets
  // and a WRITE of 1 MiB + 1 from elsewhere in the local buffer into the
  // middle of the remote.
  constexpr uint64_t kReadAt = 1001, kReadFrom = 777;
  constexpr uint64_t kReadLength = (64ull << 20) + 3;
  constexpr uint64_t kWriteFrom = (256ull << 20) + 5;
  constexpr uint64_t kWriteAt = (512ull << 20) + 1;
  constexpr uint64_t kWriteLength = (1ull << 20) + 1;
  auto again = SubmitAsync(
      *stub,
      MakeBatch({MakeWireOp(v1::OP_TYPE_READ_INTO_LOCAL, *local, kReadAt,
                            kReadLength, *remote, kReadFrom),
                 MakeWireOp(v1::OP_TYPE_WRITE_FROM_LOCAL, *local, kWriteFrom,
                            kWriteLength, *remote, kWriteAt)},
                absl::Minutes(2)));
  ASSERT_TRUE(again.ok()) << again.status();
  auto done = GetTransfer(*stub, *again, absl::Minutes(2));
  ASSERT_TRUE(done.ok()) << done.status();
  ASSERT_EQ(done->state(), v1::TRANSFER_STATE_DONE) << DescribeFailures(*done);
  for (const v1::OpResult& result : done->results()) {
    EXPECT_EQ(result.backend(), "tcp");
  }
  // Local: the READ's range holds the remote's bytes; every other byte is
  // as the snapshot had it.
  EXPECT_EQ(
      FindMismatch(bytes.subspan(kReadAt, kReadLength), kRemoteSeed, kReadFrom),
      std::nullopt);
  const absl::Span<const std::byte> image_now = absl::MakeConstSpan(snapshot);
  const auto before =
      FirstDifference(image_now.subspan(0, kReadAt), bytes.subspan(0, kReadAt));
  EXPECT_EQ(before, std::nullopt)
      << "local byte " << *before << " before the READ's range changed";
  const uint64_t read_end = kReadAt + kReadLength;
  const auto after =
      FirstDifference(image_now.subspan(read_end), bytes.subspan(read_end));
  EXPECT_EQ(after, std::nullopt)
      << "local byte " << read_end + *after << " after the READ's range "
      << "changed";
  // Remote: the WRITE's range holds what the local buffer held there (the
  // snapshot: the READ's range is elsewhere); every other byte its own.
  const absl::Span<const std::byte> far = remote->bytes();
  const auto carried =
      FirstDifference(image_now.subspan(kWriteFrom, kWriteLength),
                      far.subspan(kWriteAt, kWriteLength));
  EXPECT_EQ(carried, std::nullopt)
      << "remote byte " << kWriteAt + *carried
      << " is not the local byte the WRITE carried";
  EXPECT_EQ(FindMismatch(far.subspan(0, kWriteAt), kRemoteSeed), std::nullopt)
      << "remote bytes before the WRITE's range changed";
  EXPECT_EQ(FindMismatch(far.subspan(kWriteAt + kWriteLength), kRemoteSeed,
                         kWriteAt + kWriteLength),
            std::nullopt)
      << "remote bytes after the WRITE's range changed";
}

}  // namespace
}  // namespace rdma_agent::testing

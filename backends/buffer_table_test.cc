#include "backends/buffer_table.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/shared_memory.h"
#include "gtest/gtest.h"

namespace rdma_agent {
namespace {

constexpr uint64_t kEpoch = 7;
constexpr uid_t kOwner = 1000;
constexpr uid_t kOther = 1001;

std::shared_ptr<Registration> MakeRegistration(uint64_t id, v1::Access access,
                                               uint64_t size = 4096) {
  auto memory = SharedMemory::Allocate(size, "buffer_table_test");
  EXPECT_TRUE(memory.ok()) << memory.status();
  return std::make_shared<Registration>(id, kOwner, access, "label",
                                        "token-" + std::to_string(id),
                                        std::move(*memory),
                                        /*agent_allocated=*/true);
}

ServeRequest Request(uint64_t id, bool write = false) {
  ServeRequest request;
  request.agent_epoch = kEpoch;
  request.buffer_id = id;
  request.token = "token-" + std::to_string(id);
  request.offset = 0;
  request.length = 16;
  request.write = write;
  return request;
}

TEST(BufferTableTest, OwnerScopingHidesForeignIds) {
  BufferTable table(kEpoch);
  const uint64_t id = table.NextId();
  table.Add(MakeRegistration(id, v1::ACCESS_READ_WRITE));
  EXPECT_TRUE(table.Find(id, kOwner).ok());
  EXPECT_TRUE(table.Find(id, /*root=*/0).ok());
  EXPECT_EQ(table.Find(id, kOther).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(table.Find(id + 1, kOwner).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(table.Find(id, kOther).status(),
            absl::NotFoundError(absl::StrCat("no buffer with id ", id)));
  EXPECT_EQ(table.ListOwnedBy(kOther).size(), 0u);
  EXPECT_EQ(table.ListOwnedBy(kOwner).size(), 1u);
  EXPECT_EQ(table.Remove(id, kOther).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(table.Remove(id, kOwner).ok());
  EXPECT_EQ(table.Find(id, kOwner).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(BufferTableTest, UnpublishingMarksARegistrationReleased) {
  BufferTable table(kEpoch);
  auto removed = MakeRegistration(table.NextId(), v1::ACCESS_READ_WRITE);
  auto cleared = MakeRegistration(table.NextId(), v1::ACCESS_READ_WRITE);
  table.Add(removed);
  table.Add(cleared);
  EXPECT_EQ(table.Remove(removed->id(), kOther).code(),
            absl::StatusCode::kNotFound);
  EXPECT_FALSE(removed->released()) << "a refused Remove releases nothing";
  ASSERT_TRUE(table.Remove(removed->id(), kOwner).ok());
  EXPECT_TRUE(removed->released());
  EXPECT_FALSE(cleared->released());
  table.Clear();
  EXPECT_TRUE(cleared->released());
}

TEST(BufferTableTest, IdsAreNeverReused) {
  BufferTable table(kEpoch);
  EXPECT_NE(table.NextId(), table.NextId());
}

TEST(BufferTableTest, PeerChecksInContractOrder) {
  BufferTable table(kEpoch);
  table.Add(MakeRegistration(1, v1::ACCESS_READ));

  ASSERT_TRUE(table.ResolveForPeer(Request(1)).ok());

  ServeRequest stale = Request(1);
  stale.agent_epoch = kEpoch + 1;
  EXPECT_EQ(table.ResolveForPeer(stale).status(), StaleContextError());

  // Unknown id and wrong token are indistinguishable, and a wrong token is
  // refused before access and range are looked at.
  EXPECT_EQ(table.ResolveForPeer(Request(2)).status(), NotRegisteredError());
  ServeRequest forged = Request(1, /*write=*/true);
  forged.token = "token-x";
  forged.length = 1 << 20;
  EXPECT_EQ(table.ResolveForPeer(forged).status(), NotRegisteredError());

  EXPECT_EQ(table.ResolveForPeer(Request(1, /*write=*/true)).status().code(),
            absl::StatusCode::kPermissionDenied);
  ServeRequest empty = Request(1);
  empty.length = 0;
  EXPECT_EQ(table.ResolveForPeer(empty).status().code(),
            absl::StatusCode::kInvalidArgument);
  ServeRequest past_end = Request(1);
  past_end.offset = 4090;
  EXPECT_EQ(table.ResolveForPeer(past_end).status().code(),
            absl::StatusCode::kOutOfRange);
  ServeRequest overflow = Request(1);
  overflow.offset = ~uint64_t{0};
  EXPECT_EQ(table.ResolveForPeer(overflow).status().code(),
            absl::StatusCode::kOutOfRange);

  // Proof only: token is enough, access and range are the caller's.
  ServeRequest proof = Request(1, /*write=*/true);
  proof.proof_only = true;
  proof.length = 0;
  EXPECT_TRUE(table.ResolveForPeer(proof).ok());
}

// Spins (bounded) until the coarse clock reads later than `nanos`, so that
// a stamp taken afterwards is distinguishable from it.
void WaitForCoarseClockPast(int64_t nanos) {
  for (int i = 0; i < 10000 && CoarseNowNanos() <= nanos; ++i) {
    absl::SleepFor(absl::Microseconds(500));
  }
  ASSERT_GT(CoarseNowNanos(), nanos);
}

TEST(BufferTableTest, ServedRequestsStampLastUseRefusedOnesDoNot) {
  BufferTable table(kEpoch);
  auto registration = MakeRegistration(1, v1::ACCESS_READ);
  table.Add(registration);
  const int64_t created = registration->create_time_nanos();
  EXPECT_EQ(registration->last_use_nanos(), created);
  WaitForCoarseClockPast(created);

  ServeRequest forged = Request(1);
  forged.token = "token-x";
  EXPECT_FALSE(table.ResolveForPeer(forged).ok());
  EXPECT_FALSE(table.ResolveForPeer(Request(1, /*write=*/true)).ok());
  EXPECT_EQ(registration->last_use_nanos(), created)
      << "a refused request is no use of the buffer";

  ASSERT_TRUE(table.ResolveForPeer(Request(1)).ok());
  EXPECT_GT(registration->last_use_nanos(), created);
  EXPECT_EQ(registration->create_time_nanos(), created);
}

TEST(BufferTableTest, RemovalListenerHearsEachRemoveUntilUnset) {
  BufferTable table(kEpoch);
  for (uint64_t id : {1, 2, 3}) {
    table.Add(MakeRegistration(id, v1::ACCESS_READ_WRITE));
  }
  std::vector<uint64_t> heard;
  table.SetRemovalListener([&](uint64_t id) { heard.push_back(id); });
  ASSERT_TRUE(table.Remove(2, kOwner).ok());
  EXPECT_FALSE(table.Remove(2, kOwner).ok());
  EXPECT_FALSE(table.Remove(1, kOther).ok()) << "refused: not a removal";
  EXPECT_EQ(heard, std::vector<uint64_t>{2});
  table.SetRemovalListener(nullptr);
  ASSERT_TRUE(table.Remove(1, kOwner).ok());
  EXPECT_EQ(heard, std::vector<uint64_t>{2});
  table.Clear();
}

TEST(BufferTableTest, RemovedBufferLivesWhilePinned) {
  BufferTable table(kEpoch);
  table.Add(MakeRegistration(1, v1::ACCESS_READ_WRITE));
  auto pinned = table.ResolveForPeer(Request(1));
  ASSERT_TRUE(pinned.ok());
  ASSERT_TRUE(table.Remove(1, kOwner).ok());
  EXPECT_EQ(table.ResolveForPeer(Request(1)).status(), NotRegisteredError());
  (*pinned)->data()[0] = std::byte{1};  // still mapped
  table.Clear();
}

}  // namespace
}  // namespace rdma_agent

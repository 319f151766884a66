#include "backends/buffer_table.h"

#include <memory>
#include <set>
#include <string>
#include <thread>
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

// The Speck64/128 known answer of the cipher's designers (Beaulieu et al.,
// "The SIMON and SPECK Families of Lightweight Block Ciphers", appendix C).
TEST(BufferIdSequenceTest, IsSpeck64Over128BitKeys) {
  const BufferIdSequence ids({0x03020100, 0x0b0a0908, 0x13121110, 0x1b1a1918});
  EXPECT_EQ(ids.Encrypt(0x3b7265747475432d), 0x8c6fa548454e028bu);
}

TEST(BufferIdSequenceTest, IdsAreDistinctNonZeroAndDifferPerKey) {
  BufferIdSequence a;
  BufferIdSequence b;
  std::set<uint64_t> seen;
  uint64_t high_bits = 0;
  for (int i = 0; i < 100000; ++i) {
    const uint64_t id = a.Next();
    ASSERT_NE(id, 0u);
    ASSERT_TRUE(seen.insert(id).second) << "id " << id << " repeated";
    high_bits |= id >> 48;
  }
  EXPECT_EQ(high_bits, 0xffffu) << "every high bit varies";
  // Another table's (another life's) ids are others.
  EXPECT_EQ(seen.count(b.Next()), 0u);
}

TEST(BufferTableTest, ListsKeepTheOrderOfAdding) {
  BufferTable table(kEpoch);
  std::vector<uint64_t> ids;
  for (int i = 0; i < 50; ++i) {
    ids.push_back(table.NextId());
    table.Add(MakeRegistration(ids.back(), v1::ACCESS_READ_WRITE, 64));
  }
  std::vector<uint64_t> listed;
  for (const auto& registration : table.ListAll()) {
    listed.push_back(registration->id());
  }
  EXPECT_EQ(listed, ids);
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

TEST(BufferTableTest, NotificationTargetsNeedTheTokenThenWriteAccess) {
  BufferTable table(kEpoch);
  table.Add(MakeRegistration(1, v1::ACCESS_READ));
  table.Add(MakeRegistration(2, v1::ACCESS_WRITE));
  std::vector<absl::StatusCode> observed;
  table.set_refusal_observer(
      [&](const ServeRequest&, const absl::Status& status) {
        observed.push_back(status.code());
      });
  ServeRequest target = Request(1);
  target.requester = "10.0.0.9";
  // Offset and length name nothing here.
  target.length = 0;
  target.offset = 1 << 30;
  ServeRequest stale = target;
  stale.agent_epoch = kEpoch + 1;
  EXPECT_EQ(table.ResolveForNotification(stale).status(), StaleContextError());
  ServeRequest forged = target;
  forged.token = "token-2";
  EXPECT_EQ(table.ResolveForNotification(forged).status(),
            NotRegisteredError());
  EXPECT_EQ(table.ResolveForNotification(target).status().code(),
            absl::StatusCode::kPermissionDenied);
  ServeRequest writable = Request(2);
  writable.length = 0;
  auto resolved = table.ResolveForNotification(writable);
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ((*resolved)->id(), 2u);
  // Refusals naming a requester are observed, as for ResolveForPeer.
  EXPECT_EQ(observed, (std::vector<absl::StatusCode>{
                          absl::StatusCode::kFailedPrecondition,
                          absl::StatusCode::kNotFound,
                          absl::StatusCode::kPermissionDenied}));
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
  std::vector<uint64_t> heard_too;
  const int listener =
      table.AddRemovalListener([&](uint64_t id) { heard.push_back(id); });
  const int other =
      table.AddRemovalListener([&](uint64_t id) { heard_too.push_back(id); });
  ASSERT_TRUE(table.Remove(2, kOwner).ok());
  EXPECT_FALSE(table.Remove(2, kOwner).ok());
  EXPECT_FALSE(table.Remove(1, kOther).ok()) << "refused: not a removal";
  EXPECT_EQ(heard, std::vector<uint64_t>{2});
  EXPECT_EQ(heard_too, std::vector<uint64_t>{2});
  table.RemoveRemovalListener(listener);
  ASSERT_TRUE(table.Remove(1, kOwner).ok());
  EXPECT_EQ(heard, std::vector<uint64_t>{2});
  EXPECT_EQ(heard_too, (std::vector<uint64_t>{2, 1}));
  table.RemoveRemovalListener(other);
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

// Ownership scoping, ids and the lifetime of released registrations: the
// table as the agent's API uses it.
namespace scoping {

constexpr uint64_t kEpoch = 9;
constexpr uid_t kRoot = 0;
constexpr uid_t kAlice = 1000;
constexpr uid_t kBob = 1001;

// A registration of `owner` under a fresh id of `table`, published.
std::shared_ptr<Registration> AddBuffer(BufferTable& table, uid_t owner) {
  auto memory = SharedMemory::Allocate(4096, "buffer-table-test");
  EXPECT_TRUE(memory.ok()) << memory.status();
  const uint64_t id = table.NextId();
  auto registration = std::make_shared<Registration>(
      id, owner, v1::ACCESS_READ_WRITE, "label", absl::StrCat("token-", id),
      std::move(*memory), /*agent_allocated=*/true);
  table.Add(registration);
  return registration;
}

std::vector<uint64_t> Ids(
    const std::vector<std::shared_ptr<Registration>>& list) {
  std::vector<uint64_t> ids;
  for (const auto& registration : list) ids.push_back(registration->id());
  return ids;
}

TEST(BufferTableScopingTest, EachUserSeesOwnBuffersAndRootSeesAll) {
  BufferTable table(kEpoch);
  const uint64_t a1 = AddBuffer(table, kAlice)->id();
  const uint64_t b1 = AddBuffer(table, kBob)->id();
  const uint64_t a2 = AddBuffer(table, kAlice)->id();
  EXPECT_EQ(Ids(table.ListOwnedBy(kAlice)), (std::vector<uint64_t>{a1, a2}));
  EXPECT_EQ(Ids(table.ListOwnedBy(kBob)), (std::vector<uint64_t>{b1}));
  // Root's own list is root's own; every user's is a separate question.
  EXPECT_TRUE(table.ListOwnedBy(kRoot).empty());
  EXPECT_EQ(Ids(table.ListAll()), (std::vector<uint64_t>{a1, b1, a2}));
  EXPECT_TRUE(table.Find(b1, kRoot).ok());
  // A foreign id answers exactly as an unknown one.
  EXPECT_EQ(table.Find(b1, kAlice).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(table.Remove(b1, kAlice).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(table.Find(b1, kBob).ok()) << "a refused Remove changes nothing";
  // Root may release anyone's buffer.
  EXPECT_TRUE(table.Remove(b1, kRoot).ok());
  EXPECT_EQ(table.Find(b1, kBob).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(table.Remove(b1, kBob).code(), absl::StatusCode::kNotFound)
      << "released twice";
}

TEST(BufferTableScopingTest, IdsAreNeverReusedAfterRemoveOrClear) {
  BufferTable table(kEpoch);
  std::set<uint64_t> seen;
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < 10; ++i) {
      auto registration = AddBuffer(table, kAlice);
      const uint64_t last = registration->id();
      EXPECT_NE(last, 0u);
      EXPECT_TRUE(seen.insert(last).second) << last;
      if (i % 2 == 0) {
        ASSERT_TRUE(table.Remove(last, kAlice).ok());
      }
    }
    table.Clear();
    EXPECT_TRUE(table.ListAll().empty());
  }
}

TEST(BufferTableScopingTest, ConcurrentNextIdsAreDistinct) {
  BufferTable table(kEpoch);
  constexpr int kThreads = 8;
  constexpr int kEach = 1000;
  std::vector<std::vector<uint64_t>> ids(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) ids[t].push_back(table.NextId());
    });
  }
  for (auto& thread : threads) thread.join();
  std::set<uint64_t> all;
  for (const auto& list : ids) all.insert(list.begin(), list.end());
  EXPECT_EQ(all.size(), size_t{kThreads * kEach});
  EXPECT_EQ(all.count(0), 0u) << "0 is never an id";
}

TEST(BufferTableScopingTest, RemoveWhilePinnedKeepsMemoryUntilTheLastPin) {
  BufferTable table(kEpoch);
  std::weak_ptr<Registration> alive;
  std::shared_ptr<Registration> pinned;
  {
    auto registration = AddBuffer(table, kAlice);
    alive = registration;
    auto found = table.Find(registration->id(), kAlice);
    ASSERT_TRUE(found.ok());
    pinned = *found;  // as an op in flight holds it
    ASSERT_TRUE(table.Remove(registration->id(), kAlice).ok());
  }
  EXPECT_TRUE(table.ListAll().empty());
  ASSERT_FALSE(alive.expired()) << "the op's pin keeps it";
  pinned->data()[4095] = std::byte{0x7f};  // still mapped, still writable
  EXPECT_EQ(pinned->data()[4095], std::byte{0x7f});
  pinned.reset();
  EXPECT_TRUE(alive.expired()) << "gone with the last pin";
}

TEST(BufferTableScopingTest, ClearKeepsPinnedMemoryToo) {
  BufferTable table(kEpoch);
  auto pinned = AddBuffer(table, kBob);
  std::weak_ptr<Registration> alive = pinned;
  table.Clear();
  EXPECT_EQ(table.Find(pinned->id(), kRoot).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_FALSE(alive.expired());
  pinned.reset();
  EXPECT_TRUE(alive.expired());
}

}  // namespace scoping
}  // namespace
}  // namespace rdma_agent

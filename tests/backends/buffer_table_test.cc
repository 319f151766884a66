// The buffer table as the agent's API uses it: ownership scoping, ids, and
// the lifetime of released registrations. Its peer checks are stated in
// backends/buffer_table_test.cc and, through every backend, in the contract
// suite (backends/testing/backend_contract_test.cc).
#include "backends/buffer_table.h"

#include <memory>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/shared_memory.h"
#include "gtest/gtest.h"

namespace rdma_agent {
namespace {

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
  uint64_t last = 0;
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < 10; ++i) {
      auto registration = AddBuffer(table, kAlice);
      EXPECT_GT(registration->id(), last);
      last = registration->id();
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

}  // namespace
}  // namespace rdma_agent

#include "daemon/directory/resolve_cache.h"

#include <string>

#include "gtest/gtest.h"

namespace rdma_agent {
namespace {

v1::NameRecord Record(const std::string& name, uint64_t buffer_id,
                      size_t context_bytes = 8) {
  v1::NameRecord record;
  record.set_name(name);
  record.set_buffer_id(buffer_id);
  record.set_remote_context(std::string(context_bytes, 'c'));
  return record;
}

TEST(ResolveCacheTest, FilledRecordIsAHitOthersAreMisses) {
  ResolveCache cache(8, 1 << 20);
  EXPECT_FALSE(cache.Lookup("a").has_value());
  cache.Fill(Record("a", 1), 10);
  auto hit = cache.Lookup("a");
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->buffer_id(), 1u);
  EXPECT_FALSE(cache.Lookup("b").has_value());
  EXPECT_EQ(cache.hits(), 1u);
  EXPECT_EQ(cache.misses(), 2u);
}

TEST(ResolveCacheTest, NewerChangesReplaceAndDropOlderOnesDoNot) {
  ResolveCache cache(8, 1 << 20);
  cache.Fill(Record("a", 1), 10);
  cache.Published(Record("a", 2), 9);  // older than the entry: ignored
  EXPECT_EQ(cache.Lookup("a")->buffer_id(), 1u);
  cache.Published(Record("a", 3), 11);
  EXPECT_EQ(cache.Lookup("a")->buffer_id(), 3u);
  cache.Withdrawn("a", 11);  // not newer than the entry: ignored
  EXPECT_TRUE(cache.Lookup("a").has_value());
  cache.Withdrawn("a", 12);
  EXPECT_FALSE(cache.Lookup("a").has_value());
  // A fill older than what is cached does not overwrite it either.
  cache.Fill(Record("b", 5), 20);
  cache.Fill(Record("b", 4), 19);
  EXPECT_EQ(cache.Lookup("b")->buffer_id(), 5u);
}

TEST(ResolveCacheTest, WatchedChangesOfUncachedNamesAreNotKept) {
  ResolveCache cache(8, 1 << 20);
  cache.Published(Record("a", 1), 10);
  EXPECT_EQ(cache.entries(), 0u);
  EXPECT_FALSE(cache.Lookup("a").has_value());
}

TEST(ResolveCacheTest, EntriesAreBoundedLeastRecentlyUsedGoFirst) {
  ResolveCache cache(3, 1 << 20);
  cache.Fill(Record("a", 1), 1);
  cache.Fill(Record("b", 2), 2);
  cache.Fill(Record("c", 3), 3);
  ASSERT_TRUE(cache.Lookup("a").has_value());  // b is now the oldest used
  cache.Fill(Record("d", 4), 4);
  EXPECT_EQ(cache.entries(), 3u);
  EXPECT_TRUE(cache.Lookup("a").has_value());
  EXPECT_FALSE(cache.Lookup("b").has_value());
  EXPECT_TRUE(cache.Lookup("c").has_value());
  EXPECT_TRUE(cache.Lookup("d").has_value());
}

TEST(ResolveCacheTest, BytesAreBounded) {
  const size_t one = Record("a", 1, 1000).ByteSizeLong() + 1;
  ResolveCache cache(100, 2 * one + one / 2);
  cache.Fill(Record("a", 1, 1000), 1);
  cache.Fill(Record("b", 2, 1000), 2);
  EXPECT_EQ(cache.bytes(), 2 * one);
  cache.Fill(Record("c", 3, 1000), 3);
  EXPECT_EQ(cache.entries(), 2u);
  EXPECT_LE(cache.bytes(), 2 * one + one / 2);
  EXPECT_FALSE(cache.Lookup("a").has_value());
  // One record larger than the whole bound is not kept, and evicts nothing.
  cache.Fill(Record("huge", 9, 10 * one), 4);
  EXPECT_FALSE(cache.Lookup("huge").has_value());
  EXPECT_EQ(cache.entries(), 2u);
}

TEST(ResolveCacheTest, ZeroEntriesKeepsNothing) {
  ResolveCache cache(0, 1 << 20);
  cache.Fill(Record("a", 1), 1);
  EXPECT_FALSE(cache.Lookup("a").has_value());
  EXPECT_EQ(cache.entries(), 0u);
}

TEST(ResolveCacheTest, ClearForgetsEverything) {
  ResolveCache cache(8, 1 << 20);
  cache.Fill(Record("a", 1), 1);
  cache.Clear();
  EXPECT_EQ(cache.entries(), 0u);
  EXPECT_EQ(cache.bytes(), 0u);
  EXPECT_FALSE(cache.Lookup("a").has_value());
}

}  // namespace
}  // namespace rdma_agent

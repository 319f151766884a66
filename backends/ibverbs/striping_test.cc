// How ops are spread over rails: pairing, weights, splits, small-op placement.
#include "backends/ibverbs/striping.h"

#include <set>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace rdma_agent::ibverbs {
namespace {

bool Any(size_t, size_t) { return true; }

std::set<std::pair<size_t, size_t>> PairsOf(const std::vector<RailPair>& p) {
  std::set<std::pair<size_t, size_t>> pairs;
  for (const RailPair& pair : p) pairs.insert({pair.local, pair.remote});
  return pairs;
}

TEST(PairRailsTest, EqualRailCountsPairOneToOne) {
  const std::vector<RailPair> pairs =
      PairRails({100, 100, 100, 100}, {100, 100, 100, 100}, Any);
  EXPECT_EQ(PairsOf(pairs), (std::set<std::pair<size_t, size_t>>{
                                {0, 0}, {1, 1}, {2, 2}, {3, 3}}));
  for (const RailPair& pair : pairs) EXPECT_DOUBLE_EQ(pair.weight, 100);
}

TEST(PairRailsTest, APeerWithFewerRailsSharesItsRails) {
  const std::vector<RailPair> pairs =
      PairRails({100, 100, 100, 100}, {100, 100}, Any);
  EXPECT_EQ(PairsOf(pairs), (std::set<std::pair<size_t, size_t>>{
                                {0, 0}, {1, 1}, {2, 0}, {3, 1}}));
  // Each remote rail carries two pairs: half of it each.
  for (const RailPair& pair : pairs) EXPECT_DOUBLE_EQ(pair.weight, 50);
  // And the other way round.
  const std::vector<RailPair> back = PairRails({100}, {100, 100, 100}, Any);
  EXPECT_EQ(PairsOf(back),
            (std::set<std::pair<size_t, size_t>>{{0, 0}, {0, 1}, {0, 2}}));
  for (const RailPair& pair : back) EXPECT_NEAR(pair.weight, 100.0 / 3, 1e-9);
}

TEST(PairRailsTest, WeightIsTheSlowerEnd) {
  const std::vector<RailPair> pairs = PairRails({200, 50}, {100, 100}, Any);
  ASSERT_EQ(pairs.size(), 2u);
  EXPECT_DOUBLE_EQ(pairs[0].weight, 100);  // 200 local, 100 remote
  EXPECT_DOUBLE_EQ(pairs[1].weight, 50);   // 50 local
  // Unknown speeds take the other end's; both unknown: equal shares.
  const std::vector<RailPair> unknown = PairRails({40, 0}, {0, 0}, Any);
  EXPECT_DOUBLE_EQ(unknown[0].weight, 40);
  EXPECT_DOUBLE_EQ(unknown[1].weight, 1);
}

TEST(PairRailsTest, RefusedPairsAreReplacedSoEveryRailStaysInUse) {
  // (1, 1) cools down: local 1 and remote 1 find other partners.
  const auto allowed = [](size_t l, size_t r) { return !(l == 1 && r == 1); };
  const std::vector<RailPair> pairs =
      PairRails({100, 100}, {100, 100}, allowed);
  const auto chosen = PairsOf(pairs);
  EXPECT_EQ(chosen.count({1, 1}), 0u);
  EXPECT_EQ(chosen.count({0, 0}), 1u);
  EXPECT_EQ(chosen.count({1, 0}), 1u);  // local 1's first allowed partner
  EXPECT_EQ(chosen.count({0, 1}), 1u);  // remote 1's
  // A remote rail nobody may use is left out; nothing allowed: no pair.
  const std::vector<RailPair> dead_remote = PairRails(
      {100, 100}, {100, 100}, [](size_t, size_t r) { return r != 1; });
  EXPECT_EQ(PairsOf(dead_remote),
            (std::set<std::pair<size_t, size_t>>{{0, 0}, {1, 0}}));
  EXPECT_TRUE(
      PairRails({100}, {100}, [](size_t, size_t) { return false; }).empty());
  EXPECT_TRUE(PairRails({}, {100}, Any).empty());
}

using Matrix = std::vector<std::vector<bool>>;

TEST(HealthyPairsTest, APeerRailWhosePairFailedIsLeftOutByEveryRail) {
  // (2, 2) failed: remote rail 2 is suspect, local rail 2 is not.
  Matrix failed(4, std::vector<bool>(4, false));
  failed[2][2] = true;
  const Matrix healthy = HealthyPairs(failed);
  for (size_t l = 0; l < 4; ++l) {
    for (size_t r = 0; r < 4; ++r) {
      EXPECT_EQ(healthy[l][r], r != 2) << l << "," << r;
    }
  }
}

TEST(HealthyPairsTest, ALocalRailFailingToTwoPeerRailsIsItselfSuspect) {
  // Local rail 1's pairs to remote 0 and 3 failed: its path, not theirs.
  Matrix failed(3, std::vector<bool>(4, false));
  failed[1][0] = failed[1][3] = true;
  const Matrix healthy = HealthyPairs(failed);
  for (size_t l = 0; l < 3; ++l) {
    for (size_t r = 0; r < 4; ++r) {
      EXPECT_EQ(healthy[l][r], l != 1) << l << "," << r;
    }
  }
  // Nothing failed: everything healthy; no rails: nothing.
  const Matrix fine = HealthyPairs(Matrix(2, std::vector<bool>(2, false)));
  EXPECT_EQ(fine, Matrix(2, std::vector<bool>(2, true)));
  EXPECT_TRUE(HealthyPairs({}).empty());
}

TEST(SplitByWeightTest, PiecesCoverTheOpInProportionOnPageBoundaries) {
  const uint64_t length = (10u << 20) + 12345;  // odd on purpose
  const std::vector<Piece> pieces =
      SplitByWeight(length, {100, 100, 50, 50}, 4096);
  ASSERT_EQ(pieces.size(), 4u);
  uint64_t next = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    EXPECT_EQ(pieces[i].lane, i);
    EXPECT_EQ(pieces[i].offset, next) << "contiguous";
    if (i + 1 < pieces.size()) EXPECT_EQ(pieces[i].length % 4096, 0u);
    next += pieces[i].length;
  }
  EXPECT_EQ(next, length) << "every byte, once";
  EXPECT_NEAR(static_cast<double>(pieces[0].length) / length, 1.0 / 3, 0.001);
  EXPECT_NEAR(static_cast<double>(pieces[2].length) / length, 1.0 / 6, 0.001);
}

TEST(SplitByWeightTest, SmallOpsAndZeroWeights) {
  // Shares below a page round to nothing: the last lane takes it all.
  std::vector<Piece> pieces = SplitByWeight(5000, {1, 1, 1}, 4096);
  ASSERT_EQ(pieces.size(), 1u);
  EXPECT_EQ(pieces[0].lane, 2u);
  EXPECT_EQ(pieces[0].length, 5000u);
  // Lanes of weight 0 get nothing.
  pieces = SplitByWeight(1 << 20, {0, 3, 0, 1}, 4096);
  ASSERT_EQ(pieces.size(), 2u);
  EXPECT_EQ(pieces[0].lane, 1u);
  EXPECT_EQ(pieces[0].length, 3u << 18);
  EXPECT_EQ(pieces[1].lane, 3u);
  EXPECT_EQ(pieces[1].length, 1u << 18);
  EXPECT_TRUE(SplitByWeight(0, {1}, 4096).empty());
  EXPECT_TRUE(SplitByWeight(100, {0, 0}, 4096).empty());
}

TEST(LeastLoadedTest, ProportionalToWeightWithRoundRobinTies) {
  EXPECT_EQ(LeastLoaded({100, 50, 70}, {1, 1, 1}, 0), 1u);
  // 100 / 4 < 50 / 1.
  EXPECT_EQ(LeastLoaded({100, 50}, {4, 1}, 0), 0u);
  // Ties go to the first at or after `start`.
  EXPECT_EQ(LeastLoaded({0, 0, 0}, {1, 1, 1}, 0), 0u);
  EXPECT_EQ(LeastLoaded({0, 0, 0}, {1, 1, 1}, 1), 1u);
  EXPECT_EQ(LeastLoaded({0, 0, 0}, {1, 1, 1}, 5), 2u);
  // Weight 0 is never chosen while another lane has weight.
  EXPECT_EQ(LeastLoaded({0, 1000}, {0, 1}, 0), 1u);
}

}  // namespace
}  // namespace rdma_agent::ibverbs

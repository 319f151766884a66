#include "backends/ibverbs/striping.h"

#include <algorithm>
#include <limits>
#include <set>
#include <utility>

namespace rdma_agent::ibverbs {

std::vector<RailPair> PairRails(
    absl::Span<const double> local_gbps, absl::Span<const double> remote_gbps,
    const std::function<bool(size_t local, size_t remote)>& allowed) {
  const size_t locals = local_gbps.size();
  const size_t remotes = remote_gbps.size();
  std::vector<RailPair> pairs;
  if (locals == 0 || remotes == 0) return pairs;
  std::set<std::pair<size_t, size_t>> chosen;
  const auto add = [&](size_t l, size_t r) {
    if (chosen.insert({l, r}).second) pairs.push_back({l, r, 0});
  };
  for (size_t k = 0; k < std::max(locals, remotes); ++k) {
    if (allowed(k % locals, k % remotes)) add(k % locals, k % remotes);
  }
  // Rails whose pair was refused: the first allowed partner, starting from
  // their own position so that several of them spread out.
  std::vector<bool> local_used(locals, false);
  std::vector<bool> remote_used(remotes, false);
  for (const RailPair& p : pairs) {
    local_used[p.local] = true;
    remote_used[p.remote] = true;
  }
  for (size_t l = 0; l < locals; ++l) {
    for (size_t t = 0; t < remotes && !local_used[l]; ++t) {
      const size_t r = (l + t) % remotes;
      if (!allowed(l, r)) continue;
      add(l, r);
      local_used[l] = remote_used[r] = true;
    }
  }
  for (size_t r = 0; r < remotes; ++r) {
    for (size_t t = 0; t < locals && !remote_used[r]; ++t) {
      const size_t l = (r + t) % locals;
      if (!allowed(l, r)) continue;
      add(l, r);
      local_used[l] = remote_used[r] = true;
    }
  }
  std::vector<size_t> on_local(locals, 0);
  std::vector<size_t> on_remote(remotes, 0);
  for (const RailPair& p : pairs) {
    ++on_local[p.local];
    ++on_remote[p.remote];
  }
  for (RailPair& p : pairs) {
    double local = local_gbps[p.local];
    double remote = remote_gbps[p.remote];
    if (local <= 0) local = remote;
    if (remote <= 0) remote = local;
    if (local <= 0) local = remote = 1;  // neither known: equal shares
    p.weight =
        std::min(local / on_local[p.local], remote / on_remote[p.remote]);
  }
  return pairs;
}

std::vector<std::vector<bool>> HealthyPairs(
    const std::vector<std::vector<bool>>& failed) {
  const size_t locals = failed.size();
  const size_t remotes = locals == 0 ? 0 : failed.front().size();
  std::vector<bool> local_suspect(locals, false);
  std::vector<bool> remote_suspect(remotes, false);
  for (size_t l = 0; l < locals; ++l) {
    local_suspect[l] = std::count(failed[l].begin(), failed[l].end(), true) > 1;
  }
  for (size_t l = 0; l < locals; ++l) {
    for (size_t r = 0; r < remotes; ++r) {
      if (failed[l][r] && !local_suspect[l]) remote_suspect[r] = true;
    }
  }
  std::vector<std::vector<bool>> healthy(locals,
                                         std::vector<bool>(remotes, false));
  for (size_t l = 0; l < locals; ++l) {
    for (size_t r = 0; r < remotes; ++r) {
      healthy[l][r] = !failed[l][r] && !local_suspect[l] && !remote_suspect[r];
    }
  }
  return healthy;
}

std::vector<Piece> SplitByWeight(uint64_t length,
                                 absl::Span<const double> weights,
                                 uint64_t align) {
  std::vector<Piece> pieces;
  SplitByWeight(length, weights, align, pieces);
  return pieces;
}

void SplitByWeight(uint64_t length, absl::Span<const double> weights,
                   uint64_t align, std::vector<Piece>& pieces) {
  pieces.clear();
  if (length == 0) return;
  if (align == 0) align = 1;
  double total = 0;
  size_t last = weights.size();
  for (size_t i = 0; i < weights.size(); ++i) {
    if (weights[i] > 0) {
      total += weights[i];
      last = i;
    }
  }
  if (last == weights.size()) return;
  uint64_t offset = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    if (weights[i] <= 0) continue;
    uint64_t share = length - offset;
    if (i != last) {
      const double exact = static_cast<double>(length) * weights[i] / total;
      share = std::min<uint64_t>(
          static_cast<uint64_t>(exact / static_cast<double>(align)) * align,
          length - offset);
    }
    if (share == 0) continue;
    pieces.push_back({i, offset, share});
    offset += share;
  }
}

size_t LeastLoaded(absl::Span<const double> load_bytes,
                   absl::Span<const double> weights, size_t start) {
  const size_t n = weights.size();
  if (n == 0) return 0;
  const bool any_weight = std::any_of(weights.begin(), weights.end(),
                                      [](double w) { return w > 0; });
  size_t best = n;
  double best_cost = std::numeric_limits<double>::infinity();
  for (size_t t = 0; t < n; ++t) {
    const size_t i = (start + t) % n;
    if (any_weight && weights[i] <= 0) continue;
    const double cost = load_bytes[i] / (any_weight ? weights[i] : 1.0);
    if (best == n || cost < best_cost) {
      best = i;
      best_cost = cost;
    }
  }
  return best == n ? start % n : best;
}

}  // namespace rdma_agent::ibverbs

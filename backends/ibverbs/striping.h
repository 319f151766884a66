#ifndef RDMA_AGENTD_BACKENDS_IBVERBS_STRIPING_H_
#define RDMA_AGENTD_BACKENDS_IBVERBS_STRIPING_H_

// How the ibverbs backend spreads ops over rails: which (local rail, remote
// rail) pairs carry a peer's ops, each pair's share, and how an op is cut
// into pieces. Pure functions: the backend feeds them link speeds and what
// its rails' health allows.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "absl/types/span.h"

namespace rdma_agent::ibverbs {

// A (local rail, remote rail) pair chosen to carry ops to one peer.
struct RailPair {
  size_t local = 0;   // index into the local rails given
  size_t remote = 0;  // index into the remote rails given
  // The Gbit/s this pair can count on: its share of the slower end.
  double weight = 0;
};

// The pairs ops to one peer go over, given each side's rails' link speeds
// in Gbit/s (0 = unknown: taken to be the other end's speed).
//
// Every local rail gets a remote rail and every remote rail a local one:
// max(L, R) pairs, rail k of the side with more rails with rail k mod n of
// the other, so that each rail carries its part and no rail pair is set up
// for nothing (each pair costs a queue pair on both agents, and a session
// with its own grants on the remote one). Pairs `allowed` refuses (a pair
// cooling down after failures) are left out, and a rail that loses its pair
// that way gets the first allowed partner instead. A pair's weight is
// min(local speed / pairs on the local rail, remote speed / pairs on the
// remote rail). Empty when nothing is allowed.
std::vector<RailPair> PairRails(
    absl::Span<const double> local_gbps, absl::Span<const double> remote_gbps,
    const std::function<bool(size_t local, size_t remote)>& allowed);

// Which rail pairs may carry ops to a peer, given which pairs failed (and
// were not shown to work since); failed[l][r] for local rail l, remote
// rail r. Whose fault a failure was is a guess (the local port was ACTIVE,
// or the local rail itself would be out): a local rail whose pairs to two
// or more remote rails failed is suspect itself (a path cut beyond its
// port), otherwise the remote rail of a failed pair is, and no pair with a
// suspect rail may carry ops, so that other rails do not each find out with
// a transport timeout of their own.
std::vector<std::vector<bool>> HealthyPairs(
    const std::vector<std::vector<bool>>& failed);

// A byte range of an op given to one of several lanes.
struct Piece {
  size_t lane = 0;
  uint64_t offset = 0;  // from the op's first byte
  uint64_t length = 0;
};

// Splits [0, length) into one contiguous piece per lane with a positive
// weight, in proportion to the weights, every boundary a multiple of
// `align` (pages, for the NIC's DMA) except the end; the last such lane
// takes what rounding left. Lanes whose share rounds to nothing get no
// piece. At least one piece when length > 0 and a weight is positive.
std::vector<Piece> SplitByWeight(uint64_t length,
                                 absl::Span<const double> weights,
                                 uint64_t align);
// The same into `pieces` (cleared first), reusing its storage: once per op.
void SplitByWeight(uint64_t length, absl::Span<const double> weights,
                   uint64_t align, std::vector<Piece>& pieces);

// The lane for an op too small to split: the least loaded for its weight
// (load / weight, bytes not yet completed), ties to the first at or after
// `start` (callers rotate it: round robin among equals). Lanes of weight 0
// only when every weight is 0.
size_t LeastLoaded(absl::Span<const double> load_bytes,
                   absl::Span<const double> weights, size_t start);

}  // namespace rdma_agent::ibverbs

#endif  // RDMA_AGENTD_BACKENDS_IBVERBS_STRIPING_H_

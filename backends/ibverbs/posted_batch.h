#ifndef RDMA_AGENTD_BACKENDS_IBVERBS_POSTED_BATCH_H_
#define RDMA_AGENTD_BACKENDS_IBVERBS_POSTED_BATCH_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "backends/backend.h"
#include "backends/ibverbs/connection.h"
#include "backends/ibverbs/rails.h"

namespace rdma_agent::ibverbs {

// The bytes of one posted batch's ops as they go over lanes and complete.
// An op is done once each of its bytes has moved or been given up on
// (Settle); its status is its first error. A WR that fails in a way another
// rail can fix (its completion means UNAVAILABLE: retry exceeded, flushed)
// while its op has no error is not given up on: its bytes wait as a Retry
// for the batch's owner to post elsewhere. The owner hears, through its
// Listener, when every op is done or a Retry is queued; nobody waits.
// Thread-safe: completions arrive on pollers' threads.
class PostedBatch : public CompletionSink {
 public:
  // A byte range of an op.
  struct Range {
    size_t op = 0;
    uint64_t offset = 0;  // from the op's first byte
    uint64_t length = 0;
  };
  // Bytes to post again, and where they failed.
  struct Retry {
    Range range;
    // The lane they failed on: for comparison only, never dereferenced (it
    // may be gone when the Retry is read after its batch ended).
    const Lane* lane = nullptr;
    absl::Status why;
    // The lane's path failed (the transport retried out), as opposed to
    // its queue pair being flushed: the lane cools down.
    bool path_failed = false;
  };

  // Told when the batch may need its owner: every op is done, or a Retry
  // was queued. Called on whichever thread settled the bytes (a completion
  // poller, or the posting path), with no lock of the batch held; must not
  // block.
  class Listener {
   public:
    virtual ~Listener() = default;
    virtual void OnBatchWoken() = 0;
  };

  explicit PostedBatch(absl::Span<const Op> ops);

  // Whom to tell; set once, before the first WR is posted. Held weakly: a
  // listener gone is told nothing.
  void SetListener(std::weak_ptr<Listener> listener);

  // Records a WR of `range` about to be posted on `lane` (its load and its
  // rail's counters follow it); returns the WR's cookie.
  uint64_t WrPosting(const Range& range, const Lane& lane);
  // The WR of `cookie` was not posted after all: forgotten; its bytes are
  // the caller's to settle or requeue.
  void WrNotPosted(uint64_t cookie);
  void OnCompletion(uint64_t cookie, const ibv_wc& wc) override;

  // Bytes that will not move: their op fails with `status` (unless it
  // failed already).
  void Settle(const Range& range, const absl::Status& status);
  // Bytes `lane` could not take (its queue pair failed before they were
  // posted): queued as a Retry, or settled with `why` when their op has an
  // error already.
  void Requeue(const Range& range, const Lane* lane, absl::Status why);
  // The Retries queued so far (removed).
  std::vector<Retry> TakeRetries();
  // True when the op has an error: its remaining bytes need not move.
  bool HasError(size_t op);

  // Every op is done.
  bool AllDone();
  // A Retry is queued.
  bool HasRetries();

  // Waits until no WR is outstanding (every posted WR's completion has
  // been taken), at most until `deadline`; true when none is.
  bool AwaitNoWrs(absl::Time deadline);

  // Ops not done yet.
  std::vector<size_t> NotDone();
  // WRs posted and not completed.
  uint64_t OutstandingWrs();
  std::vector<absl::Status> Results();
  // Replaces op's status (DEADLINE_EXCEEDED for ops the deadline cut).
  void Override(size_t op, absl::Status status);

 private:
  struct OpState {
    uint64_t unsettled = 0;  // bytes neither moved nor given up on
    absl::Status status;
    std::atomic<uint64_t>* landed = nullptr;  // Op::landed
  };
  // A WR posted (or about to be): its record's slot in wrs_ is its
  // cookie.
  struct Wr {
    Range range;
    const Lane* lane = nullptr;
    // The lane's load and name, kept past the lane.
    std::shared_ptr<LaneLoad> load;
    Rail* rail = nullptr;
    bool in_use = false;
    // While not in use: the next free slot (kNoSlot: none).
    size_t next_free = 0;
  };
  static constexpr size_t kNoSlot = ~size_t{0};

  // The record of `cookie` while it is in use; nullptr otherwise.
  Wr* WrOf(uint64_t cookie) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees `wr`'s slot (its load released).
  void FreeWr(Wr& wr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Settles `length` bytes of `op` with `status`; true when that made
  // every op done.
  bool SettleLocked(size_t op, uint64_t length, const absl::Status& status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tells the listener (called without mu_ held).
  void Wake();

  absl::Mutex mu_;
  std::vector<OpState> ops_ ABSL_GUARDED_BY(mu_);
  size_t not_done_ ABSL_GUARDED_BY(mu_) = 0;
  // WR records by cookie, their free slots linked from free_wr_: slots
  // made for one WR per op at construction and reused as WRs complete, so
  // that posting an op allocates nothing (more only when ops are cut into
  // several WRs each, amortized).
  std::vector<Wr> wrs_ ABSL_GUARDED_BY(mu_);
  size_t free_wr_ ABSL_GUARDED_BY(mu_) = kNoSlot;
  uint64_t outstanding_wrs_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<Retry> retries_ ABSL_GUARDED_BY(mu_);
  // Set before any WR, read unlocked afterwards.
  std::weak_ptr<Listener> listener_;
};

}  // namespace rdma_agent::ibverbs

#endif  // RDMA_AGENTD_BACKENDS_IBVERBS_POSTED_BATCH_H_

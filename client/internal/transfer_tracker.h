#ifndef RDMA_AGENTD_CLIENT_INTERNAL_TRANSFER_TRACKER_H_
#define RDMA_AGENTD_CLIENT_INTERNAL_TRANSFER_TRACKER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/rdma_agent_client.h"

namespace rdma_agent::client::internal {

// What one client knows about one transfer; its Transfer handles share it.
struct TransferCore {
  explicit TransferCore(uint64_t id) : id(id) {}

  const uint64_t id;
  // Guarded by the tracker's mutex.
  std::optional<TransferResult> end;  // once learnt, never changes
  TransferCallback on_done;           // set by OnDone, taken when it runs
  int handles = 0;                    // Transfer handles on it
  // The agent has answered for this id (SubmitAsync gave it, or GetTransfers
  // saw it PENDING): a watch will deliver its end.
  bool confirmed = false;
};

// The asynchronous transfers of one AgentClient: the record each handle
// shares, the end each one ended with (learnt first wins, so every path
// agrees), the OnDone callbacks, and the state of the client's one watch.
//
// Two races it closes:
// - A watch's stream may deliver an end before the SubmitAsync that started
//   the transfer has returned its id. Ends of unknown ids that arrive while
//   SubmitAsync calls are in progress are kept until every call that could
//   claim them has returned (each call takes a ticket before it sends).
// - An end learnt twice (the stream and a Poll, or a Cancel) resolves the
//   handle once: callbacks run exactly once.
//
// Callbacks run without the tracker's lock held. Thread-safe.
class TransferTracker {
 public:
  // SubmitAsync: BeginSubmit before the request is sent, EndSubmit once it
  // is answered (with the id, or nullopt when refused); EndSubmit returns
  // the new transfer's record with one handle counted, already ended if the
  // watch delivered its end meanwhile.
  uint64_t BeginSubmit();
  std::shared_ptr<TransferCore> EndSubmit(uint64_t ticket,
                                          std::optional<uint64_t> id);

  // A new handle on transfer `id` (the record handles on that id share).
  std::shared_ptr<TransferCore> Open(uint64_t id);
  // A handle is gone. The record stays while other handles or a callback
  // need it.
  void Close(const std::shared_ptr<TransferCore>& core);

  // The end, once learnt.
  std::optional<TransferResult> End(const TransferCore& core) const;

  // Whether the agent has answered for the id (TransferCore::confirmed).
  bool Confirmed(const TransferCore& core) const;
  void Confirm(TransferCore& core);

  // Records `end` (an ended transfer) unless an end was learnt already, and
  // runs the callback if this recorded it; returns the end in force.
  TransferResult Resolve(const std::shared_ptr<TransferCore>& core,
                         TransferResult end);

  // Sets the callback; runs it at once (on this thread) if the end is known.
  // FAILED_PRECONDITION, without calling it, when no watch runs (and the end
  // is not known) or a callback is already set.
  absl::Status SetOnDone(const std::shared_ptr<TransferCore>& core,
                         TransferCallback callback);

  // True while a watch runs: it will deliver ends, so a wait needs no RPC.
  bool WatchServes() const;

  enum class Awaited {
    kEnded,     // *end is set
    kTimedOut,  // deadline passed, a watch still runs
    kNoWatch,   // no watch runs (any more)
  };
  // Waits, without an RPC, until the end is learnt, `deadline` passes or no
  // watch runs.
  Awaited AwaitEnd(const TransferCore& core, absl::Time deadline,
                   TransferResult* end);

  // The watch's life: BeginWatch (FAILED_PRECONDITION while another runs);
  // Delivered for each end its stream brings, which records it and hands
  // back the callback to run (the watch runs it on its callback thread,
  // never on the reader's); EndWatch last, which hands back the callbacks
  // still waiting for an end, to be run with Failure(id, why).
  using Orphans = std::vector<std::pair<uint64_t, TransferCallback>>;
  absl::Status BeginWatch();
  TransferCallback Delivered(TransferResult end);
  Orphans EndWatch();
  static absl::Status Failure(uint64_t id, const absl::Status& why);

  // For tests: records kept (handles or callbacks), and ends kept for a
  // SubmitAsync in progress.
  size_t records() const;
  size_t unclaimed() const;

 private:
  struct Unclaimed {
    TransferResult end;
    uint64_t horizon;  // the last ticket issued when it arrived
  };

  std::shared_ptr<TransferCore> OpenLocked(uint64_t id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records the end; returns the callback to run (without the lock).
  TransferCallback RecordEnd(TransferCore& core, TransferResult end)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the record when no handle and no callback needs it.
  void DropIfUnused(const TransferCore& core)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops kept ends no SubmitAsync in progress can claim.
  void PruneUnclaimed() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<TransferCore>> cores_
      ABSL_GUARDED_BY(mu_);
  uint64_t last_ticket_ ABSL_GUARDED_BY(mu_) = 0;
  std::set<uint64_t> submitting_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, Unclaimed> unclaimed_ ABSL_GUARDED_BY(mu_);
  bool watching_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace rdma_agent::client::internal

#endif  // RDMA_AGENTD_CLIENT_INTERNAL_TRANSFER_TRACKER_H_

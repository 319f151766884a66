#ifndef RDMA_AGENTD_BACKENDS_IBVERBS_CONNECTION_H_
#define RDMA_AGENTD_BACKENDS_IBVERBS_CONNECTION_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "backends/ibverbs/profiles.h"
#include "backends/ibverbs/verbs.h"
#include "backends/registration.h"
#include "common/stop_token.h"
#include "rdma/agent/v1/peer.pb.h"

namespace rdma_agent::ibverbs {

// Takes the completions of WRs posted through QueuePairConnection::Post.
class CompletionSink {
 public:
  virtual ~CompletionSink() = default;
  // The WR posted with `cookie` completed. Called once per posted WR, on the
  // connection's poller thread, after its send-queue credit and the
  // registration it pinned were released. Must not block, and must not drop
  // the last reference to the connection it came from.
  virtual void OnCompletion(uint64_t cookie, const ibv_wc& wc) = 0;
};

// Progress of a set of ops posted op by op (the cookie of each WR is its
// op's index), fed by the completion pollers of the connections its WRs
// went to. An op is done once all of its WRs were posted (or posting
// stopped) and every posted WR completed; its status is the first error
// seen. Thread-safe.
class OpTracker : public CompletionSink {
 public:
  explicit OpTracker(size_t ops);

  void WrPosted(size_t op);
  void WrCompleted(size_t op, const absl::Status& status);
  // No more WRs will be posted for `op`; a non-OK `status` is kept as its
  // error (unless it already has one).
  void PostingFinished(size_t op, const absl::Status& status);

  // Waits until every op is done, `deadline` passes or Interrupt() is
  // called; true when all are done.
  bool WaitAllDone(absl::Time deadline);
  // Ends every WaitAllDone now (and every later one at once): the batch was
  // cancelled. Callable from any thread; does not block.
  void Interrupt();
  // Ops not done yet.
  std::vector<size_t> NotDone();
  // WRs still outstanding over all ops.
  uint64_t OutstandingWrs();
  std::vector<absl::Status> Results();
  // Replaces op's status (used to report DEADLINE_EXCEEDED for ops the
  // deadline cut short).
  void Override(size_t op, absl::Status status);

  // WrCompleted(cookie, CompletionStatus(wc)).
  void OnCompletion(uint64_t cookie, const ibv_wc& wc) override;

 private:
  struct Progress {
    uint64_t pending = 0;
    bool posting_done = false;
    absl::Status status;
  };
  bool AllDone() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool DoneOrInterrupted() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  std::vector<Progress> ops_ ABSL_GUARDED_BY(mu_);
  size_t not_done_ ABSL_GUARDED_BY(mu_);
  bool interrupted_ ABSL_GUARDED_BY(mu_) = false;
};

// The contract code for a work completion status (backends/README.md; the
// table is in backends/ibverbs/README.md, "Errors"):
// REM_ACCESS_ERR -> PERMISSION_DENIED (grant revoked or access refused),
// RETRY_EXC_ERR / RNR_RETRY_EXC_ERR / WR_FLUSH_ERR -> UNAVAILABLE (peer
// unreachable, or the QP failed), REM_INV_REQ_ERR -> INVALID_ARGUMENT,
// local errors -> INTERNAL.
absl::Status CompletionStatus(const ibv_wc& wc);

class QueuePairConnection;

// True on a CompletionPoller's thread: whoever may run there (a sink's
// follow-up) then knows not to drop the last reference to a connection.
bool OnCompletionPollerThread();

// One completion queue that queue pairs of one device share, and the thread
// that polls it: it busy-polls for `busy_poll` after a completion, then arms
// the CQ and blocks on its completion channel, and hands each completion to
// the connection whose QP it names. Every WR is signaled and a QP holds at
// most its send-queue depth of them, so QPs reserve that many entries and
// the CQ never overflows. Thread-safe.
class CompletionPoller {
 public:
  // Creates a CQ of `entries` on `device` and starts the thread.
  static absl::StatusOr<std::shared_ptr<CompletionPoller>> Create(
      verbs::Device& device, uint32_t entries, absl::Duration busy_poll);
  // Stops and joins the thread. Nothing may be attached any more.
  ~CompletionPoller();
  CompletionPoller(const CompletionPoller&) = delete;
  CompletionPoller& operator=(const CompletionPoller&) = delete;

  verbs::CompletionQueue* cq() const { return cq_.get(); }
  // Takes `entries` of the CQ for a QP's send queue; false when they do
  // not fit.
  bool Reserve(uint32_t entries);
  void Unreserve(uint32_t entries);
  // Completions of `qp_num` go to `connection` from now on.
  void Attach(uint32_t qp_num, QueuePairConnection* connection);
  // After it returns, `qp_num`'s completions go nowhere (none is being
  // handed over).
  void Detach(uint32_t qp_num);

 private:
  CompletionPoller(std::unique_ptr<verbs::CompletionQueue> cq, uint32_t entries,
                   absl::Duration busy_poll);
  void Run();
  void Dispatch(absl::Span<const ibv_wc> wcs);

  const std::unique_ptr<verbs::CompletionQueue> cq_;
  const uint32_t entries_;
  const absl::Duration busy_poll_;
  absl::Mutex mu_;
  uint32_t reserved_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<uint32_t, QueuePairConnection*> connections_
      ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// The completion pollers of one device: one CQ and thread for as many queue
// pairs as the CQ has entries for their send queues, another when it is
// full. So a device costs one polling thread, plus one per
// `entries_per_cq` entries its QPs reserve, however many peers and lanes
// it serves. Thread-safe.
class CompletionPollers {
 public:
  CompletionPollers(verbs::Device* device, uint32_t entries_per_cq,
                    absl::Duration busy_poll);
  // A poller with `entries` reserved on it for a new QP.
  absl::StatusOr<std::shared_ptr<CompletionPoller>> Reserve(uint32_t entries);
  // Polling threads (CQs) now.
  size_t size() const;

 private:
  verbs::Device* const device_;
  const uint32_t entries_per_cq_;
  const absl::Duration busy_poll_;
  mutable absl::Mutex mu_;
  std::vector<std::shared_ptr<CompletionPoller>> pollers_ ABSL_GUARDED_BY(mu_);
};

// Where a connection's QP sits: the local half of the handshake.
struct LocalPort {
  verbs::Device* device = nullptr;
  verbs::ProtectionDomain* pd = nullptr;
  uint8_t port = 1;
  uint16_t lid = 0;
  ibv_gid gid = {};
  // True when the link layer needs global routing (RoCE).
  bool global_routing = true;
  // The device's shared pollers; nullptr: the QP gets a CQ and a polling
  // thread of its own.
  CompletionPollers* pollers = nullptr;
};

// One RC queue pair to one remote device, its completions taken by a
// CompletionPoller (the device's shared ones, or its own), and send-queue
// credits so that outstanding WRs never exceed the queue depth.
//
// Any error completion breaks the connection (the QP is in ERR); owners then
// replace it. Destruction moves the QP to ERR, waits for every posted WR to
// complete (bounded by `drain_timeout`), then destroys QP and CQ; posted WRs
// pin their local registration, so memory stays mapped even if the device
// never drains.
class QueuePairConnection {
 public:
  // Whether the QP lets the other side RDMA READ/WRITE through it
  // (qp_access_flags). Requesters refuse: whoever answers a handshake then
  // cannot reach this agent's memory through the QP, whatever it knows of
  // keys and addresses. Responders accept; their PD holds only what was
  // granted to that peer.
  enum class Inbound { kRefuse, kAccept };

  // Creates the QP in local.pd (its CQ from local.pollers, or its own) and
  // moves it to INIT.
  static absl::StatusOr<std::unique_ptr<QueuePairConnection>> Create(
      const LocalPort& local, const QueuePairParams& params,
      absl::Duration busy_poll, absl::Duration drain_timeout, Inbound inbound);
  ~QueuePairConnection();
  QueuePairConnection(const QueuePairConnection&) = delete;
  QueuePairConnection& operator=(const QueuePairConnection&) = delete;

  // This side, for the other one.
  v1::QueuePairEndpoint local_endpoint() const;
  // Moves the QP to RTR then RTS against `remote`.
  absl::Status ConnectTo(const v1::QueuePairEndpoint& remote);

  // Posts one signaled WR (wr.wr_id is assigned here) once a send-queue
  // credit is free. OK: its completion goes to `sink` with `cookie`, and
  // `pin` is held until then. Otherwise the sink never hears of it: if no
  // credit frees up before `stop` fires, its status (DEADLINE_EXCEEDED, or
  // the cancellation's reason); UNAVAILABLE once the connection is broken;
  // INTERNAL when ibv_post_send refuses it.
  absl::Status Post(ibv_send_wr& wr, std::shared_ptr<CompletionSink> sink,
                    uint64_t cookie, std::shared_ptr<Registration> pin,
                    const StopToken& stop);
  // Post without waiting: RESOURCE_EXHAUSTED (and the sink never hears of
  // the WR) when no send-queue credit is free now.
  absl::Status TryPost(ibv_send_wr& wr, std::shared_ptr<CompletionSink> sink,
                       uint64_t cookie, std::shared_ptr<Registration> pin);
  // The same for a WR of op `op` of `tracker`, which hears of it either way
  // (WrPosted, then WrCompleted with the error when it was not posted).
  absl::Status Post(ibv_send_wr& wr, const std::shared_ptr<OpTracker>& tracker,
                    size_t op, std::shared_ptr<Registration> pin,
                    const StopToken& stop);

  // Moves the QP to ERR and waits until every posted WR has completed (they
  // are flushed), at most `limit`. True when nothing is outstanding.
  bool MoveToErrorAndDrain(absl::Duration limit);

  bool broken() const { return broken_.load(); }
  uint32_t qp_num() const { return qp_->qp_num(); }
  uint64_t outstanding() const;

 private:
  // A posted WR's record, in the slot its wr_id's low 32 bits name.
  struct InFlight {
    uint64_t wr_id = 0;  // 0: the slot is free
    std::shared_ptr<CompletionSink> sink;
    uint64_t cookie = 0;
    std::shared_ptr<Registration> pin;
  };

  friend class CompletionPoller;

  QueuePairConnection(const LocalPort& local, const QueuePairParams& params,
                      absl::Duration drain_timeout,
                      std::shared_ptr<CompletionPoller> poller,
                      std::unique_ptr<verbs::QueuePair> qp);
  // Takes a credit and posts (credits_ > 0, the QP not broken).
  absl::Status PostLocked(ibv_send_wr& wr, std::shared_ptr<CompletionSink> sink,
                          uint64_t cookie, std::shared_ptr<Registration> pin)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Hands a completion to its sink and frees its credit (on the poller's
  // thread).
  void Reap(const ibv_wc& wc);

  const LocalPort local_;
  const QueuePairParams params_;
  const absl::Duration drain_timeout_;
  const uint32_t psn_;
  // Declared before qp_: the QP is destroyed before its CQ.
  std::shared_ptr<CompletionPoller> poller_;
  std::unique_ptr<verbs::QueuePair> qp_;
  std::atomic<bool> broken_{false};

  mutable absl::Mutex mu_;
  // Free send-queue slots: the entries of free_slots_.
  uint32_t credits_ ABSL_GUARDED_BY(mu_);
  // Counts posts; a WR's wr_id is it (high 32 bits) and its slot, so that
  // a completion of a slot's earlier WR is told apart.
  uint64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 1;
  // One record per send-queue entry (sq_depth), made with the connection,
  // and the free ones (a stack of slot numbers, its capacity sq_depth):
  // posting and reaping allocate nothing.
  std::vector<InFlight> in_flight_ ABSL_GUARDED_BY(mu_);
  std::vector<uint32_t> free_slots_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace rdma_agent::ibverbs

#endif  // RDMA_AGENTD_BACKENDS_IBVERBS_CONNECTION_H_

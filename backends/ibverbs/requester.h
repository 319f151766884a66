#ifndef RDMA_AGENTD_BACKENDS_IBVERBS_REQUESTER_H_
#define RDMA_AGENTD_BACKENDS_IBVERBS_REQUESTER_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "backends/backend.h"
#include "backends/ibverbs/connection.h"
#include "backends/ibverbs/options.h"
#include "backends/ibverbs/posted_batch.h"
#include "backends/ibverbs/rails.h"
#include "common/deadline_timer.h"
#include "common/executor.h"
#include "common/stop_token.h"
#include "rdma/agent/v1/peer.grpc.pb.h"

namespace rdma_agent::ibverbs {

// The requesting half of the ibverbs backend: posted batches over lanes (a rail
// of this agent paired with a rail of the peer, striping.h), their handshakes
// and grants through the peers' Peer services, striped posting, failover to
// the other lanes when one fails, probes of lanes whose cooldown ran out,
// and the drain at the deadline (IbverbsBackend's comment says how).
//
// Owned by IbverbsBackend, whose environment, options and rails it uses:
// they outlive it, and the rails are set up before the first Post and
// never change afterwards. Thread-safe.
//
// No thread waits on a posted batch. Post plans the lanes and posts the
// WRs of lanes already connected on the caller's thread; a lane that must
// connect (a handshake over the Peer service), ask for a grant, or wait for
// a send-queue slot goes on a posting thread. The batch ends where its last
// byte settles: on a completion poller (the last WR's completion), or a
// posting thread; bytes of failed WRs are posted again from a posting
// thread; the deadline and a cancellation end it from the timer thread
// (queue pairs moved to ERR and drained there, never on a poller).
class Requester {
 public:
  // `backend` is the backend's name, under which registrations keep its
  // state (IbverbsRegistration).
  Requester(const BackendEnvironment& env, const IbverbsOptions& options,
            const std::vector<std::unique_ptr<Rail>>& rails,
            std::string backend);
  // Lanes' connections drain and stop their pollers. No batch may be in
  // flight (every Post's done was called).
  ~Requester();
  Requester(const Requester&) = delete;
  Requester& operator=(const Requester&) = delete;

  // Backend::Post: `done` gets one status per op, and once it is called
  // no WR of the batch touches memory.
  void Post(absl::Span<const Op> ops, const StopToken& stop, OpsDone done);

  // The Peer service of the agent at `address` (one channel per address,
  // with the agent's Peer TLS credentials when configured).
  std::shared_ptr<v1::Peer::Stub> StubFor(const std::string& address);

  // Queue pairs connected as requester, over its life.
  uint64_t connections_established() const;
  // Queue pairs held now (one per lane in use).
  size_t connections() const;
  // Queue pairs held now by peer "agent/device".
  std::map<std::string, size_t> ConnectionsByPeer() const;
  // Lanes cooling down at `now`, by their rail of this agent.
  std::map<const Rail*, size_t> LanesCoolingDown(absl::Time now) const;
  // Drops the state of peers, and the channels, unused for
  // options.requester_idle_timeout at `now` (the backend's sweeper calls
  // it).
  void ExpireIdle(absl::Time now);
  // Peers (agent and epoch) with requester state now, and Peer channels
  // kept open.
  size_t peers() const;
  size_t channels() const;

 private:
  struct Handshaken;
  struct LaneUse;
  struct PeerPlan;
  struct AffinityClass;
  struct InFlight;

  // A posted batch's steps. Holds keep it from ending while a posting
  // thread works on it; Release ends the hold and moves it on.
  void Hold(InFlight& flight);
  void Release(InFlight& flight, bool may_block);
  // Moves the batch on once no hold is left: ends it when every op is
  // done, cuts it short once stopped (on this thread when `may_block`,
  // otherwise on the timer thread), or posts its Retries again on a
  // posting thread.
  void Kick(InFlight& flight, bool may_block);
  // The deadline passed or the stop was cancelled (on the timer thread).
  void Stopped(InFlight& flight);
  // CutShort, then End.
  void CutAndEnd(InFlight& flight);
  // Why bytes a posting thread would have taken fail: its queue is full.
  absl::Status RefusedPosting() const;
  // The bytes planned for `use` not dealt with yet fail with `why`.
  void SettleRest(InFlight& flight, LaneUse& use, const absl::Status& why);
  // Marks healthy lanes, counts moved bytes, lets the peers go and calls
  // done. `cut`: CutShort ran.
  void End(InFlight& flight, bool cut);

  // "agent_id/epoch": whom an op goes to.
  static std::string PeerKey(const v1::RemoteBuffer& remote);
  // Holds `peer`'s state for a batch, making room (an unused peer's
  // lanes, never-connected ones first) past max_requester_peers;
  // RESOURCE_EXHAUSTED when every peer held is in use. ReleasePeer ends
  // the hold.
  absl::Status AdmitPeer(const std::string& peer);
  void ReleasePeer(const std::string& peer);
  // Whether a lane to `peer` has a queue pair.
  bool PeerConnected(const std::string& peer) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes `peer`'s lanes (into `lanes`, for the caller to drop outside
  // mu_), connect locks and round robin out of the tables.
  void ForgetPeer(const std::string& peer,
                  std::vector<std::shared_ptr<Lane>>& lanes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What the contract does not cover before posting: the local MR.
  absl::Status CheckOp(const Op& op) const;

  // Post's steps. The rail pairs the ops `indices` to `peer` go over, and
  // which bytes each lane carries; the ops fail at once when no rail can
  // be used. `class_of_op` (by op index, over the whole batch) gets each
  // op's affinity class in the plan.
  PeerPlan PlanPeer(absl::Span<const Op> ops, const std::string& peer,
                    std::vector<size_t> indices, PostedBatch& batch,
                    std::vector<size_t>& class_of_op);
  // Which of `rails` x `plan`'s remote rails failed and were not shown to
  // work since; `expired` gets those whose cooldown ran out (worth a
  // probe).
  std::vector<std::vector<bool>> FailedPairs(
      const PeerPlan& plan, const std::vector<Rail*>& rails,
      std::vector<std::pair<size_t, size_t>>& expired);
  // Groups `plan`'s ops by the rails near their buffers (both sides) and
  // pairs rails for each group: near ones for small ops, far ones joining
  // for large ops when the near ones' speed is a small share, any usable
  // ones when no near pair is healthy. `rails` are the usable rails,
  // `healthy` their pairs with the peer's rails; each op's class goes to
  // `class_of_op`.
  void PlanAffinity(absl::Span<const Op> ops, const std::vector<Rail*>& rails,
                    const std::vector<std::vector<bool>>& healthy,
                    PeerPlan& plan, std::vector<size_t>& class_of_op);
  // Cuts `plan`'s ops over the lanes of their affinity class: large ones
  // in proportion to the lanes' shares, small ones whole to the least
  // loaded lane.
  void AssignWork(absl::Span<const Op> ops, PeerPlan& plan,
                  const std::vector<size_t>& class_of_op);
  // Rails usable now (their port's failure cooled down, or they never
  // failed); when none is, the rails whose ports are ACTIVE now.
  std::vector<Rail*> UsableRails();
  // Connects `use`'s lane and posts the bytes planned for it, from where
  // an earlier call stopped. Without `may_block`, stops (false) at the
  // first step that would wait: a handshake, a grant not cached, a full
  // send queue; true once every byte is posted or settled.
  bool RunLane(InFlight& flight, const PeerPlan& plan, LaneUse& use,
               bool may_block);
  // Posts `range` of its op over `use`'s connected lane as WRs of at most
  // the smaller max message size of both rails. What cannot be posted
  // because the lane failed is requeued; other failures settle it. Returns
  // the bytes of `range` dealt with: all of them, or (without `may_block`)
  // those before the step that would wait.
  uint64_t PostRange(const Op& op, const PostedBatch::Range& range,
                     LaneUse& use, const std::shared_ptr<PostedBatch>& batch,
                     const StopToken& stop, bool may_block);
  // Posts the bytes of failed WRs again over the other lanes to their peer
  // (connecting one if needed), or settles them UNAVAILABLE when none is
  // left.
  void Repost(absl::Span<const Op> ops, std::vector<PeerPlan>& plans,
              const std::vector<size_t>& plan_of_op,
              const std::vector<size_t>& class_of_op,
              std::vector<PostedBatch::Retry> retries,
              const std::shared_ptr<PostedBatch>& batch, const StopToken& stop);
  // The least loaded lane of `plan` still standing in this batch for an op
  // of its `affinity_class`, connected (a lane that fails to connect is
  // left out and the next one tried): one near the op's buffers first,
  // then any of the plan; when none is left, a pair the plan left out
  // (AddLane). nullptr when there is none either.
  LaneUse* PickLane(absl::Span<const Op> ops, PeerPlan& plan,
                    size_t affinity_class, const StopToken& stop);
  // Adds to `plan` a lane between usable rails that it does not have yet
  // and that is not cooling down, rails near the buffers of the ops of
  // `affinity_class` first, with at most `max_far_ends` (0-2) of its two
  // rails far from them and, with `fresh_rails`, neither rail used by a
  // lane of the plan still standing; nullptr when there is none.
  LaneUse* AddLane(PeerPlan& plan, size_t affinity_class, int max_far_ends,
                   bool fresh_rails = false);
  // Leaves out `lane` (or its rail, when its port is not ACTIVE) for a
  // while after its path failed with `why`.
  void CoolDown(Lane& lane, const absl::Status& why);
  // Reconnects a lane whose cooldown ran out and sends it a zero-length
  // RDMA WRITE; the lane is used again once that completes.
  void ProbeLane(absl::Span<const Op> ops, const PeerPlan& plan,
                 const std::shared_ptr<Lane>& lane, const StopToken& stop);
  // At the deadline or cancellation: moves the QPs holding WRs of the batch
  // to ERR, drains them, and gives the ops not done the stop's status.
  void CutShort(const std::vector<PeerPlan>& plans, PostedBatch& batch,
                const StopToken& stop);

  // The lane `rail` -> `remote` to `peer`, created on first use.
  std::shared_ptr<Lane> LaneFor(const std::string& peer, Rail& rail,
                                const RemoteRail& remote);
  // The lane's queue pair when it is connected and not broken; nullptr
  // otherwise.
  std::shared_ptr<QueuePairConnection> ConnectedNow(const Lane& lane);
  // The lane's connection. The handshake needs the proof of one buffer:
  // those of the `indices` ops are tried in turn (a few at most), so that
  // one forged or released context does not fail the others.
  absl::StatusOr<std::shared_ptr<QueuePairConnection>> ConnectLane(
      Lane& lane, absl::Span<const Op> ops, const std::vector<size_t>& indices,
      const StopToken& stop);
  absl::StatusOr<std::shared_ptr<QueuePairConnection>> GetConnection(
      Lane& lane, const v1::RemoteBuffer& remote,
      const v1::IbverbsEndpoint& endpoint, const StopToken& stop);
  // ConnectQueuePair for `lane`, reconnecting `session` (the peer's handle
  // from an earlier handshake) when not empty.
  absl::StatusOr<Handshaken> Handshake(const Lane& lane,
                                       const v1::RemoteBuffer& remote,
                                       const v1::IbverbsEndpoint& endpoint,
                                       const std::string& session,
                                       const StopToken& stop);
  // The grant for op's remote buffer over `lane`'s `connection` when it is
  // cached and its session needs no refresh; nullopt otherwise.
  std::optional<GrantedBuffer> CachedGrant(
      const Op& op, const Lane& lane, const QueuePairConnection& connection);
  // The grant for op's remote buffer over `lane`'s `connection`: cached,
  // or asked for with GrantBuffer (cut short by `stop`).
  absl::StatusOr<GrantedBuffer> GrantFor(const Op& op, Lane& lane,
                                         const QueuePairConnection& connection,
                                         const StopToken& stop);

  const BackendEnvironment& env_;
  const IbverbsOptions& options_;
  const std::vector<std::unique_ptr<Rail>>& rails_;
  const std::string backend_;
  // What may block in a posted batch (handshakes, grants, a full send
  // queue, reposts) runs on these threads; lanes connect and post at once
  // up to their number. At most options.max_queued_posting_tasks wait:
  // past it, what would have queued fails (RefusedPosting).
  static constexpr size_t kPostingThreads = 3;
  std::unique_ptr<Executor> posting_;
  // Ends batches at their deadline or cancellation.
  std::unique_ptr<DeadlineTimer> timer_;

  mutable absl::Mutex mu_;
  // One per lane key: serialises handshakes of the same lane, so concurrent
  // batches connect it once, while a slow peer does not hold up handshakes
  // with others.
  std::map<std::string, std::shared_ptr<absl::Mutex>> connect_locks_
      ABSL_GUARDED_BY(mu_);
  // Lanes by "agent_id/epoch/local rail>remote rail"; a lane's connection,
  // session and grants are guarded by mu_ too.
  std::map<std::string, std::shared_ptr<Lane>> lanes_ ABSL_GUARDED_BY(mu_);
  // Rotates ties among equally loaded lanes, per peer ("agent/epoch").
  std::map<std::string, size_t> round_robin_ ABSL_GUARDED_BY(mu_);
  // Peers with state (lanes, connect locks, round robin) by "agent/epoch":
  // batches using each now, and when one last did. At most
  // options.max_requester_peers; idle ones expire (ExpireIdle).
  struct PeerUse {
    int in_use = 0;
    absl::Time last_used;
  };
  std::map<std::string, PeerUse> peers_ ABSL_GUARDED_BY(mu_);
  // Peer channels by address, at most options.max_requester_peers (least
  // recently used first out); idle ones expire.
  struct Channel {
    std::shared_ptr<v1::Peer::Stub> stub;
    absl::Time last_used;
  };
  std::map<std::string, Channel> stubs_ ABSL_GUARDED_BY(mu_);
  uint64_t connections_established_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace rdma_agent::ibverbs

#endif  // RDMA_AGENTD_BACKENDS_IBVERBS_REQUESTER_H_

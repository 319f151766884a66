#include "backends/ibverbs/requester.h"

#include <grpc/grpc.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cassert>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <tuple>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "backends/ibverbs/registration_state.h"
#include "backends/ibverbs/striping.h"
#include "backends/peer_tls.h"
#include "common/grpc_status.h"
#include "common/log_text.h"
#include "common/status_util.h"
#include "spdlog/spdlog.h"

namespace rdma_agent::ibverbs {
namespace {

// Piece boundaries of a striped op fall on pages, so that each piece's DMA
// starts aligned when the op's does.
constexpr uint64_t kStripeAlign = 4096;

// How often the port of a healthy rail is looked at (ibv_query_port, a
// system call on hardware) when planning: a cable pulled between batches is
// then left out at once rather than found by a WR's transport timeout.
constexpr absl::Duration kPortCheckInterval = absl::Milliseconds(100);

// Takes a lane's probe completion: the lane is used again once one
// succeeds, and cools down for longer when it fails.
class ProbeSink : public CompletionSink {
 public:
  ProbeSink(std::shared_ptr<LaneHealth> health, std::string lane,
            absl::Duration initial, absl::Duration max)
      : health_(std::move(health)),
        lane_(std::move(lane)),
        initial_(initial),
        max_(max) {}

  void OnCompletion(uint64_t /*cookie*/, const ibv_wc& wc) override {
    absl::MutexLock lock(&health_->mu);
    health_->probing = false;
    if (wc.status == IBV_WC_SUCCESS) {
      health_->cooldown.Recover();
      spdlog::info("ibverbs: rail pair {} answered its probe: in use again",
                   lane_);
      return;
    }
    health_->cooldown.Fail(absl::Now(), initial_, max_,
                           std::string(CompletionStatus(wc).message()));
  }

 private:
  const std::shared_ptr<LaneHealth> health_;
  const std::string lane_;
  const absl::Duration initial_;
  const absl::Duration max_;
};

// "agent" of a peer key "agent/epoch".
std::string AgentOf(const std::string& peer) {
  return peer.substr(0, peer.rfind('/'));
}

}  // namespace

// A requester QP just connected, with what the handshake granted.
struct Requester::Handshaken {
  std::shared_ptr<QueuePairConnection> connection;
  std::string session;
  absl::Duration session_idle_timeout;
  uint64_t buffer_id = 0;
  RemoteGrant grant;
};

// One lane as one Submit uses it.
struct Requester::LaneUse {
  std::shared_ptr<Lane> lane;
  // Its share of striped ops (Gbit/s it can count on).
  double weight = 0;
  // The bytes planned for it, in batch order.
  std::vector<PostedBatch::Range> work;
  // Set once connected.
  std::shared_ptr<QueuePairConnection> connection;
  // Not OK: it failed and is left out for the rest of the Submit.
  absl::Status failed;
  // Its path failure was acted on (CoolDown), once.
  bool cooled = false;
  // A WR went out on it.
  bool posted = false;
  // Its handshake failed: the peer's Peer service did not answer, which
  // other lanes would find too (their handshakes go to the same address).
  bool connect_failed = false;
  // Where posting `work` stopped to go on elsewhere (RunLane): the range,
  // and the bytes of it already dealt with.
  size_t next_range = 0;
  uint64_t next_offset = 0;
};

// Ops of one peer plan whose buffers are near the same rails on both sides,
// and the lanes (indices into the plan's) they go over, with each lane's
// share.
struct Requester::AffinityClass {
  // Near the ops' buffers: this agent's rails by Rail::index, the peer's by
  // index into the plan's remote rails.
  std::vector<bool> local_near;
  std::vector<bool> remote_near;
  // Small ops: the near rails' pairs.
  std::vector<size_t> small_lanes;
  std::vector<double> small_weights;
  // Striped ops: the same, or with far rails joining (PlanAffinity).
  std::vector<size_t> large_lanes;
  std::vector<double> large_weights;
};

// The ops of one Submit to one peer (agent and epoch) and the lanes they go
// over. `lanes` is a deque: RunLane holds references to its elements while
// Repost may add lanes.
struct Requester::PeerPlan {
  std::string peer;
  std::vector<size_t> ops;
  std::vector<RemoteRail> remote_rails;
  std::deque<LaneUse> lanes;
  // Lanes whose cooldown ran out while others are healthy: probed aside.
  std::vector<std::shared_ptr<Lane>> probes;
  std::vector<AffinityClass> classes;
};

// One posted batch from Post until its done is called: what its posting
// threads, reposts and cut share. It keeps itself alive (`self`) until it
// ends; the batch tells it of progress (PostedBatch::Listener).
struct Requester::InFlight : PostedBatch::Listener {
  InFlight(Requester& requester, absl::Span<const Op> ops,
           const StopToken& stop, OpsDone done)
      : requester(requester),
        ops(ops),
        stop(stop),
        done(std::move(done)),
        batch(std::make_shared<PostedBatch>(ops)) {}

  // On a poller, or the posting path: nothing there may block.
  void OnBatchWoken() override { requester.Kick(*this, /*may_block=*/false); }

  Requester& requester;
  const absl::Span<const Op> ops;
  const StopToken stop;
  OpsDone done;
  const std::shared_ptr<PostedBatch> batch;
  // Written before posting starts. Then each posting step works on its own
  // lane's LaneUse; a repost (which may add lanes), the cut and End run
  // with no other step under way.
  std::vector<PeerPlan> plans;
  // Each op's plan, and its affinity class in that plan, by op index.
  std::vector<size_t> plan_of_op;
  std::vector<size_t> class_of_op;
  // Peers held for the batch (AdmitPeer).
  std::vector<std::string> admitted;
  std::unique_ptr<Cancellation::Callback> on_cancel;
  std::optional<DeadlineTimer::Handle> deadline;
  std::shared_ptr<InFlight> self;

  absl::Mutex mu;
  // Steps under way: the posting path, a posting thread's lane or probe, a
  // repost, a cut.
  int holds ABSL_GUARDED_BY(mu) = 0;
  // The deadline passed or the stop was cancelled.
  bool stopped ABSL_GUARDED_BY(mu) = false;
  // End has begun (once).
  bool ended ABSL_GUARDED_BY(mu) = false;
};

Requester::Requester(const BackendEnvironment& env,
                     const IbverbsOptions& options,
                     const std::vector<std::unique_ptr<Rail>>& rails,
                     std::string backend)
    : env_(env),
      options_(options),
      rails_(rails),
      backend_(std::move(backend)),
      posting_(std::make_unique<Executor>(
          kPostingThreads, options.max_queued_posting_tasks, "ibv-posting")),
      timer_(std::make_unique<DeadlineTimer>("ibv-deadline")) {}

Requester::~Requester() {
  timer_.reset();
  posting_.reset();
  // Lanes' connections drain and stop their pollers before the rest goes.
  std::map<std::string, std::shared_ptr<Lane>> lanes;
  {
    absl::MutexLock lock(&mu_);
    lanes.swap(lanes_);
  }
  lanes.clear();
}

std::shared_ptr<v1::Peer::Stub> Requester::StubFor(const std::string& address) {
  std::shared_ptr<v1::Peer::Stub> evicted;  // its channel closes unlocked
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  auto it = stubs_.find(address);
  if (it == stubs_.end()) {
    // Contexts name any address: the least recently used channel makes
    // room (calls in flight on it keep it until they end).
    if (stubs_.size() >= options_.max_requester_peers) {
      auto oldest = std::min_element(
          stubs_.begin(), stubs_.end(), [](const auto& a, const auto& b) {
            return a.second.last_used < b.second.last_used;
          });
      evicted = std::move(oldest->second.stub);
      stubs_.erase(oldest);
    }
    grpc::ChannelArguments args;
    std::shared_ptr<grpc::ChannelCredentials> credentials =
        PeerChannelCredentials(env_.peer_tls, &args);
    it = stubs_
             .emplace(address,
                      Channel{v1::Peer::NewStub(grpc::CreateCustomChannel(
                                  address, credentials, args)),
                              now})
             .first;
  }
  it->second.last_used = now;
  return it->second.stub;
}

absl::Status Requester::AdmitPeer(const std::string& peer) {
  std::vector<std::shared_ptr<Lane>> evicted;  // their QPs go unlocked
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  auto it = peers_.find(peer);
  if (it == peers_.end()) {
    if (peers_.size() >= options_.max_requester_peers) {
      // Room from a peer no Submit uses: one never connected first (what
      // forged contexts leave), then the least recently used.
      auto victim = peers_.end();
      bool victim_connected = true;
      for (auto p = peers_.begin(); p != peers_.end(); ++p) {
        if (p->second.in_use > 0) continue;
        const bool connected = PeerConnected(p->first);
        if (victim == peers_.end() || (!connected && victim_connected) ||
            (connected == victim_connected &&
             p->second.last_used < victim->second.last_used)) {
          victim = p;
          victim_connected = connected;
        }
      }
      if (victim == peers_.end()) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "this agent is already talking to ", peers_.size(),
            " peer agents over RDMA (--ibverbs_max_requester_peers)"));
      }
      ForgetPeer(victim->first, evicted);
      peers_.erase(victim);
    }
    it = peers_.emplace(peer, PeerUse{}).first;
  }
  ++it->second.in_use;
  it->second.last_used = now;
  return absl::OkStatus();
}

void Requester::ReleasePeer(const std::string& peer) {
  absl::MutexLock lock(&mu_);
  auto it = peers_.find(peer);
  if (it == peers_.end()) return;
  --it->second.in_use;
  it->second.last_used = absl::Now();
}

bool Requester::PeerConnected(const std::string& peer) const {
  const std::string prefix = absl::StrCat(peer, "/");
  for (auto it = lanes_.lower_bound(prefix);
       it != lanes_.end() && absl::StartsWith(it->first, prefix); ++it) {
    if (it->second->connection != nullptr) return true;
  }
  return false;
}

void Requester::ForgetPeer(const std::string& peer,
                           std::vector<std::shared_ptr<Lane>>& lanes) {
  const std::string prefix = absl::StrCat(peer, "/");
  for (auto it = lanes_.lower_bound(prefix);
       it != lanes_.end() && absl::StartsWith(it->first, prefix);) {
    connect_locks_.erase(it->first);
    lanes.push_back(std::move(it->second));
    it = lanes_.erase(it);
  }
  round_robin_.erase(peer);
}

void Requester::ExpireIdle(absl::Time now) {
  const absl::Duration timeout = options_.requester_idle_timeout;
  if (timeout <= absl::ZeroDuration()) return;
  std::vector<std::shared_ptr<Lane>> expired;  // their QPs go unlocked
  std::vector<std::shared_ptr<v1::Peer::Stub>> channels;
  absl::MutexLock lock(&mu_);
  for (auto it = peers_.begin(); it != peers_.end();) {
    if (it->second.in_use > 0 || now - it->second.last_used <= timeout) {
      ++it;
      continue;
    }
    ForgetPeer(it->first, expired);
    it = peers_.erase(it);
  }
  for (auto it = stubs_.begin(); it != stubs_.end();) {
    if (now - it->second.last_used <= timeout) {
      ++it;
      continue;
    }
    channels.push_back(std::move(it->second.stub));
    it = stubs_.erase(it);
  }
  // What was taken goes once mu_ is released (declared before `lock`).
}

uint64_t Requester::connections_established() const {
  absl::MutexLock lock(&mu_);
  return connections_established_;
}

size_t Requester::connections() const {
  absl::MutexLock lock(&mu_);
  size_t connected = 0;
  for (const auto& [key, lane] : lanes_)
    connected += lane->connection != nullptr;
  return connected;
}

std::map<std::string, size_t> Requester::ConnectionsByPeer() const {
  absl::MutexLock lock(&mu_);
  // By peer agent and device; a peer's epoch, or which of our rails, is no
  // label worth a new time series.
  std::map<std::string, size_t> out;
  for (const auto& [key, lane] : lanes_) {
    if (lane->connection == nullptr) continue;
    ++out[absl::StrCat(AgentOf(lane->peer), "/", lane->remote.device)];
  }
  return out;
}

std::map<const Rail*, size_t> Requester::LanesCoolingDown(
    absl::Time now) const {
  std::map<const Rail*, size_t> cooling;
  absl::MutexLock lock(&mu_);
  for (const auto& [key, lane] : lanes_) {
    absl::MutexLock health(&lane->health->mu);
    if (lane->health->cooldown.cooling(now)) ++cooling[lane->rail];
  }
  return cooling;
}

size_t Requester::peers() const {
  absl::MutexLock lock(&mu_);
  return peers_.size();
}

size_t Requester::channels() const {
  absl::MutexLock lock(&mu_);
  return stubs_.size();
}

std::string Requester::PeerKey(const v1::RemoteBuffer& remote) {
  return absl::StrCat(remote.agent_id(), "/", remote.agent_epoch());
}

absl::Status Requester::CheckOp(const Op& op) const {
  // Routed here by the registry, which checked CanReach, with both ranges
  // validated (backend.h): nothing of the context is checked again.
  assert(op.endpoint != nullptr && op.endpoint->has_ibverbs());
  // What the posting path casts to: one lookup, so that a registration that
  // bypassed BackendRegistry::RegisterWithAll fails instead of crashing.
  if (dynamic_cast<const IbverbsRegistration*>(
          op.local->backend_state(backend_)) == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("local buffer ", op.local->id(),
                     " is not registered with the ibverbs backend"));
  }
  return absl::OkStatus();
}

void Requester::Post(absl::Span<const Op> ops, const StopToken& stop,
                     OpsDone done) {
  auto flight = std::make_shared<InFlight>(*this, ops, stop, std::move(done));
  InFlight& f = *flight;
  f.self = flight;
  f.batch->SetListener(flight);
  Hold(f);  // this thread's posting
  if (stop.deadline() < absl::InfiniteFuture()) {
    f.deadline =
        timer_->At(stop.deadline(), [this, flight] { Stopped(*flight); });
  }
  // The cancelling thread only hands the cut to the timer thread.
  f.on_cancel = stop.OnCancel([this, flight] {
    timer_->At(absl::InfinitePast(), [this, flight] { Stopped(*flight); });
  });
  // Ops grouped by peer (agent and epoch), each group in batch order, the
  // groups in the order their peers first appear. No string is built per
  // op: ops name their peer's agent id and epoch, which are compared (with
  // the previous op's peer first: batches mostly go to one peer).
  struct Group {
    const v1::RemoteBuffer* remote;
    size_t count = 0;
    std::vector<size_t> indices;
  };
  constexpr size_t kSettled = ~size_t{0};
  std::vector<Group> groups;
  absl::flat_hash_map<std::pair<absl::string_view, uint64_t>, size_t>
      group_of_peer;
  f.plan_of_op.assign(ops.size(), kSettled);  // the group, until planned
  f.class_of_op.assign(ops.size(), 0);
  size_t last = kSettled;
  for (size_t i = 0; i < ops.size(); ++i) {
    absl::Status checked = stop.Check("before posting");
    if (checked.ok()) checked = CheckOp(ops[i]);
    if (!checked.ok()) {
      f.batch->Settle({i, 0, ops[i].length}, checked);
      continue;
    }
    const v1::RemoteBuffer& remote = *ops[i].remote;
    if (last == kSettled ||
        groups[last].remote->agent_epoch() != remote.agent_epoch() ||
        groups[last].remote->agent_id() != remote.agent_id()) {
      last = group_of_peer
                 .try_emplace({remote.agent_id(), remote.agent_epoch()},
                              groups.size())
                 .first->second;
      if (last == groups.size()) groups.push_back(Group{&remote, 0, {}});
    }
    f.plan_of_op[i] = last;
    ++groups[last].count;
  }
  for (Group& group : groups) group.indices.reserve(group.count);
  for (size_t i = 0; i < ops.size(); ++i) {
    if (f.plan_of_op[i] != kSettled) {
      groups[f.plan_of_op[i]].indices.push_back(i);
    }
  }
  // Each peer's state is held for the batch (never evicted under it);
  // past --ibverbs_max_requester_peers in use, its ops are refused.
  f.plans.reserve(groups.size());
  for (Group& group : groups) {
    std::string peer = PeerKey(*group.remote);
    if (absl::Status status = AdmitPeer(peer); !status.ok()) {
      for (size_t i : group.indices) {
        f.batch->Settle({i, 0, ops[i].length}, status);
      }
      continue;
    }
    f.plans.push_back(
        PlanPeer(ops, peer, std::move(group.indices), *f.batch, f.class_of_op));
    f.admitted.push_back(std::move(peer));
    for (size_t i : f.plans.back().ops) f.plan_of_op[i] = f.plans.size() - 1;
  }

  // Lanes already connected are posted to here; the others connect and
  // post on the posting threads, all at once, so that a slow handshake or
  // a full send queue on one does not hold up the others.
  // Past the posting threads' bound, a lane's bytes fail at once and a
  // probe waits for a later batch.
  for (PeerPlan& plan : f.plans) {
    for (LaneUse& use : plan.lanes) {
      if (use.work.empty()) continue;
      if (RunLane(f, plan, use, /*may_block=*/false)) continue;
      Hold(f);
      Executor::Task task = [this, flight, &plan, &use] {
        RunLane(*flight, plan, use, /*may_block=*/true);
        Release(*flight, /*may_block=*/true);
      };
      if (!posting_->TryPost(task)) {
        SettleRest(f, use, RefusedPosting());
        Release(f, /*may_block=*/false);
      }
    }
    for (const std::shared_ptr<Lane>& lane : plan.probes) {
      Hold(f);
      Executor::Task task = [this, flight, &plan, lane] {
        ProbeLane(flight->ops, plan, lane, flight->stop);
        Release(*flight, /*may_block=*/true);
      };
      if (!posting_->TryPost(task)) Release(f, /*may_block=*/false);
    }
  }
  Release(f, /*may_block=*/false);
}

void Requester::Hold(InFlight& flight) {
  absl::MutexLock lock(&flight.mu);
  ++flight.holds;
}

void Requester::Release(InFlight& flight, bool may_block) {
  {
    absl::MutexLock lock(&flight.mu);
    --flight.holds;
  }
  Kick(flight, may_block);
}

void Requester::Stopped(InFlight& flight) {
  {
    absl::MutexLock lock(&flight.mu);
    flight.stopped = true;
  }
  Kick(flight, /*may_block=*/true);
}

void Requester::Kick(InFlight& flight, bool may_block) {
  enum class Next { kWait, kEnd, kCut, kRepost };
  Next next = Next::kWait;
  std::shared_ptr<InFlight> keep;  // for a step handed to another thread
  {
    absl::MutexLock lock(&flight.mu);
    if (flight.ended || flight.holds > 0) return;
    if (flight.batch->AllDone()) {
      flight.ended = true;
      next = Next::kEnd;
    } else if (flight.stopped || flight.stop.stopped()) {
      // (Past the deadline before the timer said so: cut, not reposted.)
      ++flight.holds;
      next = Next::kCut;
      keep = flight.self;
    } else if (flight.batch->HasRetries()) {
      ++flight.holds;
      next = Next::kRepost;
      keep = flight.self;
    }
  }
  switch (next) {
    case Next::kWait:
      return;
    case Next::kEnd:
      End(flight, /*cut=*/false);
      return;
    case Next::kCut:
      // Draining waits for the pollers: never on one of them.
      if (may_block) {
        CutAndEnd(flight);
      } else {
        timer_->At(absl::InfinitePast(),
                   [this, keep = std::move(keep)] { CutAndEnd(*keep); });
      }
      return;
    case Next::kRepost: {
      // A repost may connect another lane (a handshake): a posting thread;
      // when their queue is full, the bytes fail here instead.
      Executor::Task task = [this, keep = std::move(keep)] {
        InFlight& f = *keep;
        Repost(f.ops, f.plans, f.plan_of_op, f.class_of_op,
               f.batch->TakeRetries(), f.batch, f.stop);
        Release(f, /*may_block=*/true);
      };
      if (!posting_->TryPost(task)) {
        const absl::Status refused = RefusedPosting();
        for (const PostedBatch::Retry& retry : flight.batch->TakeRetries()) {
          flight.batch->Settle(retry.range, refused);
        }
        Release(flight, may_block);
      }
      return;
    }
  }
}

absl::Status Requester::RefusedPosting() const {
  return absl::ResourceExhaustedError(absl::StrCat(
      "the ibverbs backend's posting threads already have ",
      options_.max_queued_posting_tasks,
      " tasks queued (IbverbsOptions::max_queued_posting_tasks); not posted"));
}

void Requester::SettleRest(InFlight& flight, LaneUse& use,
                           const absl::Status& why) {
  for (; use.next_range < use.work.size();
       ++use.next_range, use.next_offset = 0) {
    const PostedBatch::Range& range = use.work[use.next_range];
    flight.batch->Settle({range.op, range.offset + use.next_offset,
                          range.length - use.next_offset},
                         why);
  }
}

void Requester::CutAndEnd(InFlight& flight) {
  CutShort(flight.plans, *flight.batch, flight.stop);
  {
    absl::MutexLock lock(&flight.mu);
    --flight.holds;
    flight.ended = true;
  }
  End(flight, /*cut=*/true);
}

void Requester::End(InFlight& flight, bool cut) {
  // Nothing else runs on the batch now (it ended with no hold left); it
  // goes once this returns.
  const std::shared_ptr<InFlight> keep = std::move(flight.self);
  // Before done: the caller may destroy the Cancellation then.
  flight.on_cancel.reset();
  if (flight.deadline.has_value()) timer_->Cancel(*flight.deadline);
  if (!cut) {
    // Lanes that carried their bytes without a failure are healthy, even
    // those tried while cooling down because no other was left.
    for (PeerPlan& plan : flight.plans) {
      for (LaneUse& use : plan.lanes) {
        if (!use.posted || !use.failed.ok()) continue;
        absl::MutexLock lock(&use.lane->health->mu);
        if (!use.lane->health->probing) use.lane->health->cooldown.Recover();
      }
    }
  }
  for (const std::string& peer : flight.admitted) ReleasePeer(peer);
  std::vector<absl::Status> results = flight.batch->Results();
  for (size_t i = 0; i < flight.ops.size(); ++i) {
    if (results[i].ok()) flight.ops[i].local->CountMoved(flight.ops[i].length);
  }
  // The plans' references to lanes and queue pairs may be the last ones (a
  // lane expired or reconnected meanwhile): a queue pair's last reference
  // drains it, which its own poller must not do. They go here, not with
  // the batch's state, whose last reference a poller may drop later.
  std::vector<PeerPlan> plans = std::move(flight.plans);
  // Never refused (one per batch ending on a poller).
  if (OnCompletionPollerThread() && !plans.empty()) {
    posting_->Post([plans = std::move(plans)]() mutable { plans.clear(); });
  }
  plans.clear();
  std::move(flight.done)(std::move(results));
}

std::vector<Rail*> Requester::UsableRails() {
  const absl::Time now = absl::Now();
  std::vector<Rail*> usable;
  for (const auto& rail : rails_) {
    absl::MutexLock lock(&rail->mu);
    if (!rail->port_active) {
      // Down since start or since a port event or look said so: back when
      // a port event says ACTIVE, or (a device without events) when this
      // look does.
      if (now - rail->port_checked < kPortCheckInterval) continue;
      rail->port_checked = now;
      auto port = rail->device->device->QueryPort(rail->local.port);
      if (!port.ok() || port->state != IBV_PORT_ACTIVE) continue;
      rail->port_active = true;
      // On to its health: a rail that failed waits out its cooldown.
    }
    const bool failed = rail->health.failed();
    if (failed && rail->health.cooling(now)) continue;
    // A failed rail whose cooldown ran out is back once its port is ACTIVE
    // again; a healthy one is out as soon as its port is not.
    if (failed || now - rail->port_checked >= kPortCheckInterval) {
      rail->port_checked = now;
      auto port = rail->device->device->QueryPort(rail->local.port);
      if (!port.ok() || port->state != IBV_PORT_ACTIVE) {
        const std::string why =
            port.ok() ? absl::StrCat("port ", verbs::PortStateName(port->state))
                      : std::string(port.status().message());
        rail->health.Fail(now, options_.rail_cooldown,
                          options_.rail_max_cooldown, why);
        rail->port_active = false;
        if (!failed) {
          spdlog::warn("ibverbs: rail {} is out ({}): left out for {}",
                       rail->name, why,
                       absl::FormatDuration(rail->health.until() - now));
        }
        continue;
      }
      if (failed) {
        rail->health.Recover();
        spdlog::info("ibverbs: rail {} is ACTIVE again: in use", rail->name);
      }
    }
    usable.push_back(rail.get());
  }
  if (!usable.empty()) return usable;
  // All cooling down: whichever port is ACTIVE now is worth a try.
  for (const auto& rail : rails_) {
    auto port = rail->device->device->QueryPort(rail->local.port);
    if (port.ok() && port->state == IBV_PORT_ACTIVE) {
      absl::MutexLock lock(&rail->mu);
      rail->port_active = true;
      usable.push_back(rail.get());
    }
  }
  return usable;
}

std::shared_ptr<Lane> Requester::LaneFor(const std::string& peer, Rail& rail,
                                         const RemoteRail& remote) {
  const std::string key =
      absl::StrCat(peer, "/", rail.name, ">", remote.name());
  absl::MutexLock lock(&mu_);
  std::shared_ptr<Lane>& lane = lanes_[key];
  if (lane == nullptr) lane = std::make_shared<Lane>(key, peer, &rail, remote);
  return lane;
}

Requester::PeerPlan Requester::PlanPeer(absl::Span<const Op> ops,
                                        const std::string& peer,
                                        std::vector<size_t> indices,
                                        PostedBatch& batch,
                                        std::vector<size_t>& class_of_op) {
  PeerPlan plan;
  plan.peer = peer;
  plan.ops = std::move(indices);
  // Every op of the group names the same agent and epoch, so the same rails.
  plan.remote_rails = RemoteRailsOf(ops[plan.ops.front()].endpoint->ibverbs());
  const std::vector<Rail*> rails = UsableRails();
  if (rails.empty()) {
    std::vector<std::string> names;
    for (const auto& rail : rails_) names.push_back(rail->name);
    const absl::Status none = absl::UnavailableError(
        absl::StrCat("no RDMA rail of this agent has an ACTIVE port (",
                     absl::StrJoin(names, ", "), ")"));
    for (size_t i : plan.ops) batch.Settle({i, 0, ops[i].length}, none);
    plan.ops.clear();
    return plan;
  }

  std::vector<std::pair<size_t, size_t>> expired;
  const std::vector<std::vector<bool>> failed =
      FailedPairs(plan, rails, expired);
  const std::vector<std::vector<bool>> healthy = HealthyPairs(failed);
  const bool any_healthy =
      std::any_of(healthy.begin(), healthy.end(), [](const auto& row) {
        return std::find(row.begin(), row.end(), true) != row.end();
      });
  // Pairs whose cooldown ran out are probed while healthy ones carry the
  // ops; when nothing is healthy they are tried with the ops themselves.
  if (any_healthy) {
    for (const auto& [l, r] : expired) {
      plan.probes.push_back(
          LaneFor(plan.peer, *rails[l], plan.remote_rails[r]));
    }
  }
  PlanAffinity(ops, rails, healthy, plan, class_of_op);
  AssignWork(ops, plan, class_of_op);
  return plan;
}

namespace {

// Sum of the link speeds of the rails `chosen` picks (unknown speeds count
// as 1 Gbit/s, so that rails of unknown speed still count).
double TotalGbps(absl::Span<const double> gbps,
                 const std::vector<bool>& chosen) {
  double total = 0;
  for (size_t i = 0; i < gbps.size(); ++i) {
    if (chosen[i]) total += gbps[i] > 0 ? gbps[i] : 1.0;
  }
  return total;
}

bool Any(const std::vector<bool>& chosen) {
  return std::find(chosen.begin(), chosen.end(), true) != chosen.end();
}

// Pairs of the rails `local` x `remote` pick (PairRails over them), with
// indices into the full lists; empty when no allowed pair is among them.
std::vector<RailPair> PairAmong(
    absl::Span<const double> local_gbps, absl::Span<const double> remote_gbps,
    const std::vector<bool>& local, const std::vector<bool>& remote,
    const std::function<bool(size_t, size_t)>& allowed) {
  std::vector<size_t> l_index;
  std::vector<size_t> r_index;
  std::vector<double> l_gbps;
  std::vector<double> r_gbps;
  for (size_t i = 0; i < local.size(); ++i) {
    if (!local[i]) continue;
    l_index.push_back(i);
    l_gbps.push_back(local_gbps[i]);
  }
  for (size_t i = 0; i < remote.size(); ++i) {
    if (!remote[i]) continue;
    r_index.push_back(i);
    r_gbps.push_back(remote_gbps[i]);
  }
  if (l_index.empty() || r_index.empty()) return {};
  std::vector<RailPair> pairs = PairRails(
      l_gbps, r_gbps,
      [&](size_t l, size_t r) { return allowed(l_index[l], r_index[r]); });
  for (RailPair& pair : pairs) {
    pair.local = l_index[pair.local];
    pair.remote = r_index[pair.remote];
  }
  return pairs;
}

// The pairs for rails `local` x `remote`, widened when none of them is
// healthy: near rails of one side with any rail of the other, then any
// healthy pair (far rails take over before the op gives up on RDMA), then
// any pair at all (nothing is healthy: try them rather than fail outright,
// a failure costs a transport timeout and then the registry's retry on
// tcp).
std::vector<RailPair> PairsOrWider(
    absl::Span<const double> local_gbps, absl::Span<const double> remote_gbps,
    const std::vector<bool>& local, const std::vector<bool>& remote,
    const std::vector<std::vector<bool>>& healthy) {
  const std::vector<bool> every_local(local.size(), true);
  const std::vector<bool> every_remote(remote.size(), true);
  const auto is_healthy = [&](size_t l, size_t r) { return healthy[l][r]; };
  for (const auto& [l, r] :
       {std::pair{&local, &remote}, std::pair{&local, &every_remote},
        std::pair{&every_local, &remote},
        std::pair{&every_local, &every_remote}}) {
    std::vector<RailPair> pairs =
        PairAmong(local_gbps, remote_gbps, *l, *r, is_healthy);
    if (!pairs.empty()) return pairs;
  }
  return PairAmong(local_gbps, remote_gbps, every_local, every_remote,
                   [](size_t, size_t) { return true; });
}

}  // namespace

void Requester::PlanAffinity(absl::Span<const Op> ops,
                             const std::vector<Rail*>& rails,
                             const std::vector<std::vector<bool>>& healthy,
                             PeerPlan& plan, std::vector<size_t>& class_of_op) {
  std::vector<double> local_gbps;
  for (Rail* rail : rails) local_gbps.push_back(rail->speed_gbps);
  std::vector<double> remote_gbps;
  for (const RemoteRail& rail : plan.remote_rails) {
    remote_gbps.push_back(rail.speed_gbps);
  }
  const bool nearest =
      options_.numa_policy == IbverbsOptions::NumaPolicy::kNearest;
  const std::vector<bool> every_local(rails.size(), true);
  const std::vector<bool> every_remote(plan.remote_rails.size(), true);
  // Far rails join striped ops when the near ones' speed is a small share
  // of all (a host with one NIC near the buffer and three far), unless the
  // near ones are those on a device's PCIe switch (`only`): the far ones
  // would reach its memory through the CPU.
  const auto widened = [&](const std::vector<bool>& near,
                           absl::Span<const double> gbps,
                           const std::vector<bool>& every, bool only) {
    return !only && TotalGbps(gbps, near) <
                        options_.numa_near_share * TotalGbps(gbps, every)
               ? every
               : near;
  };
  std::map<std::shared_ptr<Lane>, size_t> lane_index;
  const auto add_lanes = [&](const std::vector<RailPair>& pairs,
                             std::vector<size_t>& lanes,
                             std::vector<double>& weights) {
    for (const RailPair& pair : pairs) {
      const std::shared_ptr<Lane> lane = LaneFor(
          plan.peer, *rails[pair.local], plan.remote_rails[pair.remote]);
      auto [it, added] = lane_index.emplace(lane, plan.lanes.size());
      if (added) {
        LaneUse use;
        use.lane = lane;
        plan.lanes.push_back(std::move(use));
      }
      LaneUse& use = plan.lanes[it->second];
      use.weight = std::max(use.weight, pair.weight);
      lanes.push_back(it->second);
      weights.push_back(pair.weight);
    }
  };
  // Classes by which rails are near the ops' buffers: as many as distinct
  // (local node, remote node) pairs among the ops, each paired once (and by
  // whether large ops keep to the near rails on either side).
  using ClassKey = std::tuple<std::vector<bool>, std::vector<bool>, bool, bool>;
  std::map<ClassKey, size_t> classes;
  // The op at hand's key, its storage reused from op to op (copied only
  // for a new class).
  ClassKey key;
  auto& [local, remote, local_only, remote_only] = key;
  for (size_t i : plan.ops) {
    // Near rails of ours that are usable now; all usable ones when none of
    // them is (far rails take over).
    local = every_local;
    remote = every_remote;
    local_only = false;
    remote_only = false;
    if (nearest) {
      const RailAffinity& near = dynamic_cast<const IbverbsRegistration&>(
                                     *ops[i].local->backend_state(backend_))
                                     .affinity();
      for (size_t l = 0; l < rails.size(); ++l) {
        local[l] = rails[l]->index < near.near_rails.size() &&
                   near.near_rails[rails[l]->index];
      }
      local_only = near.near_rails_only;
      if (!Any(local)) local = every_local;
      RemoteNearRailsOf(ops[i].endpoint->ibverbs(), remote);
      remote.resize(plan.remote_rails.size(), false);
      remote_only = ops[i].endpoint->ibverbs().near_rails_only();
      if (!Any(remote)) remote = every_remote;
    }
    if (auto it = classes.find(key); it != classes.end()) {
      class_of_op[i] = it->second;
      continue;
    }
    class_of_op[i] = plan.classes.size();
    classes.emplace(key, plan.classes.size());
    AffinityClass affinity;
    add_lanes(PairsOrWider(local_gbps, remote_gbps, local, remote, healthy),
              affinity.small_lanes, affinity.small_weights);
    const std::vector<bool> large_local =
        widened(local, local_gbps, every_local, local_only);
    const std::vector<bool> large_remote =
        widened(remote, remote_gbps, every_remote, remote_only);
    if (large_local == local && large_remote == remote) {
      affinity.large_lanes = affinity.small_lanes;
      affinity.large_weights = affinity.small_weights;
    } else {
      add_lanes(PairsOrWider(local_gbps, remote_gbps, large_local, large_remote,
                             healthy),
                affinity.large_lanes, affinity.large_weights);
    }
    affinity.local_near.assign(rails_.size(), false);
    for (size_t l = 0; l < rails.size(); ++l) {
      affinity.local_near[rails[l]->index] = local[l];
    }
    affinity.remote_near = remote;
    plan.classes.push_back(std::move(affinity));
  }
}

std::vector<std::vector<bool>> Requester::FailedPairs(
    const PeerPlan& plan, const std::vector<Rail*>& rails,
    std::vector<std::pair<size_t, size_t>>& expired) {
  const absl::Time now = absl::Now();
  std::vector<std::vector<bool>> failed(
      rails.size(), std::vector<bool>(plan.remote_rails.size(), false));
  absl::MutexLock lock(&mu_);
  for (size_t l = 0; l < rails.size(); ++l) {
    for (size_t r = 0; r < plan.remote_rails.size(); ++r) {
      auto it = lanes_.find(absl::StrCat(plan.peer, "/", rails[l]->name, ">",
                                         plan.remote_rails[r].name()));
      if (it == lanes_.end()) continue;  // never used: healthy
      LaneHealth& health = *it->second->health;
      absl::MutexLock health_lock(&health.mu);
      if (!health.cooldown.failed()) continue;
      failed[l][r] = true;
      if (!health.cooldown.cooling(now) && !health.probing) {
        expired.emplace_back(l, r);
      }
    }
  }
  return failed;
}

void Requester::AssignWork(absl::Span<const Op> ops, PeerPlan& plan,
                           const std::vector<size_t>& class_of_op) {
  std::vector<double> loads;  // bytes in flight, then planned too
  for (const LaneUse& use : plan.lanes) {
    loads.push_back(static_cast<double>(use.lane->load->bytes.load()));
  }
  size_t round_robin;
  {
    absl::MutexLock lock(&mu_);
    round_robin = round_robin_[plan.peer]++;
  }
  // Room for an even share of the ops on each lane (a striped op puts one
  // piece on each lane of its class): the lanes' vectors are sized once,
  // not grown op by op.
  const size_t share =
      plan.ops.size() / std::max<size_t>(plan.lanes.size(), 1) + 1;
  for (LaneUse& use : plan.lanes) use.work.reserve(share);
  std::vector<double> class_loads;
  std::vector<Piece> pieces;
  for (size_t i : plan.ops) {
    const AffinityClass& affinity = plan.classes[class_of_op[i]];
    const uint64_t length = ops[i].length;
    if (length >= options_.stripe_threshold_bytes &&
        affinity.large_lanes.size() > 1) {
      SplitByWeight(length, affinity.large_weights, kStripeAlign, pieces);
      for (const Piece& piece : pieces) {
        const size_t lane = affinity.large_lanes[piece.lane];
        plan.lanes[lane].work.push_back({i, piece.offset, piece.length});
        loads[lane] += static_cast<double>(piece.length);
      }
      continue;
    }
    class_loads.clear();
    for (size_t lane : affinity.small_lanes) class_loads.push_back(loads[lane]);
    const size_t lane = affinity.small_lanes[LeastLoaded(
        class_loads, affinity.small_weights, round_robin++)];
    plan.lanes[lane].work.push_back({i, 0, length});
    loads[lane] += static_cast<double>(length);
  }
}

bool Requester::RunLane(InFlight& flight, const PeerPlan& plan, LaneUse& use,
                        bool may_block) {
  const std::shared_ptr<PostedBatch>& batch = flight.batch;
  const StopToken& stop = flight.stop;
  if (use.connection == nullptr && !may_block) {
    use.connection = ConnectedNow(*use.lane);
    if (use.connection == nullptr) return false;
  }
  if (use.connection == nullptr) {
    auto connection = ConnectLane(*use.lane, flight.ops, plan.ops, stop);
    if (!connection.ok()) {
      // A lane that cannot connect leaves its bytes to the others; a
      // refused proof, a stale epoch or the stop is the ops' own answer.
      const bool requeue =
          connection.status().code() == absl::StatusCode::kUnavailable &&
          !stop.stopped();
      if (requeue) {
        use.failed = connection.status();
        use.connect_failed = true;
      }
      for (size_t r = use.next_range; r < use.work.size(); ++r) {
        const PostedBatch::Range& range = use.work[r];
        if (requeue) {
          batch->Requeue(range, use.lane.get(), use.failed);
        } else {
          batch->Settle(range, connection.status());
        }
      }
      use.next_range = use.work.size();
      return true;
    }
    use.connection = *connection;
  }
  for (; use.next_range < use.work.size();
       ++use.next_range, use.next_offset = 0) {
    const PostedBatch::Range& range = use.work[use.next_range];
    const PostedBatch::Range rest = {range.op, range.offset + use.next_offset,
                                     range.length - use.next_offset};
    const uint64_t dealt =
        PostRange(flight.ops[rest.op], rest, use, batch, stop, may_block);
    if (dealt < rest.length) {
      use.next_offset += dealt;
      return false;
    }
  }
  return true;
}

uint64_t Requester::PostRange(const Op& op, const PostedBatch::Range& range,
                              LaneUse& use,
                              const std::shared_ptr<PostedBatch>& batch,
                              const StopToken& stop, bool may_block) {
  // Nothing is posted once the deadline has passed (say, after a handshake
  // that answered just then): it could not end in time.
  if (stop.stopped()) {
    batch->Settle(range, stop.StopStatus("before posting"));
    return range.length;
  }
  // An op that failed needs none of its other bytes.
  if (batch->HasError(range.op)) {
    batch->Settle(range, absl::OkStatus());
    return range.length;
  }
  if (!use.failed.ok()) {
    batch->Requeue(range, use.lane.get(), use.failed);
    return range.length;
  }
  Lane& lane = *use.lane;
  absl::StatusOr<GrantedBuffer> grant;
  if (may_block) {
    grant = GrantFor(op, lane, *use.connection, stop);
  } else if (std::optional<GrantedBuffer> cached =
                 CachedGrant(op, lane, *use.connection)) {
    grant = *cached;
  } else {
    return 0;  // asking the peer waits for its answer
  }
  if (!grant.ok()) {
    if (grant.status().code() == absl::StatusCode::kUnavailable &&
        !stop.stopped()) {
      use.failed = grant.status();
      batch->Requeue(range, &lane, use.failed);
    } else {
      batch->Settle(range, grant.status());
    }
    return range.length;
  }
  // The grant is the remote's word on the buffer's real size, which a
  // forged context may overstate: the contract's code rather than the NIC's
  // access error (the remote NIC refuses the WR either way).
  if (absl::Status bounds =
          CheckRange(op.remote_offset, op.length, grant->size_bytes, "remote");
      !bounds.ok()) {
    batch->Settle(range, bounds);
    return range.length;
  }
  const auto& local = dynamic_cast<const IbverbsRegistration&>(
      *op.local->backend_state(backend_));
  const uint32_t lkey = local.mr(lane.rail->device->index).lkey();
  uint64_t wr_bytes = lane.rail->params.max_message_bytes;
  if (lane.remote.max_message_bytes > 0) {
    wr_bytes = std::min(wr_bytes, lane.remote.max_message_bytes);
  }
  for (uint64_t done = 0; done < range.length;) {
    const PostedBatch::Range piece = {range.op, range.offset + done,
                                      std::min(wr_bytes, range.length - done)};
    ibv_sge sge = {};
    sge.addr = MrAddress(*op.local) + op.local_offset + piece.offset;
    sge.length = static_cast<uint32_t>(piece.length);
    sge.lkey = lkey;
    ibv_send_wr wr = {};
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = op.reads_into_local() ? IBV_WR_RDMA_READ : IBV_WR_RDMA_WRITE;
    wr.wr.rdma.remote_addr = grant->address + op.remote_offset + piece.offset;
    wr.wr.rdma.rkey = grant->rkey;
    const uint64_t cookie = batch->WrPosting(piece, lane);
    const absl::Status posted =
        may_block ? use.connection->Post(wr, batch, cookie, op.local, stop)
                  : use.connection->TryPost(wr, batch, cookie, op.local);
    if (posted.ok()) {
      use.posted = true;
      done += piece.length;
      continue;
    }
    batch->WrNotPosted(cookie);
    if (!may_block && posted.code() == absl::StatusCode::kResourceExhausted) {
      return done;  // the send queue is full: a posting thread waits
    }
    const PostedBatch::Range rest = {range.op, range.offset + done,
                                     range.length - done};
    if (posted.code() == absl::StatusCode::kUnavailable && !stop.stopped()) {
      // The queue pair failed under us: the rest goes elsewhere.
      use.failed = Prefixed(posted, absl::StrCat("on rail ", lane.name()));
      batch->Requeue(rest, &lane, use.failed);
    } else {
      batch->Settle(rest, posted);
    }
    return range.length;
  }
  return range.length;
}

void Requester::Repost(absl::Span<const Op> ops, std::vector<PeerPlan>& plans,
                       const std::vector<size_t>& plan_of_op,
                       const std::vector<size_t>& class_of_op,
                       std::vector<PostedBatch::Retry> retries,
                       const std::shared_ptr<PostedBatch>& batch,
                       const StopToken& stop) {
  for (PostedBatch::Retry& retry : retries) {
    PeerPlan& plan = plans[plan_of_op[retry.range.op]];
    // The lane it failed on is out for the rest of this Submit (its QP is
    // in ERR; the next Submit reconnects it), and cools down when its path
    // failed rather than its QP being flushed.
    for (LaneUse& use : plan.lanes) {
      if (use.lane.get() != retry.lane) continue;
      if (use.failed.ok()) use.failed = retry.why;
      if (retry.path_failed && !use.cooled) {
        use.cooled = true;
        CoolDown(*use.lane, retry.why);
      }
      use.lane->rail->counters.reposted_bytes += retry.range.length;
    }
    if (batch->HasError(retry.range.op)) {
      batch->Settle(retry.range, absl::OkStatus());
      continue;
    }
    LaneUse* target = PickLane(ops, plan, class_of_op[retry.range.op], stop);
    if (target == nullptr) {
      std::vector<std::string> others;
      for (const LaneUse& use : plan.lanes) {
        if (!use.failed.ok() && use.lane.get() != retry.lane) {
          others.push_back(std::string(use.failed.message()));
        }
      }
      batch->Settle(
          retry.range,
          absl::UnavailableError(absl::StrCat(
              retry.why.message(), "; no other RDMA rail to agent ",
              AgentOf(plan.peer), " is left",
              others.empty()
                  ? ""
                  : absl::StrCat(" (", absl::StrJoin(others, "; "), ")"))));
      continue;
    }
    PostRange(ops[retry.range.op], retry.range, *target, batch, stop,
              /*may_block=*/true);
  }
}

Requester::LaneUse* Requester::PickLane(absl::Span<const Op> ops,
                                        PeerPlan& plan, size_t affinity_class,
                                        const StopToken& stop) {
  const AffinityClass& affinity = plan.classes[affinity_class];
  // How many of the lane's two rails are far from the op's buffers.
  const auto far_ends = [&](const LaneUse& use) {
    const size_t remote = static_cast<size_t>(
        std::find_if(plan.remote_rails.begin(), plan.remote_rails.end(),
                     [&](const RemoteRail& rail) {
                       return rail.name() == use.lane->remote.name();
                     }) -
        plan.remote_rails.begin());
    return int{!affinity.local_near[use.lane->rail->index]} +
           int{!(remote < affinity.remote_near.size() &&
                 affinity.remote_near[remote])};
  };
  const auto near = [&](const LaneUse& use) { return far_ends(use) == 0; };
  while (!stop.stopped()) {
    // Once a handshake with the peer failed, only lanes already connected
    // are worth it: the others' handshakes would fail alike, each costing up
    // to --ibverbs_connect_timeout.
    const bool handshakes_fail =
        std::any_of(plan.lanes.begin(), plan.lanes.end(),
                    [](const LaneUse& use) { return use.connect_failed; });
    // The least loaded of the lanes still standing, near the op's buffers
    // when one of those is.
    LaneUse* best = nullptr;
    double best_cost = std::numeric_limits<double>::infinity();
    bool best_near = false;
    for (LaneUse& use : plan.lanes) {
      if (!use.failed.ok()) continue;
      if (handshakes_fail && use.connection == nullptr) continue;
      const bool is_near = near(use);
      const double cost = static_cast<double>(use.lane->load->bytes.load()) /
                          std::max(use.weight, 1e-9);
      if (best == nullptr || (is_near && !best_near) ||
          (is_near == best_near && cost < best_cost)) {
        best = &use;
        best_cost = cost;
        best_near = is_near;
      }
    }
    if (!best_near && !handshakes_fail) {
      // A pair near the op the plan left out beats a far lane of the plan,
      // and so does a pair as near whose rails carry nothing of the plan
      // yet: when the near rails went, their bytes spread over as many far
      // links as they had. With no lane standing, any pair will do.
      LaneUse* added = nullptr;
      if (best == nullptr) {
        added = AddLane(plan, affinity_class, 2);
      } else {
        added = AddLane(plan, affinity_class, 0);
        if (added == nullptr) {
          added = AddLane(plan, affinity_class, far_ends(*best),
                          /*fresh_rails=*/true);
        }
      }
      if (added != nullptr) best = added;
    }
    if (best == nullptr) return nullptr;
    if (best->connection != nullptr) return best;
    auto connection = ConnectLane(*best->lane, ops, plan.ops, stop);
    if (connection.ok()) {
      best->connection = *connection;
      return best;
    }
    best->failed = connection.status();
    best->connect_failed = true;
  }
  return nullptr;
}

Requester::LaneUse* Requester::AddLane(PeerPlan& plan, size_t affinity_class,
                                       int max_far_ends, bool fresh_rails) {
  // E.g. this agent's rail whose partner failed, with the partner of a rail
  // of this agent whose port went down. Pairs near the op's buffers on both
  // sides first, then near on one side, then far.
  const AffinityClass& affinity = plan.classes[affinity_class];
  const absl::Time now = absl::Now();
  const std::vector<Rail*> rails = UsableRails();
  // Rails of both sides the plan's standing lanes use.
  std::vector<const Rail*> busy_local;
  std::vector<std::string> busy_remote;
  for (const LaneUse& use : plan.lanes) {
    if (!use.failed.ok()) continue;
    busy_local.push_back(use.lane->rail);
    busy_remote.push_back(use.lane->remote.name());
  }
  const auto busy = [&](const Rail* rail, const RemoteRail& remote) {
    return std::find(busy_local.begin(), busy_local.end(), rail) !=
               busy_local.end() ||
           std::find(busy_remote.begin(), busy_remote.end(), remote.name()) !=
               busy_remote.end();
  };
  for (int far_ends = 0; far_ends <= max_far_ends; ++far_ends) {
    for (Rail* rail : rails) {
      for (size_t r = 0; r < plan.remote_rails.size(); ++r) {
        const int ends =
            !affinity.local_near[rail->index] +
            !(r < affinity.remote_near.size() && affinity.remote_near[r]);
        if (ends != far_ends) continue;
        const RemoteRail& remote = plan.remote_rails[r];
        if (fresh_rails && busy(rail, remote)) continue;
        const std::shared_ptr<Lane> lane = LaneFor(plan.peer, *rail, remote);
        const bool planned =
            std::any_of(plan.lanes.begin(), plan.lanes.end(),
                        [&](const LaneUse& use) { return use.lane == lane; });
        if (planned) continue;
        {
          absl::MutexLock lock(&lane->health->mu);
          if (lane->health->cooldown.cooling(now)) continue;
        }
        LaneUse use;
        use.lane = lane;
        use.weight = std::min(
            rail->speed_gbps > 0 ? rail->speed_gbps : 1.0,
            remote.speed_gbps > 0 ? remote.speed_gbps : rail->speed_gbps);
        plan.lanes.push_back(std::move(use));
        return &plan.lanes.back();
      }
    }
  }
  return nullptr;
}

void Requester::CoolDown(Lane& lane, const absl::Status& why) {
  Rail& rail = *lane.rail;
  const absl::Time now = absl::Now();
  auto port = rail.device->device->QueryPort(rail.local.port);
  if (!port.ok() || port->state != IBV_PORT_ACTIVE) {
    // Its own port is down: every lane of the rail would fail alike.
    const std::string state =
        port.ok() ? absl::StrCat("port ", verbs::PortStateName(port->state))
                  : std::string(port.status().message());
    absl::MutexLock lock(&rail.mu);
    rail.health.Fail(now, options_.rail_cooldown, options_.rail_max_cooldown,
                     state);
    rail.port_active = false;
    rail.port_checked = now;
    spdlog::warn(
        "ibverbs: rail {} failed ({}): left out for {}, its bytes go over "
        "the other rails",
        rail.name, state, absl::FormatDuration(rail.health.until() - now));
    return;
  }
  absl::MutexLock lock(&lane.health->mu);
  lane.health->cooldown.Fail(now, options_.rail_cooldown,
                             options_.rail_max_cooldown,
                             std::string(why.message()));
  spdlog::warn(
      "ibverbs: rail pair {} to agent {} failed ({}): left out for {}, its "
      "bytes go over the other rails",
      lane.name(), LogSafe(AgentOf(lane.peer)), LogSafe(why.ToString()),
      absl::FormatDuration(lane.health->cooldown.until() - now));
}

void Requester::ProbeLane(absl::Span<const Op> ops, const PeerPlan& plan,
                          const std::shared_ptr<Lane>& lane,
                          const StopToken& stop) {
  {
    absl::MutexLock lock(&lane->health->mu);
    if (lane->health->probing || !lane->health->cooldown.failed() ||
        lane->health->cooldown.cooling(absl::Now())) {
      return;
    }
    lane->health->probing = true;
  }
  const auto give_up = [&](const absl::Status& why) {
    absl::MutexLock lock(&lane->health->mu);
    lane->health->probing = false;
    lane->health->cooldown.Fail(absl::Now(), options_.rail_cooldown,
                                options_.rail_max_cooldown,
                                std::string(why.message()));
  };
  auto connection = ConnectLane(*lane, ops, plan.ops, stop);
  if (!connection.ok()) {
    give_up(connection.status());
    return;
  }
  GrantedBuffer grant;
  {
    absl::MutexLock lock(&mu_);
    if (lane->connection != *connection || lane->grants.empty()) {
      give_up(absl::UnavailableError("the queue pair was replaced"));
      return;
    }
    grant = lane->grants.begin()->second.buffer;
  }
  // Zero bytes: names no memory, yet crosses both ports and is answered
  // only by the peer's NIC. It touches nothing, so it may outlive the
  // Submit.
  ibv_send_wr wr = {};
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.num_sge = 0;
  wr.wr.rdma.remote_addr = grant.address;
  wr.wr.rdma.rkey = grant.rkey;
  auto sink = std::make_shared<ProbeSink>(lane->health, lane->name(),
                                          options_.rail_cooldown,
                                          options_.rail_max_cooldown);
  const absl::Status posted = (*connection)->Post(wr, sink, 0, nullptr, stop);
  if (!posted.ok()) give_up(posted);
}

void Requester::CutShort(const std::vector<PeerPlan>& plans, PostedBatch& batch,
                         const StopToken& stop) {
  // Out of time (or cancelled) with WRs on the wire: the QPs carrying them
  // go to ERR and are drained, so no WR of this batch touches memory after
  // we return.
  const std::vector<size_t> late = batch.NotDone();
  bool drained = true;
  for (const PeerPlan& plan : plans) {
    for (const LaneUse& use : plan.lanes) {
      if (use.connection == nullptr || use.connection->outstanding() == 0) {
        continue;
      }
      drained &= use.connection->MoveToErrorAndDrain(options_.drain_timeout);
    }
  }
  // A drained WR's completion reaches the batch just after its queue pair
  // counts it done.
  if (drained) {
    drained = batch.AwaitNoWrs(absl::Now() + options_.drain_timeout);
  }
  const std::string what =
      drained ? "with RDMA work requests in flight; the queue pair was "
                "moved to ERROR and drained"
              : "with RDMA work requests in flight; the queue pair was "
                "moved to ERROR but did not drain";
  const bool cancelled = stop.cancelled();
  const absl::Status stopped = stop.StopStatus(what);
  // A cancellation's reason says nothing of the QPs: add it.
  const absl::Status cut =
      cancelled ? absl::Status(stopped.code(),
                               absl::StrCat(stopped.message(), " ", what))
                : stopped;
  // Bytes waiting for another rail get none now.
  for (const PostedBatch::Retry& retry : batch.TakeRetries()) {
    batch.Settle(retry.range, cut);
  }
  if (!drained) {
    // Not seen with a working device. The WRs still pin their local
    // registrations, so memory stays mapped whatever the NIC does.
    spdlog::error(
        "ibverbs: a queue pair moved to ERROR did not flush within {}",
        absl::FormatDuration(options_.drain_timeout));
  }
  spdlog::warn(
      "ibverbs: {} with {} op(s) in flight; queue pair(s) moved to ERROR "
      "and drained",
      cancelled ? "batch cancelled" : "deadline passed", late.size());
  for (size_t i : late) batch.Override(i, cut);
}

std::shared_ptr<QueuePairConnection> Requester::ConnectedNow(const Lane& lane) {
  absl::MutexLock lock(&mu_);
  if (lane.connection == nullptr || lane.connection->broken()) return nullptr;
  return lane.connection;
}

absl::StatusOr<std::shared_ptr<QueuePairConnection>> Requester::ConnectLane(
    Lane& lane, absl::Span<const Op> ops, const std::vector<size_t>& indices,
    const StopToken& stop) {
  // Bounds the handshakes one batch can cost when its proofs are refused.
  constexpr size_t kMaxProofs = 4;
  std::vector<const Op*> tried;
  absl::StatusOr<std::shared_ptr<QueuePairConnection>> connection =
      absl::NotFoundError("no op to connect for");
  for (size_t i : indices) {
    const Op& op = ops[i];
    const bool seen =
        std::any_of(tried.begin(), tried.end(), [&](const Op* other) {
          return other->remote->buffer_id() == op.remote->buffer_id() &&
                 other->remote->token() == op.remote->token();
        });
    if (seen) continue;
    tried.push_back(&op);
    connection = GetConnection(lane, *op.remote, op.endpoint->ibverbs(), stop);
    // Only a refused proof is worth another op's proof.
    if (connection.ok() ||
        connection.status().code() != absl::StatusCode::kNotFound ||
        tried.size() >= kMaxProofs) {
      break;
    }
  }
  return connection;
}

absl::StatusOr<std::shared_ptr<QueuePairConnection>> Requester::GetConnection(
    Lane& lane, const v1::RemoteBuffer& remote,
    const v1::IbverbsEndpoint& endpoint, const StopToken& stop) {
  std::shared_ptr<QueuePairConnection> stale;  // drained outside mu_
  std::shared_ptr<absl::Mutex> connect_lock;
  {
    absl::MutexLock lock(&mu_);
    if (lane.connection != nullptr) {
      if (!lane.connection->broken()) return lane.connection;
      // The session's handle stays: the reconnect presents it.
      stale = std::move(lane.connection);
      lane.connection = nullptr;
      lane.grants.clear();
    }
    auto& slot = connect_locks_[lane.key];
    if (slot == nullptr) slot = std::make_shared<absl::Mutex>();
    connect_lock = slot;
  }
  stale.reset();
  absl::MutexLock connecting(connect_lock.get());
  std::string session;
  {
    absl::MutexLock lock(&mu_);
    if (lane.connection != nullptr && !lane.connection->broken()) {
      return lane.connection;
    }
    session = lane.session;
  }
  auto handshaken = Handshake(lane, remote, endpoint, session, stop);
  if (!handshaken.ok()) {
    spdlog::warn("ibverbs: connecting rail {} to agent {} at {}: {}",
                 lane.name(), LogSafe(remote.agent_id()),
                 LogSafe(endpoint.peer_address()),
                 LogSafe(handshaken.status().ToString()));
    return handshaken.status();
  }
  std::shared_ptr<QueuePairConnection> connection = handshaken->connection;
  spdlog::info(
      "ibverbs: connected QP {} to agent {} (epoch {:016x}) over rail {} at "
      "{}",
      connection->qp_num(), LogSafe(remote.agent_id()), remote.agent_epoch(),
      lane.name(), LogSafe(endpoint.peer_address()));
  // The agent answered with this epoch, so lanes to its earlier lives are
  // dead: drop them (their QPs destroyed outside mu_).
  std::vector<std::shared_ptr<QueuePairConnection>> dead;
  {
    absl::MutexLock lock(&mu_);
    const std::string agent_prefix = absl::StrCat(remote.agent_id(), "/");
    const std::string epoch_prefix =
        absl::StrCat(agent_prefix, remote.agent_epoch(), "/");
    for (auto it = lanes_.lower_bound(agent_prefix);
         it != lanes_.end() && absl::StartsWith(it->first, agent_prefix);) {
      if (absl::StartsWith(it->first, epoch_prefix)) {
        ++it;
        continue;
      }
      dead.push_back(std::move(it->second->connection));
      it->second->connection = nullptr;
      connect_locks_.erase(it->first);
      round_robin_.erase(it->second->peer);
      it = lanes_.erase(it);
    }
    lane.connection = connection;
    lane.session = handshaken->session;
    lane.session_refreshed = absl::Now();
    lane.session_idle_timeout = handshaken->session_idle_timeout;
    lane.grants.clear();
    lane.grants[handshaken->buffer_id] = handshaken->grant;
    ++connections_established_;
  }
  dead.clear();
  return connection;
}

absl::StatusOr<Requester::Handshaken> Requester::Handshake(
    const Lane& lane, const v1::RemoteBuffer& remote,
    const v1::IbverbsEndpoint& endpoint, const std::string& session,
    const StopToken& stop) {
  const Rail& rail = *lane.rail;
  // Inbound RDMA refused: whoever answers cannot reach this agent's memory
  // through this QP.
  auto created = QueuePairConnection::Create(
      rail.local, rail.params, options_.busy_poll, options_.drain_timeout,
      QueuePairConnection::Inbound::kRefuse);
  if (!created.ok()) {
    return Prefixed(created.status(),
                    absl::StrCat("creating a queue pair on rail ", rail.name));
  }
  Handshaken result;
  result.connection = std::move(*created);

  v1::ConnectQueuePairRequest request;
  request.set_agent_id(env_.identity.agent_id);
  request.set_agent_epoch(env_.identity.epoch);
  request.set_expected_epoch(remote.agent_epoch());
  request.set_remote_device(lane.remote.device);
  request.set_remote_port(lane.remote.port);
  *request.mutable_requester() = result.connection->local_endpoint();
  request.set_buffer_id(remote.buffer_id());
  request.set_token(remote.token());
  request.set_session(session);
  v1::ConnectQueuePairResponse response;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(
      std::min(stop.deadline(), absl::Now() + options_.connect_timeout)));
  // A cancelled Submit does not wait for a slow peer's answer.
  const auto on_cancel = stop.OnCancel([&context] { context.TryCancel(); });
  const grpc::Status status =
      StubFor(endpoint.peer_address())
          ->ConnectQueuePair(&context, request, &response);
  if (!status.ok() && stop.cancelled()) {
    return stop.StopStatus("while connecting a queue pair");
  }
  if (!status.ok()) {
    return Prefixed(
        FromGrpcStatus(status),
        absl::StrCat("queue-pair handshake with agent ", remote.agent_id(),
                     " at ", endpoint.peer_address(), " for rail ",
                     lane.name()));
  }
  if (response.session().empty() ||
      response.grant().buffer_id() != remote.buffer_id()) {
    return absl::UnavailableError(
        absl::StrCat("queue-pair handshake with agent ", remote.agent_id(),
                     " at ", endpoint.peer_address(), " for rail ", lane.name(),
                     ": the answer has no session or grant"));
  }
  absl::Status connected = result.connection->ConnectTo(response.responder());
  if (!connected.ok()) {
    return Prefixed(absl::StatusCode::kUnavailable, connected,
                    absl::StrCat("connecting the queue pair of rail ",
                                 lane.name(), " to ", endpoint.peer_address()));
  }
  result.session = response.session();
  result.session_idle_timeout =
      absl::Milliseconds(response.session_idle_timeout_ms());
  result.buffer_id = remote.buffer_id();
  result.grant.token = remote.token();
  result.grant.buffer.rkey = response.grant().rkey();
  result.grant.buffer.address = response.grant().address();
  result.grant.buffer.size_bytes = response.grant().size_bytes();
  return result;
}

namespace {

// Whether `lane`'s session should be named to its peer again (GrantBuffer)
// before its idle timeout: a third of it has passed.
bool SessionNeedsRefresh(const Lane& lane) {
  return lane.session_idle_timeout > absl::ZeroDuration() &&
         absl::Now() - lane.session_refreshed >= lane.session_idle_timeout / 3;
}

}  // namespace

std::optional<GrantedBuffer> Requester::CachedGrant(
    const Op& op, const Lane& lane, const QueuePairConnection& connection) {
  absl::MutexLock lock(&mu_);
  if (lane.connection.get() != &connection) return std::nullopt;
  auto grant = lane.grants.find(op.remote->buffer_id());
  if (grant == lane.grants.end() ||
      !TokensEqual(grant->second.token, op.remote->token()) ||
      SessionNeedsRefresh(lane)) {
    return std::nullopt;
  }
  return grant->second.buffer;
}

absl::StatusOr<GrantedBuffer> Requester::GrantFor(
    const Op& op, Lane& lane, const QueuePairConnection& connection,
    const StopToken& stop) {
  const v1::RemoteBuffer& remote = *op.remote;
  std::string session;
  // The grant was cached with this very token: a refusal of it now means
  // the peer dropped the session, not that the token is wrong.
  bool proven = false;
  {
    absl::MutexLock lock(&mu_);
    if (lane.connection.get() != &connection) {
      return absl::UnavailableError(
          absl::StrCat("the queue pair of rail ", lane.name(),
                       " was replaced while the op was being posted"));
    }
    auto grant = lane.grants.find(remote.buffer_id());
    // The peer drops sessions nobody names for its idle timeout: one in use
    // is named again (GrantBuffer answers the same grant) well before.
    const bool refresh = SessionNeedsRefresh(lane);
    // The token too: another local user's forged context naming the same
    // buffer id must not ride on a grant earned by a real one.
    proven = grant != lane.grants.end() &&
             TokensEqual(grant->second.token, remote.token());
    if (proven && !refresh) return grant->second.buffer;
    session = lane.session;
  }
  v1::GrantBufferRequest request;
  request.set_agent_id(env_.identity.agent_id);
  request.set_expected_epoch(remote.agent_epoch());
  request.set_session(session);
  request.set_buffer_id(remote.buffer_id());
  request.set_token(remote.token());
  v1::GrantBufferResponse response;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(
      std::min(stop.deadline(), absl::Now() + options_.connect_timeout)));
  // A cancelled Submit does not wait for a slow peer's answer.
  const auto on_cancel = stop.OnCancel([&context] { context.TryCancel(); });
  const std::string& address = op.endpoint->ibverbs().peer_address();
  const grpc::Status status =
      StubFor(address)->GrantBuffer(&context, request, &response);
  if (!status.ok() && stop.cancelled()) {
    return stop.StopStatus("while asking the peer for buffer access");
  }
  if (!status.ok() && proven &&
      status.error_code() == grpc::StatusCode::NOT_FOUND) {
    // The session expired (or its buffers went): the lane reconnects, as
    // after a broken QP, and its bytes go over another lane meanwhile.
    std::shared_ptr<QueuePairConnection> dropped;  // destroyed outside mu_
    {
      absl::MutexLock lock(&mu_);
      if (lane.connection.get() == &connection) {
        dropped = std::move(lane.connection);
        lane.connection = nullptr;
        lane.session.clear();
        lane.grants.clear();
      }
    }
    return absl::UnavailableError(
        absl::StrCat("agent ", remote.agent_id(), " at ", address,
                     " dropped the queue-pair session of rail ", lane.name(),
                     "; it reconnects"));
  }
  if (!status.ok()) {
    return Prefixed(
        FromGrpcStatus(status),
        absl::StrCat("access to a buffer of agent ", remote.agent_id(), " at ",
                     address, " over rail ", lane.name()));
  }
  RemoteGrant grant;
  grant.token = remote.token();
  grant.buffer.rkey = response.grant().rkey();
  grant.buffer.address = response.grant().address();
  grant.buffer.size_bytes = response.grant().size_bytes();
  absl::MutexLock lock(&mu_);
  if (lane.connection.get() == &connection) {
    lane.grants[remote.buffer_id()] = grant;
    lane.session_refreshed = absl::Now();
  }
  return grant.buffer;
}

}  // namespace rdma_agent::ibverbs

#include "backends/tcp/data_client.h"

#include <pthread.h>
#include <sys/socket.h>

#include <algorithm>
#include <optional>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "backends/tcp/pipeline.h"
#include "backends/tcp/wire.h"
#include "common/log_text.h"
#include "common/status_util.h"
#include "spdlog/spdlog.h"

namespace rdma_agent::tcp {

// One run (a Post or Run): what its jobs share with it and with its
// cancellation. Owns itself from StartRun until FinishRun frees it.
struct DataClient::SubmitRun {
  SubmitRun(absl::Span<const Op> ops, std::vector<PeerBatch> batches,
            std::vector<absl::Status> results, const StopToken& stop,
            OpsDone done)
      : ops(ops),
        batches(std::move(batches)),
        stop(stop),
        results(std::move(results)),
        done(std::move(done)) {}

  const absl::Span<const Op> ops;
  // The PeerRuns read their op lists from here.
  const std::vector<PeerBatch> batches;
  // A copy: the caller's token may go before the run ends (the
  // Cancellation behind it may not).
  const StopToken stop;
  std::vector<std::unique_ptr<PeerRun>> peers;
  std::vector<absl::Status> results;
  OpsDone done;
  // Set by StartRun before the run can end; FinishRun drops it first.
  std::unique_ptr<Cancellation::Callback> on_cancel;

  // Lane jobs queued or running, plus one while StartRun's caller holds the
  // run; it ends when this reaches 0.
  size_t unfinished_jobs ABSL_GUARDED_BY(DataClient::mu_) = 0;
  // Cancelled or past the deadline: queued jobs were dropped and the sockets
  // in `active` shut down; nothing new starts.
  bool aborted ABSL_GUARDED_BY(DataClient::mu_) = false;
  // A loop's lane not answered in full by then has stalled (it holds no
  // thread to notice, so the timekeeper does): the run is aborted and
  // `stalled` set.
  absl::Time stall_at ABSL_GUARDED_BY(DataClient::mu_) = absl::InfiniteFuture();
  bool stalled ABSL_GUARDED_BY(DataClient::mu_) = false;
  // Sockets its lanes use right now (dialling or carrying requests).
  std::vector<int> active ABSL_GUARDED_BY(DataClient::mu_);
  // Lanes not started yet: one entry per connection wanted to a peer.
  std::deque<LaneJob> queued ABSL_GUARDED_BY(DataClient::mu_);
  // DataClient::live_, while the run has not ended.
  SubmitRun* previous ABSL_GUARDED_BY(DataClient::mu_) = nullptr;
  SubmitRun* next ABSL_GUARDED_BY(DataClient::mu_) = nullptr;
};

struct DataClient::Connection {
  UniqueFd fd;
  bool reused = false;
  // The send [0] and receive [1] timeouts in force on `fd` (see
  // IdleConnection); a new socket has none.
  absl::Duration armed[2] = {absl::InfiniteDuration(),
                             absl::InfiniteDuration()};
};

// The ops of one Run to one peer, cut into chunks as lanes ask for them,
// and their outcome. Thread-safe: the peer's lanes share it.
class DataClient::PeerRun final : public ChunkSource {
 public:
  PeerRun(const PeerBatch& batch, absl::Span<const Op> ops,
          uint64_t chunk_bytes, const StopToken& stop)
      : peer_(batch.peer),
        name_(JoinHostPort(batch.peer.host, batch.peer.port)),
        indices_(batch.ops),
        ops_(ops),
        chunk_bytes_(chunk_bytes),
        stop_(stop),
        answered_(batch.ops.size(), 0),
        failed_(batch.ops.size()) {}

  const HostPort& peer() const { return peer_; }
  const std::string& name() const { return name_; }
  const StopToken& stop() const { return stop_; }

  // Connections worth opening: one per chunk, at most `limit`.
  size_t LanesWanted(size_t limit) const {
    uint64_t chunks = 0;
    for (size_t i : indices_) {
      const uint64_t length = ops_[i].length;
      chunks += length / chunk_bytes_ + (length % chunk_bytes_ != 0 ? 1 : 0);
      if (chunks >= limit) return limit;
    }
    return static_cast<size_t>(chunks);
  }

  // The next chunk to send, or false when every op is handed out (ops that
  // already failed are skipped: their remaining bytes are not sent).
  bool NextChunk(Chunk* chunk) override {
    absl::MutexLock lock(&mu_);
    while (next_op_ < indices_.size() && !failed_[next_op_].ok()) {
      ++next_op_;
      next_offset_ = 0;
    }
    if (next_op_ >= indices_.size()) return false;
    const Op& op = ops_[indices_[next_op_]];
    chunk->op = next_op_;
    chunk->kind =
        op.reads_into_local() ? RequestKind::kRead : RequestKind::kWrite;
    chunk->local = op.local->data() + op.local_offset + next_offset_;
    chunk->remote_offset = op.remote_offset + next_offset_;
    chunk->length = std::min(chunk_bytes_, op.length - next_offset_);
    chunk->remote = op.remote.get();
    next_offset_ += chunk->length;
    if (next_offset_ == op.length) {
      ++next_op_;
      next_offset_ = 0;
    }
    return true;
  }

  bool HasWork() {
    absl::MutexLock lock(&mu_);
    return next_op_ < indices_.size() && unreachable_.ok();
  }

  void ChunkDone(const Chunk& chunk, const absl::Status& status) override {
    absl::MutexLock lock(&mu_);
    if (status.ok()) {
      answered_[chunk.op] += chunk.length;
      std::atomic<uint64_t>* landed = ops_[indices_[chunk.op]].landed;
      if (landed != nullptr) {
        landed->fetch_add(chunk.length, std::memory_order_relaxed);
      }
    } else if (failed_[chunk.op].ok()) {
      failed_[chunk.op] = status;
    }
  }

  // A lane ended without finishing: chunks nobody took get `status`. An
  // unreachable peer spares its other lanes the dial.
  void LaneGaveUp(const absl::Status& status, bool unreachable) {
    absl::MutexLock lock(&mu_);
    gave_up_ = status;
    if (unreachable) unreachable_ = status;
  }
  absl::Status unreachable() {
    absl::MutexLock lock(&mu_);
    return unreachable_;
  }

  // The addresses to dial, resolved once for all lanes.
  absl::StatusOr<std::vector<PeerAddress>> Addresses(absl::Time until) {
    // Not mu_: lanes on pooled connections keep taking chunks meanwhile.
    absl::MutexLock lock(&resolve_mu_);
    if (!addresses_.has_value()) {
      auto resolved =
          ResolvePeer(peer_, until, [this] { return stop_.cancelled(); });
      // A wait cut short is not an answer: the next lane tries again.
      if (!resolved.ok() && !absl::IsUnavailable(resolved.status())) {
        return resolved.status();
      }
      addresses_ = std::move(resolved);
    }
    return *addresses_;
  }

  // Writes each op's outcome into `results` (indexed like the run's ops).
  // `client_stopped`: the client ended the run (shutting down), not `stop`.
  void Finish(std::vector<absl::Status>& results, bool client_stopped) {
    absl::MutexLock lock(&mu_);
    for (size_t k = 0; k < indices_.size(); ++k) {
      const Op& op = ops_[indices_[k]];
      absl::Status& result = results[indices_[k]];
      if (!failed_[k].ok()) {
        result = failed_[k];
      } else if (answered_[k] == op.length) {
        result = absl::OkStatus();
      } else if (!gave_up_.ok()) {
        result = gave_up_;
      } else if (stop_.stopped()) {
        // Its lanes were dropped from the queue before they ran.
        result =
            stop_.StopStatus(absl::StrCat("before ", name_, " was contacted"));
      } else if (client_stopped) {
        result = absl::UnavailableError(absl::StrCat(
            "the tcp client shut down before ", name_, " was contacted"));
      } else {
        result = absl::InternalError(
            absl::StrCat("no connection to ", name_, " ran the op"));
      }
    }
  }

 private:
  const HostPort peer_;
  const std::string name_;
  const std::vector<size_t>& indices_;
  const absl::Span<const Op> ops_;
  const uint64_t chunk_bytes_;
  const StopToken& stop_;

  absl::Mutex mu_;
  // The chunk cursor: op (position in indices_) and offset within it.
  size_t next_op_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_offset_ ABSL_GUARDED_BY(mu_) = 0;
  // Per op: bytes answered OK, and the first failure.
  std::vector<uint64_t> answered_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Status> failed_ ABSL_GUARDED_BY(mu_);
  absl::Status gave_up_ ABSL_GUARDED_BY(mu_);
  absl::Status unreachable_ ABSL_GUARDED_BY(mu_);
  absl::Mutex resolve_mu_;
  std::optional<absl::StatusOr<std::vector<PeerAddress>>> addresses_
      ABSL_GUARDED_BY(resolve_mu_);
};

// A small batch's lane on a loop: its pipeline on a pooled connection.
// Touched by one thread at a time: the posting thread until the socket is
// armed, then the loop (one-shot events), or the worker it is handed to.
struct DataClient::LoopLane final : public ClientLoop::Watcher {
  LoopLane(DataClient& client, ClientLoop& loop, SubmitRun& submit,
           PeerRun& peer, Connection connection)
      : client(client),
        loop(loop),
        submit(submit),
        peer(peer),
        connection(std::move(connection)),
        pipeline(peer, client.options_.max_in_flight,
                 client.options_.in_flight_bytes, client.next_request_id_,
                 peer.name(), /*zero_copy_send=*/false,
                 client.options_.no_progress_timeout) {}

  void OnReady() override { client.PumpLoopLane(this, /*armed=*/true); }

  DataClient& client;
  ClientLoop& loop;
  SubmitRun& submit;
  PeerRun& peer;
  Connection connection;
  Pipeline pipeline;
};

namespace {

// The longest the timekeeper sleeps: 10 wake-ups a second, however idle.
constexpr absl::Duration kTimekeeperTick = absl::Milliseconds(100);

// The one message for a peer that could not be reached, whatever the
// reason: refused, timed out, reset, not an agent. Callers must not learn
// more about other services than "not an agent they can use".
absl::Status Unreachable(absl::string_view peer) {
  return absl::UnavailableError(absl::StrCat("peer ", peer, " is unreachable"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataClient>> DataClient::Create(
    DataClientOptions options) {
  if (options.connections_per_peer < 1 || options.max_in_flight < 1 ||
      options.chunk_bytes < 1 || options.chunk_bytes > kMaxPayloadBytes ||
      options.socket_buffer_bytes < 0 || options.threads < 1 ||
      options.loops < 0 || options.max_connections < 1 ||
      options.max_idle_connections < 0 || options.max_idle_per_peer < 0 ||
      options.idle_timeout <= absl::ZeroDuration() ||
      options.connect_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tcp client options out of range: connections per peer, max in "
        "flight, threads and max connections must be >= 1, loops >= 0, "
        "chunk bytes in [1, ",
        kMaxPayloadBytes,
        "], socket buffer bytes and idle connection limits >= 0, idle and "
        "connect timeouts > 0"));
  }
  std::unique_ptr<DataClient> client(new DataClient(std::move(options)));
  const int threads = client->options_.threads;
  for (int i = 0; i < threads; ++i) {
    try {
      client->workers_.emplace_back([raw = client.get()] {
        pthread_setname_np(pthread_self(), "tcp-client");
        raw->WorkerLoop();
      });
    } catch (const std::system_error& error) {
      // The destructor stops and joins the workers already started.
      return absl::ResourceExhaustedError(
          absl::StrCat("tcp client: cannot start worker thread ", i + 1, " of ",
                       threads, ": ", error.what()));
    }
  }
  for (int i = 0; i < client->options_.loops; ++i) {
    auto loop = ClientLoop::Start("tcp-client-loop");
    if (!loop.ok()) return loop.status();
    client->loops_.push_back(std::move(*loop));
  }
  try {
    client->timekeeper_ = std::thread([raw = client.get()] {
      pthread_setname_np(pthread_self(), "tcp-timekeeper");
      raw->TimekeeperLoop();
    });
  } catch (const std::system_error& error) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "tcp client: cannot start the timekeeper thread: ", error.what()));
  }
  return client;
}

DataClient::DataClient(DataClientOptions options)
    : options_(std::move(options)) {}

DataClient::~DataClient() {
  {
    absl::MutexLock lock(&mu_);
    // Runs still in flight end now; their lanes see their sockets shut
    // down, and the timekeeper finishes the ones whose last lane was queued.
    for (SubmitRun* run = live_; run != nullptr;) {
      SubmitRun* next = run->next;
      if (AbortLocked(*run)) runs_to_finish_.push_back(run);
      run = next;
    }
    timekeeper_cv_.Signal();
    const auto drained = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return live_ == nullptr && runs_to_finish_.empty();
    };
    mu_.Await(absl::Condition(&drained));
    stopping_ = true;
    work_cv_.SignalAll();
    timekeeper_cv_.Signal();
  }
  for (std::thread& worker : workers_) worker.join();
  if (timekeeper_.joinable()) timekeeper_.join();
  loops_.clear();  // no socket is armed: every run has ended
  absl::MutexLock lock(&mu_);
  for (auto& [key, idle] : idle_) CloseIdleLocked(key, idle);
  idle_.clear();
}

void DataClient::Post(absl::Span<const Op> ops, std::vector<PeerBatch> batches,
                      std::vector<absl::Status> results, const StopToken& stop,
                      OpsDone done) {
  const bool small = FitsALoop(ops, batches);
  PeerRun* own_lane = nullptr;
  SubmitRun* run = StartRun(ops, std::move(batches), std::move(results), stop,
                            std::move(done), small ? &own_lane : nullptr,
                            /*one_lane=*/small);
  if (own_lane != nullptr) {
    // The loop's lane takes the hold over: its done comes from the loop
    // even when the answer arrives before this thread gets here.
    if (StartLoopLane(*run, *own_lane)) return;
    QueueLane(LaneJob{run, own_lane});
  }
  EndJob(run);  // the hold: ends the run here when nothing could start
}

bool DataClient::FitsALoop(absl::Span<const Op> ops,
                           const std::vector<PeerBatch>& batches) const {
  if (loops_.empty() || batches.size() != 1) return false;
  uint64_t bytes = 0;
  for (size_t i : batches[0].ops) {
    bytes += ops[i].length;
    if (bytes > kLoopBatchBytes) return false;
  }
  return true;
}

bool DataClient::StartLoopLane(SubmitRun& submit, PeerRun& peer) {
  std::optional<absl::StatusOr<Connection>> idle = TakeIdle(submit, peer);
  // None idle: a worker dials. Aborted: QueueLane drops the lane.
  if (!idle.has_value() || !idle->ok()) return false;
  ClientLoop& loop =
      *loops_[next_loop_.fetch_add(1, std::memory_order_relaxed) %
              loops_.size()];
  auto* lane = new LoopLane(*this, loop, submit, peer, std::move(**idle));
  lane->pipeline.LendBuffer(TakeSpareBuffer());
  lane->pipeline.Restart(lane->connection.fd.get(), lane->connection.armed);
  {
    absl::MutexLock lock(&mu_);
    // Nothing but the timekeeper ends the lane at its deadline, or when it
    // stalls.
    if (options_.no_progress_timeout > absl::ZeroDuration()) {
      submit.stall_at = absl::Now() + options_.no_progress_timeout;
    }
    if (std::min(submit.stop.deadline(), submit.stall_at) <
        timekeeper_wakes_at_) {
      timekeeper_cv_.Signal();
    }
  }
  // The caller's hold is the lane's job from here.
  PumpLoopLane(lane, /*armed=*/false);
  return true;
}

void DataClient::PumpLoopLane(LoopLane* lane, bool armed) {
  PipelineOutcome outcome;
  const Pipeline::Wait wait = lane->pipeline.Pump(outcome);
  if (wait == Pipeline::Wait::kNone) {
    EndLoopLane(lane, armed, outcome);
    return;
  }
  const int fd = lane->connection.fd.get();
  const bool write = wait == Pipeline::Wait::kReadableOrWritable;
  // From here the loop owns the lane: it may already run on it.
  absl::Status status = armed ? lane->loop.Rearm(fd, write, lane)
                              : lane->loop.Watch(fd, write, lane);
  if (status.ok()) return;
  outcome.healthy = false;
  outcome.status = std::move(status);
  EndLoopLane(lane, armed, outcome);
}

void DataClient::EndLoopLane(LoopLane* lane, bool armed,
                             const PipelineOutcome& outcome) {
  std::unique_ptr<LoopLane> owned(lane);
  SubmitRun& submit = lane->submit;
  PeerRun& peer = lane->peer;
  // Out of the set before the connection is pooled (another lane may arm
  // it at once) or closed.
  if (armed) lane->loop.Forget(lane->connection.fd.get());
  Release(submit, peer, std::move(lane->connection), outcome.healthy);
  if (!outcome.healthy) {
    bool stalled;
    {
      absl::MutexLock lock(&mu_);
      stalled = submit.stalled;
      if (!submit.aborted && outcome.answered == 0 && !submit.stop.stopped()) {
        // The pooled connection was most likely stale (peer restarted): a
        // worker re-sends the window on a fresh one, as RunLane does. The
        // lane's job goes with it.
        submit.stall_at = absl::InfiniteFuture();  // the worker watches it
        submit.queued.push_back(LaneJob{&submit, &peer, owned.release()});
        if (submit.queued.size() == 1) runs_.push_back(&submit);
        work_cv_.Signal();
        return;
      }
    }
    const absl::Status status =
        stalled && !submit.stop.stopped()
            ? absl::UnavailableError(lane->pipeline.NoProgressMessage())
            : LaneFailure(submit.stop, peer, outcome);
    lane->pipeline.FailWindow(status);
    peer.LaneGaveUp(status, /*unreachable=*/false);
  }
  ReturnSpareBuffer(lane->pipeline.TakeBuffer());
  owned.reset();
  EndJob(&submit);
}

void DataClient::QueueLane(const LaneJob& job) {
  SubmitRun& submit = *job.submit;
  absl::MutexLock lock(&mu_);
  if (submit.aborted) return;  // its ops get the run's stop status
  submit.queued.push_back(job);
  ++submit.unfinished_jobs;
  if (submit.queued.size() == 1) runs_.push_back(&submit);
  work_cv_.Signal();
  if (submit.stop.deadline() < timekeeper_wakes_at_) timekeeper_cv_.Signal();
}

std::vector<absl::Status> DataClient::Run(absl::Span<const Op> ops,
                                          std::vector<PeerBatch> batches,
                                          std::vector<absl::Status> results,
                                          const StopToken& stop) {
  std::vector<absl::Status> outcome;
  absl::Notification ended;
  PeerRun* own_lane = nullptr;
  SubmitRun* run = StartRun(
      ops, std::move(batches), std::move(results), stop,
      [&outcome, &ended](std::vector<absl::Status> statuses) {
        outcome = std::move(statuses);
        ended.Notify();
      },
      &own_lane);
  // Under the hold: the run cannot end (nor be freed) while this thread
  // carries its lane.
  if (own_lane != nullptr) RunLane(LaneJob{run, own_lane});
  EndJob(run);
  ended.WaitForNotification();
  return outcome;
}

DataClient::SubmitRun* DataClient::StartRun(absl::Span<const Op> ops,
                                            std::vector<PeerBatch> batches,
                                            std::vector<absl::Status> results,
                                            const StopToken& stop, OpsDone done,
                                            PeerRun** own_lane, bool one_lane) {
  const uint64_t chunk_bytes =
      std::clamp<uint64_t>(options_.chunk_bytes, 1, kMaxPayloadBytes);
  auto* run = new SubmitRun(ops, std::move(batches), std::move(results), stop,
                            std::move(done));
  run->peers.reserve(run->batches.size());
  for (const PeerBatch& batch : run->batches) {
    run->peers.push_back(
        std::make_unique<PeerRun>(batch, ops, chunk_bytes, run->stop));
  }
  {
    absl::MutexLock lock(&mu_);
    run->unfinished_jobs = 1;  // the caller's hold
    run->next = live_;
    if (live_ != nullptr) live_->previous = run;
    live_ = run;
  }
  // Before any lane is queued: when `stop` is cancelled already the
  // callback runs right here and the run queues nothing. Cancellation
  // shuts the run's sockets down at once (the callback takes mu_ only
  // briefly, and never ends the run itself: see OnCancelled).
  run->on_cancel = run->stop.OnCancel([this, run] { OnCancelled(*run); });

  absl::MutexLock lock(&mu_);
  if (run->aborted) return run;
  for (const auto& peer : run->peers) {
    const size_t lanes = peer->LanesWanted(
        one_lane ? 1 : static_cast<size_t>(options_.connections_per_peer));
    for (size_t l = 0; l < lanes; ++l) {
      run->queued.push_back(LaneJob{run, peer.get()});
    }
  }
  if (own_lane != nullptr) {
    // The first lane is the calling thread's own (Run): a run of one lane,
    // every small op, never waits for a worker to wake and hand its result
    // back. It is covered by the hold.
    *own_lane = nullptr;
    if (!run->queued.empty()) {
      *own_lane = run->queued.front().peer;
      run->queued.pop_front();
    }
  }
  if (run->queued.empty()) return run;
  run->unfinished_jobs += run->queued.size();
  runs_.push_back(run);
  for (size_t i = 0; i < run->queued.size(); ++i) work_cv_.Signal();
  // Queued lanes may wait for busy workers past the deadline.
  if (run->stop.deadline() < timekeeper_wakes_at_) timekeeper_cv_.Signal();
  return run;
}

void DataClient::EndJob(SubmitRun* submit) {
  bool last;
  {
    absl::MutexLock lock(&mu_);
    last = EndJobLocked(*submit);
  }
  if (last) FinishRun(submit);
}

bool DataClient::EndJobLocked(SubmitRun& submit) {
  if (--submit.unfinished_jobs > 0) return false;
  // Ended: off the live list, so that neither the timekeeper nor the
  // destructor looks at it again.
  if (submit.previous != nullptr) {
    submit.previous->next = submit.next;
  } else {
    live_ = submit.next;
  }
  if (submit.next != nullptr) submit.next->previous = submit.previous;
  submit.previous = submit.next = nullptr;
  return true;
}

void DataClient::FinishRun(SubmitRun* submit) {
  std::unique_ptr<SubmitRun> run(submit);
  // Waits for the callback should it be running on another thread right
  // now; from here on it never runs. (Never called from the callback
  // itself: it would wait for itself.)
  run->on_cancel.reset();
  // After this no lane of this run touches any op's memory: all have ended.
  const bool client_stopped = !run->stop.stopped();
  for (const auto& peer : run->peers)
    peer->Finish(run->results, client_stopped);
  std::vector<absl::Status> results = std::move(run->results);
  OpsDone done = std::move(run->done);
  run.reset();
  std::move(done)(std::move(results));
}

void DataClient::OnCancelled(SubmitRun& submit) {
  absl::MutexLock lock(&mu_);
  // The callback cannot finish the run: FinishRun unregisters it, which
  // would wait for itself. Whoever still holds a job ends the run; when the
  // abort dropped the last one, the timekeeper does.
  if (AbortLocked(submit)) {
    runs_to_finish_.push_back(&submit);
    timekeeper_cv_.Signal();
  }
}

bool DataClient::AbortLocked(SubmitRun& submit) {
  // An ended run (being finished) has nothing left to abort.
  if (submit.aborted || submit.unfinished_jobs == 0) return false;
  submit.aborted = true;
  // Wakes every blocked send, receive, poll and connect of its lanes.
  for (int fd : submit.active) shutdown(fd, SHUT_RDWR);
  if (submit.queued.empty()) return false;
  auto it = std::find(runs_.begin(), runs_.end(), &submit);
  if (it != runs_.end()) runs_.erase(it);
  // The queued lanes are the last jobs unless a lane runs or the hold is
  // kept; each dropped lane counts as ended.
  const size_t dropped = submit.queued.size();
  for (const LaneJob& job : submit.queued) {
    if (job.resume == nullptr) continue;
    // A loop lane waiting for its fresh connection: its chunks were sent
    // on a connection that broke, and are not sent again.
    job.peer->LaneGaveUp(submit.stop.stopped()
                             ? submit.stop.StopStatus(absl::StrCat(
                                   "before ", job.peer->name(), " answered"))
                             : absl::UnavailableError(absl::StrCat(
                                   "the tcp client shut down before ",
                                   job.peer->name(), " answered")),
                         /*unreachable=*/false);
    delete job.resume;
  }
  submit.queued.clear();
  submit.unfinished_jobs -= dropped - 1;
  return EndJobLocked(submit);
}

void DataClient::TimekeeperLoop() {
  absl::MutexLock lock(&mu_);
  while (true) {
    timekeeper_wakes_at_ = absl::InfinitePast();
    if (!runs_to_finish_.empty()) {
      SubmitRun* run = runs_to_finish_.back();
      runs_to_finish_.pop_back();
      mu_.Unlock();
      FinishRun(run);
      mu_.Lock();
      continue;
    }
    if (stopping_) return;
    // Runs past their deadline end now: their queued lanes may wait for
    // workers busy elsewhere, and their running lanes are cut off (a
    // worker's also watches the deadline itself; a loop's does not, nor
    // whether it stalled). O(runs in flight) per wake-up; it wakes at
    // deadlines and at most every tick, rarely compared to a scan.
    const absl::Time now = absl::Now();
    absl::Time next = absl::InfiniteFuture();
    for (SubmitRun* run = live_; run != nullptr;) {
      SubmitRun* following = run->next;  // AbortLocked may unlink `run`
      if (!run->aborted) {
        if (run->stop.deadline() <= now) {
          if (AbortLocked(*run)) runs_to_finish_.push_back(run);
        } else if (run->stall_at <= now) {
          run->stalled = true;
          if (AbortLocked(*run)) runs_to_finish_.push_back(run);
        } else {
          next = std::min({next, run->stop.deadline(), run->stall_at});
        }
      }
      run = following;
    }
    if (!runs_to_finish_.empty()) continue;
    // Never asleep for longer than a tick: a run whose deadline is further
    // away than that need not wake it (a loop's small batch would otherwise
    // pay a thread wake-up to post).
    next = std::min(next, now + kTimekeeperTick);
    timekeeper_wakes_at_ = next;
    timekeeper_cv_.WaitWithDeadline(&mu_, next);
  }
}

std::optional<DataClient::LaneJob> DataClient::NextJobLocked() {
  if (runs_.empty()) return std::nullopt;
  // Round robin over the Runs with queued lanes: a Submit naming hundreds
  // of peers does not make the next Submit wait for all of them.
  SubmitRun* submit = runs_.front();
  runs_.pop_front();
  LaneJob job = submit->queued.front();
  submit->queued.pop_front();
  if (!submit->queued.empty()) runs_.push_back(submit);
  return job;
}

void DataClient::WorkerLoop() {
  absl::MutexLock lock(&mu_);
  // Wake now and then even without work, so idle connections expire.
  const absl::Duration tick = std::clamp(
      options_.idle_timeout / 4, absl::Milliseconds(10), absl::Seconds(5));
  while (true) {
    if (runs_.empty() && !stopping_) work_cv_.WaitWithTimeout(&mu_, tick);
    ExpireIdleLocked();
    if (stopping_) return;
    const std::optional<LaneJob> job = NextJobLocked();
    if (!job.has_value()) continue;
    mu_.Unlock();
    RunLane(*job);
    mu_.Lock();
    if (EndJobLocked(*job->submit)) {
      mu_.Unlock();
      FinishRun(job->submit);
      mu_.Lock();
    }
  }
}

void DataClient::RunLane(const LaneJob& job) {
  SubmitRun& submit = *job.submit;
  PeerRun& peer = *job.peer;
  if (job.resume != nullptr) {
    std::unique_ptr<LoopLane> lane(job.resume);
    CarryLane(submit, peer, lane->pipeline, /*attempt=*/1);
    ReturnSpareBuffer(lane->pipeline.TakeBuffer());
    return;
  }
  if (!peer.HasWork()) {
    // Nothing left for this lane, or another lane found the peer
    // unreachable: no dial.
    if (absl::Status why = peer.unreachable(); !why.ok()) {
      peer.LaneGaveUp(why, /*unreachable=*/true);
    }
    return;
  }
  Pipeline pipeline(peer, options_.max_in_flight, options_.in_flight_bytes,
                    next_request_id_, peer.name(), options_.zero_copy_send,
                    options_.no_progress_timeout);
  pipeline.LendBuffer(TakeSpareBuffer());
  // Whichever way the lane ends, its buffer goes back for the next one.
  struct GiveBack {
    DataClient* client;
    Pipeline* pipeline;
    ~GiveBack() { client->ReturnSpareBuffer(pipeline->TakeBuffer()); }
  } give_back{this, &pipeline};
  CarryLane(submit, peer, pipeline, /*attempt=*/0);
}

void DataClient::CarryLane(SubmitRun& submit, PeerRun& peer, Pipeline& pipeline,
                           int attempt) {
  const StopToken& stop = submit.stop;
  // A reused connection that breaks before answering anything was most
  // likely stale (peer restarted): one retry on a freshly dialled one.
  // Re-sending is safe: nothing reached local memory, and writing the same
  // bytes again to the remote range is idempotent.
  for (; attempt < 2; ++attempt) {
    if (stop.stopped()) {
      const absl::Status status =
          stop.StopStatus(absl::StrCat("before sending to ", peer.name()));
      pipeline.FailWindow(status);
      peer.LaneGaveUp(status, /*unreachable=*/false);
      return;
    }
    auto connection = Checkout(submit, peer, /*fresh=*/attempt > 0);
    if (!connection.ok()) {
      pipeline.FailWindow(connection.status());
      peer.LaneGaveUp(connection.status(),
                      absl::IsUnavailable(connection.status()));
      return;
    }
    pipeline.Restart(connection->fd.get(), connection->armed);
    const PipelineOutcome outcome = pipeline.Run(stop.deadline());
    if (outcome.healthy) {
      Release(submit, peer, std::move(*connection), /*reusable=*/true);
      return;
    }
    const bool reused = connection->reused;
    Release(submit, peer, std::move(*connection), /*reusable=*/false);
    if (reused && outcome.answered == 0 && !stop.stopped()) continue;
    const absl::Status status = LaneFailure(stop, peer, outcome);
    pipeline.FailWindow(status);
    peer.LaneGaveUp(status, /*unreachable=*/false);
    return;
  }
}

absl::Status DataClient::LaneFailure(const StopToken& stop, const PeerRun& peer,
                                     const PipelineOutcome& outcome) {
  // Shut down by the Run (cancelled, or at its deadline): say why, not
  // "closed by the peer".
  const bool cut_by_run =
      stop.cancelled() ||
      (stop.stopped() && !absl::IsDeadlineExceeded(outcome.status));
  return cut_by_run ? stop.StopStatus(absl::StrCat("before ", peer.name(),
                                                   " answered every request"))
                    : outcome.status;
}

std::unique_ptr<std::byte[]> DataClient::TakeSpareBuffer() {
  absl::MutexLock lock(&mu_);
  if (spare_buffers_.empty()) return nullptr;  // the lane allocates one
  std::unique_ptr<std::byte[]> buffer = std::move(spare_buffers_.back());
  spare_buffers_.pop_back();
  return buffer;
}

void DataClient::ReturnSpareBuffer(std::unique_ptr<std::byte[]> buffer) {
  if (buffer == nullptr) return;
  absl::MutexLock lock(&mu_);
  if (spare_buffers_.size() < kMaxSpareBuffers) {
    spare_buffers_.push_back(std::move(buffer));
  }
}

absl::StatusOr<DataClient::Connection> DataClient::Checkout(SubmitRun& submit,
                                                            PeerRun& peer,
                                                            bool fresh) {
  if (!fresh) {
    std::optional<absl::StatusOr<Connection>> idle = TakeIdle(submit, peer);
    if (idle.has_value()) return *std::move(idle);
  }
  return Dial(submit, peer);
}

std::optional<absl::StatusOr<DataClient::Connection>> DataClient::TakeIdle(
    SubmitRun& submit, PeerRun& peer) {
  absl::MutexLock lock(&mu_);
  ExpireIdleLocked();
  auto it = idle_.find(peer.name());
  while (it != idle_.end() && !it->second.empty()) {
    // Newest first: the least likely to have been closed by the peer.
    UniqueFd fd = std::move(it->second.back().fd);
    const absl::Duration armed[2] = {it->second.back().armed[0],
                                     it->second.back().armed[1]};
    it->second.pop_back();
    --idle_total_;
    if (it->second.empty()) idle_.erase(it);
    // A peer that restarted closed its end: dial it afresh instead.
    if (IdleConnectionAlive(fd.get())) {
      if (!RegisterActiveLocked(submit, fd.get())) {
        idle_[peer.name()].push_back(
            {std::move(fd), absl::Now(), {armed[0], armed[1]}});
        ++idle_total_;
        return submit.stop.StopStatus(
            absl::StrCat("before sending to ", peer.name()));
      }
      Connection connection{std::move(fd), /*reused=*/true};
      connection.armed[0] = armed[0];
      connection.armed[1] = armed[1];
      return connection;
    }
    fd.reset();
    ReleaseConnectionSlotLocked(peer.name());
    it = idle_.find(peer.name());
  }
  return std::nullopt;
}

bool DataClient::RegisterActiveLocked(SubmitRun& submit, int fd) {
  if (submit.aborted) return false;
  submit.active.push_back(fd);
  return true;
}

absl::StatusOr<DataClient::Connection> DataClient::Dial(SubmitRun& submit,
                                                        PeerRun& peer) {
  const StopToken& stop = submit.stop;
  const absl::Time until =
      std::min(stop.deadline(), absl::Now() + options_.connect_timeout);
  auto failed = [&](const absl::Status& why) -> absl::Status {
    if (stop.stopped()) {
      return stop.StopStatus(absl::StrCat("before ", peer.name(), " answered"));
    }
    if (absl::IsResourceExhausted(why)) {
      return Prefixed(why, absl::StrCat("no socket for ", peer.name()));
    }
    spdlog::debug("tcp: peer {} is unreachable: {}", LogSafe(peer.name()),
                  LogSafe(why.message()));
    return Unreachable(peer.name());
  };
  auto addresses = peer.Addresses(until);
  if (!addresses.ok()) return failed(addresses.status());
  if (!ReserveConnectionSlot(submit, peer.name())) {
    return failed(absl::CancelledError(""));
  }
  absl::Status why = absl::UnavailableError("no address");
  for (const PeerAddress& address : *addresses) {
    auto fd = OpenDataSocket(address, options_.socket_buffer_bytes);
    if (!fd.ok()) {
      why = fd.status();
      break;
    }
    {
      absl::MutexLock lock(&mu_);
      if (!RegisterActiveLocked(submit, fd->get())) break;
    }
    const StopCheck cancelled = [&stop] { return stop.cancelled(); };
    why = ConnectSocket(fd->get(), address, until, cancelled);
    // Not a byte goes out before the peer has proven to be an agent.
    if (why.ok()) why = ReadServerHello(fd->get(), until, cancelled);
    if (why.ok()) {
      SetBlocking(fd->get());
      return Connection{std::move(*fd), /*reused=*/false};
    }
    absl::MutexLock lock(&mu_);
    submit.active.erase(
        std::find(submit.active.begin(), submit.active.end(), fd->get()));
    fd->reset();  // closed under mu_, so a cancellation never sees its number
    if (submit.aborted || absl::IsDeadlineExceeded(why)) break;
  }
  absl::MutexLock lock(&mu_);
  ReleaseConnectionSlotLocked(peer.name());
  return failed(why);
}

void DataClient::Release(SubmitRun& submit, const PeerRun& peer,
                         Connection connection, bool reusable) {
  absl::MutexLock lock(&mu_);
  auto it = std::find(submit.active.begin(), submit.active.end(),
                      connection.fd.get());
  if (it != submit.active.end()) submit.active.erase(it);
  // A connection the Run shut down is finished even if its last response
  // made it.
  if (reusable && !submit.aborted && options_.max_idle_per_peer > 0 &&
      options_.max_idle_connections > 0) {
    ExpireIdleLocked();
    std::deque<IdleConnection>& idle = idle_[peer.name()];
    if (idle.size() < static_cast<size_t>(options_.max_idle_per_peer)) {
      if (idle_total_ >= static_cast<size_t>(options_.max_idle_connections)) {
        CloseOldestIdleLocked();
      }
      idle.push_back({std::move(connection.fd),
                      absl::Now(),
                      {connection.armed[0], connection.armed[1]}});
      ++idle_total_;
      return;
    }
  }
  connection.fd.reset();  // under mu_: see Dial
  ReleaseConnectionSlotLocked(peer.name());
}

bool DataClient::ReserveConnectionSlot(SubmitRun& submit,
                                       const std::string& peer) {
  absl::MutexLock lock(&mu_);
  while (open_ >= static_cast<size_t>(options_.max_connections)) {
    if (CloseOldestIdleLocked()) continue;
    if (submit.aborted || submit.stop.stopped()) return false;
    // Every connection is in use: wait for one to be released (bounded, to
    // notice the deadline).
    changed_cv_.WaitWithTimeout(&mu_, absl::Milliseconds(20));
  }
  ++open_;
  ++open_by_peer_[peer];
  return true;
}

void DataClient::ReleaseConnectionSlotLocked(const std::string& peer) {
  --open_;
  auto it = open_by_peer_.find(peer);
  if (it != open_by_peer_.end() && --it->second == 0) open_by_peer_.erase(it);
  changed_cv_.SignalAll();
}

void DataClient::CloseIdleLocked(const std::string& peer,
                                 std::deque<IdleConnection>& idle) {
  for (IdleConnection& connection : idle) {
    connection.fd.reset();
    --idle_total_;
    ReleaseConnectionSlotLocked(peer);
  }
  idle.clear();
}

void DataClient::ExpireIdleLocked() {
  const absl::Time now = absl::Now();
  if (now < next_expiry_check_) return;
  next_expiry_check_ = now + absl::Milliseconds(10);
  const absl::Time cutoff = now - options_.idle_timeout;
  for (auto it = idle_.begin(); it != idle_.end();) {
    std::deque<IdleConnection>& idle = it->second;
    while (!idle.empty() && idle.front().since <= cutoff) {
      idle.pop_front();  // closes it
      --idle_total_;
      ReleaseConnectionSlotLocked(it->first);
    }
    it = idle.empty() ? idle_.erase(it) : std::next(it);
  }
}

bool DataClient::CloseOldestIdleLocked() {
  auto oldest = idle_.end();
  for (auto it = idle_.begin(); it != idle_.end(); ++it) {
    if (it->second.empty()) continue;
    if (oldest == idle_.end() ||
        it->second.front().since < oldest->second.front().since) {
      oldest = it;
    }
  }
  if (oldest == idle_.end()) return false;
  oldest->second.pop_front();
  --idle_total_;
  ReleaseConnectionSlotLocked(oldest->first);
  if (oldest->second.empty()) idle_.erase(oldest);
  return true;
}

size_t DataClient::idle_connections(const HostPort& peer) {
  absl::MutexLock lock(&mu_);
  ExpireIdleLocked();
  auto it = idle_.find(JoinHostPort(peer.host, peer.port));
  return it == idle_.end() ? 0 : it->second.size();
}

size_t DataClient::idle_connections() {
  absl::MutexLock lock(&mu_);
  ExpireIdleLocked();
  return idle_total_;
}

size_t DataClient::open_connections() {
  absl::MutexLock lock(&mu_);
  return open_;
}

std::map<std::string, size_t> DataClient::OpenConnectionsByPeer() {
  absl::MutexLock lock(&mu_);
  return open_by_peer_;
}

}  // namespace rdma_agent::tcp

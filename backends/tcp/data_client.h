#ifndef RDMA_AGENTD_BACKENDS_TCP_DATA_CLIENT_H_
#define RDMA_AGENTD_BACKENDS_TCP_DATA_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "backends/backend.h"
#include "backends/tcp/client_loop.h"
#include "backends/tcp/socket_util.h"
#include "common/stop_token.h"
#include "common/unique_fd.h"

namespace rdma_agent::tcp {

namespace testing {
class PoolProbe;
}  // namespace testing
class Pipeline;
struct PipelineOutcome;

// How a DataClient moves bytes.
struct DataClientOptions {
  // Connections one Submit stripes its chunks over, per peer. Measured on
  // loopback (bench/README.md): 2 beat 1 by ~1.3-2x (two cores copy at
  // once) and 4 gained nothing over 2.
  int connections_per_peer = 2;
  // Largest payload of one request; longer ops are split (<= kMaxPayloadBytes).
  // 1-16 MiB measured alike within noise; 4 MiB stripes a 256 MiB op into 64
  // requests while keeping per-request overhead negligible.
  uint64_t chunk_bytes = 4ull << 20;
  // Requests sent on one connection before their responses arrive...
  int max_in_flight = 16;
  // ...or more (up to Pipeline::kMaxRequestsInFlight, pipeline.h) while the
  // requests in flight carry fewer payload bytes than this: small ops then
  // pipeline deeply (256 x 4 KiB), so that one sendmsg carries many requests
  // and one recv many responses, while large ones keep max_in_flight. 0:
  // max_in_flight alone.
  uint64_t in_flight_bytes = 1 << 20;
  // SO_SNDBUF/SO_RCVBUF of data connections, both ends (0: kernel
  // autotuning). Measured on loopback (bench/README.md): autotuned buffers
  // grow to MiBs, and the bytes a sender copies in are evicted from cache
  // before the receiver copies them out; 256 KiB kept 256 MiB ops at ~1.7-2x
  // the autotuned rate. Enough for a 100 Gb/s path up to ~20 us RTT per
  // connection; raise it (or 0) for longer paths.
  int socket_buffer_bytes = 256 << 10;
  // Send WRITE payloads of at least kSpliceMinBytes with vmsplice/splice
  // (no sender-side copy) when nothing else could deadlock against it. Off
  // by default: on loopback here it cost ~25% more agent CPU per byte than
  // send() (page pinning, and the receiver then copies from cold pages
  // instead of cache-warm socket buffers); worth trying on real NICs.
  bool zero_copy_send = false;

  // Long-lived threads, started with the client, that run every run's
  // connections (one connection at a time each). Peers beyond what they can
  // serve at once wait in a queue. 8 keeps a 2-core host's copies busy with
  // room for a few slow peers.
  int threads = 8;
  // Event-loop threads that take in the answers of small posted batches
  // (DataClient::kLoopBatchBytes): such a batch's requests are sent by the
  // posting thread on a pooled connection, and its done is called by the
  // loop that reads the last answer, so the op costs one thread wake-up
  // (the loop's, by the network) instead of three. 0: every batch goes to
  // the workers.
  int loops = 1;
  // Outgoing data connections open at once, in use and idle together. A new
  // dial past it first closes the oldest idle connection, else waits.
  int max_connections = 256;
  // Idle connections kept for reuse, in all and per peer.
  int max_idle_connections = 128;
  int max_idle_per_peer = 4;
  // Idle connections are closed after this long: below the serving agent's
  // own idle timeout (120 s), so a pooled connection is rarely found closed,
  // and so that connections to peers never seen again go away.
  absl::Duration idle_timeout = absl::Seconds(30);
  // A new connection must be established and the peer's hello read within
  // this (and the op's deadline); otherwise the peer is unreachable.
  absl::Duration connect_timeout = absl::Seconds(5);
  // A connection that moves no byte either way for this long, with
  // requests unanswered, fails its ops UNAVAILABLE (then retried on the next
  // backend) instead of holding its thread until the op's deadline, which
  // may be an hour away. Zero: wait for the deadline.
  absl::Duration no_progress_timeout = absl::Seconds(15);
  // Remote contexts name peers by IP address. With this, host names are
  // resolved too (bounded by the op's deadline); without it they are
  // refused.
  bool allow_host_names = false;
};

// The requesting half of the TCP data plane: runs ops against peers'
// DataServers over a pool of reusable connections.
//
// Thread-safe. Ops are cut into chunks of at most `chunk_bytes` as they are
// sent (nothing per Submit grows with the bytes moved), spread over up to
// `connections_per_peer` connections per peer, and pipelined on each
// connection. Payloads go from the local mapping into the socket and from the
// socket into the local mapping with no intermediate buffer.
//
// Threads: exactly `threads` workers, `loops` event loops and one
// timekeeper, started by Create and joined by the destructor; none per run.
// Workers carry lanes (one connection to one peer each). The timekeeper
// ends runs whose lanes are still queued when their deadline passes (every
// worker may be busy with other runs), shuts down the sockets of runs past
// their deadline (which ends their lanes on the loops), and finishes runs
// that a cancellation ended (a Cancellation callback cannot unregister
// itself). Run's own thread carries one lane of its run (for small ops the
// only one, so they cost no thread hand-off) and queues the others. Post
// sends a small batch to one peer (kLoopBatchBytes) on a pooled connection
// itself and leaves its answers to a loop; other batches, and small ones
// finding no idle connection to their peer (the first to a peer: dialling
// blocks), go to the workers.
//
// A run's state lives on the heap and owns itself: whoever ends its last
// lane (a worker, the timekeeper, or the posting thread when nothing could
// start) writes the outcome and calls `done`, without mu_.
//
// A peer gets no byte before it has sent a valid server hello (wire.h), and
// every failure to reach a peer reads the same ("peer H:P is unreachable"),
// so a forged context cannot make this agent talk to, or probe, other
// services. The precise reason is logged at debug level.
class DataClient {
 public:
  // INVALID_ARGUMENT for options out of range, RESOURCE_EXHAUSTED when the
  // threads (workers, timekeeper) cannot be started.
  static absl::StatusOr<std::unique_ptr<DataClient>> Create(
      DataClientOptions options);
  // Ends the runs still in flight (each gets its done: ops not answered are
  // UNAVAILABLE), stops the threads and closes idle connections. No Post or
  // Run may be in progress on another thread.
  ~DataClient();
  DataClient(const DataClient&) = delete;
  DataClient& operator=(const DataClient&) = delete;

  // The most payload bytes a posted batch to one peer may carry to go
  // through a loop (one lane); larger ones are striped over workers' lanes.
  // 64 KiB: well inside a socket buffer, so the posting thread's send
  // rarely finds it full, and a loop is not kept from other sockets' answers
  // for longer than a copy of that many bytes.
  static constexpr uint64_t kLoopBatchBytes = 64 << 10;

  // Ops to one peer: indices into the run's `ops`.
  struct PeerBatch {
    HostPort peer;
    std::vector<size_t> ops;
  };

  // Starts the ops of `batches` and returns without waiting for them.
  // `done` is called exactly once with `results` (one status per op of
  // `ops`; ops in no batch keep theirs) where each batched op's outcome is
  // written: OK, the serving agent's verdict (e.g. PERMISSION_DENIED,
  // FAILED_PRECONDITION), UNAVAILABLE when the peer is unreachable or a
  // connection broke, DEADLINE_EXCEEDED for what was not answered by
  // `stop.deadline()`, the cancellation's reason once `stop` is cancelled,
  // RESOURCE_EXHAUSTED when no socket could be made.
  //
  // `done` comes by the deadline (plus scheduling slack) or within
  // milliseconds of cancellation, even while every worker is busy with other
  // runs, and once it has been called nothing of the run reads or writes any
  // op's local memory: connections with requests outstanding are shut down
  // and closed, never reused, so late responses are discarded by the
  // kernel. It runs on a worker, a loop, the timekeeper, or inside Post
  // (nothing to start, or a send failed at once), and must not block. `ops` and
  // the Cancellation behind `stop` must outlive it; `stop` itself is copied.
  void Post(absl::Span<const Op> ops, std::vector<PeerBatch> batches,
            std::vector<absl::Status> results, const StopToken& stop,
            OpsDone done);

  // Post, with the calling thread carrying the run's first lane, then
  // waiting for the run to end; returns what `done` would be given. Small
  // ops to one peer then cost no thread hand-off (10-20 us on a loaded VM).
  std::vector<absl::Status> Run(absl::Span<const Op> ops,
                                std::vector<PeerBatch> batches,
                                std::vector<absl::Status> results,
                                const StopToken& stop);

  const DataClientOptions& options() const { return options_; }

  // Outgoing connections open now (in use and idle) by peer "host:port",
  // for metrics.
  std::map<std::string, size_t> OpenConnectionsByPeer();

 private:
  // Tests read the pool's counts through it (pool_probe.h); they are no
  // part of this class's API.
  friend class testing::PoolProbe;

  struct SubmitRun;
  class PeerRun;
  struct Connection;
  struct LoopLane;
  struct LaneJob {
    SubmitRun* submit;
    PeerRun* peer;
    // A loop's lane whose pooled connection broke before any answer: the
    // worker re-sends its window on a fresh connection (owned by the job).
    LoopLane* resume = nullptr;
  };
  struct IdleConnection {
    UniqueFd fd;
    absl::Time since;
    // The send [0] and receive [1] timeouts in force on `fd` (pooled with
    // it, so that the next Submit sets them only if they could overshoot).
    absl::Duration armed[2];
  };

  explicit DataClient(DataClientOptions options);

  // Makes the run and queues a lane job per connection wanted to each peer
  // (one when `one_lane`), except the first when `own_lane` is given: it is
  // set to the lane the caller carries itself (null when none). The run is
  // held (it cannot end) until the caller calls EndJob once more.
  SubmitRun* StartRun(absl::Span<const Op> ops, std::vector<PeerBatch> batches,
                      std::vector<absl::Status> results, const StopToken& stop,
                      OpsDone done, PeerRun** own_lane, bool one_lane = false);
  // True when Post's batch may go through a loop: one peer, at most
  // kLoopBatchBytes.
  bool FitsALoop(absl::Span<const Op> ops,
                 const std::vector<PeerBatch>& batches) const;
  // Starts `peer`'s lane of a held run on a loop: sends on an idle pooled
  // connection from this thread and arms the socket. True: the lane took
  // the caller's hold over as its job (the caller must not touch the run
  // again). False (nothing started, the hold kept) when no idle connection
  // to the peer is open.
  bool StartLoopLane(SubmitRun& submit, PeerRun& peer);
  // On the lane's loop (or the posting thread, first): sends and receives
  // what the socket allows, and arms it again or ends the lane.
  void PumpLoopLane(LoopLane* lane, bool armed);
  // The loop lane ended: its connection goes back or is closed, its
  // outcome is told, its job ends (which may finish the run here).
  void EndLoopLane(LoopLane* lane, bool armed, const PipelineOutcome& outcome);
  // Queues a lane job of a held run for the workers (nothing when the run
  // was aborted meanwhile).
  void QueueLane(const LaneJob& job);
  // One lane job (or the caller's hold) of `submit` ended; the last one
  // finishes the run.
  void EndJob(SubmitRun* submit);
  // True when it was the run's last job: the caller then finishes it.
  bool EndJobLocked(SubmitRun& submit) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes the run's outcome, calls its done and frees it. Not under mu_,
  // never inside the run's own cancellation callback.
  void FinishRun(SubmitRun* submit);
  // The run's cancellation callback.
  void OnCancelled(SubmitRun& submit);
  // The next lane job, taking runs in turn.
  std::optional<LaneJob> NextJobLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void WorkerLoop();
  // Ends runs at their deadline, and finishes runs_to_finish_.
  void TimekeeperLoop();
  // One lane: a connection to the job's peer carrying chunks until none are
  // left, the connection fails or the Run stops.
  void RunLane(const LaneJob& job);
  // Carries `pipeline` over connections to `peer`, starting at `attempt`
  // (1: a fresh dial, no pooled connection).
  void CarryLane(SubmitRun& submit, PeerRun& peer, Pipeline& pipeline,
                 int attempt);
  // Why a lane that did not end healthy failed its chunks.
  static absl::Status LaneFailure(const StopToken& stop, const PeerRun& peer,
                                  const PipelineOutcome& outcome);
  // A pooled connection (unless `fresh`) or a new one, registered with the
  // Run so cancellation can shut it down.
  absl::StatusOr<Connection> Checkout(SubmitRun& submit, PeerRun& peer,
                                      bool fresh);
  // The newest live idle connection to `peer`, registered with the run;
  // nullopt when there is none, the run's stop status when it was aborted.
  std::optional<absl::StatusOr<Connection>> TakeIdle(SubmitRun& submit,
                                                     PeerRun& peer);
  absl::StatusOr<Connection> Dial(SubmitRun& submit, PeerRun& peer);
  // Unregisters `connection` from its Run; pools it when `reusable` and the
  // Run did not shut it down, else closes it.
  void Release(SubmitRun& submit, const PeerRun& peer, Connection connection,
               bool reusable);

  // A receive buffer for a lane (BufferedSocket::kBufferBytes), or null
  // when none is spare; lanes give theirs back when they end, so that a
  // Submit allocates none (at most kMaxSpareBuffers are kept).
  std::unique_ptr<std::byte[]> TakeSpareBuffer();
  void ReturnSpareBuffer(std::unique_ptr<std::byte[]> buffer);
  static constexpr size_t kMaxSpareBuffers = 16;

  // Idle pooled connections to `peer`, and in all.
  size_t idle_connections(const HostPort& peer);
  size_t idle_connections();
  // Outgoing connections open now, in use and idle.
  size_t open_connections();

  // Drops the run's queued jobs and shuts down its sockets. True when that
  // ended its last job: the caller then finishes it (or has it finished).
  bool AbortLocked(SubmitRun& submit) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool RegisterActiveLocked(SubmitRun& submit, int fd)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits for room under max_connections (closing idle connections first).
  // False when the Run stopped first.
  bool ReserveConnectionSlot(SubmitRun& submit, const std::string& peer);
  void ReleaseConnectionSlotLocked(const std::string& peer)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ExpireIdleLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool CloseOldestIdleLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CloseIdleLocked(const std::string& peer,
                       std::deque<IdleConnection>& idle)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const DataClientOptions options_;
  std::atomic<uint64_t> next_request_id_{1};

  absl::Mutex mu_;
  // Workers wait here for jobs (and wake now and then to expire idle
  // connections).
  absl::CondVar work_cv_;
  // Dialers wait here for connection slots.
  absl::CondVar changed_cv_;
  // The timekeeper waits here until `timekeeper_wakes_at_`.
  absl::CondVar timekeeper_cv_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Runs with lane jobs not started yet, served in turn.
  std::deque<SubmitRun*> runs_ ABSL_GUARDED_BY(mu_);
  // Every run not ended yet (intrusive list: no allocation per run), for
  // the timekeeper's deadlines and the destructor.
  SubmitRun* live_ ABSL_GUARDED_BY(mu_) = nullptr;
  // Runs whose last job an abort dropped (a cancellation, the deadline,
  // the destructor), for the timekeeper to finish.
  std::vector<SubmitRun*> runs_to_finish_ ABSL_GUARDED_BY(mu_);
  // When the waiting timekeeper wakes next (InfinitePast while it is not
  // waiting: it looks at every run before it waits again). A new run with
  // an earlier deadline wakes it.
  absl::Time timekeeper_wakes_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  // Idle connections per peer ("host:port"), oldest first.
  std::map<std::string, std::deque<IdleConnection>> idle_ ABSL_GUARDED_BY(mu_);
  size_t idle_total_ ABSL_GUARDED_BY(mu_) = 0;
  // Connections open (dialling, in use or idle).
  size_t open_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, size_t> open_by_peer_ ABSL_GUARDED_BY(mu_);
  absl::Time next_expiry_check_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  // Receive buffers of lanes that ended, for the next lanes.
  std::vector<std::unique_ptr<std::byte[]>> spare_buffers_ ABSL_GUARDED_BY(mu_);

  std::vector<std::thread> workers_;
  std::thread timekeeper_;
  // Destroyed (joined) explicitly once no run is left.
  std::vector<std::unique_ptr<ClientLoop>> loops_;
  std::atomic<size_t> next_loop_{0};
};

}  // namespace rdma_agent::tcp

#endif  // RDMA_AGENTD_BACKENDS_TCP_DATA_CLIENT_H_

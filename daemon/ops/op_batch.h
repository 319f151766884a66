#ifndef RDMA_AGENTD_DAEMON_OPS_OP_BATCH_H_
#define RDMA_AGENTD_DAEMON_OPS_OP_BATCH_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "backends/backend.h"
#include "backends/buffer_table.h"
#include "backends/registry.h"
#include "common/rate_limited_log.h"
#include "common/stop_token.h"
#include "daemon/limits/active_calls.h"
#include "daemon/local/unix_socket.h"
#include "daemon/ops/notification_plan.h"
#include "daemon/ops/op_preparer.h"
#include "daemon/ops/prepared_transfers.h"
#include "daemon/ops/remote_context.h"
#include "daemon/ops/remote_handles.h"
#include "daemon/ops/transfers.h"
#include "rdma/agent/v1/agent.pb.h"

namespace rdma_agent {

class AgentMetrics;

// One warning per failed op or undelivered notification: who asked, what,
// where and why. Rate limited (20 at once, then one a second; the rest at
// debug), shared by every batch of an agent.
class FailedOpLog {
 public:
  void Op(const PeerCredentials& caller, absl::string_view rpc,
          const v1::Op& op, const std::string& backend,
          const absl::Status& status);
  // The same for an op of the agent's own paths (a ring's native batches).
  void Op(const PeerCredentials& caller, absl::string_view rpc,
          const OpSpec& op, const std::string& backend,
          const absl::Status& status);
  void Notification(const PeerCredentials& caller, absl::string_view rpc,
                    const v1::RemoteBuffer& remote, const absl::Status& status);

 private:
  // One line (a warning when the limiter let it pass: `suppressed` set,
  // else at debug); `remote` says where the op went.
  void Log(std::optional<uint64_t> suppressed, const PeerCredentials& caller,
           absl::string_view rpc, v1::OpType type, uint64_t length,
           uint64_t local_buffer_id, const std::string& remote,
           const std::string& backend, const absl::Status& status);

  LogRateLimiter limiter_{absl::Seconds(1), 20};
};

// The metrics of a batch's ended ops, as every path records them: ops that
// ended alike (backend, type, code, latency) are counted together, one
// label lookup per group rather than per op; each retry is counted on its
// own. Add every op, then Record once; a tally kept from batch to batch
// (a ring session's) keeps its room. Without metrics, does nothing.
class OpEndTally {
 public:
  explicit OpEndTally(AgentMetrics* metrics) : metrics_(metrics) {}

  void Add(v1::OpType type, uint64_t length, const OpOutcome& outcome);
  // Records the groups; the tally is empty again.
  void Record();

 private:
  struct Group {
    std::string backend;
    v1::OpType type = v1::OP_TYPE_UNSPECIFIED;
    absl::StatusCode code = absl::StatusCode::kOk;
    absl::Duration latency;
    uint64_t count = 0;
    uint64_t bytes = 0;

    bool Holds(v1::OpType t, const OpOutcome& outcome) const {
      return latency == outcome.latency && code == outcome.status.code() &&
             type == t && backend == outcome.backend;
    }
  };

  AgentMetrics* const metrics_;
  // A batch's groups are few (its backends' shares, a few codes): found by
  // a linear search, consecutive ops' mostly at once.
  std::vector<Group> groups_;
  size_t last_ = 0;
};

// What every batch of an agent runs with. Everything outlives the batches.
struct OpBatchEnvironment {
  const BackendRegistry* registry = nullptr;
  BufferTable* buffers = nullptr;
  AgentMetrics* metrics = nullptr;  // nullptr: ops are not counted
  FailedOpLog* failures = nullptr;
  // Longest remote context an op may carry (--max_remote_context_bytes):
  // a longer one fails its op (INVALID_ARGUMENT) before it is parsed.
  size_t max_remote_context_bytes = kDefaultMaxRemoteContextBytes;
  // The imported remotes ops may name (Op.remote_handle); nullptr: none.
  const RemoteHandleTable* handles = nullptr;
  // What published names ops may name stand for (Op.remote_name); nullptr:
  // none.
  const NameResolver* names = nullptr;
};

// The data path: the ops of one SubmitRequest, validated once and run once —
// by Submit on its own RPC thread (Run), or started by a transfer worker
// (SubmitAsync and ring batches with a notification, as TransferWork:
// Start) and ended on the thread that ended its ops.
//
// - Prepare checks every op on its own (contract codes; messages name the
//   op) and pins the registrations of the valid ones; what ops share (each
//   distinct context, each local buffer) is resolved once (OpPreparer).
// - Start posts the valid ops to the registry (BackendRegistry::PostInPlace)
//   and returns. When they have ended, the batch's notifications (if it has
//   any) are sent through the registry (PlanNotifications: only after every
//   op on that agent succeeded) by a task handed to the BlockingExecutor,
//   never on the completion thread (a backend's poller or event loop); then
//   every op's end is recorded the same way for every RPC: the result, the
//   metrics (one label lookup per group of alike ops) and a warning per
//   failure, and `done` gets the response. A batch without notifications
//   ends on the completion thread: recording its end does not block.
// - Run is Start and wait, with the notifications sent on the calling
//   thread. The guarantee of both is the registry's: once Run returns or
//   `done` is called, nothing of the batch touches local memory.
// - Skip ends a batch that never runs (a transfer cancelled in the queue or
//   past its deadline), with the same bookkeeping.
class OpBatch final : public TransferWork {
 public:
  // Validates every op of `request` (which must outlive the batch) for
  // `caller`; `rpc` names the call in messages and logs.
  static std::unique_ptr<OpBatch> Prepare(const OpBatchEnvironment& env,
                                          const PeerCredentials& caller,
                                          const v1::SubmitRequest* request,
                                          absl::string_view rpc);
  // The same for a transfer: the batch keeps its own copy of the request
  // and the admission of its ops until it is destroyed. `rpc` as above
  // (a ring's batches say "Ring").
  static std::unique_ptr<OpBatch> Prepare(
      const OpBatchEnvironment& env, const PeerCredentials& caller,
      std::unique_ptr<v1::SubmitRequest> request,
      std::unique_ptr<ActiveCalls::OpsCharge> charge,
      absl::string_view rpc = "SubmitAsync");
  // A run of a prepared transfer (SubmitRequest.prepared_id), by Submit or
  // (with the admission of its ops, `charge`) as a transfer: its ops are
  // checked again, their remote sides are the ones resolved when it was
  // prepared. The batch keeps `prepared` until it is destroyed.
  static std::unique_ptr<OpBatch> Prepare(
      const OpBatchEnvironment& env, const PeerCredentials& caller,
      std::shared_ptr<const PreparedTransfer> prepared,
      std::unique_ptr<ActiveCalls::OpsCharge> charge, absl::string_view rpc);

  // Sends `bytes` as the batch's notification in place of its request's
  // (a ring's RUN_PREPARED with NOTIFY: the prepared ops, this run's
  // notification). Before Run or Skip.
  void ReplaceNotification(std::string bytes);

  v1::SubmitResponse Run(const StopToken& stop) override;
  // Once, instead of Run or Skip. `done` may destroy the batch.
  void Start(const StopToken& stop, BlockingExecutor& blocking,
             TransferDone done) override;
  // Start only posts (BackendRegistry::PostInPlace) and hands
  // notifications to `blocking`.
  bool StartsWithoutBlocking() const override { return true; }
  v1::SubmitResponse Skip(const absl::Status& reason) override;
  // Starts counting the bytes of the valid ops as backends report them
  // landed; exact (the bytes of the ops that succeeded) once the batch has
  // ended.
  std::shared_ptr<const TransferProgress> progress() override;

  // What the prepared batch holds besides its request, estimated from
  // above: per-op state, the messages of ops refused and each distinct
  // parsed remote context (SpaceUsedLong). SubmitAsync charges it to the
  // transfer byte budget while the transfer is queued or running.
  uint64_t PreparedBytes() const;

 private:
  OpBatch(const OpBatchEnvironment& env, const PeerCredentials& caller,
          const v1::SubmitRequest* request, absl::string_view rpc);

  void PrepareOps();
  // The notification to send: the request's, unless replaced.
  const std::string& notification() const;
  // Op `i` of the request, validated, or why it is refused.
  absl::StatusOr<Op> PrepareOp(OpPreparer& preparer, size_t i) const;
  // The outcomes of the ops that passed validation, in their order.
  std::vector<OpOutcome> OutcomesOfReady() const;
  // Keeps the outcomes `ran` of the ready ops (in their order) as their
  // ops' ends.
  void Ran(std::vector<OpOutcome>& ran);
  // True when the batch has notifications to send once its ops have ended.
  bool Notifies() const { return !notification().empty(); }
  // Sends the notifications planned from `ran` (the ready ops' outcomes)
  // and records every op's end: the response. May block (notifications).
  v1::SubmitResponse Conclude(const std::vector<OpOutcome>& ran,
                              const StopToken& stop);
  // Concludes a started batch and hands the response to its `done`; the
  // batch may be gone once this returns.
  void ConcludeStarted(const std::vector<OpOutcome>& ran);
  // Sends one planned notification (unless it is blocked) and records what
  // became of it in `result`.
  void Notify(const PlannedNotification& planned, const StopToken& stop,
              v1::NotificationResult* result) const;
  // Records every op's end into `response`; the ops' registrations are
  // unpinned.
  void Finish(v1::SubmitResponse& response);

  const OpBatchEnvironment env_;
  const PeerCredentials caller_;
  const v1::SubmitRequest* const request_;
  const std::string rpc_;
  std::unique_ptr<v1::SubmitRequest> owned_request_;  // *request_, if owned
  // The prepared transfer whose request *request_ is, if any.
  std::shared_ptr<const PreparedTransfer> prepared_;
  std::unique_ptr<ActiveCalls::OpsCharge> charge_;
  // Per op of the request: what ended it (validation or its backend).
  std::vector<OpOutcome> outcomes_;
  // The ops that passed validation, and their positions in the request.
  std::vector<Op> ready_;
  std::vector<size_t> ready_index_;
  std::string replaced_notification_;
  bool notification_replaced_ = false;
  // The first op refused before it ran, if any: it blocks notifications.
  std::optional<size_t> first_refused_;
  // Counted only when someone follows it (progress()).
  std::shared_ptr<TransferProgress> progress_;
  // A started batch's stop and end (Start).
  StopToken stop_{absl::InfiniteFuture()};
  TransferDone done_;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_OPS_OP_BATCH_H_

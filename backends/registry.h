#ifndef RDMA_AGENTD_BACKENDS_REGISTRY_H_
#define RDMA_AGENTD_BACKENDS_REGISTRY_H_

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "backends/backend.h"

namespace rdma_agent {

// The outcome of one op: its status and the backend that ran it last.
struct OpOutcome {
  absl::Status status;
  std::string backend;
  // The backend whose UNAVAILABLE made the op retry on `backend`, if any.
  std::string retried_from;
  // How long `backend` took for the batch this op ran in (the op's own
  // time is not measured apart from its batch's).
  absl::Duration latency;
};

// The agent's backends, fastest transport first, and the rules that use them
// together: a registration is made with every available backend (or none),
// and each op goes to the fastest backend both sides share.
class BackendRegistry {
 public:
  // Keeps `backends` ordered by transport level, highest first; backends of
  // the same level keep their given order.
  explicit BackendRegistry(std::vector<std::unique_ptr<Backend>> backends);

  const std::vector<std::unique_ptr<Backend>>& backends() const {
    return backends_;
  }
  // The backend called `name`, or nullptr.
  Backend* Find(absl::string_view name) const;

  // Registers `registration` with every available backend that can register
  // it (Backend::CanRegister: device memory goes to NIC backends only), in
  // order, adding each one's state to it and its endpoint to `context`. If
  // one fails, the ones that succeeded are rolled back and its error is
  // returned; if none can, FAILED_PRECONDITION (naming the memory kind for
  // device memory).
  absl::Status RegisterWithAll(Registration& registration,
                               v1::RemoteBuffer* context) const;

  // Available backends that can reach `remote`, best first.
  std::vector<Backend*> Route(const v1::RemoteBuffer& remote) const;
  // The same for an op whose local side is `local` (nullptr: any host
  // memory): device memory narrows the route to the backends that
  // registered it.
  std::vector<Backend*> Route(const v1::RemoteBuffer& remote,
                              const Registration* local) const;

  // Runs `ops`, each on the best common backend (one that also registered
  // the op's local buffer when that is device memory); an op that fails
  // with UNAVAILABLE before `stop` fires is retried once on the next common
  // backend. An op no backend carries fails UNAVAILABLE, naming device
  // memory on either side. Each op reaches its backend with Op::endpoint set to
  // that backend's entry in the op's context (the caller leaves it unset).
  // Backends run their share of the batch concurrently. Returns one outcome
  // per op, in order, with Backend::Submit's guarantee: nothing touches
  // local memory after it has returned. (PostInPlace on a copy of `ops`,
  // and a wait for it.)
  std::vector<OpOutcome> Submit(absl::Span<const Op> ops,
                                const StopToken& stop) const;
  // Submit for a caller that owns its ops: they are routed where they lie
  // (each op's Op::endpoint is left set to the entry of the backend that
  // ran it last), and a backend's share that is one run of consecutive ops
  // (a whole batch for one backend, usually) is handed over without copying
  // its ops. (PostInPlace, and a wait for it.)
  std::vector<OpOutcome> SubmitInPlace(absl::Span<Op> ops,
                                       const StopToken& stop) const;

  // How a batch posted with PostInPlace ends: one outcome per op, in order.
  using OutcomesDone = absl::AnyInvocable<void(std::vector<OpOutcome>) &&>;

  // The asynchronous SubmitInPlace: routes `ops` as it does, posts each
  // backend's share with Backend::Post, retries an op that ended
  // UNAVAILABLE once on its next backend, and calls `done` exactly once
  // with the outcomes, on the thread that ended the last share (possibly
  // inside PostInPlace). Never waits for a backend; `done` must not block.
  // The caller keeps `ops` and the Cancellation behind `stop` alive until
  // `done` has been called; once it has, nothing touches local memory.
  //
  // Shares are posted at once, each on its backend's own threads; a retry
  // is posted from the thread that ended the failed share. What it
  // allocates is per batch and per share (routes, the outcomes, a share's
  // op indices), never per op.
  void PostInPlace(absl::Span<Op> ops, const StopToken& stop,
                   OutcomesDone done) const;

  // Sends `data` to the owner of `remote` over `backend`, the one that ran
  // the ops it announces (Backend::Notify). INTERNAL, "not sent", when this
  // agent has no such backend or `remote` no endpoint of it.
  absl::Status Notify(absl::string_view backend, const v1::RemoteBuffer& remote,
                      absl::string_view data, const StopToken& stop) const;

 private:
  // One PostInPlace call, until its `done` has been called.
  struct PostedBatch;
  // The ops of a batch posted to one backend, until that backend ends them.
  struct Share;

  // Posts ops[i] for i in `indices` (ascending) to `backend`, for `batch`
  // (which counts the share outstanding from here).
  void PostShare(PostedBatch& batch, Backend* backend,
                 std::vector<size_t> indices) const;
  // Takes a share's statuses: fills its ops' outcomes, posts the retries,
  // and finishes the batch when it was the last share outstanding.
  void EndShare(std::unique_ptr<Share> share,
                std::vector<absl::Status> statuses) const;
  // Hands the outcomes to the batch's `done` and deletes the batch.
  static void Finish(PostedBatch* batch);

  std::vector<std::unique_ptr<Backend>> backends_;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_BACKENDS_REGISTRY_H_

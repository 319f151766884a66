#include "backends/registry.h"

#include <algorithm>
#include <atomic>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/status_util.h"

namespace rdma_agent {

BackendRegistry::BackendRegistry(std::vector<std::unique_ptr<Backend>> backends)
    : backends_(std::move(backends)) {
  std::stable_sort(backends_.begin(), backends_.end(),
                   [](const auto& a, const auto& b) {
                     return a->transport_level() > b->transport_level();
                   });
}

Backend* BackendRegistry::Find(absl::string_view name) const {
  for (const auto& backend : backends_) {
    if (backend->name() == name) return backend.get();
  }
  return nullptr;
}

absl::Status BackendRegistry::Notify(absl::string_view backend_name,
                                     const v1::RemoteBuffer& remote,
                                     absl::string_view data,
                                     const StopToken& stop) const {
  Backend* backend = Find(backend_name);
  const v1::BackendEndpoint* endpoint = FindEndpoint(remote, backend_name);
  if (backend == nullptr || endpoint == nullptr) {
    return absl::InternalError(
        absl::StrCat("not sent: no ", backend_name, " endpoint to carry it"));
  }
  return backend->Notify(remote, *endpoint, data, stop);
}

absl::Status BackendRegistry::RegisterWithAll(Registration& registration,
                                              v1::RemoteBuffer* context) const {
  // Collected here first so that a failure drops (rolls back) every earlier
  // backend's state before anything is attached to the registration.
  std::vector<std::pair<std::string, std::unique_ptr<BackendRegistration>>>
      done;
  std::vector<v1::BackendEndpoint> endpoints;
  for (const auto& backend : backends_) {
    if (!backend->available() || !backend->CanRegister(registration)) continue;
    v1::BackendEndpoint endpoint;
    auto state = backend->Register(registration, &endpoint);
    if (!state.ok()) {
      return Prefixed(state.status(), absl::StrCat("registering with backend ",
                                                   backend->name()));
    }
    endpoint.set_backend(backend->name());
    endpoints.push_back(std::move(endpoint));
    done.emplace_back(backend->name(), std::move(*state));
  }
  if (done.empty()) {
    if (registration.device_memory() != nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "buffer ", registration.id(), " is ",
          DescribeMemory(registration.memory_kind(),
                         registration.device_index()),
          ", which only NIC backends (ibverbs) can register, and this agent "
          "has none available"));
    }
    return absl::FailedPreconditionError("no backend is available");
  }
  for (auto& [name, state] : done) {
    registration.AddBackend(name, std::move(state));
  }
  for (auto& endpoint : endpoints) {
    *context->add_endpoints() = std::move(endpoint);
  }
  return absl::OkStatus();
}

std::vector<Backend*> BackendRegistry::Route(
    const v1::RemoteBuffer& remote) const {
  return Route(remote, nullptr);
}

std::vector<Backend*> BackendRegistry::Route(const v1::RemoteBuffer& remote,
                                             const Registration* local) const {
  // Device memory is reached only by the backends that registered it.
  const bool device_local = local != nullptr && local->device_memory();
  std::vector<Backend*> route;
  for (const auto& backend : backends_) {
    if (backend->available() && backend->CanReach(remote) &&
        (!device_local || local->backend_state(backend->name()) != nullptr)) {
      route.push_back(backend.get());
    }
  }
  return route;
}

namespace {

// Why no backend of this agent carries `op` (UNAVAILABLE), naming device
// memory on either side: only NIC backends reach it.
absl::Status NoRouteError(const Op& op) {
  std::vector<std::string> names;
  for (const auto& endpoint : op.remote->endpoints()) {
    names.push_back(endpoint.backend());
  }
  const std::string advertised =
      absl::StrCat("it advertises [", absl::StrJoin(names, ", "), "]");
  if (op.remote->memory_kind() != v1::MEMORY_KIND_HOST) {
    return absl::UnavailableError(absl::StrCat(
        "op ", op.index, ": the remote buffer is ",
        DescribeMemory(op.remote->memory_kind(), op.remote->device_index()),
        ", which only NIC backends reach (", advertised,
        "), and no NIC backend of this agent reaches it"));
  }
  if (op.local != nullptr && op.local->device_memory() != nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "op ", op.index, ": the local buffer ", op.local->id(), " is ",
        DescribeMemory(op.local->memory_kind(), op.local->device_index()),
        ", registered with [", absl::StrJoin(op.local->backend_names(), ", "),
        "] only, and none of them reaches the remote buffer (", advertised,
        ")"));
  }
  return absl::UnavailableError(
      absl::StrCat("op ", op.index,
                   ": no backend of this agent can reach the remote "
                   "buffer (",
                   advertised, ")"));
}

// `status` (UNAVAILABLE on the only backend of `op`'s route) saying, when
// either side is device memory, why no other backend was tried: the op is
// never moved to tcp, which cannot reach it.
absl::Status NoFallbackForDeviceMemory(const Op& op,
                                       const absl::Status& status) {
  std::string memory;
  if (op.local != nullptr && op.local->device_memory() != nullptr) {
    memory = absl::StrCat(
        "the local buffer is ",
        DescribeMemory(op.local->memory_kind(), op.local->device_index()));
  } else if (op.remote->memory_kind() != v1::MEMORY_KIND_HOST) {
    memory = absl::StrCat(
        "the remote buffer is ",
        DescribeMemory(op.remote->memory_kind(), op.remote->device_index()));
  } else {
    return status;
  }
  return absl::Status(status.code(),
                      absl::StrCat(status.message(), " (", memory,
                                   ", which no other backend reaches)"));
}

// Each op's local buffer counts as used when the op starts and when it ends,
// so that a long transfer shows in last use while it runs. Once per run of
// ops on the same buffer: the stamp is a clock read.
void MarkLocalsUsed(absl::Span<const Op> ops) {
  const Registration* last = nullptr;
  for (const Op& op : ops) {
    if (op.local != nullptr && op.local.get() != last) op.local->MarkUsed();
    last = op.local.get();
  }
}

}  // namespace

struct BackendRegistry::PostedBatch {
  PostedBatch(absl::Span<Op> ops, const StopToken& stop, OutcomesDone done)
      : ops(ops), stop(stop), done(std::move(done)), outcomes(ops.size()) {}

  const absl::Span<Op> ops;
  const StopToken stop;
  OutcomesDone done;
  // Shares write the outcomes of their own ops only, so they need no lock;
  // the one that finishes the batch reads them all after the count below
  // (acq_rel) has made every share's writes visible.
  std::vector<OpOutcome> outcomes;
  // Each op's backends, best first, as an index into `routes`: ops sharing
  // a context (one parsed object) share its route, computed once per batch.
  std::vector<std::vector<Backend*>> routes;
  std::vector<size_t> route;
  // Shares posted and not ended, plus one while PostInPlace is posting:
  // whoever brings it to zero finishes the batch.
  std::atomic<size_t> outstanding{1};
};

struct BackendRegistry::Share {
  PostedBatch* batch = nullptr;
  Backend* backend = nullptr;
  std::vector<size_t> indices;
  // Copies of the ops when `indices` are not one consecutive run.
  std::vector<Op> gathered;
  absl::Time start;
};

void BackendRegistry::Finish(PostedBatch* batch) {
  MarkLocalsUsed(batch->ops);
  OutcomesDone done = std::move(batch->done);
  std::vector<OpOutcome> outcomes = std::move(batch->outcomes);
  // Nothing of the batch is left once the caller has its outcomes.
  delete batch;
  std::move(done)(std::move(outcomes));
}

std::vector<OpOutcome> BackendRegistry::Submit(absl::Span<const Op> ops,
                                               const StopToken& stop) const {
  std::vector<Op> routed(ops.begin(), ops.end());
  return SubmitInPlace(absl::MakeSpan(routed), stop);
}

std::vector<OpOutcome> BackendRegistry::SubmitInPlace(
    absl::Span<Op> ops, const StopToken& stop) const {
  std::vector<OpOutcome> outcomes;
  absl::Notification ended;
  PostInPlace(ops, stop, [&outcomes, &ended](std::vector<OpOutcome> posted) {
    outcomes = std::move(posted);
    ended.Notify();
  });
  ended.WaitForNotification();
  return outcomes;
}

void BackendRegistry::PostInPlace(absl::Span<Op> ops, const StopToken& stop,
                                  OutcomesDone done) const {
  MarkLocalsUsed(ops);
  // Owned by its shares together (and by this call until every share is
  // posted): whoever ends the last one deletes it, in Finish.
  auto* batch = new PostedBatch(ops, stop, std::move(done));
  // By context and, for device memory, local buffer (host memory is
  // reached by every backend, so host-memory ops share their context's).
  absl::flat_hash_map<std::pair<const v1::RemoteBuffer*, const Registration*>,
                      size_t>
      route_of_context;
  std::vector<std::vector<Backend*>>& routes = batch->routes;
  std::vector<size_t>& route = batch->route;
  route.resize(ops.size());
  // How many routable ops each backend gets first (by position in
  // backends_), so that each share's indices are allocated once.
  std::vector<size_t> first_choices(backends_.size(), 0);
  std::vector<size_t> first_of_route;
  const Registration* previous_device_local = nullptr;
  for (size_t i = 0; i < ops.size(); ++i) {
    const v1::RemoteBuffer* remote = ops[i].remote.get();
    const Registration* device_local =
        ops[i].local != nullptr && ops[i].local->device_memory() != nullptr
            ? ops[i].local.get()
            : nullptr;
    if (i > 0 && remote == ops[i - 1].remote.get() &&
        device_local == previous_device_local) {
      route[i] = route[i - 1];
    } else {
      auto [it, added] = route_of_context.try_emplace(
          std::make_pair(remote, device_local), routes.size());
      if (added) {
        routes.push_back(Route(*remote, device_local));
        size_t first = backends_.size();
        if (!routes.back().empty()) {
          for (first = 0; backends_[first].get() != routes.back()[0]; ++first) {
          }
        }
        first_of_route.push_back(first);
      }
      route[i] = it->second;
    }
    previous_device_local = device_local;
    if (routes[route[i]].empty()) {
      batch->outcomes[i].status = NoRouteError(ops[i]);
      continue;
    }
    ++first_choices[first_of_route[route[i]]];
  }
  // One share per backend that is some op's first choice, all posted at
  // once: a backend's Post returns without waiting for its ops.
  for (size_t b = 0; b < backends_.size(); ++b) {
    if (first_choices[b] == 0) continue;
    std::vector<size_t> indices;
    indices.reserve(first_choices[b]);
    for (size_t i = 0; i < ops.size(); ++i) {
      if (!routes[route[i]].empty() && first_of_route[route[i]] == b) {
        indices.push_back(i);
      }
    }
    PostShare(*batch, backends_[b].get(), std::move(indices));
  }
  if (batch->outstanding.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    Finish(batch);
  }
}

void BackendRegistry::PostShare(PostedBatch& batch, Backend* backend,
                                std::vector<size_t> indices) const {
  absl::Span<Op> ops = batch.ops;
  // The routing decision travels with the op: the backend runs it against
  // its own entry of the context without looking it up again. Ops of one
  // batch mostly share their context: its entry is looked up once per run
  // of ops sharing it.
  const v1::RemoteBuffer* last_remote = nullptr;
  const v1::BackendEndpoint* last_endpoint = nullptr;
  for (size_t i : indices) {
    if (ops[i].remote.get() != last_remote) {
      last_remote = ops[i].remote.get();
      last_endpoint = FindEndpoint(*last_remote, backend->name());
    }
    ops[i].endpoint = last_endpoint;
  }
  auto share = std::make_unique<Share>();
  share->batch = &batch;
  share->backend = backend;
  share->indices = std::move(indices);
  // One run of consecutive ops goes as it lies; scattered ones as copies.
  const std::vector<size_t>& posted = share->indices;
  absl::Span<const Op> span;
  if (posted.back() - posted.front() + 1 == posted.size()) {
    span = ops.subspan(posted.front(), posted.size());
  } else {
    share->gathered.reserve(posted.size());
    for (size_t i : posted) share->gathered.push_back(ops[i]);
    span = share->gathered;
  }
  batch.outstanding.fetch_add(1, std::memory_order_relaxed);
  share->start = absl::Now();
  backend->Post(span, batch.stop,
                [this, share = std::move(share)](
                    std::vector<absl::Status> statuses) mutable {
                  EndShare(std::move(share), std::move(statuses));
                });
}

void BackendRegistry::EndShare(std::unique_ptr<Share> share,
                               std::vector<absl::Status> statuses) const {
  PostedBatch& batch = *share->batch;
  Backend* const backend = share->backend;
  const absl::Duration latency = absl::Now() - share->start;
  // The ops to retry, by the backend each goes to next (usually one).
  std::vector<std::pair<Backend*, std::vector<size_t>>> retries;
  for (size_t k = 0; k < share->indices.size(); ++k) {
    const size_t i = share->indices[k];
    const Op& op = batch.ops[i];
    OpOutcome& outcome = batch.outcomes[i];
    const bool first_attempt = outcome.backend.empty();
    if (!first_attempt) outcome.retried_from = outcome.backend;
    outcome.backend = backend->name();
    outcome.latency = latency;
    outcome.status = k < statuses.size()
                         ? AnnotateOp(statuses[k], op.index)
                         : absl::InternalError(absl::StrCat(
                               "op ", op.index, ": backend ", backend->name(),
                               " returned no result"));
    if (!absl::IsUnavailable(outcome.status)) continue;
    const std::vector<Backend*>& candidates = batch.routes[batch.route[i]];
    if (first_attempt && candidates.size() > 1 && !batch.stop.stopped()) {
      Backend* next = candidates[1];
      auto group =
          std::find_if(retries.begin(), retries.end(),
                       [next](const auto& g) { return g.first == next; });
      if (group == retries.end()) {
        retries.emplace_back(next, std::vector<size_t>());
        group = retries.end() - 1;
      }
      group->second.push_back(i);
    } else if (candidates.size() == 1) {
      outcome.status = NoFallbackForDeviceMemory(op, outcome.status);
    }
  }
  // The copies pin registrations: gone before the batch can end.
  share.reset();
  // This share still counts as outstanding while its retries are posted,
  // so the batch cannot end under them.
  for (auto& [next, indices] : retries) {
    PostShare(batch, next, std::move(indices));
  }
  if (batch.outstanding.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    Finish(&batch);
  }
}

}  // namespace rdma_agent

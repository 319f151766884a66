#include "backends/registry.h"

#include <algorithm>
#include <functional>
#include <map>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/status_util.h"

namespace rdma_agent {

BackendRegistry::BackendRegistry(std::vector<std::unique_ptr<Backend>> backends)
    : backends_(std::move(backends)),
      fan_out_(std::make_unique<TaskPool>(
          backends_.empty() ? 0 : backends_.size() - 1)) {
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

void BackendRegistry::RunOn(Backend* backend, absl::Span<Op> ops,
                            const std::vector<size_t>& indices,
                            const StopToken& stop,
                            std::vector<OpOutcome>& outcomes) const {
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
  // One run of consecutive ops goes as it lies; scattered ones as copies.
  std::vector<Op> gathered;
  absl::Span<const Op> batch;
  if (indices.back() - indices.front() + 1 == indices.size()) {
    batch = ops.subspan(indices.front(), indices.size());
  } else {
    gathered.reserve(indices.size());
    for (size_t i : indices) gathered.push_back(ops[i]);
    batch = gathered;
  }
  const absl::Time start = absl::Now();
  std::vector<absl::Status> statuses = backend->Submit(batch, stop);
  const absl::Duration latency = absl::Now() - start;
  for (size_t k = 0; k < indices.size(); ++k) {
    OpOutcome& outcome = outcomes[indices[k]];
    if (!outcome.backend.empty()) outcome.retried_from = outcome.backend;
    outcome.backend = backend->name();
    outcome.latency = latency;
    outcome.status = k < statuses.size()
                         ? AnnotateOp(statuses[k], ops[indices[k]].index)
                         : absl::InternalError(absl::StrCat(
                               "op ", ops[indices[k]].index, ": backend ",
                               backend->name(), " returned no result"));
  }
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

std::vector<OpOutcome> BackendRegistry::Submit(absl::Span<const Op> ops,
                                               const StopToken& stop) const {
  std::vector<Op> routed(ops.begin(), ops.end());
  return SubmitInPlace(absl::MakeSpan(routed), stop);
}

std::vector<OpOutcome> BackendRegistry::SubmitInPlace(
    absl::Span<Op> ops, const StopToken& stop) const {
  MarkLocalsUsed(ops);
  std::vector<OpOutcome> outcomes(ops.size());
  // Each op's backends, best first, as an index into `routes`: ops sharing
  // a context (one parsed object) share its route, computed once per batch.
  std::vector<std::vector<Backend*>> routes;
  // By context and, for device memory, local buffer (host memory is
  // reached by every backend, so host-memory ops share their context's).
  absl::flat_hash_map<std::pair<const v1::RemoteBuffer*, const Registration*>,
                      size_t>
      route_of_context;
  std::vector<size_t> route(ops.size());
  // Attempt number per op: 0 = best backend, 1 = the retry.
  std::vector<size_t> attempt(ops.size(), 0);
  std::vector<size_t> pending;
  pending.reserve(ops.size());
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
      if (added) routes.push_back(Route(*remote, device_local));
      route[i] = it->second;
    }
    previous_device_local = device_local;
    if (routes[route[i]].empty()) {
      outcomes[i].status = NoRouteError(ops[i]);
      continue;
    }
    pending.push_back(i);
  }

  while (!pending.empty()) {
    std::map<Backend*, std::vector<size_t>> groups;
    for (size_t i : pending) groups[routes[route[i]][attempt[i]]].push_back(i);

    // Backends run their shares at once, on the caller and the fan-out
    // pool (no thread is started per Submit).
    std::vector<std::function<void()>> shares;
    for (auto& [backend, indices] : groups) {
      shares.push_back([&, backend = backend, &indices = indices] {
        RunOn(backend, ops, indices, stop, outcomes);
      });
    }
    fan_out_->RunAll(shares);

    std::vector<size_t> retry;
    for (size_t i : pending) {
      if (!absl::IsUnavailable(outcomes[i].status)) continue;
      if (attempt[i] == 0 && routes[route[i]].size() > 1 && !stop.stopped()) {
        attempt[i] = 1;
        retry.push_back(i);
      } else if (routes[route[i]].size() == 1) {
        outcomes[i].status =
            NoFallbackForDeviceMemory(ops[i], outcomes[i].status);
      }
    }
    pending = std::move(retry);
  }
  MarkLocalsUsed(ops);
  return outcomes;
}

void BackendRegistry::PostInPlace(absl::Span<Op> ops, const StopToken& stop,
                                  OutcomesDone done) const {
  // Until every backend posts natively: the batch runs here.
  std::move(done)(SubmitInPlace(ops, stop));
}

}  // namespace rdma_agent

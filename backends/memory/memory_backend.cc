#include "backends/memory/memory_backend.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "backends/memory/batch_resolver.h"

namespace rdma_agent {

MemoryBackend::MemoryBackend(BackendEnvironment env) : env_(std::move(env)) {}

v1::TransportInfo MemoryBackend::transport_info() const {
  v1::TransportInfo info;
  (*info.mutable_attributes())["agent_id"] = env_.identity.agent_id;
  return info;
}

absl::StatusOr<std::unique_ptr<BackendRegistration>> MemoryBackend::Register(
    const Registration& /*registration*/, v1::BackendEndpoint* endpoint) {
  endpoint->mutable_memory();
  // Nothing to hold: the agent's buffer directory already finds it.
  return std::make_unique<BackendRegistration>();
}

bool MemoryBackend::CanReach(const v1::RemoteBuffer& remote) const {
  const v1::BackendEndpoint* endpoint = FindEndpoint(remote, name_);
  return endpoint != nullptr && endpoint->has_memory() &&
         remote.agent_id() == env_.identity.agent_id;
}

std::vector<absl::Status> MemoryBackend::Submit(absl::Span<const Op> ops,
                                                const StopToken& stop) {
  // Pins what the ops' remote sides resolve to until every op has ended.
  BatchResolver remotes(env_.directory);
  std::vector<absl::Status> results;
  results.reserve(ops.size());
  for (const Op& op : ops) results.push_back(Run(op, remotes, stop));
  return results;
}

absl::Status MemoryBackend::Run(const Op& op, BatchResolver& remotes,
                                const StopToken& stop) const {
  if (absl::Status stopped = stop.Check("before the copy began");
      !stopped.ok()) {
    return stopped;
  }
  auto remote = remotes.Resolve(op);
  if (!remote.ok()) return remote.status();

  std::byte* local = op.local->data() + op.local_offset;
  std::byte* other = (*remote)->data() + op.remote_offset;
  std::byte* dst = op.reads_into_local() ? local : other;
  const std::byte* src = op.reads_into_local() ? other : local;
  // Sliced so that a huge copy still honours the deadline between slices
  // (the first slice was cleared by the check above: no second clock read
  // per small op); memmove because both sides may be the same registration.
  for (uint64_t done = 0; done < op.length;) {
    if (done > 0 && stop.stopped()) {
      return stop.StopStatus(
          absl::StrCat("after ", done, " of ", op.length, " bytes"));
    }
    const uint64_t n = std::min(kCopySliceBytes, op.length - done);
    std::memmove(dst + done, src + done, n);
    done += n;
  }
  op.local->CountMoved(op.length);
  (*remote)->CountServed(op.length);
  return absl::OkStatus();
}

}  // namespace rdma_agent

#include "backends/memory/memory_backend.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "backends/memory/batch_resolver.h"

namespace rdma_agent::memory {

MemoryBackend::MemoryBackend(BackendEnvironment env, MemoryOptions options)
    : env_(std::move(env)),
      options_(options),
      copiers_(options.copy_threads, options.max_queued_batches,
               "rdma-memcopy") {}

MemoryBackend::~MemoryBackend() = default;

v1::TransportInfo MemoryBackend::transport_info() const {
  v1::TransportInfo info;
  (*info.mutable_attributes())["agent_id"] = env_.identity.agent_id;
  return info;
}

absl::StatusOr<std::unique_ptr<BackendRegistration>> MemoryBackend::Register(
    const Registration& registration, v1::BackendEndpoint* endpoint) {
  // memcpy needs a mapping: device memory has none in the agent (the
  // registry does not offer it, see CanRegister).
  absl::Status host = RequireHostMemory(
      registration, "the memory backend cannot reach device memory");
  if (!host.ok()) return host;
  endpoint->mutable_memory();
  // Nothing to hold: the agent's buffer directory already finds it.
  return std::make_unique<BackendRegistration>();
}

bool MemoryBackend::CanReach(const v1::RemoteBuffer& remote) const {
  const v1::BackendEndpoint* endpoint = FindEndpoint(remote, name_);
  return endpoint != nullptr && endpoint->has_memory() &&
         remote.agent_id() == env_.identity.agent_id;
}

namespace {

// Whether a batch must stop, asked before each op. The cancellation (an
// atomic load) is looked at before every op; the clock only before the
// first op, after a directory lookup (which may have waited) and once
// MemoryBackend::kClockCheckBytes have been copied since it was last read:
// a clock read costs about as much as the rest of a small op's checks, and
// copying that many bytes takes microseconds. Once stopped, every later op
// is stopped too.
class PacedStop {
 public:
  explicit PacedStop(const StopToken& stop) : stop_(stop) {}

  // OK while ops may go on. `force_clock`: read the clock whatever was
  // copied since.
  absl::Status Check(absl::string_view what, bool force_clock = false) {
    if (stopped_ || stop_.cancelled()) return Stop(what);
    if (!force_clock && unclocked_bytes_ < MemoryBackend::kClockCheckBytes) {
      return absl::OkStatus();
    }
    unclocked_bytes_ = 0;
    if (absl::Now() >= stop_.deadline()) return Stop(what);
    return absl::OkStatus();
  }
  void Copied(uint64_t bytes) { unclocked_bytes_ += bytes; }
  const StopToken& token() const { return stop_; }

 private:
  absl::Status Stop(absl::string_view what) {
    stopped_ = true;
    return stop_.StopStatus(what);
  }

  const StopToken& stop_;
  bool stopped_ = false;
  // Forces a clock read before the first op.
  uint64_t unclocked_bytes_ = MemoryBackend::kClockCheckBytes;
};

absl::Status RunOp(const Op& op, BatchResolver& remotes, PacedStop& stop) {
  if (absl::Status stopped = stop.Check("before the copy began");
      !stopped.ok()) {
    return stopped;
  }
  const size_t lookups = remotes.lookups();
  auto remote = remotes.Resolve(op);
  if (!remote.ok()) return remote.status();
  // A lookup in the directory may have waited (for its lock): the clock is
  // read again before anything is copied.
  if (remotes.lookups() != lookups) {
    if (absl::Status stopped =
            stop.Check("before the copy began", /*force_clock=*/true);
        !stopped.ok()) {
      return stopped;
    }
  }

  // Neither side is ever device memory when routed here (it is registered
  // with NIC backends only); a forged context naming such a buffer is
  // refused before its (absent) mapping is touched.
  if (absl::Status host = RequireHostMemory(
          *op.local, "the memory backend cannot reach device memory");
      !host.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("local ", host.message()));
  }
  if (absl::Status host = RequireHostMemory(
          **remote, "the memory backend cannot reach device memory");
      !host.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("remote ", host.message()));
  }
  std::byte* local = op.local->data() + op.local_offset;
  std::byte* other = (*remote)->data() + op.remote_offset;
  std::byte* dst = op.reads_into_local() ? local : other;
  const std::byte* src = op.reads_into_local() ? other : local;
  // Sliced so that a huge copy still honours the deadline between slices;
  // memmove because both sides may be the same registration.
  for (uint64_t done = 0; done < op.length;) {
    if (done > 0 && stop.token().stopped()) {
      return stop.token().StopStatus(
          absl::StrCat("after ", done, " of ", op.length, " bytes"));
    }
    const uint64_t n =
        std::min(MemoryBackend::kCopySliceBytes, op.length - done);
    std::memmove(dst + done, src + done, n);
    done += n;
    stop.Copied(n);
    if (op.landed != nullptr) {
      op.landed->fetch_add(n, std::memory_order_relaxed);
    }
  }
  op.local->CountMoved(op.length);
  (*remote)->CountServed(op.length);
  return absl::OkStatus();
}

}  // namespace

std::vector<absl::Status> MemoryBackend::Run(absl::Span<const Op> ops,
                                             const StopToken& stop) {
  // Pins what the ops' remote sides resolve to until every op has ended.
  BatchResolver remotes(env_.directory);
  PacedStop paced(stop);
  std::vector<absl::Status> results;
  results.reserve(ops.size());
  for (const Op& op : ops) {
    results.push_back(RunOp(op, remotes, paced));
    if (results.back().ok()) served_.Count(!op.reads_into_local(), op.length);
  }
  return results;
}

void MemoryBackend::Post(absl::Span<const Op> ops, const StopToken& stop,
                         OpsDone done) {
  uint64_t bytes = 0;
  for (const Op& op : ops) {
    bytes += op.length;
    if (bytes > options_.inline_batch_bytes) break;
  }
  if (bytes > options_.inline_batch_bytes) {
    // `ops` and the Cancellation behind `stop` live until `done` is called.
    Executor::Task copy = [this, ops, stop, done = std::move(done)]() mutable {
      std::vector<absl::Status> results = Run(ops, stop);
      std::move(done)(std::move(results));
    };
    if (copiers_.TryPost(copy)) return;
    // Every copy thread is busy and the queue full: copy here rather than
    // wait for room.
    std::move(copy)();
    return;
  }
  std::vector<absl::Status> results = Run(ops, stop);
  std::move(done)(std::move(results));
}

absl::Status MemoryBackend::Notify(const v1::RemoteBuffer& remote,
                                   const v1::BackendEndpoint&,
                                   absl::string_view data,
                                   const StopToken& stop) {
  absl::Status stopped = stop.Check("before the notification was sent");
  if (!stopped.ok()) return stopped;
  if (env_.notifications == nullptr) {
    return absl::UnimplementedError("this agent takes no notifications");
  }
  return env_.notifications->Deliver(NotificationTarget(remote),
                                     env_.identity.agent_id, data);
}

}  // namespace rdma_agent::memory

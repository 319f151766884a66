#ifndef RDMA_AGENTD_BACKENDS_MEMORY_MEMORY_BACKEND_H_
#define RDMA_AGENTD_BACKENDS_MEMORY_MEMORY_BACKEND_H_

#include <memory>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "common/executor.h"

namespace rdma_agent::memory {

// How the memory backend spreads its copies over threads.
struct MemoryOptions {
  // A posted batch moving at most this many bytes is copied on the posting
  // thread, inside Post. Handing a batch to a copy thread and hearing back
  // costs about 6 us more than copying it in place (measured -c opt, one
  // op, 8 B to 256 KiB); 64 KiB take 0.6 us to copy from cache and about
  // as long as that hand-off from memory (~10 GB/s), so a smaller batch is
  // never worth a thread, and the posting thread is held up by one
  // hand-off's time at most. So a ring batch this small ends inside its
  // post, on the ring thread. Larger batches go to the copy threads.
  uint64_t inline_batch_bytes = 64 << 10;
  // Long-lived threads that copy the larger batches, fixed at start.
  size_t copy_threads = 2;
  // Batches waiting for a copy thread. Past it, Post copies a batch on the
  // posting thread, as for small ones: it never waits for room.
  size_t max_queued_batches = 1024;
};

// Same-host transport: both buffers are registrations of this agent, so an op
// is a memcpy inside the agent. Reaches only contexts this agent issued.
//
// Post copies small batches in place and hands larger ones to a fixed pool
// of copy threads (MemoryOptions), which call `done`; the synchronous Submit
// is Backend's (post and wait). A batch waiting for a copy thread sees its
// deadline or cancellation once one takes it (and stops at once): its wait
// is the copies queued ahead of it, each of which stops at its own deadline.
class MemoryBackend : public Backend {
 public:
  // Largest copy done between deadline and cancellation checks.
  static constexpr uint64_t kCopySliceBytes = 64ull << 20;
  // Between ops, the cancellation is checked before every op but the clock
  // (the deadline) only once this many bytes were copied since it was last
  // read (and after every directory lookup): a batch of small ops does not
  // read the clock for each, and overruns its deadline by the time of such
  // a copy at most (microseconds).
  static constexpr uint64_t kClockCheckBytes = 256ull << 10;

  explicit MemoryBackend(BackendEnvironment env, MemoryOptions options = {});
  // Finishes the batches still queued (each calls its `done`), then joins
  // the copy threads.
  ~MemoryBackend() override;

  const std::string& name() const override { return name_; }
  v1::TransportLevel transport_level() const override {
    return v1::TRANSPORT_LEVEL_MEMORY;
  }
  bool available() const override { return true; }
  v1::TransportInfo transport_info() const override;
  // Every op it ran: both sides are this agent's.
  ServedTotals served() const override { return served_.totals(); }
  absl::StatusOr<std::unique_ptr<BackendRegistration>> Register(
      const Registration& registration, v1::BackendEndpoint* endpoint) override;
  bool CanReach(const v1::RemoteBuffer& remote) const override;
  void Post(absl::Span<const Op> ops, const StopToken& stop,
            OpsDone done) override;
  // The target is this agent: straight into its NotificationSink.
  absl::Status Notify(const v1::RemoteBuffer& remote,
                      const v1::BackendEndpoint& endpoint,
                      absl::string_view data, const StopToken& stop) override;

 private:
  // Copies `ops` on this thread: one status per op; nothing is pinned or
  // touched once it has returned.
  std::vector<absl::Status> Run(absl::Span<const Op> ops,
                                const StopToken& stop);

  const std::string name_ = "memory";
  const BackendEnvironment env_;
  const MemoryOptions options_;
  ServedCounter served_;
  // Last: its threads run batches that use the members above, and are
  // joined first.
  Executor copiers_;
};

}  // namespace rdma_agent::memory

#endif  // RDMA_AGENTD_BACKENDS_MEMORY_MEMORY_BACKEND_H_

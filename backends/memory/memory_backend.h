#ifndef RDMA_AGENTD_BACKENDS_MEMORY_MEMORY_BACKEND_H_
#define RDMA_AGENTD_BACKENDS_MEMORY_MEMORY_BACKEND_H_

#include <memory>
#include <string>
#include <vector>

#include "backends/backend.h"

namespace rdma_agent::memory {

// Same-host transport: both buffers are registrations of this agent, so an op
// is a memcpy inside the agent. Reaches only contexts this agent issued.
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

  explicit MemoryBackend(BackendEnvironment env);

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
  std::vector<absl::Status> Submit(absl::Span<const Op> ops,
                                   const StopToken& stop) override;
  // The target is this agent: straight into its NotificationSink.
  absl::Status Notify(const v1::RemoteBuffer& remote,
                      const v1::BackendEndpoint& endpoint,
                      absl::string_view data, const StopToken& stop) override;

 private:
  const std::string name_ = "memory";
  const BackendEnvironment env_;
  ServedCounter served_;
};

}  // namespace rdma_agent::memory

#endif  // RDMA_AGENTD_BACKENDS_MEMORY_MEMORY_BACKEND_H_

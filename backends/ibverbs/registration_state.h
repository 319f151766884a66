#ifndef RDMA_AGENTD_BACKENDS_IBVERBS_REGISTRATION_STATE_H_
#define RDMA_AGENTD_BACKENDS_IBVERBS_REGISTRATION_STATE_H_

// What the ibverbs backend keeps for one registration (internal to the
// backend's sources).

#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "backends/ibverbs/rails.h"
#include "backends/ibverbs/verbs.h"
#include "backends/registration.h"

namespace rdma_agent::ibverbs {

// The I/O virtual address the MRs of device memory give its first byte. A
// dma-buf has no address in this process, so WRs on it (local SGEs, and
// peers' remote addresses through the context) count from here; any value
// works as long as the registration's every MR and its context agree.
inline constexpr uint64_t kDeviceMemoryIova = 0;

// What WRs call the first byte of `registration` in its MRs: its virtual
// address for host memory, kDeviceMemoryIova for device memory.
inline uint64_t MrAddress(const Registration& registration) {
  return registration.device_memory() != nullptr
             ? kDeviceMemoryIova
             : reinterpret_cast<uint64_t>(registration.data());
}

// An MR of the whole of `registration` in `pd`: ibv_reg_mr of host memory,
// ibv_reg_dmabuf_mr of device memory (addressed from MrAddress()).
inline absl::StatusOr<std::unique_ptr<verbs::MemoryRegion>> RegisterIn(
    verbs::ProtectionDomain& pd, const Registration& registration, int access) {
  if (const DeviceMemory* device = registration.device_memory()) {
    return pd.RegisterDmaBuf(device->offset(), device->size(),
                             kDeviceMemoryIova, device->fd(), access);
  }
  return pd.RegisterMemory(registration.data(), registration.size(), access);
}

// One registration's MR in one peer session's PD.
struct Grant {
  // Declared first: the MR is deregistered before its PD can go.
  std::shared_ptr<verbs::ProtectionDomain> pd;
  std::unique_ptr<verbs::MemoryRegion> mr;
};

// The grants of one registration, by session serial. The registration owns
// it; sessions hold it weakly, so either side going drops the grants.
struct GrantTable {
  absl::Mutex mu;
  std::map<uint64_t, Grant> by_session ABSL_GUARDED_BY(mu);
};

// One registration as the backend holds it: an MR in the main PD of each
// device (local access only: the lkeys of this agent's own WRs on that
// device's rails) and the per-peer grants. ibv_dereg_mr of all of them when
// the registration goes.
class IbverbsRegistration : public BackendRegistration {
 public:
  // `mrs`: one per device, by RailDevice::index.
  explicit IbverbsRegistration(
      std::vector<std::unique_ptr<verbs::MemoryRegion>> mrs)
      : mrs_(std::move(mrs)), grants_(std::make_shared<GrantTable>()) {}
  ~IbverbsRegistration() override {
    // Revokes every peer's access before the memory is unmapped.
    std::map<uint64_t, Grant> dropped;
    absl::MutexLock lock(&grants_->mu);
    dropped.swap(grants_->by_session);
  }
  // The MR on device `device` (a RailDevice::index).
  const verbs::MemoryRegion& mr(size_t device) const { return *mrs_[device]; }
  const std::shared_ptr<GrantTable>& grants() const { return grants_; }
  const RailAffinity& affinity() const { return affinity_; }
  void set_affinity(RailAffinity affinity) { affinity_ = std::move(affinity); }

 private:
  RailAffinity affinity_;
  std::vector<std::unique_ptr<verbs::MemoryRegion>> mrs_;
  std::shared_ptr<GrantTable> grants_;
};

}  // namespace rdma_agent::ibverbs

#endif  // RDMA_AGENTD_BACKENDS_IBVERBS_REGISTRATION_STATE_H_

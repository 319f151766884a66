#ifndef RDMA_AGENTD_BACKENDS_IBVERBS_BACKEND_PROBE_H_
#define RDMA_AGENTD_BACKENDS_IBVERBS_BACKEND_PROBE_H_

// Test-only: what a test playing a rogue peer reads of an IbverbsBackend
// that is no part of its API (the backend befriends this class only).

#include <cstdint>

#include "backends/ibverbs/ibverbs_backend.h"
#include "backends/registration.h"

namespace rdma_agent::testing {

class IbverbsBackendProbe {
 public:
  // The lkey of `registration`'s MR in `backend`'s main PD (0 when it has
  // none): the key a rogue peer would guess.
  static uint32_t LocalKey(const ibverbs::IbverbsBackend& backend,
                           const Registration& registration) {
    return backend.local_key(registration);
  }
};

}  // namespace rdma_agent::testing

#endif  // RDMA_AGENTD_BACKENDS_IBVERBS_BACKEND_PROBE_H_

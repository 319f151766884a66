#ifndef RDMA_AGENTD_BACKENDS_IBVERBS_REAL_VERBS_H_
#define RDMA_AGENTD_BACKENDS_IBVERBS_REAL_VERBS_H_

#include <memory>

#include "backends/ibverbs/verbs.h"

namespace rdma_agent {
namespace verbs {

// The Verbs interface over libibverbs: thin RAII wrappers, one per verbs
// object (ibv_context, ibv_pd, ibv_mr, ibv_cq + ibv_comp_channel, ibv_qp).
// ListDevices() is empty on hosts without an RDMA device or kernel support.
std::unique_ptr<Verbs> MakeRealVerbs();

}  // namespace verbs
}  // namespace rdma_agent

#endif  // RDMA_AGENTD_BACKENDS_IBVERBS_REAL_VERBS_H_

#ifndef RDMA_AGENTD_BACKENDS_IBVERBS_FLAGS_H_
#define RDMA_AGENTD_BACKENDS_IBVERBS_FLAGS_H_

#include "absl/status/statusor.h"
#include "backends/backend.h"
#include "backends/ibverbs/ibverbs_backend.h"

// The package's types live in rdma_agent::ibverbs; like every backend's
// flags target, this entry point for the daemon stays in rdma_agent.
namespace rdma_agent {

// IbverbsOptions from the --ibverbs_* flags (read when called, i.e. after
// flag parsing). INVALID_ARGUMENT for out-of-range values.
absl::StatusOr<ibverbs::IbverbsOptions> IbverbsOptionsFromFlags();

// A factory that spawns an IbverbsBackend on the host's real devices
// (libibverbs), configured by the --ibverbs_* flags.
BackendFactory MakeIbverbsBackendFactoryFromFlags();

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_BACKENDS_IBVERBS_FLAGS_H_

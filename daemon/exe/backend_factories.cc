#include "daemon/exe/backend_factories.h"

#include "absl/strings/str_cat.h"
#include "backends/ibverbs/flags.h"
#include "backends/memory/memory_backend.h"
#include "backends/tcp/flags.h"

namespace rdma_agent {

absl::StatusOr<BackendFactory> BackendFactoryFromFlags(
    const std::string& name) {
  if (name == "memory") {
    return BackendFactory([](const BackendEnvironment& env)
                              -> absl::StatusOr<std::unique_ptr<Backend>> {
      return std::make_unique<memory::MemoryBackend>(env);
    });
  }
  if (name == "tcp") return MakeTcpBackendFactoryFromFlags();
  if (name == "ibverbs") return MakeIbverbsBackendFactoryFromFlags();
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown backend '", name, "' (known: memory, tcp, ibverbs)"));
}

}  // namespace rdma_agent

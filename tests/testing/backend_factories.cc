#include "tests/testing/backend_factories.h"

#include <memory>
#include <utility>

#include "backends/memory/memory_backend.h"
#include "backends/tcp/tcp_backend.h"

namespace rdma_agent::testing {

BackendFactory MemoryFactory() {
  return [](const BackendEnvironment& env)
             -> absl::StatusOr<std::unique_ptr<Backend>> {
    return std::make_unique<memory::MemoryBackend>(env);
  };
}

BackendFactory LoopbackTcpFactory() {
  return [](const BackendEnvironment& env)
             -> absl::StatusOr<std::unique_ptr<Backend>> {
    tcp::TcpOptions options;
    options.listen = "127.0.0.1:0";
    auto backend = tcp::TcpBackend::Create(options, env);
    if (!backend.ok()) return backend.status();
    return std::unique_ptr<Backend>(std::move(*backend));
  };
}

}  // namespace rdma_agent::testing

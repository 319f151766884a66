#include "backends/testing/targets.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends/ibverbs/ibverbs_backend.h"
#include "backends/ibverbs/soft/soft_verbs.h"
#include "backends/memory/memory_backend.h"
#include "backends/tcp/tcp_backend.h"
#include "backends/testing/ibverbs_agent.h"

namespace rdma_agent {
namespace testing {
namespace {

// A world where each agent's backend comes from the same factory.
class SimpleWorld : public TargetWorld {
 public:
  explicit SimpleWorld(BackendFactory factory) : factory_(std::move(factory)) {}
  BackendFactory Factory(int /*agent*/) override { return factory_; }

 private:
  const BackendFactory factory_;
};

constexpr uint64_t kTcpChunkBytes = 1 << 20;
constexpr uint64_t kIbverbsMaxMessageBytes = 64 << 10;

class SoftFabricWorld : public TargetWorld {
 public:
  SoftFabricWorld() {
    for (int agent = 0; agent < 2; ++agent) {
      verbs::SoftDeviceConfig config;
      config.name = absl::StrCat("nic_", agent);
      const absl::Status added = fabric_.AddDevice(config);
      (void)added;
    }
  }
  BackendFactory Factory(int agent) override {
    ibverbs::IbverbsOptions options;
    options.qp.max_message_bytes = kIbverbsMaxMessageBytes;
    options.qp.timeout = 8;  // ~1 ms per try: a lost peer shows quickly
    options.qp.retry_cnt = 2;
    const std::string device = absl::StrCat("nic_", agent);
    return IbverbsFactory(
        [this, device] { return fabric_.MakeVerbs({device}); }, options);
  }

 private:
  verbs::SoftFabric fabric_;
};

// Agent 0: rails_0_0 (4x EDR), rails_0_1 (2x), rails_0_2 (4x); agent 1:
// rails_1_0 (2x), rails_1_1 (4x).
class SoftRailsWorld : public TargetWorld {
 public:
  SoftRailsWorld() {
    const std::vector<std::vector<uint8_t>> widths = {{2, 16, 2}, {16, 2}};
    for (int agent = 0; agent < 2; ++agent) {
      for (size_t i = 0; i < widths[agent].size(); ++i) {
        verbs::SoftDeviceConfig config;
        config.name = absl::StrCat("rails_", agent, "_", i);
        config.active_width = widths[agent][i];
        const absl::Status added = fabric_.AddDevice(config);
        (void)added;
        devices_[agent].push_back(config.name);
      }
    }
  }
  BackendFactory Factory(int agent) override {
    ibverbs::IbverbsOptions options;
    options.qp.max_message_bytes = kIbverbsMaxMessageBytes;
    options.qp.timeout = 8;  // ~1 ms per try: a lost peer shows quickly
    options.qp.retry_cnt = 2;
    const std::vector<std::string> devices = devices_[agent];
    return IbverbsFactory(
        [this, devices] { return fabric_.MakeVerbs(devices); }, options);
  }

 private:
  verbs::SoftFabric fabric_;
  std::vector<std::string> devices_[2];
};

}  // namespace

BackendTarget MemoryTarget() {
  BackendTarget target;
  target.name = "memory";
  target.agents = 1;
  target.max_message_bytes = memory::MemoryBackend::kCopySliceBytes;
  target.make_world = [] {
    return std::make_unique<SimpleWorld>(
        [](const BackendEnvironment& env)
            -> absl::StatusOr<std::unique_ptr<Backend>> {
          return std::make_unique<memory::MemoryBackend>(env);
        });
  };
  return target;
}

BackendTarget TcpTarget() {
  BackendTarget target;
  target.name = "tcp";
  target.max_message_bytes = kTcpChunkBytes;
  target.make_world = [] {
    return std::make_unique<SimpleWorld>(
        [](const BackendEnvironment& env)
            -> absl::StatusOr<std::unique_ptr<Backend>> {
          tcp::TcpOptions options;
          options.listen = "127.0.0.1:0";
          options.client.chunk_bytes = kTcpChunkBytes;
          auto backend = tcp::TcpBackend::Create(options, env);
          if (!backend.ok()) return backend.status();
          return std::unique_ptr<Backend>(std::move(*backend));
        });
  };
  return target;
}

BackendTarget SoftIbverbsTarget() {
  BackendTarget target;
  target.name = "soft_ibverbs";
  target.max_message_bytes = kIbverbsMaxMessageBytes;
  target.make_world = [] { return std::make_unique<SoftFabricWorld>(); };
  return target;
}

BackendTarget SoftIbverbsRailsTarget() {
  BackendTarget target;
  target.name = "soft_ibverbs_rails";
  target.max_message_bytes = kIbverbsMaxMessageBytes;
  target.make_world = [] { return std::make_unique<SoftRailsWorld>(); };
  return target;
}

}  // namespace testing
}  // namespace rdma_agent

#include "backends/testing/ibverbs_agent.h"

#include <utility>

#include "gtest/gtest.h"

namespace rdma_agent {
namespace testing {

BackendFactory IbverbsFactory(
    std::function<std::unique_ptr<verbs::Verbs>()> make_verbs,
    ibverbs::IbverbsOptions options) {
  return [make_verbs = std::move(make_verbs),
          options = std::move(options)](const BackendEnvironment& env)
             -> absl::StatusOr<std::unique_ptr<Backend>> {
    auto backend = ibverbs::IbverbsBackend::Create(env, options, make_verbs());
    if (!backend.ok()) return backend.status();
    return std::unique_ptr<Backend>(std::move(*backend));
  };
}

namespace {

std::unique_ptr<TestAgent> CreateOrFail(const std::string& agent_id,
                                        const BackendFactory& factory) {
  auto agent = TestAgent::Create(agent_id, factory);
  EXPECT_TRUE(agent.ok()) << agent.status();
  return agent.ok() ? std::move(*agent) : nullptr;
}

}  // namespace

std::unique_ptr<TestAgent> SoftIbverbsAgent(verbs::SoftFabric& fabric,
                                            const std::string& agent_id,
                                            const std::string& device,
                                            ibverbs::IbverbsOptions options) {
  return CreateOrFail(
      agent_id,
      IbverbsFactory([&fabric, device] { return fabric.MakeVerbs({device}); },
                     std::move(options)));
}

std::unique_ptr<TestAgent> SoftIbverbsAgent(
    verbs::SoftFabric& fabric, const std::string& agent_id,
    const std::vector<std::string>& devices, ibverbs::IbverbsOptions options) {
  return CreateOrFail(
      agent_id,
      IbverbsFactory([&fabric, devices] { return fabric.MakeVerbs(devices); },
                     std::move(options)));
}

std::unique_ptr<TestAgent> IbverbsAgent(std::unique_ptr<verbs::Verbs> verbs,
                                        const std::string& agent_id,
                                        ibverbs::IbverbsOptions options) {
  auto shared =
      std::make_shared<std::unique_ptr<verbs::Verbs>>(std::move(verbs));
  return CreateOrFail(agent_id,
                      IbverbsFactory([shared] { return std::move(*shared); },
                                     std::move(options)));
}

}  // namespace testing
}  // namespace rdma_agent

#include "backends/ibverbs/test_node.h"

#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace rdma_agent {
namespace testing {

std::unique_ptr<TestNode> TestNode::Create(verbs::SoftFabric& fabric,
                                           const std::string& agent_id,
                                           const std::string& device,
                                           IbverbsOptions options) {
  return CreateWithVerbs(fabric.MakeVerbs({device}), agent_id,
                         std::move(options));
}

std::unique_ptr<TestNode> TestNode::CreateWithVerbs(
    std::unique_ptr<verbs::Verbs> verbs, const std::string& agent_id,
    IbverbsOptions options) {
  std::unique_ptr<TestNode> node(new TestNode());
  node->identity_.agent_id = agent_id;
  node->identity_.epoch = std::random_device()() | 1;
  node->directory_ = std::make_unique<TestDirectory>(node->identity_.epoch);
  BackendEnvironment env;
  env.identity = node->identity_;
  env.directory = node->directory_.get();
  env.advertise_host = "127.0.0.1";
  auto backend =
      IbverbsBackend::Create(env, std::move(options), std::move(verbs));
  EXPECT_TRUE(backend.ok()) << backend.status();
  if (!backend.ok()) return nullptr;
  node->backend_ = std::move(*backend);
  if (node->backend_->available()) {
    auto listener = PeerListener::ServeAndStart(*node->backend_);
    EXPECT_TRUE(listener.ok()) << listener.status();
    if (listener.ok()) node->peer_listener_ = std::move(*listener);
  }
  return node;
}

TestBuffer TestNode::Register(uint64_t size, v1::Access access, uint8_t seed) {
  TestBuffer buffer;
  auto memory = SharedMemory::Allocate(size, "ibverbs-test");
  EXPECT_TRUE(memory.ok()) << memory.status();
  const std::string token =
      absl::StrCat("token-", identity_.agent_id, "-", next_id_);
  auto registration = std::make_shared<Registration>(
      next_id_++, /*owner=*/0, access, "test", token, std::move(*memory),
      /*agent_allocated=*/true);
  for (uint64_t i = 0; i < size; ++i) {
    reinterpret_cast<uint8_t*>(registration->data())[i] =
        static_cast<uint8_t>(seed + i * 31 + (i >> 8));
  }
  auto context = std::make_shared<v1::RemoteBuffer>();
  context->set_agent_id(identity_.agent_id);
  context->set_agent_epoch(identity_.epoch);
  context->set_buffer_id(registration->id());
  context->set_size_bytes(size);
  context->set_access(access);
  context->set_token(token);
  v1::BackendEndpoint* endpoint = context->add_endpoints();
  auto state = backend_->Register(*registration, endpoint);
  EXPECT_TRUE(state.ok()) << state.status();
  endpoint->set_backend("ibverbs");
  if (state.ok()) registration->AddBackend("ibverbs", std::move(*state));
  directory_->Add(registration);
  buffer.registration = std::move(registration);
  buffer.context = std::move(context);
  return buffer;
}

Op MakeOp(size_t index, v1::OpType type, const TestBuffer& local,
          uint64_t local_offset, uint64_t length, const TestBuffer& remote,
          uint64_t remote_offset) {
  Op op;
  op.index = index;
  op.type = type;
  op.local = local.registration;
  op.local_offset = local_offset;
  op.length = length;
  op.remote = remote.context;
  // As BackendRegistry::Submit routes it.
  op.endpoint = FindEndpoint(*op.remote, "ibverbs");
  op.remote_offset = remote_offset;
  return op;
}

}  // namespace testing
}  // namespace rdma_agent

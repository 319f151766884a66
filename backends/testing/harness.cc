#include "backends/testing/harness.h"

#include <cstring>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/shared_memory.h"
#include "gtest/gtest.h"
#include "tests/testing/pattern.h"

namespace rdma_agent {
namespace testing {

void RequestGate::Close(absl::Time open_at) {
  absl::MutexLock lock(&mu_);
  closed_ = true;
  open_at_ = open_at;
  arrivals_ = 0;
}

void RequestGate::Open() {
  absl::MutexLock lock(&mu_);
  closed_ = false;
}

void RequestGate::Pass() const {
  absl::MutexLock lock(&mu_);
  ++arrivals_;
  ++held_;
  auto open = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !closed_; };
  if (open_at_ == absl::InfiniteFuture()) {
    mu_.Await(absl::Condition(&open));
  } else {
    mu_.AwaitWithDeadline(absl::Condition(&open), open_at_);
  }
  --held_;
}

bool RequestGate::AwaitArrivals(int count, absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto arrived = [this, count]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return arrivals_ >= count;
  };
  return mu_.AwaitWithTimeout(absl::Condition(&arrived), timeout);
}

bool RequestGate::AwaitNoneHeld(absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto none = [this]()
                  ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return held_ == 0; };
  return mu_.AwaitWithTimeout(absl::Condition(&none), timeout);
}

TestAgent::TestAgent(const std::string& agent_id, uint64_t epoch)
    : table_(epoch) {
  identity_.agent_id = agent_id;
  identity_.epoch = epoch;
}

absl::StatusOr<std::unique_ptr<TestAgent>> TestAgent::Create(
    const std::string& agent_id, const BackendFactory& factory,
    uint64_t epoch) {
  if (epoch == 0) epoch = (uint64_t{std::random_device()()} << 20) | 1;
  std::unique_ptr<TestAgent> agent(new TestAgent(agent_id, epoch));
  BackendEnvironment env;
  env.identity = agent->identity_;
  env.directory = &agent->directory_;
  env.advertise_host = "127.0.0.1";
  auto backend = factory(env);
  if (!backend.ok()) return backend.status();
  agent->backend_ = std::move(*backend);
  if (!agent->backend_->available()) return agent;
  if (agent->backend_->peer_services().empty()) {
    if (absl::Status started = agent->backend_->Start(""); !started.ok()) {
      return started;
    }
    return agent;
  }
  auto listener = PeerListener::ServeAndStart(*agent->backend_);
  if (!listener.ok()) return listener.status();
  agent->peer_listener_ = std::move(*listener);
  return agent;
}

TestAgent::~TestAgent() { DestroyBackend(); }

void TestAgent::DestroyBackend() {
  peer_listener_.reset();
  backend_.reset();
}

std::string TestAgent::peer_address() const {
  return peer_listener_ == nullptr ? "" : peer_listener_->address();
}

TestBuffer TestAgent::Register(uint64_t size, v1::Access access,
                               uint64_t seed) {
  auto memory = SharedMemory::Allocate(size, "backend-test");
  EXPECT_TRUE(memory.ok()) << memory.status();
  if (!memory.ok()) return TestBuffer{nullptr, nullptr, seed};
  const uint64_t id = table_.NextId();
  auto registration = std::make_shared<Registration>(
      id, /*owner=*/0, access, "test",
      absl::StrCat("token-", identity_.agent_id, "-", id), std::move(*memory),
      /*agent_allocated=*/true);
  FillPattern(absl::MakeSpan(registration->data(), size), seed);
  TestBuffer buffer = Publish(std::move(registration));
  buffer.seed = seed;
  return buffer;
}

TestBuffer TestAgent::RegisterDevice(DeviceMemory memory, v1::Access access) {
  const uint64_t id = table_.NextId();
  return Publish(std::make_shared<Registration>(
      id, /*owner=*/0, access, "test-device",
      absl::StrCat("token-", identity_.agent_id, "-", id), std::move(memory),
      /*agent_allocated=*/false));
}

TestBuffer TestAgent::Publish(std::shared_ptr<Registration> registration) {
  auto context = std::make_shared<v1::RemoteBuffer>();
  context->set_agent_id(identity_.agent_id);
  context->set_agent_epoch(identity_.epoch);
  context->set_buffer_id(registration->id());
  context->set_size_bytes(registration->size());
  context->set_access(registration->access());
  context->set_token(registration->token());
  context->set_memory_kind(registration->memory_kind());
  context->set_device_index(registration->device_index());
  v1::BackendEndpoint* endpoint = context->add_endpoints();
  auto state = backend_->Register(*registration, endpoint);
  EXPECT_TRUE(state.ok()) << state.status();
  endpoint->set_backend(backend_->name());
  if (state.ok()) {
    registration->AddBackend(backend_->name(), std::move(*state));
  }
  table_.Add(registration);
  TestBuffer buffer;
  buffer.registration = std::move(registration);
  buffer.context = std::move(context);
  return buffer;
}

void TestAgent::Release(const TestBuffer& buffer) {
  const absl::Status removed =
      table_.Remove(buffer.registration->id(), /*caller=*/0);
  EXPECT_TRUE(removed.ok()) << removed;
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
  op.remote_offset = remote_offset;
  if (op.remote != nullptr && op.remote->endpoints_size() > 0) {
    op.endpoint = &op.remote->endpoints(0);
  }
  return op;
}

std::vector<uint8_t> Snapshot(const TestBuffer& buffer) {
  return std::vector<uint8_t>(buffer.bytes(), buffer.bytes() + buffer.size());
}

std::optional<uint64_t> FirstWrongByte(const TestBuffer& buffer,
                                       uint64_t inside_seed,
                                       uint64_t inside_from, uint64_t offset,
                                       uint64_t length) {
  return FirstMismatch(buffer.span(), inside_seed, inside_from, offset, length,
                       buffer.seed);
}

std::optional<uint64_t> FirstChangedByte(const TestBuffer& buffer) {
  return FindMismatch(buffer.span(), buffer.seed);
}

void Refill(const TestBuffer& buffer) {
  FillPattern(buffer.span(), buffer.seed);
}

void Apply(const Op& op, std::vector<uint8_t>& local_image,
           std::vector<uint8_t>& remote_image) {
  if (op.reads_into_local()) {
    std::memcpy(local_image.data() + op.local_offset,
                remote_image.data() + op.remote_offset, op.length);
  } else {
    std::memcpy(remote_image.data() + op.remote_offset,
                local_image.data() + op.local_offset, op.length);
  }
}

std::optional<uint64_t> FirstDifference(const TestBuffer& buffer,
                                        const std::vector<uint8_t>& image) {
  if (image.size() != buffer.size()) return 0;
  if (std::memcmp(buffer.bytes(), image.data(), image.size()) == 0) {
    return std::nullopt;
  }
  for (uint64_t i = 0; i < image.size(); ++i) {
    if (buffer.bytes()[i] != image[i]) return i;
  }
  return std::nullopt;
}

absl::Time In(absl::Duration duration) { return absl::Now() + duration; }

}  // namespace testing
}  // namespace rdma_agent

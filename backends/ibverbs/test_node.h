#ifndef RDMA_AGENTD_BACKENDS_IBVERBS_TEST_NODE_H_
#define RDMA_AGENTD_BACKENDS_IBVERBS_TEST_NODE_H_

// Test-only: a minimal "agent" around one IbverbsBackend on a soft device,
// so that backend tests run several agents in one process without the
// daemon: an identity, a buffer directory, and helpers to register buffers
// and build ops.

#include <cstdint>
#include <memory>
#include <string>

#include "backends/backend.h"
#include "backends/ibverbs/ibverbs_backend.h"
#include "backends/ibverbs/soft/soft_verbs.h"
#include "backends/testing/peer_listener.h"
#include "backends/testing/test_directory.h"

namespace rdma_agent {
namespace testing {

// A registration and the remote context peers use for it.
struct TestBuffer {
  std::shared_ptr<Registration> registration;
  std::shared_ptr<const v1::RemoteBuffer> context;
  uint8_t* bytes() const {
    return reinterpret_cast<uint8_t*>(registration->data());
  }
};

class TestNode {
 public:
  // An agent `agent_id` whose ibverbs backend sees only `device` of
  // `fabric`. The node serves its backend's Peer service on 127.0.0.1:0.
  static std::unique_ptr<TestNode> Create(verbs::SoftFabric& fabric,
                                          const std::string& agent_id,
                                          const std::string& device,
                                          IbverbsOptions options = {});
  // The same over any Verbs (the hardware test passes the real one).
  static std::unique_ptr<TestNode> CreateWithVerbs(
      std::unique_ptr<verbs::Verbs> verbs, const std::string& agent_id,
      IbverbsOptions options = {});

  IbverbsBackend& backend() { return *backend_; }
  const AgentIdentity& identity() const { return identity_; }

  // Registers `size` bytes with `access`, filled with a pattern derived from
  // `seed`. The directory holds it until Release().
  TestBuffer Register(uint64_t size, v1::Access access, uint8_t seed);
  void Release(const TestBuffer& buffer) {
    directory_->Remove(buffer.registration->id());
  }

 private:
  TestNode() = default;

  AgentIdentity identity_;
  // Before backend_: the backend's environment points at it.
  std::unique_ptr<TestDirectory> directory_;
  std::unique_ptr<IbverbsBackend> backend_;
  // After backend_: it stops serving before the backend goes.
  std::unique_ptr<PeerListener> peer_listener_;
  uint64_t next_id_ = 1;
};

// An op of `type` moving `length` bytes between local[local_offset..] and
// remote[remote_offset..].
Op MakeOp(size_t index, v1::OpType type, const TestBuffer& local,
          uint64_t local_offset, uint64_t length, const TestBuffer& remote,
          uint64_t remote_offset);

}  // namespace testing
}  // namespace rdma_agent

#endif  // RDMA_AGENTD_BACKENDS_IBVERBS_TEST_NODE_H_

#ifndef RDMA_AGENTD_BACKENDS_TESTING_HARNESS_H_
#define RDMA_AGENTD_BACKENDS_TESTING_HARNESS_H_

// Test-only: agents without the daemon, for backend tests. A TestAgent hosts
// one backend with a BufferTable (and serves the backend's Peer services, as
// the Agent does); TestBuffers are registrations filled with a byte pattern
// (tests/testing/pattern.h) together with the remote context peers use;
// MakeOp builds ops as BackendRegistry::Submit hands them to a backend.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "backends/backend.h"
#include "backends/buffer_table.h"
#include "backends/testing/peer_listener.h"

namespace rdma_agent {
namespace testing {

// A registration and the remote context peers use for it. The context
// advertises one endpoint: that of the agent's one backend.
struct TestBuffer {
  std::shared_ptr<Registration> registration;
  std::shared_ptr<const v1::RemoteBuffer> context;
  // The pattern the buffer was filled with at Register.
  uint64_t seed = 0;

  uint8_t* bytes() const {
    return reinterpret_cast<uint8_t*>(registration->data());
  }
  uint64_t size() const { return registration->size(); }
  absl::Span<std::byte> span() const {
    return absl::MakeSpan(registration->data(), registration->size());
  }
  // The same buffer named by a copy of its context changed by `mutate`
  // (a forged token, a stale epoch...).
  template <typename Mutate>
  TestBuffer WithContext(Mutate mutate) const {
    auto copy = std::make_shared<v1::RemoteBuffer>(*context);
    mutate(*copy);
    return TestBuffer{registration, std::move(copy), seed};
  }
};

// Holds the peer requests an agent serves (every ResolveForPeer, where a
// backend's serving side starts touching a buffer) until opened, so tests can
// run into the deadline or cancel with a request in flight. Open at creation.
class RequestGate {
 public:
  // Requests from now on wait (until Open(), or until `open_at` passes).
  void Close(absl::Time open_at = absl::InfiniteFuture());
  void Open();
  // Blocks until `count` requests have arrived at the gate since the last
  // Close() (held or not), or `timeout` passes; returns whether they did.
  bool AwaitArrivals(int count, absl::Duration timeout) const;
  // Blocks until no request is held, or `timeout` passes.
  bool AwaitNoneHeld(absl::Duration timeout) const;

  // Called by the agent's directory for each request.
  void Pass() const;

 private:
  mutable absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time open_at_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  mutable int arrivals_ ABSL_GUARDED_BY(mu_) = 0;
  mutable int held_ ABSL_GUARDED_BY(mu_) = 0;
};

// One in-process "agent": an identity, a BufferTable, one backend spawned by
// a factory, and (when the backend has any) its Peer services on 127.0.0.1.
class TestAgent {
 public:
  // Spawns the backend with an environment naming this agent and starts it
  // (serving its peer_services() first). A random odd epoch when 0.
  static absl::StatusOr<std::unique_ptr<TestAgent>> Create(
      const std::string& agent_id, const BackendFactory& factory,
      uint64_t epoch = 0);
  ~TestAgent();

  // The backend, as its own type for backend-specific tests.
  template <typename B = Backend>
  B& backend() const {
    return static_cast<B&>(*backend_);
  }
  bool has_backend() const { return backend_ != nullptr; }
  const AgentIdentity& identity() const { return identity_; }
  BufferTable& table() { return table_; }
  RequestGate& gate() { return gate_; }
  // The Peer listener's "host:port" (empty when the backend serves none).
  std::string peer_address() const;

  // Registers `size` bytes with `access`, filled with pattern `seed`, with
  // the backend and in the table (which holds it until Release()).
  TestBuffer Register(uint64_t size, v1::Access access, uint64_t seed);
  // Registers device memory as Register does host memory (its context says
  // what memory it is). Not filled: the test that made `memory` sees its
  // bytes; bytes() is null.
  TestBuffer RegisterDevice(DeviceMemory memory, v1::Access access);
  // Unpublishes `buffer` as the agent's Release does; ops still pin it.
  void Release(const TestBuffer& buffer);

  // Stops serving peers and destroys the backend (the agent going away).
  void DestroyBackend();

 private:
  // The table as the backend sees it: every peer request passes the gate.
  class GatedDirectory : public BufferDirectory {
   public:
    GatedDirectory(const BufferTable& table, const RequestGate& gate)
        : table_(table), gate_(gate) {}
    absl::StatusOr<std::shared_ptr<Registration>> ResolveForPeer(
        const ServeRequest& request) const override {
      gate_.Pass();
      return table_.ResolveForPeer(request);
    }

   private:
    const BufferTable& table_;
    const RequestGate& gate_;
  };

  TestAgent(const std::string& agent_id, uint64_t epoch);

  // Registers `registration` with the backend and adds it to the table.
  TestBuffer Publish(std::shared_ptr<Registration> registration);

  AgentIdentity identity_;
  // Before backend_: the backend's environment points at them.
  BufferTable table_;
  RequestGate gate_;
  GatedDirectory directory_{table_, gate_};
  std::unique_ptr<Backend> backend_;
  // After backend_: it stops serving before the backend goes.
  std::unique_ptr<PeerListener> peer_listener_;
};

// An op of `type` moving `length` bytes between local[local_offset..] and
// remote[remote_offset..], routed to the remote context's (first) endpoint
// as BackendRegistry::Submit routes it.
Op MakeOp(size_t index, v1::OpType type, const TestBuffer& local,
          uint64_t local_offset, uint64_t length, const TestBuffer& remote,
          uint64_t remote_offset);

// A copy of every byte of `buffer`.
std::vector<uint8_t> Snapshot(const TestBuffer& buffer);

// Where `buffer` stops holding what an op that moved `length` bytes of
// pattern `inside_seed` (from position `inside_from`) into
// [offset, offset + length) leaves: that range holds the moved bytes, every
// other byte the buffer's own pattern. nullopt when every byte matches.
std::optional<uint64_t> FirstWrongByte(const TestBuffer& buffer,
                                       uint64_t inside_seed,
                                       uint64_t inside_from, uint64_t offset,
                                       uint64_t length);
// Where `buffer` stops holding its own pattern; nullopt if nowhere.
std::optional<uint64_t> FirstChangedByte(const TestBuffer& buffer);
// Rewrites `buffer` with its own pattern.
void Refill(const TestBuffer& buffer);

// What `op` leaves in images (Snapshots) of its local and remote buffers.
void Apply(const Op& op, std::vector<uint8_t>& local_image,
           std::vector<uint8_t>& remote_image);
// Index of the first byte of `buffer` that differs from `image`; nullopt if
// none.
std::optional<uint64_t> FirstDifference(const TestBuffer& buffer,
                                        const std::vector<uint8_t>& image);

absl::Time In(absl::Duration duration);

}  // namespace testing
}  // namespace rdma_agent

#endif  // RDMA_AGENTD_BACKENDS_TESTING_HARNESS_H_

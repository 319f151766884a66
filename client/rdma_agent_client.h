#ifndef RDMA_AGENTD_CLIENT_RDMA_AGENT_CLIENT_H_
#define RDMA_AGENTD_CLIENT_RDMA_AGENT_CLIENT_H_

// The C++ client of rdma-agentd: connect to the host's agent, register memory
// (mapped into this process), run one-sided ops against remote contexts, and
// release. Thread-safe: one AgentClient may be used from many threads; a
// Buffer is used like any other piece of memory.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "rdma/agent/v1/agent.grpc.pb.h"
#include "rdma/agent/v1/agent.pb.h"
#include "rdma/agent/v1/types.pb.h"

namespace rdma_agent {
class SharedMemory;
}  // namespace rdma_agent

namespace rdma_agent::client {

namespace v1 = ::rdma::agent::v1;

// Where the agent is when nothing says otherwise.
inline constexpr char kDefaultAgentTarget[] =
    "unix:///run/rdma-agentd/agent.sock";
// The environment variable naming the agent's socket (a gRPC target such as
// "unix:///path/agent.sock", or a bare socket path) for clients given none.
inline constexpr char kAgentSocketEnv[] = "RDMA_AGENT_SOCKET";

// The gRPC target for `target`: empty -> $RDMA_AGENT_SOCKET, else
// kDefaultAgentTarget; a bare path ("/run/x.sock", "./x.sock") -> a unix:
// target; anything else as given.
std::string ResolveAgentTarget(absl::string_view target);

struct ConnectOptions {
  // gRPC target of the agent's RdmaAgent service, or a bare socket path;
  // empty: $RDMA_AGENT_SOCKET, else kDefaultAgentTarget.
  std::string target;
  // empty: the attach.sock next to the agent socket
  std::string attach_socket;
  // Connect fails with UNAVAILABLE if the agent is not reachable within this;
  // zero: do not wait, connect lazily on the first call. A Unix socket that
  // is missing, refuses connections or is forbidden fails at once (naming
  // the errno; PERMISSION_DENIED when forbidden) instead of waiting.
  absl::Duration connect_timeout = absl::Seconds(5);
  // Deadline of each RPC other than Submit, and of each attach-socket
  // exchange.
  absl::Duration rpc_timeout = absl::Seconds(30);
  // Submit's gRPC deadline is its op timeout plus this, so that the agent's
  // own timeout answers first (with per-op DEADLINE_EXCEEDED results).
  absl::Duration submit_deadline_slack = absl::Seconds(5);
  // ReadBuffer/WriteBuffer move at most this many bytes per RPC; keep it
  // under the agent's --max_transfer_bytes_per_rpc and gRPC's 4 MiB limit.
  uint64_t transfer_chunk_bytes = 1 << 20;
};

// One op of a Submit.
struct OpSpec {
  v1::OpType type = v1::OP_TYPE_UNSPECIFIED;
  uint64_t local_buffer_id = 0;
  uint64_t local_offset = 0;
  uint64_t length = 0;
  std::string remote_context;  // serialized RemoteBuffer of the other side
  uint64_t remote_offset = 0;
};

// What happened to one op.
struct OpResult {
  absl::Status status;  // the agent's code and message for this op
  std::string backend;  // backend that ran it; empty if none did
};

// A registration as the agent reported it, without a mapping in this process
// and without ownership: it stays registered until someone calls Release.
struct Registration {
  uint64_t id = 0;
  uint64_t size = 0;
  std::string remote_context;  // serialized RemoteBuffer
  std::vector<std::string> backends;
  v1::Lifetime lifetime = v1::LIFETIME_AGENT;  // as the agent keeps it
};

namespace internal {
class ClientState;
}  // namespace internal

// A registration mapped into this process. Movable, not copyable. The
// destructor unmaps the memory and releases the registration (best effort,
// errors are dropped) unless Release was already called. By default the
// agent also releases it when this process exits without doing so (killed,
// crashed): see lifetime().
class Buffer {
 public:
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();

  // Id of the registration, scoped to this user on this agent.
  uint64_t id() const { return id_; }
  // Size in bytes of the registration and of the mapping.
  uint64_t size() const { return size_; }
  // The mapped memory: the same bytes the agent moves (no copy).
  std::byte* data() const { return data_; }
  absl::Span<std::byte> bytes() const { return absl::MakeSpan(data_, size_); }
  // Serialized RemoteBuffer: hand it to peers as opaque bytes.
  const std::string& remote_context() const { return remote_context_; }
  // Backends the buffer is registered with, in preference order.
  const std::vector<std::string>& backends() const { return backends_; }
  // How long the agent keeps the registration if nobody releases it
  // (LIFETIME_CLIENT_CONNECTION where the agent cannot watch this process).
  v1::Lifetime lifetime() const { return lifetime_; }

  // Releases the registration now and returns the RPC status. The mapping
  // stays valid until the Buffer is destroyed; the destructor will not
  // release again, whatever this returned.
  absl::Status Release();

 private:
  friend class AgentClient;
  Buffer(std::shared_ptr<internal::ClientState> state, uint64_t id,
         std::unique_ptr<SharedMemory> memory, uint64_t size,
         std::string remote_context, std::vector<std::string> backends,
         v1::Lifetime lifetime);
  void ReleaseBestEffort();

  std::shared_ptr<internal::ClientState> state_;
  uint64_t id_ = 0;
  std::unique_ptr<SharedMemory> memory_;  // the memfd and its mapping
  uint64_t size_ = 0;                     // registered bytes, <= memory_'s
  std::byte* data_ = nullptr;             // memory_'s, cached for inline use
  std::string remote_context_;
  std::vector<std::string> backends_;
  v1::Lifetime lifetime_ = v1::LIFETIME_UNSPECIFIED;
  bool released_ = true;  // nothing to release until constructed for real
};

class AgentClient {
 public:
  // Opens a channel to the agent and, with connect_timeout > 0, waits until
  // it is reachable (UNAVAILABLE otherwise). A non-unix target without an
  // explicit attach socket is fine here; only Allocate and Attach need the
  // attach socket, and they fail with INVALID_ARGUMENT without one.
  static absl::StatusOr<std::unique_ptr<AgentClient>> Connect(
      ConnectOptions options = {});

  // The agent's identity, version and backends.
  absl::StatusOr<v1::AgentInfo> GetInfo();

  // Agent allocates `size` zero-filled bytes; the client maps them through
  // the fd the attach socket returns (OpenBuffer). If mapping fails, the
  // registration is released and the mapping error returned.
  //
  // `lifetime`: by default the registration lives no longer than this
  // process, like the Buffer that releases it (the agent releases it if the
  // process dies first); LIFETIME_AGENT keeps it until Release, for
  // registrations handed to something that outlives this process.
  absl::StatusOr<Buffer> Allocate(
      uint64_t size, v1::Access access, const std::string& label = "",
      v1::Lifetime lifetime = v1::LIFETIME_CLIENT_PROCESS);

  // Client creates a memfd of `size` bytes (sealed F_SEAL_SHRINK), maps it,
  // passes it on the attach socket, then Register{attach_token}. `lifetime`
  // as for Allocate.
  absl::StatusOr<Buffer> Attach(
      uint64_t size, v1::Access access, const std::string& label = "",
      v1::Lifetime lifetime = v1::LIFETIME_CLIENT_PROCESS);

  // Agent allocates; nothing is mapped here and nothing is released
  // automatically, not even when this process ends (LIFETIME_AGENT: for
  // tools such as rdma-agentctl whose registrations outlive the process).
  absl::StatusOr<Registration> AllocateUnmapped(uint64_t size,
                                                v1::Access access,
                                                const std::string& label = "");

  // Runs `ops` as one batch; one result per op, in order. The RPC's own
  // failure (bad batch, deadline) is the returned status. `timeout` bounds
  // the batch on the agent; zero or infinite leaves it to the agent's
  // --default_submit_timeout. Either way the RPC has a deadline.
  absl::StatusOr<std::vector<OpResult>> Submit(const std::vector<OpSpec>& ops,
                                               absl::Duration timeout);

  // Drops registration `buffer_id`.
  absl::Status Release(uint64_t buffer_id);

  // This user's registrations; with `all_users`, every user's (root only:
  // PERMISSION_DENIED for others).
  absl::StatusOr<std::vector<v1::BufferInfo>> ListBuffers(
      bool all_users = false);

  // Copies [offset, offset+length) of a registration out over gRPC, in
  // chunks of at most transfer_chunk_bytes. OUT_OF_RANGE if offset+length
  // overflows; the agent checks the bounds.
  absl::StatusOr<std::string> ReadBuffer(uint64_t id, uint64_t offset,
                                         uint64_t length);

  // Copies `data` into a registration at `offset` over gRPC, chunked too.
  // A failure may leave the chunks before it written.
  absl::Status WriteBuffer(uint64_t id, uint64_t offset,
                           absl::string_view data);

  // The channel to the agent, for other services it serves (grpc.health.v1)
  // and for raw RdmaAgent calls (v1::RdmaAgent::NewStub(client.channel())).
  std::shared_ptr<grpc::Channel> channel() const;

  // The attach socket this client uses (empty if none could be derived).
  const std::string& attach_socket() const;

  ~AgentClient();

 private:
  explicit AgentClient(std::shared_ptr<internal::ClientState> state);
  absl::StatusOr<v1::RegisterResponse> Register(
      const v1::RegisterRequest& request);

  std::shared_ptr<internal::ClientState> state_;
};

}  // namespace rdma_agent::client

#endif  // RDMA_AGENTD_CLIENT_RDMA_AGENT_CLIENT_H_

#ifndef RDMA_AGENTD_BACKENDS_BACKEND_H_
#define RDMA_AGENTD_BACKENDS_BACKEND_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "backends/buffer_directory.h"
#include "backends/notification_sink.h"
#include "backends/peer_tls.h"
#include "backends/registration.h"
#include "backends/served_counter.h"
#include "common/stop_token.h"
#include "rdma/agent/v1/agent.pb.h"
#include "rdma/agent/v1/remote_buffer.pb.h"

namespace grpc {
class Service;
}

namespace rdma_agent {

// Who this agent is; every backend gets it at spawn.
struct AgentIdentity {
  std::string agent_id;
  uint64_t epoch = 0;
};

// What a backend is given when it is spawned.
struct BackendEnvironment {
  AgentIdentity identity;
  // Looks up local registrations when serving peers. Outlives the backend.
  const BufferDirectory* directory = nullptr;
  // Host peers should dial to reach this agent (never a wildcard address).
  std::string advertise_host;
  // True when an operator chose advertise_host (--advertise_host: NAT, a
  // container): it then wins over a listener's own address. Otherwise it
  // was detected, and a listener bound to one address advertises that.
  bool advertise_host_explicit = false;
  // Credentials for calling peers' Peer services (the agent's Peer listener
  // serves with the same material). Not enabled = plaintext.
  PeerTls peer_tls;
  // Takes the notifications peers send to local registrations' owners.
  // Outlives the backend. nullptr: this agent takes none (backends refuse
  // them with UNIMPLEMENTED).
  NotificationSink* notifications = nullptr;
};

// One op as the agent hands it to a backend, already validated: the local
// range lies inside `local` with the right access, the remote range inside
// what `remote` advertises, length > 0, and `endpoint` is the backend's own
// entry in `remote`, one it CanReach(). Backends trust this and check again
// only what the remote side answers; the remote side re-checks the request
// against its real buffer (whoever serves it).
struct Op {
  // Position in the Submit batch, for messages ("op 3: ...").
  size_t index = 0;
  v1::OpType type = v1::OP_TYPE_UNSPECIFIED;
  std::shared_ptr<Registration> local;  // pinned for the op's lifetime
  uint64_t local_offset = 0;
  uint64_t length = 0;
  std::shared_ptr<const v1::RemoteBuffer> remote;
  uint64_t remote_offset = 0;
  // The entry of `remote` for the backend running the op, chosen by
  // BackendRegistry::Submit (which sets it for each attempt). Points into
  // *remote, so it lives as long as the op.
  const v1::BackendEndpoint* endpoint = nullptr;
  // Where a backend that moves the op in parts adds the bytes of each part
  // once it has landed (read into local memory, or acknowledged by the
  // remote side), so a running transfer can show progress. nullptr: nobody
  // follows. Shared by the ops of a batch; relaxed adds are enough (it is
  // only ever read as an estimate).
  std::atomic<uint64_t>* landed = nullptr;

  bool reads_into_local() const { return type == v1::OP_TYPE_READ_INTO_LOCAL; }
};

// How a batch posted with Backend::Post ends: one status per op, in order.
using OpsDone = absl::AnyInvocable<void(std::vector<absl::Status>) &&>;

// A transport that moves bytes between this agent's registrations and
// remote ones.
//
// Thread-safe: Register, Post, Submit and destruction of
// BackendRegistrations may happen concurrently from many RPCs.
//
// A backend implements Post; Submit waits on it (a backend may override
// Submit to lend the calling thread to its own batch, through the same
// machinery).
class Backend {
 public:
  virtual ~Backend() = default;

  // "memory", "tcp", "ibverbs": the name in remote contexts and results.
  virtual const std::string& name() const = 0;
  virtual v1::TransportLevel transport_level() const = 0;
  // False when the backend cannot be used on this host (no device, disabled);
  // the registry then skips it.
  virtual bool available() const = 0;
  // Why it is unavailable (empty when available).
  virtual std::string unavailable_reason() const { return ""; }
  // Devices, addresses and other details for GetInfo.
  virtual v1::TransportInfo transport_info() const = 0;
  // What this backend served to requesters since start (metrics). Zero for
  // a backend whose hardware serves without it (a NIC's one-sided ops).
  virtual ServedTotals served() const { return {}; }

  // Connections (or queue pairs) held with each peer now, for metrics.
  struct PeerLinks {
    std::string peer;       // the peer's host (tcp), or "agent/device" (NICs)
    std::string direction;  // "out": this agent connected; "in": the peer did
    size_t count = 0;
  };
  virtual std::vector<PeerLinks> peer_links() const { return {}; }

  // Services this backend serves to peer agents on the agent's Peer listener
  // (e.g. the queue-pair handshake). Must stay valid while the backend lives.
  // Backends never open listeners of their own: whoever runs a backend
  // serves these (the Agent; backends/testing/peer_listener.h in tests) and
  // stops serving them before destroying the backend.
  virtual std::vector<grpc::Service*> peer_services() { return {}; }

  // Called once, after the agent's Peer listener is up and before any
  // Register. `peer_address` is the "host:port" peers dial to reach this
  // backend's peer_services() (empty when the agent runs no Peer listener).
  virtual absl::Status Start(const std::string& peer_address) {
    (void)peer_address;
    return absl::OkStatus();
  }

  // Whether this backend can register `registration` at all. The registry
  // skips a backend that cannot (the registration goes without it) rather
  // than failing the registration. Backends that copy bytes themselves reach
  // host memory only; NIC backends also reach device memory (a dma-buf).
  virtual bool CanRegister(const Registration& registration) const {
    return registration.host_memory() != nullptr;
  }

  // Makes `registration` reachable through this backend. Fills `endpoint`
  // (its entry in the remote context) and returns what must live as long as
  // the registration (dropping it undoes the registration).
  virtual absl::StatusOr<std::unique_ptr<BackendRegistration>> Register(
      const Registration& registration, v1::BackendEndpoint* endpoint) = 0;

  // True when this backend can run ops against `remote`: it advertises an
  // endpoint of this backend that this agent can use.
  virtual bool CanReach(const v1::RemoteBuffer& remote) const = 0;

  // The asynchronous entry: starts `ops` (all reachable by this backend)
  // and returns without waiting for them to end. `done` is called exactly
  // once with one status per op, in order: by `stop.deadline()`
  // (DEADLINE_EXCEEDED for ops not done) or soon after `stop` is cancelled
  // (ops not done get the cancellation's reason; "soon" is well under a
  // second). Once `done` has been called, no part of the batch reads or
  // writes any op's local memory again.
  //
  // `done` runs on whichever thread ends the batch: inside Post itself (a
  // batch that ends at once, or small ops a backend runs in place), or one
  // of the backend's own threads (a worker, an event loop, a completion
  // poller). It must not block; slow follow-up work goes to another thread.
  // Post itself never waits for a peer, a queue slot or another batch.
  //
  // The caller keeps `ops` (and what they point to) and the Cancellation
  // behind `stop` alive until `done` has been called.
  virtual void Post(absl::Span<const Op> ops, const StopToken& stop,
                    OpsDone done) = 0;

  // The synchronous entry: Post, then wait for `done`. Returns the statuses
  // `done` was given, under the same guarantee.
  virtual std::vector<absl::Status> Submit(absl::Span<const Op> ops,
                                           const StopToken& stop);

  // Sends `data` over this backend's own channel to the agent that issued
  // `remote` (`endpoint` is this backend's entry in it), for the owner of
  // the buffer it names: that agent's NotificationSink. The registry calls
  // it after ops of a batch on that agent completed through this backend,
  // so the notification follows their bytes. OK once the target queued it;
  // never resent, so a failure after sending (say so in the message) may
  // still have been delivered once. Returns by `stop.deadline()`, or soon
  // after `stop` is cancelled. Backends that carry no notifications answer
  // UNIMPLEMENTED.
  virtual absl::Status Notify(const v1::RemoteBuffer& remote,
                              const v1::BackendEndpoint& endpoint,
                              absl::string_view data, const StopToken& stop);
};

// Spawns a backend from its configuration (captured by the factory) for an
// agent. The daemon builds factories from flags; tests build them directly.
using BackendFactory = std::function<absl::StatusOr<std::unique_ptr<Backend>>(
    const BackendEnvironment& env)>;

// The endpoint of `backend` in `remote`, or nullptr: for CanReach() and
// routing; Submit() finds it in Op::endpoint.
const v1::BackendEndpoint* FindEndpoint(const v1::RemoteBuffer& remote,
                                        absl::string_view backend);

// "op N: message", keeping the status code.
absl::Status AnnotateOp(const absl::Status& status, size_t op_index);

// The ServeRequest a peer sends for `op`'s remote side.
ServeRequest ServeRequestFor(const Op& op);

// The proof_only ServeRequest naming `remote`'s buffer: what a notification
// to its owner carries.
ServeRequest NotificationTarget(const v1::RemoteBuffer& remote);

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_BACKENDS_BACKEND_H_

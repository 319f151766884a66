#ifndef RDMA_AGENTD_CLIENT_RDMA_AGENT_CLIENT_H_
#define RDMA_AGENTD_CLIENT_RDMA_AGENT_CLIENT_H_

// The C++ client of rdma-agentd: connect to the host's agent, register memory
// (mapped into this process), run one-sided ops against remote contexts
// (synchronously, or as asynchronous transfers with handles and completion
// callbacks), and release. Thread-safe: one AgentClient may be used from many
// threads; a Buffer is used like any other piece of memory; a Transfer and a
// TransferWatch may be used from several threads at once.

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
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

namespace rdma::agent::v1 {
class AttachRequest;  // attach.proto: only the library's own code speaks it
}  // namespace rdma::agent::v1

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
  // The other side: a serialized RemoteBuffer, or (instead) a handle from
  // AgentClient::ImportRemote. Exactly one of the two.
  std::string remote_context;
  uint64_t remote_offset = 0;
  // After remote_offset, so that {type, id, offset, length, context,
  // remote offset} initialises what it always did.
  uint64_t remote_handle = 0;
  // Or (instead of both) a name published in the agent's directory
  // (AgentClient::Publish); the agent resolves it once per batch.
  std::string remote_name;
};

// A remote context the agent has imported (AgentClient::ImportRemote):
// parsed, checked and routed once; ops name it by `handle`. It stays on the
// agent until ReleaseRemote.
struct RemoteHandle {
  uint64_t handle = 0;
  std::string agent_id;  // what the context says of its buffer
  uint64_t buffer_id = 0;
  uint64_t size = 0;
  v1::Access access = v1::ACCESS_UNSPECIFIED;
  std::vector<std::string> backends;  // this agent's that reach it
};

// What happened to one op.
struct OpResult {
  absl::Status status;  // the agent's code and message for this op
  std::string backend;  // backend that ran it; empty if none did
};

// What became of a batch's notification to one remote buffer (see
// SubmitOptions::notification).
struct NotificationResult {
  std::string agent_id;    // the target agent
  uint64_t buffer_id = 0;  // the target buffer there
  // OK: the target queued it for the buffer's owner. ABORTED: not sent,
  // because an op of the batch on that agent did not succeed. Otherwise
  // sending it failed (never resent; the message says if it may have
  // arrived all the same).
  absl::Status status;
  std::string backend;  // backend that carried it; empty if none did
};

// How a Submit or SubmitAsync runs beyond its ops.
struct SubmitOptions {
  // Bounds the batch on the agent; zero or infinite leaves it to the agent's
  // --default_submit_timeout. A long timeout does not make the agent wait
  // that long on a stuck peer: over tcp, a connection that moves nothing
  // for the agent's --tcp_no_progress_timeout (15 s by default) fails its
  // ops UNAVAILABLE first.
  absl::Duration timeout = absl::ZeroDuration();
  // Bytes for the owner of each remote buffer the batch targets, sent once
  // every op of the batch on its agent has succeeded (at most the agent's
  // --max_notification_bytes, 4 KiB by default). Empty: none.
  std::string notification;
};

// The outcome of a Submit with options.
struct SubmitResult {
  std::vector<OpResult> results;  // one per op, in order
  // One per distinct remote buffer when a notification was asked for.
  std::vector<NotificationResult> notifications;
};

// A notification another agent's client (or this agent's) sent to the owner
// of one of this user's buffers, after its ops there succeeded: its bytes
// are in the buffer.
struct Notification {
  std::string from_agent_id;  // as the sending agent names itself
  uint64_t buffer_id = 0;     // this user's buffer the ops targeted
  std::string data;
  absl::Time receive_time = absl::InfinitePast();
  // This user's notifications on the agent, numbered from 1; a gap is where
  // some were dropped.
  uint64_t sequence = 0;
};

// What one read of this user's notifications returned.
struct NotificationBatch {
  std::vector<Notification> notifications;  // oldest first, each once
  // How many were dropped (queue full) since the last read that said so.
  uint64_t dropped = 0;
};

// Called for each event of a NotificationWatch: a notification, or only a
// count of dropped ones (then `notification` is nullptr).
using NotificationCallback = absl::AnyInvocable<void(
    const Notification* notification, uint64_t dropped)>;

// A registration as the agent reported it, without a mapping in this process
// and without ownership: it stays registered until someone calls Release.
struct Registration {
  uint64_t id = 0;
  uint64_t size = 0;
  std::string remote_context;  // serialized RemoteBuffer
  std::vector<std::string> backends;
  v1::Lifetime lifetime = v1::LIFETIME_AGENT;  // as the agent keeps it
};

// Device memory (a GPU's) that the application exported as a dma-buf, for
// AgentClient::RegisterDeviceMemory. The client links no GPU runtime: the
// application gets the fd itself, e.g. with cuMemGetHandleForAddressRange(
// ..., CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0) (the CUDA driver API wants a
// page-aligned range; `offset` then picks the bytes out of it).
struct DeviceMemorySpec {
  // The dma-buf. Stays the caller's: the agent receives its own copy and
  // keeps it while the registration lives, so the caller may close this one
  // once RegisterDeviceMemory has returned.
  int dmabuf_fd = -1;
  // The registered bytes: [offset, offset + length) of the dma-buf.
  uint64_t offset = 0;
  uint64_t length = 0;
  // Which device memory; never MEMORY_KIND_HOST (use Attach for host memory).
  v1::MemoryKind kind = v1::MEMORY_KIND_CUDA;
  // The device's index (e.g. the CUDA device ordinal), shown in ListBuffers
  // and in errors.
  uint32_t device_index = 0;
  // Optional: the device's PCI address as cuDeviceGetPCIBusId or nvidia-smi
  // print it ("0000:3b:00.0", "00000000:3B:00.0", or "3b:00.0"). With it,
  // NIC backends use the NICs nearest the device (its NUMA node, its PCIe
  // switch); without it, every NIC. A malformed one: INVALID_ARGUMENT.
  std::string pci_bus_id;
};

// Where an asynchronous transfer is (the agent's TransferState). kPending is
// the only state that changes.
enum class TransferState {
  kPending,    // queued or running: its ops may still touch local memory
  kDone,       // ended, every op OK
  kFailed,     // ended, some op failed (its OpResult says why)
  kCancelled,  // ended because Cancel stopped it
};

// "PENDING", "DONE", "FAILED" or "CANCELLED".
const char* TransferStateName(TransferState state);

// A transfer as the client last learnt it.
struct TransferResult {
  uint64_t id = 0;
  TransferState state = TransferState::kPending;
  // One per op, in request order, once ended; empty while kPending (the
  // agent reports the ops of a batch together when it ends).
  std::vector<OpResult> results;
  // When the agent accepted it, started running it (InfinitePast if it
  // never ran: cancelled while queued, or no valid op) and ended it
  // (InfinitePast while pending). InfinitePast where the client does not
  // know them.
  absl::Time create_time = absl::InfinitePast();
  absl::Time start_time = absl::InfinitePast();
  absl::Time end_time = absl::InfinitePast();
  // As SubmitResult::notifications, once ended.
  std::vector<NotificationResult> notifications;
  // The bytes its valid ops move, and how many have landed: an estimate
  // while pending (for progress), the bytes of the ops that succeeded once
  // ended. 0 and 0 from agents that do not report them.
  uint64_t bytes_total = 0;
  uint64_t bytes_done = 0;

  bool ended() const { return state != TransferState::kPending; }
  bool ok() const { return state == TransferState::kDone; }
};

// Called exactly once with a transfer's final result (or with why it will
// not be learnt). See Transfer::OnDone.
using TransferCallback =
    absl::AnyInvocable<void(absl::StatusOr<TransferResult>) &&>;
// Called for every transfer end a TransferWatch's stream delivers.
using TransferEndCallback = absl::AnyInvocable<void(const TransferResult&)>;

class Ring;

namespace internal {
class ClientState;
struct TransferCore;
class WatchStream;
class NotificationStream;
class NameStream;
}  // namespace internal

// The notification stream of AgentClient::WatchNotifications: one
// WatchNotifications RPC and one thread, which runs the callback. Movable;
// Stop() or destruction cancels the stream and joins the thread (after the
// callback in progress, if any, has returned).
class NotificationWatch {
 public:
  NotificationWatch(NotificationWatch&& other) noexcept;
  NotificationWatch& operator=(NotificationWatch&& other) noexcept;
  NotificationWatch(const NotificationWatch&) = delete;
  NotificationWatch& operator=(const NotificationWatch&) = delete;
  ~NotificationWatch();

  // Cancels the stream and waits for its thread. Idempotent.
  void Stop();
  // OK while streaming; then why the stream ended (CANCELLED after Stop,
  // UNAVAILABLE when the agent stopped, RESOURCE_EXHAUSTED when refused).
  absl::Status status() const;

 private:
  friend class AgentClient;
  explicit NotificationWatch(std::shared_ptr<internal::NotificationStream> s);
  std::shared_ptr<internal::NotificationStream> stream_;
};

// Called for each event of a NameWatch, on the watch's own thread:
// PUBLISHED (a name appeared or now stands for another buffer), WITHDRAWN
// (`record` is the name without its context), or SYNCED (no record: every
// name published when the watch started has been delivered before it).
using NameEventCallback = absl::AnyInvocable<void(const v1::NameEvent& event)>;

// The name stream of AgentClient::WatchNames: one WatchNames RPC and one
// thread, which runs the callback. Movable; Stop() or destruction cancels
// the stream and joins the thread (after the callback in progress, if any,
// has returned), so neither may happen on the watch's own callback. The
// stream ends by itself when the agent stops (an agent
// restart: watch again, and the new snapshot says what is published now),
// or when the reader falls too far behind.
class NameWatch {
 public:
  NameWatch(NameWatch&& other) noexcept;
  NameWatch& operator=(NameWatch&& other) noexcept;
  NameWatch(const NameWatch&) = delete;
  NameWatch& operator=(const NameWatch&) = delete;
  ~NameWatch();

  // Waits until the snapshot has been delivered (the SYNCED event's
  // callback has returned): OK, DEADLINE_EXCEEDED after `timeout`, or why
  // the stream ended first. Not from the watch's own callback (it would
  // wait out `timeout`).
  absl::Status WaitSynced(absl::Duration timeout);
  // Cancels the stream and waits for its thread. Idempotent; not from the
  // watch's own callback.
  void Stop();
  // OK while streaming; then why the stream ended (CANCELLED after Stop,
  // UNAVAILABLE when the agent stopped or its directory can no longer
  // follow, RESOURCE_EXHAUSTED when the reader fell behind or was refused).
  absl::Status status() const;

 private:
  friend class AgentClient;
  explicit NameWatch(std::shared_ptr<internal::NameStream> stream);
  std::shared_ptr<internal::NameStream> stream_;
};

// A handle on one asynchronous transfer (AgentClient::SubmitAsync). Movable,
// not copyable; every method may be called from any thread, concurrently.
//
// Destroying a handle does NOT cancel the transfer. The agent owns the
// transfer once SubmitAsync has returned, and it pins the registrations the
// ops use, so releasing or unmapping a Buffer while a transfer still runs
// does not make the agent touch freed memory; cancelling from a destructor
// would instead turn every early return and every `auto t = ...;` scope into
// a blocking RPC that waits for in-flight ops to drain, and would make
// fire-and-forget transfers (submit, hand the id elsewhere or rely on
// OnDone) impossible. Call Cancel() when you mean it. A callback set with
// OnDone still runs after the handle is gone.
//
// Once the client learns a transfer's end (from a TransferWatch, or from
// Wait, Poll or Cancel), it keeps it: later calls return it without asking
// the agent again, and every path agrees on it.
class Transfer {
 public:
  Transfer(Transfer&& other) noexcept;
  Transfer& operator=(Transfer&& other) noexcept;
  Transfer(const Transfer&) = delete;
  Transfer& operator=(const Transfer&) = delete;
  ~Transfer();

  // The agent's transfer id, scoped to this user on this agent.
  uint64_t id() const { return id_; }

  // The final result, once the transfer has ended; DEADLINE_EXCEEDED if it
  // has not ended within `timeout` (zero: look once). While a TransferWatch
  // of this client runs, waiting costs no RPC (the watch's stream delivers
  // the end); otherwise each Wait holds one GetTransfers long poll on the
  // agent, which holds no agent thread but one of the user's
  // --max_waiting_rpcs_per_user. An ended transfer is returned whatever its
  // state: check result.ok() (DONE) or its results. NOT_FOUND when the agent
  // does not know the id: never this user's, or its end was already read by
  // a GetTransfers of another client of this user (its Poll or Wait), or has
  // expired (--transfer_retention).
  absl::StatusOr<TransferResult> Wait(
      absl::Duration timeout = absl::InfiniteDuration());

  // The state now: the final result once the end is known, otherwise the
  // agent's answer (GetTransfers without waiting; PENDING with no results
  // while the transfer runs). Errors as Wait.
  absl::StatusOr<TransferResult> Poll();

  // Stops the transfer (CancelTransfer): ops not started never start, ops in
  // flight stop, and when Cancel returns no part of the transfer reads or
  // writes local memory any more. Returns the final result: kCancelled, or
  // the state a transfer that had already ended ended in.
  absl::StatusOr<TransferResult> Cancel();

  // Has `callback` called exactly once with the final result: on the
  // watch's callback thread when the watch delivers the end; on the caller's
  // thread, before OnDone returns, when the end is already known, or in
  // Wait, Poll or Cancel when they learn it first. If the watch stops before
  // the end arrives, the callback gets the reason instead, on the watch's
  // callback thread: CANCELLED (the TransferWatch was stopped or destroyed)
  // or the stream's error (UNAVAILABLE: the agent went away). Needs a
  // running TransferWatch on this client unless the end is already known:
  // FAILED_PRECONDITION otherwise, and then `callback` is never called;
  // FAILED_PRECONDITION too while another callback is pending on this
  // transfer. The callback runs even if the handle is gone by then.
  // Callbacks run one at a time, in the order the ends arrived; a slow one
  // delays the others (not the stream), and one may Wait for another
  // transfer.
  absl::Status OnDone(TransferCallback callback);

 private:
  friend class AgentClient;
  Transfer(std::shared_ptr<internal::ClientState> state,
           std::shared_ptr<internal::TransferCore> core);
  // The client's record of the transfer, or FAILED_PRECONDITION for a
  // moved-from handle.
  absl::Status CheckUsable() const;
  void Drop();

  std::shared_ptr<internal::ClientState> state_;
  std::shared_ptr<internal::TransferCore> core_;
  uint64_t id_ = 0;
};

// The completion stream of one AgentClient (AgentClient::WatchTransfers):
// one WatchTransfers stream and two threads, however many transfers are in
// flight. The reader ("rdma-xfer-watch") reads the stream and records each
// end, which wakes Wait at once; the callback thread ("rdma-xfer-cb") runs
// OnDone callbacks and `on_end`, one at a time, in the order the ends came.
// No user code runs on the reader, so callbacks may block or Wait for other
// transfers without stalling the stream. Movable, not copyable. Destroying it
// (or Stop) cancels the stream and joins both threads; by then every OnDone
// callback it still held has run (with CANCELLED).
//
// The agent's stream carries every end of this user's transfers on the
// agent, not only this client's (ends of other ids go to `on_end` only).
// It takes nothing from anyone: every watching client of the user gets
// every end, and an end a watch delivered stays readable by Wait and Poll
// of other clients until one of them reads it.
class TransferWatch {
 public:
  TransferWatch(TransferWatch&& other) noexcept;
  TransferWatch& operator=(TransferWatch&& other) noexcept;
  TransferWatch(const TransferWatch&) = delete;
  TransferWatch& operator=(const TransferWatch&) = delete;
  ~TransferWatch();

  // OK while the stream is open; why it ended otherwise (CANCELLED after
  // Stop, UNAVAILABLE when the agent went away, the agent's refusal, such as
  // RESOURCE_EXHAUSTED). Once ended, Transfer::Wait falls back to asking the
  // agent, and the client may start a new watch.
  absl::Status status() const;

  // Cancels the stream and waits for both threads to end. From one of its
  // own callbacks it returns once the stream is closed; the callbacks still
  // queued (the CANCELLED ones included) run after the current one returns.
  // Idempotent; the watch may also be destroyed from its own callback.
  void Stop();

 private:
  friend class AgentClient;
  explicit TransferWatch(std::shared_ptr<internal::WatchStream> stream);

  std::shared_ptr<internal::WatchStream> stream_;
};

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

  // Publishes this buffer under `name` (AgentClient::Publish) and keeps the
  // name, for names() and Rejoin.
  absl::Status Publish(const std::string& name,
                       v1::Visibility visibility = v1::VISIBILITY_OWNER);
  // Withdraws one of the names this Buffer published.
  absl::Status Unpublish(const std::string& name);
  // The names this Buffer published and has not withdrawn, with their
  // visibility (a name another Publish moved elsewhere stays listed).
  const std::map<std::string, v1::Visibility>& names() const { return names_; }

  // After the agent restarted (a new epoch, which took this registration and
  // its names with the old life), registers the same memory again and
  // publishes names() again. true: id(), remote_context() and backends()
  // are the new registration's, data() is the same memory, and a peer's
  // next Resolve finds it; false: the agent has not restarted, nothing
  // changed. Only a Buffer of this process's memory (Attach) that lives
  // with the process or the connection can; others: FAILED_PRECONDITION.
  // A name someone else took meanwhile: ALREADY_EXISTS (the registration
  // is done all the same; the name is dropped from names()). The library
  // does not call it by itself: call it when the agent went away (a
  // NameWatch or TransferWatch ended UNAVAILABLE, an op answered
  // FAILED_PRECONDITION). Not concurrently with other calls on this Buffer.
  absl::StatusOr<bool> Rejoin();

 private:
  friend class AgentClient;
  // What Rejoin registers again with (set for Attach's buffers).
  struct RejoinSpec {
    v1::Access access = v1::ACCESS_UNSPECIFIED;
    std::string label;
  };
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
  std::optional<RejoinSpec> rejoin_;
  std::map<std::string, v1::Visibility> names_;
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

  // Every agent the agent's directory knows (--directory), this one
  // included, ordered by id.
  absl::StatusOr<v1::ListAgentsResponse> ListAgents();

  // Publishes one of the caller's buffers under `name` in the agent's
  // directory: anyone who resolves the name gets its remote context.
  // By default only this user (on any agent) finds it; VISIBILITY_ANY_USER
  // shares the buffer with every user of the directory.
  absl::Status Publish(uint64_t buffer_id, const std::string& name,
                       v1::Visibility visibility = v1::VISIBILITY_OWNER);
  // Withdraws one of the caller's names.
  absl::Status Unpublish(const std::string& name);
  // The record (remote context, owner agent and epoch) `name` stands for.
  absl::StatusOr<v1::NameRecord> Resolve(const std::string& name);
  // Streams the names starting with `prefix` (empty: every name) this user
  // may see to `on_event`, called on the watch's own thread in order: every
  // name published now, SYNCED, then each change as it happens (a waiting
  // peer learns of a name the moment it is published). Each open watch
  // holds one of the user's --max_name_watches_per_user and
  // --max_waiting_rpcs_per_user; a refused watch ends at once
  // (NameWatch::status(), WaitSynced).
  absl::StatusOr<NameWatch> WatchNames(const std::string& prefix,
                                       NameEventCallback on_event);

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

  // Hands device memory to the agent (the dma-buf on the attach socket,
  // then Register{attach_token}). Only NIC backends register it: the result
  // lists them, and the agent answers FAILED_PRECONDITION when it has none.
  // Nothing is mapped here (device memory is the application's to reach);
  // Release(id) ends the registration, and by default so does the end of
  // this process (`lifetime` as for Allocate).
  absl::StatusOr<Registration> RegisterDeviceMemory(
      const DeviceMemorySpec& memory, v1::Access access,
      const std::string& label = "",
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
  // The same with a notification for the targets' owners.
  absl::StatusOr<SubmitResult> Submit(const std::vector<OpSpec>& ops,
                                      const SubmitOptions& options);

  // Starts `ops` as one asynchronous transfer and returns its handle as soon
  // as the agent has accepted it (SubmitAsync). A bad batch or timeout is
  // the returned status, with Submit's codes; a bad op is reported in the
  // transfer's results. RESOURCE_EXHAUSTED when this user has
  // --max_transfers_in_flight_per_user transfers queued or running.
  // `timeout` bounds the transfer on the agent from now, time queued
  // included; zero or infinite leaves it to --default_submit_timeout.
  absl::StatusOr<Transfer> SubmitAsync(const std::vector<OpSpec>& ops,
                                       absl::Duration timeout);
  // The same with a notification (TransferResult::notifications says what
  // became of it).
  absl::StatusOr<Transfer> SubmitAsync(const std::vector<OpSpec>& ops,
                                       const SubmitOptions& options);

  // Takes up to `max_count` (0: the agent's most, 1024) of this user's
  // queued notifications, waiting up to `wait` for the first one (cut to
  // the agent's --max_transfer_wait). While a NotificationWatch of this
  // user is open, notifications go to it instead.
  absl::StatusOr<NotificationBatch> GetNotifications(
      absl::Duration wait = absl::ZeroDuration(), uint32_t max_count = 0);

  // Streams this user's notifications to `on_notification`, called on the
  // watch's own thread, in arrival order, until the watch is stopped or
  // destroyed (first those queued). Every open watch of the user gets every
  // notification. Each open watch holds one of the user's
  // --max_rpcs_per_user.
  absl::StatusOr<NotificationWatch> WatchNotifications(
      NotificationCallback on_notification);

  // A handle on transfer `transfer_id` of this user submitted elsewhere (an
  // earlier process, rdma-agentctl submit --async); no RPC: an id the agent
  // does not know shows as NOT_FOUND from Wait, Poll and Cancel. Handles on
  // one id share what the client learns about it.
  Transfer TransferById(uint64_t transfer_id);

  // Opens this client's completion stream (see TransferWatch): from now on,
  // ends the agent pushes resolve this client's Transfer handles (Wait
  // returns without an RPC, OnDone callbacks run) and, if given, `on_end`
  // is called for every end the stream delivers: this user's transfers,
  // whoever submitted them, after the handle's own OnDone callback; first
  // the ends the agent still keeps (not yet read by a GetTransfers: a Poll,
  // or a Wait while no watch ran). Returns at once; if the agent refuses the
  // stream (e.g. RESOURCE_EXHAUSTED: each open stream holds one of the
  // user's --max_waiting_rpcs_per_user), the watch ends soon with the reason
  // (TransferWatch::status()). One watch per client at a time:
  // FAILED_PRECONDITION while another one runs; other clients of the same
  // user may watch too.
  //
  // For thousands of transfers in flight: one watch and OnDone on each
  // handle (or `on_end` and a table of your own); no thread per transfer.
  absl::StatusOr<TransferWatch> WatchTransfers(
      TransferEndCallback on_end = nullptr);

  // Drops registration `buffer_id`.
  absl::Status Release(uint64_t buffer_id);

  // Imports a remote context once (ImportRemote): ops then name
  // RemoteHandle::handle in OpSpec::remote_handle instead of carrying the
  // context. INVALID_ARGUMENT for a malformed context, UNAVAILABLE when no
  // backend of the agent reaches it, RESOURCE_EXHAUSTED past the user's
  // --max_remote_handles_per_user or --max_remote_handle_bytes_per_user.
  absl::StatusOr<RemoteHandle> ImportRemote(const std::string& remote_context);
  // Drops a handle on the agent; NOT_FOUND when it is not this user's.
  absl::Status ReleaseRemote(uint64_t handle);
  // This user's handles.
  absl::StatusOr<std::vector<RemoteHandle>> ListRemotes();

  // Validates `ops` once and keeps them on the agent (PrepareTransfer);
  // SubmitPrepared and SubmitPreparedAsync run them again by the returned
  // id without sending them. A bad op fails the call with its code and
  // "op N:"; `notification` is sent at every run, as SubmitOptions's.
  absl::StatusOr<uint64_t> PrepareTransfer(
      const std::vector<OpSpec>& ops, const std::string& notification = "");
  // Runs prepared transfer `prepared_id` as Submit would run its ops
  // (options.notification must be empty: the prepared one is sent).
  absl::StatusOr<SubmitResult> SubmitPrepared(
      uint64_t prepared_id, const SubmitOptions& options = {});
  // The same as an asynchronous transfer.
  absl::StatusOr<Transfer> SubmitPreparedAsync(
      uint64_t prepared_id, const SubmitOptions& options = {});
  // Drops a prepared transfer on the agent (runs in flight finish);
  // NOT_FOUND when it is not this user's.
  absl::Status ReleasePrepared(uint64_t prepared_id);

  // Opens a shared-memory ring session (client/ring.h, docs/RING.md) of
  // `entries` slots on this client's attach socket.
  absl::StatusOr<std::unique_ptr<Ring>> OpenRing(uint32_t entries);

  // This user's registrations; with `all_users`, every user's (root only:
  // PERMISSION_DENIED for others).
  absl::StatusOr<std::vector<v1::BufferInfo>> ListBuffers(
      bool all_users = false);

  // This user's open ring sessions (every process's); with `all_users`,
  // every user's (root only: PERMISSION_DENIED for others).
  absl::StatusOr<std::vector<v1::RingSession>> ListRingSessions(
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
  // Sends a Submit or SubmitAsync request; `ops` (how many results to
  // expect) is 0 when the client does not know (a prepared transfer).
  absl::StatusOr<SubmitResult> SendSubmit(const v1::SubmitRequest& request,
                                          absl::Duration timeout, size_t ops);
  absl::StatusOr<Transfer> SendSubmitAsync(const v1::SubmitRequest& request);
  absl::StatusOr<v1::RegisterResponse> Register(
      const v1::RegisterRequest& request);
  // Hands `fd` over on `attach_socket` with `attach` (memfd or dma-buf),
  // then registers the attach token it is answered.
  absl::StatusOr<v1::RegisterResponse> RegisterAttached(
      const std::string& attach_socket, const v1::AttachRequest& attach, int fd,
      v1::Access access, const std::string& label, v1::Lifetime lifetime);

  std::shared_ptr<internal::ClientState> state_;
};

}  // namespace rdma_agent::client

#endif  // RDMA_AGENTD_CLIENT_RDMA_AGENT_CLIENT_H_

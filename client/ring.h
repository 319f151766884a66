#ifndef RDMA_AGENTD_CLIENT_RING_H_
#define RDMA_AGENTD_CLIENT_RING_H_

// A shared-memory ring session with the local agent (docs/RING.md): ops are
// posted by writing entries into memory both processes map, and their ends
// are read back the same way, without a gRPC call or a syscall while the
// agent is awake. Ops name a registered local buffer by id and the remote
// side by an imported handle (AgentClient::ImportRemote).
//
// Not thread-safe: one Ring is used by one thread at a time (open one per
// thread). The session ends when the Ring is destroyed.

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/ring_protocol.h"
#include "common/shared_memory.h"
#include "common/unique_fd.h"
#include "rdma/agent/v1/types.pb.h"

namespace rdma_agent::client {

// One op of a ring batch.
struct RingOp {
  ::rdma::agent::v1::OpType type = ::rdma::agent::v1::OP_TYPE_UNSPECIFIED;
  uint64_t local_buffer_id = 0;
  uint64_t local_offset = 0;
  uint64_t length = 0;
  uint64_t remote_handle = 0;  // from AgentClient::ImportRemote
  uint64_t remote_offset = 0;
  uint64_t user_tag = 0;  // returned in its completion
};

// The end of one op.
struct RingCompletion {
  uint64_t user_tag = 0;
  absl::Status status;  // the agent's code and message ("op N: ...")
  std::string backend;  // that ran it; empty if none did
};

class Ring {
 public:
  // Opens a session of `entries` slots (a power of two, at most the agent's
  // --max_ring_entries) on the attach socket at `attach_socket`.
  static absl::StatusOr<std::unique_ptr<Ring>> Open(
      const std::string& attach_socket, uint32_t entries,
      absl::Duration timeout = absl::Seconds(30));
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;
  ~Ring() = default;

  // Posts `ops` as one batch (run together, like one Submit; `timeout`
  // bounds it, zero: the agent's default) and wakes the agent if it
  // sleeps. A non-empty `notification` goes to the owners of the remote
  // buffers once the batch's bytes have landed, as Submit's (its bytes are
  // written to the ring's payload area). RESOURCE_EXHAUSTED, posting
  // nothing, when the ring lacks free slots for all of them (reap
  // completions first) or payload room for the notification (the agent
  // has not taken earlier ones yet); FAILED_PRECONDITION or UNAVAILABLE
  // once the session has ended (see status()).
  absl::Status Submit(absl::Span<const RingOp> ops,
                      absl::Duration timeout = absl::ZeroDuration(),
                      absl::string_view notification = {});

  // Runs prepared transfer `prepared_id` (AgentClient::PrepareTransfer) as
  // one entry: one completion tagged `user_tag`, OK when every op
  // succeeded, else the first failed op's. A non-empty `notification`
  // replaces the prepared one for this run. Errors as Submit.
  absl::Status RunPrepared(uint64_t prepared_id, uint64_t user_tag,
                           absl::Duration timeout = absl::ZeroDuration(),
                           absl::string_view notification = {});

  // Cancels the batch taken by the agent and not yet completed that holds
  // an op tagged `tag`: its ops that have not ended end CANCELLED. Its own
  // completion, tagged `user_tag`, is OK when such a batch was found,
  // NOT_FOUND otherwise. Errors as Submit.
  absl::Status Cancel(uint64_t tag, uint64_t user_tag);

  // Appends the completions ready now to `out` (at most `max`); returns how
  // many. Errors as Submit, once every completion posted before the end
  // has been read.
  absl::StatusOr<size_t> Poll(std::vector<RingCompletion>* out,
                              size_t max = SIZE_MAX);

  // Like Poll, but waits for at least one completion: spins for `spin`,
  // then blocks on the session's connection. DEADLINE_EXCEEDED when none
  // came within `timeout`.
  absl::StatusOr<size_t> Wait(std::vector<RingCompletion>* out,
                              absl::Duration timeout,
                              absl::Duration spin = absl::Microseconds(20));

  // Ops posted and not yet reaped.
  uint32_t in_flight() const { return sq_tail_ - cq_head_; }
  uint32_t entries() const { return geometry_.entries; }

  // OK while the session runs; FAILED_PRECONDITION with the agent's reason
  // when it stopped the session, UNAVAILABLE when the agent went away.
  absl::Status status() const { return ended_; }

 private:
  Ring(UniqueFd connection, SharedMemory memory, ring::Geometry geometry);
  std::atomic<uint32_t>& Word(size_t offset) {
    return ring::Word(memory_.data(), offset);
  }
  // Reads every completion published; records the end of the session.
  size_t Reap(std::vector<RingCompletion>* out, size_t max);
  // Checks whether the agent ended the session (STOPPED, or the connection
  // closed), and records why.
  void CheckEnded();
  // Writes one doorbell byte.
  void Doorbell();
  // Room for `count` entries, or why not.
  absl::Status CheckRoom(size_t count);
  // Writes `notification` into the payload area for the entry that will
  // have index `index`: its offset and length as the entry's field.
  absl::StatusOr<uint64_t> PlacePayload(uint32_t index,
                                        absl::string_view notification);
  // Writes `entries` at the tail, publishes them and wakes the agent if it
  // sleeps.
  void Post(absl::Span<const ring::Submission> entries);

  UniqueFd connection_;
  SharedMemory memory_;
  const ring::Geometry geometry_;
  uint32_t sq_tail_ = 0;
  uint32_t cq_head_ = 0;
  absl::Status ended_;
  // Payloads the agent has not taken yet: the index of their entry and
  // where they end in the payload area (placed one after another).
  struct Payload {
    uint32_t index;
    uint64_t end;
  };
  std::deque<Payload> payloads_;
  std::vector<ring::Submission> entries_;  // reused by Submit
};

}  // namespace rdma_agent::client

#endif  // RDMA_AGENTD_CLIENT_RING_H_

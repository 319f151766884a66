#ifndef RDMA_AGENTD_COMMON_RING_PROTOCOL_H_
#define RDMA_AGENTD_COMMON_RING_PROTOCOL_H_

// The shared-memory ring of a local client and its agent: the layout of the
// memfd both map, and the decoding of what each side reads from the other.
// docs/RING.md is the contract; this header is its code, shared by the agent
// (daemon/ops/ring_session) and the C++ client (client/ring).
//
// Everything in the mapping may be written by the other side at any moment.
// Readers copy what they read once (an entry, an index) and judge the copy;
// the geometry of a ring (entries, offsets) is never read back from the
// mapping by the agent, which keeps its own.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rdma_agent::ring {

inline constexpr uint32_t kMagic = 0x474e4952;  // "RING", little-endian
inline constexpr uint32_t kVersion = 2;

// Sizes, in bytes.
inline constexpr uint32_t kHeaderBytes = 512;
inline constexpr uint32_t kSubmissionBytes = 64;
inline constexpr uint32_t kCompletionBytes = 32;
inline constexpr uint32_t kMessageBytes = 256;  // one per completion slot
inline constexpr uint32_t kPayloadBytes = 256;  // payload area, per entry
inline constexpr uint32_t kStopReasonBytes = 64;

// Header offsets. Each index has a 64-byte cache line of its own.
inline constexpr size_t kMagicOffset = 0;
inline constexpr size_t kVersionOffset = 4;
inline constexpr size_t kEntriesOffset = 8;  // submission and completion
inline constexpr size_t kSubmissionsOffsetOffset = 16;
inline constexpr size_t kCompletionsOffsetOffset = 24;
inline constexpr size_t kMessagesOffsetOffset = 32;
inline constexpr size_t kTotalBytesOffset = 40;
inline constexpr size_t kPayloadsOffsetOffset = 48;
inline constexpr size_t kSqTailOffset = 64;        // client writes
inline constexpr size_t kSqHeadOffset = 128;       // agent writes
inline constexpr size_t kCqTailOffset = 192;       // agent writes
inline constexpr size_t kCqHeadOffset = 256;       // client writes
inline constexpr size_t kAgentFlagsOffset = 320;   // agent writes
inline constexpr size_t kClientFlagsOffset = 384;  // client writes
inline constexpr size_t kStopReasonOffset = 448;   // agent writes
static_assert(kStopReasonOffset + kStopReasonBytes <= kHeaderBytes,
              "the stop reason stays inside the header");

// agent_flags bits.
inline constexpr uint32_t kAgentNeedsWakeup = 1u << 0;
inline constexpr uint32_t kAgentStopped = 1u << 1;
// client_flags bits.
inline constexpr uint32_t kClientWaiting = 1u << 0;

// Submission entry flags.
inline constexpr uint8_t kEndOfBatch = 1u << 0;
// The batch carries a notification whose bytes are in the payload area
// (Submission::notification); only on an END_OF_BATCH entry of opcode 1-3.
inline constexpr uint8_t kNotify = 1u << 1;
inline constexpr uint8_t kKnownSubmissionFlags = kEndOfBatch | kNotify;

// Opcodes: 1 and 2 are the values of rdma.agent.v1.OpType.
inline constexpr uint8_t kOpReadIntoLocal = 1;
inline constexpr uint8_t kOpWriteFromLocal = 2;
// Runs the prepared transfer whose id is in `remote_handle`: one entry, a
// batch of its own, one completion for all of its ops.
inline constexpr uint8_t kOpRunPrepared = 3;
// Cancels the running batch holding the entry whose tag is in
// `remote_handle`; a batch of its own.
inline constexpr uint8_t kOpCancel = 4;

// Bounds of a ring's entry count (a power of two).
inline constexpr uint32_t kMinEntries = 1;
inline constexpr uint32_t kMaxEntries = 1u << 16;

// Where everything of a ring with `entries` slots is.
struct Geometry {
  uint32_t entries = 0;
  uint64_t submissions_offset = 0;
  uint64_t completions_offset = 0;
  uint64_t messages_offset = 0;
  uint64_t payloads_offset = 0;
  uint64_t total_bytes = 0;

  uint32_t mask() const { return entries - 1; }
  uint64_t payload_area_bytes() const {
    return uint64_t{entries} * kPayloadBytes;
  }
};

// The geometry of a ring of `entries` slots; INVALID_ARGUMENT unless
// `entries` is a power of two within [kMinEntries, kMaxEntries].
absl::StatusOr<Geometry> GeometryFor(uint32_t entries);

// Writes the header of a new ring (the mapping is zero-filled).
void WriteHeader(std::byte* base, const Geometry& geometry);

// The geometry a header claims, checked against the mapping's `size`
// (what a client reads from the agent's ring before trusting it).
absl::StatusOr<Geometry> ReadHeader(const std::byte* base, uint64_t size);

// One op as a client posts it: 64 bytes, docs/RING.md.
struct Submission {
  uint8_t opcode = 0;
  uint8_t flags = 0;
  uint16_t reserved0 = 0;
  uint32_t timeout_ms = 0;  // the batch's, from its last entry; 0: default
  uint64_t user_tag = 0;
  uint64_t local_buffer_id = 0;
  uint64_t local_offset = 0;
  uint64_t length = 0;
  uint64_t remote_handle = 0;
  uint64_t remote_offset = 0;
  // With kNotify: the payload's offset in the payload area (low 32 bits)
  // and its length (high 32 bits). Without it: 0.
  uint64_t notification = 0;

  bool end_of_batch() const { return (flags & kEndOfBatch) != 0; }
  bool notify() const { return (flags & kNotify) != 0; }
  uint32_t payload_offset() const {
    return static_cast<uint32_t>(notification);
  }
  uint32_t payload_length() const {
    return static_cast<uint32_t>(notification >> 32);
  }
};
static_assert(sizeof(Submission) == kSubmissionBytes);

// One op's end as the agent posts it: 32 bytes.
struct Completion {
  uint64_t user_tag = 0;
  int32_t code = 0;            // gRPC status code number
  uint16_t backend = 0;        // kBackend* below
  uint16_t message_bytes = 0;  // in this slot's message, at most 255
  uint64_t reserved0 = 0;
  uint64_t reserved1 = 0;
};
static_assert(sizeof(Completion) == kCompletionBytes);

// Completion::backend.
inline constexpr uint16_t kBackendNone = 0;
inline constexpr uint16_t kBackendMemory = 1;
inline constexpr uint16_t kBackendTcp = 2;
inline constexpr uint16_t kBackendIbverbs = 3;
inline constexpr uint16_t kBackendOther = 0xffff;
uint16_t BackendCode(const std::string& name);
const char* BackendName(uint16_t code);

// Copies submission slot `index` (masked) out of the ring once; the copy is
// what is judged and used.
Submission CopySubmission(const std::byte* base, const Geometry& geometry,
                          uint32_t index);

// Why a copied submission cannot run on its own (INVALID_ARGUMENT naming
// the field): unknown opcode or flags, reserved fields not zero, the fields
// its opcode uses out of their ranges or those it does not use not zero,
// NOTIFY without END_OF_BATCH or with a payload outside the payload area
// of `geometry`, empty or longer than `max_notification_bytes`. OK when it
// may be handed to the op checks. (Whether RUN_PREPARED and CANCEL are
// alone in their batch is TakeBatch's to judge.)
absl::Status CheckSubmission(const Submission& entry, const Geometry& geometry,
                             uint64_t max_notification_bytes);

// How many submissions the agent may take: tail - head, which a client that
// lies about its tail can make anything. FAILED_PRECONDITION, naming both,
// when it is more than the ring holds.
absl::StatusOr<uint32_t> PendingSubmissions(uint32_t head, uint32_t tail,
                                            uint32_t entries);
// How many completion slots are free: entries - (tail - head), with `head`
// the client's claim. FAILED_PRECONDITION when the claim is impossible
// (ahead of the tail, or further behind than the ring holds).
absl::StatusOr<uint32_t> FreeCompletions(uint32_t head, uint32_t tail,
                                         uint32_t entries);

// The next batch of a ring, as the agent takes it: each entry copied out
// once, with the verdict of CheckSubmission on that copy, and the
// notification's payload copied out of the payload area once.
struct Batch {
  std::vector<Submission> entries;
  std::vector<absl::Status> checks;  // one per entry
  // The payload of the last entry's valid NOTIFY; empty without one.
  std::string notification;
};
// Copies the next batch out of the ring whose client published `tail`
// (its claim) while the agent's head is `head`: the entries up to and
// including the first with END_OF_BATCH, or `geometry.entries` of them
// without one. Takes nothing (returns 0) when that batch is not all
// published yet, or when it needs more than `free_completions` slots (each
// entry gets one completion: ops that cannot report never start).
// Entries are judged with CheckSubmission and `max_notification_bytes`; a
// RUN_PREPARED or CANCEL entry that is not a batch of its own fails
// INVALID_ARGUMENT. FAILED_PRECONDITION when the tail is impossible
// (PendingSubmissions). Returns how many entries it took into `batch`
// (cleared first; its vectors keep their capacity).
absl::StatusOr<uint32_t> TakeBatch(const std::byte* base,
                                   const Geometry& geometry, uint32_t head,
                                   uint32_t tail, uint32_t free_completions,
                                   uint64_t max_notification_bytes,
                                   Batch* batch);

// Writes completion slot `index` (masked) and its message (cut at 255 bytes).
void WriteCompletion(std::byte* base, const Geometry& geometry, uint32_t index,
                     const Completion& completion, const std::string& message);
// Reads completion slot `index` (masked) and its message (what the client
// does; a message length beyond the slot is cut).
Completion ReadCompletion(const std::byte* base, const Geometry& geometry,
                          uint32_t index, std::string* message);

// The header's 32-bit words shared by both sides, as atomics.
inline std::atomic<uint32_t>& Word(std::byte* base, size_t offset) {
  return *reinterpret_cast<std::atomic<uint32_t>*>(base + offset);
}

}  // namespace rdma_agent::ring

#endif  // RDMA_AGENTD_COMMON_RING_PROTOCOL_H_

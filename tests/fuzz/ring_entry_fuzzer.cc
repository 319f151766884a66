// Fuzz target: a shared-memory ring as a hostile client may leave it
// (common/ring_protocol.h, docs/RING.md): the submission slots, the tail it
// claims, and the completion head it claims, read by the agent's TakeBatch,
// PendingSubmissions, FreeCompletions and CheckSubmission (protocol
// version 2: RUN_PREPARED, CANCEL, NOTIFY with its payload).
//
// Input: u32 entries exponent (mod 5: 1 to 16 slots), u32 head, u32 tail,
// u32 completion head, u32 completion tail, u32 largest notification
// (mod 1024), then the submission slots' bytes and the payload area's
// (zero padded). The ring is a heap copy of exactly its size, so that ASan
// sees any read outside it (the payload area is its last part).
//
// Oracle: no crash or out-of-bounds read; an impossible tail or completion
// head is FAILED_PRECONDITION and nothing is taken; what is taken is a
// whole batch (its last entry ends it, or it fills the ring), within what
// was published and what the completion ring can hold; every entry taken
// passed its checks exactly when its fields are valid (RUN_PREPARED and
// CANCEL alone in their batch), a valid NOTIFY's payload is copied exactly,
// and everything taken is a copy: scribbling over the ring afterwards
// changes nothing taken.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/ring_protocol.h"
#include "tests/fuzz/fuzz_check.h"

namespace rdma_agent::ring {
namespace {

uint32_t Word(const uint8_t* data, size_t size, size_t index) {
  uint32_t value = 0;
  if (size >= (index + 1) * 4) std::memcpy(&value, data + index * 4, 4);
  return value;
}

// docs/RING.md's rules, written out again independently of the decoder.
bool ValidNotification(const Submission& entry, uint64_t area,
                       uint64_t max_bytes) {
  if ((entry.flags & kNotify) == 0) return entry.notification == 0;
  const uint64_t offset = entry.notification & 0xffffffffu;
  const uint64_t length = entry.notification >> 32;
  return (entry.flags & kEndOfBatch) != 0 && entry.opcode != kOpCancel &&
         length > 0 && length <= max_bytes && offset + length <= area;
}

bool Valid(const Submission& entry, uint32_t batch_size, uint64_t area,
           uint64_t max_bytes) {
  if (entry.opcode < 1 || entry.opcode > 4 || (entry.flags & ~3u) != 0 ||
      entry.reserved0 != 0 || !ValidNotification(entry, area, max_bytes)) {
    return false;
  }
  if (entry.opcode == kOpRunPrepared || entry.opcode == kOpCancel) {
    return entry.local_buffer_id == 0 && entry.local_offset == 0 &&
           entry.length == 0 && entry.remote_offset == 0 &&
           (entry.opcode == kOpCancel || entry.remote_handle != 0) &&
           batch_size == 1 && (entry.flags & kEndOfBatch) != 0;
  }
  return entry.length > 0 && entry.remote_handle != 0;
}

void FuzzRing(const uint8_t* data, size_t size) {
  const uint32_t entries = 1u << (Word(data, size, 0) % 5);
  const uint32_t head = Word(data, size, 1);
  const uint32_t tail = Word(data, size, 2);
  const uint32_t cq_head = Word(data, size, 3);
  const uint32_t cq_tail = Word(data, size, 4);
  const uint64_t max_notification = Word(data, size, 5) % 1024;
  auto geometry = GeometryFor(entries);
  FUZZ_CHECK(geometry.ok());
  std::vector<std::byte> ring(geometry->total_bytes);
  WriteHeader(ring.data(), *geometry);
  const size_t header_words = 6 * 4;
  const size_t slots = static_cast<size_t>(entries) * kSubmissionBytes;
  if (size > header_words) {
    const size_t n = size - header_words < slots ? size - header_words : slots;
    std::memcpy(ring.data() + geometry->submissions_offset, data + header_words,
                n);
  }
  const uint64_t area = geometry->payload_area_bytes();
  if (size > header_words + slots) {
    const size_t rest = size - header_words - slots;
    std::memcpy(ring.data() + geometry->payloads_offset,
                data + header_words + slots, rest < area ? rest : area);
  }

  auto free = FreeCompletions(cq_head, cq_tail, entries);
  if (!free.ok()) {
    FUZZ_CHECK(free.status().code() == absl::StatusCode::kFailedPrecondition);
    FUZZ_CHECK(cq_tail - cq_head > entries);
    return;
  }
  FUZZ_CHECK(*free <= entries);
  Batch batch;
  auto taken = TakeBatch(ring.data(), *geometry, head, tail, *free,
                         max_notification, &batch);
  if (!taken.ok()) {
    FUZZ_CHECK(taken.status().code() == absl::StatusCode::kFailedPrecondition);
    FUZZ_CHECK(tail - head > entries);
    FUZZ_CHECK(batch.entries.empty());
    return;
  }
  FUZZ_CHECK(tail - head <= entries);
  FUZZ_CHECK(*taken <= tail - head);
  FUZZ_CHECK(*taken <= *free);
  FUZZ_CHECK(batch.entries.size() == *taken);
  if (*taken == 0) {
    FUZZ_CHECK(batch.checks.empty());
    FUZZ_CHECK(batch.notification.empty());
    return;
  }
  FUZZ_CHECK(batch.checks.size() == *taken);
  FUZZ_CHECK(batch.entries.back().end_of_batch() || *taken == entries);
  for (uint32_t i = 0; i + 1 < *taken; ++i) {
    // Only the last entry of a batch ends it.
    FUZZ_CHECK(!batch.entries[i].end_of_batch());
  }
  std::vector<Submission> before = batch.entries;
  for (uint32_t i = 0; i < *taken; ++i) {
    FUZZ_CHECK(batch.checks[i].ok() ==
               Valid(batch.entries[i], *taken, area, max_notification));
    FUZZ_CHECK(batch.checks[i].ok() ||
               batch.checks[i].code() == absl::StatusCode::kInvalidArgument);
    FUZZ_CHECK(
        std::memcmp(&batch.entries[i],
                    ring.data() + geometry->submissions_offset +
                        ((head + i) & geometry->mask()) * kSubmissionBytes,
                    kSubmissionBytes) == 0);
  }
  // The payload of a valid NOTIFY, copied exactly; nothing otherwise.
  const Submission& last = batch.entries.back();
  if (batch.checks.back().ok() && (last.flags & kNotify) != 0) {
    const uint64_t offset = last.notification & 0xffffffffu;
    FUZZ_CHECK(batch.notification.size() == last.notification >> 32);
    FUZZ_CHECK(std::memcmp(batch.notification.data(),
                           ring.data() + geometry->payloads_offset + offset,
                           batch.notification.size()) == 0);
  } else {
    FUZZ_CHECK(batch.notification.empty());
  }
  const std::string payload = batch.notification;
  // The client scribbles: the copies taken do not change.
  std::memset(ring.data() + geometry->submissions_offset, 0xa5,
              static_cast<size_t>(entries) * kSubmissionBytes);
  std::memset(ring.data() + geometry->payloads_offset, 0x5a, area);
  FUZZ_CHECK(std::memcmp(before.data(), batch.entries.data(),
                         before.size() * sizeof(Submission)) == 0);
  FUZZ_CHECK(batch.notification == payload);
}

}  // namespace
}  // namespace rdma_agent::ring

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  rdma_agent::ring::FuzzRing(data, size);
  return 0;
}

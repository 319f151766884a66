#include "common/ring_protocol.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace rdma_agent::ring {
namespace {

template <typename T>
void Store(std::byte* base, size_t offset, T value) {
  std::memcpy(base + offset, &value, sizeof(value));
}

template <typename T>
T Load(const std::byte* base, size_t offset) {
  T value;
  std::memcpy(&value, base + offset, sizeof(value));
  return value;
}

}  // namespace

absl::StatusOr<Geometry> GeometryFor(uint32_t entries) {
  if (entries < kMinEntries || entries > kMaxEntries ||
      (entries & (entries - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ring entries must be a power of two from ", kMinEntries,
                     " to ", kMaxEntries, "; got ", entries));
  }
  Geometry geometry;
  geometry.entries = entries;
  geometry.submissions_offset = kHeaderBytes;
  geometry.completions_offset =
      geometry.submissions_offset + uint64_t{entries} * kSubmissionBytes;
  geometry.messages_offset =
      geometry.completions_offset + uint64_t{entries} * kCompletionBytes;
  geometry.payloads_offset =
      geometry.messages_offset + uint64_t{entries} * kMessageBytes;
  geometry.total_bytes =
      geometry.payloads_offset + uint64_t{entries} * kPayloadBytes;
  return geometry;
}

void WriteHeader(std::byte* base, const Geometry& geometry) {
  Store<uint32_t>(base, kMagicOffset, kMagic);
  Store<uint32_t>(base, kVersionOffset, kVersion);
  Store<uint32_t>(base, kEntriesOffset, geometry.entries);
  Store<uint64_t>(base, kSubmissionsOffsetOffset, geometry.submissions_offset);
  Store<uint64_t>(base, kCompletionsOffsetOffset, geometry.completions_offset);
  Store<uint64_t>(base, kMessagesOffsetOffset, geometry.messages_offset);
  Store<uint64_t>(base, kTotalBytesOffset, geometry.total_bytes);
  Store<uint64_t>(base, kPayloadsOffsetOffset, geometry.payloads_offset);
}

absl::StatusOr<Geometry> ReadHeader(const std::byte* base, uint64_t size) {
  if (size < kHeaderBytes) {
    return absl::InvalidArgumentError("the ring is smaller than its header");
  }
  if (Load<uint32_t>(base, kMagicOffset) != kMagic) {
    return absl::InvalidArgumentError("the ring's magic is wrong");
  }
  if (const uint32_t version = Load<uint32_t>(base, kVersionOffset);
      version != kVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "ring version ", version, "; this client speaks ", kVersion));
  }
  auto geometry = GeometryFor(Load<uint32_t>(base, kEntriesOffset));
  if (!geometry.ok()) return geometry.status();
  if (Load<uint64_t>(base, kSubmissionsOffsetOffset) !=
          geometry->submissions_offset ||
      Load<uint64_t>(base, kCompletionsOffsetOffset) !=
          geometry->completions_offset ||
      Load<uint64_t>(base, kMessagesOffsetOffset) !=
          geometry->messages_offset ||
      Load<uint64_t>(base, kTotalBytesOffset) != geometry->total_bytes ||
      Load<uint64_t>(base, kPayloadsOffsetOffset) !=
          geometry->payloads_offset ||
      geometry->total_bytes > size) {
    return absl::InvalidArgumentError(
        "the ring's offsets do not match its entries or its size");
  }
  return geometry;
}

uint16_t BackendCode(const std::string& name) {
  if (name.empty()) return kBackendNone;
  if (name == "memory") return kBackendMemory;
  if (name == "tcp") return kBackendTcp;
  if (name == "ibverbs") return kBackendIbverbs;
  return kBackendOther;
}

const char* BackendName(uint16_t code) {
  switch (code) {
    case kBackendNone:
      return "";
    case kBackendMemory:
      return "memory";
    case kBackendTcp:
      return "tcp";
    case kBackendIbverbs:
      return "ibverbs";
    default:
      return "other";
  }
}

Submission CopySubmission(const std::byte* base, const Geometry& geometry,
                          uint32_t index) {
  Submission entry;
  std::memcpy(&entry,
              base + geometry.submissions_offset +
                  uint64_t{index & geometry.mask()} * kSubmissionBytes,
              sizeof(entry));
  return entry;
}

namespace {

// The fields an opcode does not use must be zero.
absl::Status CheckUnused(const Submission& entry, const char* opcode) {
  if (entry.local_buffer_id != 0 || entry.local_offset != 0 ||
      entry.length != 0 || entry.remote_offset != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(opcode,
                     ": local_buffer_id, local_offset, length and "
                     "remote_offset must be 0"));
  }
  return absl::OkStatus();
}

absl::Status CheckNotification(const Submission& entry,
                               const Geometry& geometry,
                               uint64_t max_notification_bytes) {
  if (!entry.notify()) {
    if (entry.notification != 0) {
      return absl::InvalidArgumentError(
          "notification (offset 56) must be 0 without the NOTIFY flag");
    }
    return absl::OkStatus();
  }
  if (!entry.end_of_batch()) {
    return absl::InvalidArgumentError(
        "NOTIFY is only allowed on an END_OF_BATCH entry");
  }
  if (entry.opcode == kOpCancel) {
    return absl::InvalidArgumentError("NOTIFY is not allowed on CANCEL");
  }
  const uint64_t offset = entry.payload_offset();
  const uint64_t length = entry.payload_length();
  if (length == 0) {
    return absl::InvalidArgumentError("payload_length must be positive");
  }
  if (length > max_notification_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "payload_length ", length, " exceeds the agent's limit of ",
        max_notification_bytes, " bytes (--max_notification_bytes)"));
  }
  if (offset + length > geometry.payload_area_bytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("payload_offset ", offset, " + payload_length ", length,
                     " is beyond the payload area of ",
                     geometry.payload_area_bytes(), " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckSubmission(const Submission& entry, const Geometry& geometry,
                             uint64_t max_notification_bytes) {
  if (entry.opcode < kOpReadIntoLocal || entry.opcode > kOpCancel) {
    return absl::InvalidArgumentError(
        absl::StrCat("opcode ", entry.opcode,
                     " is not 1 (READ_INTO_LOCAL), 2 (WRITE_FROM_LOCAL), "
                     "3 (RUN_PREPARED) or 4 (CANCEL)"));
  }
  if ((entry.flags & ~kKnownSubmissionFlags) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("flags 0x", absl::Hex(entry.flags), " has unknown bits"));
  }
  if (entry.reserved0 != 0) {
    return absl::InvalidArgumentError("reserved fields must be zero");
  }
  switch (entry.opcode) {
    case kOpRunPrepared:
      if (absl::Status unused = CheckUnused(entry, "RUN_PREPARED");
          !unused.ok()) {
        return unused;
      }
      if (entry.remote_handle == 0) {
        return absl::InvalidArgumentError(
            "RUN_PREPARED: remote_handle must name a prepared transfer "
            "(PrepareTransfer)");
      }
      break;
    case kOpCancel:
      if (absl::Status unused = CheckUnused(entry, "CANCEL"); !unused.ok()) {
        return unused;
      }
      break;
    default:
      if (entry.length == 0) {
        return absl::InvalidArgumentError("length must be positive");
      }
      if (entry.remote_handle == 0) {
        return absl::InvalidArgumentError(
            "remote_handle must name an imported remote (ImportRemote)");
      }
  }
  return CheckNotification(entry, geometry, max_notification_bytes);
}

absl::StatusOr<uint32_t> PendingSubmissions(uint32_t head, uint32_t tail,
                                            uint32_t entries) {
  const uint32_t pending = tail - head;  // indices wrap at 2^32
  if (pending > entries) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sq_tail ", tail, " is ", pending, " entries past sq_head ", head,
        "; the ring holds ", entries));
  }
  return pending;
}

absl::StatusOr<uint32_t> FreeCompletions(uint32_t head, uint32_t tail,
                                         uint32_t entries) {
  const uint32_t used = tail - head;
  if (used > entries) {
    return absl::FailedPreconditionError(
        absl::StrCat("cq_head ", head, " is not within the ", entries,
                     " completions before cq_tail ", tail));
  }
  return entries - used;
}

absl::StatusOr<uint32_t> TakeBatch(const std::byte* base,
                                   const Geometry& geometry, uint32_t head,
                                   uint32_t tail, uint32_t free_completions,
                                   uint64_t max_notification_bytes,
                                   Batch* batch) {
  batch->entries.clear();
  batch->checks.clear();
  batch->notification.clear();
  auto pending = PendingSubmissions(head, tail, geometry.entries);
  if (!pending.ok()) return pending.status();
  uint32_t taken = 0;
  bool complete = false;
  while (taken < *pending) {
    batch->entries.push_back(CopySubmission(base, geometry, head + taken));
    ++taken;
    if (batch->entries.back().end_of_batch() || taken == geometry.entries) {
      complete = true;
      break;
    }
  }
  if (!complete || taken > free_completions) {
    batch->entries.clear();
    return 0;
  }
  for (const Submission& entry : batch->entries) {
    absl::Status check =
        CheckSubmission(entry, geometry, max_notification_bytes);
    if (check.ok() &&
        (entry.opcode == kOpRunPrepared || entry.opcode == kOpCancel)) {
      const char* name =
          entry.opcode == kOpRunPrepared ? "RUN_PREPARED" : "CANCEL";
      if (taken > 1) {
        check = absl::InvalidArgumentError(
            absl::StrCat(name, " must be a batch of its own"));
      } else if (!entry.end_of_batch()) {
        check = absl::InvalidArgumentError(
            absl::StrCat(name, " must carry END_OF_BATCH"));
      }
    }
    batch->checks.push_back(std::move(check));
  }
  // The notification's bytes, copied once: the client may reuse them as
  // soon as sq_head passes the entry.
  const Submission& last = batch->entries.back();
  if (last.notify() && batch->checks.back().ok()) {
    batch->notification.assign(
        reinterpret_cast<const char*>(base + geometry.payloads_offset +
                                      last.payload_offset()),
        last.payload_length());
  }
  return taken;
}

void WriteCompletion(std::byte* base, const Geometry& geometry, uint32_t index,
                     const Completion& completion, const std::string& message) {
  const uint32_t slot = index & geometry.mask();
  Completion copy = completion;
  const size_t length = std::min<size_t>(message.size(), kMessageBytes - 1);
  copy.message_bytes = static_cast<uint16_t>(length);
  std::memcpy(
      base + geometry.completions_offset + uint64_t{slot} * kCompletionBytes,
      &copy, sizeof(copy));
  std::byte* text =
      base + geometry.messages_offset + uint64_t{slot} * kMessageBytes;
  std::memcpy(text, message.data(), length);
  text[length] = std::byte{0};
}

Completion ReadCompletion(const std::byte* base, const Geometry& geometry,
                          uint32_t index, std::string* message) {
  const uint32_t slot = index & geometry.mask();
  Completion completion;
  std::memcpy(
      &completion,
      base + geometry.completions_offset + uint64_t{slot} * kCompletionBytes,
      sizeof(completion));
  const size_t length =
      std::min<size_t>(completion.message_bytes, kMessageBytes - 1);
  message->assign(
      reinterpret_cast<const char*>(base + geometry.messages_offset +
                                    uint64_t{slot} * kMessageBytes),
      length);
  return completion;
}

}  // namespace rdma_agent::ring

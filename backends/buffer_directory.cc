#include "backends/buffer_directory.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace rdma_agent {

absl::Status StaleContextError() {
  return absl::FailedPreconditionError(
      "remote context is stale: agent restarted since it was issued");
}

absl::Status NotRegisteredError() {
  // No id in the message: refusals of a forged context and of an unknown id
  // are byte-identical (the op index already says which op it was).
  return absl::NotFoundError(
      "remote buffer is not registered here (released, never registered, or "
      "the context's token does not match)");
}

absl::Status CheckRange(uint64_t offset, uint64_t length, uint64_t size,
                        absl::string_view what) {
  if (length == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " length must be positive"));
  }
  if (offset > size || length > size - offset) {
    return absl::OutOfRangeError(
        absl::StrCat(what, " range [", offset, ", ", offset, "+", length,
                     ") is outside the buffer of ", size, " bytes"));
  }
  return absl::OkStatus();
}

bool TokensEqual(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  }
  return diff == 0;
}

absl::Status CheckServeRequest(const Registration& registration,
                               const ServeRequest& request) {
  if (!TokensEqual(registration.token(), request.token)) {
    return NotRegisteredError();
  }
  if (request.proof_only) return absl::OkStatus();
  if (request.write ? !registration.writable() : !registration.readable()) {
    return absl::PermissionDeniedError(
        absl::StrCat("buffer ", request.buffer_id, " is not registered for ",
                     request.write ? "remote writes" : "remote reads",
                     " (access ", v1::Access_Name(registration.access()), ")"));
  }
  return CheckRange(request.offset, request.length, registration.size(),
                    "remote");
}

absl::Status CheckNotificationTarget(const Registration& registration,
                                     const ServeRequest& target) {
  if (!TokensEqual(registration.token(), target.token)) {
    return NotRegisteredError();
  }
  if (!registration.writable()) {
    return absl::PermissionDeniedError(absl::StrCat(
        "buffer ", target.buffer_id,
        " takes no notifications from this context: a notification needs "
        "remote write access (access ",
        v1::Access_Name(registration.access()), ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Registration>>
BufferDirectory::ResolveForNotification(const ServeRequest& target) const {
  ServeRequest proof = target;
  proof.proof_only = true;
  auto registration = ResolveForPeer(proof);
  if (!registration.ok()) return registration;
  absl::Status allowed = CheckNotificationTarget(**registration, target);
  if (!allowed.ok()) return allowed;
  return registration;
}

}  // namespace rdma_agent

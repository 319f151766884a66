#ifndef RDMA_AGENTD_BACKENDS_BUFFER_DIRECTORY_H_
#define RDMA_AGENTD_BACKENDS_BUFFER_DIRECTORY_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "backends/registration.h"

namespace rdma_agent {

// A request from a peer (or from this agent's own memory backend) to touch a
// local registration, as named by a remote context.
struct ServeRequest {
  uint64_t agent_epoch = 0;  // epoch the requester believes this agent has
  uint64_t buffer_id = 0;
  std::string token;
  uint64_t offset = 0;
  uint64_t length = 0;
  // True when the requester will write into the buffer (its WRITE_FROM_LOCAL);
  // false when it reads (its READ_INTO_LOCAL).
  bool write = false;
  // True when the requester only proves it holds the capability (epoch, id
  // and token), e.g. to be granted NIC access: access and range are then the
  // caller's to enforce (offset, length and write are ignored).
  bool proof_only = false;
  // Who asks, for the agent's log when the request is refused ("10.0.0.2",
  // "agent X at ipv4:10.0.0.2:5555"); empty for this agent's own memory
  // backend, whose failures its caller reports.
  std::string requester;
};

// The agent's live registrations, as backends see them when serving peers.
class BufferDirectory {
 public:
  virtual ~BufferDirectory() = default;

  // Checks a peer request and pins the registration it names, token first:
  // a requester without the buffer's token learns neither this agent's
  // epoch nor which ids exist. Codes, in order: stale epoch
  // FAILED_PRECONDITION (StaleContextError(), which never names the current
  // epoch); unknown id or wrong token NOT_FOUND (NotRegisteredError(), one
  // message for both); then, only for a matching token, access
  // PERMISSION_DENIED, zero length INVALID_ARGUMENT, range outside the buffer
  // (or overflowing) OUT_OF_RANGE.
  // The caller keeps the returned pointer until it no longer touches memory.
  virtual absl::StatusOr<std::shared_ptr<Registration>> ResolveForPeer(
      const ServeRequest& request) const = 0;

  // Checks the target of a notification (a tcp kNotify, Peer.Notify, the
  // memory backend's) and pins the registration it names: epoch, id and
  // token exactly as ResolveForPeer (same codes, same messages), then, only
  // for a matching token, WRITE access (PERMISSION_DENIED). A notification
  // announces bytes written into the buffer, so only a holder allowed to
  // write them may send one: a READ-only context, handed out so that others
  // may read, does not let its holder plant notifications. No range is
  // checked (a notification names none); `target`'s offset, length, write
  // and proof_only are ignored. This default goes through ResolveForPeer.
  virtual absl::StatusOr<std::shared_ptr<Registration>> ResolveForNotification(
      const ServeRequest& target) const;
};

// The answer to a context from an earlier life of this agent. It says the
// context is stale, never what the current epoch is.
absl::Status StaleContextError();

// The answer to an unknown buffer id and to a wrong token alike, so that a
// requester without the token cannot tell which ids exist.
absl::Status NotRegisteredError();

// Checks that [offset, offset + length) lies inside a buffer of `size` bytes
// without overflowing. `what` names the side in the error ("local", "remote").
absl::Status CheckRange(uint64_t offset, uint64_t length, uint64_t size,
                        absl::string_view what);

// Compares tokens in constant time.
bool TokensEqual(absl::string_view a, absl::string_view b);

// The checks of ResolveForPeer against an already-found registration:
// token (NotRegisteredError()), then access and range unless
// request.proof_only. BufferTable (backends/buffer_table.h) is the one
// BufferDirectory that finds registrations and calls this; use it rather
// than writing another.
absl::Status CheckServeRequest(const Registration& registration,
                               const ServeRequest& request);

// The checks of ResolveForNotification against an already-found
// registration: token (NotRegisteredError()), then WRITE access.
absl::Status CheckNotificationTarget(const Registration& registration,
                                     const ServeRequest& target);

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_BACKENDS_BUFFER_DIRECTORY_H_

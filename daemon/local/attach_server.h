#ifndef RDMA_AGENTD_DAEMON_LOCAL_ATTACH_SERVER_H_
#define RDMA_AGENTD_DAEMON_LOCAL_ATTACH_SERVER_H_

#include <functional>
#include <list>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "backends/buffer_table.h"
#include "common/unique_fd.h"
#include "daemon/limits/quota.h"
#include "daemon/local/attach_tokens.h"
#include "daemon/local/unix_socket.h"
#include "rdma/agent/v1/attach.pb.h"

namespace rdma_agent {

// Serves the attach socket (proto/rdma/agent/v1/attach.proto): clients hand
// memfds or device memory dma-bufs over (answered with an attach token) and
// ask for the fd of their own host-memory registrations to map them. Each
// connection is served on its own thread, within the attach-connection quota of
// its user and of everybody, until it opens a ring: then it is handed over,
// with its place in the quota, and its thread ends. Attached memory is admitted
// before it is mapped: its size against the largest registration and the bytes
// quota, the fd against the parked-attachment quota. Whatever is refused is
// closed at once.
class AttachServer {
 public:
  struct Options {
    std::string path;
    // An idle connection is dropped after this long.
    absl::Duration idle_timeout = absl::Minutes(5);
    // Largest memory one attachment may hand over.
    uint64_t max_buffer_bytes = uint64_t{64} << 30;
    // bytes, pending_attach and attach_connections are used; all must be set.
    AgentQuotas quotas;
    // Opens a ring session (OpenRing, docs/RING.md) for `peer`: answers the
    // request on `connection`, on the connection's thread, and keeps the
    // connection and `charge` (its place in the attach-connection quota)
    // for as long as the session lasts, served elsewhere; returns without
    // waiting for the session. Unset: OpenRing is refused UNIMPLEMENTED.
    std::function<void(UniqueFd connection, QuotaCharge charge,
                       const PeerCredentials& peer,
                       const v1::OpenRing& request)>
        open_ring;
  };

  static absl::StatusOr<std::unique_ptr<AttachServer>> Start(
      Options options, AttachTokens* tokens, const BufferTable* buffers);
  AttachServer(const AttachServer&) = delete;
  AttachServer& operator=(const AttachServer&) = delete;
  // Stops accepting, ends every connection and waits for their threads.
  ~AttachServer();

 private:
  struct Connection {
    UniqueFd fd;
    PeerCredentials peer;
    QuotaCharge charge;  // this connection in its user's quota
    std::thread thread;
    bool done = false;
  };

  AttachServer(Options options, AttachTokens* tokens,
               const BufferTable* buffers);
  void OnConnection(UniqueFd fd, const PeerCredentials& peer);
  void Serve(Connection* connection);
  struct Reply {
    v1::AttachResponse response;
    // For OpenBuffer: the registration whose fd goes with the response.
    std::shared_ptr<Registration> buffer;
  };
  static Reply ErrorReply(const absl::Status& status);
  // Answers one request; `fd` is the descriptor that came with it, if any.
  Reply Handle(const v1::AttachRequest& request, UniqueFd fd,
               const PeerCredentials& peer);
  // Admits, maps and parks a memfd: the attach token, or why not.
  absl::StatusOr<std::string> Attach(UniqueFd fd, const PeerCredentials& peer,
                                     uint64_t* size);
  // Checks, admits and parks a device memory dma-buf (never mapped).
  absl::StatusOr<std::string> AttachDevice(
      UniqueFd fd, const v1::AttachDeviceMemory& request,
      const PeerCredentials& peer);
  // Admits `bytes` more of `peer`'s memory (attached host or device memory):
  // the largest registration, then the bytes quota.
  absl::StatusOr<std::unique_ptr<MappingCharge>> AdmitBytes(
      uint64_t bytes, const PeerCredentials& peer) const;
  void ReapDoneLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  AttachTokens* const tokens_;
  const BufferTable* const buffers_;
  std::unique_ptr<UnixListener> listener_;
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::list<Connection> connections_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_LOCAL_ATTACH_SERVER_H_

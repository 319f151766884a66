#ifndef RDMA_AGENTD_DAEMON_LOCAL_CALLER_IDENTITY_H_
#define RDMA_AGENTD_DAEMON_LOCAL_CALLER_IDENTITY_H_

#include <sys/types.h>

#include <cstddef>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/unique_fd.h"
#include "daemon/local/unix_socket.h"
#include "grpcpp/server_context.h"

namespace rdma_agent {

// Who is calling the RdmaAgent API. The agent accepts its Unix socket itself
// (UnixListener, which reads SO_PEERCRED), admits each connection here, and
// only then hands the fd to gRPC; every RPC then finds its caller by the fd
// gRPC serves it on.

// The API connection an RPC came on: its caller, gRPC's fd for it and the
// socket's inode (the fd number alone is reused once gRPC closes it).
struct CallerConnection {
  PeerCredentials peer;
  int fd = -1;
  ino_t inode = 0;
};

// True while `connection.fd` still refers to that connection's socket.
bool ConnectionOpen(const CallerConnection& connection);

// True while `connection` is open and its client's end is too (a client
// that exits closes its end; the agent's end stays open until gRPC notices).
bool ConnectionAlive(const CallerConnection& connection);

// A pidfd of the process that opened `connection` (SO_PEERPIDFD, Linux 6.5):
// unlike pidfd_open of the SO_PEERCRED pid, it cannot name another process
// that reused the pid, and it works whatever pid namespace the caller is in.
// UNIMPLEMENTED when the kernel has no SO_PEERPIDFD; NOT_FOUND when the
// connection has closed or that process is gone.
absl::StatusOr<UniqueFd> OpenPeerPidfd(const CallerConnection& connection);

// Credentials of each connection the agent accepted on its Unix socket, by
// the fd gRPC serves it on (ServerContext::peer() reads "fd:N").
//
// gRPC owns and closes those fds, so the table cannot hear of a close; it
// keeps each socket's inode with it instead. An entry is live while its fd
// still refers to that inode (a socket's inode is unique while it is open),
// so a reused fd number is never mistaken for the old connection, and dead
// entries are swept at every Admit.
class CallerTable {
 public:
  // Records `fd` for `peer` if the user and the agent have connections to
  // spare: RESOURCE_EXHAUSTED (naming the flag) when `peer.uid` already has
  // `max_per_user` live connections or the agent has `max_total`.
  absl::Status Admit(int fd, const PeerCredentials& peer, size_t max_per_user,
                     size_t max_total);
  // The caller of the RPC in `context`; UNAUTHENTICATED if unknown.
  absl::StatusOr<PeerCredentials> Lookup(
      const grpc::ServerContextBase& context) const;
  // The connection the RPC in `context` came on; UNAUTHENTICATED if unknown.
  absl::StatusOr<CallerConnection> Connection(
      const grpc::ServerContextBase& context) const;
  // Live connections of `uid`.
  size_t Connections(uid_t uid) const;

 private:
  struct Entry {
    PeerCredentials peer;
    ino_t inode = 0;
  };
  static bool Live(int fd, const Entry& entry);

  mutable absl::Mutex mu_;
  absl::flat_hash_map<int, Entry> by_fd_ ABSL_GUARDED_BY(mu_);
};

// Readies an accepted RdmaAgent connection for gRPC and records its caller:
// makes the socket non-blocking, gives it a send buffer large enough for
// ReadBuffer chunks, then CallerTable::Admit. On error the connection must
// be closed (that is the refusal the client sees).
absl::Status AdmitApiConnection(int fd, const PeerCredentials& peer,
                                CallerTable* callers, size_t max_per_user,
                                size_t max_total);

// Connections to the RdmaAgent socket (flags --max_connections_per_user,
// --max_connections): each holds an fd and a gRPC transport.
struct ConnectionLimits {
  size_t max_per_user = 128;
  size_t max_total = 1024;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_LOCAL_CALLER_IDENTITY_H_

#ifndef RDMA_AGENTD_DAEMON_LOCAL_UNIX_SOCKET_H_
#define RDMA_AGENTD_DAEMON_LOCAL_UNIX_SOCKET_H_

#include <sys/socket.h>
#include <sys/types.h>

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/accept_loop.h"
#include "common/rate_limited_log.h"
#include "common/unique_fd.h"

namespace rdma_agent {

// Credentials of the process at the other end of a Unix socket.
struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};

// SO_PEERCRED of a connected Unix socket.
absl::StatusOr<PeerCredentials> ReadPeerCredentials(int fd);

// Accepts connections on a Unix socket at `path` (an AcceptLoop: a thread
// of its own, back-off and rate-limited logging when out of fds) and hands
// each one, with its credentials, to `on_connection` on that thread. By
// default any local user may connect (mode 0666): what each caller may do is
// decided per call from its credentials; a socket of mode 0600 admits only
// the agent's own user and root. The socket file is removed when the
// listener stops.
class UnixListener {
 public:
  using ConnectionHandler =
      std::function<void(UniqueFd connection, const PeerCredentials& peer)>;

  // Binds (replacing a stale socket file), gives the socket file `mode` and
  // starts accepting.
  static absl::StatusOr<std::unique_ptr<UnixListener>> Start(
      const std::string& path, ConnectionHandler on_connection,
      mode_t mode = 0666);

  UnixListener(const UnixListener&) = delete;
  UnixListener& operator=(const UnixListener&) = delete;
  // Stops accepting, waits for the accept thread, removes the socket file.
  ~UnixListener();

  const std::string& path() const { return path_; }

 private:
  UnixListener(std::string path, ConnectionHandler on_connection);
  // Reads the credentials of an accepted connection and hands it on.
  void OnAccepted(UniqueFd connection);

  const std::string path_;
  const ConnectionHandler on_connection_;
  LogRateLimiter dropped_log_{absl::Seconds(10)};
  std::unique_ptr<AcceptLoop> loop_;  // last: stops first
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_LOCAL_UNIX_SOCKET_H_

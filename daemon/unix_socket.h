#ifndef RDMA_AGENTD_DAEMON_UNIX_SOCKET_H_
#define RDMA_AGENTD_DAEMON_UNIX_SOCKET_H_

#include <sys/socket.h>
#include <sys/types.h>

#include <atomic>
#include <functional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
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

// Accepts connections on a Unix socket at `path` on a thread of its own and
// hands each one, with its credentials, to `on_connection`. Any local user
// may connect (mode 0666): what each caller may do is decided per call from
// its credentials. The socket file is removed when the listener stops.
// When the process runs out of fds, accepting pauses (10 ms, doubling up to
// 1 s) and says so at most once per 10 s; it resumes by itself as soon as
// fds come back.
class UnixListener {
 public:
  using ConnectionHandler =
      std::function<void(UniqueFd connection, const PeerCredentials& peer)>;

  // Binds (replacing a stale socket file) and starts accepting.
  static absl::StatusOr<std::unique_ptr<UnixListener>> Start(
      const std::string& path, ConnectionHandler on_connection);

  UnixListener(const UnixListener&) = delete;
  UnixListener& operator=(const UnixListener&) = delete;
  // Stops accepting, waits for the accept thread, removes the socket file.
  ~UnixListener();

  const std::string& path() const { return path_; }

 private:
  UnixListener(std::string path, UniqueFd listen_fd, UniqueFd wake_fd,
               ConnectionHandler on_connection);
  void AcceptLoop();
  // Waits `pause`; false if the listener is stopping.
  bool PauseUnlessStopped(absl::Duration pause);

  const std::string path_;
  UniqueFd listen_fd_;
  UniqueFd wake_fd_;  // eventfd that ends the accept loop
  ConnectionHandler on_connection_;
  LogRateLimiter out_of_fds_log_{absl::Seconds(10)};
  LogRateLimiter other_errors_log_{absl::Seconds(10)};
  LogRateLimiter recovered_log_{absl::Seconds(10)};
  std::thread thread_;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_UNIX_SOCKET_H_

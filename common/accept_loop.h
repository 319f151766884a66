#ifndef RDMA_AGENTD_COMMON_ACCEPT_LOOP_H_
#define RDMA_AGENTD_COMMON_ACCEPT_LOOP_H_

#include <sys/socket.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/rate_limited_log.h"
#include "common/unique_fd.h"

namespace rdma_agent {

// Accepts connections on a listening socket, on a thread of its own, and
// hands each one to a handler on that thread; the one accept loop of the
// agent's servers (the RdmaAgent and attach Unix sockets, the tcp data
// plane).
//
// Promises:
//  - Stop() (or destruction) wakes the loop through an eventfd and returns
//    once the thread has left: the handler is never called after it.
//  - When the process runs out of fds or kernel memory (EMFILE, ENFILE,
//    ENOBUFS, ENOMEM) the pending connection stays queued, so accepting
//    pauses, 10 ms doubling up to 1 s, instead of spinning; it resumes by
//    itself when an accept works again and says so once.
//  - Failures are logged at most once per `log_interval` per kind, with the
//    count of those held back: a flood cannot fill the log.
//  - Accepted fds are close-on-exec and blocking, whatever the listener is.
class AcceptLoop {
 public:
  struct Options {
    // Names the socket in log lines ("/run/rdma-agentd/agent.sock").
    std::string name;
    absl::Duration log_interval = absl::Seconds(10);
  };
  // The accepted connection and the peer's address (as accept4 gave it).
  using Handler =
      std::function<void(UniqueFd connection, const sockaddr_storage& peer)>;

  // Takes a bound, listening socket (made non-blocking, so that a connection
  // reset between poll and accept cannot block the loop) and starts.
  static absl::StatusOr<std::unique_ptr<AcceptLoop>> Start(UniqueFd listener,
                                                           Options options,
                                                           Handler handler);

  AcceptLoop(const AcceptLoop&) = delete;
  AcceptLoop& operator=(const AcceptLoop&) = delete;
  ~AcceptLoop() { Stop(); }

  // Stops accepting and waits for the loop's thread. Idempotent; not to be
  // called from the handler.
  void Stop();

 private:
  AcceptLoop(UniqueFd listener, UniqueFd wake, Options options,
             Handler handler);
  void Run();
  // Waits `pause`; false if the loop is stopping.
  bool PauseUnlessStopped(absl::Duration pause);

  const UniqueFd listener_;
  const UniqueFd wake_;  // eventfd that ends the loop
  const Options options_;
  const Handler handler_;
  LogRateLimiter out_of_fds_log_;
  LogRateLimiter other_errors_log_;
  LogRateLimiter recovered_log_;
  std::thread thread_;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_COMMON_ACCEPT_LOOP_H_

#ifndef RDMA_AGENTD_BACKENDS_TCP_CLIENT_LOOP_H_
#define RDMA_AGENTD_BACKENDS_TCP_CLIENT_LOOP_H_

#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/unique_fd.h"

namespace rdma_agent::tcp {

// One thread waiting in epoll for the sockets of the requesting side's
// small batches, so that their answers are taken in (and their batches
// ended) where they arrive instead of a worker blocking on each.
//
// Every watch is one-shot: after the loop has called a socket's OnReady, no
// event of that socket reaches the loop until it is armed again, so one
// thread at a time owns what the watcher guards.
class ClientLoop {
 public:
  class Watcher {
   public:
    // On the loop's thread, once per arming: the socket is readable, or
    // writable when asked for, or has failed or been shut down.
    virtual void OnReady() = 0;

   protected:
    ~Watcher() = default;
  };

  // Starts the thread, named `thread_name` (at most 15 characters).
  // RESOURCE_EXHAUSTED when no epoll set, eventfd or thread can be made.
  static absl::StatusOr<std::unique_ptr<ClientLoop>> Start(
      absl::string_view thread_name);

  // Stops and joins the thread. No socket may still be watched.
  ~ClientLoop();

  ClientLoop(const ClientLoop&) = delete;
  ClientLoop& operator=(const ClientLoop&) = delete;

  // Adds `fd` to the set, armed once for input (and output when `write`).
  absl::Status Watch(int fd, bool write, Watcher* watcher);
  // Arms `fd`, already in the set, once more.
  absl::Status Rearm(int fd, bool write, Watcher* watcher);
  // Takes `fd` out of the set (before it is closed or used elsewhere).
  void Forget(int fd);

 private:
  ClientLoop() = default;
  void Loop();
  absl::Status Control(int op, int fd, bool write, Watcher* watcher);

  UniqueFd epoll_;
  // Written by the destructor: wakes the loop to leave.
  UniqueFd wake_;
  std::thread thread_;
};

}  // namespace rdma_agent::tcp

#endif  // RDMA_AGENTD_BACKENDS_TCP_CLIENT_LOOP_H_

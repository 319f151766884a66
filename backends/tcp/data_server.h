#ifndef RDMA_AGENTD_BACKENDS_TCP_DATA_SERVER_H_
#define RDMA_AGENTD_BACKENDS_TCP_DATA_SERVER_H_

#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <thread>

#include "absl/status/statusor.h"
#include "backends/buffer_directory.h"
#include "backends/tcp/socket_util.h"
#include "common/unique_fd.h"

namespace rdma_agent::tcp {

// The serving half of the TCP data plane: accepts peer connections and
// answers their READ/WRITE requests against this agent's registrations.
//
// Every request is checked with BufferDirectory::ResolveForPeer (epoch,
// buffer id, token, access, bounds) before a byte of the registration is
// touched; the resolved registration stays pinned while its bytes move.
// Payloads go between the socket and the registration's mapping directly.
// Requests of one connection are answered in order. A refused WRITE's payload
// is read and dropped so the connection stays usable.
class DataServer {
 public:
  // Connections served at once; more are closed at accept (one thread each).
  static constexpr size_t kMaxConnections = 4096;

  // Listens on `address` and serves until destroyed. `directory` must outlive
  // the server.
  // With `zero_copy_send`, READ payloads of at least kSpliceMinBytes go to
  // the socket with vmsplice/splice instead of send (see PageSender).
  // `socket_buffer_bytes` as in ConfigureDataSocket, for accepted
  // connections.
  static absl::StatusOr<std::unique_ptr<DataServer>> Start(
      const HostPort& address, const BufferDirectory* directory,
      bool zero_copy_send = false, int socket_buffer_bytes = 0);

  // Stops accepting, cuts every connection and waits for all serving threads
  // to leave registration memory.
  ~DataServer();

  DataServer(const DataServer&) = delete;
  DataServer& operator=(const DataServer&) = delete;

  // The port actually bound (useful when asked for port 0).
  uint16_t port() const { return port_; }

 private:
  struct Connection {
    UniqueFd fd;
    std::thread thread;
    std::atomic<bool> finished{false};
  };

  DataServer(UniqueFd listener, UniqueFd wakeup, uint16_t port,
             const BufferDirectory* directory, bool zero_copy_send,
             int socket_buffer_bytes);
  void AcceptLoop();
  void Serve(Connection* connection);
  // Joins and drops connections whose thread has finished. Requires mu_.
  void ReapFinishedLocked();

  const UniqueFd listener_;
  // eventfd that wakes the accept loop at shutdown.
  const UniqueFd wakeup_;
  const uint16_t port_;
  const BufferDirectory* const directory_;
  const bool zero_copy_send_;
  const int socket_buffer_bytes_;

  std::mutex mu_;
  bool stopping_ = false;  // guarded by mu_
  std::list<std::unique_ptr<Connection>> connections_;  // guarded by mu_
  std::thread accept_thread_;
};

}  // namespace rdma_agent::tcp

#endif  // RDMA_AGENTD_BACKENDS_TCP_DATA_SERVER_H_

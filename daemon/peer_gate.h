#ifndef RDMA_AGENTD_DAEMON_PEER_GATE_H_
#define RDMA_AGENTD_DAEMON_PEER_GATE_H_

#include <sys/socket.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/accept_loop.h"
#include "common/unique_fd.h"

namespace grpc::experimental {
class ServerInterceptorFactoryInterface;
}  // namespace grpc::experimental

namespace rdma_agent {

// Bounds of the Peer listener, which any host on the network may reach.
struct PeerListenerLimits {
  // Connections held at once, from all sources and from one IP address;
  // more are closed at accept, before a byte is read or sent.
  size_t max_connections = 1024;
  size_t max_connections_per_source = 16;
  // A connection must deliver a complete request (TLS handshake, HTTP/2
  // preface, headers and message) within this long of its accept, or it is
  // closed: a half-sent call holds nothing for longer.
  absl::Duration call_arrival_timeout = absl::Seconds(10);
  // Every connection is closed this long after its accept (gRPC's
  // GOAWAY, then call_arrival_timeout of grace for calls in flight), so
  // that a half-sent call on a connection that once sent a request is
  // bounded too. Peers reconnect on their next call.
  absl::Duration max_connection_age = absl::Minutes(5);
};

// The front of the Peer listener: accepts its TCP connections itself,
// refuses those over the caps at accept, and splices each admitted one to
// the agent's gRPC Peer server on a Unix socket only the agent can reach
// (so that gRPC still does TLS, and `peer()` still names the caller). Each
// spliced connection binds an abstract Unix address naming its TCP peer,
// so gRPC's ServerContext::peer() reads "unix-abstract:ipv4:A.B.C.D:P/N":
// PeerSourceAddress() finds A.B.C.D in it, and RequestArrived() the
// connection. One thread accepts, one moves bytes (epoll), whatever the
// number of connections.
class PeerGate {
 public:
  // Listens on `listen` ("host:port", port 0: any) and forwards to the
  // Unix socket `backend_path` (gRPC's listener). INVALID_ARGUMENT for bad
  // limits; UNAVAILABLE when it cannot listen.
  static absl::StatusOr<std::unique_ptr<PeerGate>> Start(
      const std::string& listen, std::string backend_path,
      PeerListenerLimits limits);
  ~PeerGate();
  PeerGate(const PeerGate&) = delete;
  PeerGate& operator=(const PeerGate&) = delete;

  // The port bound.
  uint16_t port() const { return port_; }
  // The connection gRPC names `grpc_peer` delivered a complete request:
  // its arrival limit no longer applies.
  void RequestArrived(absl::string_view grpc_peer);
  // Connections held now.
  size_t connections() const;

 private:
  struct Pipe;

  PeerGate(PeerListenerLimits limits, std::string backend_path, UniqueFd wake);
  void Admit(UniqueFd connection, const sockaddr_storage& address);
  void Loop();
  // Moves what it can between the two sides of `pipe`; false once it is
  // done (either side closed, or failed).
  bool Pump(Pipe& pipe);
  void Watch(Pipe& pipe);
  void Close(uint64_t serial) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const PeerListenerLimits limits_;
  const std::string backend_path_;
  const UniqueFd wake_;  // eventfd: new pipes, or stop
  UniqueFd epoll_;
  uint16_t port_ = 0;
  std::unique_ptr<AcceptLoop> accept_;
  std::thread loop_;

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Admitted connections by serial (N of their name "ipv4:A.B.C.D:P/N",
  // and their key in epoll events).
  std::map<uint64_t, std::unique_ptr<Pipe>> pipes_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, size_t> per_source_ ABSL_GUARDED_BY(mu_);
};

// A server interceptor calling `arrived` with ServerContext::peer() once a
// call's request message is in: what tells PeerGate::RequestArrived.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
MakeArrivalInterceptor(std::function<void(absl::string_view)> arrived);

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_PEER_GATE_H_

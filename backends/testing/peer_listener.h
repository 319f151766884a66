#ifndef RDMA_AGENTD_BACKENDS_TESTING_PEER_LISTENER_H_
#define RDMA_AGENTD_BACKENDS_TESTING_PEER_LISTENER_H_

// Test-only: what the Agent does for the backends it runs, for a test that
// runs a backend without an Agent. Backends never open listeners of their
// own; whoever runs one serves its peer_services().

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "backends/backend.h"
#include "backends/peer_tls.h"

namespace grpc {
class Server;
}

namespace rdma_agent {
namespace testing {

// Serves a backend's peer_services() on 127.0.0.1:<ephemeral> until
// destroyed. Destroy it before the backend (declare it after).
class PeerListener {
 public:
  // Serves `backend.peer_services()` with `tls` (plaintext when not
  // enabled), then calls `backend.Start(address())`. UNAVAILABLE when the
  // port cannot be opened; Start's error otherwise.
  static absl::StatusOr<std::unique_ptr<PeerListener>> ServeAndStart(
      Backend& backend, const PeerTls& tls = PeerTls());
  ~PeerListener();

  // "127.0.0.1:port": what peers dial.
  const std::string& address() const { return address_; }

 private:
  PeerListener() = default;

  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

}  // namespace testing
}  // namespace rdma_agent

#endif  // RDMA_AGENTD_BACKENDS_TESTING_PEER_LISTENER_H_

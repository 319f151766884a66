#ifndef RDMA_AGENTD_BACKENDS_TCP_POOL_PROBE_H_
#define RDMA_AGENTD_BACKENDS_TCP_POOL_PROBE_H_

// Test-only: reads a tcp backend's connection pool, which is no part of
// TcpBackend's or DataClient's API (both befriend this class only).

#include <cstddef>

#include "backends/tcp/data_client.h"
#include "backends/tcp/tcp_backend.h"
#include "common/net_address.h"

namespace rdma_agent::tcp::testing {

// Counts of `backend`'s client pool, read under its lock. The backend must
// outlive the probe.
class PoolProbe {
 public:
  explicit PoolProbe(TcpBackend& backend) : client_(*backend.client_) {}

  // Idle pooled connections to `peer` (expired ones dropped first).
  size_t idle_connections(const HostPort& peer) {
    return client_.idle_connections(peer);
  }
  // Idle pooled connections to any peer.
  size_t idle_connections() { return client_.idle_connections(); }
  // Outgoing connections open now, in use and idle.
  size_t open_connections() { return client_.open_connections(); }

 private:
  DataClient& client_;
};

}  // namespace rdma_agent::tcp::testing

#endif  // RDMA_AGENTD_BACKENDS_TCP_POOL_PROBE_H_

#ifndef RDMA_AGENTD_DAEMON_METRICS_METRICS_SERVER_H_
#define RDMA_AGENTD_DAEMON_METRICS_METRICS_SERVER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/metrics/metrics.h"

namespace rdma_agent {

// Serves /metrics (the Prometheus text format) and /healthz (200 "ok" while
// the agent serves, 503 once it shuts down) over plain HTTP/1.x, one request
// per connection.
//
// Whoever reaches the port is a stranger, and the probes must keep
// answering whatever strangers do, so the endpoint holds nothing for them
// that a probe could wait behind:
//  - one thread and epoll, no thread per connection: a connection that sends
//    half a request (or reads its answer slowly) costs an fd and a buffer of
//    at most 8 KiB of request, never a worker;
//  - /healthz is answered as soon as its request is read; scrapes are made
//    one per turn of the loop, so health answers are never queued behind a
//    burst of scrapes;
//  - every connection is closed `request_timeout` after it was accepted,
//    answered or not;
//  - at most `max_connections` are held: a new one closes the oldest of
//    those still sending their request (else the oldest), so a flood of
//    half-open connections cannot lock probes out, it only churns itself.
class MetricsServer {
 public:
  // Listens on `listen` ("host:port"; port 0 picks one). `serving` is asked
  // at each /healthz. `metrics` must outlive the server.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const std::string& listen, const MetricsOptions& options,
      const AgentMetrics* metrics, std::function<bool()> serving);
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;
  // Stops serving: the loop's thread is joined, every connection closed.
  ~MetricsServer();

  uint16_t port() const { return port_; }

 private:
  class Loop;
  MetricsServer() = default;

  std::unique_ptr<Loop> loop_;
  uint16_t port_ = 0;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_METRICS_METRICS_SERVER_H_

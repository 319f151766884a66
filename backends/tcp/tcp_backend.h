#ifndef RDMA_AGENTD_BACKENDS_TCP_TCP_BACKEND_H_
#define RDMA_AGENTD_BACKENDS_TCP_TCP_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "backends/backend.h"
#include "backends/tcp/data_client.h"
#include "backends/tcp/data_server.h"
#include "backends/tcp/notify_client.h"

namespace rdma_agent::tcp {

// Configuration of the TCP backend (flags --tcp_*).
struct TcpOptions {
  // The data port when `listen` is empty.
  static constexpr uint16_t kDefaultPort = 7471;
  // Where the data plane listens, "host:port"; port 0 picks a free port.
  // Empty: the agent's advertise host (BackendEnvironment::advertise_host),
  // port kDefaultPort, so the data plane is not offered on interfaces peers
  // never use; every interface only when asked ("0.0.0.0:7471").
  std::string listen;
  // Host written into remote contexts; empty = the agent's advertise host.
  // Never a wildcard.
  std::string advertise_host;
  // Chunking, striping and pipelining of outgoing ops; the client's threads
  // and connection bounds.
  DataClientOptions client;
  // Timeouts and connection caps of the serving side. Its zero_copy_send and
  // socket_buffer_bytes are taken from `client` (one setting for both ends).
  DataServerOptions server;
  // Connections carrying notifications (idle and connect timeouts: the
  // client's).
  NotifyClientOptions notify;
};

// The agent-to-agent TCP transport: serves this agent's registrations on its
// own data port and runs ops against other agents' data ports.
//
// A registration's tcp endpoint is {advertised host, bound port}; the buffer
// id, epoch and token travel in every request and are checked by the serving
// agent (BufferDirectory::ResolveForPeer) before it touches memory.
class TcpBackend : public Backend {
 public:
  // Starts listening at once, so the bound port is known (and served) before
  // the first Register, and starts the client's worker threads.
  // INVALID_ARGUMENT for malformed options or a wildcard advertise host;
  // UNAVAILABLE when the address cannot be bound; RESOURCE_EXHAUSTED when
  // threads cannot be started.
  static absl::StatusOr<std::unique_ptr<TcpBackend>> Create(
      TcpOptions options, const BackendEnvironment& env);

  // Stops serving and waits for serving threads to leave registration memory.
  ~TcpBackend() override = default;

  const std::string& name() const override { return name_; }
  v1::TransportLevel transport_level() const override {
    return v1::TRANSPORT_LEVEL_TCP;
  }
  bool available() const override { return true; }
  v1::TransportInfo transport_info() const override;
  // Requests its data server answered in full.
  ServedTotals served() const override { return server_->served(); }
  absl::StatusOr<std::unique_ptr<BackendRegistration>> Register(
      const Registration& registration, v1::BackendEndpoint* endpoint) override;
  // True when `remote` advertises a usable tcp endpoint (host and port).
  bool CanReach(const v1::RemoteBuffer& remote) const override;
  // Starts the ops and returns. A small batch to one peer (at most
  // DataClient::kLoopBatchBytes) with an idle pooled connection to it is
  // sent from this thread and its answers read by the client's loops;
  // other batches' connections are queued for its worker threads. `done`
  // runs on the loop or worker that ends the batch (or the client's
  // timekeeper at the deadline or after a cancellation; or inside Post when
  // no op could start, or a small batch's answer was there at once). No
  // thread is started here. An endpoint naming a host
  // instead of an IP address is INVALID_ARGUMENT unless
  // `client.allow_host_names`.
  void Post(absl::Span<const Op> ops, const StopToken& stop,
            OpsDone done) override;
  // Post's run with the calling thread lent to it: it carries the batch's
  // first connection itself before waiting for the rest, because handing
  // a small op to a worker and its result back costs 10-20 us on a loaded
  // VM, as much as the op.
  std::vector<absl::Status> Submit(absl::Span<const Op> ops,
                                   const StopToken& stop) override;
  // A kNotify request to the target's data port, on one of the pooled
  // notification connections (tcp/notify_client.h): it follows the ops'
  // answers, so their bytes are in the target's memory.
  absl::Status Notify(const v1::RemoteBuffer& remote,
                      const v1::BackendEndpoint& endpoint,
                      absl::string_view data, const StopToken& stop) override;
  // Outgoing connections by peer address, incoming ones by source address.
  std::vector<PeerLinks> peer_links() const override;

  // The data port actually bound.
  uint16_t port() const { return server_->port(); }
  // The host written into remote contexts.
  const std::string& advertise_host() const { return advertise_host_; }

 private:
  // Tests inspect the connection pool through it (pool_probe.h).
  friend class testing::PoolProbe;

  TcpBackend(TcpOptions options, BackendEnvironment env,
             std::string advertise_host, std::unique_ptr<DataClient> client,
             std::unique_ptr<DataServer> server);
  // The data port `endpoint` (this backend's entry of a remote context)
  // names, or why it cannot be used.
  absl::StatusOr<HostPort> PeerOf(const v1::BackendEndpoint& endpoint) const;
  // The ops grouped by the data port that serves them; ops that cannot go
  // get their reason in `results` (one per op) and are in no batch.
  std::vector<DataClient::PeerBatch> GroupByPeer(
      absl::Span<const Op> ops, std::vector<absl::Status>& results) const;
  // What every batch's outcome gets on its way out: bytes moved counted
  // per registration, failures named by op.
  static void Conclude(absl::Span<const Op> ops,
                       std::vector<absl::Status>& results);

  const std::string name_ = "tcp";
  const TcpOptions options_;
  const BackendEnvironment env_;
  const std::string advertise_host_;
  const std::unique_ptr<DataClient> client_;
  NotifyClient notifier_{options_.notify, options_.client.idle_timeout,
                         options_.client.connect_timeout};
  // Last: destroyed first, so no serving thread outlives the rest.
  const std::unique_ptr<DataServer> server_;
};

}  // namespace rdma_agent::tcp

#endif  // RDMA_AGENTD_BACKENDS_TCP_TCP_BACKEND_H_

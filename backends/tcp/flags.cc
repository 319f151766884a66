#include "backends/tcp/flags.h"

#include <cstdint>
#include <string>

#include "absl/flags/flag.h"
#include "absl/time/time.h"
#include "backends/tcp/tcp_backend.h"

ABSL_FLAG(std::string, tcp_listen, "",
          "Address of the TCP data plane, host:port (port 0 = any free port). "
          "Serves only agent-to-agent transfers. Empty: the agent's "
          "--advertise_host (or detected address), port 7471; "
          "0.0.0.0:7471 serves every interface.");
ABSL_FLAG(std::string, tcp_advertise_host, "",
          "Host written into remote contexts for peers to dial (NAT, "
          "containers). Empty: the --tcp_listen host when it is a specific "
          "address, else the agent's --advertise_host / auto-detected "
          "address.");
ABSL_FLAG(int32_t, tcp_connections_per_peer,
          rdma_agent::tcp::DataClientOptions().connections_per_peer,
          "Connections one Submit stripes its chunks over, per peer.");
ABSL_FLAG(uint64_t, tcp_chunk_bytes,
          rdma_agent::tcp::DataClientOptions().chunk_bytes,
          "Largest payload of one data-plane request; longer ops are split.");
ABSL_FLAG(int32_t, tcp_max_in_flight,
          rdma_agent::tcp::DataClientOptions().max_in_flight,
          "Requests pipelined on one connection before their responses.");
ABSL_FLAG(uint64_t, tcp_in_flight_bytes,
          rdma_agent::tcp::DataClientOptions().in_flight_bytes,
          "A connection pipelines more than --tcp_max_in_flight requests "
          "(up to 1024) while they carry fewer payload bytes than this, so "
          "small ops share system calls. 0: --tcp_max_in_flight alone.");

ABSL_FLAG(int32_t, tcp_socket_buffer_bytes,
          rdma_agent::tcp::DataClientOptions().socket_buffer_bytes,
          "SO_SNDBUF/SO_RCVBUF of data connections (0: kernel autotuning). "
          "Small buffers keep loopback/low-RTT copies in cache; raise it for "
          "long, fast paths.");

ABSL_FLAG(bool, tcp_zero_copy_send,
          rdma_agent::tcp::DataClientOptions().zero_copy_send,
          "Send large payloads with vmsplice/splice (no sender-side copy) "
          "instead of send().");

ABSL_FLAG(absl::Duration, tcp_handshake_timeout,
          rdma_agent::tcp::DataServerOptions().handshake_timeout,
          "A new data connection must present a valid token (a request "
          "naming a registration with it) within this of its accept, or is "
          "closed; refused requests do not extend it.");
ABSL_FLAG(absl::Duration, tcp_idle_timeout,
          rdma_agent::tcp::DataServerOptions().idle_timeout,
          "A data connection idle this long between requests is closed.");
ABSL_FLAG(absl::Duration, tcp_request_timeout,
          rdma_agent::tcp::DataServerOptions().request_timeout,
          "A request (header, token, payload, response) not completed within "
          "this closes its connection and lets go of the buffer it pinned.");
ABSL_FLAG(int32_t, tcp_max_connections_per_source,
          rdma_agent::tcp::DataServerOptions().max_connections_per_source,
          "Data connections served at once from one source address; more are "
          "closed at accept.");
ABSL_FLAG(int32_t, tcp_max_connections,
          rdma_agent::tcp::DataServerOptions().max_connections,
          "Data connections served at once in all; more are closed at accept. "
          "0: min(4096, soft RLIMIT_NOFILE / 4).");

ABSL_FLAG(int32_t, tcp_server_threads,
          rdma_agent::tcp::DataServerOptions().threads,
          "Event-loop threads serving every incoming data connection "
          "(non-blocking; no thread per connection).");

ABSL_FLAG(int32_t, tcp_server_bulk_threads,
          rdma_agent::tcp::DataServerOptions().bulk_threads,
          "Threads that move large incoming-transfer payloads (1 MiB and "
          "more) with blocking calls when one is free; the event loops move "
          "them otherwise. 0: the event loops move everything.");

// Notifications to peers: their own pooled connections.
ABSL_FLAG(int32_t, tcp_notify_connections_per_peer,
          rdma_agent::tcp::NotifyClientOptions().connections_per_peer,
          "Connections that carry notifications to one peer's data port, in "
          "use and idle; its notifications take turns on them.");
ABSL_FLAG(int32_t, tcp_notify_max_connections,
          rdma_agent::tcp::NotifyClientOptions().max_connections,
          "Connections that carry notifications, all peers; a dial past it "
          "first closes the oldest idle one, else waits.");

// The requesting side: threads, connection bounds, dialling.
ABSL_FLAG(int32_t, tcp_client_threads,
          rdma_agent::tcp::DataClientOptions().threads,
          "Worker threads that run every outgoing transfer (started with the "
          "agent). Peers beyond what they serve at once wait in a queue.");
ABSL_FLAG(int32_t, tcp_client_loops, rdma_agent::tcp::DataClientOptions().loops,
          "Event-loop threads (tcp-client-loop) that read the answers of "
          "small posted batches (one peer, at most 64 KiB), sent by the "
          "posting thread on a pooled connection, and end them: one thread "
          "hand-off per op. 0: every batch goes to the worker threads.");
ABSL_FLAG(int32_t, tcp_client_max_connections,
          rdma_agent::tcp::DataClientOptions().max_connections,
          "Outgoing data connections open at once, in use and idle; more "
          "dials first close idle ones, else wait.");
ABSL_FLAG(int32_t, tcp_client_max_idle_connections,
          rdma_agent::tcp::DataClientOptions().max_idle_connections,
          "Idle outgoing connections kept for reuse, in all.");
ABSL_FLAG(int32_t, tcp_client_max_idle_per_peer,
          rdma_agent::tcp::DataClientOptions().max_idle_per_peer,
          "Idle outgoing connections kept for reuse, per peer.");
ABSL_FLAG(absl::Duration, tcp_client_idle_timeout,
          rdma_agent::tcp::DataClientOptions().idle_timeout,
          "Idle outgoing connections are closed after this (keep it below "
          "the peers' idle timeout).");
ABSL_FLAG(absl::Duration, tcp_client_connect_timeout,
          rdma_agent::tcp::DataClientOptions().connect_timeout,
          "A new outgoing connection must be established and the peer's "
          "hello read within this (and the op's deadline), or the peer is "
          "unreachable.");
ABSL_FLAG(absl::Duration, tcp_no_progress_timeout,
          rdma_agent::tcp::DataClientOptions().no_progress_timeout,
          "An outgoing connection that sends and receives nothing for this "
          "long while requests wait for answers fails their ops UNAVAILABLE, "
          "well before long deadlines (a stuck or hostile peer holds no "
          "thread for an hour). 0: wait for the op's deadline.");
ABSL_FLAG(bool, tcp_allow_host_names,
          rdma_agent::tcp::DataClientOptions().allow_host_names,
          "Resolve host names in remote contexts (bounded by each op's "
          "deadline). Off: only IP addresses are dialled, names are refused.");

namespace rdma_agent {

BackendFactory MakeTcpBackendFactoryFromFlags() {
  return [](const BackendEnvironment& env)
             -> absl::StatusOr<std::unique_ptr<Backend>> {
    tcp::TcpOptions options;
    options.listen = absl::GetFlag(FLAGS_tcp_listen);
    options.advertise_host = absl::GetFlag(FLAGS_tcp_advertise_host);
    options.client.connections_per_peer =
        absl::GetFlag(FLAGS_tcp_connections_per_peer);
    options.client.chunk_bytes = absl::GetFlag(FLAGS_tcp_chunk_bytes);
    options.client.max_in_flight = absl::GetFlag(FLAGS_tcp_max_in_flight);
    options.client.in_flight_bytes = absl::GetFlag(FLAGS_tcp_in_flight_bytes);
    options.client.zero_copy_send = absl::GetFlag(FLAGS_tcp_zero_copy_send);
    options.client.socket_buffer_bytes =
        absl::GetFlag(FLAGS_tcp_socket_buffer_bytes);
    options.server.handshake_timeout =
        absl::GetFlag(FLAGS_tcp_handshake_timeout);
    options.server.idle_timeout = absl::GetFlag(FLAGS_tcp_idle_timeout);
    options.server.request_timeout = absl::GetFlag(FLAGS_tcp_request_timeout);
    options.server.max_connections_per_source =
        absl::GetFlag(FLAGS_tcp_max_connections_per_source);
    options.server.max_connections = absl::GetFlag(FLAGS_tcp_max_connections);
    options.server.threads = absl::GetFlag(FLAGS_tcp_server_threads);
    options.server.bulk_threads = absl::GetFlag(FLAGS_tcp_server_bulk_threads);
    options.client.threads = absl::GetFlag(FLAGS_tcp_client_threads);
    options.client.loops = absl::GetFlag(FLAGS_tcp_client_loops);
    options.client.max_connections =
        absl::GetFlag(FLAGS_tcp_client_max_connections);
    options.client.max_idle_connections =
        absl::GetFlag(FLAGS_tcp_client_max_idle_connections);
    options.client.max_idle_per_peer =
        absl::GetFlag(FLAGS_tcp_client_max_idle_per_peer);
    options.client.idle_timeout = absl::GetFlag(FLAGS_tcp_client_idle_timeout);
    options.client.connect_timeout =
        absl::GetFlag(FLAGS_tcp_client_connect_timeout);
    options.client.no_progress_timeout =
        absl::GetFlag(FLAGS_tcp_no_progress_timeout);
    options.client.allow_host_names = absl::GetFlag(FLAGS_tcp_allow_host_names);
    options.notify.connections_per_peer =
        absl::GetFlag(FLAGS_tcp_notify_connections_per_peer);
    options.notify.max_connections =
        absl::GetFlag(FLAGS_tcp_notify_max_connections);
    if (options.notify.connections_per_peer < 1 ||
        options.notify.max_connections < options.notify.connections_per_peer) {
      return absl::InvalidArgumentError(
          "--tcp_notify_connections_per_peer must be at least 1 and "
          "--tcp_notify_max_connections at least "
          "--tcp_notify_connections_per_peer");
    }
    auto backend = tcp::TcpBackend::Create(std::move(options), env);
    if (!backend.ok()) return backend.status();
    return std::unique_ptr<Backend>(std::move(*backend));
  };
}

}  // namespace rdma_agent

#ifndef RDMA_AGENTD_BACKENDS_TCP_DATA_CLIENT_H_
#define RDMA_AGENTD_BACKENDS_TCP_DATA_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "backends/backend.h"
#include "backends/tcp/socket_util.h"
#include "common/unique_fd.h"

namespace rdma_agent::tcp {

// How a DataClient moves bytes.
struct DataClientOptions {
  // Connections one Submit stripes its chunks over, per peer. Measured on
  // loopback (bench/README.md): 2 beat 1 by ~1.3-2x (two cores copy at
  // once) and 4 gained nothing over 2.
  int connections_per_peer = 2;
  // Largest payload of one request; longer ops are split (<= kMaxPayloadBytes).
  // 1-16 MiB measured alike within noise; 4 MiB stripes a 256 MiB op into 64
  // requests while keeping per-request overhead negligible.
  uint64_t chunk_bytes = 4ull << 20;
  // Requests sent on one connection before their responses arrive.
  int max_in_flight = 16;
  // SO_SNDBUF/SO_RCVBUF of data connections, both ends (0: kernel
  // autotuning). Measured on loopback (bench/README.md): autotuned buffers
  // grow to MiBs, and the bytes a sender copies in are evicted from cache
  // before the receiver copies them out; 256 KiB kept 256 MiB ops at ~1.7-2x
  // the autotuned rate. Enough for a 100 Gb/s path up to ~20 us RTT per
  // connection; raise it (or 0) for longer paths.
  int socket_buffer_bytes = 256 << 10;
  // Send WRITE payloads of at least kSpliceMinBytes with vmsplice/splice
  // (no sender-side copy) when nothing else could deadlock against it. Off
  // by default: on loopback here it cost ~25% more agent CPU per byte than
  // send() (page pinning, and the receiver then copies from cold pages
  // instead of cache-warm socket buffers); worth trying on real NICs.
  bool zero_copy_send = false;
};

// The requesting half of the TCP data plane: runs ops against one peer's
// DataServer over a pool of reusable connections.
//
// Thread-safe. Ops are split into chunks of at most `chunk_bytes`, striped
// over up to `connections_per_peer` connections, and pipelined on each
// connection. Payloads go from the local mapping into the socket and from the
// socket into the local mapping with no intermediate buffer.
class DataClient {
 public:
  explicit DataClient(DataClientOptions options);

  // Runs `ops` against the data server at `peer` and returns one status per
  // op, in order: the serving agent's verdict (e.g. PERMISSION_DENIED,
  // FAILED_PRECONDITION), UNAVAILABLE when a connection could not be made or
  // broke, DEADLINE_EXCEEDED for what was not answered by `deadline`.
  //
  // Returns by `deadline` (plus scheduling slack), and once it has returned
  // nothing it started reads or writes any op's local memory: connections
  // with requests still outstanding are closed, never reused, so late
  // responses are discarded by the kernel.
  std::vector<absl::Status> Run(const HostPort& peer, absl::Span<const Op> ops,
                                absl::Time deadline);

  // Idle pooled connections to `peer` (for tests).
  size_t idle_connections(const HostPort& peer);

  const DataClientOptions& options() const { return options_; }

 private:
  struct Checkout {
    UniqueFd fd;
    bool reused = false;
  };
  absl::StatusOr<Checkout> CheckoutConnection(const HostPort& peer,
                                              bool fresh, absl::Time deadline);
  void ReturnConnection(const HostPort& peer, UniqueFd fd);

  const DataClientOptions options_;
  std::atomic<uint64_t> next_request_id_{1};
  std::mutex mu_;
  std::map<std::string, std::vector<UniqueFd>> idle_;  // guarded by mu_
};

}  // namespace rdma_agent::tcp

#endif  // RDMA_AGENTD_BACKENDS_TCP_DATA_CLIENT_H_

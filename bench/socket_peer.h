#ifndef RDMA_AGENTD_BENCH_SOCKET_PEER_H_
#define RDMA_AGENTD_BENCH_SOCKET_PEER_H_

// The bench's own TCP peer: the references measured without any agent, with
// the same sockets and the same code on both ends as far as possible.
//
//   ping-pong  8-byte request, 8-byte response on one persistent connection
//              with TCP_NODELAY: one round trip between the hosts, the part
//              of the latency floor a data-plane op cannot avoid;
//   sink       N connections streaming bytes from a window of memory into a
//              window of the same size on the peer (cold: the op's size;
//              hot: 1 MiB reused, what iperf3 -l 1M does).
//
// The server runs in the other "host" (compare.sh: `rdma-agent-bench
// --serve_socket_peer=10.77.0.2:7479` in namespace B).

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/unique_fd.h"

namespace rdma_agent::bench {

// Serves ping-pong and sink connections on `listen` ("ipv4:port", port 0 =
// any) until the process ends; each connection on its own thread. Calls
// `on_listening` with the bound "ip:port" once it accepts. Returns only on
// failure to listen.
absl::Status ServeSocketPeer(
    const std::string& listen,
    const std::function<void(const std::string& bound)>& on_listening);

// Starts ServeSocketPeer on 127.0.0.1:0 on a detached thread of this process
// and returns its address (for runs without a second host).
absl::StatusOr<std::string> StartLoopbackSocketPeer();

// One persistent ping-pong connection (TCP_NODELAY on both ends).
class PingPong {
 public:
  static absl::StatusOr<std::unique_ptr<PingPong>> Connect(
      const std::string& peer);
  // Sends 8 bytes and waits for the 8 echoed; the time between.
  absl::StatusOr<absl::Duration> RoundTrip();

 private:
  explicit PingPong(UniqueFd fd) : fd_(std::move(fd)) {}
  UniqueFd fd_;
  uint64_t sequence_ = 0;
};

// `streams` connections at once, each sending `bytes_per_stream` from its own
// window of `window_bytes` (pre-faulted memfd mapping) into a window of the
// same size on the peer, `io_bytes` per send(). Returns the time from the
// first byte sent until every peer confirmed the last received.
absl::StatusOr<absl::Duration> MeasureStreams(const std::string& peer,
                                              int streams,
                                              uint64_t window_bytes,
                                              uint64_t bytes_per_stream,
                                              uint64_t io_bytes);

}  // namespace rdma_agent::bench

#endif  // RDMA_AGENTD_BENCH_SOCKET_PEER_H_

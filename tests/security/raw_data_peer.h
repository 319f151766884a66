#ifndef RDMA_AGENTD_TESTS_SECURITY_RAW_DATA_PEER_H_
#define RDMA_AGENTD_TESTS_SECURITY_RAW_DATA_PEER_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "backends/tcp/wire.h"
#include "common/unique_fd.h"

namespace rdma_agent::testing {

// One connection to an agent's tcp data port spoken by hand
// (backends/tcp/wire.h frames): what an attacker on the network, or a peer
// holding a context, can send. Blocking calls, each bounded by a timeout.
class RawDataConnection {
 public:
  struct Answer {
    tcp::ResponseHeader header;
    std::string message;
  };

  // Connects from `source` (a local address, e.g. 127.0.0.2: on loopback a
  // distinct host as far as the agent's per-source cap goes) to
  // 127.0.0.1:port and reads the server's hello.
  static absl::StatusOr<RawDataConnection> Dial(
      uint16_t port, const std::string& source = "127.0.0.1",
      absl::Duration timeout = absl::Seconds(10));

  RawDataConnection(RawDataConnection&&) = default;
  RawDataConnection& operator=(RawDataConnection&&) = default;

  // Sends all of `bytes` (UNAVAILABLE once the agent has closed).
  absl::Status Send(absl::string_view bytes);
  // A request header, its token and `payload` (which may be shorter than
  // header.length: the rest is then never sent).
  static std::string Request(const tcp::RequestHeader& header,
                             absl::string_view token,
                             absl::string_view payload = "");

  // The next response and its message (a READ's payload is not read).
  absl::StatusOr<Answer> ReadAnswer(absl::Duration timeout);

  // True once the agent has closed the connection (EOF or reset), reading
  // and discarding whatever it still sends; false if it is still open after
  // `timeout`.
  bool WaitClosed(absl::Duration timeout);

  int fd() const { return fd_.get(); }

 private:
  explicit RawDataConnection(UniqueFd fd) : fd_(std::move(fd)) {}
  // Reads exactly `size` bytes by `deadline`.
  absl::Status ReadFull(char* out, size_t size, absl::Time deadline);

  UniqueFd fd_;
};

// A peer that looks like an agent to the tcp data plane and never answers:
// it accepts any number of connections, sends each the server hello, then
// reads and throws away whatever comes. An op against Context() is stuck
// until the agent gives up on it.
class SilentDataPeer {
 public:
  SilentDataPeer();
  ~SilentDataPeer();
  SilentDataPeer(const SilentDataPeer&) = delete;
  SilentDataPeer& operator=(const SilentDataPeer&) = delete;

  uint16_t port() const { return port_; }
  // Connections that have sent something (a request: an op is stuck).
  int talking() const { return talking_; }
  // Connections the agent has closed.
  int closed() const { return closed_; }
  // A serialized remote context naming this peer's data port.
  std::string Context() const;

 private:
  void Serve();

  UniqueFd listener_;
  UniqueFd stop_read_;
  UniqueFd stop_write_;
  uint16_t port_ = 0;
  std::atomic<int> talking_{0};
  std::atomic<int> closed_{0};
  std::thread thread_;
};

}  // namespace rdma_agent::testing

#endif  // RDMA_AGENTD_TESTS_SECURITY_RAW_DATA_PEER_H_

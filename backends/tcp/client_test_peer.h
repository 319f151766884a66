#ifndef RDMA_AGENTD_BACKENDS_TCP_CLIENT_TEST_PEER_H_
#define RDMA_AGENTD_BACKENDS_TCP_CLIENT_TEST_PEER_H_

// Scripted TCP endpoints for testing the requesting side of the data plane:
// listeners that behave like an agent that refuses or stalls, or like some
// other service a forged remote context could name.

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/unique_fd.h"
#include "rdma/agent/v1/remote_buffer.pb.h"

namespace rdma_agent::tcp::testing {

namespace v1 = ::rdma::agent::v1;

// A listener on host:port (port 0: a free one) serving every connection on
// its own thread until destroyed.
class ScriptedPeer {
 public:
  enum class Behavior {
    // Not an agent: accepts and never sends a byte (an HTTP server waiting
    // for its request).
    kSilent,
    // Not an agent: sends a banner at once (an SMTP server).
    kBanner,
    // An agent that knows no buffer: hello, then every request is answered
    // NOT_FOUND (WRITE payloads read and dropped).
    kRefuseAll,
    // An agent that stalls: hello, then reads requests and never answers.
    kStall,
    // An agent gone wrong: hello, then answers every WRITE OK (READs
    // NOT_FOUND), each answer followed, in the same send, by bytes nobody
    // asked for.
    kAnswerThenJunk,
    // An agent that answers the first request of each connection NOT_FOUND
    // (like kRefuseAll), then stalls like kStall.
    kRefuseOnceThenStall,
  };

  // Empty on failure (the test then fails on port() == 0).
  ScriptedPeer(Behavior behavior, const std::string& host = "127.0.0.1",
               uint16_t port = 0);
  ~ScriptedPeer();
  ScriptedPeer(const ScriptedPeer&) = delete;
  ScriptedPeer& operator=(const ScriptedPeer&) = delete;

  uint16_t port() const { return port_; }
  // Bytes received from clients, connections accepted, and connections
  // whose client closed (EOF or reset) so far.
  uint64_t bytes_received() const { return bytes_received_.load(); }
  int accepted() const { return accepted_.load(); }
  int closed_by_client() const { return closed_by_client_.load(); }
  // Requests read (every agent-like behavior).
  int requests() const { return requests_.load(); }

 private:
  void AcceptLoop();
  void Serve(UniqueFd fd);
  // Reads exactly `size` bytes unless stopping or the client closes.
  bool ReadExactly(int fd, void* data, size_t size);

  const Behavior behavior_;
  uint16_t port_ = 0;
  UniqueFd listener_;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> bytes_received_{0};
  std::atomic<int> accepted_{0};
  std::atomic<int> closed_by_client_{0};
  std::atomic<int> requests_{0};
  std::thread accept_thread_;
  absl::Mutex mu_;
  std::vector<std::thread> connections_ ABSL_GUARDED_BY(mu_);
};

// A remote context naming buffer 1 of a tcp endpoint at host:port.
std::shared_ptr<v1::RemoteBuffer> ContextFor(const std::string& host,
                                             uint16_t port, uint64_t size);

// A port on 127.0.0.1 nobody listens on (bound, then closed).
uint16_t ClosedPort();

// Open file descriptors of this process.
int OpenFds();
// Threads of this process.
int Threads();

}  // namespace rdma_agent::tcp::testing

#endif  // RDMA_AGENTD_BACKENDS_TCP_CLIENT_TEST_PEER_H_

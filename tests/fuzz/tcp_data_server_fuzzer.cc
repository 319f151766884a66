// Fuzz target: the byte stream a peer sends to the tcp data plane, fed to a
// real DataServer (its request loop, ResolveForPeer, payload reads and
// writes, refusals) over a loopback connection, through its public Start API.
// The server serves one read-only and one read-write buffer; the seed corpus
// carries well-formed requests for both so that mutations reach the payload
// paths, and kNotify frames with and without valid tokens (to either
// buffer, within and beyond the notification size, announcing payloads
// never sent).
//
// Oracle: no crash or undefined behaviour in the server; a hello, if it
// greets, is valid; it answers only with well-formed responses, always ends the
// connection after the peer has (never hangs), and never changes the
// read-only buffer; the server lets go of the connection (and runs no thread
// for it) once the peer has closed. The sink is handed only notifications
// whose target the server proved first (token, then WRITE access), never a
// payload longer than the sender id and kMaxNotificationBytes.
#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>

#include "absl/time/clock.h"
#include "backends/buffer_table.h"
#include "backends/registration.h"
#include "backends/tcp/data_server.h"
#include "backends/tcp/socket_util.h"
#include "backends/tcp/wire.h"
#include "common/shared_memory.h"
#include "tests/fuzz/fuzz_check.h"

namespace rdma_agent::tcp {
namespace {

// Must match tests/fuzz/make_seed_corpus.py.
constexpr uint64_t kEpoch = 77;
constexpr uint64_t kReadOnlyId = 5;
constexpr uint64_t kReadWriteId = 6;
constexpr uint64_t kSize = 4096;
constexpr char kToken[] = "fuzz-token-0123456789";
// The sink's max_bytes() (the agent's --max_notification_bytes).
constexpr size_t kMaxNotificationBytes = 4096;

// Threads of this process now (the kernel's count).
int ThreadCount() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  }
  return -1;
}

// Takes notifications as the agent's inbox does (the target proven, then
// the length), and checks that the server proved the target before handing
// it over: in the fuzzer no buffer goes away, so every target must pass.
class CountingSink : public NotificationSink {
 public:
  explicit CountingSink(const BufferDirectory* directory)
      : directory_(directory) {}
  absl::Status Deliver(const ServeRequest& target,
                       absl::string_view from_agent_id,
                       absl::string_view data) override {
    auto registration = directory_->ResolveForNotification(target);
    FUZZ_CHECK(registration.ok());
    FUZZ_CHECK((*registration)->writable());
    // The payload the server gathered was bounded by max_bytes().
    FUZZ_CHECK(2 + from_agent_id.size() + data.size() <=
               2 + kMaxTokenBytes + kMaxNotificationBytes);
    if (data.size() > kMaxNotificationBytes) {
      return absl::InvalidArgumentError("notification too long");
    }
    accepted_.fetch_add(1);
    return absl::OkStatus();
  }
  size_t max_bytes() const override { return kMaxNotificationBytes; }

 private:
  const BufferDirectory* const directory_;
  std::atomic<uint64_t> accepted_{0};
};

struct Fixture {
  BufferTable directory{kEpoch};
  CountingSink notifications{&directory};
  // Threads while no connection is served: the server's accept thread, its
  // event loops and whatever the fuzzing engine runs.
  int idle_threads = 0;
  std::shared_ptr<Registration> read_only;
  std::string read_only_bytes;
  std::unique_ptr<DataServer> server;
};

std::shared_ptr<Registration> NewBuffer(uint64_t id, v1::Access access) {
  auto memory = SharedMemory::Allocate(kSize, "fuzz");
  FUZZ_CHECK(memory.ok());
  auto registration = std::make_shared<Registration>(
      id, 0, access, "fuzz", kToken, std::move(*memory), true);
  for (uint64_t i = 0; i < kSize; ++i) {
    registration->data()[i] = static_cast<std::byte>(i * 13 + id);
  }
  return registration;
}

Fixture& TheFixture() {
  static Fixture* fixture = [] {
    auto* f = new Fixture;
    f->read_only = NewBuffer(kReadOnlyId, v1::ACCESS_READ);
    f->read_only_bytes.assign(
        reinterpret_cast<const char*>(f->read_only->data()), kSize);
    f->directory.Add(f->read_only);
    f->directory.Add(NewBuffer(kReadWriteId, v1::ACCESS_READ_WRITE));
    DataServerOptions options;
    options.notifications = &f->notifications;
    auto server =
        DataServer::Start(HostPort{"127.0.0.1", 0}, &f->directory, options);
    FUZZ_CHECK(server.ok());
    f->server = std::move(*server);
    f->idle_threads = ThreadCount();
    return f;
  }();
  return *fixture;
}

// Sends `input` while draining what the server answers (so that neither side
// blocks on a full socket buffer), half-closes and reads until the server
// closes. Returns everything that came back; `*reset` when the
// connection ended with a reset (then answers may be cut short).
std::string Exchange(int fd, const std::string& input, bool* reset) {
  std::string received;
  size_t sent = 0;
  bool write_open = true;
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  char buffer[65536];
  *reset = false;
  while (true) {
    if (write_open && sent == input.size()) {
      ::shutdown(fd, SHUT_WR);
      write_open = false;
    }
    pollfd p{fd, static_cast<short>(POLLIN | (write_open ? POLLOUT : 0)), 0};
    const int ready = ::poll(&p, 1, 100);
    // A server that neither answers nor closes is a bug (a hang).
    FUZZ_CHECK(absl::Now() < deadline);
    if (ready <= 0) continue;
    if (p.revents & (POLLIN | POLLHUP | POLLERR)) {
      const ssize_t n = ::recv(fd, buffer, sizeof(buffer), MSG_DONTWAIT);
      if (n > 0) {
        received.append(buffer, static_cast<size_t>(n));
      } else if (n == 0) {
        return received;
      } else if (errno != EAGAIN && errno != EINTR) {
        *reset = true;
        return received;
      }
    }
    if (write_open && (p.revents & POLLOUT)) {
      const ssize_t n = ::send(fd, input.data() + sent, input.size() - sent,
                               MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        sent += static_cast<size_t>(n);
      } else if (n < 0 && errno != EAGAIN && errno != EINTR) {
        // The server dropped the connection (e.g. a bad header); keep
        // reading whatever it answered before.
        ::shutdown(fd, SHUT_WR);
        write_open = false;
      }
    }
  }
}

// Every response the server sent is well formed; with a clean close, the
// stream ends on a frame boundary.
void CheckResponses(const std::string& stream, bool reset) {
  size_t at = 0;
  while (stream.size() - at >= kResponseHeaderBytes) {
    auto header = DecodeResponseHeader(
        reinterpret_cast<const std::byte*>(stream.data() + at));
    FUZZ_CHECK(header.ok());
    // Payloads come only with OK answers, and OK answers carry no message.
    FUZZ_CHECK(header->code == 0 || header->payload_bytes == 0);
    FUZZ_CHECK(header->code != 0 || header->message_bytes == 0);
    at += kResponseHeaderBytes;
    const uint64_t rest = header->message_bytes + header->payload_bytes;
    if (stream.size() - at < rest) {
      FUZZ_CHECK(reset);
      return;
    }
    at += rest;
  }
  FUZZ_CHECK(reset || at == stream.size());
}

void FuzzOne(const std::string& input) {
  Fixture& fixture = TheFixture();
  auto fd = DialTcp(HostPort{"127.0.0.1", fixture.server->port()},
                    absl::Now() + absl::Seconds(10));
  FUZZ_CHECK(fd.ok());
  bool reset = false;
  std::string answers = Exchange(fd->get(), input, &reset);
  // Servers that greet (wire.h) start with a hello; its magic is not a
  // response's, so both kinds of server are checked the same way.
  std::byte ours[kServerHelloBytes];
  EncodeServerHello(ours);
  if (answers.size() >= 4 && std::memcmp(answers.data(), ours, 4) == 0) {
    FUZZ_CHECK(answers.size() >= kServerHelloBytes || reset);
    if (answers.size() >= kServerHelloBytes) {
      FUZZ_CHECK(
          DecodeServerHello(reinterpret_cast<const std::byte*>(answers.data()))
              .ok());
    }
    answers.erase(0, kServerHelloBytes);
  }
  CheckResponses(answers, reset);
  FUZZ_CHECK(std::memcmp(fixture.read_only->data(),
                         fixture.read_only_bytes.data(), kSize) == 0);
  // The server drops the connection (its buffers, the registration it
  // pinned) once the peer has closed, and never starts a thread for one.
  // Waiting for it also keeps its allocations out of the next input's
  // accounting, which the leak check relies on.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (fixture.server->connections() > 0) {
    FUZZ_CHECK(absl::Now() < deadline);
    absl::SleepFor(absl::Microseconds(20));
  }
  FUZZ_CHECK(ThreadCount() <= fixture.idle_threads);
  // Close with a reset: a million connections must not leave a million
  // TIME_WAIT entries behind.
  const linger abort_on_close{1, 0};
  ::setsockopt(fd->get(), SOL_SOCKET, SO_LINGER, &abort_on_close,
               sizeof(abort_on_close));
}

}  // namespace
}  // namespace rdma_agent::tcp

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  rdma_agent::tcp::FuzzOne(
      std::string(reinterpret_cast<const char*>(data), size));
  return 0;
}

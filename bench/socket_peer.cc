#include "bench/socket_peer.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <future>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/shared_memory.h"

namespace rdma_agent::bench {
namespace {

constexpr char kModePingPong = 'P';
constexpr char kModeSink = 'S';

absl::Status Errno(const std::string& what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", strerror(errno)));
}

absl::StatusOr<sockaddr_in> ParseAddress(const std::string& text) {
  const size_t colon = text.rfind(':');
  sockaddr_in address{};
  address.sin_family = AF_INET;
  int port = 0;
  if (colon == std::string::npos ||
      inet_pton(AF_INET, text.substr(0, colon).c_str(), &address.sin_addr) !=
          1 ||
      !absl::SimpleAtoi(text.substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("not an ipv4:port address: ", text));
  }
  address.sin_port = htons(static_cast<uint16_t>(port));
  return address;
}

void SetNoDelay(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Sends or receives exactly `length` bytes.
bool SendAll(int fd, const void* data, size_t length) {
  const char* p = static_cast<const char*>(data);
  while (length > 0) {
    const ssize_t n = send(fd, p, length, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    length -= n;
  }
  return true;
}

bool RecvAll(int fd, void* data, size_t length) {
  char* p = static_cast<char*>(data);
  while (length > 0) {
    const ssize_t n = recv(fd, p, length, MSG_WAITALL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    length -= n;
  }
  return true;
}

absl::StatusOr<SharedMemory> PrefaultedWindow(uint64_t bytes, char fill) {
  auto window = SharedMemory::Allocate(bytes, "bench-socket");
  if (!window.ok()) return window.status();
  std::fill_n(window->data(), bytes, std::byte{static_cast<uint8_t>(fill)});
  return window;
}

void ServePingPong(int fd) {
  SetNoDelay(fd);
  char message[8];
  while (RecvAll(fd, message, sizeof(message)) &&
         SendAll(fd, message, sizeof(message))) {
  }
}

// Receives into a window of the size the client names until it shuts its
// side down, then answers with the byte count.
void ServeSink(int fd) {
  uint64_t window_bytes = 0;
  if (!RecvAll(fd, &window_bytes, sizeof(window_bytes)) || window_bytes == 0 ||
      window_bytes > (uint64_t{1} << 34)) {
    return;
  }
  auto window = PrefaultedWindow(window_bytes, 2);
  const char ready = window.ok() ? 1 : 0;
  if (!SendAll(fd, &ready, 1) || !window.ok()) return;
  uint64_t received = 0;
  for (uint64_t offset = 0;;) {
    const ssize_t n =
        recv(fd, window->data() + offset, window_bytes - offset, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    received += n;
    offset = (offset + n) % window_bytes;
  }
  SendAll(fd, &received, sizeof(received));
}

void ServeConnection(UniqueFd fd) {
  char mode = 0;
  if (!RecvAll(fd.get(), &mode, 1)) return;
  if (mode == kModePingPong) ServePingPong(fd.get());
  if (mode == kModeSink) ServeSink(fd.get());
}

absl::StatusOr<UniqueFd> Dial(const std::string& peer, char mode) {
  auto address = ParseAddress(peer);
  if (!address.ok()) return address.status();
  UniqueFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) return Errno("socket");
  if (connect(fd.get(), reinterpret_cast<const sockaddr*>(&*address),
              sizeof(*address)) != 0) {
    return Errno(absl::StrCat("connect ", peer));
  }
  SetNoDelay(fd.get());
  if (!SendAll(fd.get(), &mode, 1)) return Errno("send mode");
  return fd;
}

// One sink stream: announces the window, waits for the peer's, sends.
struct Stream {
  UniqueFd fd;
  SharedMemory window;
};

absl::StatusOr<Stream> OpenSinkStream(const std::string& peer,
                                      uint64_t window_bytes) {
  auto fd = Dial(peer, kModeSink);
  if (!fd.ok()) return fd.status();
  auto window = PrefaultedWindow(window_bytes, 1);
  if (!window.ok()) return window.status();
  char ready = 0;
  if (!SendAll(fd->get(), &window_bytes, sizeof(window_bytes)) ||
      !RecvAll(fd->get(), &ready, 1) || ready != 1) {
    return absl::UnavailableError("sink peer refused the window");
  }
  return Stream{std::move(*fd), std::move(*window)};
}

// Sends `total` bytes cycling through the window, then waits for the count.
bool RunSinkStream(Stream& stream, uint64_t total, uint64_t io_bytes) {
  const uint64_t window = stream.window.size();
  for (uint64_t sent = 0, offset = 0; sent < total;) {
    const uint64_t length = std::min({io_bytes, window - offset, total - sent});
    const ssize_t n = send(stream.fd.get(), stream.window.data() + offset,
                           length, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    sent += n;
    offset = (offset + n) % window;
  }
  shutdown(stream.fd.get(), SHUT_WR);
  uint64_t received = 0;
  return RecvAll(stream.fd.get(), &received, sizeof(received)) &&
         received == total;
}

}  // namespace

absl::Status ServeSocketPeer(
    const std::string& listen_address,
    const std::function<void(const std::string& bound)>& on_listening) {
  auto address = ParseAddress(listen_address);
  if (!address.ok()) return address.status();
  UniqueFd listener(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  const int one = 1;
  setsockopt(listener.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  socklen_t length = sizeof(*address);
  if (!listener ||
      bind(listener.get(), reinterpret_cast<sockaddr*>(&*address),
           sizeof(*address)) != 0 ||
      listen(listener.get(), 64) != 0 ||
      getsockname(listener.get(), reinterpret_cast<sockaddr*>(&*address),
                  &length) != 0) {
    return Errno(absl::StrCat("listen on ", listen_address));
  }
  char host[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &address->sin_addr, host, sizeof(host));
  on_listening(absl::StrCat(host, ":", ntohs(address->sin_port)));
  for (;;) {
    UniqueFd fd(accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!fd) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      return Errno("accept");
    }
    std::thread(ServeConnection, std::move(fd)).detach();
  }
}

absl::StatusOr<std::string> StartLoopbackSocketPeer() {
  auto bound = std::make_shared<std::promise<absl::StatusOr<std::string>>>();
  std::future<absl::StatusOr<std::string>> result = bound->get_future();
  std::thread([bound] {
    bool announced = false;
    absl::Status status =
        ServeSocketPeer("127.0.0.1:0", [&](const std::string& address) {
          announced = true;
          bound->set_value(address);
        });
    if (!announced) bound->set_value(status);
  }).detach();
  return result.get();
}

absl::StatusOr<std::unique_ptr<PingPong>> PingPong::Connect(
    const std::string& peer) {
  auto fd = Dial(peer, kModePingPong);
  if (!fd.ok()) return fd.status();
  return std::unique_ptr<PingPong>(new PingPong(std::move(*fd)));
}

absl::StatusOr<absl::Duration> PingPong::RoundTrip() {
  uint64_t message = ++sequence_;
  const absl::Time start = absl::Now();
  if (!SendAll(fd_.get(), &message, sizeof(message)) ||
      !RecvAll(fd_.get(), &message, sizeof(message))) {
    return Errno("ping-pong");
  }
  const absl::Duration elapsed = absl::Now() - start;
  if (message != sequence_) return absl::DataLossError("ping-pong: bad echo");
  return elapsed;
}

absl::StatusOr<absl::Duration> MeasureStreams(const std::string& peer,
                                              int streams,
                                              uint64_t window_bytes,
                                              uint64_t bytes_per_stream,
                                              uint64_t io_bytes) {
  std::vector<Stream> open;
  for (int i = 0; i < streams; ++i) {
    auto stream = OpenSinkStream(peer, window_bytes);
    if (!stream.ok()) return stream.status();
    open.push_back(std::move(*stream));
  }
  std::vector<char> ok(open.size(), 0);
  const absl::Time start = absl::Now();
  std::vector<std::thread> threads;
  for (size_t i = 0; i < open.size(); ++i) {
    threads.emplace_back(
        [&, i] { ok[i] = RunSinkStream(open[i], bytes_per_stream, io_bytes); });
  }
  for (std::thread& thread : threads) thread.join();
  const absl::Duration elapsed = absl::Now() - start;
  if (std::find(ok.begin(), ok.end(), 0) != ok.end()) {
    return absl::UnavailableError("a sink stream broke");
  }
  return elapsed;
}

}  // namespace rdma_agent::bench

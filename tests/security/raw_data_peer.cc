#include "tests/security/raw_data_peer.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "rdma/agent/v1/remote_buffer.pb.h"

namespace rdma_agent::testing {
namespace {

// Waits until `fd` is ready for `events` by `deadline`.
bool WaitReady(int fd, short events, absl::Time deadline) {
  while (true) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return false;
    pollfd p{fd, events, 0};
    const int ready =
        poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1);
    if (ready > 0) return true;
    if (ready < 0 && errno != EINTR) return false;
  }
}

}  // namespace

absl::StatusOr<RawDataConnection> RawDataConnection::Dial(
    uint16_t port, const std::string& source, absl::Duration timeout) {
  UniqueFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) return absl::InternalError(absl::StrCat("socket: ", errno));
  sockaddr_in from{};
  from.sin_family = AF_INET;
  if (inet_pton(AF_INET, source.c_str(), &from.sin_addr) != 1 ||
      bind(fd.get(), reinterpret_cast<sockaddr*>(&from), sizeof(from)) != 0) {
    return absl::InternalError(
        absl::StrCat("bind ", source, ": ", std::strerror(errno)));
  }
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(port);
  inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
  if (connect(fd.get(), reinterpret_cast<sockaddr*>(&to), sizeof(to)) != 0) {
    return absl::UnavailableError(
        absl::StrCat("connect: ", std::strerror(errno)));
  }
  // A send the agent neither reads nor refuses must not hang the test.
  const timeval send_timeout{10, 0};
  setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &send_timeout,
             sizeof(send_timeout));
  RawDataConnection connection(std::move(fd));
  char hello[tcp::kServerHelloBytes];
  absl::Status read =
      connection.ReadFull(hello, sizeof(hello), absl::Now() + timeout);
  if (!read.ok()) return read;
  absl::Status valid =
      tcp::DecodeServerHello(reinterpret_cast<const std::byte*>(hello));
  if (!valid.ok()) return valid;
  return connection;
}

std::string RawDataConnection::Request(const tcp::RequestHeader& header,
                                       absl::string_view token,
                                       absl::string_view payload) {
  std::string bytes(tcp::kRequestHeaderBytes, '\0');
  tcp::EncodeRequestHeader(header, reinterpret_cast<std::byte*>(bytes.data()));
  absl::StrAppend(&bytes, token, payload);
  return bytes;
}

absl::Status RawDataConnection::Send(absl::string_view bytes) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n =
        send(fd_.get(), bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::UnavailableError(
          absl::StrCat("send: ", std::strerror(errno)));
    }
    sent += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status RawDataConnection::ReadFull(char* out, size_t size,
                                         absl::Time deadline) {
  size_t got = 0;
  while (got < size) {
    if (!WaitReady(fd_.get(), POLLIN, deadline)) {
      return absl::DeadlineExceededError("nothing to read in time");
    }
    const ssize_t n = recv(fd_.get(), out + got, size - got, MSG_DONTWAIT);
    if (n == 0) return absl::UnavailableError("closed by the agent");
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      return absl::UnavailableError(
          absl::StrCat("recv: ", std::strerror(errno)));
    }
    got += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::StatusOr<RawDataConnection::Answer> RawDataConnection::ReadAnswer(
    absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  char header[tcp::kResponseHeaderBytes];
  absl::Status read = ReadFull(header, sizeof(header), deadline);
  if (!read.ok()) return read;
  auto decoded =
      tcp::DecodeResponseHeader(reinterpret_cast<const std::byte*>(header));
  if (!decoded.ok()) return decoded.status();
  Answer answer;
  answer.header = *decoded;
  answer.message.resize(decoded->message_bytes);
  read = ReadFull(answer.message.data(), answer.message.size(), deadline);
  if (!read.ok()) return read;
  return answer;
}

bool RawDataConnection::WaitClosed(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  char sink[65536];
  while (true) {
    if (!WaitReady(fd_.get(), POLLIN, deadline)) return false;
    const ssize_t n = recv(fd_.get(), sink, sizeof(sink), MSG_DONTWAIT);
    if (n == 0) return true;
    if (n < 0 && errno != EAGAIN && errno != EINTR) return true;
  }
}

SilentDataPeer::SilentDataPeer() {
  listener_.reset(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in address = {};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  if (::bind(listener_.get(), reinterpret_cast<sockaddr*>(&address),
             sizeof(address)) != 0 ||
      ::listen(listener_.get(), 64) != 0 ||
      ::getsockname(listener_.get(), reinterpret_cast<sockaddr*>(&address),
                    &length) != 0) {
    std::perror("SilentDataPeer listener");
    std::abort();
  }
  port_ = ntohs(address.sin_port);
  int ends[2];
  if (::pipe2(ends, O_CLOEXEC) != 0) {
    std::perror("SilentDataPeer pipe");
    std::abort();
  }
  stop_read_.reset(ends[0]);
  stop_write_.reset(ends[1]);
  thread_ = std::thread([this] { Serve(); });
}

SilentDataPeer::~SilentDataPeer() {
  (void)::write(stop_write_.get(), "x", 1);
  thread_.join();
}

std::string SilentDataPeer::Context() const {
  ::rdma::agent::v1::RemoteBuffer remote;
  remote.set_agent_id("agent-silent");
  remote.set_agent_epoch(7);
  remote.set_buffer_id(1);
  remote.set_size_bytes(1 << 20);
  remote.set_access(::rdma::agent::v1::ACCESS_READ_WRITE);
  remote.set_token(std::string(16, 't'));
  ::rdma::agent::v1::BackendEndpoint* endpoint = remote.add_endpoints();
  endpoint->set_backend("tcp");
  endpoint->mutable_tcp()->set_host("127.0.0.1");
  endpoint->mutable_tcp()->set_port(port_);
  return remote.SerializeAsString();
}

void SilentDataPeer::Serve() {
  std::vector<UniqueFd> connections;
  std::vector<bool> heard;
  char buffer[65536];
  while (true) {
    std::vector<pollfd> fds = {{stop_read_.get(), POLLIN, 0},
                               {listener_.get(), POLLIN, 0}};
    for (const UniqueFd& connection : connections) {
      fds.push_back({connection.get(), POLLIN, 0});
    }
    if (::poll(fds.data(), fds.size(), 1000) < 0) continue;
    if (fds[0].revents != 0) return;
    if (fds[1].revents & POLLIN) {
      UniqueFd connection(
          ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (connection) {
        std::byte hello[tcp::kServerHelloBytes];
        tcp::EncodeServerHello(hello);
        (void)::send(connection.get(), hello, sizeof(hello), MSG_NOSIGNAL);
        connections.push_back(std::move(connection));
        heard.push_back(false);
      }
    }
    // Only the connections polled above (fds[i + 2]); an accepted one is
    // polled from the next turn.
    const size_t polled = fds.size() - 2;
    std::vector<size_t> gone;
    for (size_t i = 0; i < polled; ++i) {
      if ((fds[i + 2].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      const ssize_t n =
          ::recv(connections[i].get(), buffer, sizeof(buffer), MSG_DONTWAIT);
      if (n > 0 && !heard[i]) {
        heard[i] = true;
        ++talking_;
      }
      // Closed by the agent (the op ended), or reset: no longer polled.
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
        if (n == 0) ++closed_;
        gone.push_back(i);
      }
    }
    for (auto it = gone.rbegin(); it != gone.rend(); ++it) {
      connections.erase(connections.begin() + static_cast<ptrdiff_t>(*it));
      heard.erase(heard.begin() + static_cast<ptrdiff_t>(*it));
    }
  }
}

}  // namespace rdma_agent::testing

#include "tests/security/raw_data_peer.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

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

}  // namespace rdma_agent::testing

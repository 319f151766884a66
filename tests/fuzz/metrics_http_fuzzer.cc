// Fuzz target: what a stranger sends to the metrics endpoint
// (--metrics_listen). Every input goes to ParseHttpRequestHead, then, as a
// whole connection's bytes, to a real MetricsServer over loopback.
//
// Oracle: no crash and no read outside the input (the parser gets a heap
// copy of exactly its size); a complete head is a prefix of the input ending
// in a blank line, with an upper-case method and a visible-ASCII origin-form
// path, and parses the same alone; more bytes never turn a refusal or a
// complete head into something else; the server answers exactly the status
// the parse calls for (nothing for an unfinished request) and still answers
// /healthz afterwards.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/unique_fd.h"
#include "daemon/metrics/http_request.h"
#include "daemon/metrics/metrics.h"
#include "daemon/metrics/metrics_server.h"
#include "tests/fuzz/fuzz_check.h"

namespace rdma_agent {
namespace {

using State = HttpRequestHead::State;

// As the endpoint reads heads.
constexpr size_t kMaxHeadBytes = 8192;

HttpRequestHead Parse(const uint8_t* data, size_t size) {
  // A heap copy of exactly the input, so that ASan sees any read past it.
  auto copy = std::make_unique<char[]>(size == 0 ? 1 : size);
  if (size > 0) std::memcpy(copy.get(), data, size);
  return ParseHttpRequestHead(absl::string_view(copy.get(), size),
                              kMaxHeadBytes);
}

void CheckHead(const HttpRequestHead& head, absl::string_view input) {
  if (head.state != State::kComplete) return;
  FUZZ_CHECK(head.head_bytes >= 2 && head.head_bytes <= input.size() &&
             head.head_bytes <= kMaxHeadBytes);
  const absl::string_view bytes = input.substr(0, head.head_bytes);
  FUZZ_CHECK(absl::EndsWith(bytes, "\n\n") || absl::EndsWith(bytes, "\n\r\n"));
  FUZZ_CHECK(!head.method.empty() && head.method.size() <= 16);
  for (char c : head.method) FUZZ_CHECK(c >= 'A' && c <= 'Z');
  FUZZ_CHECK(!head.path.empty() && head.path[0] == '/');
  for (char c : head.path) {
    FUZZ_CHECK(c > 0x20 && c < 0x7f && c != '?' && c != '#');
  }
}

// The status the endpoint must answer for a parse; 0: no answer (the client
// ended before a whole head).
int ExpectedStatus(const HttpRequestHead& head) {
  switch (head.state) {
    case State::kIncomplete:
      return 0;
    case State::kBad:
      return 400;
    case State::kTooLarge:
      return 431;
    case State::kComplete:
      break;
  }
  if (head.method != "GET" && head.method != "HEAD") return 405;
  if (head.path == "/healthz" || head.path == "/metrics") return 200;
  return 404;
}

UniqueFd Connect(uint16_t port) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  FUZZ_CHECK(fd.valid());
  sockaddr_in address = {};
  address.sin_family = AF_INET;
  address.sin_port = htons(port);
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  FUZZ_CHECK(::connect(fd.get(), reinterpret_cast<sockaddr*>(&address),
                       sizeof(address)) == 0);
  return fd;
}

// Sends `request`, ends the sending side, and reads until the endpoint
// closes (it must, within its 5 s request timeout).
std::string Exchange(uint16_t port, absl::string_view request) {
  UniqueFd fd = Connect(port);
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = ::send(fd.get(), request.data() + sent,
                             request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;  // the endpoint may answer and close early
    sent += static_cast<size_t>(n);
  }
  ::shutdown(fd.get(), SHUT_WR);
  std::string answer;
  char chunk[16384];
  while (true) {
    pollfd p = {fd.get(), POLLIN, 0};
    FUZZ_CHECK(::poll(&p, 1, 10000) == 1);
    const ssize_t n = ::recv(fd.get(), chunk, sizeof(chunk), 0);
    if (n <= 0) break;
    answer.append(chunk, static_cast<size_t>(n));
  }
  return answer;
}

uint16_t ServerPort() {
  static AgentMetrics* const metrics = new AgentMetrics("fuzz", "unknown");
  static MetricsServer* const server = [] {
    MetricsOptions options;
    options.request_timeout = absl::Seconds(5);
    auto started = MetricsServer::Start("127.0.0.1:0", options, metrics,
                                        [] { return true; });
    FUZZ_CHECK(started.ok());
    return started->release();
  }();
  return server->port();
}

}  // namespace
}  // namespace rdma_agent

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace rdma_agent;
  const absl::string_view input(reinterpret_cast<const char*>(data), size);
  const HttpRequestHead head = Parse(data, size);
  CheckHead(head, input);
  if (head.state == State::kComplete) {
    // The head alone parses the same.
    const HttpRequestHead alone = Parse(data, head.head_bytes);
    FUZZ_CHECK(alone.state == State::kComplete && alone.method == head.method &&
               alone.path == head.path && alone.head_bytes == head.head_bytes);
  }
  // A prefix is undecided, or decided as the whole is.
  const HttpRequestHead half = Parse(data, size / 2);
  if (half.state == State::kBad) FUZZ_CHECK(head.state == State::kBad);
  if (half.state == State::kComplete) {
    FUZZ_CHECK(head.state == State::kComplete &&
               head.head_bytes == half.head_bytes);
  }

  const uint16_t port = ServerPort();
  const std::string answer = Exchange(port, input);
  const int expected = ExpectedStatus(head);
  if (expected == 0) {
    FUZZ_CHECK(answer.empty());
  } else {
    FUZZ_CHECK(
        absl::StartsWith(answer, absl::StrCat("HTTP/1.1 ", expected, " ")));
    FUZZ_CHECK(absl::StrContains(answer, "\r\nConnection: close\r\n\r\n"));
  }
  // Whatever came before, the probe is answered.
  FUZZ_CHECK(absl::StartsWith(Exchange(port, "GET /healthz HTTP/1.1\r\n\r\n"),
                              "HTTP/1.1 200 "));
  return 0;
}

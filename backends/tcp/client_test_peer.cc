#include "backends/tcp/client_test_peer.h"

#include <dirent.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <utility>

#include "backends/tcp/socket_util.h"
#include "backends/tcp/wire.h"

namespace rdma_agent::tcp::testing {
namespace {

// How often blocked loops look at `stopping_`.
constexpr int kPollMs = 20;

int CountEntries(const char* dir) {
  DIR* d = opendir(dir);
  if (d == nullptr) return -1;
  int count = 0;
  while (dirent* entry = readdir(d)) {
    if (entry->d_name[0] != '.') ++count;
  }
  closedir(d);
  return count;
}

}  // namespace

ScriptedPeer::ScriptedPeer(Behavior behavior, const std::string& host,
                           uint16_t port)
    : behavior_(behavior) {
  auto listener = ListenTcp({host, port}, &port_);
  if (!listener.ok()) {
    port_ = 0;
    return;
  }
  listener_ = std::move(*listener);
  accept_thread_ = std::thread([this] { AcceptLoop(); });
}

ScriptedPeer::~ScriptedPeer() {
  stopping_ = true;
  if (accept_thread_.joinable()) accept_thread_.join();
  absl::MutexLock lock(&mu_);
  for (std::thread& connection : connections_) connection.join();
}

void ScriptedPeer::AcceptLoop() {
  while (!stopping_) {
    pollfd p{listener_.get(), POLLIN, 0};
    if (poll(&p, 1, kPollMs) <= 0) continue;
    UniqueFd fd(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!fd) continue;
    ++accepted_;
    absl::MutexLock lock(&mu_);
    connections_.emplace_back(
        [this, fd = std::move(fd)]() mutable { Serve(std::move(fd)); });
  }
}

bool ScriptedPeer::ReadExactly(int fd, void* data, size_t size) {
  auto* p = static_cast<char*>(data);
  while (size > 0) {
    if (stopping_) return false;
    pollfd poller{fd, POLLIN, 0};
    if (poll(&poller, 1, kPollMs) <= 0) continue;
    const ssize_t n = recv(fd, p, size, MSG_DONTWAIT);
    if (n <= 0) {
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      ++closed_by_client_;
      return false;
    }
    bytes_received_ += static_cast<uint64_t>(n);
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

void ScriptedPeer::Serve(UniqueFd fd) {
  const int conn = fd.get();
  switch (behavior_) {
    case Behavior::kSilent:
      break;
    case Behavior::kBanner: {
      const char banner[] = "220 mail.example ESMTP ready\r\n";
      (void)send(conn, banner, sizeof(banner) - 1, MSG_NOSIGNAL);
      break;
    }
    case Behavior::kRefuseAll:
    case Behavior::kStall:
    case Behavior::kAnswerThenJunk:
    case Behavior::kRefuseOnceThenStall: {
      std::byte hello[kServerHelloBytes];
      EncodeServerHello(hello);
      (void)send(conn, hello, sizeof(hello), MSG_NOSIGNAL);
      std::byte header_bytes[kRequestHeaderBytes];
      int answered = 0;  // on this connection
      while (ReadExactly(conn, header_bytes, sizeof(header_bytes))) {
        auto header = DecodeRequestHeader(header_bytes);
        if (!header.ok()) break;
        std::string rest(header->token_bytes, '\0');
        if (!ReadExactly(conn, rest.data(), rest.size())) break;
        std::string payload(64 << 10, '\0');
        uint64_t left =
            header->kind == RequestKind::kWrite ? header->length : 0;
        bool ok = true;
        while (ok && left > 0) {
          const size_t n =
              static_cast<size_t>(std::min<uint64_t>(left, payload.size()));
          ok = ReadExactly(conn, payload.data(), n);
          left -= n;
        }
        if (!ok) break;
        ++requests_;
        if (behavior_ == Behavior::kStall) continue;
        if (behavior_ == Behavior::kRefuseOnceThenStall && answered > 0) {
          continue;
        }
        ++answered;
        const bool accept = behavior_ == Behavior::kAnswerThenJunk &&
                            header->kind == RequestKind::kWrite;
        const std::string message = accept ? "" : "unknown buffer";
        ResponseHeader response;
        response.request_id = header->request_id;
        response.code =
            accept ? 0 : static_cast<uint32_t>(absl::StatusCode::kNotFound);
        response.message_bytes = static_cast<uint32_t>(message.size());
        std::byte response_bytes[kResponseHeaderBytes];
        EncodeResponseHeader(response, response_bytes);
        std::string junk =
            behavior_ == Behavior::kAnswerThenJunk ? "JUNKJUNK" : "";
        iovec iov[3] = {{response_bytes, sizeof(response_bytes)},
                        {const_cast<char*>(message.data()), message.size()},
                        {junk.data(), junk.size()}};
        if (!WriteFull(conn, iov, 3).ok()) break;
      }
      break;
    }
  }
  // Silent, banner, stalled: hold the connection until the client closes it
  // (counted) or the peer stops; log what the client sent meanwhile.
  char sink[4096];
  while (!stopping_) {
    pollfd p{conn, POLLIN, 0};
    if (poll(&p, 1, kPollMs) <= 0) continue;
    const ssize_t n = recv(conn, sink, sizeof(sink), MSG_DONTWAIT);
    if (n > 0) {
      bytes_received_ += static_cast<uint64_t>(n);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    ++closed_by_client_;
    break;
  }
}

std::shared_ptr<v1::RemoteBuffer> ContextFor(const std::string& host,
                                             uint16_t port, uint64_t size) {
  auto context = std::make_shared<v1::RemoteBuffer>();
  context->set_agent_id("forged");
  context->set_agent_epoch(5);
  context->set_buffer_id(1);
  context->set_size_bytes(size);
  context->set_access(v1::ACCESS_READ_WRITE);
  context->set_token("GET / HTTP/1.1\r\nHost: victim\r\n\r\n");
  v1::BackendEndpoint* endpoint = context->add_endpoints();
  endpoint->set_backend("tcp");
  endpoint->mutable_tcp()->set_host(host);
  endpoint->mutable_tcp()->set_port(port);
  return context;
}

uint16_t ClosedPort() {
  uint16_t port = 0;
  auto listener = ListenTcp({"127.0.0.1", 0}, &port);
  return listener.ok() ? port : 0;  // closed when `listener` goes
}

int OpenFds() { return CountEntries("/proc/self/fd"); }
int Threads() { return CountEntries("/proc/self/task"); }

}  // namespace rdma_agent::tcp::testing

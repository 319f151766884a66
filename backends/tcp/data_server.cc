#include "backends/tcp/data_server.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "backends/tcp/wire.h"

namespace rdma_agent::tcp {

absl::StatusOr<std::unique_ptr<DataServer>> DataServer::Start(
    const HostPort& address, const BufferDirectory* directory,
    bool zero_copy_send, int socket_buffer_bytes) {
  uint16_t port = 0;
  auto listener = ListenTcp(address, &port);
  if (!listener.ok()) return listener.status();
  UniqueFd wakeup(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wakeup) {
    return absl::InternalError(
        absl::StrCat("eventfd: ", std::strerror(errno)));
  }
  return std::unique_ptr<DataServer>(
      new DataServer(std::move(*listener), std::move(wakeup), port, directory,
                     zero_copy_send, socket_buffer_bytes));
}

DataServer::DataServer(UniqueFd listener, UniqueFd wakeup, uint16_t port,
                       const BufferDirectory* directory, bool zero_copy_send,
                       int socket_buffer_bytes)
    : listener_(std::move(listener)),
      wakeup_(std::move(wakeup)),
      port_(port),
      directory_(directory),
      zero_copy_send_(zero_copy_send),
      socket_buffer_bytes_(socket_buffer_bytes) {
  accept_thread_ = std::thread([this] { AcceptLoop(); });
}

DataServer::~DataServer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    // Unblocks every serving thread's recv/send; they then exit.
    for (auto& connection : connections_) {
      shutdown(connection->fd.get(), SHUT_RDWR);
    }
  }
  const uint64_t one = 1;
  (void)!write(wakeup_.get(), &one, sizeof(one));
  accept_thread_.join();
  // No new connection can appear now: the accept loop has left.
  for (auto& connection : connections_) connection->thread.join();
}

void DataServer::ReapFinishedLocked() {
  for (auto it = connections_.begin(); it != connections_.end();) {
    if ((*it)->finished.load()) {
      (*it)->thread.join();
      it = connections_.erase(it);
    } else {
      ++it;
    }
  }
}

void DataServer::AcceptLoop() {
  while (true) {
    pollfd fds[2] = {{listener_.get(), POLLIN, 0}, {wakeup_.get(), POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    UniqueFd fd(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!fd) continue;  // e.g. the peer gave up, or out of fds for a moment
    ConfigureDataSocket(fd.get(), socket_buffer_bytes_);
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    ReapFinishedLocked();
    if (connections_.size() >= kMaxConnections) continue;  // closes `fd`
    auto connection = std::make_unique<Connection>();
    connection->fd = std::move(fd);
    Connection* raw = connection.get();
    connections_.push_back(std::move(connection));
    raw->thread = std::thread([this, raw] { Serve(raw); });
  }
}

void DataServer::Serve(Connection* connection) {
  const int fd = connection->fd.get();
  std::byte header_bytes[kRequestHeaderBytes];
  std::string token;
  // Made on first use; without it payloads are sent with send().
  std::optional<PageSender> pages;
  bool pages_failed = !zero_copy_send_;
  // The hello first: clients send nothing before they have read it.
  std::byte hello[kServerHelloBytes];
  EncodeServerHello(hello);
  iovec hello_iov = {hello, sizeof(hello)};
  const bool greeted = WriteFull(fd, &hello_iov, 1).ok();
  while (greeted && ReadFull(fd, header_bytes, sizeof(header_bytes)).ok()) {
    auto header = DecodeRequestHeader(header_bytes);
    // A peer that speaks something else cannot be resynchronised: drop it.
    if (!header.ok()) break;
    token.resize(header->token_bytes);
    if (!ReadFull(fd, token.data(), token.size()).ok()) break;

    ServeRequest request;
    request.agent_epoch = header->epoch;
    request.buffer_id = header->buffer_id;
    request.token = token;
    request.offset = header->offset;
    request.length = header->length;
    request.write = header->kind == RequestKind::kWrite;
    auto registration = directory_->ResolveForPeer(request);

    if (request.write) {
      const absl::Status received =
          registration.ok()
              ? ReadFull(fd, (*registration)->data() + request.offset,
                         request.length)
              : Discard(fd, request.length);
      if (!received.ok()) break;
      if (registration.ok()) (*registration)->CountServed(request.length);
    }

    const absl::Status& status = registration.status();
    const std::string message(status.message().substr(
        0, std::min<size_t>(status.message().size(), kMaxMessageBytes)));
    ResponseHeader response;
    response.request_id = header->request_id;
    response.code = static_cast<uint32_t>(status.code());
    response.message_bytes = static_cast<uint32_t>(message.size());
    const bool send_payload = !request.write && registration.ok();
    response.payload_bytes = send_payload ? request.length : 0;
    std::byte response_bytes[kResponseHeaderBytes];
    EncodeResponseHeader(response, response_bytes);
    std::byte* payload =
        send_payload ? (*registration)->data() + request.offset : nullptr;
    const bool splice_payload =
        send_payload && request.length >= kSpliceMinBytes && !pages_failed &&
        (pages.has_value() || [&] {
          auto created = PageSender::Create();
          if (created.ok()) pages.emplace(std::move(*created));
          pages_failed = !created.ok();
          return created.ok();
        }());
    iovec iov[3] = {
        {response_bytes, sizeof(response_bytes)},
        {const_cast<char*>(message.data()), message.size()},
        {payload, splice_payload ? 0 : static_cast<size_t>(response.payload_bytes)},
    };
    if (!WriteFull(fd, iov, 3, splice_payload ? MSG_MORE : 0).ok()) break;
    if (splice_payload) {
      // Lent pages hold their own references: they stay valid even if the
      // registration is released before the requester has read them.
      size_t sent = 0;
      if (!pages->Send(fd, payload, request.length, /*more=*/false, &sent)
               .ok()) {
        break;
      }
    }
    if (send_payload) (*registration)->CountServed(request.length);
  }
  // The thread may still be joined later; the fd is closed with the object.
  shutdown(fd, SHUT_RDWR);
  connection->finished.store(true);
}

}  // namespace rdma_agent::tcp

#include "daemon/local/attach_server.h"

#include <sys/socket.h>
#include <sys/time.h>

#include "absl/strings/str_cat.h"
#include "common/fd_message.h"
#include "common/log_text.h"
#include "common/status_util.h"
#include "spdlog/spdlog.h"

namespace rdma_agent {
namespace {

v1::AttachResponse ErrorResponse(const absl::Status& status) {
  v1::AttachResponse response;
  response.set_code(static_cast<int>(status.code()));
  response.set_message(std::string(status.message()));
  return response;
}

}  // namespace

AttachServer::Reply AttachServer::ErrorReply(const absl::Status& status) {
  Reply reply;
  reply.response = ErrorResponse(status);
  return reply;
}

absl::StatusOr<std::unique_ptr<AttachServer>> AttachServer::Start(
    Options options, AttachTokens* tokens, const BufferTable* buffers) {
  std::unique_ptr<AttachServer> server(
      new AttachServer(std::move(options), tokens, buffers));
  auto listener = UnixListener::Start(
      server->options_.path,
      [raw = server.get()](UniqueFd fd, const PeerCredentials& peer) {
        raw->OnConnection(std::move(fd), peer);
      });
  if (!listener.ok()) return listener.status();
  server->listener_ = std::move(*listener);
  return server;
}

AttachServer::AttachServer(Options options, AttachTokens* tokens,
                           const BufferTable* buffers)
    : options_(std::move(options)), tokens_(tokens), buffers_(buffers) {}

AttachServer::~AttachServer() {
  listener_.reset();  // no new connections after this
  std::list<Connection> connections;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (Connection& connection : connections_) {
      // A connection handed to a ring session has none left here.
      if (connection.fd) ::shutdown(connection.fd.get(), SHUT_RDWR);
    }
    connections.swap(connections_);
  }
  for (Connection& connection : connections) connection.thread.join();
}

void AttachServer::ReapDoneLocked() {
  for (auto it = connections_.begin(); it != connections_.end();) {
    if (it->done) {
      it->thread.join();
      it = connections_.erase(it);
    } else {
      ++it;
    }
  }
}

void AttachServer::OnConnection(UniqueFd fd, const PeerCredentials& peer) {
  // Bounds how long one silent client can hold a thread.
  struct timeval timeout = {};
  timeout.tv_sec = absl::ToInt64Seconds(options_.idle_timeout);
  ::setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  ::setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));

  // Admitted before a thread exists; refused, the fd closes on return.
  auto charge = options_.quotas.attach_connections->Reserve(peer.uid, 1);
  if (!charge.ok()) {
    (void)SendFdMessage(fd.get(),
                        ErrorResponse(Prefixed(charge.status(), "attach")));
    return;
  }
  absl::MutexLock lock(&mu_);
  ReapDoneLocked();
  if (stopping_) return;
  Connection& connection = connections_.emplace_back();
  connection.fd = std::move(fd);
  connection.peer = peer;
  connection.charge = std::move(*charge);
  connection.thread = std::thread([this, &connection] { Serve(&connection); });
}

void AttachServer::Serve(Connection* connection) {
  while (true) {
    v1::AttachRequest request;
    auto fd = ReceiveFdMessage(connection->fd.get(), &request);
    if (!fd.ok()) {
      if (!absl::IsUnavailable(fd.status())) {
        spdlog::debug("attach connection from pid {}: {}", connection->peer.pid,
                      LogSafe(fd.status().ToString()));
        if (absl::IsInvalidArgument(fd.status())) {
          (void)SendFdMessage(connection->fd.get(), ErrorResponse(fd.status()));
        }
      }
      break;
    }
    if (request.request_case() == v1::AttachRequest::kOpenRing) {
      if (!options_.open_ring) {
        (void)SendFdMessage(connection->fd.get(),
                            ErrorResponse(absl::UnimplementedError(
                                "open ring: this agent serves no rings")));
        continue;
      }
      // The connection and its place in the quota are the session's from
      // now on, until it ends; this thread's work is done.
      UniqueFd fd_out;
      QuotaCharge charge;
      {
        absl::MutexLock lock(&mu_);
        fd_out = std::move(connection->fd);
        charge = std::move(connection->charge);
      }
      options_.open_ring(std::move(fd_out), std::move(charge), connection->peer,
                         request.open_ring());
      break;
    }
    // `reply.buffer` pins the registration until its fd has been sent.
    const Reply reply = Handle(request, std::move(*fd), connection->peer);
    const int fd_out = reply.buffer ? reply.buffer->fd() : -1;
    if (!SendFdMessage(connection->fd.get(), reply.response, fd_out).ok()) {
      break;
    }
  }
  absl::MutexLock lock(&mu_);
  // The fd and the quota go now, not when the thread is reaped (at the next
  // connection, which may be long after).
  connection->fd.reset();
  connection->charge.Reset();
  connection->done = true;
}

AttachServer::Reply AttachServer::Handle(const v1::AttachRequest& request,
                                         UniqueFd fd,
                                         const PeerCredentials& peer) {
  switch (request.request_case()) {
    case v1::AttachRequest::kAttach: {
      if (!fd) {
        return ErrorReply(absl::InvalidArgumentError(
            "attach: no file descriptor came with the request"));
      }
      uint64_t size = 0;
      auto token = Attach(std::move(fd), peer, &size);
      if (!token.ok()) {
        return ErrorReply(Prefixed(token.status(), "attach"));
      }
      Reply reply;
      reply.response.set_attach_token(*token);
      reply.response.set_size_bytes(size);
      spdlog::debug("pid {} uid {} attached {} bytes", peer.pid, peer.uid,
                    size);
      return reply;
    }
    case v1::AttachRequest::kAttachDeviceMemory: {
      const v1::AttachDeviceMemory& device = request.attach_device_memory();
      auto token = AttachDevice(std::move(fd), device, peer);
      if (!token.ok()) {
        return ErrorReply(Prefixed(token.status(), "attach device memory"));
      }
      Reply reply;
      reply.response.set_attach_token(*token);
      reply.response.set_size_bytes(device.length());
      spdlog::debug("pid {} uid {} attached {} bytes of {}", peer.pid, peer.uid,
                    device.length(),
                    DescribeMemory(device.kind(), device.device_index()));
      return reply;
    }
    case v1::AttachRequest::kOpen: {
      auto registration = buffers_->Find(request.open().buffer_id(), peer.uid);
      if (!registration.ok()) {
        return ErrorReply(Prefixed(registration.status(), "open"));
      }
      if ((*registration)->host_memory() == nullptr) {
        return ErrorReply(absl::FailedPreconditionError(
            absl::StrCat("open: buffer ", (*registration)->id(), " is ",
                         DescribeMemory((*registration)->memory_kind(),
                                        (*registration)->device_index()),
                         "; the agent has no mapping of it to hand out")));
      }
      Reply reply;
      reply.response.set_size_bytes((*registration)->size());
      reply.buffer = std::move(*registration);
      return reply;
    }
    default:
      return ErrorReply(
          absl::InvalidArgumentError("attach request names no operation"));
  }
}

absl::StatusOr<std::string> AttachServer::Attach(UniqueFd fd,
                                                 const PeerCredentials& peer,
                                                 uint64_t* size) {
  // The parked fd and mapping count first: cheap, and refuses a flood of
  // tiny memfds before any is mapped.
  auto parked = options_.quotas.pending_attach->Reserve(peer.uid, 1);
  if (!parked.ok()) return parked.status();
  auto memory = SharedMemory::Adopt(
      std::move(fd), [&](uint64_t bytes) { return AdmitBytes(bytes, peer); });
  if (!memory.ok()) return memory.status();
  *size = memory->size();
  return tokens_->Park(std::move(*memory), peer.uid, std::move(*parked));
}

absl::StatusOr<std::string> AttachServer::AttachDevice(
    UniqueFd fd, const v1::AttachDeviceMemory& request,
    const PeerCredentials& peer) {
  auto parked = options_.quotas.pending_attach->Reserve(peer.uid, 1);
  if (!parked.ok()) return parked.status();
  DeviceMemory::Description description;
  description.offset = request.offset();
  description.length = request.length();
  description.kind = request.kind();
  description.device_index = request.device_index();
  // Checked and put in sysfs's form by Adopt: never a path as given.
  description.pci_bus_id = request.pci_bus_id();
  // Counted like host memory: the NIC pins device memory as it pins pages.
  auto memory = DeviceMemory::Adopt(
      std::move(fd), description,
      [&](uint64_t bytes) { return AdmitBytes(bytes, peer); });
  if (!memory.ok()) return memory.status();
  return tokens_->Park(std::move(*memory), peer.uid, std::move(*parked));
}

absl::StatusOr<std::unique_ptr<MappingCharge>> AttachServer::AdmitBytes(
    uint64_t bytes, const PeerCredentials& peer) const {
  if (bytes > options_.max_buffer_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attached memory of ", bytes, " bytes exceeds the agent's limit of ",
        options_.max_buffer_bytes, " bytes (--max_buffer_bytes)"));
  }
  auto charge = options_.quotas.bytes->Reserve(peer.uid, bytes);
  if (!charge.ok()) return charge.status();
  return MemoryCharge::Of(std::move(*charge));
}

}  // namespace rdma_agent

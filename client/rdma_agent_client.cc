#include "client/rdma_agent_client.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "client/internal/attach_socket.h"
#include "client/internal/client_state.h"
#include "client/internal/conversions.h"
#include "client/ring.h"
#include "common/grpc_status.h"
#include "common/shared_memory.h"
#include "common/unique_fd.h"
#include "grpcpp/grpcpp.h"
#include "rdma/agent/v1/attach.pb.h"
#include "rdma/agent/v1/remote_buffer.pb.h"

namespace rdma_agent::client {

namespace {

absl::StatusOr<std::string> AttachSocketFor(
    const absl::StatusOr<std::string>& attach_socket) {
  if (!attach_socket.ok()) return attach_socket.status();
  return *attach_socket;
}

absl::Status ReleaseWith(internal::ClientState& state, uint64_t buffer_id) {
  grpc::ClientContext context;
  state.PrepareContext(&context);
  v1::ReleaseRequest request;
  request.set_buffer_id(buffer_id);
  v1::ReleaseResponse response;
  return FromGrpcStatus(state.stub().Release(&context, request, &response));
}

std::vector<std::string> BackendsOf(const v1::RegisterResponse& response) {
  return std::vector<std::string>(response.backends().begin(),
                                  response.backends().end());
}

// Hands `fd` over on `attach_socket` with `attach` (memfd or dma-buf),
// then registers the attach token it is answered.
absl::StatusOr<v1::RegisterResponse> RegisterAttachedWith(
    internal::ClientState& state, const std::string& attach_socket,
    const v1::AttachRequest& attach, int fd, v1::Access access,
    const std::string& label, v1::Lifetime lifetime) {
  absl::StatusOr<internal::AttachReply> reply =
      internal::ExchangeOnAttachSocket(attach_socket, attach, fd,
                                       state.options().rpc_timeout);
  if (!reply.ok()) return reply.status();
  if (absl::Status status = internal::ResponseStatus(reply->response);
      !status.ok()) {
    return status;
  }
  v1::RegisterRequest request;
  request.set_attach_token(reply->response.attach_token());
  request.set_access(access);
  request.set_label(label);
  request.set_lifetime(lifetime);
  grpc::ClientContext context;
  state.PrepareContext(&context);
  v1::RegisterResponse response;
  grpc::Status status = state.stub().Register(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::Status PublishWith(internal::ClientState& state, uint64_t buffer_id,
                         const std::string& name, v1::Visibility visibility) {
  grpc::ClientContext context;
  state.PrepareContext(&context);
  v1::PublishRequest request;
  request.set_buffer_id(buffer_id);
  request.set_name(name);
  request.set_visibility(visibility);
  v1::PublishResponse response;
  return FromGrpcStatus(state.stub().Publish(&context, request, &response));
}

absl::Status UnpublishWith(internal::ClientState& state,
                           const std::string& name) {
  grpc::ClientContext context;
  state.PrepareContext(&context);
  v1::UnpublishRequest request;
  request.set_name(name);
  v1::UnpublishResponse response;
  return FromGrpcStatus(state.stub().Unpublish(&context, request, &response));
}

// What a Register answered, for a registration the client does not map.
Registration RegistrationOf(const v1::RegisterResponse& response) {
  Registration registration;
  registration.id = response.buffer_id();
  registration.size = response.size_bytes();
  registration.remote_context = response.remote_context();
  registration.backends = BackendsOf(response);
  registration.lifetime = response.lifetime();
  return registration;
}

}  // namespace

// ---------------------------------------------------------------- Buffer

Buffer::Buffer(std::shared_ptr<internal::ClientState> state, uint64_t id,
               std::unique_ptr<SharedMemory> memory, uint64_t size,
               std::string remote_context, std::vector<std::string> backends,
               v1::Lifetime lifetime)
    : state_(std::move(state)),
      id_(id),
      memory_(std::move(memory)),
      size_(size),
      data_(memory_->data()),
      remote_context_(std::move(remote_context)),
      backends_(std::move(backends)),
      lifetime_(lifetime),
      released_(false) {}

Buffer::Buffer(Buffer&& other) noexcept
    : state_(std::move(other.state_)),
      id_(std::exchange(other.id_, 0)),
      memory_(std::move(other.memory_)),
      size_(std::exchange(other.size_, 0)),
      data_(std::exchange(other.data_, nullptr)),
      remote_context_(std::move(other.remote_context_)),
      backends_(std::move(other.backends_)),
      lifetime_(other.lifetime_),
      released_(std::exchange(other.released_, true)),
      rejoin_(std::move(other.rejoin_)),
      names_(std::move(other.names_)) {}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    ReleaseBestEffort();
    state_ = std::move(other.state_);
    id_ = std::exchange(other.id_, 0);
    memory_ = std::move(other.memory_);
    size_ = std::exchange(other.size_, 0);
    data_ = std::exchange(other.data_, nullptr);
    remote_context_ = std::move(other.remote_context_);
    backends_ = std::move(other.backends_);
    lifetime_ = other.lifetime_;
    released_ = std::exchange(other.released_, true);
    rejoin_ = std::move(other.rejoin_);
    names_ = std::move(other.names_);
  }
  return *this;
}

Buffer::~Buffer() { ReleaseBestEffort(); }

absl::Status Buffer::Release() {
  if (released_ || state_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("Release: buffer ", id_, " was already released"));
  }
  released_ = true;
  names_.clear();  // they go with the registration
  return ReleaseWith(*state_, id_);
}

absl::Status Buffer::Publish(const std::string& name,
                             v1::Visibility visibility) {
  if (released_ || state_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("Publish: buffer ", id_, " was released"));
  }
  absl::Status status = PublishWith(*state_, id_, name, visibility);
  if (status.ok()) names_[name] = visibility;
  return status;
}

absl::Status Buffer::Unpublish(const std::string& name) {
  if (state_ == nullptr) return absl::FailedPreconditionError("moved from");
  absl::Status status = UnpublishWith(*state_, name);
  if (status.ok() || status.code() == absl::StatusCode::kNotFound) {
    names_.erase(name);
  }
  return status;
}

absl::StatusOr<bool> Buffer::Rejoin() {
  if (released_ || state_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("Rejoin: buffer ", id_, " was released"));
  }
  if (!rejoin_.has_value() || lifetime_ == v1::LIFETIME_AGENT) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Rejoin: buffer ", id_,
        " is not memory of this process that lives with it (Attach)"));
  }
  v1::RemoteBuffer issued;
  if (!issued.ParseFromString(remote_context_)) {
    return absl::InternalError("Rejoin: the buffer's remote context is bad");
  }
  grpc::ClientContext context;
  state_->PrepareContext(&context);
  v1::AgentInfo info;
  if (grpc::Status status =
          state_->stub().GetInfo(&context, v1::GetInfoRequest(), &info);
      !status.ok()) {
    return FromGrpcStatus(status);
  }
  if (info.epoch() == issued.agent_epoch()) return false;

  absl::StatusOr<std::string> attach_socket =
      AttachSocketFor(state_->attach_socket());
  if (!attach_socket.ok()) return attach_socket.status();
  v1::AttachRequest attach;
  attach.mutable_attach();
  absl::StatusOr<v1::RegisterResponse> response =
      RegisterAttachedWith(*state_, *attach_socket, attach, memory_->fd(),
                           rejoin_->access, rejoin_->label, lifetime_);
  if (!response.ok()) return response.status();
  id_ = response->buffer_id();
  remote_context_ = response->remote_context();
  backends_ = BackendsOf(*response);
  lifetime_ = response->lifetime();
  absl::Status first_failure;
  for (auto it = names_.begin(); it != names_.end();) {
    absl::Status status = PublishWith(*state_, id_, it->first, it->second);
    if (status.ok()) {
      ++it;
      continue;
    }
    if (first_failure.ok()) {
      first_failure = absl::Status(
          status.code(), absl::StrCat("Rejoin: publishing ", it->first,
                                      " again: ", status.message()));
    }
    it = names_.erase(it);
  }
  if (!first_failure.ok()) return first_failure;
  return true;
}

void Buffer::ReleaseBestEffort() {
  // The registration goes first: the agent keeps its own mapping of the
  // memory, so unmapping ours afterwards cannot race an op it runs.
  if (!released_ && state_ != nullptr) {
    released_ = true;
    ReleaseWith(*state_, id_).IgnoreError();
  }
  memory_.reset();
  data_ = nullptr;
  size_ = 0;
}

// ----------------------------------------------------------- AgentClient

AgentClient::AgentClient(std::shared_ptr<internal::ClientState> state)
    : state_(std::move(state)) {}

AgentClient::~AgentClient() = default;

std::string ResolveAgentTarget(absl::string_view target) {
  std::string resolved(target);
  if (resolved.empty()) {
    const char* from_env = std::getenv(kAgentSocketEnv);
    resolved = from_env != nullptr && *from_env != '\0' ? from_env
                                                        : kDefaultAgentTarget;
  }
  if (absl::StartsWith(resolved, "/")) return absl::StrCat("unix://", resolved);
  if (absl::StartsWith(resolved, "./") || absl::StartsWith(resolved, "../")) {
    return absl::StrCat("unix:", resolved);
  }
  return resolved;
}

namespace {

// The socket path of a unix: target (empty for other targets).
std::string UnixSocketPath(absl::string_view target) {
  if (absl::ConsumePrefix(&target, "unix://") ||
      absl::ConsumePrefix(&target, "unix:")) {
    return std::string(target);
  }
  return "";
}

// A Unix socket that cannot be connected to at all fails now, naming why,
// rather than after the connect timeout.
absl::Status ProbeUnixSocket(const std::string& target) {
  const std::string path = UnixSocketPath(target);
  sockaddr_un address = {};
  if (path.empty() || path.size() >= sizeof(address.sun_path)) {
    return absl::OkStatus();  // gRPC judges other targets
  }
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) return absl::OkStatus();
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&address),
                sizeof(address)) == 0) {
    return absl::OkStatus();
  }
  const int error = errno;
  const std::string message = absl::StrCat(
      "cannot reach rdma-agentd at ", target, ": ", std::strerror(error),
      error == EACCES ? " (this user may not use the socket)"
                      : " (is it running? is the socket path "
                        "right? see $RDMA_AGENT_SOCKET)");
  return error == EACCES || error == EPERM
             ? absl::PermissionDeniedError(message)
             : absl::UnavailableError(message);
}

}  // namespace

absl::StatusOr<std::unique_ptr<AgentClient>> AgentClient::Connect(
    ConnectOptions options) {
  options.target = ResolveAgentTarget(options.target);
  if (options.connect_timeout > absl::ZeroDuration()) {
    if (absl::Status reachable = ProbeUnixSocket(options.target);
        !reachable.ok()) {
      return reachable;
    }
  }
  absl::StatusOr<std::string> attach_socket =
      options.attach_socket.empty()
          ? internal::AttachSocketNextTo(options.target)
          : absl::StatusOr<std::string>(options.attach_socket);
  grpc::ChannelArguments arguments;
  // Chunks of ReadBuffer/WriteBuffer plus framing must fit.
  const uint64_t max_message =
      std::max<uint64_t>(4 << 20, options.transfer_chunk_bytes + (64 << 10));
  arguments.SetMaxReceiveMessageSize(
      static_cast<int>(std::min<uint64_t>(max_message, INT32_MAX)));
  // The connection stays up however long the client is idle: where the
  // agent cannot watch this process, its buffers end with the connection.
  arguments.SetInt(GRPC_ARG_CLIENT_IDLE_TIMEOUT_MS, INT32_MAX);
  std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(
      options.target, grpc::InsecureChannelCredentials(), arguments);
  if (options.connect_timeout > absl::ZeroDuration() &&
      !channel->WaitForConnected(
          absl::ToChronoTime(absl::Now() + options.connect_timeout))) {
    return absl::UnavailableError(
        absl::StrCat("cannot reach rdma-agentd at ", options.target, " within ",
                     absl::FormatDuration(options.connect_timeout),
                     " (is it running? is the socket path right?)"));
  }
  auto state = std::make_shared<internal::ClientState>(
      std::move(options), std::move(channel), std::move(attach_socket));
  return std::unique_ptr<AgentClient>(new AgentClient(std::move(state)));
}

std::shared_ptr<grpc::Channel> AgentClient::channel() const {
  return state_->shared_channel();
}

const std::string& AgentClient::attach_socket() const {
  static const std::string* const kNone = new std::string();
  return state_->attach_socket().ok() ? *state_->attach_socket() : *kNone;
}

absl::StatusOr<v1::AgentInfo> AgentClient::GetInfo() {
  grpc::ClientContext context;
  state_->PrepareContext(&context);
  v1::AgentInfo info;
  grpc::Status status =
      state_->stub().GetInfo(&context, v1::GetInfoRequest(), &info);
  if (!status.ok()) return FromGrpcStatus(status);
  return info;
}

absl::StatusOr<v1::ListAgentsResponse> AgentClient::ListAgents() {
  grpc::ClientContext context;
  state_->PrepareContext(&context);
  v1::ListAgentsResponse response;
  grpc::Status status =
      state_->stub().ListAgents(&context, v1::ListAgentsRequest(), &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::Status AgentClient::Publish(uint64_t buffer_id, const std::string& name,
                                  v1::Visibility visibility) {
  return PublishWith(*state_, buffer_id, name, visibility);
}

absl::Status AgentClient::Unpublish(const std::string& name) {
  return UnpublishWith(*state_, name);
}

absl::StatusOr<v1::NameRecord> AgentClient::Resolve(const std::string& name) {
  grpc::ClientContext context;
  state_->PrepareContext(&context);
  v1::ResolveRequest request;
  request.set_name(name);
  v1::ResolveResponse response;
  grpc::Status status = state_->stub().Resolve(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return std::move(*response.mutable_record());
}

absl::StatusOr<v1::RegisterResponse> AgentClient::Register(
    const v1::RegisterRequest& request) {
  grpc::ClientContext context;
  state_->PrepareContext(&context);
  v1::RegisterResponse response;
  grpc::Status status = state_->stub().Register(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<Registration> AgentClient::AllocateUnmapped(
    uint64_t size, v1::Access access, const std::string& label) {
  v1::RegisterRequest request;
  request.set_allocate_bytes(size);
  request.set_access(access);
  request.set_label(label);
  request.set_lifetime(v1::LIFETIME_AGENT);
  absl::StatusOr<v1::RegisterResponse> response = Register(request);
  if (!response.ok()) return response.status();
  return RegistrationOf(*response);
}

absl::StatusOr<v1::RegisterResponse> AgentClient::RegisterAttached(
    const std::string& attach_socket, const v1::AttachRequest& attach, int fd,
    v1::Access access, const std::string& label, v1::Lifetime lifetime) {
  return RegisterAttachedWith(*state_, attach_socket, attach, fd, access, label,
                              lifetime);
}

absl::StatusOr<Registration> AgentClient::RegisterDeviceMemory(
    const DeviceMemorySpec& memory, v1::Access access, const std::string& label,
    v1::Lifetime lifetime) {
  absl::StatusOr<std::string> attach_socket =
      AttachSocketFor(state_->attach_socket());
  if (!attach_socket.ok()) return attach_socket.status();
  if (memory.dmabuf_fd < 0) {
    return absl::InvalidArgumentError(
        "RegisterDeviceMemory: dmabuf_fd is not a file descriptor");
  }
  v1::AttachRequest attach;
  v1::AttachDeviceMemory* device = attach.mutable_attach_device_memory();
  device->set_offset(memory.offset);
  device->set_length(memory.length);
  device->set_kind(memory.kind);
  device->set_device_index(memory.device_index);
  device->set_pci_bus_id(memory.pci_bus_id);
  absl::StatusOr<v1::RegisterResponse> response = RegisterAttached(
      *attach_socket, attach, memory.dmabuf_fd, access, label, lifetime);
  if (!response.ok()) return response.status();
  return RegistrationOf(*response);
}

absl::StatusOr<Buffer> AgentClient::Allocate(uint64_t size, v1::Access access,
                                             const std::string& label,
                                             v1::Lifetime lifetime) {
  absl::StatusOr<std::string> attach_socket =
      AttachSocketFor(state_->attach_socket());
  if (!attach_socket.ok()) return attach_socket.status();
  v1::RegisterRequest request;
  request.set_allocate_bytes(size);
  request.set_access(access);
  request.set_label(label);
  request.set_lifetime(lifetime);
  absl::StatusOr<v1::RegisterResponse> response = Register(request);
  if (!response.ok()) return response.status();

  // From here on, any failure must not leave the registration behind.
  auto fail = [&](absl::Status status) -> absl::StatusOr<Buffer> {
    ReleaseWith(*state_, response->buffer_id()).IgnoreError();
    return status;
  };
  v1::AttachRequest open;
  open.mutable_open()->set_buffer_id(response->buffer_id());
  absl::StatusOr<internal::AttachReply> reply =
      internal::ExchangeOnAttachSocket(*attach_socket, open, /*fd=*/-1,
                                       state_->options().rpc_timeout);
  if (!reply.ok()) return fail(reply.status());
  if (absl::Status status = internal::ResponseStatus(reply->response);
      !status.ok()) {
    return fail(status);
  }
  if (!reply->fd) {
    return fail(absl::InternalError(absl::StrCat(
        "OpenBuffer ", response->buffer_id(), ": the agent sent no fd")));
  }
  absl::StatusOr<SharedMemory> memory =
      SharedMemory::Adopt(std::move(reply->fd));
  if (!memory.ok()) return fail(memory.status());
  // The memfd may have grown since (its owner can grow it); the buffer is
  // what was registered.
  const uint64_t registered = response->size_bytes();
  if (registered < size || memory->size() < registered) {
    return fail(absl::InternalError(absl::StrCat(
        "OpenBuffer ", response->buffer_id(), ": ", size, " bytes asked for, ",
        registered, " registered, the memfd has ", memory->size())));
  }
  return Buffer(state_, response->buffer_id(),
                std::make_unique<SharedMemory>(std::move(*memory)), registered,
                response->remote_context(), BackendsOf(*response),
                response->lifetime());
}

absl::StatusOr<Buffer> AgentClient::Attach(uint64_t size, v1::Access access,
                                           const std::string& label,
                                           v1::Lifetime lifetime) {
  absl::StatusOr<std::string> attach_socket =
      AttachSocketFor(state_->attach_socket());
  if (!attach_socket.ok()) return attach_socket.status();
  // Creates, sizes, seals (F_SEAL_SHRINK) and maps the memfd.
  absl::StatusOr<SharedMemory> memory =
      SharedMemory::Allocate(size, label.empty() ? "rdma-agent-client" : label);
  if (!memory.ok()) return memory.status();

  v1::AttachRequest attach;
  attach.mutable_attach();
  absl::StatusOr<v1::RegisterResponse> response = RegisterAttached(
      *attach_socket, attach, memory->fd(), access, label, lifetime);
  if (!response.ok()) return response.status();
  const uint64_t attached = memory->size();
  Buffer buffer(state_, response->buffer_id(),
                std::make_unique<SharedMemory>(std::move(*memory)), attached,
                response->remote_context(), BackendsOf(*response),
                response->lifetime());
  buffer.rejoin_ = Buffer::RejoinSpec{access, label};
  return buffer;
}

absl::StatusOr<std::vector<OpResult>> AgentClient::Submit(
    const std::vector<OpSpec>& ops, absl::Duration timeout) {
  SubmitOptions options;
  options.timeout = timeout;
  auto submitted = Submit(ops, options);
  if (!submitted.ok()) return submitted.status();
  return std::move(submitted->results);
}

absl::StatusOr<SubmitResult> AgentClient::Submit(const std::vector<OpSpec>& ops,
                                                 const SubmitOptions& options) {
  v1::SubmitRequest request = internal::SubmitRequestFor(ops, options.timeout);
  request.set_notification(options.notification);
  return SendSubmit(request, options.timeout, ops.size());
}

absl::StatusOr<SubmitResult> AgentClient::SubmitPrepared(
    uint64_t prepared_id, const SubmitOptions& options) {
  v1::SubmitRequest request;
  request.set_prepared_id(prepared_id);
  internal::SetTimeout(options.timeout, request);
  request.set_notification(options.notification);
  return SendSubmit(request, options.timeout, 0);
}

absl::StatusOr<SubmitResult> AgentClient::SendSubmit(
    const v1::SubmitRequest& request, absl::Duration timeout, size_t ops) {
  const bool agent_default = internal::LeavesTimeoutToAgent(timeout);
  grpc::ClientContext context;
  const absl::Duration bound = (agent_default || timeout < absl::ZeroDuration()
                                    ? state_->options().rpc_timeout
                                    : timeout) +
                               state_->options().submit_deadline_slack;
  context.set_deadline(absl::ToChronoTime(absl::Now() + bound));
  v1::SubmitResponse response;
  grpc::Status status = state_->stub().Submit(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  if (ops != 0 ? static_cast<size_t>(response.results_size()) != ops
               : response.results().empty()) {
    return absl::InternalError(absl::StrCat("Submit: the agent answered ",
                                            response.results_size(),
                                            " results for ", ops, " ops"));
  }
  SubmitResult result;
  result.results.reserve(response.results_size());
  for (const v1::OpResult& op : response.results()) {
    result.results.push_back(internal::FromProto(op));
  }
  for (const v1::NotificationResult& sent : response.notifications()) {
    result.notifications.push_back(internal::FromProto(sent));
  }
  return result;
}

absl::Status AgentClient::Release(uint64_t buffer_id) {
  return ReleaseWith(*state_, buffer_id);
}

namespace {

RemoteHandle FromProto(const v1::RemoteHandleInfo& info) {
  RemoteHandle handle;
  handle.handle = info.remote_handle();
  handle.agent_id = info.agent_id();
  handle.buffer_id = info.buffer_id();
  handle.size = info.size_bytes();
  handle.access = info.access();
  handle.backends.assign(info.backends().begin(), info.backends().end());
  return handle;
}

}  // namespace

absl::StatusOr<RemoteHandle> AgentClient::ImportRemote(
    const std::string& remote_context) {
  grpc::ClientContext context;
  state_->PrepareContext(&context);
  v1::ImportRemoteRequest request;
  request.set_remote_context(remote_context);
  v1::ImportRemoteResponse response;
  grpc::Status status =
      state_->stub().ImportRemote(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return FromProto(response.remote());
}

absl::Status AgentClient::ReleaseRemote(uint64_t handle) {
  grpc::ClientContext context;
  state_->PrepareContext(&context);
  v1::ReleaseRemoteRequest request;
  request.set_remote_handle(handle);
  v1::ReleaseRemoteResponse response;
  return FromGrpcStatus(
      state_->stub().ReleaseRemote(&context, request, &response));
}

absl::StatusOr<std::vector<RemoteHandle>> AgentClient::ListRemotes() {
  grpc::ClientContext context;
  state_->PrepareContext(&context);
  v1::ListRemotesResponse response;
  grpc::Status status =
      state_->stub().ListRemotes(&context, v1::ListRemotesRequest(), &response);
  if (!status.ok()) return FromGrpcStatus(status);
  std::vector<RemoteHandle> handles;
  for (const v1::RemoteHandleInfo& info : response.remotes()) {
    handles.push_back(FromProto(info));
  }
  return handles;
}

absl::StatusOr<uint64_t> AgentClient::PrepareTransfer(
    const std::vector<OpSpec>& ops, const std::string& notification) {
  const v1::SubmitRequest batch =
      internal::SubmitRequestFor(ops, absl::ZeroDuration());
  grpc::ClientContext context;
  state_->PrepareContext(&context);
  v1::PrepareTransferRequest request;
  *request.mutable_ops() = batch.ops();
  request.set_notification(notification);
  v1::PrepareTransferResponse response;
  grpc::Status status =
      state_->stub().PrepareTransfer(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response.prepared_id();
}

absl::StatusOr<std::unique_ptr<Ring>> AgentClient::OpenRing(uint32_t entries) {
  absl::StatusOr<std::string> attach_socket =
      AttachSocketFor(state_->attach_socket());
  if (!attach_socket.ok()) return attach_socket.status();
  return Ring::Open(*attach_socket, entries, state_->options().rpc_timeout);
}

absl::Status AgentClient::ReleasePrepared(uint64_t prepared_id) {
  grpc::ClientContext context;
  state_->PrepareContext(&context);
  v1::ReleasePreparedRequest request;
  request.set_prepared_id(prepared_id);
  v1::ReleasePreparedResponse response;
  return FromGrpcStatus(
      state_->stub().ReleasePrepared(&context, request, &response));
}

absl::StatusOr<std::vector<v1::BufferInfo>> AgentClient::ListBuffers(
    bool all_users) {
  grpc::ClientContext context;
  state_->PrepareContext(&context);
  v1::ListBuffersRequest request;
  request.set_all_users(all_users);
  v1::ListBuffersResponse response;
  grpc::Status status =
      state_->stub().ListBuffers(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return std::vector<v1::BufferInfo>(response.buffers().begin(),
                                     response.buffers().end());
}

absl::StatusOr<std::vector<v1::RingSession>> AgentClient::ListRingSessions(
    bool all_users) {
  grpc::ClientContext context;
  state_->PrepareContext(&context);
  v1::ListRingSessionsRequest request;
  request.set_all_users(all_users);
  v1::ListRingSessionsResponse response;
  grpc::Status status =
      state_->stub().ListRingSessions(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return std::vector<v1::RingSession>(response.sessions().begin(),
                                      response.sessions().end());
}

absl::StatusOr<std::string> AgentClient::ReadBuffer(uint64_t id,
                                                    uint64_t offset,
                                                    uint64_t length) {
  if (offset + length < offset) {
    return absl::OutOfRangeError(absl::StrCat("ReadBuffer of buffer ", id,
                                              ": offset ", offset, " + length ",
                                              length, " overflows"));
  }
  const uint64_t chunk =
      std::max<uint64_t>(1, state_->options().transfer_chunk_bytes);
  std::string data;
  uint64_t done = 0;
  // One RPC even for length 0, so the agent judges that request too.
  do {
    const uint64_t n = std::min(chunk, length - done);
    grpc::ClientContext context;
    state_->PrepareContext(&context);
    v1::ReadBufferRequest request;
    request.set_buffer_id(id);
    request.set_offset(offset + done);
    request.set_length(n);
    v1::ReadBufferResponse response;
    grpc::Status status =
        state_->stub().ReadBuffer(&context, request, &response);
    if (!status.ok()) return FromGrpcStatus(status);
    if (response.data().size() != n) {
      return absl::InternalError(absl::StrCat(
          "ReadBuffer of buffer ", id, " at ", offset + done, ": asked for ", n,
          " bytes, got ", response.data().size()));
    }
    // The agent has checked the bounds once the first chunk came back;
    // still, never trust `length` for a single huge allocation.
    if (data.empty()) data.reserve(std::min<uint64_t>(length, 64 << 20));
    data += response.data();
    done += n;
  } while (done < length);
  return data;
}

absl::Status AgentClient::WriteBuffer(uint64_t id, uint64_t offset,
                                      absl::string_view data) {
  if (offset + data.size() < offset) {
    return absl::OutOfRangeError(absl::StrCat("WriteBuffer of buffer ", id,
                                              ": offset ", offset, " + length ",
                                              data.size(), " overflows"));
  }
  const uint64_t chunk =
      std::max<uint64_t>(1, state_->options().transfer_chunk_bytes);
  uint64_t done = 0;
  do {
    const uint64_t n = std::min<uint64_t>(chunk, data.size() - done);
    grpc::ClientContext context;
    state_->PrepareContext(&context);
    v1::WriteBufferRequest request;
    request.set_buffer_id(id);
    request.set_offset(offset + done);
    request.set_data(data.data() + done, n);
    v1::WriteBufferResponse response;
    grpc::Status status =
        state_->stub().WriteBuffer(&context, request, &response);
    if (!status.ok()) return FromGrpcStatus(status);
    done += n;
  } while (done < data.size());
  return absl::OkStatus();
}

}  // namespace rdma_agent::client

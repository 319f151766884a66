#include "daemon/api/service.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <variant>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log_text.h"
#include "common/random.h"
#include "common/status_util.h"
#include "daemon/api/notification_rpcs.h"
#include "daemon/api/transfer_rpcs.h"
#include "daemon/api/version.h"
#include "daemon/api/waiting_rpcs.h"
#include "daemon/metrics/metrics.h"
#include "google/protobuf/util/time_util.h"
#include "spdlog/spdlog.h"

namespace rdma_agent {
namespace {

bool ValidAccess(v1::Access access) {
  return AllowsRead(access) || AllowsWrite(access);
}

std::string HostName() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "";
  return name;
}

// What ListBuffers says of one registration.
void DescribeBuffer(const Registration& registration, v1::BufferInfo* info) {
  using google::protobuf::util::TimeUtil;
  info->set_buffer_id(registration.id());
  info->set_size_bytes(registration.size());
  info->set_access(registration.access());
  info->set_label(registration.label());
  for (const auto& name : registration.backend_names()) {
    info->add_backends(name);
  }
  info->set_bytes_moved(registration.bytes_moved());
  info->set_bytes_served(registration.bytes_served());
  info->set_agent_allocated(registration.agent_allocated());
  info->set_memory_kind(registration.memory_kind());
  info->set_device_index(registration.device_index());
  info->set_pci_bus_id(registration.pci_bus_id());
  info->set_owner_uid(registration.owner());
  info->set_owner_pid(static_cast<uint32_t>(registration.owner_pid()));
  info->set_lifetime(registration.lifetime());
  *info->mutable_create_time() =
      TimeUtil::NanosecondsToTimestamp(registration.create_time_nanos());
  *info->mutable_last_use_time() =
      TimeUtil::NanosecondsToTimestamp(registration.last_use_nanos());
}

}  // namespace

RdmaAgentService::RdmaAgentService(
    const ApiLimits& limits, const AgentIdentity& identity,
    const BackendRegistry* registry, BufferTable* buffers,
    AttachTokens* attach_tokens, const CallerTable* callers, ActiveCalls* calls,
    AgentQuotas quotas, ClientWatcher* client_watcher, TransferTable* transfers,
    NotificationInbox* notifications, AgentMetrics* metrics,
    std::string metrics_address, Directory* directory, BufferNames* names,
    const DirectoryOptions& names_limits, RemoteHandleTable* remote_handles,
    PreparedTransferTable* prepared, const RingSessions* rings)
    : limits_(limits),
      identity_(identity),
      registry_(registry),
      buffers_(buffers),
      attach_tokens_(attach_tokens),
      callers_(callers),
      calls_(calls),
      quotas_(std::move(quotas)),
      client_watcher_(client_watcher),
      transfers_(transfers),
      notifications_(notifications),
      remote_handles_(remote_handles),
      prepared_(prepared),
      rings_(rings),
      metrics_(metrics),
      metrics_address_(std::move(metrics_address)),
      directory_(directory),
      names_(names),
      name_watches_(names_limits.max_name_watches_per_user,
                    names_limits.max_name_watches),
      name_resolver_(
          [directory, max = limits.max_remote_context_bytes](
              uid_t caller,
              const std::string& name) -> absl::StatusOr<std::string> {
            absl::Status valid = ValidateName(name);
            if (!valid.ok()) return valid;
            auto record =
                directory->ResolveName(name, absl::Now() + absl::Seconds(10));
            if (!record.ok()) return record.status();
            if (!VisibleTo(*record, caller)) return NameNotPublished(name);
            absl::Status size =
                CheckRemoteContextSize(record->remote_context(), max);
            if (!size.ok()) return size;
            return std::move(*record->mutable_remote_context());
          }),
      batch_env_{registry,
                 buffers,
                 metrics,
                 &failures_,
                 limits.max_remote_context_bytes,
                 remote_handles,
                 &name_resolver_} {}

absl::StatusOr<RdmaAgentService::Admitted> RdmaAgentService::Admit(
    const grpc::ServerContext& context, absl::string_view rpc,
    size_t ops) const {
  auto caller = callers_->Lookup(context);
  if (!caller.ok()) return Prefixed(caller.status(), rpc);
  auto call = calls_->Start(&context, caller->uid, ops);
  if (!call.ok()) return Prefixed(call.status(), rpc);
  return Admitted{*caller, std::move(*call)};
}

absl::StatusOr<RdmaAgentService::Admitted> RdmaAgentService::AdmitCallback(
    const grpc::CallbackServerContext& context, absl::string_view rpc,
    bool may_wait) const {
  auto caller = callers_->Lookup(context);
  if (!caller.ok()) return Prefixed(caller.status(), rpc);
  // A call that answers at once is not watched for abandonment: it is over
  // before the watcher would look.
  auto call = may_wait ? calls_->StartWaiting(caller->uid)
                       : calls_->Start(nullptr, caller->uid, 0);
  if (!call.ok()) return Prefixed(call.status(), rpc);
  return Admitted{*caller, std::move(*call)};
}

grpc::Status RdmaAgentService::GetInfo(grpc::ServerContext* context,
                                       const v1::GetInfoRequest*,
                                       v1::AgentInfo* response) {
  auto admitted = Admit(*context, "GetInfo");
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  *response = Info();
  return grpc::Status::OK;
}

v1::AgentInfo RdmaAgentService::Info() const {
  v1::AgentInfo response;
  response.set_agent_id(identity_.agent_id);
  response.set_epoch(identity_.epoch);
  response.set_version(kAgentVersion);
  response.set_hostname(HostName());
  response.set_metrics_address(metrics_address_);
  for (const auto& backend : registry_->backends()) {
    v1::BackendInfo* info = response.add_backends();
    info->set_name(backend->name());
    info->set_transport_level(backend->transport_level());
    info->set_available(backend->available());
    info->set_unavailable_reason(backend->unavailable_reason());
    *info->mutable_transport_info() = backend->transport_info();
  }
  return response;
}

grpc::Status RdmaAgentService::ListAgents(grpc::ServerContext* context,
                                          const v1::ListAgentsRequest*,
                                          v1::ListAgentsResponse* response) {
  auto admitted = Admit(*context, "ListAgents");
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  auto agents = directory_->ListAgents(absl::FromChrono(context->deadline()));
  if (!agents.ok()) {
    return ToGrpcStatus(Prefixed(agents.status(), "ListAgents"));
  }
  *response = std::move(*agents);
  return grpc::Status::OK;
}

grpc::Status RdmaAgentService::Publish(grpc::ServerContext* context,
                                       const v1::PublishRequest* request,
                                       v1::PublishResponse*) {
  auto admitted = Admit(*context, "Publish");
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  const uid_t uid = admitted->caller.uid;
  auto registration = buffers_->Find(request->buffer_id(), uid);
  if (!registration.ok()) {
    return ToGrpcStatus(Prefixed(registration.status(), "Publish"));
  }
  absl::Status status = PublishBufferName(**registration, uid, request->name(),
                                          request->visibility());
  if (!status.ok()) return ToGrpcStatus(Prefixed(status, "Publish"));
  return grpc::Status::OK;
}

absl::Status RdmaAgentService::PublishBufferName(
    const Registration& registration, uid_t uid, const std::string& name,
    v1::Visibility visibility) {
  if (!v1::Visibility_IsValid(visibility)) {
    return absl::InvalidArgumentError(
        "visibility must be VISIBILITY_OWNER or VISIBILITY_ANY_USER");
  }
  v1::NameRecord record;
  record.set_name(name);
  record.set_visibility(visibility);
  record.set_remote_context(registration.remote_context());
  record.set_agent_id(identity_.agent_id);
  record.set_agent_epoch(identity_.epoch);
  record.set_owner_uid(uid);
  record.set_buffer_id(registration.id());
  *record.mutable_published_at() =
      google::protobuf::util::TimeUtil::NanosecondsToTimestamp(
          absl::ToUnixNanos(absl::Now()));
  absl::Status status = names_->Publish(record);
  if (!status.ok()) return status;
  // Released meanwhile: its release may have missed the name, so withdraw
  // it here (the release's own withdrawal and this one race harmlessly).
  if (registration.released()) {
    (void)names_->Unpublish(uid, name);
    return absl::NotFoundError(
        absl::StrCat("buffer ", registration.id(), " was released"));
  }
  spdlog::info("uid {} published buffer {} as \"{}\" in directory {}", uid,
               registration.id(), LogSafe(name), directory_->name());
  return absl::OkStatus();
}

grpc::Status RdmaAgentService::Unpublish(grpc::ServerContext* context,
                                         const v1::UnpublishRequest* request,
                                         v1::UnpublishResponse*) {
  auto admitted = Admit(*context, "Unpublish");
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  absl::Status status = ValidateName(request->name());
  if (status.ok()) {
    status = names_->Unpublish(admitted->caller.uid, request->name());
  }
  if (!status.ok()) return ToGrpcStatus(Prefixed(status, "Unpublish"));
  return grpc::Status::OK;
}

grpc::Status RdmaAgentService::Resolve(grpc::ServerContext* context,
                                       const v1::ResolveRequest* request,
                                       v1::ResolveResponse* response) {
  auto admitted = Admit(*context, "Resolve");
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  absl::Status status = ValidateName(request->name());
  if (!status.ok()) return ToGrpcStatus(Prefixed(status, "Resolve"));
  auto record = directory_->ResolveName(request->name(),
                                        absl::FromChrono(context->deadline()));
  if (record.ok() && !VisibleTo(*record, admitted->caller.uid)) {
    record = NameNotPublished(request->name());
  }
  if (!record.ok()) return ToGrpcStatus(Prefixed(record.status(), "Resolve"));
  *response->mutable_record() = std::move(*record);
  return grpc::Status::OK;
}

grpc::ServerWriteReactor<v1::NameEvent>* RdmaAgentService::WatchNames(
    grpc::CallbackServerContext* context,
    const v1::WatchNamesRequest* request) {
  auto admitted = AdmitCallback(*context, "WatchNames", /*may_wait=*/true);
  if (!admitted.ok()) return RefuseStream<v1::NameEvent>(admitted.status());
  if (request->prefix().size() > kMaxNameBytes) {
    return RefuseStream<v1::NameEvent>(absl::InvalidArgumentError(absl::StrCat(
        "WatchNames: a prefix is at most ", kMaxNameBytes, " bytes")));
  }
  auto slot = name_watches_.Take(admitted->caller.uid);
  if (!slot.ok()) {
    return RefuseStream<v1::NameEvent>(Prefixed(slot.status(), "WatchNames"));
  }
  return ServeWatchNames(std::move(admitted->call), admitted->caller.uid,
                         std::move(*slot), directory_, request->prefix());
}

grpc::Status RdmaAgentService::Register(grpc::ServerContext* context,
                                        const v1::RegisterRequest* request,
                                        v1::RegisterResponse* response) {
  auto admitted = Admit(*context, "Register");
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  const PeerCredentials* caller = &admitted->caller;
  auto result = DoRegister(*request, *context, *caller);
  if (!result.ok()) return ToGrpcStatus(Prefixed(result.status(), "Register"));
  *response = std::move(*result);
  return grpc::Status::OK;
}

absl::StatusOr<std::optional<ClientWatcher::Ticket>>
RdmaAgentService::WatchCaller(const grpc::ServerContext& context,
                              v1::Lifetime lifetime) {
  if (lifetime == v1::LIFETIME_AGENT) {
    return std::optional<ClientWatcher::Ticket>();
  }
  auto connection = callers_->Connection(context);
  if (!connection.ok()) return connection.status();
  auto ticket = client_watcher_->Reserve(*connection, lifetime);
  if (!ticket.ok()) return ticket.status();
  return std::optional<ClientWatcher::Ticket>(std::move(*ticket));
}

absl::StatusOr<v1::RegisterResponse> RdmaAgentService::DoRegister(
    const v1::RegisterRequest& request, const grpc::ServerContext& context,
    const PeerCredentials& peer) {
  const uid_t caller = peer.uid;
  if (!ValidAccess(request.access())) {
    return absl::InvalidArgumentError(
        "access must be ACCESS_READ, ACCESS_WRITE or ACCESS_READ_WRITE");
  }
  if (request.label().size() > limits_.max_label_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "label is longer than ", limits_.max_label_bytes, " bytes"));
  }
  if (!v1::Lifetime_IsValid(request.lifetime())) {
    return absl::InvalidArgumentError(
        absl::StrCat("lifetime ", request.lifetime(),
                     " is not LIFETIME_AGENT, LIFETIME_CLIENT_PROCESS or "
                     "LIFETIME_CLIENT_CONNECTION"));
  }
  if (!request.name().empty()) {
    absl::Status valid = ValidateName(request.name());
    if (!valid.ok()) return valid;
  }
  if (!v1::Visibility_IsValid(request.name_visibility())) {
    return absl::InvalidArgumentError(
        "name_visibility must be VISIBILITY_OWNER or VISIBILITY_ANY_USER");
  }
  const v1::Lifetime asked = request.lifetime() == v1::LIFETIME_UNSPECIFIED
                                 ? v1::LIFETIME_AGENT
                                 : request.lifetime();
  // Refused, an attachment is not kept parked for a retry: its fd, mapping
  // and bytes go now.
  auto refuse = [&](absl::Status status) {
    if (request.memory_case() == v1::RegisterRequest::kAttachToken) {
      (void)attach_tokens_->Take(request.attach_token(), caller);
    }
    return status;
  };
  // Admission before allocation: the registration (an fd and a mapping
  // until unmapped) is charged first, then the client watch its lifetime
  // needs, then the bytes, before any memfd is created; whatever is refused
  // leaves nothing behind.
  auto slot = quotas_.registrations->Reserve(caller, 1);
  if (!slot.ok()) return refuse(slot.status());
  auto watch = WatchCaller(context, asked);
  if (!watch.ok()) return refuse(watch.status());
  const v1::Lifetime lifetime =
      watch->has_value() ? (*watch)->lifetime() : v1::LIFETIME_AGENT;
  const uint64_t id = buffers_->NextId();
  absl::StatusOr<BufferMemory> memory;
  bool agent_allocated = false;
  switch (request.memory_case()) {
    case v1::RegisterRequest::kAllocateBytes:
      if (request.allocate_bytes() == 0) {
        return absl::InvalidArgumentError("allocate_bytes must be positive");
      }
      if (request.allocate_bytes() > limits_.max_buffer_bytes) {
        return absl::InvalidArgumentError(absl::StrCat(
            "allocate_bytes ", request.allocate_bytes(),
            " exceeds the agent's limit of ", limits_.max_buffer_bytes,
            " bytes (--max_buffer_bytes)"));
      }
      memory = SharedMemory::Allocate(
          request.allocate_bytes(), absl::StrCat("rdma-agentd-buffer-", id),
          [&](uint64_t bytes)
              -> absl::StatusOr<std::unique_ptr<MappingCharge>> {
            // Charged to the agent's cgroup, and registered like any other.
            auto allocated = quotas_.agent_allocated->Reserve(caller, bytes);
            if (!allocated.ok()) return allocated.status();
            auto charge = quotas_.bytes->Reserve(caller, bytes);
            if (!charge.ok()) return charge.status();
            return MemoryCharge::Of(std::move(*charge), std::move(*allocated));
          });
      agent_allocated = true;
      break;
    case v1::RegisterRequest::kAttachToken:
      // Its bytes were charged when it was attached, and stay charged.
      memory = attach_tokens_->Take(request.attach_token(), caller);
      break;
    default:
      return absl::InvalidArgumentError(
          "set allocate_bytes or attach_token to say where the memory is");
  }
  if (!memory.ok()) return memory.status();
  std::visit(
      [&](auto& held) { held.HoldCharge(MemoryCharge::Of(std::move(*slot))); },
      *memory);

  auto registration = std::make_shared<Registration>(
      id, caller, request.access(), request.label(), RandomBytes(16),
      std::move(*memory), agent_allocated,
      Registration::Origin{peer.pid, lifetime});
  v1::RemoteBuffer remote;
  remote.set_agent_id(identity_.agent_id);
  remote.set_agent_epoch(identity_.epoch);
  remote.set_buffer_id(id);
  remote.set_size_bytes(registration->size());
  remote.set_access(registration->access());
  remote.set_token(registration->token());
  remote.set_memory_kind(registration->memory_kind());
  remote.set_device_index(registration->device_index());
  absl::Status status = registry_->RegisterWithAll(*registration, &remote);
  if (!status.ok()) return status;

  v1::RegisterResponse response;
  response.set_buffer_id(id);
  response.set_size_bytes(registration->size());
  for (const auto& name : registration->backend_names()) {
    response.add_backends(name);
  }
  response.set_lifetime(lifetime);
  remote.SerializeToString(response.mutable_remote_context());
  registration->set_remote_context(response.remote_context());
  buffers_->Add(registration);
  // Published first: a client gone meanwhile releases it like any other.
  if (watch->has_value()) client_watcher_->Bind(std::move(**watch), id);
  if (!request.name().empty()) {
    // Registered and published in one call, or neither: a name that cannot
    // be published takes its registration back with it.
    status = PublishBufferName(*registration, caller, request.name(),
                               request.name_visibility());
    if (!status.ok()) {
      (void)buffers_->Remove(id, caller);
      return Prefixed(status, absl::StrCat("publishing buffer ", id, " as \"",
                                           request.name(), "\""));
    }
  }
  spdlog::info(
      "uid {} pid {} registered buffer {} ({} bytes of {}, {}, {}, label "
      "\"{}\")",
      caller, peer.pid, id, registration->size(),
      DescribeMemory(registration->memory_kind(), registration->device_index()),
      v1::Access_Name(registration->access()), v1::Lifetime_Name(lifetime),
      LogSafe(registration->label()));
  return response;
}

grpc::Status RdmaAgentService::Release(grpc::ServerContext* context,
                                       const v1::ReleaseRequest* request,
                                       v1::ReleaseResponse*) {
  auto admitted = Admit(*context, "Release");
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  const PeerCredentials* caller = &admitted->caller;
  absl::Status status = buffers_->Remove(request->buffer_id(), caller->uid);
  if (status.ok()) {
    spdlog::info("uid {} released buffer {}", caller->uid,
                 request->buffer_id());
  }
  return ToGrpcStatus(Prefixed(status, "Release"));
}

absl::Status RdmaAgentService::CheckBatchSize(const v1::SubmitRequest& request,
                                              absl::string_view rpc) const {
  // A run of a prepared transfer was checked when it was prepared.
  if (request.prepared_id() != 0) return absl::OkStatus();
  return CheckBatchSize(request.ops(), request.notification(), rpc);
}

absl::Status RdmaAgentService::CheckBatchSize(
    const google::protobuf::RepeatedPtrField<v1::Op>& ops,
    const std::string& notification, absl::string_view rpc) const {
  if (ops.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(rpc, ": the op batch is empty"));
  }
  if (static_cast<size_t>(ops.size()) > limits_.max_ops_per_submit) {
    return absl::InvalidArgumentError(
        absl::StrCat(rpc, ": ", ops.size(), " ops exceed the limit of ",
                     limits_.max_ops_per_submit, " per Submit"));
  }
  const size_t most = notifications_->limits().max_bytes;
  if (notification.size() > most) {
    return absl::InvalidArgumentError(
        absl::StrCat(rpc, ": the notification is ", notification.size(),
                     " bytes; at most ", most, " (--max_notification_bytes)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const PreparedTransfer>>
RdmaAgentService::PreparedFor(const v1::SubmitRequest& request, uid_t caller,
                              absl::string_view rpc) const {
  if (request.prepared_id() == 0) {
    return std::shared_ptr<const PreparedTransfer>();
  }
  if (!request.ops().empty() || !request.notification().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        rpc,
        ": prepared_id runs the prepared ops and notification; ops and "
        "notification must be empty"));
  }
  auto prepared = prepared_->Find(caller, request.prepared_id());
  if (!prepared.ok()) return Prefixed(prepared.status(), rpc);
  return prepared;
}

absl::StatusOr<absl::Duration> RdmaAgentService::SubmitTimeout(
    const v1::SubmitRequest& request) const {
  absl::Duration timeout = limits_.default_submit_timeout;
  if (request.has_timeout()) {
    const auto& t = request.timeout();
    if (t.seconds() < 0 || t.nanos() < 0 || t.nanos() > 999999999 ||
        (t.seconds() == 0 && t.nanos() == 0)) {
      return absl::InvalidArgumentError(
          "timeout must be a positive, well-formed Duration");
    }
    timeout = absl::Seconds(t.seconds()) + absl::Nanoseconds(t.nanos());
    if (timeout > limits_.max_submit_timeout) {
      return absl::InvalidArgumentError(
          absl::StrCat("timeout ", absl::FormatDuration(timeout),
                       " exceeds the agent's limit of ",
                       absl::FormatDuration(limits_.max_submit_timeout)));
    }
  }
  return timeout;
}

grpc::Status RdmaAgentService::Submit(grpc::ServerContext* context,
                                      const v1::SubmitRequest* request,
                                      v1::SubmitResponse* response) {
  absl::Status size = CheckBatchSize(*request, "Submit");
  if (!size.ok()) return ToGrpcStatus(size);
  auto caller = callers_->Lookup(*context);
  if (!caller.ok()) return ToGrpcStatus(Prefixed(caller.status(), "Submit"));
  auto prepared = PreparedFor(*request, caller->uid, "Submit");
  if (!prepared.ok()) return ToGrpcStatus(prepared.status());
  const size_t count = *prepared != nullptr
                           ? static_cast<size_t>((*prepared)->ops.size())
                           : static_cast<size_t>(request->ops_size());
  // Admitted before anything is built for it; stopped when its client goes
  // away or the agent shuts down.
  auto admitted = Admit(*context, "Submit", count);
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  auto timeout = SubmitTimeout(*request);
  if (!timeout.ok()) return ToGrpcStatus(Prefixed(timeout.status(), "Submit"));
  const absl::Time deadline =
      std::min(absl::Now() + *timeout, absl::FromChrono(context->deadline()));
  // On this thread, not a transfer worker's: a Submit waits behind no
  // transfer, and its client's going away stops it (ActiveCalls).
  auto batch =
      *prepared != nullptr
          ? OpBatch::Prepare(batch_env_, admitted->caller, std::move(*prepared),
                             nullptr, "Submit")
          : OpBatch::Prepare(batch_env_, admitted->caller, request, "Submit");
  *response = batch->Run(admitted->call->stop_token(deadline));
  return grpc::Status::OK;
}

grpc::Status RdmaAgentService::SubmitAsync(grpc::ServerContext* context,
                                           const v1::SubmitRequest* request,
                                           v1::SubmitAsyncResponse* response) {
  // Checked as Submit checks them, in the same order, with the same
  // messages.
  absl::Status size = CheckBatchSize(*request, "SubmitAsync");
  if (!size.ok()) return ToGrpcStatus(size);
  auto caller = callers_->Lookup(*context);
  if (!caller.ok()) {
    return ToGrpcStatus(Prefixed(caller.status(), "SubmitAsync"));
  }
  auto prepared = PreparedFor(*request, caller->uid, "SubmitAsync");
  if (!prepared.ok()) return ToGrpcStatus(prepared.status());
  const size_t count = *prepared != nullptr
                           ? static_cast<size_t>((*prepared)->ops.size())
                           : static_cast<size_t>(request->ops_size());
  auto admitted = Admit(*context, "SubmitAsync");
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  // The ops count toward the same bounds as a Submit's until the transfer
  // ends; the transfer holds no call slot (no gRPC thread).
  auto charge = calls_->ChargeOps(admitted->caller.uid, count);
  if (!charge.ok()) {
    return ToGrpcStatus(Prefixed(charge.status(), "SubmitAsync"));
  }
  auto timeout = SubmitTimeout(*request);
  if (!timeout.ok()) {
    return ToGrpcStatus(Prefixed(timeout.status(), "SubmitAsync"));
  }
  // From now, queueing included; this call's own deadline does not bound
  // the transfer, which outlives it.
  const absl::Time deadline = absl::Now() + *timeout;
  // The copy of the request the transfer keeps until it ends is charged to
  // the user's transfer byte budget before it is made; then what preparing
  // the batch holds (parsed contexts, per-op state), freed at once if it
  // does not fit. A run of a prepared transfer copies no ops: the prepared
  // transfer, charged to its own budget, is shared.
  auto bytes = transfers_->Reserve(admitted->caller.uid,
                                   *prepared != nullptr
                                       ? RequestCopyBytes(v1::SubmitRequest())
                                       : RequestCopyBytes(*request),
                                   count);
  if (!bytes.ok()) return ToGrpcStatus(Prefixed(bytes.status(), "SubmitAsync"));
  auto batch =
      *prepared != nullptr
          ? OpBatch::Prepare(batch_env_, admitted->caller, std::move(*prepared),
                             std::move(*charge), "SubmitAsync")
          : OpBatch::Prepare(batch_env_, admitted->caller,
                             std::make_unique<v1::SubmitRequest>(*request),
                             std::move(*charge));
  absl::Status grown = transfers_->Grow(*bytes, batch->PreparedBytes());
  if (!grown.ok()) return ToGrpcStatus(Prefixed(grown, "SubmitAsync"));
  auto id = transfers_->Submit(admitted->caller.uid, std::move(batch), deadline,
                               std::move(*bytes));
  if (!id.ok()) return ToGrpcStatus(Prefixed(id.status(), "SubmitAsync"));
  response->set_transfer_id(*id);
  return grpc::Status::OK;
}

grpc::ServerUnaryReactor* RdmaAgentService::GetTransfers(
    grpc::CallbackServerContext* context,
    const v1::GetTransfersRequest* request,
    v1::GetTransfersResponse* response) {
  // A long poll takes a waiting slot (it holds no thread, and must not eat
  // into the user's call slots); a plain read is an ordinary call, so that
  // a user whose watches fill its waiting slots can still poll.
  const bool may_wait = request->has_wait() && (request->wait().seconds() > 0 ||
                                                request->wait().nanos() > 0);
  auto admitted = AdmitCallback(*context, "GetTransfers", may_wait);
  if (!admitted.ok()) return RefuseUnary(context, admitted.status());
  return ServeGetTransfers(context, std::move(admitted->call),
                           admitted->caller.uid, *request, response, transfers_,
                           limits_.max_transfer_wait);
}

grpc::ServerWriteReactor<v1::TransferEvent>* RdmaAgentService::WatchTransfers(
    grpc::CallbackServerContext* context, const v1::WatchTransfersRequest*) {
  // A waiting slot for as long as the stream is open; its reactor hears of
  // the client's going from gRPC.
  auto admitted = AdmitCallback(*context, "WatchTransfers", /*may_wait=*/true);
  if (!admitted.ok()) {
    return RefuseStream<v1::TransferEvent>(admitted.status());
  }
  return ServeWatchTransfers(std::move(admitted->call), admitted->caller.uid,
                             transfers_);
}

grpc::Status RdmaAgentService::CancelTransfer(
    grpc::ServerContext* context, const v1::CancelTransferRequest* request,
    v1::CancelTransferResponse* response) {
  auto admitted = Admit(*context, "CancelTransfer");
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  // Returns once the transfer's run has ended: nothing of it touches local
  // memory any more.
  auto transfer =
      transfers_->Cancel(admitted->caller.uid, request->transfer_id());
  if (!transfer.ok()) {
    return ToGrpcStatus(Prefixed(transfer.status(), "CancelTransfer"));
  }
  *response->mutable_transfer() = std::move(*transfer);
  return grpc::Status::OK;
}

grpc::ServerUnaryReactor* RdmaAgentService::GetNotifications(
    grpc::CallbackServerContext* context,
    const v1::GetNotificationsRequest* request,
    v1::GetNotificationsResponse* response) {
  // As GetTransfers: a waiting slot only when it may wait.
  const bool may_wait = request->has_wait() && (request->wait().seconds() > 0 ||
                                                request->wait().nanos() > 0);
  auto admitted = AdmitCallback(*context, "GetNotifications", may_wait);
  if (!admitted.ok()) return RefuseUnary(context, admitted.status());
  return ServeGetNotifications(context, std::move(admitted->call),
                               admitted->caller.uid, *request, response,
                               notifications_, limits_.max_transfer_wait);
}

grpc::ServerWriteReactor<v1::NotificationEvent>*
RdmaAgentService::WatchNotifications(grpc::CallbackServerContext* context,
                                     const v1::WatchNotificationsRequest*) {
  auto admitted =
      AdmitCallback(*context, "WatchNotifications", /*may_wait=*/true);
  if (!admitted.ok()) {
    return RefuseStream<v1::NotificationEvent>(admitted.status());
  }
  return ServeWatchNotifications(std::move(admitted->call),
                                 admitted->caller.uid, notifications_);
}

grpc::Status RdmaAgentService::ListBuffers(
    grpc::ServerContext* context, const v1::ListBuffersRequest* request,
    v1::ListBuffersResponse* response) {
  auto admitted = Admit(*context, "ListBuffers");
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  const PeerCredentials* caller = &admitted->caller;
  if (request->all_users() && caller->uid != 0) {
    return ToGrpcStatus(absl::PermissionDeniedError(
        absl::StrCat("ListBuffers: all_users is for root; uid ", caller->uid,
                     " may list only its own registrations")));
  }
  const auto registrations = request->all_users()
                                 ? buffers_->ListAll()
                                 : buffers_->ListOwnedBy(caller->uid);
  for (const auto& registration : registrations) {
    DescribeBuffer(*registration, response->add_buffers());
  }
  return grpc::Status::OK;
}

grpc::Status RdmaAgentService::ListRingSessions(
    grpc::ServerContext* context, const v1::ListRingSessionsRequest* request,
    v1::ListRingSessionsResponse* response) {
  using google::protobuf::util::TimeUtil;
  auto admitted = Admit(*context, "ListRingSessions");
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  const uid_t uid = admitted->caller.uid;
  if (request->all_users() && uid != 0) {
    return ToGrpcStatus(absl::PermissionDeniedError(
        absl::StrCat("ListRingSessions: all_users is for root; uid ", uid,
                     " may list only its own sessions")));
  }
  for (const RingSessionInfo& session : rings_->List(
           request->all_users() ? std::nullopt : std::optional<uid_t>(uid))) {
    v1::RingSession* info = response->add_sessions();
    info->set_owner_uid(session.uid);
    info->set_owner_pid(static_cast<uint32_t>(session.pid));
    info->set_entries(session.entries);
    *info->mutable_open_time() =
        TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(session.opened));
    info->set_batches_in_flight(session.batches_in_flight);
    info->set_ops_in_flight(session.ops_in_flight);
    info->set_ops_completed(session.ops_completed);
    info->set_stopped_reason(session.stopped_reason);
  }
  return grpc::Status::OK;
}

grpc::Status RdmaAgentService::ReadBuffer(grpc::ServerContext* context,
                                          const v1::ReadBufferRequest* request,
                                          v1::ReadBufferResponse* response) {
  auto admitted = Admit(*context, "ReadBuffer");
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  const PeerCredentials* caller = &admitted->caller;
  if (request->length() > limits_.max_transfer_bytes_per_rpc) {
    return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
        "ReadBuffer: length ", request->length(), " exceeds the limit of ",
        limits_.max_transfer_bytes_per_rpc, " bytes per call")));
  }
  auto registration = buffers_->Find(request->buffer_id(), caller->uid);
  if (!registration.ok()) {
    return ToGrpcStatus(Prefixed(registration.status(), "ReadBuffer"));
  }
  absl::Status status = RequireHostMemory(
      **registration,
      "the agent cannot read it; move it with Submit over a NIC backend");
  if (status.ok()) {
    status = CheckRange(request->offset(), request->length(),
                        (*registration)->size(), "buffer");
  }
  if (!status.ok()) return ToGrpcStatus(Prefixed(status, "ReadBuffer"));
  (*registration)->MarkUsed();
  response->set_data(reinterpret_cast<const char*>((*registration)->data() +
                                                   request->offset()),
                     request->length());
  return grpc::Status::OK;
}

grpc::Status RdmaAgentService::WriteBuffer(
    grpc::ServerContext* context, const v1::WriteBufferRequest* request,
    v1::WriteBufferResponse*) {
  auto admitted = Admit(*context, "WriteBuffer");
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  const PeerCredentials* caller = &admitted->caller;
  auto registration = buffers_->Find(request->buffer_id(), caller->uid);
  if (!registration.ok()) {
    return ToGrpcStatus(Prefixed(registration.status(), "WriteBuffer"));
  }
  absl::Status status = RequireHostMemory(
      **registration,
      "the agent cannot write it; move it with Submit over a NIC backend");
  if (status.ok()) {
    status = CheckRange(request->offset(), request->data().size(),
                        (*registration)->size(), "buffer");
  }
  if (!status.ok()) return ToGrpcStatus(Prefixed(status, "WriteBuffer"));
  (*registration)->MarkUsed();
  std::memcpy((*registration)->data() + request->offset(),
              request->data().data(), request->data().size());
  return grpc::Status::OK;
}

namespace {

void DescribeRemote(uint64_t handle, const ImportedRemote& imported,
                    v1::RemoteHandleInfo* info) {
  const v1::RemoteBuffer& remote = *imported.remote;
  info->set_remote_handle(handle);
  info->set_agent_id(remote.agent_id());
  info->set_buffer_id(remote.buffer_id());
  info->set_size_bytes(remote.size_bytes());
  info->set_access(remote.access());
  for (const std::string& name : imported.backends) info->add_backends(name);
}

}  // namespace

grpc::Status RdmaAgentService::ImportRemote(
    grpc::ServerContext* context, const v1::ImportRemoteRequest* request,
    v1::ImportRemoteResponse* response) {
  auto admitted = Admit(*context, "ImportRemote");
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  auto imported =
      remote_handles_->Import(admitted->caller.uid, request->remote_context(),
                              limits_.max_remote_context_bytes, *registry_);
  if (!imported.ok()) {
    return ToGrpcStatus(Prefixed(imported.status(), "ImportRemote"));
  }
  response->set_remote_handle(imported->handle);
  DescribeRemote(imported->handle, *imported->remote,
                 response->mutable_remote());
  return grpc::Status::OK;
}

grpc::Status RdmaAgentService::ReleaseRemote(
    grpc::ServerContext* context, const v1::ReleaseRemoteRequest* request,
    v1::ReleaseRemoteResponse*) {
  auto admitted = Admit(*context, "ReleaseRemote");
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  return ToGrpcStatus(Prefixed(
      remote_handles_->Release(admitted->caller.uid, request->remote_handle()),
      "ReleaseRemote"));
}

grpc::Status RdmaAgentService::ListRemotes(grpc::ServerContext* context,
                                           const v1::ListRemotesRequest*,
                                           v1::ListRemotesResponse* response) {
  auto admitted = Admit(*context, "ListRemotes");
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  for (const auto& imported :
       remote_handles_->ListOwnedBy(admitted->caller.uid)) {
    DescribeRemote(imported.handle, *imported.remote, response->add_remotes());
  }
  return grpc::Status::OK;
}

grpc::Status RdmaAgentService::PrepareTransfer(
    grpc::ServerContext* context, const v1::PrepareTransferRequest* request,
    v1::PrepareTransferResponse* response) {
  absl::Status size = CheckBatchSize(request->ops(), request->notification(),
                                     "PrepareTransfer");
  if (!size.ok()) return ToGrpcStatus(size);
  auto admitted = Admit(*context, "PrepareTransfer");
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  OpPreparer preparer(buffers_, admitted->caller.uid, remote_handles_,
                      &name_resolver_);
  auto id = prepared_->Prepare(admitted->caller.uid, *request, preparer,
                               limits_.max_remote_context_bytes);
  if (!id.ok()) return ToGrpcStatus(Prefixed(id.status(), "PrepareTransfer"));
  response->set_prepared_id(*id);
  return grpc::Status::OK;
}

grpc::Status RdmaAgentService::ReleasePrepared(
    grpc::ServerContext* context, const v1::ReleasePreparedRequest* request,
    v1::ReleasePreparedResponse*) {
  auto admitted = Admit(*context, "ReleasePrepared");
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  return ToGrpcStatus(
      Prefixed(prepared_->Release(admitted->caller.uid, request->prepared_id()),
               "ReleasePrepared"));
}

}  // namespace rdma_agent

#ifndef RDMA_AGENTD_DAEMON_API_SERVICE_H_
#define RDMA_AGENTD_DAEMON_API_SERVICE_H_

#include <sys/types.h>

#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "backends/buffer_table.h"
#include "backends/registry.h"
#include "common/grpc_status.h"
#include "common/rate_limited_log.h"
#include "daemon/api/api_limits.h"
#include "daemon/api/name_rpcs.h"
#include "daemon/directory/buffer_names.h"
#include "daemon/directory/directory.h"
#include "daemon/limits/active_calls.h"
#include "daemon/limits/quota.h"
#include "daemon/local/attach_tokens.h"
#include "daemon/local/caller_identity.h"
#include "daemon/local/client_watcher.h"
#include "daemon/local/unix_socket.h"
#include "daemon/ops/notifications.h"
#include "daemon/ops/op_batch.h"
#include "daemon/ops/prepared_transfers.h"
#include "daemon/ops/remote_context.h"
#include "daemon/ops/remote_handles.h"
#include "daemon/ops/ring_sessions.h"
#include "daemon/ops/transfers.h"
#include "rdma/agent/v1/agent.grpc.pb.h"

namespace rdma_agent {

class AgentMetrics;

// The RPCs that may wait for something to happen are served with gRPC's
// callback API (daemon/waiting_rpcs.h): they hold no thread while they
// wait. Every other RPC is synchronous (a gRPC server thread each).
using RdmaAgentServiceBase = v1::RdmaAgent::WithCallbackMethod_GetTransfers<
    v1::RdmaAgent::WithCallbackMethod_WatchTransfers<
        v1::RdmaAgent::WithCallbackMethod_GetNotifications<
            v1::RdmaAgent::WithCallbackMethod_WatchNotifications<
                v1::RdmaAgent::WithCallbackMethod_WatchNames<
                    v1::RdmaAgent::Service>>>>>;

// The public API (rdma.agent.v1.RdmaAgent). Each RPC acts for the local user
// whose credentials the caller table holds for its connection.
class RdmaAgentService final : public RdmaAgentServiceBase {
 public:
  RdmaAgentService(const ApiLimits& limits, const AgentIdentity& identity,
                   const BackendRegistry* registry, BufferTable* buffers,
                   AttachTokens* attach_tokens, const CallerTable* callers,
                   ActiveCalls* calls, AgentQuotas quotas,
                   ClientWatcher* client_watcher, TransferTable* transfers,
                   NotificationInbox* notifications, AgentMetrics* metrics,
                   std::string metrics_address, Directory* directory,
                   BufferNames* names, const DirectoryOptions& names_limits,
                   RemoteHandleTable* remote_handles,
                   PreparedTransferTable* prepared, const RingSessions* rings);

  // What GetInfo answers (and the agent publishes in the directory).
  v1::AgentInfo Info() const;

  grpc::Status GetInfo(grpc::ServerContext* context,
                       const v1::GetInfoRequest* request,
                       v1::AgentInfo* response) override;
  grpc::Status Register(grpc::ServerContext* context,
                        const v1::RegisterRequest* request,
                        v1::RegisterResponse* response) override;
  grpc::Status Release(grpc::ServerContext* context,
                       const v1::ReleaseRequest* request,
                       v1::ReleaseResponse* response) override;
  grpc::Status Submit(grpc::ServerContext* context,
                      const v1::SubmitRequest* request,
                      v1::SubmitResponse* response) override;
  grpc::Status ListBuffers(grpc::ServerContext* context,
                           const v1::ListBuffersRequest* request,
                           v1::ListBuffersResponse* response) override;
  grpc::Status ReadBuffer(grpc::ServerContext* context,
                          const v1::ReadBufferRequest* request,
                          v1::ReadBufferResponse* response) override;
  grpc::Status WriteBuffer(grpc::ServerContext* context,
                           const v1::WriteBufferRequest* request,
                           v1::WriteBufferResponse* response) override;
  grpc::Status SubmitAsync(grpc::ServerContext* context,
                           const v1::SubmitRequest* request,
                           v1::SubmitAsyncResponse* response) override;
  grpc::ServerUnaryReactor* GetTransfers(
      grpc::CallbackServerContext* context,
      const v1::GetTransfersRequest* request,
      v1::GetTransfersResponse* response) override;
  grpc::ServerWriteReactor<v1::TransferEvent>* WatchTransfers(
      grpc::CallbackServerContext* context,
      const v1::WatchTransfersRequest* request) override;
  grpc::Status CancelTransfer(grpc::ServerContext* context,
                              const v1::CancelTransferRequest* request,
                              v1::CancelTransferResponse* response) override;
  grpc::ServerUnaryReactor* GetNotifications(
      grpc::CallbackServerContext* context,
      const v1::GetNotificationsRequest* request,
      v1::GetNotificationsResponse* response) override;
  grpc::ServerWriteReactor<v1::NotificationEvent>* WatchNotifications(
      grpc::CallbackServerContext* context,
      const v1::WatchNotificationsRequest* request) override;
  grpc::Status ListAgents(grpc::ServerContext* context,
                          const v1::ListAgentsRequest* request,
                          v1::ListAgentsResponse* response) override;
  grpc::Status Publish(grpc::ServerContext* context,
                       const v1::PublishRequest* request,
                       v1::PublishResponse* response) override;
  grpc::Status Unpublish(grpc::ServerContext* context,
                         const v1::UnpublishRequest* request,
                         v1::UnpublishResponse* response) override;
  grpc::Status Resolve(grpc::ServerContext* context,
                       const v1::ResolveRequest* request,
                       v1::ResolveResponse* response) override;
  grpc::ServerWriteReactor<v1::NameEvent>* WatchNames(
      grpc::CallbackServerContext* context,
      const v1::WatchNamesRequest* request) override;
  grpc::Status ImportRemote(grpc::ServerContext* context,
                            const v1::ImportRemoteRequest* request,
                            v1::ImportRemoteResponse* response) override;
  grpc::Status ReleaseRemote(grpc::ServerContext* context,
                             const v1::ReleaseRemoteRequest* request,
                             v1::ReleaseRemoteResponse* response) override;
  grpc::Status ListRemotes(grpc::ServerContext* context,
                           const v1::ListRemotesRequest* request,
                           v1::ListRemotesResponse* response) override;
  grpc::Status PrepareTransfer(grpc::ServerContext* context,
                               const v1::PrepareTransferRequest* request,
                               v1::PrepareTransferResponse* response) override;
  grpc::Status ReleasePrepared(grpc::ServerContext* context,
                               const v1::ReleasePreparedRequest* request,
                               v1::ReleasePreparedResponse* response) override;
  grpc::Status ListRingSessions(
      grpc::ServerContext* context, const v1::ListRingSessionsRequest* request,
      v1::ListRingSessionsResponse* response) override;

 private:
  // What every handler starts with: who is calling, and a call slot for it
  // (`ops` ops of a Submit). Errors are prefixed with `rpc`.
  struct Admitted {
    PeerCredentials caller;
    std::unique_ptr<ActiveCalls::Call> call;
  };
  absl::StatusOr<Admitted> Admit(const grpc::ServerContext& context,
                                 absl::string_view rpc, size_t ops = 0) const;
  // The same for an RPC served with the callback API: a waiting slot
  // (ActiveCalls::StartWaiting) when it `may_wait`, otherwise a call slot
  // (it answers at once).
  absl::StatusOr<Admitted> AdmitCallback(
      const grpc::CallbackServerContext& context, absl::string_view rpc,
      bool may_wait) const;

  absl::StatusOr<v1::RegisterResponse> DoRegister(
      const v1::RegisterRequest& request, const grpc::ServerContext& context,
      const PeerCredentials& caller);
  // Publishes `registration` (the caller's, `uid`) as `name`: the checks
  // and the directory's answer of Publish, unprefixed. A registration
  // released meanwhile loses the name again (NOT_FOUND).
  absl::Status PublishBufferName(const Registration& registration, uid_t uid,
                                 const std::string& name,
                                 v1::Visibility visibility);
  // A reserved watch of the caller for `lifetime`; none for LIFETIME_AGENT.
  absl::StatusOr<std::optional<ClientWatcher::Ticket>> WatchCaller(
      const grpc::ServerContext& context, v1::Lifetime lifetime);
  // The checks that fail a whole Submit (or SubmitAsync, named `rpc`): the
  // batch is empty or too large, or its notification too long.
  absl::Status CheckBatchSize(const v1::SubmitRequest& request,
                              absl::string_view rpc) const;
  // The same for a batch of `ops` with `notification` (PrepareTransfer).
  absl::Status CheckBatchSize(
      const google::protobuf::RepeatedPtrField<v1::Op>& ops,
      const std::string& notification, absl::string_view rpc) const;
  // The prepared transfer a request names (SubmitRequest.prepared_id), or
  // nullptr when it names none; INVALID_ARGUMENT when it also carries ops or
  // a notification, NOT_FOUND when the id is not the caller's. Errors are
  // prefixed with `rpc`.
  absl::StatusOr<std::shared_ptr<const PreparedTransfer>> PreparedFor(
      const v1::SubmitRequest& request, uid_t caller,
      absl::string_view rpc) const;
  // The request's timeout, or the default; INVALID_ARGUMENT when malformed
  // or past the limit.
  absl::StatusOr<absl::Duration> SubmitTimeout(
      const v1::SubmitRequest& request) const;

  const ApiLimits limits_;
  const AgentIdentity identity_;
  const BackendRegistry* const registry_;
  BufferTable* const buffers_;
  AttachTokens* const attach_tokens_;
  const CallerTable* const callers_;
  ActiveCalls* const calls_;
  const AgentQuotas quotas_;
  ClientWatcher* const client_watcher_;
  TransferTable* const transfers_;
  NotificationInbox* const notifications_;
  RemoteHandleTable* const remote_handles_;
  PreparedTransferTable* const prepared_;
  const RingSessions* const rings_;    // for ListRingSessions
  AgentMetrics* const metrics_;        // ops by backend, type and code
  const std::string metrics_address_;  // for GetInfo
  Directory* const directory_;
  BufferNames* const names_;
  NameWatches name_watches_;
  FailedOpLog failures_;
  // What Submit's and SubmitAsync's batches run with.
  // Op.remote_name: the directory's Resolve, its context checked for size.
  const NameResolver name_resolver_;
  const OpBatchEnvironment batch_env_;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_API_SERVICE_H_

#include "backends/memory/batch_resolver.h"

#include <utility>

namespace rdma_agent::memory {

BatchResolver::Context& BatchResolver::Find(const v1::RemoteBuffer* remote) {
  if (remote == last_remote_) return *last_;
  auto it = contexts_.find(remote);
  if (it == contexts_.end()) {
    Context context;
    context.request.agent_epoch = remote->agent_epoch();
    context.request.buffer_id = remote->buffer_id();
    context.request.token = remote->token();
    // Epoch, id and token only: access and range are the op's, checked
    // below for each one.
    context.request.proof_only = true;
    context.registration = directory_->ResolveForPeer(context.request);
    context.request.proof_only = false;
    it = contexts_.emplace(remote, std::move(context)).first;
  }
  last_remote_ = remote;
  last_ = &it->second;
  return it->second;
}

absl::StatusOr<Registration*> BatchResolver::Resolve(const Op& op) {
  Context& context = Find(op.remote.get());
  if (!context.registration.ok()) return context.registration.status();
  // Released since the lookup: the directory would no longer find it, so
  // an op that begins now fails as its own lookup would have.
  if ((*context.registration)->released()) return NotRegisteredError();
  ServeRequest& request = context.request;
  request.offset = op.remote_offset;
  request.length = op.length;
  request.write = !op.reads_into_local();
  // What ResolveForPeer would check after its lookup, for this op.
  absl::Status status = CheckServeRequest(**context.registration, request);
  if (!status.ok()) return status;
  return context.registration->get();
}

}  // namespace rdma_agent::memory

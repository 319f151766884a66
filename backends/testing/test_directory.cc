#include "backends/testing/test_directory.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace rdma_agent::testing {

absl::StatusOr<std::shared_ptr<Registration>> TestDirectory::ResolveForPeer(
    const ServeRequest& request) const {
  if (request.agent_epoch != epoch_) {
    return StaleContextError();
  }
  absl::MutexLock lock(&mu_);
  auto it = buffers_.find(request.buffer_id);
  if (it == buffers_.end()) {
    return NotRegisteredError();
  }
  absl::Status status = CheckServeRequest(*it->second, request);
  if (!status.ok()) return status;
  return it->second;
}

void TestDirectory::Add(std::shared_ptr<Registration> registration) {
  absl::MutexLock lock(&mu_);
  buffers_[registration->id()] = std::move(registration);
}

void TestDirectory::Remove(uint64_t id) {
  std::shared_ptr<Registration> dropped;  // released outside mu_
  absl::MutexLock lock(&mu_);
  auto it = buffers_.find(id);
  if (it == buffers_.end()) return;
  dropped = std::move(it->second);
  buffers_.erase(it);
}

}  // namespace rdma_agent::testing

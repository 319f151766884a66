#ifndef RDMA_AGENTD_BACKENDS_TESTING_TEST_DIRECTORY_H_
#define RDMA_AGENTD_BACKENDS_TESTING_TEST_DIRECTORY_H_

#include <cstdint>
#include <map>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "backends/buffer_directory.h"

namespace rdma_agent::testing {

// Registrations by id, resolved for peers as the agent does (epoch, id, then
// CheckServeRequest), for backend tests that run without an Agent.
class TestDirectory : public BufferDirectory {
 public:
  explicit TestDirectory(uint64_t epoch) : epoch_(epoch) {}

  absl::StatusOr<std::shared_ptr<Registration>> ResolveForPeer(
      const ServeRequest& request) const override;

  void Add(std::shared_ptr<Registration> registration);
  // Drops the directory's reference (the agent's Release).
  void Remove(uint64_t id);
  uint64_t epoch() const { return epoch_; }

 private:
  const uint64_t epoch_;
  mutable absl::Mutex mu_;
  std::map<uint64_t, std::shared_ptr<Registration>> buffers_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace rdma_agent::testing

#endif  // RDMA_AGENTD_BACKENDS_TESTING_TEST_DIRECTORY_H_

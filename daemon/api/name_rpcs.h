#ifndef RDMA_AGENTD_DAEMON_API_NAME_RPCS_H_
#define RDMA_AGENTD_DAEMON_API_NAME_RPCS_H_

#include <sys/types.h>

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "daemon/directory/directory.h"
#include "daemon/limits/active_calls.h"
#include "rdma/agent/v1/agent.grpc.pb.h"

namespace rdma_agent {

// How many WatchNames streams run, per user and in total: each may hold up
// to kMaxQueuedNameEventBytes of events its reader has not taken.
class NameWatches {
 public:
  NameWatches(size_t max_per_user, size_t max_total)
      : max_per_user_(max_per_user), max_total_(max_total) {}

  // A slot for one stream of `uid`, given back when the returned token
  // goes; RESOURCE_EXHAUSTED naming the flag past either bound.
  absl::StatusOr<std::shared_ptr<void>> Take(uid_t uid);

 private:
  const size_t max_per_user_;
  const size_t max_total_;
  absl::Mutex mu_;
  absl::flat_hash_map<uid_t, size_t> per_user_ ABSL_GUARDED_BY(mu_);
  size_t total_ ABSL_GUARDED_BY(mu_) = 0;
};

// Events a WatchNames stream holds for a slow reader, at most; past either
// bound the stream ends RESOURCE_EXHAUSTED (watch again).
inline constexpr size_t kMaxQueuedNameEvents = 2 * kMaxWatchSnapshot + 1;
inline constexpr size_t kMaxQueuedNameEventBytes = 4 << 20;

// Serves WatchNames for `prefix` from `directory` (the call admitted and
// the slot taken by the caller).
grpc::ServerWriteReactor<v1::NameEvent>* ServeWatchNames(
    std::unique_ptr<ActiveCalls::Call> call, uid_t caller,
    std::shared_ptr<void> slot, Directory* directory, std::string prefix);

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_API_NAME_RPCS_H_

#ifndef RDMA_AGENTD_DAEMON_LIMITS_QUOTA_H_
#define RDMA_AGENTD_DAEMON_LIMITS_QUOTA_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/shared_memory.h"

namespace rdma_agent {

class QuotaCharge;

// How much of one resource (bytes mapped, registrations, parked attach fds,
// attach connections...) each local user, and all users together, may hold.
//
// Admission happens before allocation: a caller reserves with Reserve() before
// it maps, opens or spawns anything, and the QuotaCharge it gets back gives
// the amount back when destroyed. Counters never go negative and never exceed
// their limits. Thread-safe. Held by shared_ptr so that a charge may outlive
// whoever made the quota (a registration pinned by an op at shutdown).
class ResourceQuota : public std::enable_shared_from_this<ResourceQuota> {
 public:
  struct Limits {
    uint64_t per_user = 0;
    uint64_t total = 0;
  };

  // `what` names the resource in refusals ("registered bytes"); the flag
  // names tell the operator which knob to turn.
  static std::shared_ptr<ResourceQuota> Create(std::string what,
                                               std::string per_user_flag,
                                               std::string total_flag,
                                               Limits limits);
  ResourceQuota(const ResourceQuota&) = delete;
  ResourceQuota& operator=(const ResourceQuota&) = delete;

  // Reserves `amount` for `uid`. RESOURCE_EXHAUSTED, naming the limit and its
  // flag, when `uid` or everybody together would go past a limit; nothing is
  // reserved then.
  absl::StatusOr<QuotaCharge> Reserve(uid_t uid, uint64_t amount);

  uint64_t used(uid_t uid) const;
  uint64_t used_total() const;
  // What each user holds now (users holding nothing are left out).
  absl::flat_hash_map<uid_t, uint64_t> used_by_user() const;
  const Limits& limits() const { return limits_; }

 private:
  friend class QuotaCharge;
  ResourceQuota(std::string what, std::string per_user_flag,
                std::string total_flag, Limits limits);
  void Release(uid_t uid, uint64_t amount);

  const std::string what_;
  const std::string per_user_flag_;
  const std::string total_flag_;
  const Limits limits_;
  mutable absl::Mutex mu_;
  uint64_t total_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<uid_t, uint64_t> by_user_ ABSL_GUARDED_BY(mu_);
};

// An amount reserved from a ResourceQuota; gives it back exactly once, when
// destroyed or Reset(). Move-only. A default-constructed charge holds nothing.
class QuotaCharge {
 public:
  QuotaCharge() = default;
  QuotaCharge(QuotaCharge&& other) noexcept;
  QuotaCharge& operator=(QuotaCharge&& other) noexcept;
  QuotaCharge(const QuotaCharge&) = delete;
  QuotaCharge& operator=(const QuotaCharge&) = delete;
  ~QuotaCharge() { Reset(); }

  void Reset();
  uint64_t amount() const { return amount_; }

 private:
  friend class ResourceQuota;
  QuotaCharge(std::shared_ptr<ResourceQuota> quota, uid_t uid, uint64_t amount)
      : quota_(std::move(quota)), uid_(uid), amount_(amount) {}

  std::shared_ptr<ResourceQuota> quota_;
  uid_t uid_ = 0;
  uint64_t amount_ = 0;
};

// A charge that lives with a mapping (SharedMemory::HoldCharge): given back
// once the memory is unmapped and its fd closed.
class MemoryCharge final : public MappingCharge {
 public:
  explicit MemoryCharge(QuotaCharge charge, QuotaCharge also = {})
      : charge_(std::move(charge)), also_(std::move(also)) {}

  // `charge` (and `also`, for memory that counts against two quotas), ready
  // for SharedMemory::HoldCharge or an Admission.
  static std::unique_ptr<MappingCharge> Of(QuotaCharge charge,
                                           QuotaCharge also = {}) {
    return std::make_unique<MemoryCharge>(std::move(charge), std::move(also));
  }

 private:
  QuotaCharge charge_;
  QuotaCharge also_;
};

// The agent's quotas: one per resource a local user can make the agent hold.
struct AgentQuotas {
  // Bytes of memory mapped for the user: registered plus parked on the
  // attach socket, whoever allocated them. Bounds address space and what
  // ibverbs would pin.
  std::shared_ptr<ResourceQuota> bytes;
  // Of those, the bytes the agent allocated itself (allocate_bytes): the
  // only ones charged to the agent's own cgroup.
  std::shared_ptr<ResourceQuota> agent_allocated;
  // Registrations (each holds an fd and a mapping until unmapped).
  std::shared_ptr<ResourceQuota> registrations;
  // Memfds parked on the attach socket, not yet registered (fd + mapping).
  std::shared_ptr<ResourceQuota> pending_attach;
  // Open attach-socket connections (an fd and a thread each).
  std::shared_ptr<ResourceQuota> attach_connections;
  // Clients watched for lifetime-bound registrations (a pidfd each, or a
  // connection polled for closing).
  std::shared_ptr<ResourceQuota> watched_clients;
};

// What the host lets this process hold, read at start.
struct HostLimits {
  uint64_t open_files = 0;     // soft RLIMIT_NOFILE
  uint64_t max_map_count = 0;  // /proc/sys/vm/max_map_count
  uint64_t memory_bytes = 0;   // the host's physical memory
  // The memory limit of the agent's own cgroup (systemd MemoryMax=, a
  // container's limit); none when unlimited.
  std::optional<uint64_t> cgroup_memory_bytes;
  // RLIMIT_MEMLOCK when it binds the agent (finite, and no CAP_IPC_LOCK);
  // none otherwise.
  std::optional<uint64_t> memlock_bytes;
  // Whether a backend pins registered memory (a NIC), so that
  // memlock_bytes bounds what may be registered. Set by the agent once its
  // backends exist.
  bool memory_pinned = false;
};

// Reads RLIMIT_NOFILE, vm.max_map_count, the physical memory, the agent's
// cgroup memory limit and RLIMIT_MEMLOCK. Conservative fallbacks when
// something cannot be read.
HostLimits ReadHostLimits();

// The memory limit of the cgroup this process is in, from `proc_cgroup`
// (the text of /proc/self/cgroup) and the cgroup filesystem at
// `cgroup_root`: cgroup v2 memory.max, else v1
// memory/.../memory.limit_in_bytes. nullopt when there is none ("max", v1's
// page-rounded LLONG_MAX) or it cannot be read.
std::optional<uint64_t> CgroupMemoryLimit(absl::string_view proc_cgroup,
                                          const std::string& cgroup_root);

// Sets the soft RLIMIT_NOFILE to `soft_limit`, or, when 0, raises it to the
// hard limit (every registration and parked attachment holds an fd); never
// above the hard limit. Returns the soft limit in force afterwards.
uint64_t SetOpenFileLimit(uint64_t soft_limit);

// Resource limits of the agent; zero means "derive from the host" (see
// DeriveQuotaLimits).
struct QuotaLimits {
  ResourceQuota::Limits bytes;
  ResourceQuota::Limits agent_allocated;
  ResourceQuota::Limits registrations;
  ResourceQuota::Limits pending_attach;
  ResourceQuota::Limits attach_connections;
  ResourceQuota::Limits watched_clients;
};

// Fills every zero in `limits` from `host`:
//  - fds and mappings: one registration or parked attachment holds one of
//    each, so their budget is min(open files - socket reserve, map count -
//    reserve for libraries and thread stacks); registrations get 3/4 of it,
//    parked attachments 1/4;
//  - bytes (registered or attached, whoever allocated them): physical
//    memory (what ibverbs could pin, far below the 128 TiB of address
//    space), or RLIMIT_MEMLOCK when lower and a NIC pins; never the agent's
//    cgroup: a client's memfd is charged to the client's cgroup;
//  - agent-allocated bytes (charged to the agent's cgroup): 7/8 of the
//    agent's cgroup memory limit when it has one below physical memory (the
//    rest left to the agent itself, so that registrations are refused with
//    RESOURCE_EXHAUSTED before the kernel OOM-kills the agent), else
//    physical memory;
//  - attach connections: 256 in all;
//  - watched clients (a pidfd each, no mapping): out of the fd reserve, a
//    quarter of it and at most 1024;
//  - every per-user limit: a quarter of its total (at least 1), so that one
//    user cannot starve the others.
// Per-user limits set above their total are lowered to the total.
QuotaLimits DeriveQuotaLimits(QuotaLimits limits, const HostLimits& host);

// Where the memory limits DeriveQuotaLimits(asked, host) sets came from,
// for the start-up log: "--max_registered_bytes_total", "the host's
// physical memory", "RLIMIT_MEMLOCK of N, which a NIC's pinned memory
// counts against", "7/8 of the agent's cgroup memory limit of N".
struct MemoryLimitOrigins {
  std::string registered;
  std::string agent_allocated;
};
MemoryLimitOrigins DescribeMemoryLimits(const QuotaLimits& asked,
                                        const HostLimits& host);

// The quotas for `limits` (every field non-zero), with the flag names the
// daemon exposes them under.
AgentQuotas MakeAgentQuotas(const QuotaLimits& limits);

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_LIMITS_QUOTA_H_

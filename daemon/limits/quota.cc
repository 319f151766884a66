#include "daemon/limits/quota.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <utility>

#include "absl/algorithm/container.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace rdma_agent {
namespace {

// Used when /proc/sys/vm/max_map_count cannot be read (the kernel default).
constexpr uint64_t kDefaultMaxMapCount = 65530;
constexpr uint64_t kDefaultAttachConnections = 256;
constexpr uint64_t kMaxDefaultWatchedClients = 1024;

// A positive number from a /proc file, or `fallback`.
uint64_t ReadProcNumber(const char* path, uint64_t fallback) {
  std::ifstream in(path);
  uint64_t value = 0;
  if (in >> value && value > 0) return value;
  return fallback;
}

// What stays free of registrations and parked attachments out of `limit`:
// a quarter, and at least min(1024, half) so that small limits still leave
// room for sockets, thread stacks and libraries.
uint64_t Reserve(uint64_t limit) {
  return std::max(limit / 4, std::min<uint64_t>(1024, limit / 2));
}

void DeriveOne(ResourceQuota::Limits* limits, uint64_t total) {
  if (limits->total == 0) limits->total = std::max<uint64_t>(total, 1);
  if (limits->per_user == 0) {
    limits->per_user = std::max<uint64_t>(limits->total / 4, 1);
  }
  limits->per_user = std::min(limits->per_user, limits->total);
}

// Whether this process may lock memory beyond RLIMIT_MEMLOCK
// (CAP_IPC_LOCK in /proc/self/status's effective set).
bool HasIpcLock() {
  constexpr int kCapIpcLock = 14;
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view rest = line;
    if (!absl::ConsumePrefix(&rest, "CapEff:")) continue;
    uint64_t caps = 0;
    return absl::SimpleHexAtoi(absl::StripAsciiWhitespace(rest), &caps) &&
           (caps >> kCapIpcLock & 1) != 0;
  }
  return false;
}

// What all users together may register: physical memory, or what the NIC
// may pin when that is less.
uint64_t RegistrableBytes(const HostLimits& host) {
  if (host.memory_pinned && host.memlock_bytes.has_value()) {
    return std::min(host.memory_bytes, *host.memlock_bytes);
  }
  return host.memory_bytes;
}

// What the agent may allocate for all users: physical memory, or 7/8 of its
// cgroup's limit when that is less (the rest is the agent's own).
uint64_t AgentMemoryBudget(const HostLimits& host) {
  if (host.cgroup_memory_bytes.has_value()) {
    const uint64_t limit = *host.cgroup_memory_bytes;
    return std::min(host.memory_bytes, limit - limit / 8);
  }
  return host.memory_bytes;
}

}  // namespace

std::shared_ptr<ResourceQuota> ResourceQuota::Create(std::string what,
                                                     std::string per_user_flag,
                                                     std::string total_flag,
                                                     Limits limits) {
  return std::shared_ptr<ResourceQuota>(
      new ResourceQuota(std::move(what), std::move(per_user_flag),
                        std::move(total_flag), limits));
}

ResourceQuota::ResourceQuota(std::string what, std::string per_user_flag,
                             std::string total_flag, Limits limits)
    : what_(std::move(what)),
      per_user_flag_(std::move(per_user_flag)),
      total_flag_(std::move(total_flag)),
      limits_(limits) {}

absl::StatusOr<QuotaCharge> ResourceQuota::Reserve(uid_t uid, uint64_t amount) {
  absl::MutexLock lock(&mu_);
  uint64_t& mine = by_user_[uid];
  // Subtractions, not additions: `amount` comes from a caller and may be
  // near 2^64.
  if (amount > limits_.per_user || mine > limits_.per_user - amount) {
    const uint64_t held = mine;
    if (held == 0) by_user_.erase(uid);
    return absl::ResourceExhaustedError(absl::StrCat(
        "user ", uid, " holds ", held, " ", what_, " and asks for ", amount,
        " more: over the per-user limit of ", limits_.per_user, " (--",
        per_user_flag_, ")"));
  }
  if (amount > limits_.total || total_ > limits_.total - amount) {
    if (mine == 0) by_user_.erase(uid);
    return absl::ResourceExhaustedError(
        absl::StrCat("the agent holds ", total_, " ", what_, " for all users; ",
                     amount, " more would pass the limit of ", limits_.total,
                     " (--", total_flag_, ")"));
  }
  mine += amount;
  total_ += amount;
  return QuotaCharge(shared_from_this(), uid, amount);
}

void ResourceQuota::Release(uid_t uid, uint64_t amount) {
  absl::MutexLock lock(&mu_);
  auto it = by_user_.find(uid);
  if (it == by_user_.end()) return;  // unreachable: charges are exact
  it->second -= std::min(it->second, amount);
  if (it->second == 0) by_user_.erase(it);
  total_ -= std::min(total_, amount);
}

uint64_t ResourceQuota::used(uid_t uid) const {
  absl::MutexLock lock(&mu_);
  auto it = by_user_.find(uid);
  return it == by_user_.end() ? 0 : it->second;
}

absl::flat_hash_map<uid_t, uint64_t> ResourceQuota::used_by_user() const {
  absl::MutexLock lock(&mu_);
  return by_user_;
}

uint64_t ResourceQuota::used_total() const {
  absl::MutexLock lock(&mu_);
  return total_;
}

QuotaCharge::QuotaCharge(QuotaCharge&& other) noexcept
    : quota_(std::move(other.quota_)),
      uid_(other.uid_),
      amount_(std::exchange(other.amount_, 0)) {}

QuotaCharge& QuotaCharge::operator=(QuotaCharge&& other) noexcept {
  if (this != &other) {
    Reset();
    quota_ = std::move(other.quota_);
    uid_ = other.uid_;
    amount_ = std::exchange(other.amount_, 0);
  }
  return *this;
}

void QuotaCharge::Reset() {
  if (quota_ != nullptr && amount_ > 0) quota_->Release(uid_, amount_);
  quota_.reset();
  amount_ = 0;
}

HostLimits ReadHostLimits() {
  HostLimits host;
  struct rlimit files = {};
  host.open_files =
      ::getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur != RLIM_INFINITY
          ? files.rlim_cur
          : 1024;
  host.max_map_count =
      ReadProcNumber("/proc/sys/vm/max_map_count", kDefaultMaxMapCount);
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page_size = ::sysconf(_SC_PAGESIZE);
  host.memory_bytes =
      pages > 0 && page_size > 0
          ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size)
          : uint64_t{1} << 30;
  std::ifstream in("/proc/self/cgroup");
  const std::string cgroups((std::istreambuf_iterator<char>(in)),
                            std::istreambuf_iterator<char>());
  host.cgroup_memory_bytes = CgroupMemoryLimit(cgroups, "/sys/fs/cgroup");
  struct rlimit memlock = {};
  if (::getrlimit(RLIMIT_MEMLOCK, &memlock) == 0 &&
      memlock.rlim_cur != RLIM_INFINITY && !HasIpcLock()) {
    host.memlock_bytes = memlock.rlim_cur;
  }
  return host;
}

std::optional<uint64_t> CgroupMemoryLimit(absl::string_view proc_cgroup,
                                          const std::string& cgroup_root) {
  // v1 "unlimited" is LLONG_MAX rounded down to a page; anything that large
  // is no limit.
  constexpr uint64_t kUnlimited = uint64_t{1} << 62;
  const auto read = [](const std::string& path) -> std::optional<uint64_t> {
    std::ifstream in(path);
    std::string text;
    if (!(in >> text) || text == "max") return std::nullopt;
    uint64_t value = 0;
    if (!absl::SimpleAtoi(text, &value) || value == 0 || value >= kUnlimited) {
      return std::nullopt;
    }
    return value;
  };
  std::optional<uint64_t> v2;
  std::optional<uint64_t> v1;
  for (absl::string_view line : absl::StrSplit(proc_cgroup, '\n')) {
    // "hierarchy-id:controllers:path"
    std::vector<absl::string_view> fields = absl::StrSplit(line, ':');
    if (fields.size() != 3 || !absl::StartsWith(fields[2], "/")) continue;
    const std::string path(fields[2]);
    if (fields[0] == "0" && fields[1].empty()) {
      v2 = read(absl::StrCat(cgroup_root, path, "/memory.max"));
    } else if (absl::c_linear_search(std::vector<absl::string_view>(
                                         absl::StrSplit(fields[1], ',')),
                                     "memory")) {
      v1 = read(
          absl::StrCat(cgroup_root, "/memory", path, "/memory.limit_in_bytes"));
    }
  }
  return v2.has_value() ? v2 : v1;
}

uint64_t SetOpenFileLimit(uint64_t soft_limit) {
  struct rlimit files = {};
  if (::getrlimit(RLIMIT_NOFILE, &files) != 0) return 0;
  // An unlimited hard limit still cannot pass fs.nr_open for fds.
  const rlim_t ceiling =
      files.rlim_max == RLIM_INFINITY
          ? static_cast<rlim_t>(ReadProcNumber("/proc/sys/fs/nr_open", 1 << 20))
          : files.rlim_max;
  const rlim_t wanted =
      soft_limit == 0 ? ceiling : std::min<rlim_t>(soft_limit, ceiling);
  if (files.rlim_cur != wanted) {
    files.rlim_cur = wanted;
    (void)::setrlimit(RLIMIT_NOFILE, &files);
    (void)::getrlimit(RLIMIT_NOFILE, &files);
  }
  return files.rlim_cur;
}

QuotaLimits DeriveQuotaLimits(QuotaLimits limits, const HostLimits& host) {
  const uint64_t fds = host.open_files - Reserve(host.open_files);
  const uint64_t maps = host.max_map_count - Reserve(host.max_map_count);
  const uint64_t objects = std::min(fds, maps);
  DeriveOne(&limits.registrations, objects - objects / 4);
  DeriveOne(&limits.pending_attach, objects / 4);
  DeriveOne(&limits.bytes, RegistrableBytes(host));
  DeriveOne(&limits.agent_allocated, AgentMemoryBudget(host));
  DeriveOne(&limits.attach_connections, kDefaultAttachConnections);
  DeriveOne(&limits.watched_clients,
            std::min(kMaxDefaultWatchedClients, Reserve(host.open_files) / 4));
  return limits;
}

MemoryLimitOrigins DescribeMemoryLimits(const QuotaLimits& asked,
                                        const HostLimits& host) {
  MemoryLimitOrigins origins;
  if (asked.bytes.total != 0) {
    origins.registered = "--max_registered_bytes_total";
  } else if (RegistrableBytes(host) < host.memory_bytes) {
    origins.registered = absl::StrCat("RLIMIT_MEMLOCK of ", *host.memlock_bytes,
                                      ", which a NIC's pinned memory counts "
                                      "against");
  } else {
    origins.registered = "the host's physical memory";
  }
  if (asked.agent_allocated.total != 0) {
    origins.agent_allocated = "--max_agent_allocated_bytes_total";
  } else if (AgentMemoryBudget(host) < host.memory_bytes) {
    origins.agent_allocated =
        absl::StrCat("7/8 of the agent's cgroup memory limit of ",
                     *host.cgroup_memory_bytes);
  } else {
    origins.agent_allocated = "the host's physical memory";
  }
  return origins;
}

AgentQuotas MakeAgentQuotas(const QuotaLimits& limits) {
  AgentQuotas quotas;
  quotas.bytes = ResourceQuota::Create(
      "bytes of registered or attached memory", "max_registered_bytes_per_user",
      "max_registered_bytes_total", limits.bytes);
  quotas.agent_allocated = ResourceQuota::Create(
      "bytes of memory the agent allocated",
      "max_agent_allocated_bytes_per_user", "max_agent_allocated_bytes_total",
      limits.agent_allocated);
  quotas.registrations =
      ResourceQuota::Create("registrations", "max_buffers_per_user",
                            "max_buffers_total", limits.registrations);
  quotas.pending_attach = ResourceQuota::Create(
      "attached memfds not yet registered", "max_pending_attach_per_user",
      "max_pending_attach_total", limits.pending_attach);
  quotas.attach_connections = ResourceQuota::Create(
      "attach-socket connections", "max_attach_connections_per_user",
      "max_attach_connections_total", limits.attach_connections);
  quotas.watched_clients = ResourceQuota::Create(
      "clients watched for their registrations' lifetime",
      "max_watched_clients_per_user", "max_watched_clients_total",
      limits.watched_clients);
  return quotas;
}

}  // namespace rdma_agent

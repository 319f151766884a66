#ifndef RDMA_AGENTD_BACKENDS_REGISTRATION_H_
#define RDMA_AGENTD_BACKENDS_REGISTRATION_H_

#include <sys/types.h>
#include <time.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "backends/device_memory.h"
#include "common/shared_memory.h"
#include "rdma/agent/v1/types.pb.h"

namespace rdma_agent {

namespace v1 = ::rdma::agent::v1;

// Whether `access` lets ops read from / write into a buffer.
inline bool AllowsRead(v1::Access access) {
  return access == v1::ACCESS_READ || access == v1::ACCESS_READ_WRITE;
}
inline bool AllowsWrite(v1::Access access) {
  return access == v1::ACCESS_WRITE || access == v1::ACCESS_READ_WRITE;
}

// Wall-clock nanoseconds since the Unix epoch from the coarse clock (a few
// milliseconds of resolution, a fraction of the cost of the precise one):
// cheap enough to stamp every use of a buffer.
inline int64_t CoarseNowNanos() {
  struct timespec now;
  ::clock_gettime(CLOCK_REALTIME_COARSE, &now);
  return int64_t{now.tv_sec} * 1000000000 + now.tv_nsec;
}

// What a backend keeps for one registration (an MR, a table entry...). It is
// destroyed when the registration is, after every op that pinned the
// registration has finished, so its destructor is where a backend releases
// what it registered (e.g. ibv_dereg_mr).
class BackendRegistration {
 public:
  virtual ~BackendRegistration() = default;
};

// One registered buffer: its memory, its identity and what backends attached
// to it.
//
// Held by std::shared_ptr. The agent's buffer directory holds one reference
// until Release; every op holds one while it runs. The memory is unmapped (and
// backend registrations dropped) when the last reference goes, so a Release
// never pulls memory from under an op in flight.
// Who registered a buffer and how long it lives unreleased, for ListBuffers
// (the lifetime itself is kept by whoever releases the buffer).
struct RegistrationOrigin {
  pid_t pid = 0;  // as the agent sees it; 0 if it cannot
  v1::Lifetime lifetime = v1::LIFETIME_AGENT;
};

// A registration's bytes: host memory the agent maps, or device memory it
// only hands to NICs.
using BufferMemory = std::variant<SharedMemory, DeviceMemory>;

class Registration {
 public:
  using Origin = RegistrationOrigin;

  Registration(uint64_t id, uid_t owner, v1::Access access, std::string label,
               std::string token, BufferMemory memory, bool agent_allocated,
               Origin origin = Origin())
      : id_(id),
        owner_(owner),
        origin_(origin),
        access_(access),
        label_(std::move(label)),
        token_(std::move(token)),
        agent_allocated_(agent_allocated),
        create_time_nanos_(CoarseNowNanos()),
        last_use_nanos_(create_time_nanos_),
        memory_(std::move(memory)) {}
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;

  uint64_t id() const { return id_; }
  uid_t owner() const { return owner_; }
  pid_t owner_pid() const { return origin_.pid; }
  v1::Lifetime lifetime() const { return origin_.lifetime; }
  v1::Access access() const { return access_; }
  const std::string& label() const { return label_; }
  // Random capability that remote requests must present.
  const std::string& token() const { return token_; }
  bool agent_allocated() const { return agent_allocated_; }

  // The host memory, or nullptr for device memory: whatever copies bytes
  // itself (the memory backend, tcp, ReadBuffer) asks this first.
  const SharedMemory* host_memory() const {
    return std::get_if<SharedMemory>(&memory_);
  }
  // The device memory, or nullptr for host memory: NIC backends register
  // its dma-buf.
  const DeviceMemory* device_memory() const {
    return std::get_if<DeviceMemory>(&memory_);
  }
  v1::MemoryKind memory_kind() const {
    const DeviceMemory* device = device_memory();
    return device == nullptr ? v1::MEMORY_KIND_HOST : device->kind();
  }
  uint32_t device_index() const {
    const DeviceMemory* device = device_memory();
    return device == nullptr ? 0 : device->device_index();
  }
  // The device's PCI address ("0000:3b:00.0"); empty for host memory and
  // for device memory attached without one.
  const std::string& pci_bus_id() const {
    static const std::string* const kNone = new std::string();
    const DeviceMemory* device = device_memory();
    return device == nullptr ? *kNone : device->pci_bus_id();
  }

  // The agent's mapping of host memory; nullptr for device memory, which
  // the agent cannot touch (see host_memory()).
  std::byte* data() const {
    const SharedMemory* host = host_memory();
    return host == nullptr ? nullptr : host->data();
  }
  uint64_t size() const {
    return std::visit([](const auto& memory) { return memory.size(); },
                      memory_);
  }
  // The memfd behind the host mapping (to hand it back to its owner); -1
  // for device memory, whose dma-buf the agent never hands out.
  int fd() const {
    const SharedMemory* host = host_memory();
    return host == nullptr ? -1 : host->fd();
  }

  bool readable() const { return AllowsRead(access_); }
  bool writable() const { return AllowsWrite(access_); }

  // Backend state, in registry order. Set once by the backend registry before
  // the registration is published; read-only afterwards.
  void AddBackend(std::string name,
                  std::unique_ptr<BackendRegistration> state) {
    backends_.emplace_back(std::move(name), std::move(state));
  }
  // The state `backend` attached, or nullptr.
  BackendRegistration* backend_state(const std::string& backend) const {
    for (const auto& [name, state] : backends_) {
      if (name == backend) return state.get();
    }
    return nullptr;
  }
  // The serialized remote context Register answered, for names published
  // later. Set once before the registration is published; read-only after.
  void set_remote_context(std::string context) {
    remote_context_ = std::move(context);
  }
  const std::string& remote_context() const { return remote_context_; }

  std::vector<std::string> backend_names() const {
    std::vector<std::string> names;
    for (const auto& entry : backends_) names.push_back(entry.first);
    return names;
  }

  // Traffic counters for ListBuffers.
  void CountMoved(uint64_t bytes) { bytes_moved_ += bytes; }
  void CountServed(uint64_t bytes) { bytes_served_ += bytes; }
  uint64_t bytes_moved() const { return bytes_moved_.load(); }
  uint64_t bytes_served() const { return bytes_served_.load(); }

  // Stamps "used now": the buffer is the local or remote side of an op, or
  // is read or written over the API. Called on data paths, so it loads and
  // stores only when the coarse clock has moved on (relaxed): concurrent ops
  // on one buffer seldom write the shared cache line. Two racing stamps may
  // leave the older of their two times, a clock tick at most.
  void MarkUsed() {
    const int64_t now = CoarseNowNanos();
    if (now > last_use_nanos_.load(std::memory_order_relaxed)) {
      last_use_nanos_.store(now, std::memory_order_relaxed);
    }
  }
  // Set once, by the buffer table, when it unpublishes the registration
  // (Release, or the agent dropping every registration). Whoever pinned it
  // earlier to serve several ops (a batch's one lookup) asks before each op,
  // so that an op which begins after the release fails as if it had looked
  // the buffer up itself.
  void MarkReleased() { released_.store(true, std::memory_order_release); }
  bool released() const { return released_.load(std::memory_order_acquire); }

  // Unix nanoseconds of the registration and of its last use (the
  // registration's time until it is used).
  int64_t create_time_nanos() const { return create_time_nanos_; }
  int64_t last_use_nanos() const {
    return last_use_nanos_.load(std::memory_order_relaxed);
  }

 private:
  const uint64_t id_;
  const uid_t owner_;
  const Origin origin_;
  const v1::Access access_;
  const std::string label_;
  const std::string token_;
  const bool agent_allocated_;
  std::atomic<uint64_t> bytes_moved_{0};
  std::atomic<uint64_t> bytes_served_{0};
  const int64_t create_time_nanos_;
  std::atomic<int64_t> last_use_nanos_;
  std::atomic<bool> released_{false};
  // Declared before backends_ so that backend state (MRs) is dropped before
  // the memory it covers is unmapped (or its dma-buf closed).
  BufferMemory memory_;
  std::vector<std::pair<std::string, std::unique_ptr<BackendRegistration>>>
      backends_;
  std::string remote_context_;
};

// OK for host memory. For device memory FAILED_PRECONDITION: "buffer 7 is
// CUDA device memory (device 0); <consequence>" -- what everything that
// copies bytes itself answers (ReadBuffer, the memory and tcp backends).
inline absl::Status RequireHostMemory(const Registration& registration,
                                      absl::string_view consequence) {
  if (registration.host_memory() != nullptr) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "buffer ", registration.id(), " is ",
      DescribeMemory(registration.memory_kind(), registration.device_index()),
      "; ", consequence));
}

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_BACKENDS_REGISTRATION_H_

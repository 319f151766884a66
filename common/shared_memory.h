#ifndef RDMA_AGENTD_COMMON_SHARED_MEMORY_H_
#define RDMA_AGENTD_COMMON_SHARED_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "common/unique_fd.h"

namespace rdma_agent {

// Something held exactly as long as a mapping: let go only after the memory
// is unmapped and its fd closed (e.g. the agent's quota charge for it).
class MappingCharge {
 public:
  virtual ~MappingCharge() = default;
};

// A shared mapping of a memfd: the memory behind every registration.
//
// The fd is kept so the agent can hand the same memory to its owner again
// (OpenBuffer on the attach socket). Client memfds must be sealed against
// shrinking, so the mapping can never lose its pages under the agent (no
// SIGBUS however the client treats its own fd or mapping).
class SharedMemory {
 public:
  // Decides whether `size` bytes may be mapped, before anything is: an error
  // refuses (and is returned as is), a charge is held by the mapping.
  using Admission =
      absl::FunctionRef<absl::StatusOr<std::unique_ptr<MappingCharge>>(
          uint64_t size)>;

  // Creates a zero-filled memfd of `size` bytes (size > 0), sealed against
  // shrinking, and maps it. `admit` runs first, before the memfd exists.
  static absl::StatusOr<SharedMemory> Allocate(uint64_t size,
                                               const std::string& name,
                                               Admission admit);
  static absl::StatusOr<SharedMemory> Allocate(uint64_t size,
                                               const std::string& name);

  // Maps a memfd received from a client. Fails with INVALID_ARGUMENT unless it
  // is a memfd sealed with F_SEAL_SHRINK and non-empty. `admit` sees the size
  // (fstat) before it is mapped; when it refuses, nothing is mapped and `fd`
  // is closed.
  static absl::StatusOr<SharedMemory> Adopt(UniqueFd fd, Admission admit);
  static absl::StatusOr<SharedMemory> Adopt(UniqueFd fd);

  SharedMemory(SharedMemory&& other) noexcept;
  SharedMemory& operator=(SharedMemory&& other) noexcept;
  SharedMemory(const SharedMemory&) = delete;
  SharedMemory& operator=(const SharedMemory&) = delete;
  ~SharedMemory();

  std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }
  int fd() const { return fd_.get(); }

  // Keeps `charge` until this memory is unmapped and its fd closed (moves
  // with the memory).
  void HoldCharge(std::unique_ptr<MappingCharge> charge);

 private:
  SharedMemory(UniqueFd fd, std::byte* data, uint64_t size)
      : fd_(std::move(fd)), data_(data), size_(size) {}
  // Unmaps, closes the fd, then lets the charges go.
  void Reset();

  UniqueFd fd_;
  std::byte* data_ = nullptr;
  uint64_t size_ = 0;
  std::vector<std::unique_ptr<MappingCharge>> charges_;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_COMMON_SHARED_MEMORY_H_

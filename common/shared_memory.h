#ifndef RDMA_AGENTD_COMMON_SHARED_MEMORY_H_
#define RDMA_AGENTD_COMMON_SHARED_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/unique_fd.h"

namespace rdma_agent {

// A shared mapping of a memfd: the memory behind every registration.
//
// The fd is kept so the agent can hand the same memory to its owner again
// (OpenBuffer on the attach socket). Client memfds must be sealed against
// shrinking, so the mapping can never lose its pages under the agent (no
// SIGBUS however the client treats its own fd or mapping).
class SharedMemory {
 public:
  // Creates a zero-filled memfd of `size` bytes (size > 0), sealed against
  // shrinking, and maps it.
  static absl::StatusOr<SharedMemory> Allocate(uint64_t size,
                                               const std::string& name);

  // Maps a memfd received from a client. Fails with INVALID_ARGUMENT unless it
  // is a memfd sealed with F_SEAL_SHRINK and non-empty.
  static absl::StatusOr<SharedMemory> Adopt(UniqueFd fd);

  SharedMemory(SharedMemory&& other) noexcept;
  SharedMemory& operator=(SharedMemory&& other) noexcept;
  SharedMemory(const SharedMemory&) = delete;
  SharedMemory& operator=(const SharedMemory&) = delete;
  ~SharedMemory();

  std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }
  int fd() const { return fd_.get(); }

 private:
  SharedMemory(UniqueFd fd, std::byte* data, uint64_t size)
      : fd_(std::move(fd)), data_(data), size_(size) {}
  void Unmap();

  UniqueFd fd_;
  std::byte* data_ = nullptr;
  uint64_t size_ = 0;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_COMMON_SHARED_MEMORY_H_

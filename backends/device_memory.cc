#include "backends/device_memory.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace rdma_agent {

absl::StatusOr<DeviceMemory> DeviceMemory::Adopt(
    UniqueFd fd, const Description& description,
    SharedMemory::Admission admit) {
  if (!fd) {
    return absl::InvalidArgumentError(
        "no dma-buf file descriptor came with the request");
  }
  if (description.kind == v1::MEMORY_KIND_HOST ||
      !v1::MemoryKind_IsValid(description.kind)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device memory kind ", description.kind,
        " is not MEMORY_KIND_CUDA, MEMORY_KIND_ROCM or MEMORY_KIND_OTHER "
        "(host memory is attached as a memfd, with AttachMemory)"));
  }
  if (description.length == 0) {
    return absl::InvalidArgumentError("device memory length must be positive");
  }
  if (description.offset > UINT64_MAX - description.length) {
    return absl::InvalidArgumentError(
        absl::StrCat("device memory range of ", description.length,
                     " bytes at offset ", description.offset, " overflows"));
  }
  // A dma-buf answers its size to SEEK_END (and nothing else): the range is
  // checked here rather than at the first ibv_reg_dmabuf_mr. The file
  // position is the owner's too (one open file): it is put back.
  const off_t position = ::lseek(fd.get(), 0, SEEK_CUR);
  const off_t end = ::lseek(fd.get(), 0, SEEK_END);
  if (position >= 0) (void)::lseek(fd.get(), position, SEEK_SET);
  if (end < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the file descriptor is not a dma-buf (lseek: ", std::strerror(errno),
        ")"));
  }
  if (description.offset + description.length > static_cast<uint64_t>(end)) {
    return absl::InvalidArgumentError(
        absl::StrCat("device memory range [", description.offset, ", ",
                     description.offset + description.length,
                     ") ends past the dma-buf's ", end, " bytes"));
  }
  auto charge = admit(description.length);
  if (!charge.ok()) return charge.status();
  DeviceMemory memory(std::move(fd), description);
  memory.HoldCharge(std::move(*charge));
  return memory;
}

DeviceMemory::~DeviceMemory() {
  fd_.reset();
  charges_.clear();
}

void DeviceMemory::HoldCharge(std::unique_ptr<MappingCharge> charge) {
  if (charge != nullptr) charges_.push_back(std::move(charge));
}

std::string DescribeMemory(v1::MemoryKind kind, uint32_t device_index) {
  switch (kind) {
    case v1::MEMORY_KIND_HOST:
      return "host memory";
    case v1::MEMORY_KIND_CUDA:
      return absl::StrCat("CUDA device memory (device ", device_index, ")");
    case v1::MEMORY_KIND_ROCM:
      return absl::StrCat("ROCm device memory (device ", device_index, ")");
    default:
      return absl::StrCat("device memory (device ", device_index, ")");
  }
}

}  // namespace rdma_agent

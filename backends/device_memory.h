#ifndef RDMA_AGENTD_BACKENDS_DEVICE_MEMORY_H_
#define RDMA_AGENTD_BACKENDS_DEVICE_MEMORY_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/shared_memory.h"
#include "common/unique_fd.h"
#include "rdma/agent/v1/types.pb.h"

namespace rdma_agent {

namespace v1 = ::rdma::agent::v1;

// Device memory (a GPU's) that its owner exported as a dma-buf and handed
// over: the range [offset, offset + size) of the dma-buf behind fd().
//
// The agent never maps it and links no GPU runtime: NIC backends register
// it (ibv_reg_dmabuf_mr, one memory region per PD, each made from fd()), so
// the fd stays open for as long as this object lives. Holds its quota
// charges until the fd is closed, as SharedMemory does.
class DeviceMemory {
 public:
  // What the owner says about the memory (AttachDeviceMemory).
  struct Description {
    uint64_t offset = 0;
    uint64_t length = 0;
    v1::MemoryKind kind = v1::MEMORY_KIND_OTHER;
    uint32_t device_index = 0;
    // The device's PCI address in any form NormalizePciBusId takes; empty
    // when not known. Kept in sysfs's form.
    std::string pci_bus_id;
  };

  // Adopts `fd` as `description` says. INVALID_ARGUMENT, with `fd` closed,
  // when there is no fd, the kind is MEMORY_KIND_HOST or not a known kind,
  // the length is 0, the PCI address is malformed (NormalizePciBusId), or
  // the range overflows or ends past the dma-buf's size
  // (lseek SEEK_END, which dma-bufs and memfds answer; an fd that cannot
  // say, such as a socket, is no dma-buf). `admit` sees the length last,
  // and what it refuses is returned as is.
  static absl::StatusOr<DeviceMemory> Adopt(UniqueFd fd,
                                            const Description& description,
                                            SharedMemory::Admission admit);

  DeviceMemory(DeviceMemory&&) noexcept = default;
  DeviceMemory& operator=(DeviceMemory&&) noexcept = default;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  // Closes the fd, then lets the charges go.
  ~DeviceMemory();

  // The dma-buf, for ibv_reg_dmabuf_mr. Owned here: never close it.
  int fd() const { return fd_.get(); }
  uint64_t offset() const { return description_.offset; }
  uint64_t size() const { return description_.length; }
  v1::MemoryKind kind() const { return description_.kind; }
  uint32_t device_index() const { return description_.device_index; }
  // The device's PCI address as sysfs names it ("0000:3b:00.0"), or empty.
  const std::string& pci_bus_id() const { return description_.pci_bus_id; }

  // Keeps `charge` until the fd is closed (moves with the memory).
  void HoldCharge(std::unique_ptr<MappingCharge> charge);

 private:
  DeviceMemory(UniqueFd fd, const Description& description)
      : fd_(std::move(fd)), description_(description) {}

  UniqueFd fd_;
  Description description_;
  std::vector<std::unique_ptr<MappingCharge>> charges_;
};

// A PCI address as GPU runtimes and tools print it, in the form sysfs names
// the device (/sys/bus/pci/devices/<it>): "domain:bus:device.function" in
// lower-case hex with a domain of at least four digits. Takes
// cuDeviceGetPCIBusId's "0000:3B:00.0", nvidia-smi's "00000000:3B:00.0" and
// lspci's short "3b:00.0" (domain 0); surrounding blanks are dropped. Empty
// stays empty (no address). INVALID_ARGUMENT, naming the text, for anything
// else: the result is used as a path component and must never be more.
absl::StatusOr<std::string> NormalizePciBusId(absl::string_view text);

// "CUDA device memory (device 1)", "host memory": how messages name memory.
std::string DescribeMemory(v1::MemoryKind kind, uint32_t device_index);

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_BACKENDS_DEVICE_MEMORY_H_

#include "common/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_util.h"

namespace rdma_agent {
namespace {

absl::Status ErrnoStatus(absl::string_view what) {
  const int err = errno;
  return ::rdma_agent::ErrnoStatus(
      err == ENOMEM || err == ENOSPC || err == EMFILE || err == ENFILE
          ? absl::StatusCode::kResourceExhausted
          : absl::StatusCode::kInternal,
      what, err);
}

absl::StatusOr<std::byte*> MapShared(int fd, uint64_t size) {
  void* addr = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (addr == MAP_FAILED) return ErrnoStatus("mmap");
  return static_cast<std::byte*>(addr);
}

absl::StatusOr<std::unique_ptr<MappingCharge>> AdmitAll(uint64_t) {
  return nullptr;
}

}  // namespace

absl::StatusOr<SharedMemory> SharedMemory::Allocate(uint64_t size,
                                                    const std::string& name) {
  return Allocate(size, name, AdmitAll);
}

absl::StatusOr<SharedMemory> SharedMemory::Adopt(UniqueFd fd) {
  return Adopt(std::move(fd), AdmitAll);
}

absl::StatusOr<SharedMemory> SharedMemory::Allocate(uint64_t size,
                                                    const std::string& name,
                                                    Admission admit) {
  if (size == 0) return absl::InvalidArgumentError("size must be positive");
  auto charge = admit(size);
  if (!charge.ok()) return charge.status();
  UniqueFd fd(::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd) return ErrnoStatus("memfd_create");
  if (::ftruncate(fd.get(), static_cast<off_t>(size)) != 0) {
    return ErrnoStatus(absl::StrCat("ftruncate to ", size, " bytes"));
  }
  // Whoever the agent hands this fd to (the owner, to map it) can grow it
  // but never shrink it under the agent's mapping.
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_SEAL) != 0) {
    return ErrnoStatus("sealing memfd");
  }
  auto data = MapShared(fd.get(), size);
  if (!data.ok()) return data.status();
  SharedMemory memory(std::move(fd), *data, size);
  memory.HoldCharge(std::move(*charge));
  return memory;
}

absl::StatusOr<SharedMemory> SharedMemory::Adopt(UniqueFd fd, Admission admit) {
  const int seals = ::fcntl(fd.get(), F_GET_SEALS);
  if (seals < 0) {
    return absl::InvalidArgumentError(
        "attached fd is not a sealable memfd (F_GET_SEALS failed)");
  }
  if ((seals & F_SEAL_SHRINK) == 0) {
    return absl::InvalidArgumentError(
        "attached memfd must be sealed with F_SEAL_SHRINK");
  }
  if ((seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) != 0) {
    return absl::InvalidArgumentError(
        "attached memfd is write-sealed; the agent needs to write it");
  }
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus("fstat");
  if (st.st_size <= 0) {
    return absl::InvalidArgumentError("attached memfd is empty");
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  // Before mmap: a sparse memfd can claim terabytes that cost its owner
  // nothing but would cost the agent its address space.
  auto charge = admit(size);
  if (!charge.ok()) return charge.status();
  auto data = MapShared(fd.get(), size);
  if (!data.ok()) return data.status();
  SharedMemory memory(std::move(fd), *data, size);
  memory.HoldCharge(std::move(*charge));
  return memory;
}

SharedMemory::SharedMemory(SharedMemory&& other) noexcept
    : fd_(std::move(other.fd_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      charges_(std::move(other.charges_)) {
  other.charges_.clear();
}

SharedMemory& SharedMemory::operator=(SharedMemory&& other) noexcept {
  if (this != &other) {
    Reset();
    fd_ = std::move(other.fd_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    charges_ = std::move(other.charges_);
    other.charges_.clear();
  }
  return *this;
}

SharedMemory::~SharedMemory() { Reset(); }

void SharedMemory::HoldCharge(std::unique_ptr<MappingCharge> charge) {
  if (charge != nullptr) charges_.push_back(std::move(charge));
}

void SharedMemory::Reset() {
  if (data_ != nullptr) ::munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
  fd_.reset();
  // Last: what the charges account for is gone now.
  charges_.clear();
}

}  // namespace rdma_agent

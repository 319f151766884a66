#include "backends/device_memory.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace rdma_agent {
namespace {

// `text` as an unsigned hex number of 1..max_digits digits; false for
// anything else (signs, blanks, "0x" included).
bool ParseHex(absl::string_view text, size_t max_digits, uint32_t* value) {
  if (text.empty() || text.size() > max_digits) return false;
  uint32_t parsed = 0;
  for (char c : text) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) return false;
    const char lower = absl::ascii_tolower(static_cast<unsigned char>(c));
    parsed = parsed * 16 + (lower <= '9' ? lower - '0' : lower - 'a' + 10);
  }
  *value = parsed;
  return true;
}

}  // namespace

absl::StatusOr<std::string> NormalizePciBusId(absl::string_view text) {
  const absl::string_view trimmed = absl::StripAsciiWhitespace(text);
  if (trimmed.empty()) return std::string();
  const auto malformed = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        "PCI bus id \"", absl::CHexEscape(text),
        "\" is not a PCI address such as 0000:3b:00.0 "
        "([domain:]bus:device.function, hex; device <= 1f, function <= 7)"));
  };
  // [domain:]bus:device.function
  std::vector<absl::string_view> parts = absl::StrSplit(trimmed, ':');
  if (parts.size() == 2) parts.insert(parts.begin(), "0");
  if (parts.size() != 3) return malformed();
  const std::vector<absl::string_view> slot = absl::StrSplit(parts[2], '.');
  if (slot.size() != 2) return malformed();
  // The domain is 16 bits in the PCI spec and printed with 8 digits by
  // NVML; Linux prints at least 4 (more for synthetic domains such as
  // VMD's 10000). Bus and device are two digits, the function one.
  uint32_t domain = 0, bus = 0, device = 0, function = 0;
  if (!ParseHex(parts[0], 8, &domain) || parts[1].size() != 2 ||
      !ParseHex(parts[1], 2, &bus) || slot[0].size() != 2 ||
      !ParseHex(slot[0], 2, &device) || device > 0x1f ||
      !ParseHex(slot[1], 1, &function) || function > 7) {
    return malformed();
  }
  return absl::StrFormat("%04x:%02x:%02x.%x", domain, bus, device, function);
}

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
  absl::StatusOr<std::string> pci_bus_id =
      NormalizePciBusId(description.pci_bus_id);
  if (!pci_bus_id.ok()) return pci_bus_id.status();
  auto charge = admit(description.length);
  if (!charge.ok()) return charge.status();
  Description kept = description;
  kept.pci_bus_id = *std::move(pci_bus_id);
  DeviceMemory memory(std::move(fd), kept);
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

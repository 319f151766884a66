#include "common/random.h"

#include <sys/random.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace rdma_agent {

std::string RandomBytes(size_t size) {
  std::string bytes(size, '\0');
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::getrandom(bytes.data() + done, size - done, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      // Without the kernel CSPRNG no token would be safe to hand out.
      std::abort();
    }
    done += static_cast<size_t>(n);
  }
  return bytes;
}

uint64_t RandomNonZeroU64() {
  uint64_t value = 0;
  while (value == 0) {
    const std::string bytes = RandomBytes(sizeof(value));
    std::memcpy(&value, bytes.data(), sizeof(value));
  }
  return value;
}

}  // namespace rdma_agent

#include "tests/testing/allocation_count.h"

#include <atomic>
#include <cstdlib>
#include <new>

namespace rdma_agent::testing {
namespace {
std::atomic<int64_t> allocations{0};
}  // namespace

int64_t Allocations() { return allocations.load(std::memory_order_relaxed); }

}  // namespace rdma_agent::testing

// Counting replacements of the global allocation functions (malloc/free
// underneath).
void* operator new(std::size_t size) {
  rdma_agent::testing::allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t size, std::align_val_t align) {
  rdma_agent::testing::allocations.fetch_add(1, std::memory_order_relaxed);
  const std::size_t alignment = static_cast<std::size_t>(align);
  const std::size_t rounded = (size + alignment - 1) / alignment * alignment;
  if (void* p =
          std::aligned_alloc(alignment, rounded == 0 ? alignment : rounded)) {
    return p;
  }
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept {
  std::free(p);
}

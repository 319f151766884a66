#include "tests/testing/allocation_count.h"

#include <atomic>
#include <cstdlib>
#include <new>

namespace rdma_agent::testing {
namespace {
std::atomic<int64_t> allocations{0};
std::atomic<bool (*)()> filter{nullptr};

void Count() {
  bool (*counted)() = filter.load(std::memory_order_relaxed);
  if (counted == nullptr || counted()) {
    allocations.fetch_add(1, std::memory_order_relaxed);
  }
}
}  // namespace

int64_t Allocations() { return allocations.load(std::memory_order_relaxed); }

void CountOnly(bool (*counted)()) {
  filter.store(counted, std::memory_order_relaxed);
}

}  // namespace rdma_agent::testing

// Counting replacements of every form of the global allocation functions
// (malloc/free underneath), so that all are counted and each pairs with its
// delete (AddressSanitizer reports a form left to it and freed here).
void* operator new(std::size_t size) {
  rdma_agent::testing::Count();
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t size, std::align_val_t align) {
  rdma_agent::testing::Count();
  const std::size_t alignment = static_cast<std::size_t>(align);
  const std::size_t rounded = (size + alignment - 1) / alignment * alignment;
  if (void* p =
          std::aligned_alloc(alignment, rounded == 0 ? alignment : rounded)) {
    return p;
  }
  throw std::bad_alloc();
}
void* operator new(std::size_t size, const std::nothrow_t&) noexcept {
  rdma_agent::testing::Count();
  return std::malloc(size == 0 ? 1 : size);
}
void* operator new(std::size_t size, std::align_val_t align,
                   const std::nothrow_t&) noexcept {
  try {
    return operator new(size, align);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}
void* operator new[](std::size_t size) { return operator new(size); }
void* operator new[](std::size_t size, std::align_val_t align) {
  return operator new(size, align);
}
void* operator new[](std::size_t size, const std::nothrow_t& nothrow) noexcept {
  return operator new(size, nothrow);
}
void* operator new[](std::size_t size, std::align_val_t align,
                     const std::nothrow_t& nothrow) noexcept {
  return operator new(size, align, nothrow);
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t,
                     const std::nothrow_t&) noexcept {
  std::free(p);
}
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, const std::nothrow_t&) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::align_val_t,
                       const std::nothrow_t&) noexcept {
  std::free(p);
}

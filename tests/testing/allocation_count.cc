#include "tests/testing/allocation_count.h"

#include <sys/prctl.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <utility>
#include <vector>

namespace rdma_agent::testing {
namespace {
std::atomic<int64_t> allocations{0};
// Set once by CountOnlyOn, before `only_named` makes it read.
std::vector<std::string>* name_prefixes = nullptr;
std::atomic<bool> only_named{false};
thread_local bool on_counted_thread = false;

bool Counted() {
  if (!only_named.load(std::memory_order_acquire) || on_counted_thread) {
    return true;
  }
  char name[16] = {};
  ::prctl(PR_GET_NAME, name);
  for (const std::string& prefix : *name_prefixes) {
    if (std::strncmp(name, prefix.c_str(), prefix.size()) == 0) return true;
  }
  return false;
}

void Count() {
  if (Counted()) allocations.fetch_add(1, std::memory_order_relaxed);
}
}  // namespace

int64_t Allocations() { return allocations.load(std::memory_order_relaxed); }

void CountOnlyOn(std::vector<std::string> prefixes) {
  on_counted_thread = true;
  // The first call's prefixes stand: other threads may be reading them.
  if (name_prefixes != nullptr) return;
  name_prefixes = new std::vector<std::string>(std::move(prefixes));
  only_named.store(true, std::memory_order_release);
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

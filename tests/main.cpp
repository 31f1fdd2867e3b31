// The doctest runner of psx_tests, and its allocation-failure hook
// (psx_test::fail_allocation, support.hpp): operator new throws bad_alloc
// at the n-th allocation of the thread that armed it, and otherwise is
// malloc's.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cstdlib>
#include <new>

namespace psx_test {
namespace {
thread_local long allocations_left = -1;  // -1: off
}  // namespace
void fail_allocation(long n) noexcept { allocations_left = n; }
}  // namespace psx_test

namespace {
void* allocate(std::size_t n) {
  if (psx_test::allocations_left >= 0 && psx_test::allocations_left-- == 0) throw std::bad_alloc();
  if (void* p = std::malloc(n != 0 ? n : 1)) return p;
  throw std::bad_alloc();
}
}  // namespace

void* operator new(std::size_t n) { return allocate(n); }
void* operator new[](std::size_t n) { return allocate(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

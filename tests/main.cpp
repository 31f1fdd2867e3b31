// The doctest runner of psx_tests, and its allocation-failure hook
// (psx_test::fail_allocation, support.hpp): operator new throws bad_alloc
// at the n-th allocation of the thread that armed it, and otherwise is
// malloc's. Not under ThreadSanitizer: memory that libzmq's threads take
// from a replaced operator new shows there as races inside libzmq, which
// its own operator new keeps out of sight; there the hook is off.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdlib>
#include <new>

#if defined(__SANITIZE_THREAD__)
#define PSX_TEST_FAIL_ALLOCATIONS 0
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)  // clang's way of saying so
#define PSX_TEST_FAIL_ALLOCATIONS 0
#endif
#endif
#ifndef PSX_TEST_FAIL_ALLOCATIONS
#define PSX_TEST_FAIL_ALLOCATIONS 1
#include "replace_new.hpp"
#endif

namespace psx_test {
namespace {
thread_local long allocations_left = -1;  // -1: off
}  // namespace

bool can_fail_allocations() noexcept { return PSX_TEST_FAIL_ALLOCATIONS != 0; }
void fail_allocation(long n) noexcept { allocations_left = n; }

void* allocate(std::size_t n) {
  if (allocations_left >= 0 && allocations_left-- == 0) throw std::bad_alloc();
  if (void* p = std::malloc(n != 0 ? n : 1)) return p;
  throw std::bad_alloc();
}
}  // namespace psx_test

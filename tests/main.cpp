// The doctest runner of psx_tests, and its allocation-failure hook
// (psx_test::fail_allocation, support.hpp): operator new throws bad_alloc
// at the n-th allocation of the thread that armed it, and otherwise is
// malloc's.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include "replace_new.hpp"

namespace psx_test {
namespace {
thread_local long allocations_left = -1;  // -1: off
}  // namespace

void fail_allocation(long n) noexcept { allocations_left = n; }

void* allocate(std::size_t n) {
  if (allocations_left >= 0 && allocations_left-- == 0) throw std::bad_alloc();
  if (void* p = std::malloc(n != 0 ? n : 1)) return p;
  throw std::bad_alloc();
}
}  // namespace psx_test

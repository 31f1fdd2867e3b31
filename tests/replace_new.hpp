// Replaces the global operator new and delete of the one program that
// includes this (in one translation unit): new takes its memory from
// psx_test::allocate, which that program defines, and delete gives it back
// to free. Aligned new and delete are left as they are (they pair with each
// other).
#pragma once

#include <cstddef>
#include <cstdlib>
#include <new>

namespace psx_test {
// Memory for operator new (malloc's, or a throw): defined by the includer.
void* allocate(std::size_t n);
}  // namespace psx_test

void* operator new(std::size_t n) { return psx_test::allocate(n); }
void* operator new[](std::size_t n) { return psx_test::allocate(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

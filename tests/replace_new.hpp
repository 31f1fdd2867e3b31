// Replaces the global operator new and delete of the one program that
// includes this (in one translation unit): new (plain, array, nothrow)
// takes its memory from psx_test::allocate, which that program defines,
// and delete gives it back to free. Every form that pairs with malloc'd
// memory is replaced, or a sanitizer's own new would meet this delete
// (std::stable_sort uses nothrow new); aligned new and delete are left as
// they are (they pair with each other) and are not counted.
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
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return psx_test::allocate(n);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, const std::nothrow_t& t) noexcept { return operator new(n, t); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }

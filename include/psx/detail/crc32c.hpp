//! @file psx/detail/crc32c.hpp
//! CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of
//! psx's checkpoint files and of TFRecord/TensorBoard event files, and
//! CRC-32 (IEEE 802.3, reflected 0xEDB88320), the checksum of zip members
//! (the .npz export). CRC-32C uses the SSE4.2 `crc32` instruction where the
//! CPU has it, a slicing-by-8 table otherwise; both give the same value.
//! None of psx's dependencies exports these, so they are written here.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

namespace psx {
inline namespace v0 {
namespace detail {

template <std::uint32_t Poly = 0x82F63B78u>
const std::array<std::array<std::uint32_t, 256>, 8>& crc32_tables() noexcept {
  static const auto tables = [] {
    std::array<std::array<std::uint32_t, 256>, 8> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (Poly & (0u - (c & 1u)));
      t[0][i] = c;
    }
    for (std::size_t s = 1; s < 8; ++s)
      for (std::size_t i = 0; i < 256; ++i) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xffu];
    return t;
  }();
  return tables;
}

// Continues `crc` (the raw register, not inverted) over `n` bytes at `p`.
template <std::uint32_t Poly = 0x82F63B78u>
std::uint32_t crc32_table(std::uint32_t crc, const unsigned char* p, std::size_t n) noexcept {
  const auto& t = crc32_tables<Poly>();
  for (; n >= 8; n -= 8, p += 8) {
    std::uint64_t w;
    std::memcpy(&w, p, 8);  // little-endian hosts only (psx's files are little-endian)
    w ^= crc;
    crc = t[7][w & 0xff] ^ t[6][(w >> 8) & 0xff] ^ t[5][(w >> 16) & 0xff] ^ t[4][(w >> 24) & 0xff] ^
          t[3][(w >> 32) & 0xff] ^ t[2][(w >> 40) & 0xff] ^ t[1][(w >> 48) & 0xff] ^ t[0][w >> 56];
  }
  for (; n > 0; --n, ++p) crc = (crc >> 8) ^ t[0][(crc ^ *p) & 0xffu];
  return crc;
}

// Appending `len` zero bytes to a CRC-32C register is linear: these four
// tables apply that operator a byte of the register at a time (Mark
// Adler's construction, crc32c.c, by squaring the one-zero-bit operator
// over GF(2)). They combine the CRCs of three lanes computed side by side.
struct Crc32cShift {
  std::array<std::array<std::uint32_t, 256>, 4> t{};

  static std::uint32_t times(const std::array<std::uint32_t, 32>& mat, std::uint32_t vec) noexcept {
    std::uint32_t sum = 0;
    for (std::size_t i = 0; vec; vec >>= 1, ++i)
      if (vec & 1u) sum ^= mat[i];
    return sum;
  }
  static void square(std::array<std::uint32_t, 32>& out, const std::array<std::uint32_t, 32>& mat) noexcept {
    for (std::size_t n = 0; n < 32; ++n) out[n] = times(mat, mat[n]);
  }
  // `len` a power of two, at least 1.
  explicit Crc32cShift(std::size_t len) noexcept {
    std::array<std::uint32_t, 32> odd{}, even{};
    odd[0] = 0x82F63B78u;  // one zero bit
    for (std::uint32_t n = 1, row = 1; n < 32; ++n, row <<= 1) odd[n] = row;
    square(even, odd);  // two zero bits
    square(odd, even);  // four
    for (;;) {
      square(even, odd);  // a byte, then 4, 16, ... bytes
      len >>= 1;
      if (len == 0) break;
      square(odd, even);
      len >>= 1;
      if (len == 0) {
        even = odd;
        break;
      }
    }
    for (std::uint32_t n = 0; n < 256; ++n)
      for (std::size_t b = 0; b < 4; ++b) t[b][n] = times(even, n << (8 * b));
  }
  std::uint32_t operator()(std::uint32_t crc) const noexcept {
    return t[0][crc & 0xff] ^ t[1][(crc >> 8) & 0xff] ^ t[2][(crc >> 16) & 0xff] ^ t[3][crc >> 24];
  }
};

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// The `crc32` instruction has a latency of 3 cycles and a throughput of 1:
// three lanes of `lane` bytes each run side by side, then combine.
__attribute__((target("sse4.2"))) inline std::uint32_t crc32c_sse42(std::uint32_t crc, const unsigned char* p,
                                                                    std::size_t n) noexcept {
  constexpr std::size_t lane = 8192;
  static const Crc32cShift shift(lane);
  std::uint64_t c0 = crc;
  for (; n >= 3 * lane; n -= 3 * lane, p += 3 * lane) {
    std::uint64_t c1 = 0, c2 = 0;
    for (std::size_t i = 0; i < lane; i += 8) {
      std::uint64_t w0, w1, w2;
      std::memcpy(&w0, p + i, 8);
      std::memcpy(&w1, p + lane + i, 8);
      std::memcpy(&w2, p + 2 * lane + i, 8);
      c0 = __builtin_ia32_crc32di(c0, w0);
      c1 = __builtin_ia32_crc32di(c1, w1);
      c2 = __builtin_ia32_crc32di(c2, w2);
    }
    c0 = shift(static_cast<std::uint32_t>(c0)) ^ c1;
    c0 = shift(static_cast<std::uint32_t>(c0)) ^ c2;
  }
  for (; n >= 8; n -= 8, p += 8) {
    std::uint64_t w;
    std::memcpy(&w, p, 8);
    c0 = __builtin_ia32_crc32di(c0, w);
  }
  auto c32 = static_cast<std::uint32_t>(c0);
  for (; n > 0; --n, ++p) c32 = __builtin_ia32_crc32qi(c32, *p);
  return c32;
}
#endif

//! Extends `crc` (a value this function returned, or 0 to start) over `bytes`.
inline std::uint32_t crc32c(std::span<const std::byte> bytes, std::uint32_t crc = 0) noexcept {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  std::uint32_t c = ~crc;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const bool hardware = __builtin_cpu_supports("sse4.2");
  c = hardware ? crc32c_sse42(c, p, bytes.size()) : crc32_table(c, p, bytes.size());
#else
  c = crc32_table(c, p, bytes.size());
#endif
  return ~c;
}

//! The table version alone (tests compare the two).
inline std::uint32_t crc32c_portable(std::span<const std::byte> bytes, std::uint32_t crc = 0) noexcept {
  return ~crc32_table(~crc, reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size());
}

//! CRC-32 (IEEE, zip's and zlib's `crc32`), extending `crc` over `bytes`.
inline std::uint32_t crc32_ieee(std::span<const std::byte> bytes, std::uint32_t crc = 0) noexcept {
  return ~crc32_table<0xEDB88320u>(~crc, reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size());
}

}  // namespace detail
}  // namespace v0
}  // namespace psx

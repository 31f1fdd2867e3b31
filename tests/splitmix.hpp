// splitmix64, the seeded stream the tests draw gradients from; the same
// stream as tests/optim/reference/generate.py, bit for bit.
#pragma once

#include <cstdint>

namespace psx_test {

struct Splitmix64 {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Exactly representable in float32, in [-1, 1).
  float uniform() { return static_cast<float>(static_cast<double>(next() >> 40) * 0x1p-24 * 2.0 - 1.0); }
};

}  // namespace psx_test

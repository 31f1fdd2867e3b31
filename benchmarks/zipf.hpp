// Zipf-distributed row ids for the benchmarks: the recommender case, where a
// few ids are hot and most are rare.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

namespace psx_bench {

// `count` ids drawn from a Zipf law of exponent `s` over `rows` ranks (by
// inversion of the CDF), rank r becoming row (r * 2654435761) % rows: the
// multiplier is a prime above any table here, so this permutes the rows and
// the hot ids are spread over the table as in a real embedding.
inline std::vector<std::uint64_t> zipf_ids(std::size_t count, std::size_t rows, double s, std::uint64_t seed) {
  std::vector<double> cdf(rows);
  double total = 0.0;
  for (std::size_t k = 0; k < rows; ++k) cdf[k] = total += std::pow(static_cast<double>(k + 1), -s);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.0, total);
  std::vector<std::uint64_t> ids(count);
  for (auto& id : ids) {
    const auto rank = static_cast<std::uint64_t>(std::upper_bound(cdf.begin(), cdf.end(), u(rng)) - cdf.begin());
    id = (std::min<std::uint64_t>(rank, rows - 1) * 2654435761ull) % rows;
  }
  return ids;
}

}  // namespace psx_bench

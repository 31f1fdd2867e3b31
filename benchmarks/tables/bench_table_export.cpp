// bench_table_export: what `ParameterServer::export_table` costs in one
// process: a dynamic table of `rows` ids (default 1M) of 16 floats on 2
// servers, filled by pushes, then exported whole (and as an empty delta,
// and its counters read) `rounds` times; the medians are printed next to
// the floor, a copy of the same bytes (ids and rows) from one array into a
// new one. The export goes as it goes between processes: each server
// answers pages of at most `page_bytes` (Worker::table_page_bytes, 8 MiB,
// by default).
//
//   bench_table_export [rows] [rounds] [page_bytes]     (default 1000000, 5, 8 MiB)
#include <psx/psx.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t rows = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1'000'000;
  const std::size_t rounds = argc > 2 ? std::max<std::size_t>(1, std::strtoull(argv[2], nullptr, 10)) : 5;
  const std::size_t page = argc > 3 ? std::strtoull(argv[3], nullptr, 10) : psx::Worker::table_page_bytes;
  constexpr std::size_t dim = 16;
  psx::ParameterServer<psx::partition::HashByName, psx::sync::Asynchronous, psx::optim::SGD> ps({2, 1}, {}, {},
                                                                                              psx::optim::SGD{0.1f});
  ps.declare(psx::embedding("emb", dim, psx::Initializer::constant(0.5f)));
  ps.run([&](psx::Worker& w) {
    std::vector<std::uint64_t> ids(4096);
    std::vector<float> grads(ids.size() * dim, 0.01f);
    for (std::size_t first = 0; first < rows; first += ids.size()) {
      const std::size_t n = std::min(ids.size(), rows - first);
      for (std::size_t j = 0; j < n; ++j) ids[j] = (first + j) * 0x9e3779b97f4a7c15ull;
      w.push_rows("emb", std::span(ids.data(), n), std::span<const float>(grads.data(), n * dim));
    }
  });
  std::vector<double> full, delta, stats, floor;
  std::size_t exported = 0;
  for (std::size_t r = 0; r < rounds; ++r) {
    auto t = clock_type::now();
    const psx::TableExport e = ps.export_table("emb", {}, page);
    full.push_back(seconds_since(t));
    exported = e.ids.size();
    t = clock_type::now();
    const psx::TableExport d = ps.export_table("emb", e.cursor, page);
    delta.push_back(seconds_since(t));
    if (!d.ids.empty() || !d.removed.empty()) std::printf("unexpected: a delta of %zu rows\n", d.ids.size());
    t = clock_type::now();
    (void)ps.table_stats("emb");
    stats.push_back(seconds_since(t));
    // The floor: the same bytes copied into new arrays.
    t = clock_type::now();
    std::vector<std::uint64_t> ids(e.ids.size());
    std::vector<float> values(e.values.size());
    std::memcpy(ids.data(), e.ids.data(), ids.size() * sizeof(std::uint64_t));
    std::memcpy(values.data(), e.values.data(), values.size() * sizeof(float));
    floor.push_back(seconds_since(t));
    if (ids.back() != e.ids.back()) return 1;
  }
  const double mib = static_cast<double>(exported * (8 + dim * 4)) / (1 << 20);
  std::printf("table_export: %zu rows x %zu floats on 2 servers (%.1f MiB), pages of %zu bytes, medians of %zu rounds\n",
              exported, dim, mib, page, rounds);
  std::printf("  full export   %8.2f ms  (%.0f MiB/s)\n", median(full) * 1e3, mib / median(full));
  std::printf("  empty delta   %8.3f ms\n", median(delta) * 1e3);
  std::printf("  table_stats   %8.3f ms\n", median(stats) * 1e3);
  std::printf("  floor (copy)  %8.2f ms  (%.0f MiB/s)\n", median(floor) * 1e3, mib / median(floor));
  return 0;
}

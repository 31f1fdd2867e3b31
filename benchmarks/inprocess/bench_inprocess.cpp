// bench_inprocess: the in-process transport's hot paths next to memcpy of the
// same bytes, measured in the same run.
//
//   dense push + pull of a 64 MiB variable (push applies SGD on the server)
//   sparse pull of 100k rows x 16 floats from a 1M-row table
//
// Goal (issue 2): dense push + pull at least 0.8x the memcpy of the same bytes.
//
//   ./bench_inprocess [repetitions]
#include <psx/psx.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <random>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double seconds(const auto& f) {
  const auto start = Clock::now();
  f();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Runs `a` and `b` alternately, `reps` times each after a warm-up, and
// returns both median times: interleaving exposes both to the same machine
// state (the other core's load, frequency), so their ratio is fair.
template <class A, class B>
std::pair<double, double> paired_medians(int reps, A&& a, B&& b) {
  a();
  b();
  std::vector<double> ta, tb;
  for (int i = 0; i < reps; ++i) {
    ta.push_back(seconds(a));
    tb.push_back(seconds(b));
  }
  std::sort(ta.begin(), ta.end());
  std::sort(tb.begin(), tb.end());
  return {ta[ta.size() / 2], tb[tb.size() / 2]};
}

void row(const char* what, double bytes, double psx_s, double memcpy_s, const char* goal) {
  const double gb = 1e9;
  std::printf("%-34s %9.1f MiB %10.2f %12.2f %9.2fx  %s\n", what, bytes / (1 << 20), bytes / psx_s / gb,
              bytes / memcpy_s / gb, memcpy_s / psx_s, goal);
}

// Keeps the compiler from dropping a copy whose result nobody reads.
void touch(const std::vector<float>& v) {
  volatile float sink = v[v.size() / 2];
  (void)sink;
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 21;
  constexpr std::size_t kDense = (64u << 20) / sizeof(float);  // 64 MiB
  constexpr std::size_t kTable = 1'000'000, kDim = 16, kIds = 100'000;

  psx::ParameterServer<psx::partition::HashByName, psx::sync::Asynchronous, psx::optim::SGD> ps({1, 1}, {}, {},
                                                                                                 {1e-9f});
  ps.declare(psx::dense("dense", {kDense}, psx::Initializer::uniform(-1, 1, 1)));
  ps.declare(psx::sparse("table", kTable, kDim, psx::Initializer::uniform(-1, 1, 2)));
  auto worker = ps.worker(0);

  std::vector<float> params(kDense), grad(kDense, 1.0f), src(kDense, 2.0f), dst(kDense);
  const double dense_bytes = kDense * sizeof(float);

  auto copy = [&] {
    std::memcpy(dst.data(), src.data(), kDense * sizeof(float));
    touch(dst);
  };
  auto copy_twice = [&] {
    copy();
    copy();
  };
  const auto [pull_s, pull_memcpy_s] = paired_medians(reps, [&] { worker.pull("dense", params); }, copy);
  const auto [push_s, push_memcpy_s] = paired_medians(reps, [&] { worker.push("dense", grad); }, copy);
  const auto [both_s, both_memcpy_s] = paired_medians(reps, [&] {
    worker.push("dense", grad);
    worker.pull("dense", params);
  }, copy_twice);

  std::mt19937_64 rng(7);
  std::vector<std::uint64_t> ids(kIds);
  for (auto& id : ids) id = rng() % kTable;
  std::vector<float> rows(kIds * kDim), flat(kIds * kDim, 1.0f);
  const double rows_bytes = static_cast<double>(rows.size() * sizeof(float));
  auto flat_copy = [&] {
    std::memcpy(rows.data(), flat.data(), rows.size() * sizeof(float));
    touch(rows);
  };
  const auto [sparse_s, sparse_memcpy_s] =
      paired_medians(reps, [&] { worker.pull_rows("table", ids, rows); }, flat_copy);
  // The same gather done by hand on a plain array: what a row pull cannot beat.
  std::vector<float> table(kTable * kDim, 0.5f);
  const auto [gather_s, gather_memcpy_s] = paired_medians(reps, [&] {
    for (std::size_t j = 0; j < kIds; ++j)
      std::memcpy(&rows[j * kDim], &table[ids[j] * kDim], kDim * sizeof(float));
    touch(rows);
  }, flat_copy);

  std::printf("psx in-process transport, median of %d runs (GB/s = 1e9 bytes/s of payload)\n\n", reps);
  std::printf("%-34s %13s %10s %12s %10s  %s\n", "operation", "payload", "psx GB/s", "memcpy GB/s", "ratio",
              "goal");
  row("dense pull (64 MiB)", dense_bytes, pull_s, pull_memcpy_s, "");
  row("dense push, SGD applied (64 MiB)", dense_bytes, push_s, push_memcpy_s, "");
  row("dense push + pull (64 MiB each)", 2 * dense_bytes, both_s, both_memcpy_s, ">= 0.80x");
  row("sparse pull 100k x 16 rows", rows_bytes, sparse_s, sparse_memcpy_s, "");
  row("  hand-written gather, same rows", rows_bytes, gather_s, gather_memcpy_s, "(a gather's own cost)");
  std::printf("\nratio = memcpy time / psx time for the same bytes; the push reads the gradient and\n"
              "reads and writes the parameters (3 streams), a memcpy reads and writes (2 streams).\n");
}

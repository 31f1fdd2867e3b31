// bench_rows: row pushes and pulls on a large sparse variable in host memory,
// each next to a floor measured in the same run.
//
//   one server, one worker (in-process), Adam, a 4M-row variable of width 16
//   and 64, calls of 1M ids, Zipf(1.1) and uniform;
//   push floor: the same distinct rows, with their gradients already summed,
//     updated by optim::Adam in a plain loop over arrays of the same size
//     (what the server must do at the least);
//   pull floor: the same rows copied from such an array in a plain loop.
//
// The start-up (declare + start: allocating and initializing the rows and
// slots) is printed too. docs/architecture.md ("Large sparse variables in
// host memory") has the figures, with and without transparent huge pages
// (GLIBC_TUNABLES=glibc.malloc.hugetlb=1).
//
//   ./bench_rows [rows] [ids per call] [calls]
#include "../zipf.hpp"

#include <psx/psx.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <span>
#include <unordered_set>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// Median of `calls` timings of f (one untimed call first).
template <class F>
double median_ms(int calls, F&& f) {
  f();
  std::vector<double> t;
  for (int i = 0; i < calls; ++i) {
    const auto start = Clock::now();
    f();
    t.push_back(ms_since(start));
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void run(std::size_t rows, std::size_t width, std::size_t count, bool zipf, int calls) {
  const psx::optim::Adam adam{1e-3};
  std::vector<std::uint64_t> ids;
  if (zipf) {
    ids = psx_bench::zipf_ids(count, rows, 1.1, 7);
  } else {
    std::mt19937_64 rng(3);
    ids.resize(count);
    for (auto& id : ids) id = rng() % rows;
  }
  std::vector<float> grads(count * width, 0.01f), out(count * width);

  double start_ms = 0, push = 0, pull = 0;
  {
    const auto start = Clock::now();
    psx::ParameterServer<psx::partition::RowRange, psx::sync::Asynchronous, psx::optim::Adam,
                         psx::transport::InProcess>
        ps({1, 1}, {}, {}, adam);
    ps.declare(psx::sparse("e", rows, width, psx::Initializer::uniform(-0.1f, 0.1f, 3)));
    ps.start();
    start_ms = ms_since(start);
    psx::Worker w = ps.worker(0);
    push = median_ms(calls, [&] { w.push_rows("e", ids, grads); });
    pull = median_ms(calls, [&] { w.pull_rows("e", ids, out); });
    w.leave();
  }  // the server's memory goes back before the floors take theirs

  // The floors: arrays of the same size, no server.
  std::vector<std::uint64_t> distinct;
  {
    std::unordered_set<std::uint64_t> seen;
    for (std::uint64_t id : ids)
      if (seen.insert(id).second) distinct.push_back(id);  // first-seen order, as the server's sums
  }
  std::vector<float> table(rows * width, 0.05f), m(rows * width, 0.0f), v(rows * width, 0.0f);
  float* bases[2] = {m.data(), v.data()};
  psx::UpdateContext ctx;
  ctx.rows = true;
  ctx.global_step = 1;
  const double push_floor = median_ms(calls, [&] {
    for (std::size_t k = 0; k < distinct.size(); ++k)  // the sums in a contiguous buffer, as the server's
      adam.update(std::span<float>(table.data() + distinct[k] * width, width),
                  std::span<const float>(grads.data() + k * width, width),
                  psx::SlotView(bases, 2, distinct[k] * width, width), ctx);
  });
  const double pull_floor = median_ms(calls, [&] {
    for (std::size_t j = 0; j < ids.size(); ++j)
      std::memcpy(out.data() + j * width, table.data() + ids[j] * width, width * sizeof(float));
  });

  std::printf("width %3zu %-7s %7zu distinct  start %7.0f ms  push %7.1f ms (floor %7.1f, %.2fx)  pull %6.1f ms "
              "(floor %6.1f, %.2fx)\n",
              width, zipf ? "Zipf" : "uniform", distinct.size(), start_ms, push, push_floor, push / push_floor, pull,
              pull_floor, pull / pull_floor);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t rows = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 4000000;
  const std::size_t count = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1000000;
  const int calls = argc > 3 ? std::atoi(argv[3]) : 5;
  if (rows == 0 || count == 0 || calls <= 0) {
    std::fprintf(stderr, "usage: bench_rows [rows > 0] [ids per call > 0] [calls > 0]\n");
    return 2;
  }
  std::printf("bench_rows: %zu rows, %zu ids a call, median of %d calls; times in ms\n", rows, count, calls);
  for (std::size_t width : {16, 64})
    for (bool zipf : {true, false}) run(rows, width, count, zipf, calls);
}

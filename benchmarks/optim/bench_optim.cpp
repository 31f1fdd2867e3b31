// bench_optim: dense update throughput of every built-in optimizer, on one
// thread and on all threads, next to its floor: the bytes the update must
// read and write (parameters, gradient, slots; each once) divided by this
// machine's streaming bandwidth for that access pattern, measured in the same
// run, on the same arrays and threads, by a pass that reads the gradient and
// adds it into the parameters and every slot (the same streams, no arithmetic
// to speak of).
//
// Goal (issue 4): SGD, Adam and AdamW within 1.25x of the floor on arrays
// larger than the last-level cache.
//
//   ./bench_optim [millions of parameters = 16] [repetitions = 9]
#include <psx/psx.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

// Parameters, gradient and slots of one dense variable.
struct Arrays {
  std::vector<float> w, g, slots;
  std::vector<float*> bases;
  std::size_t n = 0;

  Arrays(std::size_t size, std::size_t num_slots) : w(size), g(size), slots(num_slots * size), n(size) {
    for (std::size_t i = 0; i < size; ++i) {
      w[i] = 0.5f + static_cast<float>(i % 1000) * 1e-4f;
      g[i] = static_cast<float>(i % 777) * 1e-3f - 0.3f;
    }
    for (std::size_t k = 0; k < num_slots; ++k) bases.push_back(slots.data() + k * size);
    std::fill(slots.begin(), slots.end(), 0.01f);
  }
};

// Runs `body(begin, end)` over [0, n) split into `threads` contiguous chunks.
void parallel(std::size_t n, unsigned threads, const std::function<void(std::size_t, std::size_t)>& body) {
  if (threads == 1) return body(0, n);
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t)
    pool.emplace_back([&, t] { body(n * t / threads, n * (t + 1) / threads); });
  for (auto& th : pool) th.join();
}

double median_seconds(int reps, const std::function<void()>& f) {
  f();  // warm-up: pages touched, caches in their steady state
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto start = Clock::now();
    f();
    t.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// The floor pass: reads g, w and each slot, writes w and each slot.
template <std::size_t Slots>
void stream_pass(std::size_t lo, std::size_t hi, float* __restrict w, const float* __restrict g,
                 float* __restrict s0, float* __restrict s1, float* __restrict s2) {
  for (std::size_t i = lo; i < hi; ++i) {
    w[i] += g[i];
    if constexpr (Slots > 0) s0[i] += g[i];
    if constexpr (Slots > 1) s1[i] += g[i];
    if constexpr (Slots > 2) s2[i] += g[i];
  }
}

double floor_seconds(Arrays& a, unsigned threads, int reps) {
  float* s[3] = {};
  for (std::size_t k = 0; k < a.bases.size(); ++k) s[k] = a.bases[k];
  auto pass = [&](std::size_t lo, std::size_t hi) {
    switch (a.bases.size()) {
      case 0: return stream_pass<0>(lo, hi, a.w.data(), a.g.data(), s[0], s[1], s[2]);
      case 1: return stream_pass<1>(lo, hi, a.w.data(), a.g.data(), s[0], s[1], s[2]);
      case 2: return stream_pass<2>(lo, hi, a.w.data(), a.g.data(), s[0], s[1], s[2]);
      default: return stream_pass<3>(lo, hi, a.w.data(), a.g.data(), s[0], s[1], s[2]);
    }
  };
  return median_seconds(reps, [&] { parallel(a.n, threads, pass); });
}

struct Result {
  std::string name;
  double bytes_per_param;
  double seconds[2];
  double floor[2];
};

template <class O>
Result measure(const std::string& name, const O& opt, std::size_t arrays_read_written, std::size_t n,
               const unsigned (&threads)[2], int reps) {
  Arrays a(n, opt.slots());
  Result r{name, static_cast<double>(arrays_read_written) * sizeof(float), {0, 0}, {0, 0}};
  for (int k = 0; k < 2; ++k) {
    r.floor[k] = floor_seconds(a, threads[k], reps);
    std::uint64_t step = 0;
    r.seconds[k] = median_seconds(reps, [&] {
      ++step;
      parallel(n, threads[k], [&](std::size_t lo, std::size_t hi) {
        const psx::SlotView slots(a.bases.data(), a.bases.size(), lo, hi - lo);
        const psx::UpdateContext ctx{step, 1.0, nullptr, step, false};
        opt.update(std::span(a.w).subspan(lo, hi - lo), std::span<const float>(a.g).subspan(lo, hi - lo), slots, ctx);
      });
    });
  }
  volatile float sink = a.w[n / 2];
  (void)sink;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t n = (argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 16) * 1000000 + (argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 0);
  const int reps = argc > 2 ? std::atoi(argv[2]) : 9;
  const unsigned all = std::max(1u, std::thread::hardware_concurrency());
  const unsigned threads[2] = {1, all};

  // Per parameter: arrays read + arrays written (the parameters, the gradient
  // and each slot once; LAMB's floor is one pass though it needs two).
  using namespace psx::optim;
  std::vector<Result> results;
  results.push_back(measure("SGD", SGD{0.01}, 3, n, threads, reps));
  results.push_back(measure("SGD momentum", SGD{0.01, 0.9}, 5, n, threads, reps));
  results.push_back(measure("SGD Nesterov + wd", SGD{0.01, 0.9, 0.0, true, 1e-4}, 5, n, threads, reps));
  results.push_back(measure("Adagrad", Adagrad{0.01}, 5, n, threads, reps));
  results.push_back(measure("RMSProp", RMSProp{0.01}, 5, n, threads, reps));
  results.push_back(measure("RMSProp centered + momentum", RMSProp{.momentum = 0.9, .centered = true}, 9, n,
                            threads, reps));
  results.push_back(measure("Adam", Adam{0.001}, 7, n, threads, reps));
  results.push_back(measure("Adam AMSGrad", Adam{.amsgrad = true}, 9, n, threads, reps));
  results.push_back(measure("AdamW", AdamW{0.001}, 7, n, threads, reps));
  results.push_back(measure("FTRL (lr_power -0.5)", Ftrl{0.01, -0.5, 0.01, 0.01}, 7, n, threads, reps));
  results.push_back(measure("LAMB (two passes)", Lamb{0.001}, 7, n, threads, reps));

  std::printf("bench_optim: %zu M parameters (%.0f MiB per array), median of %d\n", n / 1'000'000,
              static_cast<double>(n) * 4 / (1 << 20), reps);
  std::printf("floor: the same bytes streamed by a pass with no arithmetic, same arrays, same threads\n");
  std::printf("%-28s %5s | %8s %8s %7s %7s | %8s %8s %7s %7s\n", "optimizer", "B/par", "1 thr ms", "floor", "GB/s",
              "x floor", "all ms", "floor", "GB/s", "x floor");
  for (const Result& r : results) {
    const double bytes = r.bytes_per_param * static_cast<double>(n);
    std::printf("%-28s %5.0f | %8.2f %8.2f %7.1f %6.2fx | %8.2f %8.2f %7.1f %6.2fx\n", r.name.c_str(),
                r.bytes_per_param, r.seconds[0] * 1e3, r.floor[0] * 1e3, bytes / r.floor[0] / 1e9,
                r.seconds[0] / r.floor[0], r.seconds[1] * 1e3, r.floor[1] * 1e3, bytes / r.floor[1] / 1e9,
                r.seconds[1] / r.floor[1]);
  }
  std::printf("goal: SGD, Adam and AdamW within 1.25x of the floor (%u threads = all)\n", all);
}

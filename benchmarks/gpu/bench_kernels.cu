// Benchmarks of psx/cuda/*.cuh on one GPU, each next to its floor.
//
// The floor of a streaming kernel is the bytes it must read and write over
// the device's copy bandwidth, measured first (cudaMemcpy device to device,
// bytes read + written). Each kernel prints its time (median of 20 after
// warm-up, CUDA events), its bandwidth (those bytes / time) and that as a
// percentage of the copy's. The sparse push is timed against the CPU path
// of psx (RowAccumulator-style hash map, then optim::Adam per row) on the
// same machine.
//
// Usage: psx_bench_gpu [--quick]   (--quick: small sizes, to check it runs)
#include "../zipf.hpp"
#include "common.hpp"

#include <psx/cuda/kernels.cuh>
#include <psx/optim.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

namespace pc = psx::cuda;

struct Result {
  std::string name;
  double ms;
  double gb_per_s;  // 0: not a bandwidth figure
  std::string note;
};
std::vector<Result> results;
double copy_gb_per_s = 0.0;

void report(const std::string& name, double ms, double bytes, const std::string& note = "") {
  const double gbps = bytes > 0 ? bytes / (ms * 1e-3) / 1e9 : 0.0;
  results.push_back({name, ms, gbps, note});
  if (gbps > 0)
    std::printf("%-34s %9.3f ms %8.0f GB/s %5.1f%% of copy  %s\n", name.c_str(), ms, gbps,
                100.0 * gbps / copy_gb_per_s, note.c_str());
  else
    std::printf("%-34s %9.3f ms  %s\n", name.c_str(), ms, note.c_str());
  std::fflush(stdout);
}

using psx_bench::median;
using psx_bench::wall_ms;

// Median of `reps` timings (CUDA events on the default stream) after `warmup` runs.
template <class F>
double time_ms(F&& f, int reps = 20, int warmup = 3) {
  cudaEvent_t start, stop;
  pc::check(cudaEventCreate(&start), "cudaEventCreate");
  pc::check(cudaEventCreate(&stop), "cudaEventCreate");
  for (int i = 0; i < warmup; ++i) f();
  pc::check(cudaDeviceSynchronize(), "warm-up");
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    pc::check(cudaEventRecord(start), "cudaEventRecord");
    f();
    pc::check(cudaEventRecord(stop), "cudaEventRecord");
    pc::check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    pc::check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    t.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return median(t);
}

// Deterministic pseudo-random fill in [lo, hi).
__global__ void fill_kernel(float* x, std::size_t n, std::uint64_t seed, float lo, float hi) {
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  for (std::size_t i = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) {
    std::uint64_t h = (i + seed) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 29;
    x[i] = lo + (hi - lo) * static_cast<float>(h >> 40) * 0x1p-24f;
  }
}

void fill(float* x, std::size_t n, std::uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  fill_kernel<<<1024, 256>>>(x, n, seed, lo, hi);
  pc::check(cudaGetLastError(), "fill kernel");
}

void bench_copy(std::size_t bytes) {
  pc::buffer<unsigned char> a(bytes), b(bytes);
  pc::check(cudaMemset(a.data(), 1, bytes), "cudaMemset");
  const double ms = time_ms([&] {
    pc::check(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice), "cudaMemcpyAsync");
  });
  copy_gb_per_s = 2.0 * static_cast<double>(bytes) / (ms * 1e-3) / 1e9;
  std::printf("%-34s %9.3f ms %8.0f GB/s (read + written)  %zu MiB\n", "copy D2D (cudaMemcpy)", ms, copy_gb_per_s,
              bytes >> 20);
  results.push_back({"copy D2D (cudaMemcpy)", ms, copy_gb_per_s, "the floor's bandwidth"});
}

// One dense optimizer on n parameters; `arrays` = arrays read + arrays written per element.
template <class O>
void bench_optimizer(const std::string& name, const O& o, std::size_t n, int arrays, float* w, const float* g,
                     float* const* slots) {
  pc::DeviceSlots s{};
  s.count = o.slots();
  for (std::size_t k = 0; k < s.count; ++k) s.slot[k] = slots[k];
  psx::UpdateContext ctx;
  ctx.step = 10;
  const double ms = time_ms([&] { pc::update(o, w, g, s, n, ctx); });
  report(name, ms, static_cast<double>(arrays) * 4.0 * static_cast<double>(n),
         std::to_string(arrays) + " x 4 B/param");
}

void bench_optimizers(std::size_t n) {
  pc::buffer<float> w(n), g(n), s0(n), s1(n), s2(n);
  fill(w.data(), n, 1);
  fill(g.data(), n, 2);
  fill(s0.data(), n, 3, 0.0f, 0.01f);
  fill(s1.data(), n, 4, 0.0f, 0.01f);
  fill(s2.data(), n, 5, 0.0f, 0.01f);
  float* slots[3] = {s0.data(), s1.data(), s2.data()};
  namespace po = psx::optim;
  bench_optimizer("SGD", po::SGD{.lr = 0.01}, n, 3, w.data(), g.data(), slots);
  bench_optimizer("SGD momentum", po::SGD{.lr = 0.01, .momentum = 0.9}, n, 5, w.data(), g.data(), slots);
  bench_optimizer("Adagrad", po::Adagrad{}, n, 5, w.data(), g.data(), slots);
  bench_optimizer("RMSProp", po::RMSProp{}, n, 5, w.data(), g.data(), slots);
  bench_optimizer("RMSProp centered+momentum", po::RMSProp{.momentum = 0.9, .centered = true}, n, 9, w.data(),
                  g.data(), slots);
  bench_optimizer("Adam", po::Adam{}, n, 7, w.data(), g.data(), slots);
  bench_optimizer("Adam AMSGrad", po::Adam{.amsgrad = true}, n, 9, w.data(), g.data(), slots);
  bench_optimizer("AdamW", po::AdamW{}, n, 7, w.data(), g.data(), slots);
  // FTRL keeps n > 0: refill its accumulator.
  fill(s0.data(), n, 6, 0.1f, 0.2f);
  bench_optimizer("Ftrl", po::Ftrl{}, n, 7, w.data(), g.data(), slots);
  // LAMB: two passes (w, g, m, v in and m, v out; then w, m, v in and w out).
  bench_optimizer("Lamb (2 passes)", po::Lamb{}, n, 10, w.data(), g.data(), slots);
}

void bench_aggregate(std::size_t n, std::size_t k) {
  std::vector<pc::buffer<float>> grads;
  std::vector<const float*> ptrs;
  for (std::size_t j = 0; j < k; ++j) {
    grads.emplace_back(n);
    fill(grads.back().data(), n, 10 + j);
    ptrs.push_back(grads.back().data());
  }
  pc::buffer<float> out(n);
  const double ms = time_ms([&] { pc::aggregate(ptrs.data(), k, n, out.data(), static_cast<float>(k)); });
  report("aggregate mean of " + std::to_string(k), ms, static_cast<double>(k + 1) * 4.0 * static_cast<double>(n),
         std::to_string(k + 1) + " x 4 B/element");
}

void bench_conversions(std::size_t n) {
  pc::buffer<float> x(n), y(n);
  pc::buffer<psx::bfloat16> b(n);
  pc::buffer<psx::float16> h(n);
  pc::buffer<std::int8_t> q(n);
  fill(x.data(), n, 20, -3.0f, 3.0f);
  const double dn = static_cast<double>(n);
  report("float32 -> bfloat16", time_ms([&] { pc::convert(x.data(), b.data(), n); }), 6.0 * dn);
  report("bfloat16 -> float32", time_ms([&] { pc::convert(b.data(), y.data(), n); }), 6.0 * dn);
  report("float32 -> float16", time_ms([&] { pc::convert(x.data(), h.data(), n); }), 6.0 * dn);
  report("float16 -> float32", time_ms([&] { pc::convert(h.data(), y.data(), n); }), 6.0 * dn);
  const std::size_t width = 1024, rows = n / width;
  pc::buffer<float> scales(rows);
  report("int8 quantize per tensor", time_ms([&] { pc::quantize_int8(x.data(), 1, n, false, q.data(), scales.data()); }),
         9.0 * dn, "2 passes: max, then quantize");
  report("int8 quantize per channel",
         time_ms([&] { pc::quantize_int8(x.data(), rows, width, true, q.data(), scales.data()); }),
         5.0 * static_cast<double>(rows * width), "rows of 1024, one block a row");
  report("int8 dequantize per channel",
         time_ms([&] { pc::dequantize_int8(q.data(), scales.data(), rows, width, true, y.data()); }),
         5.0 * static_cast<double>(rows * width));
}

using psx_bench::zipf_ids;

void bench_sparse(std::size_t table_rows, std::size_t width, std::size_t count) {
  std::printf("\nsparse push: %zu Zipf(1.1) ids into a %zu x %zu table, Adam rows\n", count, table_rows, width);
  const std::vector<std::uint64_t> ids = zipf_ids(count, table_rows, 1.1, 7);
  std::mt19937_64 rng(8);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> grads(count * width);
  for (float& x : grads) x = d(rng);
  int end_bit = 1;
  while ((std::uint64_t{1} << end_bit) < table_rows) ++end_bit;

  const psx::optim::Adam adam{};
  psx::UpdateContext ctx;
  ctx.rows = true;
  ctx.global_step = 10;

  // Device: the table and its slots, the push's ids and rows already on the device.
  const std::size_t n = table_rows * width;
  pc::buffer<float> table(n), m(n), v(n), dgrads(count * width);
  pc::buffer<std::uint64_t> dids(count);
  fill(table.data(), n, 30);
  pc::check(cudaMemset(m.data(), 0, n * 4), "cudaMemset");
  pc::check(cudaMemset(v.data(), 0, n * 4), "cudaMemset");
  dids.copy_from(ids);
  dgrads.copy_from(grads);
  pc::RowDedup dedup;
  std::size_t unique = 0;
  const pc::DeviceSlots slots{{m.data(), v.data()}, 2};
  auto device_push = [&] {
    unique = dedup.run(dids.data(), dgrads.data(), count, width, 0, end_bit);
    pc::update_rows(adam, table.data(), slots, width, dedup.unique_ids(), dedup.sums(), unique, ctx);
    pc::check(cudaDeviceSynchronize(), "sparse push");
  };
  const double gpu_ms = wall_ms(device_push, 20, 3);
  const double dedup_ms = wall_ms(
      [&] {
        dedup.run(dids.data(), dgrads.data(), count, width, 0, end_bit);
        pc::check(cudaDeviceSynchronize(), "RowDedup");
      },
      20, 1);
  const double rows_ms = time_ms(
      [&] { pc::update_rows(adam, table.data(), slots, width, dedup.unique_ids(), dedup.sums(), unique, ctx); });
  std::printf("  %zu unique ids (%.1f%%)\n", unique, 100.0 * static_cast<double>(unique) / static_cast<double>(count));

  // CPU: the same push as the CPU server applies it, one thread. Zeroed
  // pages come from calloc; the warm-up run touches the pushed rows.
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> ct(static_cast<float*>(std::calloc(n, 4))), cm(static_cast<float*>(std::calloc(n, 4))),
      cv(static_cast<float*>(std::calloc(n, 4)));
  if (!ct || !cm || !cv) throw std::bad_alloc();
  float* bases[2] = {cm.get(), cv.get()};
  auto cpu_push = [&] {
    std::unordered_map<std::uint64_t, std::size_t> index;
    index.reserve(count);
    std::vector<std::uint64_t> rows;
    std::vector<float> sums;
    for (std::size_t i = 0; i < count; ++i) {
      const float* g = grads.data() + i * width;
      auto [it, inserted] = index.try_emplace(ids[i], rows.size());
      if (inserted) {
        rows.push_back(ids[i]);
        sums.insert(sums.end(), g, g + width);
      } else {
        float* dst = sums.data() + it->second * width;
        for (std::size_t j = 0; j < width; ++j) dst[j] += g[j];
      }
    }
    for (std::size_t k = 0; k < rows.size(); ++k)
      adam.update(std::span<float>(ct.get() + rows[k] * width, width),
                  std::span<const float>(sums.data() + k * width, width),
                  psx::SlotView(bases, 2, rows[k] * width, width), ctx);
  };
  const double cpu_ms = wall_ms(cpu_push, 3, 1);
  const double push_bytes = static_cast<double>(count) * static_cast<double>(width * 4 + 8);
  report("sparse push, device (dedup+rows)", gpu_ms, 0.0, "RowDedup::run + update_rows, wall clock");
  report("  of which RowDedup::run", dedup_ms, 0.0, "sort, run-length encode, ordered sums");
  report("  of which update_rows (Adam)", rows_ms, static_cast<double>(unique * width) * 4.0 * 7.0,
         "7 x 4 B per pushed parameter");
  report("sparse push, CPU (1 thread)", cpu_ms, 0.0, "hash-map sum + optim::Adam per row");
  char note[64];
  std::snprintf(note, sizeof note, "%.1fx", cpu_ms / gpu_ms);
  results.push_back({"sparse push speed-up, device vs CPU", 0.0, 0.0, note});
  std::printf("  speed-up %s; push payload %.0f MB\n", note, push_bytes / 1e6);
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  if (const int rc = psx_bench::open_device("psx_bench_gpu", quick)) return rc;
  try {
    const std::size_t dense = quick ? (std::size_t{1} << 22) : (std::size_t{64} << 20);  // 256 MiB of floats
    bench_copy(quick ? (std::size_t{64} << 20) : (std::size_t{1} << 30));
    std::printf("\ndense optimizers, %zu parameters (%zu MiB per array)\n", dense, dense * 4 >> 20);
    bench_optimizers(dense);
    std::printf("\n");
    bench_aggregate(dense, 8);
    {
      const std::size_t rows = quick ? 100000 : 10000000, width = 64, n = quick ? 10000 : 1000000;
      pc::buffer<float> table(rows * width), out(n * width);
      fill(table.data(), rows * width, 40);
      std::vector<std::uint64_t> ids(n);
      std::mt19937_64 rng(9);
      for (auto& id : ids) id = rng() % rows;
      pc::buffer<std::uint64_t> dids(ids);
      report("gather_rows " + std::to_string(n) + " x " + std::to_string(width),
             time_ms([&] { pc::gather_rows(table.data(), width, dids.data(), n, out.data()); }),
             static_cast<double>(n) * (2.0 * width * 4 + 8), "rows read + written, ids");
    }
    std::printf("\n");
    bench_conversions(dense);
    bench_sparse(quick ? 100000 : 10000000, 64, quick ? 10000 : 1000000);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "psx_bench_gpu: %s\n", e.what());
    return 1;
  }

  std::printf("\n%-36s %10s %10s %8s  %s\n", "kernel", "ms", "GB/s", "of copy", "note");
  for (const Result& r : results) {
    if (r.ms == 0.0) {
      std::printf("%-36s %10s %10s %8s  %s\n", r.name.c_str(), "", "", "", r.note.c_str());
    } else if (r.gb_per_s > 0) {
      std::printf("%-36s %10.3f %10.0f %7.1f%%  %s\n", r.name.c_str(), r.ms, r.gb_per_s,
                  100.0 * r.gb_per_s / copy_gb_per_s, r.note.c_str());
    } else {
      std::printf("%-36s %10.3f %10s %8s  %s\n", r.name.c_str(), r.ms, "", "", r.note.c_str());
    }
  }
  return 0;
}

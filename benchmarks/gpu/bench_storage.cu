// A ParameterServer's step on host storage against psx::cuda::Device, end to
// end: a worker pushes a gradient and pulls the parameters through the
// in-process transport, and the servers apply Adam.
//
// With psx::cuda::Device, a step must move the gradient to the GPU and the
// parameters back (unless they are pulled into device memory): its floor is
// those bytes over the copy engines' bandwidth from and to pinned memory,
// measured first with cudaMemcpy (the Adam kernel's fraction of a
// millisecond is left out). Pageable memory must also be copied by the CPU
// into pinned memory on the way: psx does it in 4 MiB chunks on each server's
// thread (psx::cuda::Staging); the driver's own pageable cudaMemcpy rate is
// printed for comparison. Host storage's step is printed as the reference,
// with the bytes Adam and the pull must touch (36 per parameter) over its
// time, next to one thread's memcpy bandwidth.
//
// Dense: 64M parameters (256 MiB), Asynchronous, 4 servers, 1 worker.
// Sparse: 1M Zipf(1.1) ids x 64 pushed and pulled on a 4M x 64 table, from
// and to pageable, pinned and device memory.
//
// Usage: psx_bench_gpu_storage [--quick]   (--quick: small sizes, to check it runs)
#include "../zipf.hpp"
#include "common.hpp"

#include <psx/cuda/storage.cuh>
#include <psx/psx.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace {

namespace pc = psx::cuda;

using psx_bench::wall_ms;

struct Floors {
  double h2d_pageable, d2h_pageable, h2d_pinned, d2h_pinned;  // GB/s
  double memcpy_host;                                         // GB/s, read + written, one thread
};

Floors measure_copies(std::size_t bytes) {
  Floors f{};
  std::vector<unsigned char> host(bytes, 1), back(bytes, 0);
  pc::pinned_buffer<unsigned char> ph(bytes), pb(bytes);
  std::memset(ph.data(), 1, bytes);
  std::memset(pb.data(), 0, bytes);
  pc::buffer<unsigned char> dev(bytes);
  auto rate = [&](void* dst, const void* src, cudaMemcpyKind kind) {
    const double ms = wall_ms([&] { pc::check(cudaMemcpy(dst, src, bytes, kind), "cudaMemcpy"); }, 10, 2);
    return static_cast<double>(bytes) / (ms * 1e-3) / 1e9;
  };
  f.h2d_pageable = rate(dev.data(), host.data(), cudaMemcpyHostToDevice);
  f.d2h_pageable = rate(back.data(), dev.data(), cudaMemcpyDeviceToHost);
  f.h2d_pinned = rate(dev.data(), ph.data(), cudaMemcpyHostToDevice);
  f.d2h_pinned = rate(pb.data(), dev.data(), cudaMemcpyDeviceToHost);
  const double ms = wall_ms([&] { std::memcpy(back.data(), host.data(), bytes); }, 10, 2);
  f.memcpy_host = 2.0 * static_cast<double>(bytes) / (ms * 1e-3) / 1e9;
  std::printf("host -> device, pageable  %8.1f GB/s   device -> host, pageable  %8.1f GB/s   (the driver's staging)\n", f.h2d_pageable,
              f.d2h_pageable);
  std::printf("host -> device, pinned    %8.1f GB/s   device -> host, pinned    %8.1f GB/s\n", f.h2d_pinned,
              f.d2h_pinned);
  std::printf("host memcpy, one thread   %8.1f GB/s (read + written)   %zu MiB each\n", f.memcpy_host, bytes >> 20);
  return f;
}

// One row of the table: the step's time, and its floor where it has one.
void report(const char* name, double ms, double floor_ms, const char* note) {
  if (floor_ms > 0)
    std::printf("%-44s %9.2f ms   floor %7.2f ms (%5.1f%% of it)  %s\n", name, ms, floor_ms, 100.0 * floor_ms / ms,
                note);
  else
    std::printf("%-44s %9.2f ms   %s\n", name, ms, note);
  std::fflush(stdout);
}

template <class Storage>
using Server = psx::ParameterServer<psx::partition::RowRange, psx::sync::Asynchronous, psx::optim::Adam,
                                    psx::transport::InProcess, Storage>;

constexpr std::size_t kServers = 4;

// The dense step: push `g`, pull into `out`. Returns the median step time and
// checks that both storages end with the same parameters.
template <class Storage>
double dense_step(std::size_t n, std::span<const float> g, std::span<float> out, int reps, std::vector<float>* final) {
  Server<Storage> ps({kServers, 1}, {}, {}, psx::optim::Adam{1e-3});
  ps.declare(psx::dense("w", {n}, psx::Initializer::uniform(-1, 1, 1)));
  ps.start();
  psx::Worker w = ps.worker(0);
  const double ms = wall_ms(
      [&] {
        w.push("w", g);
        w.pull("w", out);
      },
      reps, 2);
  w.leave();
  if (final) *final = ps.read("w");
  return ms;
}

void bench_dense(std::size_t n, const Floors& f, int reps) {
  std::printf("\ndense: %zu parameters (%zu MiB), Adam, Asynchronous, %zu servers, 1 worker; a step = push + pull\n",
              n, n * 4 >> 20, kServers);
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> g(n), out(n);
  for (float& x : g) x = d(rng);
  pc::pinned_buffer<float> pg(n), pout(n);
  std::copy(g.begin(), g.end(), pg.span().begin());
  pc::buffer<float> dout(n);

  const double bytes = static_cast<double>(n) * 4.0;
  std::vector<float> host_final, device_final;
  const double host = dense_step<psx::storage::Host>(n, g, out, reps, &host_final);
  char note[96];
  std::snprintf(note, sizeof note, "%.1f GB/s of Adam + pull traffic (36 B/param)", 9.0 * bytes / (host * 1e-3) / 1e9);
  report("host storage", host, 0.0, note);
  const double pageable = dense_step<pc::Device>(n, g, out, reps, &device_final);
  const double both_ways = 1e3 * (bytes / (f.h2d_pinned * 1e9) + bytes / (f.d2h_pinned * 1e9));
  report("cuda::Device, pageable push and pull", pageable, both_ways, "floor: H2D + D2H at the pinned rates");
  const double pin = dense_step<pc::Device>(n, pg.span(), pout.span(), reps, nullptr);
  report("cuda::Device, pinned push and pull", pin, both_ways, "floor: H2D + D2H at the pinned rates");
  const double to_device = dense_step<pc::Device>(n, pg.span(), std::span<float>(dout.data(), dout.size()), reps, nullptr);
  report("cuda::Device, pinned push, pull to device", to_device, 1e3 * bytes / (f.h2d_pinned * 1e9),
         "floor: H2D of pinned memory");
  std::printf("  host storage / cuda::Device: %.1fx (pageable), %.1fx (pinned), %.1fx (pull to device)\n",
              host / pageable, host / pin, host / to_device);
  // Same pushes, same Adam: the parameters must agree bit for bit.
  std::printf("  parameters after %d steps: %s\n", reps + 2,
              host_final == device_final ? "bit-identical on both storages" : "DIFFER between the storages");
}

struct SparseTimes {
  double step, push, pull;  // medians, ms
};

// A step = push_rows + pull_rows of the same ids; then pushes alone and pulls alone.
template <class Storage>
SparseTimes sparse_steps(std::size_t rows, std::size_t width, std::span<const std::uint64_t> ids,
                         std::span<const float> g, std::span<float> out, int reps) {
  Server<Storage> ps({kServers, 1}, {}, {}, psx::optim::Adam{1e-3});
  ps.declare(psx::sparse("e", rows, width, psx::Initializer::uniform(-0.1f, 0.1f, 2)));
  ps.start();
  psx::Worker w = ps.worker(0);
  SparseTimes t{};
  t.step = wall_ms(
      [&] {
        w.push_rows("e", ids, g);
        w.pull_rows("e", ids, out);
      },
      reps, 2);
  t.push = wall_ms([&] { w.push_rows("e", ids, g); }, reps, 0);
  t.pull = wall_ms([&] { w.pull_rows("e", ids, out); }, reps, 0);
  w.leave();
  return t;
}

void bench_sparse(std::size_t rows, std::size_t width, std::size_t count, const Floors& f, int reps) {
  std::printf("\nsparse: %zu Zipf(1.1) ids x %zu pushed and pulled on a %zu x %zu table, Adam rows, Asynchronous, "
              "%zu servers\n",
              count, width, rows, width, kServers);
  const std::vector<std::uint64_t> ids = psx_bench::zipf_ids(count, rows, 1.1, 7);
  std::mt19937_64 rng(8);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> g(count * width), out(count * width);
  for (float& x : g) x = d(rng);
  pc::buffer<float> dout(count * width);
  const double row_bytes = static_cast<double>(count * width) * 4.0, id_bytes = static_cast<double>(count) * 8.0;
  // Floors: the push's rows and ids to the device; the pull's ids to the device and its rows back.
  const double push_floor = 1e3 * (row_bytes + id_bytes) / (f.h2d_pinned * 1e9);
  const double pull_floor = 1e3 * (id_bytes / (f.h2d_pinned * 1e9) + row_bytes / (f.d2h_pinned * 1e9));
  const double pull_device_floor = 1e3 * id_bytes / (f.h2d_pinned * 1e9);

  const SparseTimes host = sparse_steps<psx::storage::Host>(rows, width, ids, g, out, reps);
  report("host storage: push + pull", host.step, 0.0, "rows summed in a hash map, Adam per row");
  report("  push alone", host.push, 0.0, "");
  report("  pull alone", host.pull, 0.0, "rows gathered on the host");
  const SparseTimes device = sparse_steps<pc::Device>(rows, width, ids, g, out, reps);
  report("cuda::Device, pageable: push + pull", device.step, push_floor + pull_floor,
         "rows deduplicated (CUB) and gathered on the device");
  report("  push alone", device.push, push_floor, "floor: rows + ids H2D at the pinned rate");
  report("  pull alone", device.pull, pull_floor, "floor: ids H2D + rows D2H at the pinned rates");
  pc::pinned_buffer<float> pg(count * width), pout(count * width);
  std::copy(g.begin(), g.end(), pg.span().begin());
  const SparseTimes pin = sparse_steps<pc::Device>(rows, width, ids, pg.span(), pout.span(), reps);
  report("cuda::Device, pinned: push + pull", pin.step, push_floor + pull_floor,
         "rows gathered and scattered by kernels over the bus");
  report("  push alone", pin.push, push_floor, "floor: rows + ids H2D at the pinned rate");
  report("  pull alone", pin.pull, pull_floor, "floor: ids H2D + rows D2H at the pinned rates");
  const SparseTimes to_device =
      sparse_steps<pc::Device>(rows, width, ids, g, std::span<float>(dout.data(), dout.size()), reps);
  report("cuda::Device, pull to device: push + pull", to_device.step, push_floor + pull_device_floor, "");
  report("  pull alone", to_device.pull, pull_device_floor, "floor: ids H2D at the pinned rate");
  std::printf("  host storage / cuda::Device: %.1fx (pageable), %.1fx (pinned), %.1fx (pull to device)\n",
              host.step / device.step, host.step / pin.step, host.step / to_device.step);
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  if (const int rc = psx_bench::open_device("psx_bench_gpu_storage", quick)) return rc;
  try {
    const std::size_t dense = quick ? (1u << 20) : (64u << 20);
    const Floors f = measure_copies(dense * 4);
    bench_dense(dense, f, quick ? 3 : 10);
    bench_sparse(quick ? 100000 : 4000000, 64, quick ? 10000 : 1000000, f, quick ? 3 : 10);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "psx_bench_gpu_storage: %s\n", e.what());
    return 1;
  }
  return 0;
}

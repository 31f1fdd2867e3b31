// bench_checkpoint: checkpoint save and restore throughput next to a plain
// sequential file of the same bytes, in the same run, in the same directory.
//
//   model: 4 dense variables of 1024 columns, Adam (2 slots per parameter),
//          2 servers, 1 worker, after one training step (so the slots are not
//          zeros); parameters + slots come to about the size asked for
//   save:  psx::checkpoint::save: every server writes (and CRCs) its shard
//          file, fsyncs it, the chief writes the manifest and renames the
//          directory into place
//   plain write: write() of the same number of bytes, from a buffer already
//          in memory, into one file, then fsync
//   restore: psx::checkpoint::restore: every server reads its shard file,
//          checks its CRCs, and the chief has them apply it
//   plain read: read() of the plain file into a freshly allocated buffer (a
//          program that loads a file must put it somewhere; psx allocates its
//          read buffers the same way)
//
// Reads are measured twice. Warm: right after the writes, so both files come
// from the page cache and the figure is the CPU and memory cost of loading.
// Cold: after `sync` and writing 3 to /proc/sys/vm/drop_caches, done before
// the plain read and before the psx read alike; only when that file is
// writable (as root), and the output says which applied. On a virtual
// machine a cold read may still come from the host's cache.
// Bytes moved = the sizes of the shard files (the manifest aside). psx and
// plain runs alternate in order, and each figure is the median of `reps`.
//
// Goal (issue: checkpoints): save and restore within 1.5x of the plain write
// and read, i.e. psx time / plain time <= 1.5.
//
//   ./bench_checkpoint [MiB of parameters + slots = 1024] [reps = 3]
#include <psx/checkpoint.hpp>
#include <psx/psx.hpp>

#include "plain_io.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace psx_bench;

using Cluster = psx::ParameterServer<psx::partition::RowRange, psx::sync::Synchronous, psx::optim::Adam>;

constexpr std::size_t num_servers = 2, num_variables = 4, cols = 1024;
constexpr std::size_t saved_floats_per_param = 3;  // the parameter and Adam's two slots

struct Times {
  std::vector<double> save, write, restore_warm, read_warm, restore_cold, read_cold;
};

void print_row(const char* what, double bytes, double psx_s, double plain_s) {
  const double ratio = psx_s / plain_s;
  std::printf("%-10s %9.2f %10.2f %9.3f %9.3f   psx/plain %5.2fx (goal <= 1.5x) %s\n", what,
              bytes / psx_s / 1e9, bytes / plain_s / 1e9, psx_s, plain_s, ratio, ratio <= 1.5 ? "ok" : "MISSED");
}

}  // namespace

int main(int argc, char** argv) try {
  const std::size_t mib = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1024;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 3;
  if (mib == 0 || reps < 1) {
    std::fprintf(stderr, "usage: %s [MiB of parameters + slots = 1024] [reps = 3]\n", argv[0]);
    return 2;
  }
  const std::size_t rows =
      std::max<std::size_t>(1, (mib << 20) / (num_variables * cols * sizeof(float) * saved_floats_per_param));

  const ScratchDir scratch("psx-bench-checkpoint");
  const fs::path& root = scratch.path;
  if (!scratch.has_room(2.2 * static_cast<double>(mib << 20), "bench_checkpoint")) return 2;  // a checkpoint and the plain file
  const bool cold = drop_caches();

  Cluster ps({num_servers, 1}, {}, {}, {.lr = 0.01});
  for (std::size_t v = 0; v < num_variables; ++v)
    ps.declare(psx::dense("w" + std::to_string(v), {rows, cols}, psx::Initializer::uniform(-1, 1, v + 1)));

  Times t;
  std::uint64_t bytes = 0;
  bool restored_ok = true;
  ps.run([&](psx::Worker& w) {
    {  // one step, so Adam's slots hold values rather than zeros
      std::vector<float> g(rows * cols);
      for (std::size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>(i % 1009) * 1e-3f - 0.5f;
      for (std::size_t v = 0; v < num_variables; ++v) w.push("w" + std::to_string(v), g);
      w.step();
    }
    // Untimed: a first save (first-touch effects, and the size of the files).
    const auto first = psx::checkpoint::save(ps, w, root);
    bytes = shard_bytes(first.path);
    fs::remove_all(first.path);
    std::vector<std::byte> source(bytes);  // what the plain write writes
    std::uint64_t x = 0x9E3779B97F4A7C15ull;
    for (std::size_t i = 0; i + 8 <= source.size(); i += 8) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      std::memcpy(source.data() + i, &x, 8);
    }
    const fs::path plain = root / "plain.bin";

    for (int rep = 0; rep < reps; ++rep) {
      fs::path ckpt;
      auto run_save = [&] {
        ::sync();
        const auto t0 = Clock::now();
        ckpt = psx::checkpoint::save(ps, w, root).path;
        t.save.push_back(seconds_since(t0));
      };
      auto run_write = [&] {
        ::sync();
        const auto t0 = Clock::now();
        plain_write(plain, source.data(), source.size());
        t.write.push_back(seconds_since(t0));
      };
      auto run_restore = [&](std::vector<double>& into) {
        const auto t0 = Clock::now();
        const auto step = psx::checkpoint::restore(ps, w, ckpt);
        into.push_back(seconds_since(t0));
        restored_ok = restored_ok && step == w.clock();
      };
      auto run_read = [&](std::vector<double>& into) {
        const auto t0 = Clock::now();
        auto buf = plain_read(plain, source.size());
        into.push_back(seconds_since(t0));
        buf.reset();
      };
      const bool psx_first = rep % 2 == 0;
      if (psx_first) run_save(), run_write(); else run_write(), run_save();
      if (psx_first) run_restore(t.restore_warm), run_read(t.read_warm);
      else run_read(t.read_warm), run_restore(t.restore_warm);
      if (cold) {
        if (psx_first) {
          drop_caches(), run_restore(t.restore_cold);
          drop_caches(), run_read(t.read_cold);
        } else {
          drop_caches(), run_read(t.read_cold);
          drop_caches(), run_restore(t.restore_cold);
        }
      }
      fs::remove_all(ckpt);
      fs::remove(plain);
    }
  });
  if (!restored_ok) throw std::runtime_error("a restore returned another step");

  const double b = static_cast<double>(bytes);
  std::printf("bench_checkpoint: %zu variables x [%zu, %zu] + Adam's 2 slots = %.1f MiB in %zu shard files, "
              "%zu servers, median of %d\n",
              num_variables, rows, cols, b / (1 << 20), num_servers, num_servers, reps);
  std::printf("directory: %s (checkpoint and plain file side by side; removed at the end)\n", root.c_str());
  std::printf("%-10s %9s %10s %9s %9s   (time ratio)\n", "", "psx GB/s", "plain GB/s", "psx s", "plain s");
  print_row("write", b, median(t.save), median(t.write));
  print_row("read warm", b, median(t.restore_warm), median(t.read_warm));
  if (cold) print_row("read cold", b, median(t.restore_cold), median(t.read_cold));
  std::printf("write: save (each server CRCs, writes and fsyncs its file, in parallel; manifest, renames) vs one "
              "thread's write() + fsync of one file\n");
  std::printf("read: restore (each server reads, CRCs and stages its file, in parallel; then applies) vs one "
              "thread's read() into a new buffer\n");
  std::printf("read warm: from the page cache (both files were just written): the CPU and memory cost\n");
  if (cold)
    std::printf("read cold: page cache dropped (/proc/sys/vm/drop_caches) before each psx and each plain "
                "read; on a VM the host may still cache the disk\n");
  else
    std::printf("read cold: not measured: /proc/sys/vm/drop_caches is not writable here (run as root to drop caches), "
                "so every read came from the page cache\n");
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_checkpoint: %s\n", e.what());
  return 1;
}

// bench_table_save: saving a large dynamic table while training goes on
// (checkpoint::save_in_background) against a save that training waits for
// (checkpoint::save), and the save's and restore's GB/s next to a plain
// file of the same bytes, all in the same run.
//
//   table:    psx::embedding of `rows` ids x `dim` floats (default 10M x 16),
//             Adagrad (one slot), every id pushed once before the clock
//             starts; `servers` servers (default 2), one worker, in one
//             process (InProcess), Asynchronous
//   a step:   pull_rows and push_rows of 4096 ids drawn from a Zipf(1.1)
//             law over the rows (the recommender case: a few hot ids)
//   phases:   `seconds` (default 4) of training with no save; a background
//             save begun (the workers wait while each server snapshots:
//             counters and sketch copied, rows not), then training on,
//             asking the servers every 8 steps whether their files are
//             written, then `finish` (manifest, rename); a stopping save
//             (training waits for the whole write), then training on for
//             the same window as the background save took
//   figures:  steps per second in each window and its ratio to the window
//             without a save (goal: >= 0.7x while a background save is
//             written); the longest step (a pull + push: the longest pause
//             a push sees) and the snapshot's wait (goal: < 50 ms); the peak
//             resident memory the background save added (rows copied
//             before they changed, the writers' blocks); save and restore
//             GB/s next to write() + fsync and read() of the same bytes
//             into one file in the same directory.
//
// On this 2-core VM the servers' threads, their writers and the worker share
// two cores: the background figures include that contention.
//
//   bench_table_save [rows = 10000000] [dim = 16] [servers = 2] [seconds = 4]
#include <psx/checkpoint.hpp>
#include <psx/psx.hpp>

#include "../proc_status.hpp"
#include "../zipf.hpp"
#include "plain_io.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

namespace {

using namespace psx_bench;
using Cluster = psx::ParameterServer<psx::partition::HashByName, psx::sync::Asynchronous, psx::optim::Adagrad>;

constexpr std::size_t kBatch = 4096;

// Resets VmHWM to the current RSS (writing 5 to clear_refs), where allowed.
bool reset_peak() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  f.flush();
  return static_cast<bool>(f);
}

struct Window {
  double seconds = 0;
  std::size_t steps = 0;
  double longest_ms = 0;
  std::vector<double> ms;  // each step's
  double rate() const { return static_cast<double>(steps) / seconds; }
  double p99() const {
    if (ms.empty()) return 0;
    std::vector<double> v = ms;
    const auto k = static_cast<std::ptrdiff_t>(v.size() * 99 / 100);
    std::nth_element(v.begin(), v.begin() + k, v.end());
    return v[static_cast<std::size_t>(k)];
  }
};

class Trainer {
 public:
  Trainer(psx::Worker& w, std::size_t rows, std::size_t dim)
      : w_(w), pool_(zipf_ids(std::size_t{1} << 20, rows, 1.1, 7)), rows_(kBatch * dim), grads_(kBatch * dim) {
    for (std::size_t i = 0; i < grads_.size(); ++i) grads_[i] = static_cast<float>(i % 17) * 1e-3f - 8e-3f;
  }

  // One step; returns its milliseconds.
  double step() {
    const std::span<const std::uint64_t> ids(pool_.data() + at_, kBatch);
    at_ = (at_ + kBatch) % (pool_.size() - kBatch);
    const auto t0 = Clock::now();
    w_.pull_rows("emb", ids, rows_);
    w_.push_rows("emb", ids, grads_);
    w_.step();
    return seconds_since(t0) * 1e3;
  }

  // Steps for `seconds`; `between(k)` after step k (untimed in the steps, timed in the window).
  template <class Between>
  Window run_for(double seconds, Between&& between) {
    Window out;
    const auto t0 = Clock::now();
    while (seconds_since(t0) < seconds) {
      out.ms.push_back(step());
      out.longest_ms = std::max(out.longest_ms, out.ms.back());
      ++out.steps;
      if (!between(out.steps)) break;
    }
    out.seconds = seconds_since(t0);
    return out;
  }

 private:
  psx::Worker& w_;
  std::vector<std::uint64_t> pool_;
  std::vector<float> rows_, grads_;
  std::size_t at_ = 0;
};

}  // namespace

int main(int argc, char** argv) try {
  const std::size_t rows = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 10'000'000;
  const std::size_t dim = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 16;
  const std::size_t servers = argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 2;
  const double seconds = argc > 4 ? std::atof(argv[4]) : 4.0;
  if (rows < kBatch || dim == 0 || servers == 0 || seconds <= 0) {
    std::fprintf(stderr, "usage: %s [rows = 10000000] [dim = 16] [servers = 2] [seconds = 4]\n", argv[0]);
    return 2;
  }
  const ScratchDir scratch("psx-bench-table-save");
  const fs::path& root = scratch.path;
  const double need = 3.2 * static_cast<double>(rows * (24 + 8 * dim));  // two checkpoints and the plain file
  if (!scratch.has_room(need, "bench_table_save")) return 2;

  Cluster ps({servers, 1}, {}, {}, {.lr = 0.05});
  ps.declare(psx::embedding("emb", dim, psx::Initializer::uniform(-0.05f, 0.05f, 3)));
  Window without, background, stopping;
  double fill_s = 0, snapshot_ms = 0, finish_ms = 0, written_s = 0, save_s = 0, restore_s = 0;
  double write_s = 0, read_s = 0;
  std::uint64_t bytes = 0, rss_before = 0, peak_added = 0;
  bool peak_known = false;
  ps.run([&](psx::Worker& w) {
    {  // every id stored once
      const auto t0 = Clock::now();
      std::vector<std::uint64_t> ids(std::size_t{1} << 16);
      std::vector<float> g(ids.size() * dim, 1e-3f);
      for (std::size_t first = 0; first < rows; first += ids.size()) {
        const std::size_t n = std::min(ids.size(), rows - first);
        for (std::size_t k = 0; k < n; ++k) ids[k] = first + k;
        w.push_rows("emb", std::span<const std::uint64_t>(ids.data(), n), std::span<const float>(g.data(), n * dim));
      }
      w.step();
      w.barrier();
      fill_s = seconds_since(t0);
    }
    Trainer trainer(w, rows, dim);
    for (int k = 0; k < 50; ++k) trainer.step();  // warm
    without = trainer.run_for(seconds, [](std::size_t) { return true; });

    // A background save, training on while it is written.
    rss_before = proc_status("VmRSS");
    peak_known = reset_peak();
    {
      const auto t0 = Clock::now();
      psx::checkpoint::BackgroundSave b = psx::checkpoint::save_in_background(ps, w, root / "background");
      snapshot_ms = seconds_since(t0) * 1e3;
      bool written = false;
      background = trainer.run_for(600, [&](std::size_t k) { return k % 8 != 0 || !(written = b.written(w)); });
      written_s = seconds_since(t0);
      background.seconds += snapshot_ms / 1e3;  // the snapshot's wait is the window's too
      background.longest_ms = std::max(background.longest_ms, snapshot_ms);
      const auto t1 = Clock::now();
      const auto info = b.finish(w);
      finish_ms = seconds_since(t1) * 1e3;
      if (!written) throw std::runtime_error("the background save did not finish within 600 s");
      bytes = shard_bytes(info.path);
      fs::remove_all(info.path);
    }
    peak_added = proc_status("VmHWM") - rss_before;

    // A stopping save: training waits for the whole write, then trains on for the same window.
    {
      ::sync();
      const auto t0 = Clock::now();
      const auto info = psx::checkpoint::save(ps, w, root / "stopping");
      save_s = seconds_since(t0);
      stopping = trainer.run_for(std::max(0.0, written_s - save_s), [](std::size_t) { return true; });
      stopping.seconds += save_s;
      stopping.longest_ms = std::max(stopping.longest_ms, save_s * 1e3);
      const auto t1 = Clock::now();
      psx::checkpoint::restore(ps, w, info.path);
      restore_s = seconds_since(t1);
    }
  });
  {  // the same bytes as one plain file, in the same directory
    std::vector<std::byte> source(bytes);
    std::uint64_t x = 0x9E3779B97F4A7C15ull;
    for (std::size_t i = 0; i + 8 <= source.size(); i += 8) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      std::memcpy(source.data() + i, &x, 8);
    }
    const fs::path plain = root / "plain.bin";
    ::sync();
    auto t0 = Clock::now();
    plain_write(plain, source.data(), source.size());
    write_s = seconds_since(t0);
    t0 = Clock::now();
    auto buf = plain_read(plain, source.size());
    read_s = seconds_since(t0);
  }

  const double b = static_cast<double>(bytes);
  std::printf("bench_table_save: %zu rows x %zu floats, Adagrad (1 slot), %zu servers, 1 worker (pull + push of %zu "
              "Zipf(1.1) ids a step); %.2f GB of shard files; filled in %.1f s\n",
              rows, dim, servers, kBatch, b / 1e9, fill_s);
  std::printf("%-34s %9s %9s %11s %7s\n", "", "steps/s", "vs none", "longest ms", "p99 ms");
  auto row = [&](const char* what, const Window& x, const char* goal) {
    std::printf("%-34s %9.1f %8.2fx %11.1f %7.1f   %s\n", what, x.rate(), x.rate() / without.rate(), x.longest_ms,
                x.p99(), goal);
  };
  row("training, no save", without, "");
  row("while a background save is written", background, "(goals: >= 0.70x, longest < 50 ms)");
  row("a stopping save, same window", stopping, "(its longest step: the whole save)");
  std::printf("background save: snapshot %.1f ms (every worker waits), written in %.2f s while training, finish "
              "(manifest, rename) %.1f ms; peak resident memory +%.0f MiB%s\n",
              snapshot_ms, written_s, finish_ms, static_cast<double>(peak_added) / (1 << 20),
              peak_known ? "" : " (VmHWM not reset: since the start)");
  std::printf("%-10s %9s %10s %9s %9s\n", "", "psx GB/s", "plain GB/s", "psx s", "plain s");
  std::printf("%-10s %9.2f %10.2f %9.3f %9.3f   psx/plain %.2fx\n", "save", b / save_s / 1e9, b / write_s / 1e9, save_s,
              write_s, save_s / write_s);
  std::printf("%-10s %9.2f %10.2f %9.3f %9.3f   psx/plain %.2fx\n", "restore", b / restore_s / 1e9, b / read_s / 1e9,
              restore_s, read_s, restore_s / read_s);
  std::printf("save: every server CRCs, writes and fsyncs its file, in parallel (the stopping save); plain: one "
              "write() + fsync. restore: every server reads and checks its file, then applies; plain: one read() "
              "from the page cache\n");
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_table_save: %s\n", e.what());
  return 1;
}

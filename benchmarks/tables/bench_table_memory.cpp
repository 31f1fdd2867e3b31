// bench_table_memory: does a memory cap hold the process's resident memory?
//
// An endless stream of ids never seen before (the 64-bit mix of a counter:
// 1e8 of them by default), pushed in batches of 1024 with Adagrad, into a
// dynamic table under a memory cap, two ways, each in a process of its own
// (a child forked before anything is allocated), so that each has its own
// resident memory and peak:
//   table    psx::DynamicTable<Adagrad> alone, one thread pushing;
//   cluster  LocalCluster<HashByName, Asynchronous, Adagrad> of 2 servers and
//            2 workers, each server's table under the cap (the cluster's
//            cap is twice it).
// Every id is admitted, so every push past the cap evicts. Every ~2% of the
// ids it prints what the table counts (TableStats::bytes, summed over
// servers, next to the cap), the removal log (outside the cap), and the
// process's resident memory from /proc/self/status: VmRSS now and VmHWM
// (its peak), each as growth over the resident memory just before the
// table was made; then the peak growth next to the cap and what lies
// outside it.
//
//   bench_table_memory [ids] [cap_mib] [dim] [table|cluster|both]   (default 100000000 64 16 both)
//   PSX_REMOVAL_LOG=n bench_table_memory ...   TableOptions::removal_log_limit = n (default: the library's)
#include <psx/psx.hpp>

#include "../proc_status.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace {

using psx_bench::proc_status;

using Clock = std::chrono::steady_clock;
constexpr std::size_t kBatch = 1024;
const psx::Initializer kInit = psx::Initializer::uniform(-0.05f, 0.05f, 7);
const psx::optim::Adagrad kOpt{.lr = 0.05};


double mib(double bytes) { return bytes / (1 << 20); }

struct Config {
  std::uint64_t ids = 100'000'000;
  std::uint64_t cap = std::uint64_t{64} << 20;  // per table (per server)
  std::size_t dim = 16;
};

psx::TableOptions options(const Config& c) {
  psx::TableOptions o;
  o.memory_cap_bytes = c.cap;
  if (const char* limit = std::getenv("PSX_REMOVAL_LOG")) o.removal_log_limit = std::strtoull(limit, nullptr, 10);
  return o;
}

// The i-th id of the stream: never seen before (mix64 is a bijection).
std::uint64_t id_at(std::uint64_t i) { return psx::detail::mix64(i + 0x5eed); }

// What a run watches: the peak of what the table counts, and the samples.
class Watch {
 public:
  // Made just before the table (after the run's own buffers and the
  // cluster's threads): the resident memory then is the base.
  Watch(const char* way, const Config& c, std::uint64_t tables)
      : way_(way), config_(c), cap_(c.cap * tables), base_(proc_status("VmRSS")), start_(Clock::now()) {
    std::printf("%s: %llu new ids, dim %zu, cap %.0f MiB (%llu x %.0f), resident before the table %.1f MiB\n", way,
                static_cast<unsigned long long>(c.ids), c.dim, mib(static_cast<double>(cap_)),
                static_cast<unsigned long long>(tables), mib(static_cast<double>(c.cap)), mib(static_cast<double>(base_)));
    // The removal log's bound (outside the cap): each stripe forgets its
    // older half once it holds one more than its share of the limit; 48
    // bytes an entry is the library's estimate (TableStats::removal_log_bytes).
    const psx::TableOptions o = options(c);
    const std::uint64_t per_stripe = o.removal_log_limit ? std::max<std::uint64_t>(1, o.removal_log_limit / o.stripes) + 1 : 0;
    log_bound_ = per_stripe * o.stripes * 48 * tables;
    std::printf("  removal log: at most %llu removals per table, %.1f MiB in all, outside the cap\n",
                static_cast<unsigned long long>(per_stripe * o.stripes), mib(static_cast<double>(log_bound_)));
    std::printf("  %8s %8s | %9s %7s | %10s | %9s %9s\n", "Mids", "Mids/s", "table MiB", "/ cap", "removal log",
                "RSS +MiB", "peak +MiB");
    std::fflush(stdout);
  }

  // Called after each batch with the ids done and the summed stats.
  void sample(std::uint64_t done, const psx::TableStats& s) {
    table_peak_ = std::max(table_peak_, s.bytes);
    log_peak_ = std::max(log_peak_, s.removal_log_bytes);
    const std::uint64_t rss = proc_status("VmRSS");
    rss_peak_ = std::max(rss_peak_, rss);
    const double secs = std::chrono::duration<double>(Clock::now() - start_).count();
    std::printf("  %8.2f %8.2f | %9.1f %6.1f%% | %7.1f MiB | %9.1f %9.1f\n", static_cast<double>(done) / 1e6,
                static_cast<double>(done) / 1e6 / secs, mib(static_cast<double>(s.bytes)),
                100.0 * static_cast<double>(s.bytes) / static_cast<double>(cap_), mib(static_cast<double>(s.removal_log_bytes)),
                mib(static_cast<double>(rss) - static_cast<double>(base_)), mib(static_cast<double>(proc_status("VmHWM")) - static_cast<double>(base_)));
    std::fflush(stdout);
  }

  void finish(std::uint64_t done, const psx::TableStats& s) {
    sample(done, s);
    const double secs = std::chrono::duration<double>(Clock::now() - start_).count();
    const double peak = static_cast<double>(std::max(proc_status("VmHWM"), rss_peak_)) - static_cast<double>(base_);
    const double cap = static_cast<double>(cap_);
    std::printf("%s: %.1f Mids/s over %.0f s; rows %llu, evicted %llu\n", way_, static_cast<double>(done) / 1e6 / secs,
                secs, static_cast<unsigned long long>(s.rows), static_cast<unsigned long long>(s.evicted_memory));
    std::printf("%s: cap %.1f MiB, table counted at most %.1f MiB (%.1f%% of the cap), removal log at most %.1f MiB\n",
                way_, mib(cap), mib(static_cast<double>(table_peak_)), 100.0 * static_cast<double>(table_peak_) / cap,
                mib(static_cast<double>(log_peak_)));
    std::printf("%s: peak RSS growth %.1f MiB = %.2fx the cap; beyond the cap %.1f MiB, beyond the cap and the "
                "removal log's peak %.1f MiB (its bound %.1f MiB)\n\n",
                way_, mib(peak), peak / cap, mib(peak - cap), mib(peak - cap - static_cast<double>(log_peak_)),
                mib(static_cast<double>(log_bound_)));
    std::fflush(stdout);
  }

  bool due(std::uint64_t done) const { return done >= next_; }
  void advance() { next_ += std::max<std::uint64_t>(kBatch, config_.ids / 50); }

 private:
  const char* way_;
  Config config_;
  std::uint64_t cap_, base_, log_bound_ = 0;
  Clock::time_point start_;
  std::uint64_t table_peak_ = 0, log_peak_ = 0, rss_peak_ = 0, next_ = 0;
};

void run_table(const Config& c) {
  std::vector<std::uint64_t> ids(kBatch);
  const std::vector<float> g(kBatch * c.dim, 0.01f);
  Watch watch("table", c, 1);
  psx::DynamicTable<psx::optim::Adagrad> table("emb", c.dim, kInit, options(c), kOpt);
  std::uint64_t done = 0;
  for (std::uint64_t step = 1; done < c.ids; ++step) {
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(kBatch, c.ids - done));
    for (std::size_t j = 0; j < n; ++j) ids[j] = id_at(done + j);
    table.push(kOpt, std::span<const std::uint64_t>(ids.data(), n), std::span<const float>(g.data(), n * c.dim),
               psx::UpdateContext{step, 1.0, nullptr, step, true});
    done += n;
    if (watch.due(done)) watch.sample(done, table.stats()), watch.advance();
  }
  watch.finish(done, table.stats());
}

void run_cluster(const Config& c) {
  constexpr std::size_t kServers = 2, kWorkers = 2;
  std::vector<std::vector<std::uint64_t>> ids(kWorkers, std::vector<std::uint64_t>(kBatch));
  const std::vector<float> g(kBatch * c.dim, 0.01f);
  psx::LocalCluster<psx::partition::HashByName, psx::sync::Asynchronous, psx::optim::Adagrad> ps({kServers, kWorkers},
                                                                                                {}, {}, kOpt);
  Watch watch("cluster", c, kServers);
  ps.declare(psx::embedding("emb", c.dim, kInit, options(c)));
  auto total = [&] {
    psx::TableStats t;
    for (const auto& s : ps.table_stats("emb")) t += s;
    return t;
  };
  std::atomic<std::uint64_t> done{0};
  ps.run([&](psx::Worker& w) {
    std::vector<std::uint64_t>& mine = ids[w.index()];
    // The workers take turns: worker k the batches k, k + workers, ...
    for (std::uint64_t b = w.index();; b += kWorkers) {
      const std::uint64_t first = b * kBatch;
      if (first >= c.ids) break;
      const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(kBatch, c.ids - first));
      for (std::size_t j = 0; j < n; ++j) mine[j] = id_at(first + j);
      w.push_rows("emb", std::span<const std::uint64_t>(mine.data(), n), std::span<const float>(g.data(), n * c.dim));
      w.step();
      const std::uint64_t now = done.fetch_add(n) + n;
      if (w.index() == 0 && watch.due(now)) watch.sample(now, total()), watch.advance();
    }
  });
  watch.finish(done.load(), total());
}

// Runs `body` in a child process of its own: its resident memory and peak are its own.
template <class F>
int in_child(F&& body) {
  std::fflush(stdout);
  const pid_t pid = fork();
  if (pid < 0) return 1;
  if (pid == 0) {
    body();
    std::fflush(stdout);
    _exit(0);
  }
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return 1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  if (argc > 1) c.ids = std::strtoull(argv[1], nullptr, 10);
  if (argc > 2) c.cap = std::strtoull(argv[2], nullptr, 10) << 20;
  if (argc > 3) c.dim = std::strtoull(argv[3], nullptr, 10);
  const std::string mode = argc > 4 ? argv[4] : "both";
  std::printf("bench_table_memory: %llu never-seen ids pushed in batches of %zu (Adagrad, dim %zu), "
              "cap %.0f MiB per table; RSS and peak as growth over the resident memory before the table\n\n",
              static_cast<unsigned long long>(c.ids), kBatch, c.dim, mib(static_cast<double>(c.cap)));
  int rc = 0;
  if (mode == "table" || mode == "both") rc |= in_child([&] { run_table(c); });
  if (mode == "cluster" || mode == "both") rc |= in_child([&] { run_cluster(c); });
  return rc;
}

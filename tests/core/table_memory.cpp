// A dynamic table's memory cap holds the process's resident memory, not only
// the table's own count (psx/embedding.hpp, docs/embedding.md "Memory cap").
//
// A program of its own, not a doctest case: resident memory is a property of
// the process, and the test suite's other cases leave its heap grown and
// holed. Each run streams ids never seen before (the 64-bit mix of a counter)
// through pushes of 1024 ids into a table under a cap, every id admitted, so
// every push past the cap evicts, and reads VmRSS and VmHWM from
// /proc/self/status. It passes when the resident memory grew by at most
//   the cap + the removal log's bound + kSlack
// over the resident memory just before the table was made, and the table
// evicted (and counted itself under the cap) all along. Without eviction the
// default stream stores 3M rows of about 180 bytes: 540 MB, far over.
//
//   psx_table_memory table|cluster [ids]   (default 3000000; PSX_TABLE_MEMORY_IDS=100000000 for the long form)
//
// `table`: a DynamicTable<Adagrad> alone, one thread, a 32 MiB cap.
// `cluster`: LocalCluster<HashByName, Asynchronous, Adagrad> of 2 servers and
// 2 workers, 16 MiB per server.
// Exit 77 (skipped) under a sanitizer (its shadow memory and quarantine of
// freed blocks are resident too) or without /proc.
#include <psx/psx.hpp>

#include "../../benchmarks/proc_status.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define PSX_TABLE_MEMORY_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
#define PSX_TABLE_MEMORY_SANITIZED 1
#endif
#endif

namespace {

using psx_bench::proc_status;

using Clock = std::chrono::steady_clock;
constexpr std::size_t kBatch = 1024;
constexpr std::size_t kDim = 16;
// The removal log's limit here: 64 Ki removals (about 3 MiB) per table, so
// that the log reaches its bound and forgets many times over the stream.
constexpr std::uint64_t kRemovalLog = std::uint64_t{1} << 16;
// What the process may hold beyond the cap and the removal log: the pushing
// threads' scratch (ids grouped, duplicate sums: about 0.2 MiB a thread for
// 1024 ids of 16 floats), glibc's 16-byte header on each 2.4 KiB chunk of
// records (0.7% of the cap), the stripes' free lists and chunk pointers
// (under 1 byte a row), the LRU eviction's passing copy of a stripe's
// (last use, id) pairs, the cluster's threads (stacks, queues, requests in
// flight) and the allocator's per-thread arenas. Measured with 64 MiB caps
// and no removal log (bench_table_memory, 1e8 ids): 1.9 MiB for the table
// alone, 3.8 MiB for the cluster.
constexpr std::uint64_t kSlack = std::uint64_t{8} << 20;
const psx::Initializer kInit = psx::Initializer::uniform(-0.05f, 0.05f, 7);
const psx::optim::Adagrad kOpt{.lr = 0.05};


double mib(std::uint64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

std::uint64_t id_at(std::uint64_t i) { return psx::detail::mix64(i + 0x7ab1e); }

psx::TableOptions options(std::uint64_t cap) {
  psx::TableOptions o;
  o.memory_cap_bytes = cap;
  o.removal_log_limit = kRemovalLog;
  return o;
}

// The removal log's bound per table: a stripe forgets its older half once it
// holds one more than its share; 48 bytes an entry (TableStats::removal_log_bytes).
std::uint64_t log_bound(const psx::TableOptions& o) {
  return (std::max<std::uint64_t>(1, o.removal_log_limit / o.stripes) + 1) * o.stripes * 48;
}

// What a run saw: checked against the bound at the end.
struct Seen {
  std::uint64_t base = 0, rss_peak = 0, table_peak = 0, cap = 0, log_bound = 0, ids = 0;
  psx::TableStats last;
  int over_cap = 0;  // samples where the table counted more than its cap
  bool out_of_time = false;

  void sample(const psx::TableStats& s, std::uint64_t caps) {
    rss_peak = std::max(rss_peak, proc_status("VmRSS"));
    table_peak = std::max(table_peak, s.bytes);
    if (s.bytes > caps) ++over_cap;
  }
};

// At most this long for the default stream (the test's time limit is 300 s);
// a longer stream gets 5 µs an id more.
std::chrono::seconds time_limit(std::uint64_t ids) {
  return std::chrono::seconds(std::max<std::uint64_t>(150, ids / 200'000));
}

Seen run_table(std::uint64_t total) {
  std::vector<std::uint64_t> ids(kBatch);
  const std::vector<float> g(kBatch * kDim, 0.01f);
  const psx::TableOptions o = options(std::uint64_t{32} << 20);
  Seen seen;
  seen.cap = o.memory_cap_bytes;
  seen.log_bound = log_bound(o);
  seen.base = proc_status("VmRSS");
  psx::DynamicTable<psx::optim::Adagrad> table("emb", kDim, kInit, o, kOpt);
  const auto deadline = Clock::now() + time_limit(total);
  for (std::uint64_t step = 1; seen.ids < total; ++step) {
    if (Clock::now() > deadline) {
      seen.out_of_time = true;
      break;
    }
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(kBatch, total - seen.ids));
    for (std::size_t j = 0; j < n; ++j) ids[j] = id_at(seen.ids + j);
    table.push(kOpt, std::span<const std::uint64_t>(ids.data(), n), std::span<const float>(g.data(), n * kDim),
               psx::UpdateContext{step, 1.0, nullptr, step, true});
    seen.ids += n;
    if (step % 64 == 0) seen.sample(table.stats(), seen.cap);
  }
  seen.last = table.stats();
  seen.sample(seen.last, seen.cap);
  return seen;
}

Seen run_cluster(std::uint64_t total) {
  constexpr std::size_t kServers = 2, kWorkers = 2;
  std::vector<std::vector<std::uint64_t>> ids(kWorkers, std::vector<std::uint64_t>(kBatch));
  const std::vector<float> g(kBatch * kDim, 0.01f);
  const psx::TableOptions o = options(std::uint64_t{16} << 20);
  psx::LocalCluster<psx::partition::HashByName, psx::sync::Asynchronous, psx::optim::Adagrad> ps({kServers, kWorkers},
                                                                                                {}, {}, kOpt);
  Seen seen;
  seen.cap = kServers * o.memory_cap_bytes;
  seen.log_bound = kServers * log_bound(o);
  seen.base = proc_status("VmRSS");
  ps.declare(psx::embedding("emb", kDim, kInit, o));
  auto stats = [&] {
    psx::TableStats t;
    int over = 0;
    for (const auto& s : ps.table_stats("emb")) {
      t += s;
      if (s.bytes > o.memory_cap_bytes) ++over;  // each server under its own cap
    }
    return std::pair(t, over);
  };
  const auto deadline = Clock::now() + time_limit(total);
  std::atomic<std::uint64_t> done{0};
  std::atomic<bool> late{false};
  ps.run([&](psx::Worker& w) {
    std::vector<std::uint64_t>& mine = ids[w.index()];
    for (std::uint64_t b = w.index(), k = 0;; b += kWorkers, ++k) {
      const std::uint64_t first = b * kBatch;
      if (first >= total) break;
      if (Clock::now() > deadline) {
        late = true;
        break;
      }
      const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(kBatch, total - first));
      for (std::size_t j = 0; j < n; ++j) mine[j] = id_at(first + j);
      w.push_rows("emb", std::span<const std::uint64_t>(mine.data(), n), std::span<const float>(g.data(), n * kDim));
      w.step();
      done += n;
      if (w.index() == 0 && k % 32 == 0) {
        const auto [t, over] = stats();
        seen.sample(t, seen.cap);
        seen.over_cap += over;
      }
    }
  });
  seen.ids = done.load();
  seen.out_of_time = late.load();
  const auto [t, over] = stats();
  seen.last = t;
  seen.sample(t, seen.cap);
  seen.over_cap += over;
  return seen;
}

}  // namespace

int main(int argc, char** argv) {
#ifdef PSX_TABLE_MEMORY_SANITIZED
  std::printf("table memory: skipped under a sanitizer (its shadow memory and quarantine are resident too)\n");
  return 77;
#endif
  if (proc_status("VmRSS") == 0 || proc_status("VmHWM") == 0) {
    std::printf("table memory: skipped, no VmRSS/VmHWM in /proc/self/status\n");
    return 77;
  }
  const std::string way = argc > 1 ? argv[1] : "table";
  std::uint64_t ids = 3'000'000;
  if (const char* env = std::getenv("PSX_TABLE_MEMORY_IDS")) ids = std::strtoull(env, nullptr, 10);
  if (argc > 2) ids = std::strtoull(argv[2], nullptr, 10);
  if ((way != "table" && way != "cluster") || ids == 0) {
    std::fprintf(stderr, "usage: psx_table_memory table|cluster [ids]\n");
    return 2;
  }
  const auto t0 = Clock::now();
  const Seen s = way == "table" ? run_table(ids) : run_cluster(ids);
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  const std::uint64_t peak = std::max(proc_status("VmHWM"), s.rss_peak) - s.base;
  const std::uint64_t bound = s.cap + s.log_bound + kSlack;
  std::printf("%s: %llu new ids in %.1f s%s; %s\n", way.c_str(), static_cast<unsigned long long>(s.ids), secs,
              s.out_of_time ? " (out of time: stopped early)" : "", [&] {
                std::ostringstream line;
                line << s.last;
                return line.str();
              }().c_str());
  std::printf("%s: peak RSS growth %.1f MiB, cap %.1f MiB (the table counted at most %.1f), removal log bound %.1f "
              "MiB, slack %.1f MiB: bound %.1f MiB\n",
              way.c_str(), mib(peak), mib(s.cap), mib(s.table_peak), mib(s.log_bound), mib(kSlack), mib(bound));
  int failed = 0;
  auto check = [&](bool ok, const char* what) {
    if (!ok) {
      std::printf("%s: FAILED: %s\n", way.c_str(), what);
      ++failed;
    }
  };
  check(peak <= bound, "the resident memory grew beyond the cap, the removal log's bound and the slack");
  check(s.over_cap == 0, "the table counted more than its cap");
  // The stream ran well past the cap: most ids stored were evicted again.
  check(s.last.evicted_memory >= s.ids / 2, "fewer than half the ids were evicted (did the stream reach the cap?)");
  check(s.last.admitted == s.ids, "not every id was admitted");
  check(s.last.removal_log * 48 <= s.log_bound, "the removal log outgrew its bound");
  if (failed) return 1;
  std::printf("table memory: passed (%s)\n", way.c_str());
  return 0;
}

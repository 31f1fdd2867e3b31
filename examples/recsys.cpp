// recsys: trains a click model over a stream of hashed feature ids that
// never repeats itself, as a recommender's does: 8 fields per example, each
// field's id drawn from a Zipf law (exponent 1.05) over 2^25 ranks, so a
// few ids are hot and most are seen once or twice. By default the stream
// passes 12 million distinct ids; no table could be sized for it in advance.
//
// The ids live in one dynamic embedding table (psx::embedding, rows of 8
// floats) on the in-process cluster (2 servers, 2 asynchronous workers,
// Adagrad), with admission and eviction on:
//  - an id is stored at its second push, counted in a count-min sketch of
//    4 x 2^22 counters (16 MiB per server); until then a pull returns its
//    initial value and a push is refused. The sketch never forgets, so as
//    it fills, more ids pass at their first push: refusals slow down;
//  - a row not updated for 800 steps (a quarter of a shorter run) is
//    evicted (time to live);
//  - each server holds at most 48 MiB of the table (rows, optimizer
//    slots, index and sketch), evicting its least recently used rows to
//    store new ones.
//
// The hidden truth: id x adds t(x), uniform in [-0.75, 0.75] and drawn from
// a hash of x, to the click logit (bias -1). The model: logit = b + sum over
// fields of dot(e[x], v), with e the embedding rows and v a dense vector.
//
// The chief prints, every tenth of the run: the distinct ids drawn so far
// (counted exactly, in a bitmap over the fields' ranks) and the ids per
// second; its log loss over the last tenth next to the true model's on the
// same examples (the excess is what the model has yet to learn); and per
// server the rows stored, the memory against the cap, the bytes per row
// against the ideal (8 floats and their Adagrad accumulators: 64 bytes; the
// memory also counts the index, the rows' metadata and the sketch), the
// ids admitted and refused, and the rows evicted by age and by memory.
//
//   ./recsys [steps]     (default 8000 steps of 512 examples per worker: about
//                         65M ids drawn, 12.9M distinct, in 30-60 s on 2 cores)
#include <psx/psx.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

namespace {

constexpr std::size_t kFields = 8, kDim = 8, kBatch = 512, kWorkers = 2, kServers = 2;
constexpr unsigned kRankBits = 25;  // ranks per field: 2^25
constexpr double kExponent = 1.05;
constexpr std::uint64_t kTtlSteps = 800;
constexpr std::uint64_t kCapBytes = 48ull << 20;  // per server
constexpr float kTrueBias = -1.0f, kTrueScale = 0.75f;
constexpr std::uint64_t kTruthKey = 0x7275746873656564ull;

// Draws ranks 1..n with P(k) proportional to k^-s by rejection-inversion
// (Hörmann & Derflinger 1996, as Apache Commons RNG's
// RejectionInversionZipfSampler): O(1) per draw and no table, where
// inverting the CDF would need one double per rank.
class ZipfSampler {
 public:
  ZipfSampler(std::uint64_t n, double s)
      : n_(static_cast<double>(n)),
        s_(s),
        h_integral_x1_(h_integral(1.5) - 1.0),
        h_integral_n_(h_integral(n_ + 0.5)),
        shift_(2.0 - h_integral_inverse(h_integral(2.5) - h(2.0))) {}

  // `u01` returns uniform doubles in [0, 1).
  template <class U>
  std::uint64_t operator()(U&& u01) const {
    for (;;) {
      const double u = h_integral_n_ + u01() * (h_integral_x1_ - h_integral_n_);
      const double x = h_integral_inverse(u);
      const double k = std::clamp(std::floor(x + 0.5), 1.0, n_);
      if (k - x <= shift_ || u >= h_integral(k + 0.5) - h(k)) return static_cast<std::uint64_t>(k);
    }
  }

 private:
  double h(double x) const { return std::exp(-s_ * std::log(x)); }
  // The integral of h from 1 to x: (x^(1-s) - 1) / (1-s), stable near s = 1.
  double h_integral(double x) const {
    const double log_x = std::log(x);
    return expm1_over((1.0 - s_) * log_x) * log_x;
  }
  double h_integral_inverse(double x) const {
    const double t = std::max(x * (1.0 - s_), -1.0);
    return std::exp(log1p_over(t) * x);
  }
  // expm1(x) / x and log1p(x) / x, by their Taylor series near 0.
  static double expm1_over(double x) {
    return std::abs(x) > 1e-8 ? std::expm1(x) / x : 1.0 + x * 0.5 * (1.0 + x / 3.0 * (1.0 + 0.25 * x));
  }
  static double log1p_over(double x) {
    return std::abs(x) > 1e-8 ? std::log1p(x) / x : 1.0 - x * (0.5 - x * (1.0 / 3.0 - 0.25 * x));
  }

  double n_, s_, h_integral_x1_, h_integral_n_, shift_;
};

// SplitMix64's finalizer (Steele, Lea, Flood 2014): a bijective 64-bit mix.
constexpr std::uint64_t mix64(std::uint64_t z) noexcept {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

double to_unit(std::uint64_t bits) noexcept { return static_cast<double>(bits >> 11) * 0x1.0p-53; }

// SplitMix64: uniform doubles in [0, 1), one stream per worker.
struct Rng {
  std::uint64_t state;
  double operator()() noexcept { return to_unit(mix64(state += 0x9e3779b97f4a7c15ull)); }
};

// Field f's rank r as a feature id: mixed, so the ids look hashed; the mix
// is bijective, so no two (field, rank) pairs share an id.
std::uint64_t feature_id(std::size_t f, std::uint64_t rank) { return mix64((std::uint64_t{f} << 40) | rank); }

// The hidden logit contribution of an id.
float true_weight(std::uint64_t id) {
  return kTrueScale * static_cast<float>(2.0 * to_unit(mix64(id ^ kTruthKey)) - 1.0);
}

// log(1 + e^-z) for a click, log(1 + e^z) otherwise, computed stably.
double log_loss(double logit, bool click) {
  const double z = click ? logit : -logit;
  return z > 0 ? std::log1p(std::exp(-z)) : -z + std::log1p(std::exp(z));
}

// One bit per (field, rank): counts the distinct ids drawn so far, exactly,
// from every worker at once (2^28 bits, 32 MiB).
class DistinctIds {
 public:
  DistinctIds() : words_(std::make_unique<std::atomic<std::uint64_t>[]>(kWords)) {}

  void add(std::size_t f, std::uint64_t rank) noexcept {
    const std::uint64_t bit = (std::uint64_t{f} << kRankBits) | (rank - 1);
    std::atomic<std::uint64_t>& word = words_[bit / 64];
    const std::uint64_t mask = std::uint64_t{1} << (bit % 64);
    // Most draws are of ids seen before: read before writing.
    if (!(word.load(std::memory_order_relaxed) & mask) && !(word.fetch_or(mask, std::memory_order_relaxed) & mask))
      count_.fetch_add(1, std::memory_order_relaxed);
  }
  std::uint64_t count() const noexcept { return count_.load(std::memory_order_relaxed); }

 private:
  static constexpr std::size_t kWords = (kFields << kRankBits) / 64;
  std::unique_ptr<std::atomic<std::uint64_t>[]> words_;
  std::atomic<std::uint64_t> count_{0};
};

double mib(std::uint64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }
double millions(std::uint64_t n) { return static_cast<double>(n) / 1e6; }

}  // namespace

int main(int argc, char** argv) {
  const std::size_t steps = std::max<std::size_t>(1, argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 8000);
  const std::size_t report_every = std::max<std::size_t>(1, steps / 10);

  using PS = psx::LocalCluster<psx::partition::HashByName, psx::sync::Asynchronous, psx::optim::Adagrad>;
  PS ps(psx::ClusterConfig{kServers, kWorkers}, {}, {}, psx::optim::Adagrad{.lr = 0.1});
  psx::TableOptions table;
  // With the default sketch (2^20 counters a row) this stream fills it in
  // about 2000 steps; after that nearly every id is admitted at its first push.
  table.admission = psx::Admission::after_pushes(2, 1u << 22, 4);
  table.ttl_steps = std::min<std::uint64_t>(kTtlSteps, std::max<std::size_t>(1, steps / 4));  // a short run evicts too
  table.memory_cap_bytes = kCapBytes;
  table.removal_log_limit = 0;  // no delta exports here: remember no removals
  ps.declare(psx::embedding("ids", kDim, psx::Initializer::normal(0.0f, 0.01f, 7), table));
  ps.declare(psx::dense("v", {kDim}, psx::Initializer::constant(0.3f)));
  ps.declare(psx::dense("bias", {1}));

  std::printf("psx recsys: %zu fields of Zipf(%.2f) ids over 2^%u ranks each, %zu servers, %zu workers, "
              "%zu steps of %zu examples per worker\n",
              kFields, kExponent, kRankBits, kServers, kWorkers, steps, kBatch);
  std::printf("table 'ids': dim %zu, admitted at the 2nd push (16 MiB sketch), ttl %llu steps, "
              "cap %.0f MiB per server\n",
              kDim, static_cast<unsigned long long>(table.ttl_steps), mib(kCapBytes));

  const ZipfSampler zipf(std::uint64_t{1} << kRankBits, kExponent);
  DistinctIds distinct;
  std::atomic<std::uint64_t> drawn{0};
  double first_loss = -1, first_true_loss = 0, last_loss = 0, last_true_loss = 0;
  std::uint64_t peak_bytes = 0;
  const auto start = std::chrono::steady_clock::now();

  ps.run([&](psx::Worker& w) {
    Rng rng{mix64(0x5eed + w.index())};
    std::vector<std::uint64_t> ids(kBatch * kFields);
    std::vector<float> e(ids.size() * kDim), ge(ids.size() * kDim), v(kDim), gv(kDim), bias(1), gbias(1);
    std::vector<float> truth(kBatch);  // the true logits
    double window_loss = 0, window_true_loss = 0;
    auto last_report = start;
    std::uint64_t last_drawn = 0;

    for (std::size_t step = 1; step <= steps; ++step) {
      for (std::size_t b = 0; b < kBatch; ++b) {
        truth[b] = kTrueBias;
        for (std::size_t f = 0; f < kFields; ++f) {
          const std::uint64_t rank = zipf(rng);
          distinct.add(f, rank);
          ids[b * kFields + f] = feature_id(f, rank);
          truth[b] += true_weight(ids[b * kFields + f]);
        }
      }
      drawn.fetch_add(ids.size(), std::memory_order_relaxed);
      w.pull_rows("ids", ids, e);  // ids not stored pull their initial value
      w.pull("v", v);
      w.pull("bias", bias);

      std::fill(gv.begin(), gv.end(), 0.0f);
      gbias[0] = 0.0f;
      for (std::size_t b = 0; b < kBatch; ++b) {
        float z = bias[0];
        for (std::size_t j = b * kFields; j < (b + 1) * kFields; ++j)
          for (std::size_t k = 0; k < kDim; ++k) z += e[j * kDim + k] * v[k];
        const bool click = rng() < 1.0 / (1.0 + std::exp(-static_cast<double>(truth[b])));
        window_loss += log_loss(z, click);
        window_true_loss += log_loss(truth[b], click);
        // d(mean loss)/d(logit); each row's gradient is err * v, v's the sum of err * e.
        const float err = (1.0f / (1.0f + std::exp(-z)) - (click ? 1.0f : 0.0f)) / kBatch;
        gbias[0] += err;
        for (std::size_t j = b * kFields; j < (b + 1) * kFields; ++j)
          for (std::size_t k = 0; k < kDim; ++k) {
            ge[j * kDim + k] = err * v[k];
            gv[k] += err * e[j * kDim + k];
          }
      }
      w.push_rows("ids", ids, ge);  // repeated ids are summed; ids not admitted change nothing
      w.push("v", gv);
      w.push("bias", gbias);
      w.step();

      if (!w.is_chief() || step % report_every != 0) continue;
      // The chief reports; the servers' counters are read while they serve.
      const auto now = std::chrono::steady_clock::now();
      const double secs = std::chrono::duration<double>(now - last_report).count();
      const std::uint64_t all_drawn = drawn.load(std::memory_order_relaxed);
      const double ids_per_s = static_cast<double>(all_drawn - last_drawn) / secs;
      last_report = now;
      last_drawn = all_drawn;
      const double examples = static_cast<double>(report_every * kBatch);
      last_loss = window_loss / examples;
      last_true_loss = window_true_loss / examples;
      if (first_loss < 0) first_loss = last_loss, first_true_loss = last_true_loss;
      window_loss = window_true_loss = 0;
      std::printf("step %5zu  %6.2fM distinct ids of %7.2fM drawn  %5.2fM ids/s  loss %.4f (true model %.4f, "
                  "excess %.4f)\n",
                  step, millions(distinct.count()), millions(all_drawn), ids_per_s / 1e6, last_loss, last_true_loss,
                  last_loss - last_true_loss);
      const std::vector<psx::TableStats> stats = ps.table_stats("ids");
      for (std::size_t s = 0; s < stats.size(); ++s) {
        const psx::TableStats& t = stats[s];
        peak_bytes = std::max(peak_bytes, t.bytes);
        std::printf("  server %zu: %5.2fM rows  %5.1f/%.0f MiB  %6.1f B/row (ideal %llu)  admitted %5.2fM  "
                    "refused %5.2fM  evicted ttl %5.2fM  memory %5.2fM\n",
                    s, millions(t.rows), mib(t.bytes), mib(kCapBytes), t.bytes_per_row(),
                    static_cast<unsigned long long>(t.ideal_row_bytes), millions(t.admitted), millions(t.refused),
                    millions(t.evicted_ttl), millions(t.evicted_memory));
      }
      std::fflush(stdout);
    }
  });

  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  psx::TableStats total;
  for (const psx::TableStats& t : ps.table_stats("ids")) {
    peak_bytes = std::max(peak_bytes, t.bytes);
    total += t;
  }
  std::printf("%llu ids drawn in %.1f s (%.2fM ids/s); most memory on a server %llu bytes, cap %llu\n",
              static_cast<unsigned long long>(drawn.load()), secs, static_cast<double>(drawn.load()) / secs / 1e6,
              static_cast<unsigned long long>(peak_bytes), static_cast<unsigned long long>(kCapBytes));
  std::printf("excess loss over the true model: %.4f in the first window, %.4f in the last\n",
              first_loss - first_true_loss, last_loss - last_true_loss);
  std::printf("final: %llu distinct ids, %llu rows stored, %llu evicted (ttl %llu, memory %llu), "
              "loss %.4f -> %.4f (%s)\n",
              static_cast<unsigned long long>(distinct.count()), static_cast<unsigned long long>(total.rows),
              static_cast<unsigned long long>(total.evicted_ttl + total.evicted_memory),
              static_cast<unsigned long long>(total.evicted_ttl), static_cast<unsigned long long>(total.evicted_memory),
              first_loss, last_loss, last_loss < first_loss ? "down" : "not down");
  if (peak_bytes > kCapBytes) {
    std::fprintf(stderr, "recsys: a server held %llu bytes, over its cap of %llu\n",
                 static_cast<unsigned long long>(peak_bytes), static_cast<unsigned long long>(kCapBytes));
    return 1;
  }
}

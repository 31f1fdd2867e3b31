// quickstart: trains a click model with one dense and one sparse variable on
// the embedded in-process cluster (2 servers, 4 workers, synchronous SGD).
//
// The data set is generated from known true parameters: an example has 16
// dense features x and an item id c in [0, 100), and is clicked with
// probability sigmoid(w* . x + e*[c] . x[0:8]). The model learns w (dense,
// [16]) and the item embeddings e (sparse, [100, 8]), and the run ends with
// the final loss and how close w and e came to w* and e*.
//
// The chief prints its progress (rate, ETA) and writes TensorBoard summaries
// every 250 steps: loss, learning rate, the global norm of its gradient,
// examples/s, and the servers' counters (bytes per server, staleness).
//
//   ./quickstart [steps] [logdir]     (logdir: $TMPDIR/psx-quickstart)
//   tensorboard --logdir <logdir>
#include <psx/psx.hpp>
#include <psx/summary.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <vector>

namespace {

constexpr std::size_t kFeatures = 16, kItems = 100, kDim = 8;
constexpr std::size_t kExamples = 200'000, kBatch = 256;

struct Dataset {
  std::vector<float> x;                // kExamples x kFeatures
  std::vector<std::uint64_t> item;     // kExamples
  std::vector<float> label;            // kExamples, 0 or 1
  std::vector<float> true_w, true_e;   // kFeatures, kItems x kDim
};

Dataset generate() {
  Dataset d;
  std::mt19937_64 rng(2026);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<std::uint64_t> items(0, kItems - 1);
  std::uniform_real_distribution<float> coin(0.0f, 1.0f);
  for (std::size_t i = 0; i < kFeatures; ++i) d.true_w.push_back(normal(rng));
  for (std::size_t i = 0; i < kItems * kDim; ++i) d.true_e.push_back(0.5f * normal(rng));
  d.x.resize(kExamples * kFeatures);
  for (float& v : d.x) v = normal(rng);
  for (std::size_t n = 0; n < kExamples; ++n) {
    const std::uint64_t c = items(rng);
    const float* x = &d.x[n * kFeatures];
    float logit = 0.0f;
    for (std::size_t i = 0; i < kFeatures; ++i) logit += d.true_w[i] * x[i];
    for (std::size_t k = 0; k < kDim; ++k) logit += d.true_e[c * kDim + k] * x[k];
    d.item.push_back(c);
    d.label.push_back(coin(rng) < 1.0f / (1.0f + std::exp(-logit)) ? 1.0f : 0.0f);
  }
  return d;
}

// Mean log loss of parameters (w, e) over the whole data set.
double mean_loss(const Dataset& d, const std::vector<float>& w, const std::vector<float>& e) {
  double total = 0;
  for (std::size_t n = 0; n < kExamples; ++n) {
    const float* x = &d.x[n * kFeatures];
    double logit = 0;
    for (std::size_t i = 0; i < kFeatures; ++i) logit += w[i] * x[i];
    for (std::size_t k = 0; k < kDim; ++k) logit += e[d.item[n] * kDim + k] * x[k];
    // log(1 + exp(-z)) for a click, log(1 + exp(z)) otherwise, computed stably.
    const double z = d.label[n] > 0.5f ? logit : -logit;
    total += z > 0 ? std::log1p(std::exp(-z)) : -z + std::log1p(std::exp(z));
  }
  return total / kExamples;
}

double relative_error(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  return std::sqrt(diff / norm);
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t steps = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 1500;
  const std::filesystem::path logdir =
      argc > 2 ? std::filesystem::path(argv[2]) : std::filesystem::temp_directory_path() / "psx-quickstart";
  const Dataset data = generate();

  // Synchronous SGD averaged over workers; the dense weights and the
  // embedding table are split by rows over both servers.
  using PS = psx::ParameterServer<psx::partition::RowRange, psx::sync::Synchronous, psx::optim::SGD>;
  PS ps({.num_servers = 2, .num_workers = 4}, {}, {psx::sync::Aggregate::mean}, {.lr = 2.0f});
  ps.declare(psx::dense("w", {kFeatures}));
  ps.declare(psx::sparse("item_embedding", kItems, kDim, psx::Initializer::normal(0.0f, 0.01f, 1)));

  std::printf("psx quickstart: %zu examples, 2 servers, 4 workers, %zu steps of %zu examples per worker\n",
              kExamples, steps, kBatch);
  const auto start = std::chrono::steady_clock::now();
  psx::SummaryWriter summaries(logdir);  // only the chief writes
  psx::summary::Progress progress(steps);

  ps.run([&](psx::Worker& worker) {
    const psx::ShardRange mine = worker.shard(kExamples);  // this worker's examples
    std::vector<float> w(kFeatures), gw(kFeatures);
    std::vector<std::uint64_t> ids(kBatch);
    std::vector<float> e(kBatch * kDim), ge(kBatch * kDim);
    double window_loss = 0;
    for (std::size_t step = 0; step < steps; ++step) {
      for (std::size_t b = 0; b < kBatch; ++b) ids[b] = data.item[mine[(step * kBatch + b) % mine.size()]];
      worker.pull("w", w);
      worker.pull_rows("item_embedding", ids, e);

      std::fill(gw.begin(), gw.end(), 0.0f);
      double loss = 0;
      for (std::size_t b = 0; b < kBatch; ++b) {
        const std::size_t n = mine[(step * kBatch + b) % mine.size()];
        const float* x = &data.x[n * kFeatures];
        float logit = 0.0f;
        for (std::size_t i = 0; i < kFeatures; ++i) logit += w[i] * x[i];
        for (std::size_t k = 0; k < kDim; ++k) logit += e[b * kDim + k] * x[k];
        const float p = 1.0f / (1.0f + std::exp(-logit));
        const float y = data.label[n];
        loss -= y * std::log(std::max(p, 1e-7f)) + (1 - y) * std::log(std::max(1 - p, 1e-7f));
        const float err = (p - y) / kBatch;  // d(mean loss)/d(logit)
        for (std::size_t i = 0; i < kFeatures; ++i) gw[i] += err * x[i];
        for (std::size_t k = 0; k < kDim; ++k) ge[b * kDim + k] = err * x[k];
      }
      worker.push("w", gw);
      worker.push_rows("item_embedding", ids, ge);  // repeated ids are summed
      worker.step();

      window_loss += loss / kBatch;
      if (worker.is_chief() && (step + 1) % 250 == 0) {
        progress.update(step + 1);
        const double examples_per_s = progress.rate() * static_cast<double>(kBatch * worker.num_workers());
        const auto at = static_cast<std::int64_t>(step + 1);
        summaries.scalar("loss", static_cast<float>(window_loss / 250), at);
        summaries.scalar("learning_rate", static_cast<float>(ps.optimizer().lr), at);
        summaries.scalar("gradient_global_norm", psx::global_norm({gw, ge}), at);
        summaries.scalar("examples_per_second", static_cast<float>(examples_per_s), at);
        psx::summary::write_server_stats(summaries, worker.server_stats(), at);  // bytes per server, staleness
        std::printf("loss %.4f  %9.0f examples/s  %s\n", window_loss / 250, examples_per_s,
                    progress.line().c_str());
        window_loss = 0;
      }
    }
  });

  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::vector<float> w = ps.read("w"), e = ps.read("item_embedding");
  std::printf("trained %zu examples in %.2f s (%.0f examples/s)\n", steps * kBatch * 4, secs,
              static_cast<double>(steps * kBatch * 4) / secs);
  std::printf("final loss on all examples %.4f (the true parameters reach %.4f)\n", mean_loss(data, w, e),
              mean_loss(data, data.true_w, data.true_e));
  std::printf("relative error of w:              %.3f\n", relative_error(w, data.true_w));
  std::printf("relative error of item_embedding: %.3f\n", relative_error(e, data.true_e));
  summaries.close();
  std::printf("TensorBoard summaries: %s (tensorboard --logdir %s)\n", summaries.path().c_str(), logdir.c_str());
}

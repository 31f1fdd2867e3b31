// psx-bench: trains a workload on every cell of a grid of partitioner x sync
// policy x transport x workers x servers and reports, per cell, throughput,
// traffic, step-time percentiles, staleness, server load balance and the
// time to reach a target loss. docs/bench.md has the flags and a sample run.
//
//   psx-bench --quick --out results      # ~1 minute on a 2-core machine
//   psx-bench --workload embedding --sync async,bsp --transport zmq --workers 1,2,4 --servers 1,2
//
// Workloads (generated deterministically, seeds fixed; labels drawn afresh
// at every visit of an example, from a per-worker stream, so the loss cannot
// fall below the generating model's own and memorizing the data set does
// not help):
//   mlp        a dense MLP (--mlp IN,HIDDEN...,CLASSES; ReLU; softmax
//              cross-entropy; one dense variable per weight matrix [in, out]
//              and per bias), on 32768 Gaussian inputs whose class is drawn
//              from the softmax of a hidden random linear teacher (logits of
//              standard deviation 5).
//   embedding  logistic regression on the sum of the embedding rows of
//              --ids Zipf(--zipf) ids per example (id = Zipf rank - 1, so the
//              hottest rows are the first ones, as in a vocabulary sorted by
//              frequency) from a --embedding ROWS,DIM sparse table, dotted
//              with a dense vector w, plus a bias b; 262144 id sets whose
//              label is drawn from Bernoulli(sigmoid(.)) of a hidden table
//              and vector of the same shapes. pull_rows/push_rows for the
//              table (repeated ids summed), one batched pull/push for w and
//              b, both in flight together.
// Every cell trains from the same initial values (counter-based
// initializers) with SGD (--lr per workload) and Aggregate::mean; worker w
// trains on examples w, w+N, w+2N, ... (Worker::shard), --batch per step.
//
// How each number is measured (all wall-clock, std::chrono::steady_clock):
//   train time   from the first worker's first step to the last worker's
//                end (max end - min start over workers); cluster start-up
//                and connection set-up are outside it.
//   examples/s   sum over workers of steps x batch / train time.
//   push, pull   ServerStats::bytes_in (gradient payload received) and
//   bytes/s      bytes_out (parameter payload answered), summed over servers,
//                / train time. Payload bytes, the same for both transports:
//                no wire headers.
//   step time    one worker's pull + compute + push + step() for one step,
//                compute including drawing the batch's labels (step() only
//                sends the clock; under a synchronous policy the wait for
//                the others is in the next pull); p50 and p99 by nearest
//                rank over every step of every worker.
//   staleness    ServerStats::staleness histograms summed over servers: mean
//                and max over every applied gradient, a worker's
//                contribution to an aggregated step counting as one (the
//                shard's version when applied minus the version the worker
//                had read; the last bucket, 63, means 63 or more and prints
//                ">=63"). "-" when no gradient was applied. The CSV also has
//                ServerStats::dropped (SyncReplicas' late gradients).
//   load         per server, bytes_in + bytes_out; the max over servers
//                divided by the mean over servers (1.00 = even; S = all on
//                one server of S).
//   loss         the chief's (worker 0's) batch loss, computed on the
//                parameters it pulled for that step, before its update, and
//                in expectation over the labels: the cross-entropy between
//                the generating model's distribution and the prediction, for
//                each input of the batch (training uses the drawn labels).
//                Its floor is the generating model's own loss, printed in
//                the header.
//                "final" = mean of its last 50 steps; time to target = the
//                time (from the train start) of the first chief step at which
//                the mean of its last 50 batch losses is <= --target-loss,
//                "-" if none. loss.csv/loss.png: the chief's steps in up to
//                60 groups of equal count, each plotted at its last step's
//                time with its mean loss.
// A cell that throws is reported as failed with the message, and so is one
// still running after --cell-timeout (its cluster is shut down); the sweep
// goes on. Exit status: 0 when every cell ran, 1 when one failed, 2 for a bad
// command line.
#include "grid.hpp"

#include <psx/psx.hpp>

#include <unistd.h>  // isatty

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using psx_bench::Entry;

double seconds_between(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }
double to_double(std::size_t n) { return static_cast<double>(n); }

// ---------------------------------------------------------------------------
// Flags

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Options {
  std::vector<std::string> workloads{"mlp", "embedding"};
  std::vector<std::string> partitions;  // keys; empty = all
  std::vector<std::string> syncs;
  std::vector<std::string> transports;
  std::vector<std::size_t> workers{1, 2, 4};
  std::vector<std::size_t> servers{1, 2};
  std::optional<std::size_t> steps;
  std::optional<double> seconds;
  std::optional<double> cell_timeout;
  std::vector<std::size_t> mlp{64, 128, 10};
  std::size_t emb_rows = 100000, emb_dim = 16, ids = 4;
  double zipf = 1.1;
  std::size_t batch = 64;
  std::size_t pipeline = 2;  // Worker::pipeline_pushes
  std::optional<double> target_mlp, target_embedding;
  std::optional<double> lr_mlp, lr_embedding;
  bool zmq_ipc = false;
  std::string out = "psx-bench-results";
  bool quick = false, smoke = false, list = false;
};

constexpr const char* kUsage = R"(usage: psx-bench [flags]
  --workload LIST     mlp,embedding (default: both)
  --partition LIST    rowrange,hash,roundrobin (default: all)
  --sync LIST         async,bsp,ssp1,ssp4,replicas2 (default: all)
  --transport LIST    inprocess,zmq (default: all)
  --workers LIST      worker counts (default 1,2,4)
  --servers LIST      server counts (default 1,2)
  --steps N           steps per worker per cell
  --seconds X         seconds per cell (default 2; give --steps or --seconds)
  --cell-timeout X    a cell still running after X s is shut down and
                      reported as failed (default 30 + 5 x --seconds, or
                      600 with --steps)
  --target-loss SPEC  X for every workload, or mlp=X,embedding=Y
                      (default mlp=0.7,embedding=0.45)
  --lr SPEC           SGD learning rate, X or mlp=X,embedding=Y
                      (default mlp=0.1,embedding=0.02)
  --mlp SIZES         layer sizes IN,HIDDEN...,CLASSES (default 64,128,10)
  --embedding R,D     embedding table rows,dim (default 100000,16)
  --ids K             ids per example (default 4)
  --zipf S            Zipf exponent of the ids (default 1.1)
  --batch N           examples per worker per step (default 64)
  --pipeline N        pushes each worker leaves unacknowledged
                      (Worker::pipeline_pushes; default 2, 0: each waits)
  --zmq tcp|ipc       Zmq sockets: tcp on 127.0.0.1 (default) or ipc
  --out DIR           where psx-bench.csv, loss.csv, loss.gp, loss.png go
                      (default psx-bench-results)
  --quick             every partitioner, sync policy and transport with 2
                      workers, 2 servers, 1 s per cell (~1 minute on 2 cores)
  --smoke             4 cells of 0.5 s on small models (the ctest)
  --list              print the compiled grid and exit
  --help              this text
)";

std::vector<std::string> split(std::string_view s, char sep = ',') {
  std::vector<std::string> out;
  std::size_t begin = 0;
  while (true) {
    const std::size_t end = s.find(sep, begin);
    out.emplace_back(s.substr(begin, end - begin));
    if (end == std::string_view::npos) break;
    begin = end + 1;
  }
  return out;
}

std::size_t parse_count(std::string_view flag, std::string_view s, std::size_t min = 1) {
  std::size_t v = 0;
  const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size() || v < min)
    throw UsageError(std::string(flag) + ": expected an integer >= " + std::to_string(min) + ", got '" +
                     std::string(s) + "'");
  return v;
}

double parse_positive(std::string_view flag, std::string_view s) {
  std::string str(s);
  char* end = nullptr;
  const double v = std::strtod(str.c_str(), &end);
  if (str.empty() || end != str.c_str() + str.size() || !(v > 0) || !std::isfinite(v))
    throw UsageError(std::string(flag) + ": expected a positive number, got '" + str + "'");
  return v;
}

std::vector<std::size_t> parse_counts(std::string_view flag, std::string_view s) {
  std::vector<std::size_t> out;
  for (const std::string& part : split(s)) out.push_back(parse_count(flag, part));
  return out;
}

std::vector<std::string> parse_keys(std::string_view flag, std::string_view s,
                                    const std::vector<std::string_view>& allowed) {
  std::vector<std::string> out;
  for (const std::string& part : split(s)) {
    if (std::find(allowed.begin(), allowed.end(), part) == allowed.end()) {
      std::string list;
      for (auto a : allowed) list += (list.empty() ? "" : ", ") + std::string(a);
      throw UsageError(std::string(flag) + ": unknown '" + part + "' (one of: " + list + ")");
    }
    if (std::find(out.begin(), out.end(), part) == out.end()) out.push_back(part);
  }
  return out;
}

template <class Tuple>
std::vector<std::string_view> keys_of(const Tuple& t) {
  return std::apply([](auto... tag) { return std::vector<std::string_view>{tag.key...}; }, t);
}

// "X" (both workloads) or "mlp=X,embedding=Y" (either or both).
void per_workload(std::string_view flag, std::string_view v, std::optional<double>& mlp,
                  std::optional<double>& embedding) {
  if (v.find('=') == std::string_view::npos) {
    mlp = embedding = parse_positive(flag, v);
    return;
  }
  for (const std::string& part : split(v)) {
    const std::size_t eq = part.find('=');
    const std::string key = part.substr(0, eq);
    if (eq == std::string::npos || (key != "mlp" && key != "embedding"))
      throw UsageError(std::string(flag) + ": expected X or mlp=X,embedding=Y, got '" + std::string(v) + "'");
    (key == "mlp" ? mlp : embedding) = parse_positive(flag, part.substr(eq + 1));
  }
}

Options parse(int argc, char** argv) {
  Options o;
  bool seen_workers = false, seen_servers = false, seen_mlp = false, seen_embedding = false;
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    auto value = [&]() -> std::string_view {
      if (i + 1 >= argc) throw UsageError(std::string(flag) + ": missing value");
      return argv[++i];
    };
    if (flag == "--help" || flag == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (flag == "--workload") {
      o.workloads = parse_keys(flag, value(), {"mlp", "embedding"});
    } else if (flag == "--partition") {
      o.partitions = parse_keys(flag, value(), keys_of(psx_bench::partitioners));
    } else if (flag == "--sync") {
      o.syncs = parse_keys(flag, value(), keys_of(psx_bench::sync_policies));
    } else if (flag == "--transport") {
      o.transports = parse_keys(flag, value(), {"inprocess", "zmq"});
    } else if (flag == "--workers") {
      o.workers = parse_counts(flag, value());
      seen_workers = true;
    } else if (flag == "--servers") {
      o.servers = parse_counts(flag, value());
      seen_servers = true;
    } else if (flag == "--steps") {
      o.steps = parse_count(flag, value());
    } else if (flag == "--seconds") {
      o.seconds = parse_positive(flag, value());
    } else if (flag == "--cell-timeout") {
      o.cell_timeout = parse_positive(flag, value());
    } else if (flag == "--target-loss") {
      per_workload(flag, value(), o.target_mlp, o.target_embedding);
    } else if (flag == "--lr") {
      per_workload(flag, value(), o.lr_mlp, o.lr_embedding);
    } else if (flag == "--mlp") {
      o.mlp = parse_counts(flag, value());
      seen_mlp = true;
      if (o.mlp.size() < 2) throw UsageError("--mlp: expected at least IN,CLASSES");
      if (o.mlp.back() < 2) throw UsageError("--mlp: at least 2 classes");
    } else if (flag == "--embedding") {
      const std::vector<std::size_t> rd = parse_counts(flag, value());
      if (rd.size() != 2) throw UsageError("--embedding: expected ROWS,DIM");
      o.emb_rows = rd[0];
      o.emb_dim = rd[1];
      seen_embedding = true;
    } else if (flag == "--ids") {
      o.ids = parse_count(flag, value());
    } else if (flag == "--zipf") {
      o.zipf = parse_positive(flag, value());
    } else if (flag == "--batch") {
      o.batch = parse_count(flag, value());
    } else if (flag == "--pipeline") {
      o.pipeline = parse_count(flag, value(), 0);
    } else if (flag == "--zmq") {
      const std::string_view v = value();
      if (v != "tcp" && v != "ipc") throw UsageError("--zmq: expected tcp or ipc, got '" + std::string(v) + "'");
      o.zmq_ipc = v == "ipc";
    } else if (flag == "--out") {
      o.out = value();
      if (o.out.empty()) throw UsageError("--out: empty directory name");
    } else if (flag == "--quick") {
      o.quick = true;
    } else if (flag == "--smoke") {
      o.smoke = true;
    } else if (flag == "--list") {
      o.list = true;
    } else {
      throw UsageError("unknown flag '" + std::string(flag) + "'");
    }
  }
  if (o.quick && o.smoke) throw UsageError("--quick and --smoke: give one");
  if (o.steps && o.seconds) throw UsageError("--steps and --seconds: give one");
  // Presets fill in what the command line left unset.
  if (o.quick) {
    if (o.transports.empty()) o.transports = {"inprocess", "zmq"};
    if (!seen_workers) o.workers = {2};
    if (!seen_servers) o.servers = {2};
    if (!o.steps && !o.seconds) o.seconds = 1.0;
  }
  if (o.smoke) {
    if (!seen_mlp) o.mlp = {32, 32, 4};
    if (!seen_embedding) {
      o.emb_rows = 10000;
      o.emb_dim = 8;
    }
    if (!seen_workers) o.workers = {2};
    if (!seen_servers) o.servers = {2};
    if (!o.steps && !o.seconds) o.seconds = 0.5;
  }
  if (!o.steps && !o.seconds) o.seconds = 2.0;
  if (!o.cell_timeout) o.cell_timeout = o.steps ? 600.0 : 30.0 + 5.0 * *o.seconds;
  if (!o.target_mlp) o.target_mlp = 0.7;
  if (!o.target_embedding) o.target_embedding = 0.45;
  if (!o.lr_mlp) o.lr_mlp = 0.1;
  if (!o.lr_embedding) o.lr_embedding = 0.02;
  return o;
}

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

// ---------------------------------------------------------------------------
// Workloads

//! One worker's model state; `step` pulls, computes and pushes one batch and
//! returns the batch's mean loss.
class Trainer {
 public:
  virtual ~Trainer() = default;
  virtual double step(std::size_t t) = 0;
};

class Workload {
 public:
  virtual ~Workload() = default;
  virtual std::string_view key() const = 0;
  virtual std::string describe() const = 0;
  virtual std::vector<psx::VariableSpec> variables() const = 0;
  virtual std::unique_ptr<Trainer> trainer(psx::Worker& w) const = 0;
  double lr() const { return lr_; }
  std::size_t batch = 64;
  double target = 0;
  double lr_ = 0.1;
};

// Softmax cross-entropy of `logits` (rows of `classes`): leaves the gradient
// of the mean loss against the drawn `labels` in `logits` (what training
// uses), and returns the mean loss against the teacher's distributions
// (`cdfs`, cumulative), the expected loss over the labels (what is reported).
double softmax_cross_entropy(std::span<float> logits, std::span<const std::uint32_t> labels,
                             std::span<const float* const> cdfs, std::size_t classes) {
  const std::size_t batch = labels.size();
  double loss = 0;
  for (std::size_t b = 0; b < batch; ++b) {
    float* z = &logits[b * classes];
    const float top = *std::max_element(z, z + classes);
    double sum = 0;
    for (std::size_t c = 0; c < classes; ++c) sum += std::exp(static_cast<double>(z[c] - top));
    const double log_sum = std::log(sum);
    for (std::size_t c = 0; c < classes; ++c) {
      const double p = static_cast<double>(cdfs[b][c] - (c > 0 ? cdfs[b][c - 1] : 0.0f));
      loss += p * (log_sum - static_cast<double>(z[c] - top));  // p * -log q
    }
    for (std::size_t c = 0; c < classes; ++c)
      z[c] = static_cast<float>(std::exp(static_cast<double>(z[c] - top)) / sum / to_double(batch));
    z[labels[b]] -= 1.0f / static_cast<float>(batch);
  }
  return loss / to_double(batch);
}

class Mlp final : public Workload {
 public:
  static constexpr std::size_t kExamples = 32768;
  // The teacher's logits have this standard deviation: its own loss (the
  // floor) is then about 0.57 for 10 classes.
  static constexpr double kTeacherScale = 5.0;

  explicit Mlp(std::vector<std::size_t> sizes) : sizes_(std::move(sizes)) {
    const std::size_t in = sizes_.front(), classes = sizes_.back();
    std::mt19937_64 rng(2026);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> teacher(in * classes);
    for (float& v : teacher) v = normal(rng);
    x_.resize(kExamples * in);
    for (float& v : x_) v = normal(rng);
    cdf_.resize(kExamples * classes);
    std::vector<double> logit(classes);
    double entropy = 0;
    for (std::size_t n = 0; n < kExamples; ++n) {
      for (std::size_t c = 0; c < classes; ++c) {
        double z = 0;
        for (std::size_t i = 0; i < in; ++i) z += static_cast<double>(x_[n * in + i] * teacher[i * classes + c]);
        logit[c] = kTeacherScale * z / std::sqrt(to_double(in));
      }
      const double top = *std::max_element(logit.begin(), logit.end());
      double sum = 0;
      for (double z : logit) sum += std::exp(z - top);
      double cum = 0;
      for (std::size_t c = 0; c < classes; ++c) {
        const double p = std::exp(logit[c] - top) / sum;
        if (p > 0) entropy -= p * std::log(p);
        cum += p;
        cdf_[n * classes + c] = static_cast<float>(cum);
      }
      cdf_[n * classes + classes - 1] = 1.0f;
    }
    floor_ = entropy / to_double(kExamples);
  }

  std::string_view key() const override { return "mlp"; }
  std::string describe() const override {
    std::string s;
    for (std::size_t v : sizes_) s += (s.empty() ? "" : "-") + std::to_string(v);
    return "mlp " + s + " (ReLU, cross-entropy), " + std::to_string(kExamples) + " inputs, lr " +
           fixed(lr(), 2) + ", teacher's loss " + fixed(floor_, 3);
  }
  std::vector<psx::VariableSpec> variables() const override {
    std::vector<psx::VariableSpec> v;
    for (std::size_t l = 0; l + 1 < sizes_.size(); ++l) {
      // He initialization for ReLU layers.
      const float stddev = std::sqrt(2.0f / static_cast<float>(sizes_[l]));
      v.push_back(psx::dense(w_name(l), {sizes_[l], sizes_[l + 1]}, psx::Initializer::normal(0.0f, stddev, 7)));
      v.push_back(psx::dense(b_name(l), {sizes_[l + 1]}));
    }
    return v;
  }
  std::unique_ptr<Trainer> trainer(psx::Worker& w) const override { return std::make_unique<MlpTrainer>(*this, w); }

 private:
  static std::string w_name(std::size_t l) { return "layer" + std::to_string(l) + "/w"; }
  static std::string b_name(std::size_t l) { return "layer" + std::to_string(l) + "/b"; }

  class MlpTrainer final : public Trainer {
   public:
    MlpTrainer(const Mlp& m, psx::Worker& w) : m_(m), w_(w), mine_(w.shard(kExamples)), rng_(1000 + w.index()) {
      const std::size_t layers = m.sizes_.size() - 1, batch = m.batch;
      for (std::size_t l = 0; l < layers; ++l) {
        names_.push_back(w_name(l));
        names_.push_back(b_name(l));
        weights_.emplace_back(m.sizes_[l] * m.sizes_[l + 1]);
        weights_.emplace_back(m.sizes_[l + 1]);
      }
      grads_ = weights_;
      for (std::size_t k = 0; k < names_.size(); ++k) {
        pulls_.push_back({names_[k], weights_[k]});
        pushes_.push_back({names_[k], grads_[k]});
      }
      for (std::size_t size : m.sizes_) acts_.emplace_back(batch * size);
      deltas_ = acts_;
      labels_.resize(batch);
      cdfs_.resize(batch);
    }

    double step(std::size_t t) override {
      const std::vector<std::size_t>& sizes = m_.sizes_;
      const std::size_t batch = m_.batch, layers = sizes.size() - 1, in = sizes.front();
      w_.pull_async(std::span<const psx::PullItem>(pulls_)).wait();
      for (std::size_t b = 0; b < batch; ++b) {
        const std::size_t n = mine_[(t * batch + b) % mine_.size()];
        std::copy_n(&m_.x_[n * in], in, &acts_[0][b * in]);
        // A fresh draw from the teacher's distribution on every visit.
        const float* cdf = &m_.cdf_[n * sizes.back()];
        cdfs_[b] = cdf;
        labels_[b] = static_cast<std::uint32_t>(std::upper_bound(cdf, cdf + sizes.back() - 1, coin_(rng_)) - cdf);
      }
      // Forward: acts[l+1] = relu(acts[l] W_l + b_l), no ReLU on the logits.
      for (std::size_t l = 0; l < layers; ++l) {
        const std::size_t ni = sizes[l], no = sizes[l + 1];
        const std::vector<float>&W = weights_[2 * l], &bias = weights_[2 * l + 1];
        for (std::size_t b = 0; b < batch; ++b) {
          const float* a = &acts_[l][b * ni];
          float* z = &acts_[l + 1][b * no];
          std::copy(bias.begin(), bias.end(), z);
          for (std::size_t i = 0; i < ni; ++i) {
            if (a[i] == 0.0f) continue;
            const float ai = a[i];
            const float* row = &W[i * no];
            for (std::size_t o = 0; o < no; ++o) z[o] += ai * row[o];
          }
          if (l + 1 < layers)
            for (std::size_t o = 0; o < no; ++o) z[o] = std::max(z[o], 0.0f);
        }
      }
      // Backward: deltas[l+1] = d(loss)/d(pre-activation of layer l's output).
      std::copy(acts_[layers].begin(), acts_[layers].end(), deltas_[layers].begin());
      const double loss = softmax_cross_entropy(deltas_[layers], labels_, cdfs_, sizes.back());
      for (std::size_t l = layers; l-- > 0;) {
        const std::size_t ni = sizes[l], no = sizes[l + 1];
        std::vector<float>&gW = grads_[2 * l], &gb = grads_[2 * l + 1];
        const std::vector<float>& W = weights_[2 * l];
        std::fill(gW.begin(), gW.end(), 0.0f);
        std::fill(gb.begin(), gb.end(), 0.0f);
        for (std::size_t b = 0; b < batch; ++b) {
          const float* a = &acts_[l][b * ni];
          const float* d = &deltas_[l + 1][b * no];
          for (std::size_t o = 0; o < no; ++o) gb[o] += d[o];
          for (std::size_t i = 0; i < ni; ++i) {
            if (a[i] == 0.0f) continue;
            const float ai = a[i];
            float* g = &gW[i * no];
            for (std::size_t o = 0; o < no; ++o) g[o] += ai * d[o];
          }
          if (l == 0) continue;
          float* da = &deltas_[l][b * ni];
          for (std::size_t i = 0; i < ni; ++i) {
            if (a[i] == 0.0f) {  // ReLU was off (a = relu(z) = 0)
              da[i] = 0.0f;
              continue;
            }
            const float* row = &W[i * no];
            float s = 0;
            for (std::size_t o = 0; o < no; ++o) s += d[o] * row[o];
            da[i] = s;
          }
        }
      }
      w_.push(pushes_);  // returns once sent when pushes are pipelined
      return loss;
    }

   private:
    const Mlp& m_;
    psx::Worker& w_;
    psx::ShardRange mine_;
    std::vector<std::string> names_;
    std::vector<std::vector<float>> weights_, grads_, acts_, deltas_;
    std::vector<psx::PullItem> pulls_;
    std::vector<psx::PushItem> pushes_;
    std::vector<std::uint32_t> labels_;
    std::vector<const float*> cdfs_;  // the teacher's distribution of each example of the batch
    std::mt19937_64 rng_;
    std::uniform_real_distribution<float> coin_{0.0f, 1.0f};
  };

  std::vector<std::size_t> sizes_;
  std::vector<float> x_;
  std::vector<float> cdf_;  // kExamples x classes: the teacher's cumulative class probabilities
  double floor_ = 0;        // the teacher's own mean loss over the inputs
};

class Embedding final : public Workload {
 public:
  static constexpr std::size_t kExamples = 262144;

  Embedding(std::size_t rows, std::size_t dim, std::size_t ids, double zipf)
      : rows_(rows), dim_(dim), k_(ids), zipf_(zipf) {
    // Zipf(s) over ranks 1..rows: P(rank r) ~ r^-s; id = rank - 1.
    std::vector<double> cdf(rows);
    double total = 0;
    for (std::size_t r = 0; r < rows; ++r) cdf[r] = total += std::pow(to_double(r + 1), -zipf);
    std::mt19937_64 rng(2027);
    std::uniform_real_distribution<double> u(0.0, total);
    ids_.resize(kExamples * k_);
    for (auto& id : ids_)
      id = std::min<std::uint64_t>(static_cast<std::uint64_t>(std::lower_bound(cdf.begin(), cdf.end(), u(rng)) -
                                                              cdf.begin()),
                                   rows - 1);
    // The hidden model: logits with a standard deviation of about 2.
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const float scale = 2.0f / std::sqrt(static_cast<float>(dim_ * k_));
    std::vector<float> table(rows * dim_), w(dim_);
    for (float& v : table) v = scale * normal(rng);
    for (float& v : w) v = normal(rng);
    p_.resize(kExamples);
    double entropy = 0;
    for (std::size_t n = 0; n < kExamples; ++n) {
      double logit = 0;
      for (std::size_t j = 0; j < k_; ++j)
        for (std::size_t d = 0; d < dim_; ++d) logit += static_cast<double>(w[d] * table[ids_[n * k_ + j] * dim_ + d]);
      const double p = 1.0 / (1.0 + std::exp(-logit));
      if (p > 0 && p < 1) entropy -= p * std::log(p) + (1 - p) * std::log(1 - p);
      p_[n] = static_cast<float>(p);
    }
    floor_ = entropy / to_double(kExamples);
  }

  std::string_view key() const override { return "embedding"; }
  std::string describe() const override {
    return "embedding " + std::to_string(rows_) + "x" + std::to_string(dim_) + ", " + std::to_string(k_) +
           " Zipf(" + fixed(zipf_, 2) + ") ids per example (logistic), " + std::to_string(kExamples) +
           " id sets, lr " + fixed(lr(), 2) + ", hidden model's loss " + fixed(floor_, 3);
  }
  std::vector<psx::VariableSpec> variables() const override {
    return {psx::sparse("embedding", rows_, dim_, psx::Initializer::normal(0.0f, 0.01f, 11)),
            psx::dense("w", {dim_}, psx::Initializer::normal(0.0f, 0.5f, 12)), psx::dense("b", {1})};
  }
  std::unique_ptr<Trainer> trainer(psx::Worker& w) const override {
    return std::make_unique<EmbeddingTrainer>(*this, w);
  }

 private:
  class EmbeddingTrainer final : public Trainer {
   public:
    EmbeddingTrainer(const Embedding& e, psx::Worker& w)
        : e_(e),
          w_(w),
          mine_(w.shard(kExamples)),
          ids_(e.batch * e.k_),
          rows_(ids_.size() * e.dim_),
          grows_(rows_.size()),
          wv_(e.dim_),
          gw_(e.dim_),
          b_(1),
          gb_(1),
          sum_(e.dim_),
          rng_(2000 + w.index()) {}

    double step(std::size_t t) override {
      const std::size_t batch = e_.batch, k = e_.k_, dim = e_.dim_;
      for (std::size_t b = 0; b < batch; ++b) {
        const std::size_t n = mine_[(t * batch + b) % mine_.size()];
        std::copy_n(&e_.ids_[n * k], k, &ids_[b * k]);
      }
      // Both pulls in flight at once; the same for the pushes.
      const psx::PullItem dense[] = {{"w", wv_}, {"b", b_}};
      psx::Handle h1 = w_.pull_async(dense);
      psx::Handle h2 = w_.pull_rows_async("embedding", ids_, rows_);
      h1.wait();
      h2.wait();
      std::fill(gw_.begin(), gw_.end(), 0.0f);
      gb_[0] = 0;
      double loss = 0;
      for (std::size_t b = 0; b < batch; ++b) {
        std::fill(sum_.begin(), sum_.end(), 0.0f);
        for (std::size_t j = 0; j < k; ++j)
          for (std::size_t d = 0; d < dim; ++d) sum_[d] += rows_[(b * k + j) * dim + d];
        float logit = b_[0];
        for (std::size_t d = 0; d < dim; ++d) logit += wv_[d] * sum_[d];
        const std::size_t n = mine_[(t * batch + b) % mine_.size()];
        const float p = e_.p_[n];
        const float y = coin_(rng_) < p ? 1.0f : 0.0f;  // a fresh draw on every visit
        // Reported: the expected log loss over the label, p * -log(q) +
        // (1 - p) * -log(1 - q) with q = sigmoid(logit), computed stably.
        auto softplus = [](double x) { return x > 0 ? x + std::log1p(std::exp(-x)) : std::log1p(std::exp(x)); };
        loss += static_cast<double>(p) * softplus(-logit) + static_cast<double>(1 - p) * softplus(logit);
        const float err = 1.0f / (1.0f + std::exp(-logit)) - y;  // d(loss)/d(logit)
        // w and b get the batch mean; each row its example's own gradient
        // (summed over the batch, not averaged: a row appears in few examples).
        for (std::size_t d = 0; d < dim; ++d) gw_[d] += err * sum_[d] / static_cast<float>(batch);
        gb_[0] += err / static_cast<float>(batch);
        for (std::size_t j = 0; j < k; ++j)
          for (std::size_t d = 0; d < dim; ++d) grows_[(b * k + j) * dim + d] = err * wv_[d];
      }
      const psx::PushItem grads[] = {{"w", gw_}, {"b", gb_}};
      // Pipelined (--pipeline), each returns once sent; else each waits.
      w_.push(grads);
      w_.push_rows("embedding", ids_, grows_);
      return loss / to_double(batch);
    }

   private:
    const Embedding& e_;
    psx::Worker& w_;
    psx::ShardRange mine_;
    std::vector<std::uint64_t> ids_;
    std::vector<float> rows_, grows_, wv_, gw_, b_, gb_, sum_;
    std::mt19937_64 rng_;
    std::uniform_real_distribution<float> coin_{0.0f, 1.0f};
  };

  std::size_t rows_, dim_, k_;
  double zipf_;
  std::vector<std::uint64_t> ids_;
  std::vector<float> p_;  // kExamples: the hidden model's probability of a 1
  double floor_ = 0;      // the hidden model's own mean loss over the id sets
};

// ---------------------------------------------------------------------------
// Cells

struct Cell {
  std::size_t id = 0;
  const Workload* workload = nullptr;
  const Entry* entry = nullptr;
  std::size_t workers = 1, servers = 1;

  std::string label() const {
    return std::string(workload->key()) + "/" + std::string(entry->partition) + "/" + std::string(entry->sync) + "/" +
           std::string(entry->transport) + "/w" + std::to_string(workers) + "/s" + std::to_string(servers);
  }
};

struct Result {
  bool ok = false;
  std::string message;
  double train_s = 0;
  std::size_t worker_steps = 0, examples = 0;
  double examples_per_s = 0, push_bps = 0, pull_bps = 0;
  double p50_ms = 0, p99_ms = 0;
  std::uint64_t applied = 0, dropped = 0;
  double stale_mean = 0;
  std::size_t stale_max = 0;
  double load = 0;
  std::optional<double> time_to_target;
  std::optional<double> final_loss;
  std::vector<std::pair<double, double>> series;  // (seconds, loss)
};

struct WorkerLog {
  Clock::time_point begin{}, end{};
  std::vector<float> step_ms;
  std::vector<std::pair<double, double>> losses;  // chief only: (seconds since train start, batch loss)
};

struct Budget {
  std::optional<std::size_t> steps;
  std::optional<double> seconds;
  double time_limit = 600;
  std::size_t pipeline = 0;  // Worker::pipeline_pushes
};

constexpr std::size_t kLossWindow = 50;
constexpr std::size_t kSeriesPoints = 60;

Result run_cell(const Cell& cell, const Budget& budget, bool zmq_ipc) {
  Result r;
  std::vector<WorkerLog> logs(cell.workers);
  std::atomic<Clock::rep> start{0};  // the first worker's first step; 0 = not yet
  std::atomic<bool> stop{false};
  const Workload& wl = *cell.workload;
  psx_bench::WorkerFn fn = [&](psx::Worker& w) {
    WorkerLog& log = logs[w.index()];
    w.pipeline_pushes(budget.pipeline);
    std::unique_ptr<Trainer> trainer = wl.trainer(w);
    log.begin = Clock::now();
    Clock::rep expected = 0;
    start.compare_exchange_strong(expected, log.begin.time_since_epoch().count());
    const Clock::time_point t_start{Clock::duration(start.load())};
    for (std::size_t t = 0;; ++t) {
      if (budget.steps ? t >= *budget.steps : stop.load(std::memory_order_relaxed)) break;
      const Clock::time_point t0 = Clock::now();
      const double loss = trainer->step(t);
      w.step();
      const Clock::time_point t1 = Clock::now();
      log.step_ms.push_back(static_cast<float>(seconds_between(t0, t1) * 1e3));
      if (w.is_chief()) log.losses.emplace_back(seconds_between(t_start, t1), loss);
      if (budget.seconds && seconds_between(t_start, t1) >= *budget.seconds) stop.store(true);
    }
    log.end = Clock::now();
  };
  psx_bench::ClusterSetup setup{cell.servers, cell.workers, wl.variables(), wl.lr(), zmq_ipc,
                                std::chrono::milliseconds(std::llround(budget.time_limit * 1e3))};
  std::vector<psx::ServerStats> stats;
  try {
    stats = cell.entry->run(setup, fn);
  } catch (const std::exception& e) {
    r.message = e.what();
    return r;
  } catch (...) {
    r.message = "a non-standard exception";
    return r;
  }
  r.ok = true;

  Clock::time_point begin = logs[0].begin, end = logs[0].end;
  std::vector<float> steps;
  for (const WorkerLog& log : logs) {
    begin = std::min(begin, log.begin);
    end = std::max(end, log.end);
    r.worker_steps += log.step_ms.size();
    steps.insert(steps.end(), log.step_ms.begin(), log.step_ms.end());
  }
  r.train_s = seconds_between(begin, end);
  r.examples = r.worker_steps * wl.batch;
  r.examples_per_s = to_double(r.examples) / r.train_s;
  if (!steps.empty()) {
    auto rank = [&](double q) {  // nearest rank
      const std::size_t k =
          std::min(steps.size() - 1, static_cast<std::size_t>(std::ceil(q * to_double(steps.size()))) - 1);
      std::nth_element(steps.begin(), steps.begin() + static_cast<std::ptrdiff_t>(k), steps.end());
      return static_cast<double>(steps[k]);
    };
    r.p50_ms = rank(0.50);
    r.p99_ms = rank(0.99);
  }

  std::uint64_t in = 0, out = 0, weighted = 0;
  double max_bytes = 0;
  for (const psx::ServerStats& s : stats) {
    in += s.bytes_in;
    out += s.bytes_out;
    r.dropped += s.dropped;
    max_bytes = std::max(max_bytes, static_cast<double>(s.bytes_in + s.bytes_out));
    for (std::size_t k = 0; k < s.staleness.size(); ++k) {
      r.applied += s.staleness[k];
      weighted += k * s.staleness[k];
      if (s.staleness[k] > 0) r.stale_max = std::max(r.stale_max, k);
    }
  }
  r.push_bps = static_cast<double>(in) / r.train_s;
  r.pull_bps = static_cast<double>(out) / r.train_s;
  r.stale_mean = r.applied ? static_cast<double>(weighted) / static_cast<double>(r.applied) : 0.0;
  const double mean_bytes = static_cast<double>(in + out) / to_double(stats.size());
  r.load = mean_bytes > 0 ? max_bytes / mean_bytes : 0.0;

  const auto& losses = logs[0].losses;
  double window = 0;
  for (std::size_t i = 0; i < losses.size(); ++i) {
    window += losses[i].second;
    if (i >= kLossWindow) window -= losses[i - kLossWindow].second;
    if (i + 1 >= kLossWindow && !r.time_to_target && window / kLossWindow <= wl.target)
      r.time_to_target = losses[i].first;
  }
  if (!losses.empty()) {
    const std::size_t n = std::min(kLossWindow, losses.size());
    double sum = 0;
    for (std::size_t i = losses.size() - n; i < losses.size(); ++i) sum += losses[i].second;
    r.final_loss = sum / to_double(n);
  }
  const std::size_t groups = std::min(kSeriesPoints, losses.size());
  for (std::size_t g = 0; g < groups; ++g) {
    const std::size_t a = g * losses.size() / groups, b = (g + 1) * losses.size() / groups;
    double sum = 0;
    for (std::size_t i = a; i < b; ++i) sum += losses[i].second;
    r.series.emplace_back(losses[b - 1].first, sum / to_double(b - a));
  }
  return r;
}

// ---------------------------------------------------------------------------
// Progress on stderr: a bar redrawn in place on a terminal, a line per cell otherwise.

std::string clock_text(double s) {
  const long t = std::lround(std::max(0.0, s));
  char buf[32];
  std::snprintf(buf, sizeof buf, "%ld:%02ld", t / 60, t % 60);
  return buf;
}

class Progress {
 public:
  explicit Progress(std::size_t total) : total_(total), tty_(::isatty(2) != 0), start_(Clock::now()) {}

  void begin(const Cell& c) {
    if (tty_) draw("running " + c.label());
  }
  void end(const Cell& c, const Result& r) {
    ++done_;
    if (tty_) {
      draw(done_ == total_ ? "done" : "");
      if (done_ == total_) std::fputc('\n', stderr);
    } else {
      char buf[160];
      if (r.ok)
        std::snprintf(buf, sizeof buf, "%.0f examples/s, p50 step %.3f ms, final loss %.3f", r.examples_per_s,
                      r.p50_ms, r.final_loss.value_or(NAN));
      std::fprintf(stderr, "psx-bench: [%zu/%zu] %s: %s (ETA %s)\n", done_, total_, c.label().c_str(),
                   r.ok ? buf : ("FAILED: " + r.message).c_str(), clock_text(eta()).c_str());
    }
    std::fflush(stderr);
  }

 private:
  double elapsed() const { return seconds_between(start_, Clock::now()); }
  double eta() const { return done_ ? elapsed() / to_double(done_) * to_double(total_ - done_) : 0.0; }

  void draw(const std::string& what) {
    constexpr std::size_t kWidth = 24;
    const std::size_t filled = total_ ? done_ * kWidth / total_ : kWidth;
    const double rate = done_ ? to_double(done_) / elapsed() : 0.0;
    std::fprintf(stderr, "\r\033[K[%s%s] %zu/%zu cells  %.2f cells/s  ETA %s  %s", std::string(filled, '#').c_str(),
                 std::string(kWidth - filled, '.').c_str(), done_, total_, rate,
                 done_ ? clock_text(eta()).c_str() : "?", what.c_str());
    std::fflush(stderr);
  }

  std::size_t total_, done_ = 0;
  bool tty_;
  Clock::time_point start_;
};

// ---------------------------------------------------------------------------
// Output

// Three significant digits without an exponent (step times, staleness).
std::string sig3(double v) {
  const double a = std::abs(v);
  return fixed(v, a >= 100 ? 0 : a >= 10 ? 1 : a >= 1 ? 2 : 3);
}

std::string stale_max_text(std::size_t k) {
  return k + 1 >= psx::staleness_buckets ? ">=" + std::to_string(k) : std::to_string(k);
}

void print_table(const std::vector<Cell>& cells, const std::vector<Result>& results) {
  const std::vector<std::string> head = {"#",       "workload",    "partition",  "sync",       "transport",
                                         "W",       "S",           "examples/s", "push MB/s",  "pull MB/s",
                                         "p50 ms",  "p99 ms",      "stale mean", "stale max",  "load",
                                         "target s", "final loss", "status"};
  // Left-aligned text columns; the rest are numbers, right-aligned.
  const std::vector<bool> left = {false, true,  true,  true,  true,  false, false, false, false,
                                  false, false, false, false, false, false, false, false, true};
  std::vector<std::vector<std::string>> rows;
  for (std::size_t i = 0; i < cells.size(); ++i) {
    const Cell& c = cells[i];
    const Result& r = results[i];
    std::vector<std::string> row = {std::to_string(c.id),      std::string(c.workload->key()),
                                    std::string(c.entry->partition), std::string(c.entry->sync),
                                    std::string(c.entry->transport), std::to_string(c.workers),
                                    std::to_string(c.servers)};
    if (r.ok) {
      row.insert(row.end(), {fixed(r.examples_per_s, 0), fixed(r.push_bps / 1e6, 2), fixed(r.pull_bps / 1e6, 2),
                             sig3(r.p50_ms), sig3(r.p99_ms), r.applied ? sig3(r.stale_mean) : "-",
                             r.applied ? stale_max_text(r.stale_max) : "-", fixed(r.load, 2),
                             r.time_to_target ? fixed(*r.time_to_target, 2) : "-",
                             r.final_loss ? fixed(*r.final_loss, 3) : "-", "ok"});
    } else {
      for (int k = 0; k < 10; ++k) row.emplace_back("-");
      std::string msg = r.message;
      std::replace(msg.begin(), msg.end(), '\n', ' ');
      row.push_back("FAILED: " + msg);
    }
    rows.push_back(std::move(row));
  }
  std::vector<std::size_t> width(head.size());
  for (std::size_t k = 0; k < head.size(); ++k) {
    width[k] = head[k].size();
    for (const auto& row : rows) width[k] = std::max(width[k], row[k].size());
  }
  auto line = [&](const std::vector<std::string>& row) {
    std::string s;
    for (std::size_t k = 0; k < row.size(); ++k) {
      const bool last = k + 1 == row.size();
      const std::size_t pad = width[k] - row[k].size();
      if (left[k]) s += row[k] + (last ? "" : std::string(pad, ' '));
      else s += std::string(pad, ' ') + row[k];
      if (!last) s += "  ";
    }
    std::printf("%s\n", s.c_str());
  };
  line(head);
  std::size_t total = 0;
  for (std::size_t w : width) total += w + 2;
  std::printf("%s\n", std::string(total - 2, '-').c_str());
  for (const auto& row : rows) line(row);
}

std::string csv_field(std::string s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string q = "\"";
  for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
  return q + "\"";
}

std::string num(double v) {
  std::ostringstream os;
  os.precision(6);
  os << v;
  return os.str();
}

void write_csv(const fs::path& path, const std::vector<Cell>& cells, const std::vector<Result>& results) {
  std::ofstream f(path);
  f << "cell,workload,partition,sync,transport,workers,servers,status,train_time_s,worker_steps,examples,"
       "examples_per_s,push_bytes_per_s,pull_bytes_per_s,step_p50_ms,step_p99_ms,gradients_applied,"
       "dropped_gradients,staleness_mean_updates,staleness_max_updates,load_max_over_mean,target_loss,"
       "time_to_target_s,final_loss,message\n";
  for (std::size_t i = 0; i < cells.size(); ++i) {
    const Cell& c = cells[i];
    const Result& r = results[i];
    f << c.id << ',' << c.workload->key() << ',' << c.entry->partition << ',' << csv_field(std::string(c.entry->sync))
      << ',' << c.entry->transport << ',' << c.workers << ',' << c.servers << ',' << (r.ok ? "ok" : "failed");
    if (r.ok) {
      f << ',' << num(r.train_s) << ',' << r.worker_steps << ',' << r.examples << ',' << num(r.examples_per_s) << ','
        << num(r.push_bps) << ',' << num(r.pull_bps) << ',' << num(r.p50_ms) << ',' << num(r.p99_ms) << ','
        << r.applied << ',' << r.dropped << ',' << (r.applied ? num(r.stale_mean) : "") << ','
        << (r.applied ? std::to_string(r.stale_max) : "") << ',' << num(r.load) << ',' << num(c.workload->target)
        << ',' << (r.time_to_target ? num(*r.time_to_target) : "") << ','
        << (r.final_loss ? num(*r.final_loss) : "") << ",\n";
    } else {
      f << ",,,,,,,,,,,,,," << num(c.workload->target) << ",,," << csv_field(r.message) << '\n';
    }
  }
  if (!f) throw std::runtime_error("psx-bench: cannot write " + path.string());
}

void write_loss_csv(const fs::path& path, const std::vector<Cell>& cells, const std::vector<Result>& results) {
  std::ofstream f(path);
  f << "cell,seconds,loss\n";
  for (std::size_t i = 0; i < cells.size(); ++i)
    for (const auto& [t, loss] : results[i].series) f << cells[i].label() << ',' << num(t) << ',' << num(loss) << '\n';
  if (!f) throw std::runtime_error("psx-bench: cannot write " + path.string());
}

// A gnuplot single-quoted string ('' is a quote inside one).
std::string gp_quote(std::string_view s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("''") : std::string(1, c);
  return q + "'";
}

// The gnuplot script: one panel per workload, one line per cell, the target
// loss dashed. Reads loss.csv and writes loss.png in its own directory.
void write_gnuplot(const fs::path& path, const std::vector<const Workload*>& workloads, const std::vector<Cell>& cells,
                   const std::vector<Result>& results) {
  std::ofstream f(path);
  f << "# psx-bench: training loss vs time, one line per cell. Run in this directory:\n"
       "#   gnuplot loss.gp   (reads loss.csv, writes loss.png)\n"
       "set terminal pngcairo size 1500,"
    << 560 * workloads.size()
    << " noenhanced font ',9'\n"
       "set output 'loss.png'\n"
       "set datafile separator ','\n"
       "set xlabel 'seconds since the first worker started'\n"
       "set ylabel \"chief's batch loss (mean of a group of steps)\"\n"
       "set grid\n"
       "set key outside right top font ',8'\n"
       "set multiplot layout "
    << workloads.size() << ",1\n";
  for (const Workload* wl : workloads) {
    std::vector<std::string> lines;
    std::size_t k = 0;
    for (std::size_t i = 0; i < cells.size(); ++i) {
      if (cells[i].workload != wl || results[i].series.empty()) continue;
      const std::string label = cells[i].label();
      lines.push_back("'loss.csv' skip 1 using 2:(strcol(1) eq \"" + label + "\" ? $3 : NaN) with lines lw 1.5 lc " +
                      std::to_string(k % 10 + 1) + " dt " + std::to_string(k / 10 % 4 + 1) + " title " + gp_quote(label));
      ++k;
    }
    const bool key = lines.size() <= 40;
    f << "set title " << gp_quote(wl->describe() + (key ? "" : " (key left out: too many lines; see loss.csv)"))
      << "\n"
      << (key ? "set key\n" : "unset key\n");
    lines.push_back(num(wl->target) + " with lines lc 'black' dt 3 title " + gp_quote("target " + num(wl->target)));
    f << "plot ";
    for (std::size_t i = 0; i < lines.size(); ++i) f << (i ? ", \\\n     " : "") << lines[i];
    f << "\n";
  }
  f << "unset multiplot\n";
  if (!f) throw std::runtime_error("psx-bench: cannot write " + path.string());
}

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  try {
    opt = parse(argc, argv);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "psx-bench: %s\n(psx-bench --help lists the flags)\n", e.what());
    return 2;
  }

  std::vector<Entry> entries = psx_bench::inprocess_entries();
#ifdef PSX_BENCH_ZMQ
  const std::vector<Entry> zmq = psx_bench::zmq_entries();
  entries.insert(entries.end(), zmq.begin(), zmq.end());
#endif
  if (opt.list) {
    std::printf("psx-bench grid (compiled in; optimizer SGD):\n");
    for (const Entry& e : entries)
      std::printf("  %-10s %-20s %-9s   --partition %s --sync %s --transport %s\n", std::string(e.partition).c_str(),
                  std::string(e.sync).c_str(), std::string(e.transport).c_str(),
                  std::string(e.partition_key).c_str(), std::string(e.sync_key).c_str(),
                  std::string(e.transport_key).c_str());
    return 0;
  }
#ifndef PSX_BENCH_ZMQ
  if (std::find(opt.transports.begin(), opt.transports.end(), "zmq") != opt.transports.end()) {
    std::fprintf(stderr, "psx-bench: --transport zmq: this psx-bench was built without psx::zmq\n");
    return 2;
  }
#endif

  // The workloads, generated once and shared (read-only) by every cell.
  std::vector<std::unique_ptr<Workload>> workloads;
  for (const std::string& key : opt.workloads) {
    if (key == "mlp") workloads.push_back(std::make_unique<Mlp>(opt.mlp));
    else workloads.push_back(std::make_unique<Embedding>(opt.emb_rows, opt.emb_dim, opt.ids, opt.zipf));
    workloads.back()->batch = opt.batch;
    workloads.back()->target = key == "mlp" ? *opt.target_mlp : *opt.target_embedding;
    workloads.back()->lr_ = key == "mlp" ? *opt.lr_mlp : *opt.lr_embedding;
  }

  // The grid, in the order of the flags' lists; --smoke picks four cells.
  auto wanted = [](const std::vector<std::string>& keys, std::string_view key) {
    return keys.empty() || std::find(keys.begin(), keys.end(), key) != keys.end();
  };
  std::vector<Cell> cells;
  std::size_t left_out = 0;
  std::string left_out_why;
  auto add = [&](const Workload* wl, const Entry& e, std::size_t w, std::size_t s) {
    if (w < e.min_workers) {
      ++left_out;
      left_out_why = std::string(e.sync) + " needs at least " + std::to_string(e.min_workers) + " workers";
      return;
    }
    cells.push_back({cells.size() + 1, wl, &e, w, s});
  };
  if (opt.smoke) {
    const std::pair<std::string_view, std::string_view> picks[] = {
        {"rowrange", "bsp"}, {"hash", "async"}, {"roundrobin", "ssp1"}, {"rowrange", "replicas2"}};
    for (std::size_t k = 0; k < std::size(picks); ++k) {
      const Workload* wl = workloads[k % workloads.size()].get();
      const std::string_view transport = k % 2 ? "zmq" : "inprocess";
      for (const Entry& e : entries)
        if (e.partition_key == picks[k].first && e.sync_key == picks[k].second && e.transport_key == transport)
          add(wl, e, opt.workers.front(), opt.servers.front());
    }
    if (cells.empty()) add(workloads.front().get(), entries.front(), opt.workers.front(), opt.servers.front());
  } else {
    for (const auto& wl : workloads)
      for (const Entry& e : entries)
        if (wanted(opt.partitions, e.partition_key) && wanted(opt.syncs, e.sync_key) &&
            wanted(opt.transports, e.transport_key))
          for (std::size_t w : opt.workers)
            for (std::size_t s : opt.servers) add(wl.get(), e, w, s);
  }
  if (cells.empty()) {
    std::fprintf(stderr, "psx-bench: no cells to run%s\n", left_out ? (" (" + left_out_why + ")").c_str() : "");
    return 2;
  }

  std::error_code ec;
  fs::create_directories(opt.out, ec);
  if (ec) {
    std::fprintf(stderr, "psx-bench: --out %s: %s\n", opt.out.c_str(), ec.message().c_str());
    return 2;
  }

  const Budget budget{opt.steps, opt.seconds, *opt.cell_timeout, opt.pipeline};
  std::printf("psx-bench: %zu cells, %s per cell, batch %zu per worker, %u hardware threads, Zmq over %s\n",
              cells.size(),
              opt.steps ? (std::to_string(*opt.steps) + " steps per worker").c_str()
                        : (fixed(*opt.seconds, 2) + " s").c_str(),
              opt.batch, std::thread::hardware_concurrency(), opt.zmq_ipc ? "ipc" : "tcp 127.0.0.1");
  for (const auto& wl : workloads)
    std::printf("  %s; target loss %s\n", wl->describe().c_str(), num(wl->target).c_str());
  if (left_out) std::printf("  %zu cells left out: %s\n", left_out, left_out_why.c_str());
  std::printf("\n");
  std::fflush(stdout);

  std::vector<Result> results;
  Progress progress(cells.size());
  const Clock::time_point sweep_start = Clock::now();
  for (const Cell& c : cells) {
    progress.begin(c);
    results.push_back(run_cell(c, budget, opt.zmq_ipc));
    progress.end(c, results.back());
  }
  const double sweep_s = seconds_between(sweep_start, Clock::now());

  print_table(cells, results);
  std::size_t failed = 0;
  for (const Result& r : results) failed += !r.ok;

  const fs::path dir(opt.out);
  bool png = false;
  std::string plot_note;
  try {
    write_csv(dir / "psx-bench.csv", cells, results);
    write_loss_csv(dir / "loss.csv", cells, results);
    std::vector<const Workload*> plotted;
    for (const auto& wl : workloads) plotted.push_back(wl.get());
    write_gnuplot(dir / "loss.gp", plotted, cells, results);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    plot_note = "gnuplot not found: wrote " + (dir / "loss.gp").string() + "; run `gnuplot loss.gp` there for loss.png";
  } else {
    fs::remove(dir / "loss.png", ec);
    const std::string cmd = "cd " + shell_quote(dir.string()) + " && gnuplot loss.gp";
    if (std::system(cmd.c_str()) == 0 && fs::exists(dir / "loss.png")) png = true;
    else plot_note = "gnuplot failed on " + (dir / "loss.gp").string() + "; no loss.png";
  }
  std::printf("\nsweep: %.1f s wall; %zu failed\n", sweep_s, failed);
  if (!plot_note.empty()) std::printf("psx-bench: %s\n", plot_note.c_str());
  // The last line (the ctest matches it): cells, failures, what was written.
  std::printf("psx-bench: %zu cells%s, table/CSV%s written to %s\n", cells.size(),
              failed ? (", " + std::to_string(failed) + " failed").c_str() : "", png ? "/PNG" : "",
              dir.string().c_str());
  return failed ? 1 : 0;
}

// export_int8: trains a small classifier on the in-process cluster, saving a
// checkpoint every 50 steps, exports it with int8 weights (one scale per
// output channel), loads the export back and compares its accuracy on
// held-out data with the float32 model's.
//
//   ./export_int8 [steps] [work_dir]     (work_dir/checkpoints, work_dir/export)
//
// The data: 10 classes, each a Gaussian blob around its own random centre
// in 32 dimensions. The model: 32 -> 64 (ReLU) -> 10, weights stored
// [out, in], so each row of a kernel is one output channel.
#include <psx/export.hpp>
#include <psx/psx.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr std::size_t kIn = 32, kHidden = 64, kClasses = 10, kBatch = 64;

struct Data {
  std::vector<float> x;  // n x kIn
  std::vector<int> y;
  std::size_t size() const { return y.size(); }
};

Data make_data(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 centres_rng(7);  // the same classes for every split
  std::normal_distribution<float> unit(0.0f, 1.0f);
  std::vector<float> centres(kClasses * kIn);
  for (float& c : centres) c = unit(centres_rng);
  std::mt19937_64 rng(seed);
  Data d;
  for (std::size_t i = 0; i < n; ++i) {
    const int label = static_cast<int>(rng() % kClasses);
    d.y.push_back(label);
    for (std::size_t k = 0; k < kIn; ++k) d.x.push_back(centres[label * kIn + k] + 1.8f * unit(rng));
  }
  return d;
}

struct Model {
  std::vector<float> w1, b1, w2, b2;
};

// Logits of example `x`; `h` gets the hidden activations.
void forward(const Model& m, const float* x, std::vector<float>& h, std::vector<float>& logits) {
  for (std::size_t j = 0; j < kHidden; ++j) {
    float a = m.b1[j];
    for (std::size_t k = 0; k < kIn; ++k) a += m.w1[j * kIn + k] * x[k];
    h[j] = std::max(a, 0.0f);
  }
  for (std::size_t c = 0; c < kClasses; ++c) {
    float a = m.b2[c];
    for (std::size_t j = 0; j < kHidden; ++j) a += m.w2[c * kHidden + j] * h[j];
    logits[c] = a;
  }
}

double accuracy(const Model& m, const Data& d) {
  std::vector<float> h(kHidden), logits(kClasses);
  std::size_t right = 0;
  for (std::size_t i = 0; i < d.size(); ++i) {
    forward(m, &d.x[i * kIn], h, logits);
    right += static_cast<int>(std::max_element(logits.begin(), logits.end()) - logits.begin()) == d.y[i];
  }
  return static_cast<double>(right) / static_cast<double>(d.size());
}

// Mean softmax cross-entropy gradient over a batch, into `g` (same layout as the model).
void gradient(const Model& m, const Data& d, const std::vector<std::size_t>& batch, Model& g) {
  for (auto* v : {&g.w1, &g.b1, &g.w2, &g.b2}) std::fill(v->begin(), v->end(), 0.0f);
  std::vector<float> h(kHidden), logits(kClasses), dh(kHidden);
  const float inv = 1.0f / static_cast<float>(batch.size());
  for (const std::size_t i : batch) {
    const float* x = &d.x[i * kIn];
    forward(m, x, h, logits);
    const float top = *std::max_element(logits.begin(), logits.end());
    float z = 0.0f;
    for (float& l : logits) z += (l = std::exp(l - top));
    std::fill(dh.begin(), dh.end(), 0.0f);
    for (std::size_t c = 0; c < kClasses; ++c) {
      const float dl = (logits[c] / z - (static_cast<int>(c) == d.y[i] ? 1.0f : 0.0f)) * inv;
      g.b2[c] += dl;
      for (std::size_t j = 0; j < kHidden; ++j) {
        g.w2[c * kHidden + j] += dl * h[j];
        dh[j] += dl * m.w2[c * kHidden + j];
      }
    }
    for (std::size_t j = 0; j < kHidden; ++j) {
      if (h[j] <= 0.0f) continue;
      g.b1[j] += dh[j];
      for (std::size_t k = 0; k < kIn; ++k) g.w1[j * kIn + k] += dh[j] * x[k];
    }
  }
}

Model sized() {
  return {std::vector<float>(kHidden * kIn), std::vector<float>(kHidden), std::vector<float>(kClasses * kHidden),
          std::vector<float>(kClasses)};
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 400;
  const std::filesystem::path base =
      argc > 2 ? std::filesystem::path(argv[2]) : std::filesystem::temp_directory_path() / "psx-export-int8";
  std::filesystem::remove_all(base);
  const Data train = make_data(8000, 1), held_out = make_data(2000, 2);

  using Cluster = psx::ParameterServer<psx::partition::RoundRobin, psx::sync::Synchronous, psx::optim::Adam>;
  Cluster ps({2, 2}, {}, {}, {.lr = 0.01});
  ps.declare(psx::dense("dense1/kernel", {kHidden, kIn}, psx::Initializer::normal(0, 0.2f, 1)));
  ps.declare(psx::dense("dense1/bias", {kHidden}));
  ps.declare(psx::dense("dense2/kernel", {kClasses, kHidden}, psx::Initializer::normal(0, 0.15f, 2)));
  ps.declare(psx::dense("dense2/bias", {kClasses}));

  // A run that finds a checkpoint here resumes from it (this one starts fresh).
  psx::checkpoint::Manager<Cluster> ckpt(ps, {.directory = base / "checkpoints", .every_steps = 50, .max_to_keep = 2});
  std::filesystem::path exported;
  ps.run([&](psx::Worker& w) {
    Model m = sized(), g = sized();
    std::vector<std::size_t> batch(kBatch);
    for (std::uint64_t step = ckpt.restore_or_init(w); step < static_cast<std::uint64_t>(steps); ++step) {
      std::mt19937_64 rng(step * 16 + w.index());  // the batch of a step depends on the step alone
      w.pull({{"dense1/kernel", m.w1}, {"dense1/bias", m.b1}, {"dense2/kernel", m.w2}, {"dense2/bias", m.b2}});
      for (auto& i : batch) i = rng() % train.size();
      gradient(m, train, batch, g);
      w.push({{"dense1/kernel", g.w1}, {"dense1/bias", g.b1}, {"dense2/kernel", g.w2}, {"dense2/bias", g.b2}});
      w.step();
      ckpt.maybe_save(w);  // every worker calls it; the chief writes, the others wait
    }
    psx::ExportOptions options;
    options.base = base / "export";
    options.precision = psx::ExportPrecision::int8_per_channel;
    options.keep_float32 = {"*/bias"};
    options.signature = {.method = "predict",
                         .inputs = {{"x", "float32", {-1, static_cast<std::int64_t>(kIn)}}},
                         .outputs = {{"logits", "float32", {-1, static_cast<std::int64_t>(kClasses)}}}};
    const auto dir = psx::export_model(ps, w, options);
    if (w.is_chief()) exported = dir;
  });

  // The float32 model, as the servers hold it, and the int8 export, loaded back.
  const Model trained{ps.read("dense1/kernel"), ps.read("dense1/bias"), ps.read("dense2/kernel"), ps.read("dense2/bias")};
  const psx::Export e = psx::load_export(exported, {.dequantize = true});
  const Model int8{e["dense1/kernel"].to_float(), e["dense1/bias"].to_float(), e["dense2/kernel"].to_float(),
                   e["dense2/bias"].to_float()};
  const psx::Export raw = psx::load_export(exported);
  std::uintmax_t bytes = 0, float_bytes = 0;
  for (const auto& t : raw.tensors) {
    bytes += t.values.size() + t.scales.size() * sizeof(float);
    float_bytes += t.elements() * sizeof(float);
  }
  std::printf("exported %s (step %llu, %s weights: %ju bytes of tensors, %ju in float32)\n", exported.c_str(),
              static_cast<unsigned long long>(e.metadata.step), raw["dense1/kernel"].dtype.c_str(), bytes, float_bytes);
  std::printf("checkpoints kept:");
  for (const auto& c : ckpt.all()) std::printf(" %s", c.path.filename().c_str());
  std::printf("\nheld-out accuracy: float32 %.4f   int8 export %.4f\n", accuracy(trained, held_out),
              accuracy(int8, held_out));
}

// The golden checkpoints: every format psx ever wrote stays loadable.
//
// tests/checkpoint/golden/v<N>/ holds a tiny checkpoint written by the psx
// whose newest format was N: 2 servers, RowRange, one worker, Adam, three
// variables (a dense [3, 4] float32, a sparse [6, 2], a dense [5] bfloat16),
// three steps with the fixed gradients below. The test restores it into 3
// servers and checks parameters and Adam's slots bit for bit against the
// same three steps applied here by direct calls of the optimizer, the
// manifest's fields, and that training on from it equals a fourth direct step.
//
// A directory is written once and never again. A new format version gets a
// new directory next to the old ones, which stay (they prove this psx still
// reads them); the test checks v1 up to the newest:
//
//   PSX_WRITE_GOLDEN=$PWD/tests/checkpoint/golden/v2 build/dev/tests/psx_tests -tc='*golden*'
//
// With PSX_WRITE_GOLDEN set, the test writes the checkpoint of the current
// format there (refusing a directory that has one) and checks it the same
// way; without it, it only reads.
#include <psx/checkpoint.hpp>
#include <psx/psx.hpp>

#include "../support.hpp"

#include <doctest/doctest.h>

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#ifndef PSX_GOLDEN_DIR
#error "PSX_GOLDEN_DIR must name tests/checkpoint/golden"
#endif

namespace {

namespace fs = std::filesystem;

const psx::optim::Adam kAdam{.lr = 0.05};
constexpr std::uint64_t kSteps = 3;
constexpr std::size_t kEmbRows = 6, kEmbDim = 2;

// The fixed gradients of step t (1-based), all exact in float32.
std::vector<float> grad_w(std::uint64_t t) {
  std::vector<float> g(12);
  for (std::size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>(static_cast<int>((i * 5 + t * 3) % 11) - 5) * 0.125f;
  return g;
}
std::vector<float> grad_h(std::uint64_t t) {
  std::vector<float> g(5);
  for (std::size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>(static_cast<int>((i + 2 * t) % 5) - 2) * 0.5f;
  return g;
}
std::vector<std::uint64_t> emb_ids(std::uint64_t t) {  // distinct in each step; rows 2 and 3 never pushed
  const std::vector<std::vector<std::uint64_t>> ids = {{1, 4}, {4, 0}, {5, 1}, {0, 3}};
  return ids[t - 1];
}
std::vector<float> grad_emb(std::uint64_t t) {
  std::vector<float> g(2 * kEmbDim);
  for (std::size_t j = 0; j < g.size(); ++j) g[j] = static_cast<float>(static_cast<int>((j * 3 + t) % 7) - 3) * 0.25f;
  return g;
}

using Cluster = psx::ParameterServer<psx::partition::RowRange, psx::sync::Synchronous, psx::optim::Adam>;

void declare(Cluster& ps) {
  ps.declare(psx::dense("w", {3, 4}, psx::Initializer::constant(0.5f)));
  ps.declare(psx::sparse("emb", kEmbRows, kEmbDim, psx::Initializer::constant(-0.25f)));
  psx::VariableSpec h = psx::dense("h", {5}, psx::Initializer::constant(1.0f));
  h.dtype = psx::DType::bfloat16;
  ps.declare(h);
}

void train_step(psx::Worker& w) {
  const std::uint64_t t = w.clock() + 1;
  w.push("w", grad_w(t));
  w.push_rows("emb", emb_ids(t), grad_emb(t));
  w.push("h", grad_h(t));
  w.step();
}

// One variable updated by direct calls of Adam, slots as a server lays them
// out (m, then v), independent of any cluster or file.
struct Direct {
  std::vector<float> w, m, v;
  explicit Direct(std::vector<float> init) : w(std::move(init)), m(w.size(), 0.0f), v(w.size(), 0.0f) {}
  void dense(std::span<const float> g, std::uint64_t t) {
    float* bases[] = {m.data(), v.data()};
    kAdam.update(w, g, psx::SlotView(bases, 2, 0, w.size()), psx::UpdateContext{t, 1.0, nullptr, t, false});
  }
  void rows(std::span<const std::uint64_t> ids, std::span<const float> g, std::uint64_t t) {
    float* bases[] = {m.data(), v.data()};
    for (std::size_t j = 0; j < ids.size(); ++j)
      kAdam.update(std::span(w).subspan(ids[j] * kEmbDim, kEmbDim), g.subspan(j * kEmbDim, kEmbDim),
                   psx::SlotView(bases, 2, ids[j] * kEmbDim, kEmbDim), psx::UpdateContext{t, 1.0, nullptr, t, true});
  }
  std::vector<float> slots() const {
    std::vector<float> s(m);
    s.insert(s.end(), v.begin(), v.end());
    return s;
  }
};

struct Expected {
  Direct w{std::vector<float>(12, 0.5f)};
  Direct emb{std::vector<float>(kEmbRows * kEmbDim, -0.25f)};
  Direct h{std::vector<float>(5, 1.0f)};
  explicit Expected(std::uint64_t steps) {
    for (std::uint64_t t = 1; t <= steps; ++t) {
      w.dense(grad_w(t), t);
      emb.rows(emb_ids(t), grad_emb(t), t);
      h.dense(grad_h(t), t);
    }
  }
  const Direct& operator[](const std::string& name) const { return name == "w" ? w : name == "emb" ? emb : h; }
};

bool same_bits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
}

// Writes the golden checkpoint of the current format into `dir`, which
// has none yet: an old one is never overwritten.
void write_golden(const fs::path& dir) {
  REQUIRE_MESSAGE(!fs::exists(dir / "manifest.psx"), dir << " has a golden checkpoint already; it stays as it is");
  const fs::path root = fs::temp_directory_path() / ("psx-golden-" + std::to_string(::getpid()));
  fs::remove_all(root);
  Cluster ps({2, 1}, {}, {}, kAdam);
  declare(ps);
  ps.run([&](psx::Worker& w) {
    while (w.clock() < kSteps) train_step(w);
    psx::checkpoint::save(ps, w, root);
  });
  fs::create_directories(dir);
  for (const auto& e : fs::directory_iterator(root / psx::checkpoint::detail::checkpoint_dir_name(kSteps)))
    fs::copy_file(e.path(), dir / e.path().filename(), fs::copy_options::overwrite_existing);
  fs::remove_all(root);
  MESSAGE("wrote the golden checkpoint of format " << psx::checkpoint::format_version << " to " << dir);
}

void check_manifest(const fs::path& dir, std::uint32_t format) {
  const psx::checkpoint::Manifest m = psx::checkpoint::verify(dir);  // every file's CRCs and index too
  CHECK(m.format_version == format);
  CHECK(m.step == kSteps);
  CHECK(m.num_servers == 2);
  CHECK(m.num_workers == 1);
  CHECK(m.optimizer_slots == 2);
  CHECK(m.partitioner == "RowRange{min_rows=1}");
  CHECK(m.optimizer.find("Adam{lr=0.05") == 0);
  REQUIRE(m.variables.size() == 3);
  using Shards = std::vector<std::vector<std::uint64_t>>;  // server, row_begin, row_end
  auto check_variable = [](const psx::checkpoint::ManifestVariable& v, const std::string& name,
                           const std::vector<std::uint64_t>& shape, const std::string& kind, const std::string& dtype,
                           std::uint64_t row_width, const Shards& shards) {
    CAPTURE(name);
    CHECK(v.name == name);
    CHECK(v.shape == shape);
    CHECK(v.kind == kind);
    CHECK(v.dtype == dtype);
    CHECK(v.trainable);
    CHECK(v.row_width == row_width);
    REQUIRE(v.shards.size() == shards.size());
    for (std::size_t k = 0; k < shards.size(); ++k)
      CHECK(Shards::value_type{v.shards[k].server, v.shards[k].row_begin, v.shards[k].row_end} == shards[k]);
  };
  // RowRange on 2 servers: each variable in two halves, the first on server `id % 2`.
  check_variable(m.variables[0], "w", {3, 4}, "dense", "float32", 4, {{0, 0, 2}, {1, 2, 3}});
  check_variable(m.variables[1], "emb", {6, 2}, "sparse", "float32", 2, {{1, 0, 3}, {0, 3, 6}});
  check_variable(m.variables[2], "h", {5}, "dense", "bfloat16", 1, {{0, 0, 3}, {1, 3, 5}});
  REQUIRE(m.files.size() == 2);
  CHECK(m.files[0].name == "server-00000.psx");
  CHECK(m.files[1].name == "server-00001.psx");
}

// Restores the golden checkpoint in `dir` (format `format`) and checks it
// against the direct computation; reads only.
void check_golden(const fs::path& dir, std::uint32_t format) {
  REQUIRE_MESSAGE(fs::exists(dir / "manifest.psx"), "no golden checkpoint in " << dir << ": write the one of format "
                                                        << format << " with PSX_WRITE_GOLDEN (golden.cpp says how)");
  check_manifest(dir, format);
  const Expected expected(kSteps);
  for (const char* name : {"w", "emb", "h"}) {
    CAPTURE(name);
    const psx::checkpoint::Variable v = psx::checkpoint::load_variable(dir, name);
    CHECK(v.num_slots == 2);
    CHECK(v.version == kSteps);
    CHECK(same_bits(v.values, expected[name].w));
    CHECK(same_bits(v.slots, expected[name].slots()));
  }
  // Into another layout: 3 servers. Pulls return the saved parameters, and a
  // fourth step continues from the saved slots and update counts.
  Cluster ps({3, 1}, {}, {}, kAdam);
  declare(ps);
  ps.start();
  psx::Worker w = ps.worker(0);
  CHECK(psx::checkpoint::restore(ps, w, dir) == kSteps);
  CHECK(w.clock() == kSteps);
  for (const char* name : {"w", "emb", "h"}) {
    CAPTURE(name);
    CHECK(same_bits(ps.read(name), expected[name].w));
  }
  std::vector<psx::bfloat16> h16(5);
  w.pull("h", std::span(h16));
  for (std::size_t i = 0; i < h16.size(); ++i) CHECK(h16[i] == psx::bfloat16::from_float(expected.h.w[i]));
  train_step(w);
  const Expected next(kSteps + 1);
  for (const char* name : {"w", "emb", "h"}) {
    CAPTURE(name);
    CHECK(same_bits(ps.read(name), next[name].w));
  }
}

}  // namespace

TEST_CASE("checkpoint: the golden checkpoint of every format restores into 3 servers, bit for bit") {
  psx_test::Watchdog dog("golden checkpoints");
  if (const char* out = std::getenv("PSX_WRITE_GOLDEN")) {
    write_golden(out);
    check_golden(out, psx::checkpoint::format_version);
    return;
  }
  // Format 1 up to the newest: each has its directory (see the top of this file).
  for (std::uint32_t format = 1; format <= psx::checkpoint::format_version; ++format) {
    CAPTURE(format);
    check_golden(fs::path(PSX_GOLDEN_DIR) / ("v" + std::to_string(format)), format);
  }
}

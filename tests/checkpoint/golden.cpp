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
// From format 2 on, also a dynamic table "tbl" (rows of 3 floats, admitted
// at the second push, a time to live of 1 step swept every step, a ring of
// 16 points a server): its rows, slots, last update and use, counters, and
// what its restored admission sketch and sweep do in the fourth step (ids
// pushed once before are admitted, a row of step 2 expires).
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

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
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

// The table (format 2 on): ids pushed at step t (1-based), and their gradients.
constexpr std::size_t kTblDim = 3;
constexpr float kTblInit = 0.125f;
std::vector<std::uint64_t> tbl_ids(std::uint64_t t) {
  const std::vector<std::vector<std::uint64_t>> ids = {{10, 11, 12}, {10, 11, 13}, {10, 14}, {12, 13, 15}};
  return ids[t - 1];
}
std::vector<float> grad_tbl(std::uint64_t t) {
  std::vector<float> g(tbl_ids(t).size() * kTblDim);
  for (std::size_t j = 0; j < g.size(); ++j) g[j] = static_cast<float>(static_cast<int>((j * 3 + t) % 5) - 2) * 0.25f;
  return g;
}
psx::TableOptions tbl_options() {
  psx::TableOptions o;
  o.admission = psx::Admission::after_pushes(2, 64, 2);
  o.ttl_steps = 1;
  o.ttl_sweep_steps = 1;
  o.memory_cap_bytes = 1 << 20;  // the rows' last use kept
  o.virtual_nodes = 16;
  o.stripes = 2;
  return o;
}

using Cluster = psx::ParameterServer<psx::partition::RowRange, psx::sync::Synchronous, psx::optim::Adam>;

void declare(Cluster& ps, std::uint32_t format) {
  ps.declare(psx::dense("w", {3, 4}, psx::Initializer::constant(0.5f)));
  ps.declare(psx::sparse("emb", kEmbRows, kEmbDim, psx::Initializer::constant(-0.25f)));
  psx::VariableSpec h = psx::dense("h", {5}, psx::Initializer::constant(1.0f));
  h.dtype = psx::DType::bfloat16;
  ps.declare(h);
  if (format >= 2) ps.declare(psx::embedding("tbl", kTblDim, psx::Initializer::constant(kTblInit), tbl_options()));
}

void train_step(psx::Worker& w, std::uint32_t format) {
  const std::uint64_t t = w.clock() + 1;
  w.push("w", grad_w(t));
  w.push_rows("emb", emb_ids(t), grad_emb(t));
  w.push("h", grad_h(t));
  if (format >= 2) w.push_rows("tbl", tbl_ids(t), grad_tbl(t));
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

// The table's rows as direct calls of Adam leave them: an id is stored at
// its second push (with its initial value and zero slots, then updated);
// a server that applied rows of the table in step t sweeps it when its
// sweep is due: its rows not updated for more than a step go, and the next
// sweep is due at t + 1. Restored into another ring, every server's next
// sweep is the earliest of the saved servers'.
struct DirectTable {
  psx::detail::HashRing ring{2, 16};  // the saved cluster's
  std::map<std::uint64_t, Direct> rows;
  std::map<std::uint64_t, unsigned> pushes;  // of ids not stored
  std::map<std::uint64_t, std::uint64_t> updated;
  std::vector<std::uint64_t> next_sweep = std::vector<std::uint64_t>(2, 0);
  void step(std::uint64_t t) {
    const auto ids = tbl_ids(t);
    const auto g = grad_tbl(t);
    std::vector<bool> applied(ring.servers(), false);
    for (std::size_t j = 0; j < ids.size(); ++j) {
      applied[ring.server(ids[j])] = true;
      if (!rows.count(ids[j]) && ++pushes[ids[j]] < 2) continue;
      pushes.erase(ids[j]);
      Direct& row = rows.try_emplace(ids[j], std::vector<float>(kTblDim, kTblInit)).first->second;
      float* bases[] = {row.m.data(), row.v.data()};
      kAdam.update(row.w, std::span<const float>(g).subspan(j * kTblDim, kTblDim),
                   psx::SlotView(bases, 2, 0, kTblDim), psx::UpdateContext{t, 1.0, nullptr, t, true});
      updated[ids[j]] = t;
    }
    for (std::size_t s = 0; s < applied.size(); ++s) {
      if (!applied[s] || t < next_sweep[s]) continue;
      std::erase_if(rows, [&](const auto& r) { return ring.server(r.first) == s && t - updated[r.first] > 1; });
      next_sweep[s] = t + 1;
    }
  }
  void restore_into(std::size_t servers) {
    ring = psx::detail::HashRing(servers, 16);
    next_sweep.assign(servers, *std::min_element(next_sweep.begin(), next_sweep.end()));
  }
};

struct Expected {
  Direct w{std::vector<float>(12, 0.5f)};
  Direct emb{std::vector<float>(kEmbRows * kEmbDim, -0.25f)};
  Direct h{std::vector<float>(5, 1.0f)};
  DirectTable tbl;
  explicit Expected(std::uint64_t steps) {
    for (std::uint64_t t = 1; t <= steps; ++t) {
      if (t == kSteps + 1) tbl.restore_into(3);  // the test's restore, into 3 servers
      w.dense(grad_w(t), t);
      emb.rows(emb_ids(t), grad_emb(t), t);
      h.dense(grad_h(t), t);
      tbl.step(t);
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
  declare(ps, psx::checkpoint::format_version);
  ps.run([&](psx::Worker& w) {
    while (w.clock() < kSteps) train_step(w, psx::checkpoint::format_version);
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
  REQUIRE(m.tables.size() == (format >= 2 ? 1u : 0u));
  if (format >= 2) {
    CHECK(m.tables[0].name == "tbl");
    CHECK(m.tables[0].dim == kTblDim);
    CHECK(m.tables[0].options == tbl_options());
  }
}

// The table of a golden checkpoint (format 2 on), read without a cluster.
void check_golden_table(const fs::path& dir) {
  const Expected expected(kSteps);
  const psx::checkpoint::Table t = psx::checkpoint::load_table(dir, "tbl");
  CHECK(t.num_slots == 2);
  REQUIRE(t.ids == std::vector<std::uint64_t>{10, 11});  // 12, 13, 14 pushed once
  REQUIRE(expected.tbl.rows.size() == 2);
  const std::size_t n = t.ids.size();
  for (std::size_t k = 0; k < n; ++k) {
    CAPTURE(t.ids[k]);
    const Direct& row = expected.tbl.rows.at(t.ids[k]);
    CHECK(same_bits(std::span(t.values).subspan(k * kTblDim, kTblDim), row.w));
    CHECK(same_bits(std::span(t.slots).subspan(k * kTblDim, kTblDim), row.m));
    CHECK(same_bits(std::span(t.slots).subspan((n + k) * kTblDim, kTblDim), row.v));
  }
  CHECK(t.updated == std::vector<std::uint64_t>{3, 2});
  CHECK(t.used == std::vector<std::uint64_t>{3, 2});
  REQUIRE(t.parts.size() == 2);
  std::uint64_t admitted = 0, refused = 0, rows = 0;
  for (const auto& p : t.parts) {
    admitted += p.state.admitted;
    refused += p.state.refused;
    rows += p.state.rows;
    CHECK(p.state.sketch_width == 64);
    CHECK(p.state.sketch_depth == 2);
    CHECK(p.state.next_sweep == expected.tbl.next_sweep[p.server]);
    CHECK(p.state.layout.size() == 4);  // 2 stripes
  }
  CHECK(admitted == 2);
  CHECK(refused == 5);  // 10, 11, 12 at step 1, 13 at 2, 14 at 3
  CHECK(rows == 2);
}

// Restores the golden checkpoint in `dir` (format `format`) and checks it
// against the direct computation; reads only.
void check_golden(const fs::path& dir, std::uint32_t format) {
  REQUIRE_MESSAGE(fs::exists(dir / "manifest.psx"), "no golden checkpoint in " << dir << ": write the one of format "
                                                        << format << " with PSX_WRITE_GOLDEN (golden.cpp says how)");
  check_manifest(dir, format);
  if (format >= 2) check_golden_table(dir);
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
  declare(ps, format);
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
  train_step(w, format);
  const Expected next(kSteps + 1);
  for (const char* name : {"w", "emb", "h"}) {
    CAPTURE(name);
    CHECK(same_bits(ps.read(name), next[name].w));
  }
  if (format < 2) return;
  // 12 and 13, pushed once before the save, admitted at their second push
  // (the sketch restored into 3 servers), 15 not; 11 expired where its
  // server swept (the sweep restored).
  const psx::TableExport e = ps.export_table("tbl");
  const auto rows = e.sorted();
  REQUIRE(next.tbl.rows.count(12) + next.tbl.rows.count(13) == 2);
  REQUIRE(next.tbl.rows.count(15) == 0);
  REQUIRE(rows.size() == next.tbl.rows.size());
  auto it = next.tbl.rows.begin();
  for (std::size_t k = 0; k < rows.size(); ++k, ++it) {
    CAPTURE(rows[k].first);
    CHECK(rows[k].first == it->first);
    CHECK(same_bits(rows[k].second, it->second.w));
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

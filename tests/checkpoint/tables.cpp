// Dynamic tables in checkpoints (psx/checkpoint/tables.hpp, and
// DynamicTable's Restorer in psx/embedding.hpp): rows, slots, admission
// and eviction state saved by every server; restored into the same servers
// bit for bit (memory layout and sketch included), into another number of
// servers with every row once on the server the new ring names; a
// recommender job resumed from a checkpoint equal to one that never
// stopped; every damage to a table's part named with its file and table.
#include <psx/checkpoint.hpp>
#include <psx/psx.hpp>

#include "../splitmix.hpp"
#include "../support.hpp"
#include "faults.hpp"
#include "gate.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using psx_test::message_of;
using psx_test::TempDir;
using psx_test::Watchdog;

namespace {

namespace cd = psx::checkpoint::detail;

std::uint64_t mix(std::uint64_t z) { return psx_test::Splitmix64{z}.next(); }

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

fs::path dir_of(const fs::path& root, std::uint64_t step) { return root / cd::checkpoint_dir_name(step); }

// Two checkpoints' copies of a table hold the same rows, slots and
// eviction state, bit for bit.
void check_same_rows(const psx::checkpoint::Table& a, const psx::checkpoint::Table& b) {
  CHECK(a.ids.size() == b.ids.size());
  CHECK(same_bits(a.ids, b.ids));
  CHECK(same_bits(a.values, b.values));
  CHECK(same_bits(a.slots, b.slots));
  CHECK(same_bits(a.updated, b.updated));
  CHECK(same_bits(a.used, b.used));
}

// Two parts of a table (one saved server's) hold the same state, sketch and memory layout.
void check_same_part(const psx::checkpoint::TablePart& a, const psx::checkpoint::TablePart& b) {
  CAPTURE(a.server);
  CHECK(a.server == b.server);
  CHECK(a.state.rows == b.state.rows);
  CHECK(a.state.shard_version == b.state.shard_version);
  CHECK(a.state.version == b.state.version);
  CHECK(a.state.next_sweep == b.state.next_sweep);
  CHECK(a.state.admitted == b.state.admitted);
  CHECK(a.state.refused == b.state.refused);
  CHECK(a.state.evicted_ttl == b.state.evicted_ttl);
  CHECK(a.state.evicted_memory == b.state.evicted_memory);
  CHECK(a.state.sketch_width == b.state.sketch_width);
  CHECK(a.state.sketch_depth == b.state.sketch_depth);
  CHECK(a.state.sketch_added == b.state.sketch_added);
  CHECK(a.state.layout == b.state.layout);
  CHECK(a.sketch == b.sketch);
}

// The sums of the parts' counters.
psx::TableStats counted(const psx::checkpoint::Table& t) {
  psx::TableStats s;
  for (const auto& p : t.parts) {
    s.rows += p.state.rows;
    s.admitted += p.state.admitted;
    s.refused += p.state.refused;
    s.evicted_ttl += p.state.evicted_ttl;
    s.evicted_memory += p.state.evicted_memory;
  }
  return s;
}

// -- a table trained by a few steps ---------------------------------------------------

using AdamPS = psx::ParameterServer<psx::partition::RoundRobin, psx::sync::Synchronous, psx::optim::Adam>;
const psx::optim::Adam kAdam{.lr = 0.05};
constexpr std::size_t kDim = 4;
constexpr std::size_t kWorkers = 2;
constexpr std::uint64_t kSaveStep = 10;

// Admitted at the second push, counted in a sketch large enough that an id
// pushed once counts 1 (collisions would raise it); rows not updated for 4
// steps expire; a cap that keeps the rows' last use, far above what they take.
psx::TableOptions table_options(std::uint32_t virtual_nodes = 1024, std::uint32_t sketch_width = 1u << 16) {
  psx::TableOptions o;
  o.admission = psx::Admission::after_pushes(2, sketch_width, 4);
  o.ttl_steps = 4;
  o.ttl_sweep_steps = 2;
  o.memory_cap_bytes = std::uint64_t{16} << 20;
  o.virtual_nodes = virtual_nodes;
  o.stripes = 8;
  return o;
}

void declare(AdamPS& ps, const psx::TableOptions& o) {
  ps.declare(psx::embedding("emb", kDim, psx::Initializer::uniform(-0.1f, 0.1f, 5), o));
  ps.declare(psx::dense("bias", {kDim}, psx::Initializer::constant(0.25f)));
}

// Worker w's ids at clock t: 48 of 600 ranks, hashed to 64-bit ids.
std::vector<std::uint64_t> stream_ids(std::size_t worker, std::uint64_t t) {
  std::vector<std::uint64_t> ids(48);
  for (std::size_t k = 0; k < ids.size(); ++k) ids[k] = mix(1 + mix(worker * 1000003 + t * 7919 + k) % 600);
  return ids;
}

// Ids the stream never draws.
std::vector<std::uint64_t> fresh_ids(std::uint64_t base, std::size_t n) {
  std::vector<std::uint64_t> ids(n);
  for (std::size_t k = 0; k < n; ++k) ids[k] = (std::uint64_t{1} << 62) + base + k;
  return ids;
}

// Gradients that depend on the rows pulled (a wrong restore shows).
void train_step(psx::Worker& w) {
  const std::vector<std::uint64_t> ids = stream_ids(w.index(), w.clock());
  std::vector<float> rows(ids.size() * kDim), bias(kDim);
  w.pull_rows("emb", ids, rows);
  w.pull("bias", bias);
  psx_test::Splitmix64 noise{w.index() * 31 + w.clock()};
  std::vector<float> g(rows.size()), gb(kDim);
  for (std::size_t i = 0; i < g.size(); ++i) g[i] = 0.5f * rows[i] + bias[i % kDim] + 0.125f * noise.uniform();
  for (std::size_t i = 0; i < kDim; ++i) gb[i] = 0.25f * bias[i] - 0.0625f;
  w.push_rows("emb", ids, g);
  w.push("bias", gb);
  w.step();
}

// One push of each id (a step of its own for every worker; the chief pushes).
void push_once(psx::Worker& w, const std::vector<std::uint64_t>& ids) {
  if (w.is_chief() && !ids.empty()) w.push_rows("emb", ids, std::vector<float>(ids.size() * kDim, 0.5f));
  w.step();
}

// Trains `servers` servers for kSaveStep steps (the probes pushed once in
// the last) and saves into `root`; returns the servers' table stats.
std::vector<psx::TableStats> train_and_save(std::size_t servers, const psx::TableOptions& o, const fs::path& root,
                                            const std::vector<std::uint64_t>& probes) {
  AdamPS ps({servers, kWorkers}, {}, {}, kAdam);
  declare(ps, o);
  ps.run([&](psx::Worker& w) {
    while (w.clock() + 1 < kSaveStep) train_step(w);
    push_once(w, probes);
    psx::checkpoint::save(ps, w, root);
  });
  return ps.table_stats("emb");
}

bool stored(const psx::TableExport& e, std::uint64_t id) { return std::find(e.ids.begin(), e.ids.end(), id) != e.ids.end(); }

// Saved by `from` servers (their ring of `from_nodes` points each),
// restored by `to` servers (`to_nodes`), saved again at once: the same
// rows, slots and eviction state, each row on the server the new ring
// names, the counters' sums kept, and the admission sketch moved with the
// rows (an id pushed once before the save is admitted at its next push).
void check_reshard(std::size_t from, std::uint32_t from_nodes, std::size_t to, std::uint32_t to_nodes) {
  Watchdog dog("reshard " + std::to_string(from) + " -> " + std::to_string(to));
  TempDir first("tables-from"), second("tables-to");
  const std::vector<std::uint64_t> probes = fresh_ids(0, 24), control = fresh_ids(1000, 24);
  train_and_save(from, table_options(from_nodes), first.path, probes);
  const psx::checkpoint::Table saved = psx::checkpoint::load_table(dir_of(first.path, kSaveStep), "emb");
  REQUIRE(saved.parts.size() == from);
  REQUIRE(saved.ids.size() > 100);
  CHECK(counted(saved).evicted_ttl > 0);  // the sweep ran: rows expired before the save
  CHECK(counted(saved).refused > 0);      // and ids waited for their second push
  for (const std::uint64_t id : probes) CHECK(!std::binary_search(saved.ids.begin(), saved.ids.end(), id));
  const psx::detail::HashRing old_ring(from, from_nodes);
  for (std::size_t k = 0; k < saved.ids.size(); ++k) CHECK(saved.server[k] == old_ring.server(saved.ids[k]));

  AdamPS ps({to, kWorkers}, {}, {}, kAdam);
  declare(ps, table_options(to_nodes));
  std::vector<psx::TableStats> restored;
  ps.run([&](psx::Worker& w) {
    CHECK(psx::checkpoint::restore(ps, w, dir_of(first.path, kSaveStep)) == kSaveStep);
    psx::checkpoint::save(ps, w, second.path);
    if (w.is_chief()) restored = ps.table_stats("emb");
    w.barrier();
    std::vector<std::uint64_t> once = probes;
    once.insert(once.end(), control.begin(), control.end());
    push_once(w, once);
  });
  const psx::checkpoint::Table again = psx::checkpoint::load_table(dir_of(second.path, kSaveStep), "emb");
  REQUIRE(again.parts.size() == to);
  check_same_rows(saved, again);
  const psx::detail::HashRing& ring = ps.variable("emb").ring;
  for (std::size_t k = 0; k < again.ids.size(); ++k) CHECK(again.server[k] == ring.server(again.ids[k]));
  std::uint64_t rows = 0;
  for (std::size_t s = 0; s < to; ++s) {
    CAPTURE(s);
    rows += restored[s].rows;
    CHECK(restored[s].rows == static_cast<std::uint64_t>(std::count(again.server.begin(), again.server.end(), s)));
  }
  CHECK(rows == saved.ids.size());
  const psx::TableStats a = counted(saved), b = counted(again);
  CHECK(a.admitted == b.admitted);
  CHECK(a.refused == b.refused);
  CHECK(a.evicted_ttl == b.evicted_ttl);
  CHECK(a.evicted_memory == b.evicted_memory);
  std::uint64_t version = 0;
  for (const auto& p : saved.parts) version = std::max(version, p.state.version);
  for (const auto& p : again.parts) CHECK(p.state.version >= version);
  // The sketch moved: probes admitted at their second push, ids pushed once refused.
  const psx::TableExport e = ps.export_table("emb");
  for (const std::uint64_t id : probes) CHECK(stored(e, id));
  for (const std::uint64_t id : control) CHECK(!stored(e, id));
}

}  // namespace

TEST_CASE("checkpoint tables: 1 server restores into 3, every row and slot once on the server the new ring names") {
  check_reshard(1, 1024, 3, 1024);
}

TEST_CASE("checkpoint tables: 3 servers restore into 2, every row and slot once on the server the new ring names") {
  check_reshard(3, 1024, 2, 1024);
}

TEST_CASE("checkpoint tables: 4 servers restore into 4 on a ring of other virtual_nodes, every row once where it names") {
  check_reshard(4, 1024, 4, 64);
}

TEST_CASE("checkpoint tables: into the same servers a table comes back whole: rows, counters, sketch, sweep and memory held") {
  Watchdog dog("same servers");
  TempDir first("tables-same"), second("tables-same-again");
  // A cap that evicts, then 6 steps of one id each, in which most rows
  // expire: the stripes hold index entries and chunks for more rows than
  // they have left, which the cap counts.
  psx::TableOptions o = table_options();
  o.admission = psx::Admission::after_pushes(2, 1024, 2, 2048);
  o.memory_cap_bytes = 12 << 10;
  o.stripes = 2;
  constexpr std::uint64_t kQuiet = 6, kStep = kSaveStep + kQuiet;
  std::vector<psx::TableStats> before, peak;
  {
    AdamPS ps({2, kWorkers}, {}, {}, kAdam);
    declare(ps, o);
    ps.run([&](psx::Worker& w) {
      while (w.clock() < kSaveStep) train_step(w);
      if (w.is_chief()) peak = ps.table_stats("emb");
      w.barrier();
      while (w.clock() < kStep) push_once(w, {w.clock()});
      psx::checkpoint::save(ps, w, first.path);
    });
    before = ps.table_stats("emb");
  }
  CHECK(before[0].evicted_memory + before[1].evicted_memory > 0);
  CHECK(before[0].rows + before[1].rows < (peak[0].rows + peak[1].rows) / 2);
  CHECK(before[0].bytes == peak[0].bytes);  // held, not given back
  const psx::checkpoint::Table saved = psx::checkpoint::load_table(dir_of(first.path, kStep), "emb");
  AdamPS ps({2, kWorkers}, {}, {}, kAdam);
  declare(ps, o);
  ps.run([&](psx::Worker& w) {
    psx::checkpoint::restore(ps, w, dir_of(first.path, kStep));
    psx::checkpoint::save(ps, w, second.path);
  });
  const psx::checkpoint::Table again = psx::checkpoint::load_table(dir_of(second.path, kStep), "emb");
  check_same_rows(saved, again);
  REQUIRE(again.parts.size() == 2);
  for (std::size_t s = 0; s < 2; ++s) check_same_part(saved.parts[s], again.parts[s]);
  // What the servers count is what they counted (the cap's memory too).
  const auto after = ps.table_stats("emb");
  for (std::size_t s = 0; s < 2; ++s) {
    CAPTURE(s);
    CHECK(after[s].rows == before[s].rows);
    CHECK(after[s].bytes == before[s].bytes);
    CHECK(after[s].admitted == before[s].admitted);
    CHECK(after[s].evicted_memory == before[s].evicted_memory);
  }
  CHECK(same_bits(psx::checkpoint::load_variable(dir_of(second.path, kStep), "bias").values,
                  psx::checkpoint::load_variable(dir_of(first.path, kStep), "bias").values));
}

TEST_CASE("checkpoint tables: a sketch of another width starts from zero, and a restore refuses older cursors") {
  Watchdog dog("other sketch");
  TempDir first("tables-sketch");
  const std::vector<std::uint64_t> probes = fresh_ids(0, 16);
  train_and_save(2, table_options(), first.path, probes);
  for (const std::uint32_t width : {1u << 16, 1u << 15}) {
    CAPTURE(width);
    AdamPS ps({2, kWorkers}, {}, {}, kAdam);
    declare(ps, table_options(1024, width));
    ps.start();
    const psx::TableExport before = ps.export_table("emb");
    ps.run([&](psx::Worker& w) {
      psx::checkpoint::restore(ps, w, dir_of(first.path, kSaveStep));
      push_once(w, probes);
    });
    const psx::TableExport e = ps.export_table("emb");
    // The same sketch: each probe's second push admits it; another: its first.
    for (const std::uint64_t id : probes) CHECK(stored(e, id) == (width == 1u << 16));
    CHECK(e.cursor.incarnation != before.cursor.incarnation);
    CHECK_THROWS_AS(ps.export_table("emb", before.cursor), psx::checkpoint_error);
  }
}

// -- exact resume: a recommender job ----------------------------------------------------

namespace {

// examples/recsys.cpp's shape, small: 4 fields of Zipf-like ids into one
// table (rows of 8 floats, Adagrad, admitted at the second push, a time to
// live, a memory cap that evicts, a sketch with a window), then dense
// layers: logit = b + v . relu(W h), h the sum of the fields' rows. The
// stream alternates 5 steps over 3000 ranks a field, which fill the table
// to its cap (least recently used rows evicted), with 5 over 60, in which
// the rows of the wide phase expire: the save comes at the end of a narrow
// phase, and the wide phase after it admits and evicts again. Each step
// also scores again, without training on them, the examples of two steps
// before (pulled, not pushed): their rows' last use is not their last
// update, and the cap evicts by use.
namespace rec {

using PS = psx::ParameterServer<psx::partition::RoundRobin, psx::sync::Synchronous, psx::optim::Adagrad>;
constexpr std::size_t kFields = 4, kDim = 8, kBatch = 24, kServers = 2;
constexpr std::uint64_t kSteps = 40, kSaveAt = 20;

psx::TableOptions options() {
  psx::TableOptions o;
  o.admission = psx::Admission::after_pushes(2, 4096, 2, 4096);
  o.ttl_steps = 4;
  o.ttl_sweep_steps = 3;
  o.memory_cap_bytes = 24 << 10;
  o.stripes = 4;
  return o;
}

void declare(PS& ps) {
  ps.declare(psx::embedding("ids", kDim, psx::Initializer::normal(0.0f, 0.05f, 11), options()));
  ps.declare(psx::dense("W", {kDim, kDim}, psx::Initializer::normal(0.0f, 0.3f, 12)));
  ps.declare(psx::dense("v", {kDim}, psx::Initializer::normal(0.0f, 0.3f, 13)));
  ps.declare(psx::dense("b", {1}));
}

// Example j of worker w at step t: field f's id, a rank drawn about as
// often as 1/rank over 3000 or 60, hashed; its label from a hidden truth.
std::uint64_t feature(std::size_t w, std::uint64_t t, std::size_t j, std::size_t f) {
  const double u = static_cast<double>(mix(((w * 977 + t) * 131 + j) * 17 + f) >> 11) * 0x1p-53;
  const double ranks = (t / 5) % 2 == 0 ? 3000.0 : 60.0;
  const auto rank = static_cast<std::uint64_t>(std::exp(u * std::log(ranks)));
  return mix((std::uint64_t{f} << 40) | rank);
}
bool label(const std::uint64_t* ids) {
  std::uint64_t h = 0;
  for (std::size_t f = 0; f < kFields; ++f) h += mix(ids[f] ^ 0x5eed) % 7;
  return h % 3 == 0;
}

void train_step(psx::Worker& w) {
  const std::uint64_t t = w.clock();
  std::vector<std::uint64_t> ids(kBatch * kFields);
  for (std::size_t j = 0; j < kBatch; ++j)
    for (std::size_t f = 0; f < kFields; ++f) ids[j * kFields + f] = feature(w.index(), t, j, f);
  std::vector<float> rows(ids.size() * kDim), W(kDim * kDim), v(kDim), b(1);
  std::vector<std::uint64_t> candidates(kBatch * kFields);
  const std::uint64_t before = t >= 2 ? t - 2 : t;
  for (std::size_t j = 0; j < kBatch; ++j)
    for (std::size_t f = 0; f < kFields; ++f) candidates[j * kFields + f] = feature(w.index(), before, j, f);
  std::vector<float> scored(candidates.size() * kDim);
  w.pull_rows("ids", candidates, scored);
  w.pull_rows("ids", ids, rows);
  w.pull("W", W);
  w.pull("v", v);
  w.pull("b", b);
  std::vector<float> g_rows(rows.size(), 0.0f), gW(W.size(), 0.0f), gv(kDim, 0.0f), gb(1, 0.0f);
  for (std::size_t j = 0; j < kBatch; ++j) {
    float h[kDim] = {}, z[kDim], a[kDim];
    for (std::size_t f = 0; f < kFields; ++f)
      for (std::size_t i = 0; i < kDim; ++i) h[i] += rows[(j * kFields + f) * kDim + i];
    float logit = b[0];
    for (std::size_t o = 0; o < kDim; ++o) {
      z[o] = 0.0f;
      for (std::size_t i = 0; i < kDim; ++i) z[o] += W[o * kDim + i] * h[i];
      a[o] = z[o] > 0.0f ? z[o] : 0.0f;
      logit += v[o] * a[o];
    }
    const float g = 1.0f / (1.0f + std::exp(-logit)) - (label(&ids[j * kFields]) ? 1.0f : 0.0f);
    gb[0] += g;
    float dh[kDim] = {};
    for (std::size_t o = 0; o < kDim; ++o) {
      gv[o] += g * a[o];
      const float dz = z[o] > 0.0f ? g * v[o] : 0.0f;
      for (std::size_t i = 0; i < kDim; ++i) {
        gW[o * kDim + i] += dz * h[i];
        dh[i] += dz * W[o * kDim + i];
      }
    }
    for (std::size_t f = 0; f < kFields; ++f)
      for (std::size_t i = 0; i < kDim; ++i) g_rows[(j * kFields + f) * kDim + i] = dh[i];
  }
  w.push_rows("ids", ids, g_rows);
  w.push("W", gW);
  w.push("v", gv);
  w.push("b", gb);
  w.step();
}

// Trains a new cluster up to `until` under a Manager saving every kSaveAt
// steps into `root` (restore_or_init resumes from its newest checkpoint);
// returns the table's stats at the end. `background`: the Manager saves in
// the background, and its writes wait (WriteGate) until 3 steps after
// each save began; `waited` counts the writes that waited.
std::vector<psx::TableStats> run(const fs::path& root, std::uint64_t until, std::uint64_t* resumed = nullptr,
                                 bool background = false, int* waited = nullptr) {
  PS ps({kServers, kWorkers}, {}, {}, psx::optim::Adagrad{.lr = 0.1});
  declare(ps);
  psx::CheckpointManager<PS> ckpt(
      ps, {.directory = root, .every_steps = kSaveAt, .max_to_keep = 0, .background = background});
  std::optional<psx_test::WriteGate> gate;
  if (background) gate.emplace();
  int writes = 0;  // the chief's: writes begun
  ps.run([&](psx::Worker& w) {
    const std::uint64_t from = ckpt.restore_or_init(w);
    if (resumed && w.is_chief()) *resumed = from;
    const bool gatekeeper = gate && w.is_chief();
    while (w.clock() < until) {
      train_step(w);
      if (gatekeeper && w.clock() % kSaveAt == 0) gate->close();  // before the chief begins a save
      if (gatekeeper && w.clock() % kSaveAt == 3) gate->open_when_waited(writes);
      if (ckpt.maybe_save(w) && gatekeeper) writes += static_cast<int>(kServers);
    }
    if (gatekeeper) gate->open_when_waited(writes);
    ckpt.finish(w);
  });
  if (waited && gate) *waited = gate->waited();
  return ps.table_stats("ids");
}

}  // namespace rec

}  // namespace

TEST_CASE("checkpoint tables: a recommender job killed after a save and resumed ends bit-identical to one that never stopped") {
  Watchdog dog("recsys resume", std::chrono::seconds(120));
  TempDir straight("recsys-straight"), halves("recsys-halves");
  const auto end_straight = rec::run(straight.path, rec::kSteps);
  std::uint64_t resumed = 99;
  const auto at_save = rec::run(halves.path, rec::kSaveAt, &resumed);  // then the cluster is gone
  CHECK(resumed == 0);
  const auto end_resumed = rec::run(halves.path, rec::kSteps, &resumed);
  CHECK(resumed == rec::kSaveAt);
  // Both halves evicted by age and by memory, and refused ids: the state
  // that decides those was restored, not only the rows.
  psx::TableStats first, second;
  for (std::size_t s = 0; s < rec::kServers; ++s) {
    first += at_save[s];
    second += end_resumed[s];
  }
  MESSAGE("at the save: " << first << "; at the end: " << second);
  CHECK(first.evicted_ttl > 0);
  CHECK(first.evicted_memory > 0);
  CHECK(second.evicted_ttl > first.evicted_ttl);
  CHECK(second.evicted_memory > first.evicted_memory);
  CHECK(second.refused > first.refused);
  CHECK(second.admitted > first.admitted);
  for (std::size_t s = 0; s < rec::kServers; ++s) {
    CAPTURE(s);
    CHECK(end_resumed[s].rows == end_straight[s].rows);
    CHECK(end_resumed[s].bytes == end_straight[s].bytes);
    CHECK(end_resumed[s].admitted == end_straight[s].admitted);
    CHECK(end_resumed[s].refused == end_straight[s].refused);
    CHECK(end_resumed[s].evicted_ttl == end_straight[s].evicted_ttl);
    CHECK(end_resumed[s].evicted_memory == end_straight[s].evicted_memory);
  }
  const fs::path a = dir_of(straight.path, rec::kSteps), b = dir_of(halves.path, rec::kSteps);
  for (const char* name : {"W", "v", "b"}) {
    CAPTURE(name);
    const auto x = psx::checkpoint::load_variable(a, name), y = psx::checkpoint::load_variable(b, name);
    CHECK(same_bits(x.values, y.values));
    CHECK(same_bits(x.slots, y.slots));
    CHECK(x.version == y.version);
  }
  const auto x = psx::checkpoint::load_table(a, "ids"), y = psx::checkpoint::load_table(b, "ids");
  REQUIRE(x.ids.size() > 100);
  check_same_rows(x, y);
  CHECK(same_bits(x.server, y.server));
  REQUIRE(x.parts.size() == y.parts.size());
  for (std::size_t s = 0; s < x.parts.size(); ++s) check_same_part(x.parts[s], y.parts[s]);
}

TEST_CASE("checkpoint tables: a recommender job saving in the background as it trains keeps the same checkpoints, and resumes bit-identical") {
  Watchdog dog("recsys background", std::chrono::seconds(120));
  TempDir stopping("recsys-stopping"), background("recsys-background");
  const auto end_stopping = rec::run(stopping.path, rec::kSteps);
  int waited = 0;
  const auto end_background = rec::run(background.path, rec::kSteps, nullptr, true, &waited);
  CHECK(waited == static_cast<int>(2 * rec::kServers));  // every save's writes waited while the job went on
  auto check_same = [](const fs::path& a, const fs::path& b) {
    for (const char* name : {"W", "v", "b"}) {
      CAPTURE(name);
      const auto x = psx::checkpoint::load_variable(a, name), y = psx::checkpoint::load_variable(b, name);
      CHECK(same_bits(x.values, y.values));
      CHECK(same_bits(x.slots, y.slots));
    }
    const auto x = psx::checkpoint::load_table(a, "ids"), y = psx::checkpoint::load_table(b, "ids");
    REQUIRE(x.ids.size() > 100);
    check_same_rows(x, y);
    REQUIRE(x.parts.size() == y.parts.size());
    for (std::size_t s = 0; s < x.parts.size(); ++s) check_same_part(x.parts[s], y.parts[s]);
  };
  // Each background checkpoint holds its step exactly, though the job
  // trained on (admitting, evicting, sweeping) while it was written.
  for (const std::uint64_t step : {rec::kSaveAt, rec::kSteps}) {
    CAPTURE(step);
    check_same(dir_of(stopping.path, step), dir_of(background.path, step));
  }
  for (std::size_t s = 0; s < rec::kServers; ++s) CHECK(end_background[s].rows == end_stopping[s].rows);
  // Resumed from the background one of the middle: the same end.
  fs::remove_all(dir_of(background.path, rec::kSteps));
  std::uint64_t resumed = 0;
  rec::run(background.path, rec::kSteps, &resumed, true);
  CHECK(resumed == rec::kSaveAt);
  check_same(dir_of(stopping.path, rec::kSteps), dir_of(background.path, rec::kSteps));
}

TEST_CASE("checkpoint tables: a row's last use moves with it and decides what a full table evicts after a restore") {
  // One stripe whose cap holds 24 rows (an index of 32 entries that may not
  // grow): each id beyond evicts the least recently used row.
  Watchdog dog("last use");
  TempDir root("tables-used");
  psx::TableOptions o;
  o.stripes = 1;
  o.memory_cap_bytes = psx::detail::table_minimum_bytes(kDim, 2, o);
  std::vector<std::uint64_t> first(24), pulled(12), fresh(12);
  for (std::uint64_t k = 0; k < 24; ++k) first[k] = 1 + k;
  for (std::uint64_t k = 0; k < 12; ++k) pulled[k] = 1 + k, fresh[k] = 101 + k;
  auto make = [&](AdamPS& ps) {
    ps.declare(psx::embedding("emb", kDim, psx::Initializer::constant(0.5f), o));
    ps.declare(psx::dense("bias", {kDim}));
  };
  {
    AdamPS ps({1, 1}, {}, {}, kAdam);
    make(ps);
    ps.run([&](psx::Worker& w) {
      push_once(w, first);  // all 24 stored, updated and used at step 1
      std::vector<float> rows(pulled.size() * kDim);
      w.pull_rows("emb", pulled, rows);  // the first 12 used at step 2, not updated
      w.step();
      psx::checkpoint::save(ps, w, root.path);
    });
  }
  const auto saved = psx::checkpoint::load_table(dir_of(root.path, 2), "emb");
  REQUIRE(saved.ids == first);
  CHECK(saved.updated == std::vector<std::uint64_t>(24, 1));
  AdamPS ps({1, 1}, {}, {}, kAdam);
  make(ps);
  ps.run([&](psx::Worker& w) {
    psx::checkpoint::restore(ps, w, dir_of(root.path, 2));
    push_once(w, fresh);  // 12 evictions: the rows last used at step 1
  });
  const psx::TableExport e = ps.export_table("emb");
  CHECK(e.ids.size() == 24);
  for (std::uint64_t k = 0; k < 24; ++k) CHECK(stored(e, first[k]) == (k < 12));
  for (const std::uint64_t id : fresh) CHECK(stored(e, id));
}

// -- damage ---------------------------------------------------------------------------------

namespace {

// A checkpoint of step kSaveStep by 2 servers, its table's parts in both files.
struct Saved {
  TempDir root{"tables-damage"};
  fs::path dir;
  Saved() {
    train_and_save(2, table_options(), root.path, {});
    dir = dir_of(root.path, kSaveStep);
  }
  // A copy to damage.
  fs::path copy(const std::string& name) const {
    const fs::path d = root.path / name;
    fs::remove_all(d);
    fs::copy(dir, d);
    return d;
  }
};

// Where the table's part of a shard file lies: its rows' and its sketch's
// first bytes, from the file's start.
struct PartAt {
  std::uint64_t rows, rows_bytes, sketch;
};
PartAt part_at(const fs::path& file) {
  const cd::Loaded f = cd::read_file(file);
  const cd::Header h = cd::decode_header(f.all(), f.size, cd::FileKind::shards, file);
  const cd::Index index = cd::decode_index(f.all().subspan(cd::header_bytes, h.meta_bytes), h.data_bytes, h.server, file);
  REQUIRE(index.tables.size() == 1);
  const std::uint64_t data = cd::header_bytes + h.meta_bytes;
  return {data + index.tables[0].rows_offset, index.tables[0].rows_bytes(), data + index.tables[0].sketch_offset};
}

void flip(const fs::path& file, std::uint64_t at) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(at));
  const char c = static_cast<char>(f.get());
  f.seekp(static_cast<std::streamoff>(at));
  f.put(static_cast<char>(c ^ 0x04));
}

// Restores `dir` into a new cluster of `servers` (the table declared with
// `o`): returns the chief's error; a refused restore changes nothing.
std::string restore_error(const fs::path& dir, std::size_t servers = 2, psx::TableOptions o = table_options(),
                          std::size_t dim = kDim) {
  AdamPS ps({servers, kWorkers}, {}, {}, kAdam);
  ps.declare(psx::embedding("emb", dim, psx::Initializer::uniform(-0.1f, 0.1f, 5), o));
  ps.declare(psx::dense("bias", {kDim}, psx::Initializer::constant(0.25f)));
  std::string message;
  ps.run([&](psx::Worker& w) {
    const std::vector<std::uint64_t> id = {7};
    if (w.is_chief()) w.push_rows("emb", id, std::vector<float>(dim, 1.0f));
    w.step();
    if (w.is_chief()) w.push_rows("emb", id, std::vector<float>(dim, 1.0f));
    w.step();  // id 7 stored, at its second push
    try {
      psx::checkpoint::restore(ps, w, dir);
    } catch (const psx::checkpoint_error& e) {
      if (w.is_chief()) message = e.what();
      CHECK(w.clock() == 2);
    }
  });
  const psx::TableExport e = ps.export_table("emb");
  CHECK(e.ids == std::vector<std::uint64_t>{7});
  CHECK(ps.read("bias") == std::vector<float>(kDim, 0.25f));
  return message;
}

}  // namespace

TEST_CASE("checkpoint tables: a damaged table part is named with its file and table, and changes nothing") {
  Watchdog dog("table damage", std::chrono::seconds(120));
  const Saved saved;
  const std::string file1 = cd::server_file_name(1);
  SUBCASE("a flipped bit in a row") {
    const fs::path d = saved.copy("rows");
    const PartAt at = part_at(d / file1);
    REQUIRE(at.rows_bytes > 100);
    flip(d / file1, at.rows + 50);
    const std::string expected = (d / file1).string() + ": dynamic table 'emb': corrupted rows (CRC-32C mismatch)";
    CHECK_MESSAGE(restore_error(d).find(expected) != std::string::npos, expected);
    CHECK_THROWS_WITH_AS(psx::checkpoint::verify(d), doctest::Contains(expected.c_str()), psx::checkpoint_error);
    CHECK_THROWS_WITH_AS(psx::checkpoint::load_table(d, "emb"), doctest::Contains(expected.c_str()), psx::checkpoint_error);
    // Into another number of servers (every server reads every file) too.
    CHECK(restore_error(d, 3).find(expected) != std::string::npos);
  }
  SUBCASE("a flipped bit in the admission sketch") {
    const fs::path d = saved.copy("sketch");
    flip(d / file1, part_at(d / file1).sketch + 1000);
    CHECK(restore_error(d).find(file1 + ": dynamic table 'emb': corrupted admission sketch (CRC-32C mismatch)") !=
          std::string::npos);
  }
  SUBCASE("a file cut inside the table's rows") {
    const fs::path d = saved.copy("cut");
    const PartAt at = part_at(d / file1);
    fs::resize_file(d / file1, at.rows + at.rows_bytes / 2);
    const std::string m = restore_error(d);
    CHECK(m.find(file1 + ": truncated: the header promises") != std::string::npos);
    CHECK(m.find("(it ends inside the rows of dynamic table 'emb')") != std::string::npos);
    CHECK_THROWS_WITH_AS(psx::checkpoint::verify(d), doctest::Contains("it ends inside the rows of dynamic table 'emb'"),
                         psx::checkpoint_error);
  }
  SUBCASE("a file from a newer psx") {
    const fs::path d = saved.copy("newer");
    cd::Loaded f = cd::read_file(d / file1);
    cd::Header h = cd::decode_header(f.all(), f.size, cd::FileKind::shards, d / file1);
    h.version = psx::checkpoint::format_version + 1;
    const auto bytes = cd::encode_header(h);
    std::fstream(d / file1, std::ios::in | std::ios::out | std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    const std::string expected = "written in checkpoint format " + std::to_string(psx::checkpoint::format_version + 1) +
                                 "; this psx reads formats 1 to " + std::to_string(psx::checkpoint::format_version) +
                                 " (a newer psx wrote it: upgrade psx to read it)";
    CHECK_MESSAGE(restore_error(d).find(expected) != std::string::npos, expected);
  }
  SUBCASE("an id in two servers' parts") {
    // Server 1's file written again with a row of server 0's in its part.
    const fs::path d = saved.copy("twice");
    const psx::checkpoint::Table t = psx::checkpoint::load_table(d, "emb");
    const auto first0 = std::find(t.server.begin(), t.server.end(), 0u) - t.server.begin();
    std::vector<std::size_t> rows1;
    for (std::size_t k = 0; k < t.ids.size(); ++k)
      if (t.server[k] == 1) rows1.push_back(k);
    rows1.push_back(static_cast<std::size_t>(first0));
    psx::VariableInfo info;
    info.meta.name = "emb";
    psx::detail::SavedTable part{&info, t.parts[1].state, t.parts[1].sketch, {}};
    part.state.rows = rows1.size();
    part.rows = [&](const std::function<void(std::span<const std::byte>)>& sink) {
      for (const std::size_t k : rows1) {
        std::vector<std::byte> row(psx::detail::table_row_bytes(kDim, 2));
        const std::uint64_t head[3] = {t.ids[k], t.updated[k], t.used[k]};
        std::memcpy(row.data(), head, sizeof head);
        std::memcpy(row.data() + sizeof head, &t.values[k * kDim], kDim * sizeof(float));
        for (std::size_t j = 0; j < 2; ++j)
          std::memcpy(row.data() + sizeof head + (1 + j) * kDim * sizeof(float), &t.slots[(j * t.ids.size() + k) * kDim],
                      kDim * sizeof(float));
        sink(row);
      }
    };
    const psx::checkpoint::Variable bias = psx::checkpoint::load_variable(d, "bias");
    psx::checkpoint::Manifest m = psx::checkpoint::read_manifest(d);
    REQUIRE(m.variables.size() == 1);
    // Round-robin put "bias" on server 1 (the table is declared first).
    REQUIRE(m.variables[0].shards.size() == 1);
    REQUIRE(m.variables[0].shards[0].server == 1);
    psx::VariableInfo bias_info;
    bias_info.meta.name = "bias";
    bias_info.meta.row_width = 1;
    bias_info.shards = {psx::Shard{1, 0, kDim}};
    const std::span<const float> slots(bias.slots);
    const psx::detail::SavedShard shard{&bias_info, 0, bias.version, bias.values, {slots.first(kDim), slots.subspan(kDim)}};
    cd::write_server_file({d.string(), kSaveStep, 1}, std::span(&shard, 1), std::span(&part, 1));
    std::uint64_t size = 0;
    const cd::Header h = cd::read_header(d / file1, cd::FileKind::shards, &size);
    m.files[1] = {file1, size, h.crc};
    cd::write_manifest(d, m);
    const std::string expected = "dynamic table 'emb': id " + std::to_string(t.ids[first0]) + " is saved twice";
    CHECK_THROWS_WITH_AS(psx::checkpoint::load_table(d, "emb"), doctest::Contains(expected.c_str()), psx::checkpoint_error);
    // One server reads both files; two read their own (the row of server 0 in
    // server 1's file is not server 1's: left out, and server 0 has it).
    CHECK_MESSAGE(restore_error(d, 1).find(file1 + ": " + expected) != std::string::npos, expected);
  }
  SUBCASE("rows beyond the memory cap of the servers restoring them") {
    psx::TableOptions small = table_options();
    small.memory_cap_bytes = psx::detail::table_minimum_bytes(kDim, 2, small);
    const std::string m = restore_error(saved.dir, 1, small);
    CHECK(m.find("dynamic table 'emb' on server 0: its restored rows need") != std::string::npos);
    CHECK(m.find("raise memory_cap_bytes or restore into more servers") != std::string::npos);
  }
  SUBCASE("a table of other rows, or none") {
    CHECK(restore_error(saved.dir, 2, table_options(), 8).find("dynamic table 'emb' has rows of 4 floats, declared 8") !=
          std::string::npos);
  }
}

TEST_CASE("checkpoint tables: restore_or_init passes over a checkpoint whose table part is damaged, naming it") {
  Watchdog dog("table fallback", std::chrono::seconds(120));
  TempDir root("tables-fallback");
  psx::TableOptions o = table_options();
  {
    AdamPS ps({2, kWorkers}, {}, {}, kAdam);
    declare(ps, o);
    psx::CheckpointManager<AdamPS> ckpt(ps, {.directory = root.path, .every_steps = 4, .max_to_keep = 0});
    ps.run([&](psx::Worker& w) {
      while (w.clock() < 8) {
        train_step(w);
        ckpt.maybe_save(w);
      }
    });
  }
  const fs::path file = dir_of(root.path, 8) / cd::server_file_name(0);
  flip(file, part_at(file).rows + 3);
  AdamPS ps({2, kWorkers}, {}, {}, kAdam);
  declare(ps, o);
  psx::CheckpointManager<AdamPS> ckpt(ps, {.directory = root.path});
  std::uint64_t step = 0;
  ps.run([&](psx::Worker& w) {
    const std::uint64_t s = ckpt.restore_or_init(w);
    if (w.is_chief()) step = s;
  });
  CHECK(step == 4);
  const psx::checkpoint::Table four = psx::checkpoint::load_table(dir_of(root.path, 4), "emb");
  const psx::TableExport e = ps.export_table("emb");
  CHECK(e.ids.size() == four.ids.size());
}

TEST_CASE("checkpoint tables: a save that fails at any point leaves the previous checkpoint, its table whole") {
  Watchdog dog("table faults", std::chrono::seconds(120));
  TempDir root("tables-faults");
  AdamPS ps({2, 1}, {}, {}, kAdam);
  declare(ps, table_options());
  int failures = 0;
  psx::checkpoint::Table first;
  ps.run([&](psx::Worker& w) {
    for (int i = 0; i < 3; ++i) train_step(w);
    psx::checkpoint::save(ps, w, root.path);
    first = psx::checkpoint::load_table(dir_of(root.path, 3), "emb");
    for (int i = 0; i < 2; ++i) train_step(w);
    failures = psx_test::save_through_each_failure(ps, w, root.path, 3, [&] {
      check_same_rows(first, psx::checkpoint::load_table(dir_of(root.path, 3), "emb"));
    });
  });
  CHECK(failures >= 10);
  REQUIRE(!first.ids.empty());
  CHECK(psx::checkpoint::load_table(dir_of(root.path, 5), "emb").ids.size() == ps.export_table("emb").ids.size());
}

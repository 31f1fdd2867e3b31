// Optimizers, schedules and mixed precision.
//
// Reference trajectories: tests/optim/reference/trajectories.txt, written by
// tests/optim/reference/generate.py (PyTorch 1.13 from Debian's python3-torch
// where PyTorch has the optimizer, TensorFlow's documented formulas where it
// has not). The gradients are drawn here and there from the same splitmix64
// stream, so the file holds only the trajectories.
#include <psx/psx.hpp>
#include <psx/quantize.hpp>

#include <Eigen/Core>

#include "../support.hpp"
#include "../splitmix.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#ifndef PSX_REFERENCE_FILE
#error "PSX_REFERENCE_FILE must name tests/optim/reference/trajectories.txt"
#endif

namespace {

using psx_test::message_of;

// -- the reference file --------------------------------------------------------

using psx_test::Splitmix64;

struct Case {
  std::string kind;  // "case" or "schedule"
  std::string name;
  bool sparse = false;
  std::size_t size = 0;
  std::uint64_t seed = 0;
  std::map<std::string, std::string> params;
  std::vector<std::vector<double>> rows;  // one per step (a schedule: one row of factors)

  double num(const std::string& key) const {
    auto it = params.find(key);
    REQUIRE_MESSAGE(it != params.end(), name << ": no parameter " << key);
    return std::stod(it->second);
  }
  bool flag(const std::string& key) const { return num(key) != 0.0; }
};

std::vector<Case> load_reference() {
  std::ifstream in(PSX_REFERENCE_FILE);
  REQUIRE_MESSAGE(in, "cannot open " << PSX_REFERENCE_FILE);
  std::vector<Case> cases;
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream words(line);
    if (line == "end") continue;
    if (line.starts_with("case ") || line.starts_with("schedule ")) {
      Case c;
      words >> c.kind >> c.name;
      if (c.kind == "case") {
        std::string kind;
        words >> kind;
        c.sparse = kind == "sparse";
      }
      for (std::string kv; words >> kv;) {
        const auto eq = kv.find('=');
        c.params[kv.substr(0, eq)] = kv.substr(eq + 1);
      }
      if (c.kind == "case") {
        c.size = static_cast<std::size_t>(c.num("size"));
        c.seed = static_cast<std::uint64_t>(c.num("seed"));
      }
      cases.push_back(std::move(c));
      continue;
    }
    REQUIRE(!cases.empty());
    std::vector<double> values;
    for (double v; words >> v;) values.push_back(v);
    cases.back().rows.push_back(std::move(values));
  }
  return cases;
}

const std::vector<Case>& reference() {
  static const std::vector<Case> cases = load_reference();
  return cases;
}

// -- running an optimizer by direct calls ----------------------------------------

// Parameters and slots of one tensor, slots laid out as a server lays them out.
template <class O>
struct Tensor {
  const O& opt;
  std::size_t width;
  std::vector<float> w;
  std::vector<float> slots;
  std::vector<float*> bases;
  std::uint64_t t = 0;

  Tensor(const O& o, std::vector<float> init, std::size_t row_width) : opt(o), width(row_width), w(std::move(init)) {
    const std::size_t n = w.size();
    slots.resize(o.slots() * n);
    for (std::size_t k = 0; k < o.slots(); ++k) {
      bases.push_back(slots.data() + k * n);
      std::fill_n(bases.back(), n, psx::initial_slot(o, k));
    }
  }
  psx::SlotView view(std::size_t offset, std::size_t length) const { return {bases.data(), bases.size(), offset, length}; }

  void dense(std::span<const float> g) {
    const psx::UpdateContext ctx{++t, 1.0, nullptr, t, false};
    opt.update(w, g, view(0, w.size()), ctx);
  }
  // Sums duplicate ids (first appearance first), then updates each row.
  void rows(std::span<const std::uint64_t> ids, std::span<const float> g) {
    std::vector<std::uint64_t> order;
    std::map<std::uint64_t, std::vector<float>> sum;
    for (std::size_t j = 0; j < ids.size(); ++j) {
      auto [it, fresh] = sum.try_emplace(ids[j], g.begin() + j * width, g.begin() + (j + 1) * width);
      if (fresh) order.push_back(ids[j]);
      else
        for (std::size_t k = 0; k < width; ++k) it->second[k] += g[j * width + k];
    }
    const psx::UpdateContext ctx{++t, 1.0, nullptr, t, true};
    for (std::uint64_t id : order)
      opt.update(std::span(w).subspan(id * width, width), sum[id], view(id * width, width), ctx);
  }
};

// Builds the optimizer a reference case names and hands it to `f`.
template <class F>
void with_optimizer(const Case& c, F&& f) {
  const std::string& n = c.name;
  if (n.find("sgd") != std::string::npos)
    f(psx::optim::SGD{c.num("lr"), c.num("momentum"), c.num("dampening"), c.flag("nesterov"), c.num("weight_decay")});
  else if (n.find("adagrad") != std::string::npos)
    f(psx::optim::Adagrad{c.num("lr"), c.num("lr_decay"), c.num("weight_decay"), c.num("initial_accumulator_value"),
                          c.num("eps")});
  else if (n.find("rmsprop") != std::string::npos)
    f(psx::optim::RMSProp{c.num("lr"), c.num("alpha"), c.num("eps"), c.num("weight_decay"), c.num("momentum"),
                          c.flag("centered")});
  else if (n.starts_with("adamw"))
    f(psx::optim::AdamW{c.num("lr"), c.num("beta1"), c.num("beta2"), c.num("eps"), c.num("weight_decay"),
                        c.flag("amsgrad")});
  else if (n == "sparse_adam")
    f(psx::optim::Adam{c.num("lr"), c.num("beta1"), c.num("beta2"), c.num("eps")});
  else if (n.starts_with("adam"))
    f(psx::optim::Adam{c.num("lr"), c.num("beta1"), c.num("beta2"), c.num("eps"), c.num("weight_decay"),
                       c.flag("amsgrad")});
  else if (n.find("ftrl") != std::string::npos)
    f(psx::optim::Ftrl{c.num("lr"), c.num("lr_power"), c.num("l1"), c.num("l2"), c.num("initial_accumulator_value")});
  else if (n == "lamb")
    f(psx::optim::Lamb{c.num("lr"), c.num("beta1"), c.num("beta2"), c.num("eps"), c.num("weight_decay")});
  else
    FAIL("no optimizer for reference case " << n);
}

constexpr std::size_t kTableRows = 10, kTableWidth = 4, kIdsPerStep = 5;

// Relative error of `got` against `want` at the scale of the tensor: an
// element crossing zero is compared with the tensor's largest magnitude,
// not with its own (what torch.testing's rtol does with a norm).
double rel_error(double got, double want, double scale) { return std::abs(got - want) / std::max(std::abs(want), scale); }

// Replays a case's gradients; calls `check(step, values)` after each step.
template <class O, class Check>
void replay(const Case& c, const O& opt, Check&& check) {
  Splitmix64 rng{c.seed};
  std::vector<float> init(c.size);
  for (float& x : init) x = rng.uniform();
  Tensor<O> t(opt, init, c.sparse ? kTableWidth : c.size);
  const std::size_t steps = static_cast<std::size_t>(c.num("steps"));
  for (std::size_t step = 0; step < steps; ++step) {
    if (c.sparse) {
      std::vector<std::uint64_t> ids(kIdsPerStep);
      for (auto& id : ids) id = rng.next() % kTableRows;
      std::vector<float> g(kIdsPerStep * kTableWidth);
      for (float& x : g) x = rng.uniform();
      t.rows(ids, g);
    } else {
      std::vector<float> g(c.size);
      for (float& x : g) x = rng.uniform();
      t.dense(g);
    }
    check(step, t.w);
  }
}

// The reference tolerance: 1e-6 relative (fp32 trajectories of 200 steps).
constexpr double kTolerance = 1e-6;

TEST_CASE("optim: every optimizer follows its reference trajectory for 200 steps") {
  std::size_t cases = 0;
  for (const Case& c : reference()) {
    if (c.kind != "case") continue;
    ++cases;
    with_optimizer(c, [&](const auto& opt) {
      REQUIRE(c.rows.size() == static_cast<std::size_t>(c.num("steps")));
      double worst = 0.0;
      std::size_t worst_step = 0;
      replay(c, opt, [&](std::size_t step, const std::vector<float>& w) {
        REQUIRE(c.rows[step].size() == w.size());
        double scale = 0.0;
        for (double x : c.rows[step]) scale = std::max(scale, std::abs(x));
        for (std::size_t i = 0; i < w.size(); ++i) {
          const double e = rel_error(w[i], c.rows[step][i], scale);
          if (e > worst) worst = e, worst_step = step;
        }
      });
      MESSAGE(c.name << ": max relative error " << worst << " (step " << worst_step + 1 << ")");
      CHECK_MESSAGE(worst <= kTolerance, c.name << " (" << opt << ") drifts from its reference by " << worst
                                                << " at step " << worst_step + 1);
    });
  }
  CHECK(cases == 19);
}

TEST_CASE("optim: schedules follow TensorFlow's formulas") {
  using namespace psx::schedule;
  auto by_name = [](const std::string& name) -> const Case& {
    for (const Case& c : reference())
      if (c.kind == "schedule" && c.name == name) return c;
    FAIL("no schedule " << name);
    throw;
  };
  auto check = [&](const std::string& name, const auto& s) {
    const Case& c = by_name(name);
    REQUIRE(c.rows.size() == 1);
    REQUIRE(c.rows[0].size() == 200);
    for (std::uint64_t t = 0; t < 200; ++t) {
      INFO(name << " at t = " << t);
      CHECK(s(t) == doctest::Approx(c.rows[0][t]).epsilon(1e-12));
    }
  };
  check("exponential", Exponential{50, 0.5, false});
  check("exponential_staircase", Exponential{50, 0.5, true});
  check("polynomial", Polynomial{150, 0.1, 2.0});
  check("piecewise", Piecewise{{50, 120}, {1.0, 0.5, 0.1}});
  check("cosine", Cosine{150, 0.1});
  check("warmup_cosine", Warmup<Cosine>{20, {150, 0.0}});
  CHECK(Constant{}(12345) == 1.0);
}

TEST_CASE("optim: Scheduled scales the learning rate at the update's global step") {
  // SGD with lr 1 and gradient 1: each update moves w by exactly the factor.
  const auto opt = psx::optim::scheduled(psx::optim::SGD{1.0}, psx::schedule::Piecewise{{1, 2}, {0.5, 0.25, 0.125}});
  static_assert(psx::Optimizer<std::remove_const_t<decltype(opt)>>);
  std::vector<float> w{0.0f};
  const std::vector<float> g{1.0f};
  for (std::uint64_t global = 1; global <= 4; ++global)
    opt.update(w, g, {}, psx::UpdateContext{global, 2.0, nullptr, global, false});
  // factors at t = 0, 1, 2, 3: 0.5, 0.5, 0.25, 0.125, times lr_scale 2.
  CHECK(w[0] == -(1.0f + 1.0f + 0.5f + 0.25f));

  CHECK(message_of<psx::config_error>([] {
          psx::ParameterServer<psx::partition::RoundRobin, psx::sync::Synchronous,
                               psx::optim::Scheduled<psx::optim::SGD, psx::schedule::Piecewise>>
              ps({1, 1}, {}, {}, {psx::optim::SGD{}, psx::schedule::Piecewise{{10, 5}, {1.0, 0.1, 0.01}}});
          ps.declare(psx::dense("x", {2}));
        }) == "psx: schedule::Piecewise for 'x': needs strictly increasing boundaries");
  CHECK(message_of<psx::config_error>([] { psx::schedule::Piecewise{{10}, {1.0}}.validate(); }) ==
        "psx: schedule::Piecewise needs one value more than boundaries (got 1 boundaries, 1 values)");
}

// -- the same optimizers inside a running cluster ---------------------------------

// Trains `steps` synchronous steps on a 2-server cluster (one worker) and
// replays the same gradients by direct calls: the results must be bit-identical.
template <class O, class P = psx::partition::RowRange>
void check_cluster_matches_direct(const O& opt, bool sparse, psx::DType dtype = psx::DType::float32) {
  INFO(opt << (sparse ? " on rows" : " dense"));
  constexpr std::size_t rows = 12, width = 3, steps = 30;
  psx::ParameterServer<P, psx::sync::Synchronous, O> ps({2, 1}, P{}, {}, opt);
  psx::VariableSpec spec = sparse ? psx::sparse("v", rows, width, psx::Initializer::uniform(-1, 1, 3))
                                  : psx::dense("v", {rows, width}, psx::Initializer::uniform(-1, 1, 3));
  spec.dtype = dtype;
  ps.declare(spec);
  ps.start();
  const std::vector<float> initial = ps.read("v");
  Tensor<O> direct(opt, initial, width);
  psx::Worker w = ps.worker(0);
  Splitmix64 rng{77};
  for (std::size_t step = 0; step < steps; ++step) {
    if (sparse) {
      // Rows 10 and 11 are never pushed: they and their slots must not change.
      std::vector<std::uint64_t> ids(6);
      for (auto& id : ids) id = rng.next() % (rows - 2);
      std::vector<float> g(ids.size() * width);
      for (float& x : g) x = rng.uniform();
      w.push_rows("v", ids, g);
      direct.rows(ids, g);
    } else {
      std::vector<float> g(rows * width);
      for (float& x : g) x = rng.uniform();
      w.push("v", g);
      direct.dense(g);
    }
    w.step();
  }
  const std::vector<float> got = ps.read("v");
  CHECK(std::memcmp(got.data(), direct.w.data(), got.size() * sizeof(float)) == 0);
  if (sparse) {
    // Rows 10 and 11 were never pushed: bit-identical to their initial values,
    // and their slots too: a first push to row 11 updates it exactly as a
    // first update from the initial slots, at the current step.
    for (std::size_t i = 10 * width; i < rows * width; ++i)
      CHECK(std::bit_cast<std::uint32_t>(got[i]) == std::bit_cast<std::uint32_t>(initial[i]));
    Tensor<O> fresh(opt, std::vector<float>(initial.begin() + 10 * width, initial.end()), width);
    fresh.t = direct.t;
    const std::vector<float> g{0.5f, -0.25f, 1.0f};
    w.push_rows("v", std::vector<std::uint64_t>{11}, g);
    w.step();
    fresh.rows(std::vector<std::uint64_t>{1}, g);
    std::vector<float> row(width);
    w.pull_rows("v", std::vector<std::uint64_t>{11}, row);
    CHECK(std::memcmp(row.data(), fresh.w.data() + width, width * sizeof(float)) == 0);
  }
}

TEST_CASE("optim: a cluster applies each optimizer exactly as direct calls do, dense and sparse") {
  psx_test::Watchdog dog("optim cluster");
  check_cluster_matches_direct(psx::optim::SGD{0.1, 0.9, 0.0, true, 0.01}, false);
  check_cluster_matches_direct(psx::optim::SGD{0.1, 0.9, 0.1, false, 0.01}, true);
  check_cluster_matches_direct(psx::optim::Adagrad{0.1, 0.01, 0.0, 0.1}, false);
  check_cluster_matches_direct(psx::optim::Adagrad{0.1}, true);
  check_cluster_matches_direct(psx::optim::RMSProp{0.01, 0.9, 1e-8, 0.01, 0.5, true}, false);
  check_cluster_matches_direct(psx::optim::RMSProp{0.01, 0.9, 1e-8, 0.0, 0.5, true}, true);
  check_cluster_matches_direct(psx::optim::Adam{0.01, 0.9, 0.999, 1e-8, 0.0, true}, false);
  check_cluster_matches_direct(psx::optim::Adam{0.01}, true);
  check_cluster_matches_direct(psx::optim::AdamW{0.01, 0.9, 0.999, 1e-8, 0.1}, false);
  check_cluster_matches_direct(psx::optim::AdamW{0.01, 0.9, 0.999, 1e-8, 0.1, true}, true);
  check_cluster_matches_direct(psx::optim::Ftrl{0.1, -0.5, 0.01, 0.01}, false);
  check_cluster_matches_direct(psx::optim::Ftrl{0.1, -0.6, 0.001, 0.0}, true);
  check_cluster_matches_direct<psx::optim::Lamb, psx::partition::RoundRobin>(psx::optim::Lamb{0.01}, false);
}

// Row pushes are applied as they came (storage::Host::apply_raw_rows): rows
// pushed once straight from the caller's buffer, repeated ones summed first.
// Whatever the ids, the bits must be those of summing every id in push
// order and updating each row once (Tensor::rows, the path of before).
// The shard holds rows [200, 900) of its variable; every other push reads
// its rows through positions, as a push split over several shards does.
template <class O>
void check_row_pushes_bitwise(const O& opt) {
  INFO(opt);
  constexpr std::size_t first = 200, rows = 700, width = 5;
  psx::VariableInfo v;
  v.meta.name = "v";
  v.meta.rows = 1000;
  v.meta.row_width = width;
  v.meta.kind = psx::VariableKind::sparse;
  v.meta.shape = {1000, width};
  v.init = psx::Initializer::uniform(-1, 1, 9);
  psx::storage::Host::shard<O> shard(opt, v, psx::Shard{0, first, first + rows});
  Tensor<O> direct(opt, {shard.values().begin(), shard.values().end()}, width);
  Splitmix64 rng{31};
  std::vector<std::vector<std::uint64_t>> pushes;  // shard-local rows
  std::vector<std::uint64_t> all(rows);
  std::iota(all.begin(), all.end(), 0);
  for (std::size_t k = rows - 1; k > 0; --k) std::swap(all[k], all[rng.next() % (k + 1)]);
  pushes.emplace_back(all.begin(), all.begin() + 300);                 // distinct, shuffled
  std::vector<std::uint64_t> sorted(all.begin() + 100, all.begin() + 400);
  std::sort(sorted.begin(), sorted.end());
  pushes.push_back(sorted);                                            // distinct, sorted
  std::vector<std::uint64_t> zipf(500);
  for (auto& id : zipf) id = (rng.next() % 4 == 0) ? rng.next() % rows : rng.next() % 7;
  pushes.push_back(zipf);                                              // a few hot ids, many repeats
  pushes.push_back(std::vector<std::uint64_t>(64, rows - 1));          // one id 64 times (the last row)
  std::vector<std::uint64_t> same_bit;                                 // rows 64 apart share a bit position
  for (std::uint64_t r = 63; r < rows; r += 64) same_bit.push_back(r);
  same_bit.push_back(63);
  pushes.push_back(same_bit);
  std::vector<std::uint64_t> late(all.begin(), all.begin() + 200);     // distinct until the last id
  late.push_back(all[0]);
  pushes.push_back(late);
  pushes.push_back({0, rows - 1, 0, rows - 1, 1, 0});                  // the ends, alternating
  pushes.push_back(pushes[0]);                                         // again: the marks of before were cleared
  for (std::size_t p = 0; p < pushes.size(); ++p) {
    const std::vector<std::uint64_t>& local = pushes[p];
    const std::size_t n = local.size();
    std::vector<std::uint64_t> ids(n);
    for (std::size_t j = 0; j < n; ++j) ids[j] = local[j] + first;
    // Odd pushes: the rows sit in a buffer twice as long, in another order.
    std::vector<std::uint32_t> positions;
    std::vector<float> buffer((p % 2 ? 2 * n : n) * width), g(n * width);
    for (float& x : buffer) x = rng.uniform();
    if (p % 2) {
      for (std::size_t j = 0; j < n; ++j) positions.push_back(static_cast<std::uint32_t>(2 * n - 1 - 2 * j));
      for (std::size_t j = 0; j < n; ++j)
        std::copy_n(buffer.begin() + static_cast<std::ptrdiff_t>(positions[j] * width), width,
                    g.begin() + static_cast<std::ptrdiff_t>(j * width));
    } else {
      g = buffer;
    }
    direct.rows(local, g);
    const psx::UpdateContext ctx{direct.t, 1.0, nullptr, direct.t, true};
    shard.apply_raw_rows(opt, ids, first, positions, buffer, ctx);
  }
  CHECK(std::memcmp(shard.values().data(), direct.w.data(), direct.w.size() * sizeof(float)) == 0);
  for (std::size_t k = 0; k < opt.slots(); ++k)
    CHECK(std::memcmp(shard.slot_values(k).data(), direct.bases[k], direct.w.size() * sizeof(float)) == 0);
}

TEST_CASE("optim: row pushes give the bits of summing in push order, whatever the ids") {
  psx_test::Watchdog dog("row pushes bitwise");
  check_row_pushes_bitwise(psx::optim::SGD{0.1, 0.9, 0.0, false, 0.01});
  check_row_pushes_bitwise(psx::optim::Adagrad{0.1, 0.01, 0.0, 0.1});
  check_row_pushes_bitwise(psx::optim::Adam{0.01});
  check_row_pushes_bitwise(psx::optim::Ftrl{0.1, -0.5, 0.01, 0.01});
  // Through a cluster (the server takes the same path): the sparse cases of
  // "a cluster applies each optimizer exactly as direct calls do".
}

TEST_CASE("optim: a row push that runs out of memory while summing repeats changes no row") {
  if (!psx_test::can_fail_allocations()) return;
  const psx::optim::Adagrad opt{0.1};
  psx::VariableInfo v;
  v.meta.name = "v";
  v.meta.rows = 100;
  v.meta.row_width = 4;
  v.meta.kind = psx::VariableKind::sparse;
  v.meta.shape = {100, 4};
  v.init = psx::Initializer::uniform(-1, 1, 2);
  const psx::Shard shard{0, 0, 100};
  psx::storage::Host::shard<psx::optim::Adagrad> s(opt, v, shard);
  const std::vector<float> before(s.values().begin(), s.values().end());
  const std::vector<float> slots_before(s.slot_values(0).begin(), s.slot_values(0).end());
  std::vector<std::uint64_t> ids(300);
  for (std::size_t j = 0; j < ids.size(); ++j) ids[j] = (j * 7) % 100;  // every id 3 times
  const std::vector<float> g(ids.size() * 4, 0.5f);
  psx::UpdateContext ctx;
  ctx.rows = true;
  int failed = 0;
  for (long n = 0; n < 64; ++n) {
    psx_test::fail_allocation(n);
    try {
      s.apply_raw_rows(opt, ids, 0, {}, g, ctx);
      psx_test::fail_allocation(-1);
      break;  // it needed fewer than n allocations: done
    } catch (const std::bad_alloc&) {
      psx_test::fail_allocation(-1);
      ++failed;
      REQUIRE(std::equal(before.begin(), before.end(), s.values().begin()));
      REQUIRE(std::equal(slots_before.begin(), slots_before.end(), s.slot_values(0).begin()));
    }
  }
  CHECK(failed > 0);
  CHECK_FALSE(std::equal(before.begin(), before.end(), s.values().begin()));  // the last try went through
}

TEST_CASE("optim: LAMB with per_shard_trust_ratio treats each shard as a layer") {
  psx_test::Watchdog dog("lamb per shard");
  const psx::optim::Lamb opt{0.01, 0.9, 0.999, 1e-6, 0.01, true};
  psx::ParameterServer<psx::partition::RowRange, psx::sync::Synchronous, psx::optim::Lamb> ps({2, 1}, {}, {}, opt);
  ps.declare(psx::dense("v", {4, 2}, psx::Initializer::uniform(-1, 1, 4)));
  ps.start();
  const std::vector<float> init = ps.read("v");
  using T = Tensor<psx::optim::Lamb>;
  T top(opt, {init.begin(), init.begin() + 4}, 2), bottom(opt, {init.begin() + 4, init.end()}, 2), whole(opt, init, 2);
  psx::Worker w = ps.worker(0);
  for (int step = 0; step < 10; ++step) {
    // The halves' gradients differ in scale, so the two trust ratios differ.
    std::vector<float> g{0.1f, -0.2f, 0.3f, 0.1f, 5.0f, -4.0f, 3.0f, 6.0f};
    w.push("v", g);
    w.step();
    top.dense(std::span(g).first(4));
    bottom.dense(std::span(g).subspan(4));
    whole.dense(g);
  }
  std::vector<float> expect = top.w;
  expect.insert(expect.end(), bottom.w.begin(), bottom.w.end());
  CHECK(ps.read("v") == expect);
  CHECK(ps.read("v") != whole.w);
}

TEST_CASE("optim: row pushes that touch every row equal dense pushes, except Adam's SparseAdam formula") {
  // Lazy semantics differ from dense only for rows that are not pushed.
  auto same = [](const auto& opt) {
    Splitmix64 rng{5};
    std::vector<float> init(12);
    for (float& x : init) x = rng.uniform();
    using O = std::decay_t<decltype(opt)>;
    Tensor<O> dense(opt, init, 3), rows(opt, init, 3);
    const std::vector<std::uint64_t> all{0, 1, 2, 3};
    for (int step = 0; step < 20; ++step) {
      std::vector<float> g(12);
      for (float& x : g) x = rng.uniform();
      dense.dense(g);
      rows.rows(all, g);
    }
    return dense.w == rows.w;
  };
  CHECK(same(psx::optim::SGD{0.1, 0.9, 0.0, true, 0.01}));
  CHECK(same(psx::optim::Adagrad{0.1, 0.01, 0.01, 0.1}));
  CHECK(same(psx::optim::RMSProp{0.01, 0.9, 1e-8, 0.01, 0.5, true}));
  CHECK(same(psx::optim::Ftrl{0.1, -0.5, 0.01, 0.01}));
  CHECK_FALSE(same(psx::optim::Adam{0.01}));  // eps sits elsewhere in SparseAdam
}

TEST_CASE("optim: optimizers refuse what they cannot do, at declare") {
  using psx::optim::Lamb;
  CHECK(message_of<psx::config_error>([] {
          psx::ParameterServer<psx::partition::RowRange, psx::sync::Synchronous, Lamb> ps({2, 1}, {}, {}, Lamb{});
          ps.declare(psx::dense("w", {8, 4}));
        }) == "psx: optim::Lamb: variable 'w' is split into 2 shards, but LAMB's trust ratio needs the whole "
              "variable; use a partitioner that keeps variables whole (HashByName, RoundRobin) or set "
              "per_shard_trust_ratio");
  CHECK(message_of<psx::config_error>([] {
          psx::ParameterServer<psx::partition::HashByName, psx::sync::Synchronous, Lamb> ps({2, 1}, {}, {}, Lamb{});
          ps.declare(psx::sparse("emb", 100, 8));
        }) == "psx: optim::Lamb: variable 'emb' is sparse; LAMB's trust ratio is per layer and a row is not one");
  // A schedule keeps LAMB's refusal of row pushes (it applied a trust
  // ratio per row, and took dynamic tables).
  {
    using ScheduledLamb = psx::optim::Scheduled<Lamb, psx::schedule::Cosine>;
    static_assert(!psx::accepts_rows<ScheduledLamb>());
    CHECK(message_of<psx::config_error>([] {
            psx::ParameterServer<psx::partition::HashByName, psx::sync::Synchronous, ScheduledLamb> ps({2, 1});
            ps.declare(psx::embedding("emb", 8));
          }) == "psx: dynamic table 'emb': the optimizer does not apply row pushes");
    psx::ParameterServer<psx::partition::HashByName, psx::sync::Asynchronous, ScheduledLamb> ps(
        {1, 1}, {}, {}, ScheduledLamb{{.lr = 0.1}, {.decay_steps = 10}});
    ps.declare(psx::dense("w", {2, 2}, psx::Initializer::constant(1.0f)));
    auto w = ps.worker(0);
    const std::vector<std::uint64_t> row{0};
    const std::vector<float> g{1.0f, 0.0f};
    CHECK(message_of<psx::config_error>([&] { w.push_rows("w", row, g); }).find("does not apply row pushes") !=
          std::string::npos);
    CHECK(ps.read("w") == std::vector<float>(4, 1.0f));
  }
  CHECK(message_of<psx::config_error>([] {
          psx::ParameterServer<psx::partition::HashByName, psx::sync::Synchronous, psx::optim::SGD> ps(
              {1, 1}, {}, {}, psx::optim::SGD{.lr = 0.1, .nesterov = true});
          ps.declare(psx::dense("w", {4}));
        }) == "psx: optim::SGD for 'w': Nesterov momentum needs momentum > 0 and dampening = 0");
  CHECK(message_of<psx::config_error>([] {
          psx::ParameterServer<psx::partition::HashByName, psx::sync::Synchronous, psx::optim::Ftrl> ps(
              {1, 1}, {}, {}, psx::optim::Ftrl{.lr = 0.1, .lr_power = 0.5});
          ps.declare(psx::dense("w", {4}));
        }) == "psx: optim::Ftrl for 'w': needs lr > 0, lr_power <= 0, initial_accumulator_value >= 0, l1 >= 0 and "
              "l2 >= 0");
}

TEST_CASE("optim: hyper-parameters are checked at declare, as PyTorch's constructors check them") {
  auto refused = [](const auto& opt) {
    using O = std::decay_t<decltype(opt)>;
    return message_of<psx::config_error>([&] {
      psx::ParameterServer<psx::partition::HashByName, psx::sync::Synchronous, O> ps({1, 1}, {}, {}, opt);
      ps.declare(psx::dense("w", {4}));
    });
  };
  CHECK(refused(psx::optim::Adam{.beta1 = 1.0}) == "psx: optim::Adam for 'w': needs beta1 and beta2 in [0, 1)");
  CHECK(refused(psx::optim::AdamW{.beta2 = -0.1}) == "psx: optim::AdamW for 'w': needs beta1 and beta2 in [0, 1)");
  CHECK(refused(psx::optim::Adam{.lr = -1.0}) == "psx: optim::Adam for 'w': needs lr, eps and weight_decay >= 0");
  CHECK(refused(psx::optim::Adagrad{.initial_accumulator_value = -1.0}) ==
        "psx: optim::Adagrad for 'w': needs lr, lr_decay, weight_decay, initial_accumulator_value and eps >= 0");
  CHECK(refused(psx::optim::RMSProp{.eps = -1e-8}) ==
        "psx: optim::RMSProp for 'w': needs lr, alpha, eps, weight_decay and momentum >= 0");
  CHECK(refused(psx::optim::SGD{.lr = 0.1, .momentum = -0.9}) ==
        "psx: optim::SGD for 'w': needs lr, momentum and weight_decay >= 0");
  CHECK(refused(psx::optim::Ftrl{.lr = 0.0}) == "psx: optim::Ftrl for 'w': needs lr > 0, lr_power <= 0, "
                                                "initial_accumulator_value >= 0, l1 >= 0 and l2 >= 0");
  CHECK(refused(psx::optim::Lamb{.beta1 = 1.5}) == "psx: optim::Lamb for 'w': needs beta1 and beta2 in [0, 1)");
  // Schedules, also inside a Warmup.
  CHECK(refused(psx::optim::scheduled(psx::optim::SGD{0.1}, psx::schedule::Polynomial{.decay_steps = 0})) ==
        "psx: schedule::Polynomial for 'w': needs decay_steps >= 1, a finite power > 0 and a finite end >= 0, got 0, "
        "1 and 0.0001");
  CHECK(refused(psx::optim::scheduled(psx::optim::SGD{0.1}, psx::schedule::Exponential{.decay_steps = 0})) ==
        "psx: schedule::Exponential for 'w': needs decay_steps >= 1 and a finite decay_rate > 0, got 0 and 0.96");
  CHECK(refused(psx::optim::scheduled(psx::optim::SGD{0.1}, psx::schedule::Cosine{.decay_steps = 0})) ==
        "psx: schedule::Cosine for 'w': needs decay_steps >= 1 and a finite alpha >= 0, got 0 and 0");
  CHECK(refused(psx::optim::scheduled(psx::optim::SGD{0.1},
                                      psx::schedule::Warmup<psx::schedule::Piecewise>{10, {{5}, {}}})) ==
        "psx: schedule::Piecewise for 'w': needs one value more than boundaries (got 1 boundaries, 0 values)");
  // Infinite, NaN or negative settings: a factor of NaN or infinity, or gradient ascent.
  constexpr double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  CHECK(refused(psx::optim::scheduled(psx::optim::SGD{0.1}, psx::schedule::Exponential{.decay_rate = inf})) ==
        "psx: schedule::Exponential for 'w': needs decay_steps >= 1 and a finite decay_rate > 0, got 1 and inf");
  CHECK(refused(psx::optim::scheduled(psx::optim::SGD{0.1}, psx::schedule::Cosine{.alpha = inf})) ==
        "psx: schedule::Cosine for 'w': needs decay_steps >= 1 and a finite alpha >= 0, got 1 and inf");
  CHECK(refused(psx::optim::scheduled(psx::optim::SGD{0.1}, psx::schedule::Polynomial{.power = nan})) ==
        "psx: schedule::Polynomial for 'w': needs decay_steps >= 1, a finite power > 0 and a finite end >= 0, got 1, "
        "nan and 0.0001");
  CHECK(refused(psx::optim::scheduled(psx::optim::SGD{0.1}, psx::schedule::Piecewise{{5}, {1.0, -1.0}})) ==
        "psx: schedule::Piecewise for 'w': needs finite values >= 0, got value 1 = -1");
  CHECK(refused(psx::optim::scheduled(psx::optim::SGD{0.1}, psx::schedule::Piecewise{{5}, {nan, 1.0}})) ==
        "psx: schedule::Piecewise for 'w': needs finite values >= 0, got value 0 = nan");
  CHECK(refused(psx::optim::Pruned<psx::optim::SGD>{.schedule = {.final_sparsity = 1.0}}) ==
        "psx: PolynomialDecaySparsity for 'w': needs 0 <= initial_sparsity <= final_sparsity < 1, got 0.000000 and "
        "1.000000");
  CHECK(psx::schedule::Piecewise{{5}, {}}(3) == 1.0);  // never reads out of bounds
  // A NaN hyper-parameter would make every parameter it touches NaN.
  const std::string ftrl_rule =
      "psx: optim::Ftrl for 'w': needs lr > 0, lr_power <= 0, initial_accumulator_value >= 0, l1 >= 0 and l2 >= 0";
  CHECK(refused(psx::optim::Ftrl{.l1 = nan}) == ftrl_rule);
  CHECK(refused(psx::optim::Ftrl{.l2 = nan}) == ftrl_rule);
  CHECK(refused(psx::optim::Ftrl{.lr_power = nan}) == ftrl_rule);
  CHECK(refused(psx::optim::Ftrl{.initial_accumulator_value = nan}) == ftrl_rule);
  CHECK(refused(psx::optim::SGD{.lr = 0.1, .momentum = 0.9, .dampening = nan}) ==
        "psx: optim::SGD for 'w': needs a dampening that is a number");
  CHECK(refused(psx::optim::Adam{.beta2 = nan}) == "psx: optim::Adam for 'w': needs beta1 and beta2 in [0, 1)");
  CHECK(refused(psx::optim::Adagrad{.eps = nan}) ==
        "psx: optim::Adagrad for 'w': needs lr, lr_decay, weight_decay, initial_accumulator_value and eps >= 0");
  CHECK(refused(psx::optim::RMSProp{.alpha = nan}) ==
        "psx: optim::RMSProp for 'w': needs lr, alpha, eps, weight_decay and momentum >= 0");
}

TEST_CASE("optim: FTRL at learning rate 0 (warm-up's first step) leaves parameters and state as they are") {
  const auto opt = psx::optim::scheduled(psx::optim::Ftrl{0.1, -0.5, 0.01, 0.01},
                                         psx::schedule::Warmup<psx::schedule::Constant>{.steps = 2});
  std::vector<float> w{0.5f, -0.25f}, slots(4);
  std::vector<float*> bases{slots.data(), slots.data() + 2};
  for (std::size_t k = 0; k < 2; ++k) std::fill_n(bases[k], 2, psx::initial_slot(opt, k));
  const std::vector<float> g{1.0f, -2.0f};
  opt.update(w, g, psx::SlotView(bases.data(), 2, 0, 2), psx::UpdateContext{1, 1.0, nullptr, 1, false});
  CHECK(w == std::vector<float>{0.5f, -0.25f});
  CHECK(slots == std::vector<float>{0.1f, 0.1f, 0.0f, 0.0f});
  for (std::uint64_t t = 2; t <= 20; ++t)
    opt.update(w, g, psx::SlotView(bases.data(), 2, 0, 2), psx::UpdateContext{t, 1.0, nullptr, t, false});
  for (float x : slots) CHECK(std::isfinite(x));
  for (float x : w) CHECK(std::isfinite(x));
}

TEST_CASE("optim: SGD momentum on rows accumulates across pushes of the same step") {
  // Two pushes of g = 1 stamped with the same global step: b = 1, then 1.9.
  const psx::optim::SGD opt{1.0, 0.9};
  std::vector<float> w{0.0f}, b{0.0f};
  float* bases[] = {b.data()};
  const std::vector<float> g{1.0f};
  for (int push = 0; push < 2; ++push)
    opt.update(w, g, psx::SlotView(bases, 1, 0, 1), psx::UpdateContext{1, 1.0, nullptr, 1, true});
  CHECK(b[0] == doctest::Approx(1.9f));
  CHECK(w[0] == doctest::Approx(-2.9f));
}

TEST_CASE("optim: the server refuses row pushes for LAMB, whose trust ratio needs a layer") {
  psx::ParameterServer<psx::partition::HashByName, psx::sync::Asynchronous, psx::optim::Lamb> ps({1, 1}, {}, {},
                                                                                                 {0.01});
  ps.declare(psx::dense("w", {4, 2}));
  ps.start();
  psx::Worker w = ps.worker(0);
  const std::vector<float> before = ps.read("w");
  const std::vector<std::uint64_t> ids{1};
  const std::vector<float> g{1.0f, 1.0f};
  CHECK(message_of<psx::config_error>([&] { w.push_rows("w", ids, g); }) ==
        "psx: server 0, request from worker 0: push_rows to 'w': the optimizer does not apply row pushes; push "
        "the whole variable");
  CHECK(ps.read("w") == before);
}

TEST_CASE("optim: slots are sharded with the parameters, bytes per parameter") {
  CHECK(psx::optim::bytes_per_parameter(psx::optim::SGD{}) == 4);
  CHECK(psx::optim::bytes_per_parameter(psx::optim::SGD{.momentum = 0.9}) == 8);
  CHECK(psx::optim::bytes_per_parameter(psx::optim::Adagrad{}) == 8);
  CHECK(psx::optim::bytes_per_parameter(psx::optim::RMSProp{}) == 8);
  CHECK(psx::optim::bytes_per_parameter(psx::optim::RMSProp{.momentum = 0.9, .centered = true}) == 16);
  CHECK(psx::optim::bytes_per_parameter(psx::optim::Adam{}) == 12);
  CHECK(psx::optim::bytes_per_parameter(psx::optim::Adam{.amsgrad = true}) == 16);
  CHECK(psx::optim::bytes_per_parameter(psx::optim::AdamW{}) == 12);
  CHECK(psx::optim::bytes_per_parameter(psx::optim::Ftrl{}) == 12);
  CHECK(psx::optim::bytes_per_parameter(psx::optim::Lamb{}) == 12);

  // Each server holds the slots of its own rows only.
  psx::ParameterServer<psx::partition::RowRange, psx::sync::Synchronous, psx::optim::Adam> ps({2, 1});
  ps.declare(psx::dense("w", {10, 4}));
  psx::VariableSpec half = psx::dense("h", {6, 2});
  half.dtype = psx::DType::bfloat16;
  ps.declare(half);
  ps.start();
  const psx::ServerStats s0 = ps.server_stats(0), s1 = ps.server_stats(1);
  CHECK(s0.slot_bytes == 2 * (5 * 4 + 3 * 2) * 4);
  CHECK(s1.slot_bytes == 2 * (5 * 4 + 3 * 2) * 4);
  CHECK(s0.parameter_bytes == (5 * 4 + 3 * 2) * 4 + 3 * 2 * 2);
  CHECK(ps.stats().slot_bytes == 2 * 52 * 4);
}

// -- mixed precision ----------------------------------------------------------------

TEST_CASE("half: conversions agree with Eigen's bfloat16 and half") {
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const float bf = psx::bfloat16{bits}.to_float(), hf = psx::float16{bits}.to_float();
    const float ebf = static_cast<float>(Eigen::numext::bit_cast<Eigen::bfloat16>(bits));
    const float ehf = static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(bits));
    if (std::isnan(ebf)) CHECK(std::isnan(bf));
    else if (std::bit_cast<std::uint32_t>(bf) != std::bit_cast<std::uint32_t>(ebf)) FAIL_CHECK("bfloat16 " << b);
    if (std::isnan(ehf)) CHECK(std::isnan(hf));
    else if (std::bit_cast<std::uint32_t>(hf) != std::bit_cast<std::uint32_t>(ehf)) FAIL_CHECK("float16 " << b);
  }
  std::size_t mismatches = 0, checked = 0;
  auto check_float = [&](std::uint32_t u) {
    const float f = std::bit_cast<float>(u);
    ++checked;
    const auto bf = psx::bfloat16::from_float(f).bits, hf = psx::float16::from_float(f).bits;
    const auto ebf = Eigen::numext::bit_cast<std::uint16_t>(Eigen::bfloat16(f));
    const auto ehf = Eigen::numext::bit_cast<std::uint16_t>(Eigen::half(f));
    if (std::isnan(f)) {
      mismatches += !std::isnan(psx::bfloat16{bf}.to_float()) + !std::isnan(psx::float16{hf}.to_float());
      return;
    }
    mismatches += (bf != ebf) + (hf != ehf);
  };
  for (std::uint64_t u = 0; u <= 0xffffffffull; u += 4093) check_float(static_cast<std::uint32_t>(u));
  // Ties, the subnormal and overflow boundaries, both signs.
  for (std::uint32_t sign : {0u, 0x80000000u})
    for (std::uint32_t u : {0x00000000u, 0x7f800000u, 0x477fe000u, 0x477ff000u, 0x477fefffu, 0x38800000u, 0x387fc000u,
                            0x33000000u, 0x33000001u, 0x32ffffffu, 0x3f808000u, 0x3f818000u, 0x3f800001u, 0x7f7fffffu,
                            0x3f801000u, 0x3f803000u, 0x00000001u})
      check_float(sign | u);
  CHECK(mismatches == 0);
  CHECK(checked > 1'000'000);
}

TEST_CASE("half: bfloat16 and float16 variables train in float32 and serve 16-bit copies") {
  psx_test::Watchdog dog("mixed precision");
  for (psx::DType dtype : {psx::DType::bfloat16, psx::DType::float16}) {
    INFO(psx::dtype_name(dtype));
    // Bit-identical fp32 master to a float32 run; the 16-bit pull is its rounding.
    check_cluster_matches_direct(psx::optim::Adam{0.01}, false, dtype);
    check_cluster_matches_direct(psx::optim::Adagrad{0.1}, true, dtype);

    psx::ParameterServer<psx::partition::RowRange, psx::sync::Synchronous, psx::optim::SGD> ps({2, 1}, {}, {},
                                                                                                {0.001});
    psx::VariableSpec d = psx::dense("d", {5, 3}, psx::Initializer::normal(0, 1, 9));
    psx::VariableSpec e = psx::sparse("e", 8, 4, psx::Initializer::uniform(-3, 3, 9));
    d.dtype = e.dtype = dtype;
    ps.declare(d);
    ps.declare(e);
    ps.start();
    psx::Worker w = ps.worker(0);
    std::vector<float> g(15, 1.0f), eg(8, 0.5f);
    w.push("d", g);
    const std::vector<std::uint64_t> ids{6, 1};
    w.push_rows("e", ids, eg);
    w.step();
    const std::vector<float> master = ps.read("d"), emaster = ps.read("e");
    auto expect_rounded = [&](const auto& low, std::span<const float> ref) {
      using T = std::decay_t<decltype(low[0])>;
      for (std::size_t i = 0; i < ref.size(); ++i) CHECK(low[i] == T::from_float(ref[i]));
    };
    auto run = [&]<class T>(T) {
      std::vector<T> low(15);
      w.pull("d", std::span(low));
      expect_rounded(low, master);
      std::vector<T> rows(8);
      w.pull_rows("e", ids, std::span(rows));
      expect_rounded(std::span(rows).first(4), std::span(emaster).subspan(6 * 4, 4));
      expect_rounded(std::span(rows).subspan(4), std::span(emaster).subspan(1 * 4, 4));
      // The master moved by 0.001 per step: the 16-bit copy lags it, the master does not.
      CHECK(master[0] != T::from_float(master[0]).to_float());
    };
    if (dtype == psx::DType::bfloat16) run(psx::bfloat16{});
    else run(psx::float16{});
    // A 16-bit pull of the other kind, or of a float32 variable, is a shape error.
    std::vector<psx::float16> wrong16(15);
    std::vector<psx::bfloat16> wrongbf(15);
    const std::string msg = dtype == psx::DType::bfloat16
                                ? message_of<psx::shape_error>([&] { w.pull("d", std::span(wrong16)); })
                                : message_of<psx::shape_error>([&] { w.pull("d", std::span(wrongbf)); });
    CHECK(msg == std::string("psx: worker 0: pull of variable 'd' (dtype ") + psx::dtype_name(dtype) + ") into a " +
                     (dtype == psx::DType::bfloat16 ? "float16" : "bfloat16") +
                     " buffer; 16-bit pulls need the variable's own dtype");
  }
}

}  // namespace

namespace {

// The code of docs/optimizers.md (the docs test checks it is here, line for line).
TEST_CASE("optim: the documented set-up trains with AdamW, warm-up + cosine, and a bfloat16 table") {
  psx_test::Watchdog dog("docs optimizers");
  using Opt = psx::optim::Scheduled<psx::optim::AdamW, psx::schedule::Warmup<psx::schedule::Cosine>>;
  const Opt opt{psx::optim::AdamW{.lr = 1e-3, .weight_decay = 0.01},
                psx::schedule::Warmup<psx::schedule::Cosine>{.steps = 100, .after = {.decay_steps = 10'000}}};
  psx::ParameterServer<psx::partition::HashByName, psx::sync::Synchronous, Opt> ps({2, 4}, {}, {}, opt);
  ps.declare(psx::dense("w", {64, 8}, psx::Initializer::normal(0, 0.1f, 7)));
  psx::VariableSpec table = psx::sparse("emb", 1000, 16, psx::Initializer::normal(0, 0.1f, 7));
  table.dtype = psx::DType::bfloat16;  // float32 master on the server, bfloat16 copy for pulls
  ps.declare(table);
  const std::vector<float> before = ps.read("w");
  ps.run([](psx::Worker& w) {
    const std::vector<std::uint64_t> ids{3, 14, 15, 92};
    for (int step = 0; step < 3; ++step) {
      std::vector<psx::bfloat16> rows(ids.size() * 16);
      w.pull_rows("emb", ids, std::span(rows));  // 2 bytes per element on the way
      std::vector<float> grad(ids.size() * 16, 0.5f);
      w.push_rows("emb", ids, grad);
      w.push("w", std::vector<float>(64 * 8, 1.0f));
      w.step();
    }
  });
  // Warm-up: the first step runs at factor 0, the next at 1/100 and 2/100.
  const std::vector<float> after = ps.read("w");
  CHECK(after[0] < before[0]);
  CHECK(after[0] > before[0] - 1e-4f);
}

}  // namespace

namespace {

TEST_CASE("quantize: int8 symmetric per tensor and per channel, against hand-computed values") {
  // max |x| = 2.54 -> scale 0.02; 0.01 / 0.02 = 0.5 rounds to even (0), 0.03 -> 1.5 -> 2.
  const std::vector<float> x{2.54f, -2.54f, 0.01f, 0.03f, 0.0f, -1.0f};
  const psx::QuantizedInt8 t = psx::quantize_int8(x, 2, 3, false);
  REQUIRE(t.scales.size() == 1);
  CHECK(t.scales[0] == 2.54f / 127.0f);
  CHECK(t.values == std::vector<std::int8_t>{127, -127, 0, 2, 0, -50});
  // Per channel: row 1's max is 1 -> scale 1/127.
  const psx::QuantizedInt8 c = psx::quantize_int8(x, 2, 3, true);
  REQUIRE(c.scales.size() == 2);
  CHECK(c.scales[1] == 1.0f / 127.0f);
  CHECK(c.values[3] == 4);  // 0.03 * 127 = 3.81 -> 4
  CHECK(c.values[5] == -127);
  std::vector<float> back(6);
  psx::dequantize(c, back);
  CHECK(back[5] == -127.0f * (1.0f / 127.0f));
  for (std::size_t i = 0; i < 6; ++i) CHECK(std::abs(back[i] - x[i]) <= c.scales[i / 3] / 2);
  // All zeros: scale 1, values 0. NaN quantizes to 0 and does not set the scale.
  const psx::QuantizedInt8 z = psx::quantize_int8(std::vector<float>{0.0f, std::nanf(""), 1.27f}, 1, 3, false);
  CHECK(z.scales[0] == 1.27f / 127.0f);
  CHECK(z.values[1] == 0);
  CHECK(psx::quantize_int8(std::vector<float>(4, 0.0f), 2, 2, true).scales == std::vector<float>{1.0f, 1.0f});
  CHECK(message_of<psx::shape_error>([&] { (void)psx::quantize_int8(x, 4, 2, false); }) ==
        "psx::quantize_int8: a 4 x 2 tensor needs more than the 6 values given");
  CHECK(message_of<psx::shape_error>([&] { (void)psx::quantize_int8(x, 1, 4, false); }) ==
        "psx::quantize_int8: a 1 x 4 tensor has 4 values, 6 given");
  std::vector<float> small(5);
  CHECK_THROWS_AS(psx::dequantize(c, small), psx::shape_error);
  CHECK(message_of<psx::shape_error>([&] { (void)psx::quantize_int8({}, SIZE_MAX, 0, true); }) ==
        "psx::quantize_int8: 18446744073709551615 rows (of 0 values) are more scales than memory holds");
  CHECK(psx::quantize_int8({}, 5, 0, true).scales == std::vector<float>(5, 1.0f));  // empty rows: scale 1 each
  // A max below 127 x FLT_MIN: max / 127 would lose bits (or be 0), so the
  // scale stays FLT_MIN and the values become exact multiples of it.
  const std::vector<float> tiny{5.04e-44f, -2.0e-44f, 0.0f, 1.0e-30f, -3.0e-31f, 0.0f};
  const psx::QuantizedInt8 sq = psx::quantize_int8(tiny, 2, 3, true);
  CHECK(sq.scales[0] == FLT_MIN);
  CHECK(sq.scales[1] == 1.0e-30f / 127.0f);  // a normal scale: as before
  std::vector<float> tiny_back(6);
  psx::dequantize(sq, tiny_back);
  CHECK(tiny_back[0] == 0.0f);  // 5.04e-44 is under half of FLT_MIN
  CHECK(tiny_back[2] == 0.0f);
  CHECK(std::abs(tiny_back[3] - tiny[3]) <= sq.scales[1] / 2);
  CHECK(std::abs(tiny_back[4] - tiny[4]) <= sq.scales[1] / 2);
  const std::vector<float> subnormal_rows{1.0e-38f, -6.0e-39f};
  const psx::QuantizedInt8 n = psx::quantize_int8(subnormal_rows, 1, 2, false);
  CHECK(n.scales[0] == FLT_MIN);
  CHECK(std::vector<int>(n.values.begin(), n.values.end()) == std::vector<int>{1, -1});  // 0.85 and 0.51 of FLT_MIN
  std::vector<float> n_back(2);
  psx::dequantize(n, n_back);
  CHECK(n_back == std::vector<float>{FLT_MIN, -FLT_MIN});
  // max |x| = FLT_MAX: FLT_MAX / 127 rounds up, and 127 times it was
  // infinite (a finite parameter dequantized to inf); one step down keeps it
  // finite, 127 still.
  const std::vector<float> huge{FLT_MAX, -FLT_MAX, 1.0f};
  const psx::QuantizedInt8 hq = psx::quantize_int8(huge, 1, 3, false);
  CHECK(hq.scales[0] == std::nextafter(FLT_MAX / 127.0f, 0.0f));
  CHECK(std::vector<int>(hq.values.begin(), hq.values.end()) == std::vector<int>{127, -127, 0});
  std::vector<float> huge_back(3);
  psx::dequantize(hq, huge_back);
  CHECK(std::isfinite(huge_back[0]));
  CHECK(huge_back[0] == 127.0f * hq.scales[0]);
  CHECK(huge_back[1] == -huge_back[0]);
  CHECK(huge_back[0] > 0.999999f * FLT_MAX);  // within a part in a million of FLT_MAX
}

}  // namespace

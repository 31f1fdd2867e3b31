// Tests of psx/gradients.hpp: the clipping functions against hand-computed
// values (TensorFlow's semantics, inf and NaN included), and the gradient
// pipeline on a running cluster: accumulation, sparse rows, clipping after
// accumulation, stage order, frozen variables, and errors that change nothing.
#include "../support.hpp"

#include <psx/gradients.hpp>
#include <psx/psx.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <span>
#include <string>
#include <vector>

using psx_test::message_of;
using psx_test::Watchdog;

namespace {

using Cluster = psx::ParameterServer<psx::partition::RowRange, psx::sync::Synchronous, psx::optim::SGD>;
using Floats = std::vector<float>;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Two servers, so that variables are split across them; lr = 1: a parameter
// starting at 0 ends at minus the sum of the gradients pushed.
struct Fixture {
  Cluster ps{{2, 1}, {}, {}, psx::optim::SGD{.lr = 1.0f}};
};

Floats pulled(psx::Worker& w, std::string_view name) {
  Floats out(w.variable(name).meta.size());
  w.pull(name, out);
  return out;
}

bool all_nan(std::span<const float> g) {
  for (const float x : g)
    if (!std::isnan(x)) return false;
  return true;
}

}  // namespace

// -- the clipping functions ---------------------------------------------------

TEST_CASE("gradients: clip_by_value clamps every element to [lo, hi] and keeps NaN") {
  Floats g{-3.0f, -0.5f, 0.0f, 2.0f, 7.0f, kInf, -kInf, kNaN};
  psx::clip_by_value(g, -1.0f, 2.0f);
  CHECK(std::vector(g.begin(), g.end() - 1) == Floats{-1.0f, -0.5f, 0.0f, 2.0f, 2.0f, 2.0f, -1.0f});
  CHECK(std::isnan(g.back()));

  Floats same{-2.0f, 5.0f};
  psx::clip_by_value(same, 1.5f, 1.5f);  // lo == hi is allowed
  CHECK(same == Floats{1.5f, 1.5f});
  Floats open{-1e30f, 1e30f};
  psx::clip_by_value(open, -kInf, kInf);
  CHECK(open == Floats{-1e30f, 1e30f});
}

TEST_CASE("gradients: clip_by_norm rescales a tensor whose l2 norm exceeds clip_norm, and returns that norm") {
  Floats g{3.0f, 4.0f};
  CHECK(psx::clip_by_norm(g, 2.5f) == 5.0f);
  CHECK(g == Floats{1.5f, 2.0f});

  for (const float clip : {5.0f, 10.0f}) {  // norm <= clip_norm: left exactly as it is
    Floats h{3.0f, 4.0f};
    CHECK(psx::clip_by_norm(h, clip) == 5.0f);
    CHECK(h == Floats{3.0f, 4.0f});
  }
  Floats zero{0.0f, 0.0f, 0.0f};
  CHECK(psx::clip_by_norm(zero, 1.0f) == 0.0f);
  CHECK(zero == Floats{0.0f, 0.0f, 0.0f});
  Floats empty;
  CHECK(psx::clip_by_norm(empty, 1.0f) == 0.0f);

  // The squares are summed in double: in float, 1e20^2 overflows to inf.
  Floats big{3e20f, 4e20f};
  CHECK(psx::clip_by_norm(big, 1.0f) == doctest::Approx(5e20f));
  CHECK(big[0] == doctest::Approx(0.6f));
  CHECK(big[1] == doctest::Approx(0.8f));
}

TEST_CASE("gradients: clip_by_norm with an infinite or NaN norm behaves as TF's t * c / max(norm, c)") {
  Floats inf{kInf, 1.0f, -2.0f};
  CHECK(std::isinf(psx::clip_by_norm(inf, 1.0f)));
  CHECK(std::isnan(inf[0]));  // inf * 0
  CHECK(inf[1] == 0.0f);
  CHECK(inf[2] == 0.0f);

  Floats nan{kNaN, 1.0f};
  CHECK(std::isnan(psx::clip_by_norm(nan, 1.0f)));
  CHECK(all_nan(nan));
}

TEST_CASE("gradients: global_norm is the l2 norm of all the tensors together") {
  const Floats a{3.0f, 4.0f}, b{12.0f};
  CHECK(psx::global_norm({a, b}) == 13.0f);
  CHECK(psx::global_norm({}) == 0.0f);
  const std::vector<std::span<const float>> list{a, b, Floats{}};
  CHECK(psx::global_norm(list) == 13.0f);
  const Floats huge{1e20f, 1e20f};  // float accumulation would give inf
  CHECK(psx::global_norm({huge}) == doctest::Approx(1.41421356e20f));
  const Floats with_inf{1.0f, -kInf}, with_nan{kNaN};
  CHECK(std::isinf(psx::global_norm({a, with_inf})));
  CHECK(std::isnan(psx::global_norm({a, with_nan})));
}

TEST_CASE("gradients: clip_by_global_norm scales every tensor by clip_norm / max(global_norm, clip_norm)") {
  Floats a{3.0f, 4.0f}, b{12.0f};
  CHECK(psx::clip_by_global_norm({a, b}, 6.5f) == 13.0f);
  CHECK(a == Floats{1.5f, 2.0f});
  CHECK(b == Floats{6.0f});

  for (const float clip : {13.0f, 20.0f}) {  // global norm <= clip_norm: unchanged
    Floats c{3.0f, 4.0f}, d{12.0f};
    const std::vector<std::span<float>> list{c, d};
    CHECK(psx::clip_by_global_norm(list, clip) == 13.0f);
    CHECK(c == Floats{3.0f, 4.0f});
    CHECK(d == Floats{12.0f});
  }
  // Each tensor alone is under the clip norm; together they are not.
  Floats e{3.0f, 4.0f}, f{3.0f, 4.0f};
  psx::clip_by_global_norm({e, f}, 5.0f);
  CHECK(e[0] == doctest::Approx(3.0 / std::sqrt(2.0)));
  CHECK(f[1] == doctest::Approx(4.0 / std::sqrt(2.0)));
}

TEST_CASE("gradients: an infinite or NaN global norm turns every element of every tensor into NaN, as TF does") {
  Floats a{3.0f, kInf}, b{1.0f, 2.0f};
  CHECK(std::isinf(psx::clip_by_global_norm({a, b}, 100.0f)));
  CHECK(all_nan(a));
  CHECK(all_nan(b));

  Floats c{kNaN}, d{0.5f};
  CHECK(std::isnan(psx::clip_by_global_norm({c, d}, 100.0f)));
  CHECK(all_nan(c));
  CHECK(all_nan(d));
}

TEST_CASE("gradients: bad clipping arguments raise config_error naming the call") {
  Floats g{1.0f};
  CHECK(message_of<psx::config_error>([&] { psx::clip_by_value(g, 2.0f, 1.0f); }) ==
        "psx: clip_by_value(2, 1): lo must be <= hi");
  CHECK(message_of<psx::config_error>([&] { psx::clip_by_value(g, kNaN, 1.0f); }) ==
        "psx: clip_by_value(nan, 1): the bounds must not be NaN");
  CHECK(message_of<psx::config_error>([&] { psx::clip_by_norm(g, 0.0f); }) ==
        "psx: clip_by_norm(0): the norm must be > 0");
  CHECK(message_of<psx::config_error>([&] { psx::clip_by_norm(g, kNaN); }) ==
        "psx: clip_by_norm(nan): the norm must be > 0");
  CHECK(message_of<psx::config_error>([&] { psx::clip_by_norm(g, kInf); }) ==
        "psx: clip_by_norm(inf): the norm must be finite (leave the stage out not to clip)");
  CHECK(message_of<psx::config_error>([&] { psx::clip_by_global_norm({g}, -1.0f); }) ==
        "psx: clip_by_global_norm(-1): the norm must be > 0");
  CHECK(g == Floats{1.0f});

  psx::GradientPipeline pipe;
  CHECK(message_of<psx::config_error>([&] { pipe.clip_by_global_norm(-1.0f); }) ==
        "psx: GradientPipeline: clip_by_global_norm(-1): the norm must be > 0");
  CHECK(message_of<psx::config_error>([&] { pipe.clip_by_norm(-0.5f); }) ==
        "psx: GradientPipeline: clip_by_norm(-0.5): the norm must be > 0");
  CHECK(message_of<psx::config_error>([&] { pipe.clip_by_value(1.0f, -1.0f); }) ==
        "psx: GradientPipeline: clip_by_value(1, -1): lo must be <= hi");
  CHECK(message_of<psx::config_error>([&] { pipe.accumulate(0); }) ==
        "psx: GradientPipeline: accumulate(0): k must be >= 1");
  std::ostringstream os;
  os << pipe;
  CHECK(os.str() == "GradientPipeline{accumulate(1, mean)}");  // nothing was added
}

TEST_CASE("gradients: a GradientPipeline prints its stages in order") {
  psx::GradientPipeline pipe;
  pipe.accumulate(4, psx::Accumulate::sum)
      .clip_by_value(-1.0f, 1.0f)
      .clip_by_norm(2.5f)
      .clip_by_global_norm(5.0f)
      .freeze("bias")
      .freeze("emb")
      .unfreeze("emb");
  std::ostringstream os;
  os << pipe;
  CHECK(os.str() ==
        "GradientPipeline{accumulate(4, sum), clip_by_value(-1, 1), clip_by_norm(2.5), clip_by_global_norm(5), "
        "frozen: [bias]}");
  CHECK(pipe.frozen("bias"));
  CHECK_FALSE(pipe.frozen("emb"));
}

// -- the pipeline on a cluster -------------------------------------------------

TEST_CASE("gradients: without stages a pipeline forwards every micro-batch as it is") {
  Watchdog dog("forwarding pipeline");
  Fixture f;
  f.ps.declare(psx::dense("a", {2}));
  f.ps.declare(psx::sparse("emb", 4, 2));
  auto w = f.ps.worker(0);
  psx::GradientPipeline pipe;
  CHECK(std::isnan(pipe.last_global_norm()));
  const Floats g{3.0f, 4.0f}, rows{1.0f, 2.0f};
  const std::vector<std::uint64_t> ids{2};
  CHECK(pipe.push(w, {{"a", g}}, {{"emb", ids, rows}}));
  CHECK(pipe.pending() == 0);
  CHECK(pipe.last_global_norm() == doctest::Approx(std::sqrt(30.0)));
  w.step();
  CHECK(pulled(w, "a") == Floats{-3.0f, -4.0f});
  CHECK(pulled(w, "emb") == Floats{0, 0, 0, 0, -1, -2, 0, 0});
  CHECK(pipe.push(w, {{"a", g}}));
  w.step();
  CHECK(pulled(w, "a") == Floats{-6.0f, -8.0f});
}

TEST_CASE("gradients: accumulate(3) pushes the mean of 3 micro-batches on every 3rd call, and nothing before") {
  Watchdog dog("accumulate mean");
  Fixture f;
  f.ps.declare(psx::dense("a", {2}));
  f.ps.declare(psx::dense("b", {3}));
  auto w = f.ps.worker(0);
  psx::GradientPipeline pipe;
  pipe.accumulate(3);
  const std::vector<Floats> ga{{3, -6}, {0, 3}, {6, 0}}, gb{{1, 2, 3}, {1, 2, 3}, {4, 5, 6}};
  // means: a {3, -1}, b {2, 3, 4}
  for (float window = 1; window <= 2; ++window) {
    for (std::size_t m = 0; m < 3; ++m) {
      const bool pushed = pipe.push(w, {{"a", ga[m]}, {"b", gb[m]}});
      CHECK(pushed == (m == 2));
      CHECK(pipe.pending() == (m + 1) % 3);
      if (pushed) w.step();
      const float moved = pushed ? window : window - 1;  // windows applied so far
      CHECK(pulled(w, "a") == Floats{-3 * moved, 1 * moved});
      CHECK(pulled(w, "b") == Floats{-2 * moved, -3 * moved, -4 * moved});
    }
    CHECK(pipe.last_global_norm() == doctest::Approx(std::sqrt(39.0)));  // of the mean
  }
}

TEST_CASE("gradients: Accumulate::sum pushes the sum of the k micro-batches") {
  Watchdog dog("accumulate sum");
  Fixture f;
  f.ps.declare(psx::dense("a", {2}));
  auto w = f.ps.worker(0);
  psx::GradientPipeline pipe;
  pipe.accumulate(2, psx::Accumulate::sum);
  const Floats g1{1.0f, 2.0f}, g2{3.0f, 4.0f};
  CHECK_FALSE(pipe.push(w, {{"a", g1}}));
  CHECK(pipe.push(w, {{"a", g2}}));
  w.step();
  CHECK(pulled(w, "a") == Floats{-4.0f, -6.0f});
  CHECK(pipe.last_global_norm() == doctest::Approx(std::sqrt(52.0)));
}

TEST_CASE("gradients: a variable missing from some micro-batches counts as zero there") {
  Watchdog dog("missing variable");
  Fixture f;
  f.ps.declare(psx::dense("a", {1}));
  f.ps.declare(psx::dense("b", {1}));
  auto w = f.ps.worker(0);
  psx::GradientPipeline pipe;
  pipe.accumulate(2);
  const Floats g{4.0f};
  CHECK_FALSE(pipe.push(w, {{"a", g}}));
  CHECK(pipe.push(w, {{"b", g}}));
  w.step();
  CHECK(pulled(w, "a") == Floats{-2.0f});
  CHECK(pulled(w, "b") == Floats{-2.0f});
}

TEST_CASE("gradients: row gradients accumulate by concatenation, and their norm counts duplicates as given") {
  Watchdog dog("accumulate rows");
  Fixture f;
  f.ps.declare(psx::sparse("emb", 5, 2));
  f.ps.declare(psx::dense("a", {1}));
  auto w = f.ps.worker(0);
  psx::GradientPipeline pipe;
  pipe.accumulate(2);
  // example-begin rows
  const std::vector<std::uint64_t> ids1{1, 3}, ids2{3, 3};
  const std::vector<float> rows1{1, 1, 2, 2}, rows2{4, 4, 6, 6};
  CHECK_FALSE(pipe.push(w, {}, {{"emb", ids1, rows1}}));
  CHECK(pipe.push(w, {}, {{"emb", ids2, rows2}}));  // ids {1, 3, 3, 3}, rows / 2
  // example-end rows
  w.step();
  // The servers sum repeated ids: row 3 gets (2 + 4 + 6) / 2.
  CHECK(pulled(w, "emb") == Floats{0, 0, -0.5f, -0.5f, 0, 0, -6, -6, 0, 0});
  // As IndexedSlices: 0.5^2 * 2 + 1^2 * 2 + 2^2 * 2 + 3^2 * 2, not (0.5^2 + 6^2) * 2 once merged.
  CHECK(pipe.last_global_norm() == doctest::Approx(std::sqrt(28.5)));

  // Dense and rows in the same micro-batches, and the rows buffer restarts.
  const Floats g{2.0f};
  CHECK_FALSE(pipe.push(w, {{"a", g}}, {{"emb", ids1, rows1}}));
  CHECK(pipe.push(w, {{"a", g}}));
  w.step();
  CHECK(pulled(w, "emb") == Floats{0, 0, -1, -1, 0, 0, -7, -7, 0, 0});
  CHECK(pulled(w, "a") == Floats{-2.0f});
  CHECK(pipe.last_global_norm() == doctest::Approx(std::sqrt(4 + 0.25 * 2 + 1 * 2)));
}

TEST_CASE("gradients: clipping applies to the accumulated gradient, not to each micro-batch") {
  Watchdog dog("clip after accumulation");
  Fixture f;
  f.ps.declare(psx::dense("a", {2}));
  auto w = f.ps.worker(0);
  psx::GradientPipeline pipe;
  pipe.accumulate(2).clip_by_global_norm(1.0f);
  const Floats g1{6.0f, 8.0f}, g2{0.0f, 0.0f};
  CHECK_FALSE(pipe.push(w, {{"a", g1}}));
  CHECK(pipe.push(w, {{"a", g2}}));
  w.step();
  // The mean {3, 4} (norm 5) clipped to norm 1; clipping each micro-batch
  // first would give the mean of {0.6, 0.8} and {0, 0}: {0.3, 0.4}.
  const Floats a = pulled(w, "a");
  CHECK(a[0] == doctest::Approx(-0.6f));
  CHECK(a[1] == doctest::Approx(-0.8f));
  CHECK(pipe.last_global_norm() == doctest::Approx(5.0f));
}

TEST_CASE("gradients: clipping stages run in the order they were added") {
  Watchdog dog("stage order");
  Fixture f;
  for (const char* name : {"a", "b", "c", "e"}) f.ps.declare(psx::dense(name, {2}));
  for (const char* name : {"d", "f"}) f.ps.declare(psx::dense(name, {1}));
  auto w = f.ps.worker(0);
  const Floats g{3.0f, 4.0f}, h{12.0f};

  psx::GradientPipeline value_first, norm_first;
  value_first.clip_by_value(-1.0f, 1.0f).clip_by_global_norm(1.0f);
  norm_first.clip_by_global_norm(1.0f).clip_by_value(-1.0f, 1.0f);
  CHECK(value_first.push(w, {{"a", g}}));  // {1, 1}, then / sqrt(2)
  CHECK(norm_first.push(w, {{"b", g}}));   // {0.6, 0.8}, then within [-1, 1]
  CHECK(value_first.last_global_norm() == 5.0f);

  psx::GradientPipeline each, global;
  each.clip_by_norm(5.0f);          // {3, 4} has norm 5: kept; {12} becomes {5}
  global.clip_by_global_norm(6.5f);  // the global norm 13 halves both
  CHECK(each.push(w, {{"c", g}, {"d", h}}));
  CHECK(global.push(w, {{"e", g}, {"f", h}}));
  w.step();

  const Floats a = pulled(w, "a"), b = pulled(w, "b");
  CHECK(a[0] == doctest::Approx(-1.0 / std::sqrt(2.0)));
  CHECK(a[1] == doctest::Approx(-1.0 / std::sqrt(2.0)));
  CHECK(b[0] == doctest::Approx(-0.6f));
  CHECK(b[1] == doctest::Approx(-0.8f));
  CHECK(pulled(w, "c") == Floats{-3.0f, -4.0f});
  CHECK(pulled(w, "d") == Floats{-5.0f});
  CHECK(pulled(w, "e") == Floats{-1.5f, -2.0f});
  CHECK(pulled(w, "f") == Floats{-6.0f});
}

TEST_CASE("gradients: a frozen variable is neither accumulated, nor counted in the global norm, nor pushed") {
  Watchdog dog("frozen in the pipeline");
  Fixture f;
  f.ps.declare(psx::dense("a", {2}));
  f.ps.declare(psx::dense("b", {1}));
  auto w = f.ps.worker(0);
  psx::GradientPipeline pipe;
  pipe.accumulate(2).clip_by_global_norm(2.5f).freeze("b");
  const Floats ga{3.0f, 4.0f}, gb{100.0f}, wrong_size{1.0f, 2.0f, 3.0f};
  CHECK_FALSE(pipe.push(w, {{"a", ga}, {"b", gb}}));
  CHECK(pipe.push(w, {{"a", ga}, {"b", wrong_size}}));  // dropped unchecked
  w.step();
  CHECK(pipe.last_global_norm() == 5.0f);  // b's 100 left out
  CHECK(pulled(w, "a") == Floats{-1.5f, -2.0f});
  CHECK(pulled(w, "b") == Floats{0.0f});

  // Unfrozen, it counts again; frozen mid-window, what it had is dropped.
  pipe.unfreeze("b");
  const Floats zero{0.0f, 0.0f}, one{1.0f}, three{3.0f};
  CHECK_FALSE(pipe.push(w, {{"a", zero}, {"b", one}}));
  CHECK(pipe.push(w, {{"a", zero}, {"b", three}}));
  w.step();
  CHECK(pulled(w, "b") == Floats{-2.0f});
  CHECK_FALSE(pipe.push(w, {{"a", ga}, {"b", one}}));
  pipe.freeze("a");
  CHECK(pipe.push(w, {{"b", one}}));
  w.step();
  CHECK(pulled(w, "a") == Floats{-1.5f, -2.0f});
  CHECK(pulled(w, "b") == Floats{-3.0f});
  CHECK(pipe.last_global_norm() == 1.0f);
}

TEST_CASE("gradients: a bad micro-batch raises a typed error naming the variable and sizes, and accumulates nothing") {
  Watchdog dog("bad micro-batch");
  Fixture f;
  f.ps.declare(psx::dense("a", {2}));
  f.ps.declare(psx::dense("b", {1}));
  f.ps.declare(psx::sparse("emb", 4, 2));
  f.ps.declare(psx::dense("fixed", {1}, psx::Initializer::zeros(), /*trainable=*/false));
  auto w = f.ps.worker(0);
  psx::GradientPipeline pipe;
  pipe.accumulate(3);
  const Floats a1{3.0f, 3.0f}, b1{3.0f};
  CHECK_FALSE(pipe.push(w, {{"a", a1}, {"b", b1}}));

  // "a" comes first and is fine: it must not be accumulated either.
  const Floats a_bad{100.0f, 100.0f}, b_bad{1.0f, 2.0f};
  CHECK(message_of<psx::shape_error>([&] { pipe.push(w, {{"a", a_bad}, {"b", b_bad}}); }) ==
        "psx: GradientPipeline: micro-batch 2 of 3: the gradient of 'b' has 2 floats, the one accumulated so far "
        "has 1 float (shape [1]); nothing of this micro-batch was accumulated");
  const std::vector<std::uint64_t> ids{0}, bad_ids{4};
  const Floats row{1.0f, 1.0f}, short_row{1.0f};
  CHECK(message_of<psx::shape_error>([&] { pipe.push(w, {{"a", a_bad}}, {{"emb", ids, short_row}}); }) ==
        "psx: GradientPipeline: micro-batch 2 of 3: 1 row of 'emb' (row width 2) needs 2 floats, the gradient has "
        "1 float; nothing of this micro-batch was accumulated");
  CHECK(message_of<psx::row_out_of_range>([&] { pipe.push(w, {{"a", a_bad}}, {{"emb", bad_ids, row}}); }) ==
        "psx: GradientPipeline: micro-batch 2 of 3: row id 4 at position 0 of 'emb' (4 rows) is out of range; "
        "nothing of this micro-batch was accumulated");
  CHECK(message_of<psx::frozen_variable>([&] { pipe.push(w, {{"a", a_bad}, {"fixed", b1}}); }) ==
        "psx: GradientPipeline: micro-batch 2 of 3: a gradient for 'fixed', which the servers hold frozen "
        "(trainable = false); freeze(\"fixed\") drops it in the pipeline; nothing of this micro-batch was "
        "accumulated");
  CHECK(message_of<psx::unknown_variable>([&] { pipe.push(w, {{"a", a_bad}, {"nope", b1}}); }) ==
        "psx: GradientPipeline: micro-batch 2 of 3: worker 0: lookup of unknown variable 'nope' (declared: a, b, "
        "emb, fixed); nothing of this micro-batch was accumulated");
  CHECK(pipe.pending() == 1);

  const Floats a2{0.0f, 3.0f}, zero2{0.0f, 0.0f}, zero1{0.0f};
  CHECK_FALSE(pipe.push(w, {{"a", a2}, {"b", b1}}));
  CHECK(pipe.push(w, {{"a", zero2}, {"b", zero1}}));
  w.step();
  CHECK(pulled(w, "a") == Floats{-1.0f, -2.0f});
  CHECK(pulled(w, "b") == Floats{-2.0f});
  CHECK(pulled(w, "emb") == Floats(8, 0.0f));

  // A variable seen for the first time is checked against its declaration.
  psx::GradientPipeline fresh;
  fresh.clip_by_norm(1.0f);
  const Floats three{1.0f, 2.0f, 3.0f};
  CHECK(message_of<psx::shape_error>([&] { fresh.push(w, {{"a", three}}); }) ==
        "psx: GradientPipeline: micro-batch 1 of 1: the gradient of 'a' has 3 floats, the variable has 2 floats "
        "(shape [2]); nothing of this micro-batch was accumulated");
}

TEST_CASE("gradients: a dynamic table's rows go through the pipeline by any 64-bit id, a dense gradient for it is refused") {
  Watchdog dog("dynamic table");
  Fixture f;
  f.ps.declare(psx::embedding("tab", 2, psx::Initializer::zeros()));
  f.ps.declare(psx::dense("a", {1}));
  auto w = f.ps.worker(0);
  psx::GradientPipeline pipe;
  pipe.accumulate(2);
  constexpr std::uint64_t top = std::numeric_limits<std::uint64_t>::max();
  const std::vector<std::uint64_t> ids1{top, 12345}, ids2{12345};
  const Floats rows1{2, 2, 4, 4}, rows2{6, 6}, g{1.0f};
  CHECK_FALSE(pipe.push(w, {{"a", g}}, {{"tab", ids1, rows1}}));
  // The whole table as a dense gradient: the worker would refuse it at the push.
  CHECK(message_of<psx::shape_error>([&] { pipe.push(w, {{"a", g}, {"tab", g}}); }) ==
        "psx: GradientPipeline: micro-batch 2 of 2: a dense gradient for 'tab', a dynamic table: it has no whole "
        "value; give its rows by id (RowsGrad); nothing of this micro-batch was accumulated");
  CHECK(pipe.pending() == 1);
  CHECK(pipe.push(w, {{"a", g}}, {{"tab", ids2, rows2}}));  // the mean of the two
  w.step();
  const std::vector<std::uint64_t> look{top, 12345, 7};
  Floats rows(6);
  w.pull_rows("tab", look, rows);
  CHECK(rows == Floats{-1, -1, -5, -5, 0, 0});
  CHECK(pulled(w, "a") == Floats{-1.0f});
}

TEST_CASE("gradients: reset() drops the accumulated micro-batches, a failed push drops them too") {
  Watchdog dog("reset");
  Fixture f;
  f.ps.declare(psx::dense("a", {1}));
  auto w = f.ps.worker(0);
  psx::GradientPipeline pipe;
  pipe.accumulate(2, psx::Accumulate::sum);
  const Floats g1{100.0f}, g2{1.0f}, g3{2.0f};
  CHECK_FALSE(pipe.push(w, {{"a", g1}}));
  const psx::GradientPipeline copy = pipe;  // a value: it keeps its own micro-batch
  CHECK(message_of<psx::config_error>([&] { pipe.accumulate(4); }) ==
        "psx: GradientPipeline: accumulate(4) with 1 micro-batch pending: push or reset() first");
  pipe.reset();
  CHECK(pipe.pending() == 0);
  CHECK(copy.pending() == 1);
  CHECK_FALSE(pipe.push(w, {{"a", g2}}));
  CHECK(pipe.push(w, {{"a", g3}}));
  w.step();
  CHECK(pulled(w, "a") == Floats{-3.0f});

  CHECK_FALSE(pipe.push(w, {{"a", g1}}));
  f.ps.shutdown();
  CHECK_THROWS_AS(pipe.push(w, {{"a", g2}}), psx::shutdown_error);
  CHECK(pipe.pending() == 0);
}

TEST_CASE("gradients: the documented example trains with accumulation and global-norm clipping") {
  Watchdog dog("documented example");
  // example-begin gradients
  psx::ParameterServer<psx::partition::RowRange, psx::sync::Synchronous, psx::optim::SGD> ps(
      {1, 2}, {}, {}, psx::optim::SGD{.lr = 0.5f});
  ps.declare(psx::dense("w", {4}));
  const std::vector<float> target{1, -2, 3, -4};
  ps.run([&](psx::Worker& w) {
    psx::GradientPipeline pipe;
    pipe.accumulate(4).clip_by_global_norm(1.0f);  // one step per 4 micro-batches
    std::vector<float> x(4), grad(4);
    for (int batch = 0; batch < 200; ++batch) {
      w.pull("w", x);
      for (std::size_t i = 0; i < 4; ++i) grad[i] = x[i] - target[i];  // of |x - target|^2 / 2
      if (pipe.push(w, {{"w", grad}})) w.step();
    }
  });
  // example-end gradients
  const auto x = ps.read("w");
  for (std::size_t i = 0; i < 4; ++i) CHECK(x[i] == doctest::Approx(target[i]).epsilon(1e-3));
}

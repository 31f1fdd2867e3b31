// Dynamic embedding tables (psx/embedding.hpp): initial values of unseen
// ids, admission, eviction, memory cap, delta export, consistent hashing,
// the table under 8 threads, and the table inside a cluster.
#include <psx/psx.hpp>

#include <doctest/doctest.h>

#include "../support.hpp"

#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

using psx::Admission;
using psx::DynamicTable;
using psx::TableOptions;
using psx::UpdateContext;
using psx_test::message_of;

constexpr std::uint64_t max_id = std::numeric_limits<std::uint64_t>::max();

UpdateContext at_step(std::uint64_t step) { return UpdateContext{step, 1.0, nullptr, step, true}; }

// One gradient row per id, every element `g`.
void push(DynamicTable<psx::optim::SGD>& t, const psx::optim::SGD& o, std::vector<std::uint64_t> ids, float g,
          std::uint64_t step, std::size_t dim) {
  std::vector<float> grads(ids.size() * dim, g);
  t.push(o, ids, grads, at_step(step));
}

std::vector<float> pull(const DynamicTable<psx::optim::SGD>& t, std::uint64_t id, std::size_t dim,
                        std::uint64_t step = 0) {
  std::vector<float> out(dim);
  const std::uint64_t ids[] = {id};
  t.pull(ids, {}, out, step);
  return out;
}

std::vector<float> initial(const psx::Initializer& init, const char* name, std::uint64_t id, std::size_t dim) {
  std::vector<float> out(dim);
  init.fill_row(name, id, out);
  return out;
}

// The inverse of splitmix64's finalizer (detail::mix64): the id whose hash is `h`.
std::uint64_t unmix64(std::uint64_t z) {
  auto inverse = [](std::uint64_t a) {  // a * inverse == 1 (mod 2^64), Newton's iteration
    std::uint64_t x = a;
    for (int i = 0; i < 6; ++i) x *= 2 - a * x;
    return x;
  };
  z ^= z >> 31 ^ z >> 62;
  z *= inverse(0x94d049bb133111ebull);
  z ^= z >> 27 ^ z >> 54;
  z *= inverse(0xbf58476d1ce4e5b9ull);
  z ^= z >> 30 ^ z >> 60;
  return z - 0x9e3779b97f4a7c15ull;
}

}  // namespace

TEST_CASE("embedding: an unseen id pulls its initial value, deterministic per id and seed, and stores nothing") {
  const auto init = psx::Initializer::normal(0.0f, 0.5f, 11);
  DynamicTable<psx::optim::SGD> t("emb", 8, init, {}, {});
  for (const std::uint64_t id : {std::uint64_t{0}, std::uint64_t{1}, std::uint64_t{42}, max_id}) {
    CHECK(pull(t, id, 8) == initial(init, "emb", id, 8));
    CHECK(pull(t, id, 8) == pull(t, id, 8));
  }
  CHECK(pull(t, 1, 8) != pull(t, 2, 8));
  CHECK(initial(psx::Initializer::normal(0.0f, 0.5f, 12), "emb", 1, 8) != initial(init, "emb", 1, 8));
  CHECK(initial(init, "other", 1, 8) != initial(init, "emb", 1, 8));
  CHECK(t.size() == 0);
  CHECK(t.stats().admitted == 0);
  CHECK(!t.contains(0));
  // The values follow the distribution: mean 0, standard deviation 0.5.
  double sum = 0, squares = 0;
  for (std::uint64_t id = 0; id < 4000; ++id)
    for (float x : initial(init, "emb", id * 0x9e3779b97f4a7c15ull, 8)) {
      sum += x;
      squares += double{x} * x;
    }
  CHECK(std::abs(sum / 32000) < 0.02);
  CHECK(std::abs(std::sqrt(squares / 32000) - 0.5) <= 0.015);  // 3% of it
}

TEST_CASE("embedding: rows carry their own optimizer slots") {
  const psx::optim::Adagrad opt{.lr = 0.5, .lr_decay = 0.0, .weight_decay = 0.0, .initial_accumulator_value = 0.25};
  const auto init = psx::Initializer::uniform(-1.0f, 1.0f, 3);
  DynamicTable<psx::optim::Adagrad> t("emb", 4, init, {}, opt);
  // Reference: the optimizer on a row and slot of our own.
  std::vector<float> w = initial(init, "emb", 9, 4), acc(4, 0.25f);
  float* bases[] = {acc.data()};
  const std::vector<float> g1{0.1f, -0.2f, 0.3f, 0.0f}, g2{1.0f, 1.0f, -1.0f, 2.0f};
  const std::uint64_t ids[] = {9};
  for (std::uint64_t step = 1; step <= 2; ++step) {
    const auto& g = step == 1 ? g1 : g2;
    t.push(opt, ids, g, at_step(step));
    opt.update(w, g, psx::SlotView(bases, 1, 0, 4), at_step(step));
  }
  std::vector<float> got(4);
  t.pull(ids, {}, got, 3);
  CHECK(got == w);
  // Another id starts from its own initial value and a fresh accumulator.
  const std::uint64_t other[] = {10};
  t.push(opt, other, g1, at_step(3));
  std::vector<float> w2 = initial(init, "emb", 10, 4), acc2(4, 0.25f);
  float* bases2[] = {acc2.data()};
  opt.update(w2, g1, psx::SlotView(bases2, 1, 0, 4), at_step(3));
  t.pull(other, {}, got, 3);
  CHECK(got == w2);
  CHECK(t.stats().rows == 2);
  CHECK(t.stats().ideal_row_bytes == 4 * 4 * 2);
}

TEST_CASE("embedding: calls too large for the kept working memory alternate with small ones, each exact") {
  // A call of more than 2^16 ids gives its thread's working memory back
  // when it returns; the calls around it reuse theirs. SGD with lr 0.5 and
  // gradients of 1: every row is its initial value plus -0.5 times the
  // number of times its id was pushed in each call, exactly.
  const psx::optim::SGD opt{0.5f};
  const auto init = psx::Initializer::uniform(-1.0f, 1.0f, 11);
  constexpr std::size_t dim = 3, distinct = 5000;
  DynamicTable<psx::optim::SGD> t("emb", dim, init, {}, opt);
  std::vector<std::vector<float>> want(distinct);
  for (std::uint64_t id = 0; id < distinct; ++id) want[id] = initial(init, "emb", id, dim);
  std::mt19937_64 rng(5);
  for (const std::size_t n : {100000, 7, 70000, 1, 200000, 64}) {
    CAPTURE(n);
    std::vector<std::uint64_t> ids(n);
    std::vector<float> count(distinct, 0.0f);
    for (auto& id : ids) count[id = rng() % distinct] += 1.0f;
    push(t, opt, ids, 1.0f, 1, dim);
    for (std::uint64_t id = 0; id < distinct; ++id)
      if (count[id] != 0.0f)
        for (float& w : want[id]) w = w + -0.5f * count[id];
    std::vector<float> got(n * dim);
    t.pull(ids, {}, got, 1);
    std::size_t wrong = 0;
    for (std::size_t j = 0; j < n; ++j)
      wrong += !std::equal(want[ids[j]].begin(), want[ids[j]].end(), got.begin() + static_cast<std::ptrdiff_t>(j * dim));
    CHECK(wrong == 0);
  }
}

TEST_CASE("embedding: admission after n pushes stores an id at its n-th push") {
  const psx::optim::SGD sgd{.lr = 1.0};
  TableOptions o;
  o.admission = Admission::after_pushes(3, 1u << 12, 4);
  const auto init = psx::Initializer::constant(1.0f);
  DynamicTable<psx::optim::SGD> t("emb", 2, init, o, sgd);
  // Two pushes in one call count once: the call's rows are summed first.
  push(t, sgd, {7, 7}, 0.5f, 1, 2);
  CHECK(!t.contains(7));
  CHECK(pull(t, 7, 2) == std::vector<float>{1.0f, 1.0f});
  push(t, sgd, {7, 8}, 0.5f, 2, 2);
  CHECK(!t.contains(7));
  CHECK(!t.contains(8));
  CHECK(t.stats().refused == 3);
  push(t, sgd, {7}, 0.25f, 3, 2);  // the third push: stored, and this gradient applied
  CHECK(t.contains(7));
  CHECK(pull(t, 7, 2) == std::vector<float>{0.75f, 0.75f});
  CHECK(!t.contains(8));
  push(t, sgd, {7}, 0.25f, 4, 2);
  CHECK(pull(t, 7, 2) == std::vector<float>{0.5f, 0.5f});
  const psx::TableStats s = t.stats();
  CHECK(s.admitted == 1);
  CHECK(s.refused == 3);
  CHECK(s.rows == 1);
}

TEST_CASE("embedding: admission with probability p, the same coins for the same seed") {
  const psx::optim::SGD sgd{.lr = 1.0};
  TableOptions o;
  o.admission = Admission::with_probability(0.25, 5);
  DynamicTable<psx::optim::SGD> a("emb", 1, {}, o, sgd), b("emb", 1, {}, o, sgd);
  std::vector<std::uint64_t> ids(20000);
  for (std::size_t k = 0; k < ids.size(); ++k) ids[k] = psx::detail::mix64(k);
  push(a, sgd, ids, 1.0f, 1, 1);
  push(b, sgd, ids, 1.0f, 1, 1);
  const double admitted = static_cast<double>(a.size()) / static_cast<double>(ids.size());
  // Binomial: a standard deviation of 0.003 over 20000 coins; doctest's
  // Approx would allow 0.1 either way (its epsilon scales 1 + the value).
  CHECK(std::abs(admitted - 0.25) <= 0.02);
  for (const std::uint64_t id : ids) REQUIRE(a.contains(id) == b.contains(id));
  CHECK(a.stats().refused == ids.size() - a.size());
  // Each later push flips a new coin: a quarter of the refused get in.
  const std::size_t before = a.size();
  push(a, sgd, ids, 1.0f, 2, 1);
  const double second = static_cast<double>(a.size() - before) / static_cast<double>(ids.size() - before);
  CHECK(std::abs(second - 0.25) <= 0.02);
}

TEST_CASE("embedding: rows not updated within the time to live are evicted") {
  const psx::optim::SGD sgd{.lr = 1.0};
  TableOptions o;
  o.ttl_steps = 3;
  o.ttl_sweep_steps = 1;
  DynamicTable<psx::optim::SGD> t("emb", 2, psx::Initializer::constant(2.0f), o, sgd);
  push(t, sgd, {1, 2}, 1.0f, 1, 2);  // both updated at step 1
  for (std::uint64_t step = 2; step <= 4; ++step) {
    push(t, sgd, {1}, 0.0f, step, 2);  // id 1 stays fresh; pulls do not renew id 2
    (void)pull(t, 2, 2, step);
    CHECK(t.contains(2));  // 1 + 3 < step is false up to step 4
  }
  push(t, sgd, {1}, 0.0f, 5, 2);
  CHECK(!t.contains(2));
  CHECK(t.contains(1));
  CHECK(pull(t, 2, 2) == std::vector<float>{2.0f, 2.0f});  // back to its initial value
  CHECK(t.stats().evicted_ttl == 1);
  CHECK(t.stats().evicted_memory == 0);
  // An explicit sweep far later takes the rest.
  CHECK(t.expire(100) == 1);
  CHECK(t.size() == 0);
}

TEST_CASE("embedding: an endless stream of new ids stays under the memory cap, least recently used out first") {
  const psx::optim::Adagrad opt{};
  TableOptions o;
  o.stripes = 4;
  o.memory_cap_bytes = 256 << 10;
  DynamicTable<psx::optim::Adagrad> t("emb", 16, {}, o, opt);
  std::vector<std::uint64_t> hot(40);
  for (std::size_t k = 0; k < hot.size(); ++k) hot[k] = max_id - k;
  std::vector<float> out(hot.size() * 16);
  std::uint64_t next = 0;
  std::uint64_t most = 0;
  for (std::uint64_t step = 1; step <= 400; ++step) {
    std::vector<std::uint64_t> ids(hot);
    for (int k = 0; k < 500; ++k) ids.push_back(next++);
    std::vector<float> g(ids.size() * 16, 0.1f);
    t.push(opt, ids, g, at_step(step));
    t.pull(hot, {}, out, step);
    const psx::TableStats s = t.stats();
    REQUIRE(s.bytes <= o.memory_cap_bytes);
    most = std::max(most, s.rows);
  }
  const psx::TableStats s = t.stats();
  CHECK(s.admitted == next + hot.size());
  CHECK(s.evicted_memory == s.admitted - s.rows);
  CHECK(s.evicted_memory > 150000);
  CHECK(s.rows > 500);  // the cap holds more than one step's rows
  for (const std::uint64_t id : hot) CHECK(t.contains(id));  // used every step: never the least recent
  CHECK(t.contains(next - 1));
  CHECK(!t.contains(0));
  CHECK(s.bytes_per_row() < 2.0 * static_cast<double>(s.ideal_row_bytes));
  MESSAGE("cap " << o.memory_cap_bytes << " B: " << s << ", at most " << most << " rows");
}

TEST_CASE("embedding: a full export plus its deltas equals the full export at the end") {
  const psx::optim::SGD sgd{.lr = 0.5};
  TableOptions o;
  o.stripes = 8;
  o.ttl_steps = 4;
  o.ttl_sweep_steps = 1;
  o.admission = Admission::after_pushes(2, 1u << 12, 3);
  DynamicTable<psx::optim::SGD> t("emb", 3, psx::Initializer::uniform(-1.0f, 1.0f, 1), o, sgd);
  psx::TableExport serving = t.export_rows();
  CHECK(serving.ids.empty());
  std::uint64_t deltas_with_removals = 0;
  for (std::uint64_t step = 1; step <= 60; ++step) {
    std::vector<std::uint64_t> ids;
    for (std::uint64_t k = 0; k < 30; ++k) ids.push_back(psx::detail::mix64(step * 7 + k % 11) % 97);
    ids.push_back(max_id);
    ids.push_back(0);
    push(t, sgd, ids, static_cast<float>(step % 5) - 2.0f, step, 3);
    if (step % 3 == 0) {
      const psx::TableExport delta = t.export_rows(serving.cursor);
      deltas_with_removals += !delta.removed.empty();
      serving.merge(delta);
    }
  }
  serving.merge(t.export_rows(serving.cursor));
  const psx::TableExport full = t.export_rows();
  CHECK(serving.sorted() == full.sorted());
  CHECK(full.ids.size() == t.size());
  CHECK(deltas_with_removals > 0);
  CHECK(t.stats().evicted_ttl > 0);
  // Nothing changed since: an empty delta.
  const psx::TableExport none = t.export_rows(full.cursor);
  CHECK(none.ids.empty());
  CHECK(none.removed.empty());
  // A cursor of another table (a restarted server), or from the future, is refused.
  DynamicTable<psx::optim::SGD> other("emb", 3, {}, o, sgd);
  CHECK(other.incarnation() != t.incarnation());
  CHECK_THROWS_WITH_AS(other.export_rows(full.cursor), doctest::Contains("another table"), psx::checkpoint_error);
  CHECK_THROWS_AS(t.export_rows(psx::TableCursor{{t.incarnation()}, {t.version() + 1}}), psx::checkpoint_error);
  CHECK_THROWS_AS(t.export_rows(psx::TableCursor{{t.incarnation(), 1}, {0, 0}}), psx::checkpoint_error);
}

namespace {
// An optimizer that refuses a non-finite gradient, as a user's may: it
// throws halfway through a row.
struct CheckedSGD {
  std::size_t slots() const { return 0; }
  void update(std::span<float> w, std::span<const float> g, const psx::SlotView&, const psx::UpdateContext&) const {
    for (std::size_t i = 0; i < w.size(); ++i) {
      if (!std::isfinite(g[i])) throw std::domain_error("non-finite gradient");
      w[i] -= g[i];
    }
  }
};
}  // namespace

TEST_CASE("embedding: rows an optimizer changed or admitted before it threw are in the next delta") {
  const CheckedSGD opt;
  TableOptions o;
  o.stripes = 1;  // ids applied in the order of the call
  DynamicTable<CheckedSGD> t("emb", 2, psx::Initializer::constant(0.5f), o, opt);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::uint64_t one[] = {1}, seven_one[] = {7, 1};
  const float g1[] = {1.0f, 1.0f};
  t.push(opt, one, g1, at_step(1));
  psx::TableExport serving = t.export_rows();
  // Id 7 is admitted, then its update throws at once; id 1 is not reached.
  const float g2[] = {nan, 0.0f, 1.0f, 1.0f};
  CHECK_THROWS_WITH_AS(t.push(opt, seven_one, g2, at_step(2)), "non-finite gradient", std::domain_error);
  CHECK(t.contains(7));
  psx::TableExport delta = t.export_rows(serving.cursor);
  CHECK(delta.ids == std::vector<std::uint64_t>{7});
  serving.merge(delta);
  CHECK(serving.sorted() == t.export_rows().sorted());
  // Id 1's update changes its first float, then throws.
  const float g3[] = {1.0f, nan};
  CHECK_THROWS_AS(t.push(opt, one, g3, at_step(3)), std::domain_error);
  delta = t.export_rows(serving.cursor);
  CHECK(delta.ids == std::vector<std::uint64_t>{1});
  CHECK(delta.values == std::vector<float>{-1.5f, -0.5f});
  serving.merge(delta);
  CHECK(serving.sorted() == t.export_rows().sorted());
  // Sums of another width, and exports whose floats are not their rows, are refused.
  psx::detail::RowAccumulator narrow(1);
  narrow.add(5, g1);
  CHECK_THROWS_WITH_AS(t.apply(opt, narrow, at_step(4)), doctest::Contains("1 summed rows of 1 floats to rows of 2"),
                       psx::shape_error);
  CHECK(!t.contains(5));
  psx::TableExport short_delta = t.export_rows(serving.cursor);
  short_delta.ids.push_back(9);
  CHECK(message_of<psx::checkpoint_error>([&] { serving.merge(short_delta); }) ==
        "psx: merging a delta: the delta has 1 ids and 0 floats, not rows of 2");
  psx::TableExport broken = serving;
  broken.values.pop_back();
  CHECK(message_of<psx::checkpoint_error>([&] { broken.merge(t.export_rows(serving.cursor)); }) ==
        "psx: merging a delta: the export has 2 ids and 3 floats, not rows of 2");
}

TEST_CASE("embedding: a delta from before the forgotten removals is refused") {
  const psx::optim::SGD sgd{.lr = 1.0};
  TableOptions o;
  o.stripes = 1;
  o.ttl_steps = 1;
  o.ttl_sweep_steps = 1;
  o.removal_log_limit = 8;
  DynamicTable<psx::optim::SGD> t("emb", 1, {}, o, sgd);
  auto at = [&](std::uint64_t v) { return psx::TableCursor{{t.incarnation()}, {v}}; };
  const std::uint64_t start = t.version();
  for (std::uint64_t step = 1; step <= 30; ++step) push(t, sgd, {step}, 1.0f, step, 1);  // each evicted two steps later
  CHECK(t.stats().removal_log <= 8);
  CHECK_THROWS_AS(t.export_rows(at(start)), psx::checkpoint_error);
  CHECK_NOTHROW(t.export_rows(at(t.version())));
  // Remembering none: no delta from before the last removal.
  o.removal_log_limit = 0;
  DynamicTable<psx::optim::SGD> none("emb", 1, {}, o, sgd);
  auto none_at = [&](std::uint64_t v) { return psx::TableCursor{{none.incarnation()}, {v}}; };
  push(none, sgd, {1}, 1.0f, 1, 1);
  const std::uint64_t before = none.version();
  CHECK_NOTHROW(none.export_rows(none_at(before)));
  push(none, sgd, {2}, 1.0f, 3, 1);  // the sweep at step 3 removes id 1
  CHECK(!none.contains(1));
  CHECK(none.stats().removal_log == 0);
  CHECK_THROWS_AS(none.export_rows(none_at(before)), psx::checkpoint_error);
  CHECK_NOTHROW(none.export_rows(none_at(none.version())));
  psx::TableExport a = t.export_rows(), b;
  b.dim = 2;
  CHECK_THROWS_AS(a.merge(b), psx::checkpoint_error);
  // Forgetting keeps the newer half: with room for one, the latest removal
  // is always remembered (it once forgot both at every second removal).
  o.removal_log_limit = 1;
  DynamicTable<psx::optim::SGD> one("emb", 1, {}, o, sgd);
  for (std::uint64_t step = 1; step <= 12; ++step) {
    const std::uint64_t before_step = one.version();
    push(one, sgd, {step}, 1.0f, step, 1);  // from step 3 on, each sweep removes the id of two steps before
    if (step < 3) continue;
    CHECK(one.stats().removal_log == 1);
    CHECK_NOTHROW(one.export_rows(psx::TableCursor{{one.incarnation()}, {before_step}}));
  }
}

TEST_CASE("embedding: an allocation that fails during an eviction leaves the deltas right") {
  // A removal made but not logged (the log's allocation failed after the
  // row was gone) was missing from every later delta: the serving copy kept
  // the row for good. Every allocation of the eviction fails in turn.
  if (!psx_test::can_fail_allocations()) {
    MESSAGE("skipped: allocations cannot be failed in this build (ThreadSanitizer)");
    return;
  }
  const psx::optim::SGD sgd{.lr = 1.0};
  std::size_t failures = 0;
  for (int mode = 0; mode < 2; ++mode)
    for (long n = 0;; ++n) {
      INFO("mode " << mode << ", allocation " << n);
      TableOptions o;
      o.stripes = 1;
      o.ttl_sweep_steps = 1'000'000;  // expire() alone evicts, when called
      if (mode == 0) o.ttl_steps = 2;
      else o.memory_cap_bytes = psx::detail::table_minimum_bytes(1, 0, o);
      DynamicTable<psx::optim::SGD> t("emb", 1, psx::Initializer::constant(1.0f), o, sgd);
      std::vector<std::uint64_t> ids(20), more(40);
      for (std::uint64_t k = 0; k < ids.size(); ++k) ids[k] = k;
      for (std::uint64_t k = 0; k < more.size(); ++k) more[k] = 100 + k;
      push(t, sgd, ids, 0.5f, 1, 1);
      psx::TableExport serving = t.export_rows();
      bool threw = false;
      psx_test::fail_allocation(n);
      try {
        if (mode == 0) t.expire(10);
        else push(t, sgd, more, 0.5f, 2, 1);  // evicts under the cap
      } catch (const std::bad_alloc&) {
        threw = true;
      }
      psx_test::fail_allocation(-1);
      if (!threw) break;
      ++failures;
      try {
        serving.merge(t.export_rows(serving.cursor));
      } catch (const psx::checkpoint_error&) {  // refused, as a delta may be: then a full export
        serving = t.export_rows();
      }
      CHECK(serving.sorted() == t.export_rows().sorted());
      // The log holds the removals made, each counted once: a delta from
      // the start lists them all, also once the eviction is done again
      // (an entry left by the failure was counted by neither).
      auto logged = [&] { return t.export_rows(psx::TableCursor{{t.incarnation()}, {0}}).removed.size(); };
      CHECK(t.stats().removal_log == logged());
      if (mode == 0) t.expire(10);
      else push(t, sgd, more, 0.5f, 3, 1);
      CHECK(t.stats().removal_log == logged());
    }
  CHECK(failures > 10);  // the loop reached the evictions' allocations
}

TEST_CASE("embedding: a push whose time-to-live sweep runs out of memory is applied, and swept at the next push") {
  // The sweep runs after the push's rows are applied: its bad_alloc made
  // the applied push throw (a push retried then applied its gradients
  // twice), and the sweep waited for its next turn. Every allocation of the
  // push fails in turn.
  if (!psx_test::can_fail_allocations()) {
    MESSAGE("skipped: allocations cannot be failed in this build (ThreadSanitizer)");
    return;
  }
  const psx::optim::SGD sgd{.lr = 1.0};
  std::size_t failed_sweeps = 0;
  for (long n = 0;; ++n) {
    INFO("allocation " << n);
    TableOptions o;
    o.stripes = 1;
    o.ttl_steps = 2;
    o.ttl_sweep_steps = 1;  // a sweep at every push
    DynamicTable<psx::optim::SGD> t("emb", 1, psx::Initializer::constant(1.0f), o, sgd);
    std::vector<std::uint64_t> old(20), kept(5);
    for (std::uint64_t k = 0; k < old.size(); ++k) old[k] = k;
    for (std::uint64_t k = 0; k < kept.size(); ++k) kept[k] = 100 + k;
    push(t, sgd, old, 0.5f, 1, 1);
    push(t, sgd, kept, 0.5f, 1, 1);  // every row 1 - 0.5
    bool threw = false;
    psx_test::fail_allocation(n);
    try {
      push(t, sgd, kept, 0.25f, 10, 1);  // its sweep evicts the 20 old rows
    } catch (const std::bad_alloc&) {
      threw = true;
    }
    psx_test::fail_allocation(-1);
    // Applied exactly when the push returned.
    for (const std::uint64_t id : kept) CHECK(pull(t, id, 1)[0] == (threw ? 0.5f : 0.25f));
    const std::uint64_t evicted = t.stats().evicted_ttl;
    if (!threw && evicted < old.size()) ++failed_sweeps;
    if (!threw && evicted == old.size()) break;  // nothing failed
    push(t, sgd, kept, 0.25f, 11, 1);  // the sweep is due again
    CHECK(t.stats().evicted_ttl == old.size());
    CHECK(t.stats().rows == kept.size());
    for (const std::uint64_t id : old) CHECK_FALSE(t.contains(id));
  }
  CHECK(failed_sweeps > 0);  // the loop reached the sweep's allocations
}

TEST_CASE("embedding: a merge that runs out of memory leaves the export whole, and merging again completes it") {
  // A delta's new row took its id and then failed to take its floats: the
  // export's ids and floats disagreed, and every later merge refused it.
  if (!psx_test::can_fail_allocations()) {
    MESSAGE("skipped: allocations cannot be failed in this build (ThreadSanitizer)");
    return;
  }
  const psx::optim::SGD sgd{.lr = 1.0};
  TableOptions o;
  o.stripes = 1;
  o.ttl_steps = 2;
  o.ttl_sweep_steps = 1'000'000;  // expire() alone evicts, when called
  DynamicTable<psx::optim::SGD> t("emb", 2, psx::Initializer::constant(1.0f), o, sgd);
  std::vector<std::uint64_t> first(30), second(40);
  for (std::uint64_t k = 0; k < first.size(); ++k) first[k] = k;
  for (std::uint64_t k = 0; k < second.size(); ++k) second[k] = 20 + k;
  push(t, sgd, first, 0.5f, 1, 2);
  const psx::TableExport base = t.export_rows();
  push(t, sgd, second, 0.25f, 5, 2);  // 20..29 changed, 30..59 new
  REQUIRE(t.expire(5) == 20);         // 0..19 removed
  const psx::TableExport delta = t.export_rows(base.cursor);
  REQUIRE(delta.ids.size() == 40);
  REQUIRE(delta.removed.size() == 20);
  psx::TableExport expected = base;
  expected.merge(delta);
  REQUIRE(expected.sorted() == t.export_rows().sorted());
  std::size_t failures = 0;
  for (long n = 0;; ++n) {
    INFO("allocation " << n);
    psx::TableExport e = base;
    bool threw = false;
    psx_test::fail_allocation(n);
    try {
      e.merge(delta);
    } catch (const std::bad_alloc&) {
      threw = true;
    }
    psx_test::fail_allocation(-1);
    CHECK(e.values.size() == e.ids.size() * e.dim);
    if (!threw) {
      CHECK(e.sorted() == expected.sorted());
      break;
    }
    ++failures;
    CHECK_NOTHROW(e.merge(delta));
    CHECK(e.sorted() == expected.sorted());
    CHECK(e.cursor == expected.cursor);
  }
  CHECK(failures > 3);  // the loop reached the merge's allocations
}

TEST_CASE("embedding: a thread keeps no more than 16 MiB of a large call's working memory") {
  // The duplicate sums of a push were kept for the next call whatever their
  // size (up to 65536 ids of any width): 60000 rows of 256 floats left
  // 60 MiB on the calling thread, outside the table's 8 MiB cap.
  const auto heap = [] {
    const struct mallinfo2 m = mallinfo2();
    return static_cast<long long>(m.uordblks + m.hblkhd);  // mmapped blocks (large buffers) too
  };
  if (heap() == 0) {
    MESSAGE("skipped: mallinfo2 counts nothing under this build's allocator (a sanitizer's)");
    return;
  }
  const psx::optim::SGD sgd{.lr = 0.1};
  TableOptions o;
  o.memory_cap_bytes = 8u << 20;
  DynamicTable<psx::optim::SGD> t("emb", 256, {}, o, sgd);
  std::vector<std::uint64_t> ids(60000);
  for (std::size_t j = 0; j < ids.size(); ++j) ids[j] = j;
  std::vector<float> grads(ids.size() * 256, 1.0f);  // 61 MB
  const long long before = heap();
  t.push(sgd, ids, grads, at_step(1));
  const long long grew = heap() - before;
  CHECK(t.stats().bytes <= o.memory_cap_bytes);
  if (grew < static_cast<long long>(t.stats().bytes) / 2) {
    MESSAGE("skipped: mallinfo2 does not see this build's allocations (a sanitizer's allocator)");
    return;
  }
  // What the table grew by, its bookkeeping outside the count and the call's id-sized
  // scratch (about 3 MB together here), with room to spare.
  CHECK(grew <= static_cast<long long>(o.memory_cap_bytes) + (8ll << 20));
}

TEST_CASE("embedding: 8 threads pull and push one table at once") {
  // SGD with a constant gradient subtracts the same number at each update,
  // so the result is exact whatever the interleaving.
  const psx::optim::SGD sgd{.lr = 0.25};
  TableOptions o;
  o.stripes = 8;
  DynamicTable<psx::optim::SGD> t("emb", 4, {}, o, sgd);
  constexpr int threads = 8, steps = 200;
  std::vector<std::uint64_t> shared{0, 1, 2, max_id};
  std::atomic<int> wrong{0};
  std::vector<std::thread> pool;
  for (int w = 0; w < threads; ++w)
    pool.emplace_back([&, w] {
      std::vector<float> out(4 * 24);
      for (int step = 1; step <= steps; ++step) {
        std::vector<std::uint64_t> ids(shared);
        for (std::uint64_t k = 0; k < 20; ++k) ids.push_back((std::uint64_t(w + 1) << 40) + k + std::uint64_t(step % 3) * 20);
        std::vector<float> g(ids.size() * 4, 0.5f);
        t.push(sgd, ids, g, at_step(static_cast<std::uint64_t>(step)));
        t.pull(ids, {}, out, static_cast<std::uint64_t>(step));
        // A row of this thread's own was last pushed by this thread: its value is known.
        const float own = -0.125f * static_cast<float>((step + 2) / 3);
        for (std::size_t k = 0; k < 20; ++k)
          if (out[(shared.size() + k) * 4] != own) wrong.fetch_add(1);
        (void)t.export_rows();
        (void)t.stats();
      }
    });
  for (auto& th : pool) th.join();
  CHECK(wrong.load() == 0);
  for (const std::uint64_t id : shared) CHECK(pull(t, id, 4) == std::vector<float>(4, -0.125f * threads * steps));
  CHECK(t.size() == shared.size() + threads * 60);
  CHECK(t.stats().admitted == t.size());
}

TEST_CASE("embedding: 8 threads on a capped, expiring table stay under the cap") {
  const psx::optim::Adam opt{};
  TableOptions o;
  o.stripes = 8;
  o.memory_cap_bytes = 512 << 10;
  o.ttl_steps = 20;
  o.admission = Admission::with_probability(0.9, 1);
  DynamicTable<psx::optim::Adam> t("emb", 8, psx::Initializer::normal(0.0f, 0.1f), o, opt);
  std::atomic<std::uint64_t> over{0};
  std::vector<std::thread> pool;
  for (int w = 0; w < 8; ++w)
    pool.emplace_back([&, w] {
      std::vector<float> out(8 * 300), g(8 * 300, 0.01f);
      for (std::uint64_t step = 1; step <= 150; ++step) {
        std::vector<std::uint64_t> ids(300);
        for (std::size_t k = 0; k < ids.size(); ++k) ids[k] = psx::detail::mix64(step * 1000 + k) % (k < 50 ? 64 : max_id) + std::uint64_t(w) * (k < 50 ? 0 : 1);
        t.pull(ids, {}, out, step);
        t.push(opt, ids, g, at_step(step));
        if (t.stats().bytes > o.memory_cap_bytes) over.fetch_add(1);
      }
    });
  for (auto& th : pool) th.join();
  const psx::TableStats s = t.stats();
  CHECK(over.load() == 0);
  CHECK(s.evicted_memory > 0);
  CHECK(s.rows == s.admitted - s.evicted_memory - s.evicted_ttl);
}

TEST_CASE("embedding: ConsistentHash moves about 1/(n+1) of the ids when a server joins") {
  const psx::partition::ConsistentHash ch;
  constexpr std::size_t ids = 200000;
  for (std::size_t n = 1; n <= 16; ++n) {
    const auto before = ch.ring(n), after = ch.ring(n + 1);
    std::size_t moved = 0;
    for (std::size_t k = 0; k < ids; ++k) {
      const std::uint64_t id = psx::detail::mix64(k + 977);
      const std::size_t a = before.server(id), b = after.server(id);
      if (a != b) {
        ++moved;
        REQUIRE(b == n);  // ids move only to the new server
      }
    }
    const double want = 1.0 / static_cast<double>(n + 1);
    CAPTURE(n);
    // Within 10% of 1/(n+1) itself (doctest's Approx epsilon would allow
    // 0.1 + 10% of the value, enough for a ring that moved nothing).
    CHECK(std::abs(static_cast<double>(moved) / ids - want) <= 0.10 * want);
  }
  // Whole variables by name, the same way.
  psx::VariableMeta m;
  m.name = "w";
  m.rows = 10;
  m.row_width = 2;
  const auto shards = ch.place(m, 5);
  REQUIRE(shards.size() == 1);
  CHECK(shards[0].server == ch.ring(5).server(psx::detail::fnv1a64("w")));
  CHECK(shards[0].rows() == 10);
  CHECK_THROWS_AS(psx::partition::ConsistentHash{0}.ring(3), psx::config_error);
}

TEST_CASE("embedding: every 64-bit id maps to exactly one server, at the ring's edges too") {
  for (std::size_t n = 1; n <= 8; ++n) {
    const psx::detail::HashRing ring(n, 64);
    const auto& points = ring.points();
    const auto& owners = ring.owners();
    REQUIRE(points.size() == n * 64);
    REQUIRE(std::is_sorted(points.begin(), points.end()));
    // The id whose position on the circle is exactly `p`.
    auto id_at = [](std::uint64_t p) { return unmix64(p) ^ 0x5851f42d4c957f2dull; };
    CHECK(psx::detail::HashRing::position(id_at(12345)) == 12345);
    for (std::size_t i = 0; i < points.size(); ++i) {
      const std::size_t next = i + 1 == points.size() ? 0 : i + 1;
      REQUIRE(ring.server(id_at(points[i])) == owners[i]);           // on a point: its owner
      if (points[i] != 0 && (i == 0 || points[i - 1] != points[i] - 1))
        REQUIRE(ring.server(id_at(points[i] - 1)) == owners[i]);     // just before: the same
      if (points[i] != max_id) REQUIRE(ring.server(id_at(points[i] + 1)) == owners[next]);  // just after: the next
    }
    CHECK(ring.server(id_at(0)) == owners.front());
    CHECK(ring.server(id_at(max_id)) == (points.back() == max_id ? owners.back() : owners.front()));
    // Around every boundary of 2^bits equal parts of the circle (the lookup's
    // buckets are such parts), against a search of the points.
    auto owner_at = [&](std::uint64_t p) {
      const auto it = std::lower_bound(points.begin(), points.end(), p);
      return owners[it == points.end() ? 0 : static_cast<std::size_t>(it - points.begin())];
    };
    for (int bits = 6; bits <= 14; ++bits)
      for (std::uint64_t b = 0; b < (std::uint64_t{1} << bits); ++b) {
        const std::uint64_t p = b << (64 - bits);
        REQUIRE(ring.server(id_at(p)) == owner_at(p));
        REQUIRE(ring.server(id_at(p - 1)) == owner_at(p - 1));
        REQUIRE(ring.server(id_at(p + (std::uint64_t{1} << (63 - bits)))) == owner_at(p + (std::uint64_t{1} << (63 - bits))));
      }
    for (const std::uint64_t id : {std::uint64_t{0}, std::uint64_t{1}, std::uint64_t{1} << 63, max_id - 1, max_id})
      CHECK(ring.server(id) < n);
    std::vector<std::size_t> load(n);
    for (std::uint64_t k = 0; k < 100000; ++k) ++load[ring.server(k * 0x9e3779b97f4a7c15ull)];
    for (std::size_t s = 0; s < n; ++s) CHECK(load[s] > 0);
  }
  CHECK(psx::detail::HashRing().server(max_id) == 0);
}

TEST_CASE("embedding: a dynamic table trains like a sparse variable of the same rows, bit for bit") {
  // The same pushes into a dynamic table and into a sparse variable whose
  // row r stands for id ids[r]: under BSP both get the same aggregated
  // gradient in the same order, so every row must agree exactly.
  const std::vector<std::uint64_t> universe{0, 1, 7, 1ull << 40, 123456789, max_id - 1, max_id};
  psx::LocalCluster<psx::partition::RowRange, psx::sync::Synchronous, psx::optim::Adagrad> ps(
      {3, 4}, {}, {}, psx::optim::Adagrad{.lr = 0.1});
  TableOptions o;
  o.stripes = 2;
  ps.declare(psx::embedding("emb", 5, psx::Initializer::constant(0.5f), o));
  ps.declare(psx::sparse("ref", universe.size(), 5, psx::Initializer::constant(0.5f)));
  ps.run([&](psx::Worker& w) {
    for (std::size_t step = 0; step < 12; ++step) {
      std::vector<std::uint64_t> ids, rows;
      for (std::size_t k = 0; k < 6; ++k) {
        const std::size_t r = psx::detail::mix64(w.index() * 1000 + step * 10 + k) % universe.size();
        ids.push_back(universe[r]);
        rows.push_back(r);
      }
      std::vector<float> a(ids.size() * 5), b(ids.size() * 5), g(ids.size() * 5);
      w.pull_rows("emb", ids, a);
      w.pull_rows("ref", rows, b);
      REQUIRE(a == b);
      for (std::size_t i = 0; i < g.size(); ++i) g[i] = psx_test::toy_grad(a[i], w.index(), step, i);
      w.push_rows("emb", ids, g);
      w.push_rows("ref", rows, g);
      w.step();
    }
  });
  const psx::TableExport e = ps.export_table("emb");
  const std::vector<float> ref = ps.read("ref");
  std::set<std::uint64_t> seen(e.ids.begin(), e.ids.end());
  CHECK(seen.size() == e.ids.size());
  for (std::size_t k = 0; k < e.ids.size(); ++k) {
    const auto r = static_cast<std::size_t>(std::find(universe.begin(), universe.end(), e.ids[k]) - universe.begin());
    REQUIRE(r < universe.size());
    CHECK(std::vector<float>(e.row(k).begin(), e.row(k).end()) ==
          std::vector<float>(ref.begin() + static_cast<std::ptrdiff_t>(r * 5), ref.begin() + static_cast<std::ptrdiff_t>(r * 5 + 5)));
  }
  // Where the ids live: on the ring's servers, counted per server.
  const auto& v = ps.variable("emb");
  const std::vector<psx::TableStats> per_server = ps.table_stats("emb");
  REQUIRE(per_server.size() == 3);
  std::vector<std::uint64_t> expect(3, 0);
  for (const std::uint64_t id : e.ids) ++expect[v.ring.server(id)];
  for (std::size_t s = 0; s < 3; ++s) CHECK(per_server[s].rows == expect[s]);
  // The servers' counters include the rows held (and Adagrad's one slot a
  // row), beside the sparse variable's 7 rows; the placement report counts
  // each server's table bytes.
  std::uint64_t rows = 0;
  for (const auto& t : per_server) rows += t.rows;
  CHECK(rows == e.ids.size());
  CHECK(ps.stats().parameter_bytes == (7 + rows) * 5 * 4);
  CHECK(ps.stats().slot_bytes == (7 + rows) * 5 * 4);
  const psx::PlacementReport placement = ps.placement();
  const psx::PlacementReport fixed = psx::placement_report(ps.variables(), 3, 1);
  REQUIRE(placement.bytes.size() == 3);
  for (std::size_t s = 0; s < 3; ++s) CHECK(placement.bytes[s] == fixed.bytes[s] + per_server[s].bytes);
}

TEST_CASE("embedding: deltas taken while the cluster trains add up to the final export") {
  psx::LocalCluster<psx::partition::HashByName, psx::sync::Asynchronous, psx::optim::SGD> ps(
      {2, 3}, {}, {}, psx::optim::SGD{.lr = 0.1});
  TableOptions o;
  o.stripes = 4;
  o.ttl_steps = 6;
  o.ttl_sweep_steps = 2;
  o.memory_cap_bytes = psx::detail::table_minimum_bytes(4, 0, o) * 2;
  ps.declare(psx::embedding("emb", 4, psx::Initializer::uniform(-0.1f, 0.1f, 2), o));
  ps.start();
  psx::TableExport serving = ps.export_table("emb");
  std::atomic<bool> done{false};
  std::size_t deltas = 0;
  std::thread reader([&] {
    while (!done.load()) {
      serving.merge(ps.export_table("emb", serving.cursor));
      ++deltas;
      std::this_thread::yield();
    }
  });
  ps.run([](psx::Worker& w) {
    std::vector<float> rows(64 * 4), g(64 * 4, 0.01f);
    for (std::uint64_t step = 0; step < 80; ++step) {
      std::vector<std::uint64_t> ids(64);
      for (std::size_t k = 0; k < ids.size(); ++k) ids[k] = psx::detail::mix64(step * 64 + k + w.index()) % 3000;
      w.pull_rows("emb", ids, rows);
      w.push_rows("emb", ids, g);
      w.step();
    }
  });
  done = true;
  reader.join();
  serving.merge(ps.export_table("emb", serving.cursor));
  const psx::TableExport full = ps.export_table("emb");
  CHECK(serving.sorted() == full.sorted());
  CHECK(deltas > 0);
  psx::TableStats total;
  for (const auto& t : ps.table_stats("emb")) {
    CHECK(t.bytes <= o.memory_cap_bytes);
    total += t;
  }
  CHECK(total.evicted_ttl + total.evicted_memory > 0);
  CHECK(total.rows == full.ids.size());
}

TEST_CASE("embedding: refused declarations and calls say what is wrong") {
  psx::LocalCluster<> ps({2, 1});
  CHECK_THROWS_AS(ps.declare({"e", {0}, psx::VariableKind::dynamic}), psx::shape_error);
  CHECK_THROWS_AS(ps.declare({"e", {4, 4}, psx::VariableKind::dynamic}), psx::shape_error);
  TableOptions bad;
  bad.admission = Admission::after_pushes(0);
  CHECK_THROWS_AS(ps.declare(psx::embedding("e", 4, {}, bad)), psx::config_error);
  bad = {};
  bad.admission = Admission::with_probability(1.5);
  CHECK_THROWS_AS(ps.declare(psx::embedding("e", 4, {}, bad)), psx::config_error);
  bad = {};
  bad.stripes = 3;
  CHECK_THROWS_AS(ps.declare(psx::embedding("e", 4, {}, bad)), psx::config_error);
  bad = {};
  bad.memory_cap_bytes = 1000;
  CHECK_THROWS_WITH_AS(ps.declare(psx::embedding("e", 4, {}, bad)), doctest::Contains("below its minimum"),
                       psx::config_error);
  auto spec = psx::embedding("e", 4);
  spec.dtype = psx::DType::bfloat16;
  CHECK_THROWS_AS(ps.declare(spec), psx::config_error);
  ps.declare(psx::embedding("emb", 4));
  ps.declare(psx::dense("w", {3}));
  CHECK_THROWS_AS(ps.table_stats("emb"), psx::config_error);  // before start
  psx::Worker w = ps.worker(0);
  std::vector<float> four(4), eight(8);
  const std::uint64_t one[] = {max_id};
  CHECK_THROWS_WITH_AS(w.pull("emb", std::span<float>(four)), doctest::Contains("dynamic table"), psx::shape_error);
  CHECK_THROWS_AS(w.push("emb", std::span<const float>(four)), psx::shape_error);
  CHECK_THROWS_AS(w.pull_rows("emb", one, std::span<float>(eight)), psx::shape_error);
  CHECK_THROWS_AS(ps.read("emb"), psx::shape_error);
  w.pull_rows("emb", one, std::span<float>(four));
  CHECK(four == std::vector<float>(4, 0.0f));
  CHECK_THROWS_AS(ps.table_stats("w"), psx::config_error);
  CHECK_THROWS_AS(ps.table_stats("nope"), psx::unknown_variable);
  CHECK_THROWS_AS(ps.export_table("emb", psx::TableCursor{{1, 2, 3}, {1, 2, 3}}), psx::config_error);
  // A cursor of another cluster's tables: the refusal names the server.
  CHECK(message_of<psx::checkpoint_error>([&] { ps.export_table("emb", psx::TableCursor{{1, 2}, {0, 0}}); })
            .ends_with("; take a full export (server 0 of 2)"));
  // LAMB does not apply row pushes: it cannot train a table.
  psx::LocalCluster<psx::partition::HashByName, psx::sync::Synchronous, psx::optim::Lamb> lamb({1, 1});
  CHECK_THROWS_AS(lamb.declare(psx::embedding("e", 4)), psx::config_error);
  // Delay compensation would copy every row a worker read.
  psx::LocalCluster<psx::partition::HashByName, psx::sync::Asynchronous> dc({1, 1}, {}, {.staleness_scaled_lr = false, .delay_compensation = 0.5f});
  dc.declare(psx::embedding("e", 4));
  CHECK_THROWS_WITH_AS(dc.start(), doctest::Contains("delay compensation"), psx::config_error);
}

TEST_CASE("embedding: the docs example (docs/embedding.md)") {
  std::ostringstream report;
  psx::LocalCluster<psx::partition::HashByName, psx::sync::Asynchronous, psx::optim::Adagrad> ps({2, 4});
  psx::TableOptions options;
  options.admission = psx::Admission::after_pushes(3);  // stored at its third push
  options.ttl_steps = 1000;                             // gone after 1000 steps without an update
  options.memory_cap_bytes = std::uint64_t{256} << 20;  // per server: least recently used rows out first
  ps.declare(psx::embedding("item", 16, psx::Initializer::normal(0.0f, 0.01f, 7), options));
  ps.start();
  psx::TableExport serving = ps.export_table("item");  // every row stored (none yet)

  ps.run([](psx::Worker& w) {
    for (int step = 0; step < 3; ++step) {
      std::vector<std::uint64_t> ids = {0x9e3779b97f4a7c15, 42, 42, UINT64_MAX};
      std::vector<float> rows(ids.size() * 16), grads(ids.size() * 16, 0.1f);
      w.pull_rows("item", ids, rows);   // unseen ids: their initial value, nothing stored
      w.push_rows("item", ids, grads);  // repeated ids summed; each push counts towards admission
      w.step();
    }
  });

  serving.merge(ps.export_table("item", serving.cursor));  // rows changed, ids removed since
  for (const psx::TableStats& s : ps.table_stats("item")) report << s << '\n';
  CHECK(serving.ids.size() == 3);
  CHECK(serving.sorted() == ps.export_table("item").sorted());
  CHECK(report.str().find("admitted") != std::string::npos);
}

TEST_CASE("embedding: a sketch with a window forgets old pushes") {
  const psx::optim::SGD sgd{.lr = 1.0};
  for (const std::uint64_t window : {std::uint64_t{0}, std::uint64_t{64}}) {
    TableOptions o;
    o.admission = Admission::after_pushes(2, 64, 4, window);
    DynamicTable<psx::optim::SGD> t("emb", 1, {}, o, sgd);
    push(t, sgd, {max_id}, 1.0f, 1, 1);  // counted once
    std::vector<std::uint64_t> others(64);
    for (std::size_t k = 0; k < others.size(); ++k) others[k] = k + 1;
    push(t, sgd, others, 1.0f, 2, 1);  // 64 more counts: with a window of 64, every counter is halved
    push(t, sgd, {max_id}, 1.0f, 3, 1);
    CAPTURE(window);
    CHECK(t.contains(max_id) == (window == 0));  // its second push: admitted unless the first was forgotten
    push(t, sgd, {max_id}, 1.0f, 4, 1);
    CHECK(t.contains(max_id));
  }
}

TEST_CASE("embedding: a table made directly checks its options and buffers") {
  const psx::optim::SGD sgd{.lr = 1.0};
  TableOptions o;
  o.admission = Admission::after_pushes(2, 1u << 10, 17);
  CHECK_THROWS_AS(DynamicTable<psx::optim::SGD>("emb", 4, {}, o, sgd), psx::config_error);
  o.admission = Admission::after_pushes(2, 1u << 10, 4, 100);  // a window shorter than the width
  CHECK_THROWS_AS(DynamicTable<psx::optim::SGD>("emb", 4, {}, o, sgd), psx::config_error);
  o.admission = Admission::after_pushes(2, 1u << 31, 4);  // 8 GiB of counters per server
  CHECK_THROWS_WITH_AS(DynamicTable<psx::optim::SGD>("emb", 4, {}, o, sgd),
                       doctest::Contains("an admission sketch of 2147483648 x 4 counters is over 4 GiB per server"),
                       psx::config_error);
  // A cap the sketch alone exceeds is refused before the sketch is made (4 GiB here).
  o.admission = Admission::after_pushes(2, 1u << 30, 4);
  o.memory_cap_bytes = 1 << 20;
  CHECK_THROWS_WITH_AS(DynamicTable<psx::optim::SGD>("emb", 4, {}, o, sgd), doctest::Contains("is below its minimum"),
                       psx::config_error);
  o = {};
  o.stripes = 0;
  CHECK_THROWS_AS(DynamicTable<psx::optim::SGD>("emb", 4, {}, o, sgd), psx::config_error);
  CHECK_THROWS_AS(DynamicTable<psx::optim::SGD>("emb", 0, {}, {}, sgd), psx::shape_error);
  DynamicTable<psx::optim::SGD> t("emb", 4, {}, {}, sgd);
  const std::uint64_t ids[] = {1, 2};
  const std::uint32_t positions[] = {0, 5};
  std::vector<float> out(8), odd(7);
  CHECK_THROWS_AS(t.pull(ids, {}, odd, 1), psx::shape_error);
  CHECK_THROWS_AS(t.pull(ids, positions, out, 1), psx::shape_error);
  CHECK_THROWS_AS(t.pull(std::span(ids).first(1), {}, out, 1), psx::shape_error);
  CHECK_THROWS_AS(t.push(sgd, ids, odd, at_step(1)), psx::shape_error);
  CHECK_NOTHROW(t.pull(ids, {}, out, 1));
}

TEST_CASE("embedding: a time to live at the top of the range never evicts, and wide rows come in small chunks") {
  const psx::optim::SGD sgd{.lr = 1.0};
  TableOptions o;
  o.ttl_steps = max_id;
  o.ttl_sweep_steps = 1;
  DynamicTable<psx::optim::SGD> t("emb", 2, {}, o, sgd);
  push(t, sgd, {1}, 1.0f, 1, 2);
  push(t, sgd, {2}, 1.0f, max_id, 2);
  CHECK(t.contains(1));
  CHECK(t.stats().evicted_ttl == 0);
  // A row of 2^18 floats with Adam's two slots is 3 MiB: a chunk holds one.
  TableOptions wide;
  wide.stripes = 1;
  DynamicTable<psx::optim::Adam> w("wide", 1u << 18, {}, wide, {});
  std::vector<float> g(1u << 18, 0.5f);
  const std::uint64_t one[] = {7};
  w.push({}, one, g, at_step(1));
  CHECK(w.stats().bytes < (4u << 20));
  CHECK(w.stats().bytes >= 3 * (1u << 20));
}

TEST_CASE("embedding: the default sweep period, least-recently-used ties broken by id, pulls as uses") {
  const psx::optim::SGD sgd{.lr = 1.0};
  TableOptions o;
  o.ttl_steps = 32;  // swept every 32 / 16 = 2 steps
  DynamicTable<psx::optim::SGD> t("emb", 1, {}, o, sgd);
  push(t, sgd, {7}, 1.0f, 1, 1);
  for (std::uint64_t step = 2; step <= 33; ++step) push(t, sgd, {8}, 1.0f, step, 1);
  CHECK(t.contains(7));  // 33 - 1 is not more than 32
  push(t, sgd, {8}, 1.0f, 34, 1);
  push(t, sgd, {8}, 1.0f, 35, 1);
  CHECK(!t.contains(7));  // expired at 34, gone by the sweep at 35
  // One stripe at its minimum: 24 rows fill its index to 3/4; the 25th
  // evicts one row, the least recently used, the smallest id among equals.
  TableOptions small;
  small.stripes = 1;
  small.memory_cap_bytes = psx::detail::table_minimum_bytes(1, 0, small);
  DynamicTable<psx::optim::SGD> lru("emb", 1, {}, small, sgd);
  std::vector<std::uint64_t> ids;
  for (std::uint64_t id = 100; id < 124; ++id) ids.push_back(id);
  push(lru, sgd, ids, 1.0f, 1, 1);
  CHECK(lru.size() == 24);
  push(lru, sgd, {5}, 1.0f, 1, 1);
  CHECK(lru.contains(5));
  CHECK(!lru.contains(100));
  for (std::uint64_t id = 101; id < 124; ++id) CHECK(lru.contains(id));
  CHECK(lru.stats().evicted_memory == 1);
  CHECK(lru.stats().bytes <= small.memory_cap_bytes);
  // A row only pulled counts as used: rows 100..111 pulled at step 2 are
  // more recent than 112..123, pushed at step 1 only, so 112 goes (without
  // the pull's mark, 100 would).
  DynamicTable<psx::optim::SGD> pulled_lru("emb", 1, {}, small, sgd);
  push(pulled_lru, sgd, ids, 1.0f, 1, 1);
  const std::vector<std::uint64_t> pulled(ids.begin(), ids.begin() + 12);
  std::vector<float> out(pulled.size());
  pulled_lru.pull(pulled, {}, out, 2);
  push(pulled_lru, sgd, {5}, 1.0f, 3, 1);
  CHECK(pulled_lru.stats().evicted_memory == 1);
  CHECK(pulled_lru.contains(5));
  CHECK(!pulled_lru.contains(112));
  for (const std::uint64_t id : pulled) CHECK(pulled_lru.contains(id));
}

TEST_CASE("embedding: uniform initial rows: in range, uncorrelated neighbours, odd widths too") {
  const auto init = psx::Initializer::uniform(-0.25f, 0.75f, 5);
  double sum = 0, squares = 0, lag1 = 0;  // lag1: products of neighbours (each pair of a 64-bit word, and across)
  std::size_t n = 0, pairs = 0, equal_neighbours = 0;
  for (const std::size_t dim : {1, 2, 3, 7, 16, 33}) {
    for (std::uint64_t id = 0; id < 3000; ++id) {
      const std::vector<float> row = initial(init, "emb", id * 0x9e3779b97f4a7c15ull + 1, dim);
      for (std::size_t i = 0; i < dim; ++i) {
        REQUIRE(row[i] >= -0.25f);
        REQUIRE(row[i] < 0.75f);
        sum += row[i];
        squares += double{row[i]} * row[i];
        ++n;
        if (i + 1 < dim) {
          lag1 += (double{row[i]} - 0.25) * (double{row[i + 1]} - 0.25);
          equal_neighbours += row[i] == row[i + 1];
          ++pairs;
        }
      }
      // A row is the prefix of any wider row of the same id: the stream does not depend on the width.
      const std::vector<float> wider = initial(init, "emb", id * 0x9e3779b97f4a7c15ull + 1, dim + 1);
      CHECK(std::equal(row.begin(), row.end(), wider.begin()));
    }
  }
  const double mean = sum / static_cast<double>(n), var = squares / static_cast<double>(n) - mean * mean;
  CHECK(std::abs(mean - 0.25) < 0.005);         // 186k draws: the standard error is 0.0007
  CHECK(std::abs(var - 1.0 / 12) < 0.002);      // the standard error is 0.0002
  CHECK(std::abs(lag1 / static_cast<double>(pairs) / (1.0 / 12)) < 0.02);  // correlation; error 0.0024
  CHECK(equal_neighbours <= 2);  // two 24-bit draws agree with odds 2^-24
  // Draws that round up to `high` as a float stay below it: in a range one
  // float wide, half the draws would round to `high`.
  const auto narrow = psx::Initializer::uniform(1.0f, std::nextafter(1.0f, 2.0f), 1);
  for (std::uint64_t id = 0; id < 100; ++id)
    for (const float x : initial(narrow, "emb", id, 16)) REQUIRE(x == 1.0f);
}

TEST_CASE("embedding: pulls of stored and unseen ids land in their positions, any width") {
  const psx::optim::SGD sgd{.lr = 1.0};
  const auto init = psx::Initializer::uniform(-1.0f, 1.0f, 9);
  for (const std::size_t dim : {1, 3, 5, 17, 36}) {
    DynamicTable<psx::optim::SGD> t("emb", dim, init, {}, sgd);
    std::vector<std::uint64_t> stored, all;
    for (std::uint64_t k = 0; k < 700; ++k) {
      const std::uint64_t id = psx::detail::mix64(k + 1000 * dim);
      all.push_back(id);
      if (k % 3 != 0) stored.push_back(id);
    }
    push(t, sgd, stored, 0.5f, 1, dim);
    // Positions reversed: row j of the call lands in row 699 - j of the buffer.
    std::vector<std::uint32_t> positions(all.size());
    for (std::uint32_t j = 0; j < positions.size(); ++j) positions[j] = static_cast<std::uint32_t>(all.size() - 1 - j);
    std::vector<float> out(all.size() * dim);
    t.pull(all, positions, out, 2);
    for (std::size_t j = 0; j < all.size(); ++j) {
      std::vector<float> want = initial(init, "emb", all[j], dim);
      if (j % 3 != 0)
        for (float& x : want) x -= 0.5f;
      const float* got = out.data() + positions[j] * dim;
      REQUIRE(std::equal(want.begin(), want.end(), got));
    }
  }
}

TEST_CASE("embedding: evictions in the middle of a push leave every other row's update in its own row") {
  // Each id's gradient is (-1, -f(id)) with SGD at lr 1: a stored row is its
  // initial value plus (k, k * f(id)) after k updates. An update written to
  // another id's record (a slot looked up before an eviction handed it to
  // another id) would break that for some row. Caps so small that every
  // push of new ids evicts rows it still has to update.
  const psx::optim::SGD sgd{.lr = 1.0};
  const auto init = psx::Initializer::uniform(-1.0f, 1.0f, 3);
  auto f = [](std::uint64_t id) { return 1.0f + static_cast<float>(id % 13) * 0.25f; };
  for (const std::uint32_t stripes : {1u, 4u}) {
    TableOptions o;
    o.stripes = stripes;
    // Tight enough that a push's own stored ids are evicted before their turn (in every stripe).
    o.memory_cap_bytes = (stripes == 1 ? 4 : 1) * psx::detail::table_minimum_bytes(2, 0, o);
    DynamicTable<psx::optim::SGD> t("emb", 2, init, o, sgd);
    std::uint64_t next = 1;
    std::vector<std::uint64_t> recent;
    for (std::uint64_t step = 1; step <= 150; ++step) {
      // Stored ids from the last pushes, interleaved with new ones, so a window holds both.
      std::vector<std::uint64_t> ids;
      for (std::size_t k = 0; k < 60; ++k) {
        ids.push_back(next++);
        if (k < recent.size()) ids.push_back(recent[recent.size() - 1 - k]);
      }
      std::vector<float> g;
      for (const std::uint64_t id : ids) g.insert(g.end(), {-1.0f, -f(id)});
      t.push(sgd, ids, g, at_step(step));
      recent.assign(ids.begin(), ids.end());
      const psx::TableExport all = t.export_rows();
      REQUIRE(!all.ids.empty());
      for (std::size_t k = 0; k < all.ids.size(); ++k) {
        const std::vector<float> first = initial(init, "emb", all.ids[k], 2);
        const double updates = double{all.row(k)[0]} - first[0];
        INFO("id " << all.ids[k] << " at step " << step);
        REQUIRE(updates == doctest::Approx(std::round(updates)).epsilon(1e-4));
        REQUIRE(std::round(updates) >= 1.0);
        REQUIRE(double{all.row(k)[1]} - first[1] == doctest::Approx(std::round(updates) * f(all.ids[k])).epsilon(1e-4));
      }
    }
    CHECK(t.stats().evicted_memory > 1000);
    CHECK(t.stats().bytes <= o.memory_cap_bytes);
  }
}

namespace {

// Every page of `t`'s export from `since` (empty: full), `capacity` entries
// a page, gathered into one export; between two pages `between()` runs
// (changes of the table). Checks that no id comes twice.
template <class Between>
psx::TableExport paged(const DynamicTable<psx::optim::SGD>& t, const psx::TableCursor& since, std::size_t capacity,
                       Between&& between) {
  psx::TableExport out;
  out.dim = t.dim();
  std::vector<float> page(capacity * (2 + t.dim()));
  std::optional<std::uint64_t> after;
  for (std::size_t pages = 0;; ++pages) {
    REQUIRE(pages < 100000);
    const psx::TablePage p = t.export_page(since, after, page);
    REQUIRE(p.rows + p.removed <= capacity);
    if (pages == 0) out.cursor = {{p.incarnation}, {p.version}};
    const auto* bytes = reinterpret_cast<const std::byte*>(page.data());
    for (std::size_t k = 0; k < p.rows + p.removed; ++k) {
      std::uint64_t id;
      std::memcpy(&id, bytes + k * sizeof id, sizeof id);
      (k < p.rows ? out.ids : out.removed).push_back(id);
    }
    out.values.insert(out.values.end(), page.begin() + static_cast<std::ptrdiff_t>(2 * capacity),
                      page.begin() + static_cast<std::ptrdiff_t>(2 * capacity + p.rows * t.dim()));
    if (!p.more) break;
    REQUIRE((!after || p.next > *after));  // each page moves on
    after = p.next;
    between();
  }
  const std::set<std::uint64_t> rows(out.ids.begin(), out.ids.end()), gone(out.removed.begin(), out.removed.end());
  CHECK(rows.size() == out.ids.size());
  CHECK(gone.size() == out.removed.size());
  return out;
}

std::vector<std::uint64_t> sorted_ids(std::vector<std::uint64_t> v) {
  std::sort(v.begin(), v.end());
  return v;
}

}  // namespace

TEST_CASE("embedding: an export in pages holds what one export holds, whatever the page size") {
  const psx::optim::SGD sgd{.lr = 0.5};
  TableOptions o;
  o.stripes = 4;
  o.ttl_steps = 3;
  o.ttl_sweep_steps = 1000;  // swept by hand below
  DynamicTable<psx::optim::SGD> t("t", 3, psx::Initializer::uniform(-1.0f, 1.0f, 5), o, sgd);
  std::vector<std::uint64_t> ids;
  for (std::uint64_t k = 0; k < 300; ++k) ids.push_back(psx::detail::mix64(k) | (k % 3 == 0 ? 1ull << 63 : 0));
  push(t, sgd, ids, 0.1f, 1, 3);
  const psx::TableExport whole = t.export_rows();
  for (const std::size_t capacity : {1, 2, 7, 64, 299, 300, 1000}) {
    INFO("capacity " << capacity);
    const psx::TableExport e = paged(t, {}, capacity, [] {});
    CHECK(e.sorted() == whole.sorted());
    CHECK(e.cursor == whole.cursor);
  }
  // A delta: rows changed and ids removed since the cursor.
  push(t, sgd, std::vector<std::uint64_t>(ids.begin(), ids.begin() + 40), 0.2f, 5, 3);
  push(t, sgd, {1, 2, 3}, 0.3f, 5, 3);
  CHECK(t.expire(5) == 260);  // updated at step 1: more than 3 steps before 5
  const psx::TableExport delta = t.export_rows(whole.cursor);
  REQUIRE(delta.removed.size() == 260);
  for (const std::size_t capacity : {1, 5, 100, 1000}) {
    INFO("capacity " << capacity);
    const psx::TableExport e = paged(t, whole.cursor, capacity, [] {});
    CHECK(e.sorted() == delta.sorted());
    CHECK(sorted_ids(e.removed) == sorted_ids(delta.removed));
  }
  // Refused as a whole export refuses, and a page without room for a row.
  std::vector<float> fifty(50);
  CHECK_THROWS_AS(t.export_page(psx::TableCursor{{t.incarnation() + 1}, {0}}, {}, fifty), psx::checkpoint_error);
  CHECK_THROWS_AS(t.export_page(psx::TableCursor{{t.incarnation()}, {t.version() + 1}}, {}, fifty),
                  psx::checkpoint_error);
  std::vector<float> small(4);
  CHECK_THROWS_WITH_AS(t.export_page({}, {}, small), doctest::Contains("has no room for one row"), psx::shape_error);
}

TEST_CASE("embedding: a table that changes between the pages of an export: its next delta completes it") {
  const psx::optim::SGD sgd{.lr = 0.5};
  TableOptions o;
  o.stripes = 8;
  o.ttl_steps = 4;
  o.ttl_sweep_steps = 1;
  DynamicTable<psx::optim::SGD> t("t", 2, psx::Initializer::uniform(-1.0f, 1.0f, 9), o, sgd);
  std::uint64_t step = 1;
  auto train = [&] {  // new ids, old ones updated, some expiring
    std::vector<std::uint64_t> ids;
    for (std::uint64_t k = 0; k < 30; ++k) ids.push_back(psx::detail::mix64(step * 7 + k % 11) % 500);
    push(t, sgd, ids, 0.01f * static_cast<float>(step % 5), step, 2);
    ++step;
  };
  for (int k = 0; k < 10; ++k) train();
  psx::TableExport serving = paged(t, {}, 8, train);  // a step of training between every two pages
  for (int round = 0; round < 5; ++round) {
    serving.merge(paged(t, serving.cursor, 5, train));
    CHECK(std::set<std::uint64_t>(serving.ids.begin(), serving.ids.end()).size() == serving.ids.size());
  }
  serving.merge(paged(t, serving.cursor, 5, [] {}));  // idle now
  CHECK(serving.sorted() == t.export_rows().sorted());
  CHECK(step > 40);
}

TEST_CASE("embedding: export_table and table_stats in small pages over every transport equal the whole export") {
  psx_test::Watchdog dog("table pages");
  auto check = [](auto& ps) {
    TableOptions o;
    o.ttl_steps = 5;
    o.ttl_sweep_steps = 1;
    ps.declare(psx::embedding("emb", 3, psx::Initializer::uniform(-0.1f, 0.1f, 4), o));
    ps.declare(psx::dense("w", {2}));
    auto train = [&](std::uint64_t from, std::uint64_t to) {
      ps.run([&](psx::Worker& w) {
        std::vector<float> rows(40 * 3), g(40 * 3, 0.05f);
        for (std::uint64_t step = from; step < to; ++step) {
          std::vector<std::uint64_t> ids(40);
          for (std::size_t k = 0; k < ids.size(); ++k) ids[k] = psx::detail::mix64(step * 13 + k + 100 * w.index()) % 700;
          w.pull_rows("emb", ids, rows);
          w.push_rows("emb", ids, g);
          w.step();
        }
      });
    };
    train(0, 12);
    const psx::TableExport whole = ps.export_table("emb");
    REQUIRE(!whole.ids.empty());
    const psx::TableExport pages = ps.export_table("emb", {}, 100);  // a row and its id a page: 20 floats < 25
    CHECK(pages.sorted() == whole.sorted());
    CHECK(pages.cursor == whole.cursor);
    std::uint64_t rows = 0;
    for (const psx::TableStats& s : ps.table_stats("emb")) rows += s.rows;
    CHECK(rows == whole.ids.size());
    train(12, 24);  // rows change, expire and come back
    const psx::TableExport delta = ps.export_table("emb", whole.cursor, 400);
    CHECK(!delta.removed.empty());
    CHECK(delta.sorted() == ps.export_table("emb", whole.cursor).sorted());
    psx::TableExport serving = whole;
    serving.merge(delta);
    CHECK(serving.sorted() == ps.export_table("emb", {}, 1000).sorted());
    // A worker's own calls, from its function; another kind of variable is refused.
    ps.run([&](psx::Worker& w) {
      if (w.index() != 0) return;
      CHECK(w.export_table("emb", serving.cursor).ids.empty());
      CHECK(w.table_stats("emb").size() == ps.config().num_servers);
      CHECK_THROWS_WITH_AS(w.table_stats("w"), doctest::Contains("a dense variable, not a dynamic table"),
                           psx::config_error);
      CHECK_THROWS_AS(w.export_table("nope"), psx::unknown_variable);
    });
    // A cursor of another incarnation: refused, naming the server.
    psx::TableCursor stale = serving.cursor;
    stale.incarnation.back() += 1;
    CHECK(message_of<psx::checkpoint_error>([&] { ps.export_table("emb", stale, 100); })
              .ends_with("; take a full export (server " + std::to_string(ps.config().num_servers - 1) + " of " +
                         std::to_string(ps.config().num_servers) + ")"));
  };
  SUBCASE("in process") {
    psx::LocalCluster<psx::partition::HashByName, psx::sync::Synchronous, psx::optim::SGD> ps({3, 2}, {}, {},
                                                                                               {.lr = 0.1});
    check(ps);
    ps.shutdown();
    CHECK_THROWS_AS(ps.table_stats("emb"), psx::shutdown_error);
  }
  SUBCASE("in process, the waiting callers serving the inboxes") {
    psx::ParameterServer<psx::partition::HashByName, psx::sync::Synchronous, psx::optim::SGD> ps(
        {2, 2}, {}, {}, {.lr = 0.1}, psx::transport::InProcess{.waiters_serve = true});
    check(ps);
  }
  SUBCASE("simulated") {
    psx::ParameterServer<psx::partition::HashByName, psx::sync::Synchronous, psx::optim::SGD,
                         psx::transport::Simulated>
        ps({3, 2}, {}, {}, {.lr = 0.1});
    check(ps);
  }
}

TEST_CASE("embedding: a server refuses a table request that names no table of its own or the wrong sizes") {
  std::vector<psx::VariableInfo> vars(2);
  vars[0].meta = psx::detail::make_meta(psx::embedding("emb", 2), 0);
  vars[0].table = {};
  vars[0].ring = psx::detail::HashRing(2, vars[0].table.virtual_nodes);
  vars[0].shards = {{0, 0, 0}, {1, 0, 0}};
  vars[1].meta = psx::detail::make_meta(psx::dense("w", {4}), 1);
  vars[1].shards = {{0, 0, 4}};
  psx::Server<psx::sync::Asynchronous, psx::optim::SGD> server(0, 1, vars, {}, psx::optim::SGD{1.0f});
  auto send = [&](psx::Op op, std::uint32_t variable, std::uint32_t shard, std::vector<std::uint64_t> words,
                  std::size_t floats) {
    std::vector<float> out(floats);
    psx::Request r;
    r.op = op;
    r.items.push_back({variable, shard, words, {}, {}, out, {}});
    auto done = std::make_shared<psx::Completion>(1);
    r.done = done;
    server.handle(std::move(r));
    REQUIRE(done->ready());
    try {
      done->wait();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const std::vector<std::uint64_t> first = {0, 0, 0, 0};
  CHECK(send(psx::Op::table_stats, 0, 0, {}, psx::detail::table_stats_floats).empty());
  CHECK(send(psx::Op::table_export, 0, 0, first, psx::detail::page_floats(3, 2)).empty());
  CHECK(send(psx::Op::table_stats, 0, 1, {}, psx::detail::table_stats_floats)
            .find("names shard 1 of variable 0, which is not this server's part of a dynamic table") != std::string::npos);
  CHECK(send(psx::Op::table_stats, 1, 0, {}, psx::detail::table_stats_floats).find("not this server's part") !=
        std::string::npos);
  CHECK(send(psx::Op::table_stats, 0, 0, {}, 5).find("answer of 5 floats") != std::string::npos);
  CHECK(send(psx::Op::table_export, 0, 0, first, psx::detail::page_floats(3, 2) + 1).find("of table 'emb'") !=
        std::string::npos);
  CHECK(send(psx::Op::table_export, 0, 0, {0, 0}, psx::detail::page_floats(3, 2)).find("with 2 words") !=
        std::string::npos);
  CHECK(send(psx::Op::table_export, 0, 0, {0, 0, 0, 8}, psx::detail::page_floats(3, 2)).find("unknown flags 8") !=
        std::string::npos);
  CHECK(send(psx::Op::table_export, 0, 0, {1, 0, 0, psx::detail::page_delta}, psx::detail::page_floats(3, 2))
            .find("a delta from a cursor of another table") != std::string::npos);
  CHECK(server.stats().errors == 7);
}

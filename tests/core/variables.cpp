// Tests of psx/variable.hpp, psx/partition.hpp and psx/cluster.hpp.
#include "../support.hpp"

#include <psx/psx.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <numeric>
#include <set>
#include <sstream>
#include <vector>

using psx_test::message_of;

TEST_CASE("fnv1a64 matches the published test vectors") {
  CHECK(psx::detail::fnv1a64("") == 0xcbf29ce484222325ull);
  CHECK(psx::detail::fnv1a64("a") == 0xaf63dc4c8601ec8cull);
  CHECK(psx::detail::fnv1a64("foobar") == 0x85944171f73967e8ull);
}

TEST_CASE("initializers: values depend on seed, name and index only") {
  const auto init = psx::Initializer::normal(0.5f, 2.0f, 42);
  std::vector<float> all(1000), tail(400);
  init.fill("w", 0, all);
  init.fill("w", 600, tail);
  CHECK(std::equal(tail.begin(), tail.end(), all.begin() + 600));
  CHECK(init.value("w", 17) == all[17]);
  CHECK(init.value("w", 17) != init.value("v", 17));                               // name matters
  CHECK(init.value("w", 17) != psx::Initializer::normal(0.5f, 2.0f, 43).value("w", 17));  // seed matters
}

TEST_CASE("initializers draw from the stated distributions") {
  const std::size_t n = 200000;
  std::vector<float> x(n);
  auto moments = [&] {
    const double mean = std::accumulate(x.begin(), x.end(), 0.0) / n;
    double var = 0;
    for (float v : x) var += (v - mean) * (v - mean);
    return std::pair{mean, std::sqrt(var / n)};
  };

  SUBCASE("zeros and constant") {
    psx::Initializer::zeros().fill("a", 0, x);
    CHECK(std::all_of(x.begin(), x.end(), [](float v) { return v == 0.0f; }));
    psx::Initializer::constant(3.5f).fill("a", 0, x);
    CHECK(std::all_of(x.begin(), x.end(), [](float v) { return v == 3.5f; }));
  }
  SUBCASE("uniform") {
    psx::Initializer::uniform(-1.0f, 3.0f, 1).fill("u", 0, x);
    CHECK(*std::min_element(x.begin(), x.end()) >= -1.0f);
    CHECK(*std::max_element(x.begin(), x.end()) < 3.0f);
    auto [mean, sd] = moments();
    CHECK(mean == doctest::Approx(1.0).epsilon(0.01));
    CHECK(sd == doctest::Approx(4.0 / std::sqrt(12.0)).epsilon(0.01));
    // Where floats are coarse next to the width, the top draws round to
    // `high` (29 in a million here): they are kept below it.
    std::vector<float> coarse(1'000'000);
    psx::Initializer::uniform(1000.0f, 1001.0f, 4).fill("c", 0, coarse);
    CHECK(*std::max_element(coarse.begin(), coarse.end()) == std::nextafter(1001.0f, 0.0f));
    CHECK(*std::min_element(coarse.begin(), coarse.end()) == 1000.0f);
  }
  SUBCASE("normal") {
    psx::Initializer::normal(1.0f, 0.5f, 2).fill("n", 0, x);
    auto [mean, sd] = moments();
    CHECK(mean == doctest::Approx(1.0).epsilon(0.01));
    CHECK(sd == doctest::Approx(0.5).epsilon(0.01));
  }
  SUBCASE("truncated normal stays within two standard deviations") {
    psx::Initializer::truncated_normal(0.0f, 1.0f, 3).fill("t", 0, x);
    CHECK(*std::min_element(x.begin(), x.end()) >= -2.0f);
    CHECK(*std::max_element(x.begin(), x.end()) <= 2.0f);
    auto [mean, sd] = moments();
    CHECK(std::abs(mean) < 0.01);
    CHECK(sd == doctest::Approx(0.8796).epsilon(0.01));  // sd of N(0,1) truncated to [-2, 2]
  }
}

TEST_CASE("variable specs are checked") {
  CHECK(message_of<psx::shape_error>([] { psx::detail::make_meta(psx::dense("w", {3, 0}), 0); })
            .find("'w' has a zero extent in shape [3, 0]") != std::string::npos);
  CHECK(message_of<psx::shape_error>([] {
          psx::detail::make_meta({"e", {10}, psx::VariableKind::sparse}, 0);
        }).find("sparse variable 'e' needs a shape [rows, dim], got [10]") != std::string::npos);
  CHECK_THROWS_AS(psx::detail::make_meta(psx::dense("", {1}), 0), psx::config_error);
  // Names as long as checkpoints store, no longer (one was saved, and then never restored).
  CHECK(psx::detail::make_meta(psx::dense(std::string(psx::max_variable_name_bytes, 'n'), {1}), 0).name.size() ==
        65536);
  CHECK(message_of<psx::config_error>([] {
          psx::detail::make_meta(psx::dense(std::string(psx::max_variable_name_bytes + 1, 'n'), {1}), 0);
        }).find("a variable name of 65537 bytes (\"nnn") != std::string::npos);
  CHECK_THROWS_AS(psx::detail::make_meta(psx::dense("huge", {1ull << 40, 1ull << 40}), 0), psx::shape_error);

  const auto m = psx::detail::make_meta(psx::dense("w", {4, 3, 2}), 7);
  CHECK(m.rows == 4);
  CHECK(m.row_width == 6);
  CHECK(m.id == 7);
  const auto scalar = psx::detail::make_meta(psx::dense("s", {}), 0);
  CHECK(scalar.rows == 1);
  CHECK(scalar.row_width == 1);
}

namespace {
psx::VariableMeta meta(std::string name, std::size_t rows, std::uint32_t id = 0) {
  return psx::detail::make_meta(psx::dense(std::move(name), {rows, 2}), id);
}
}  // namespace

TEST_CASE("HashByName places by the specified hash") {
  const psx::partition::HashByName p;
  for (std::size_t servers : {1, 2, 3, 7}) {
    const auto shards = p.place(meta("layer1/weights", 10), servers);
    REQUIRE(shards.size() == 1);
    CHECK(shards[0] == psx::Shard{psx::detail::fnv1a64("layer1/weights") % servers, 0, 10});
  }
}

TEST_CASE("RoundRobin deals variables to servers in declaration order") {
  const psx::partition::RoundRobin p;
  for (std::uint32_t id = 0; id < 7; ++id) CHECK(p.place(meta("v", 5, id), 3)[0].server == id % 3);
}

TEST_CASE("RowRange tiles the rows in nearly equal ranges") {
  const psx::partition::RowRange p;
  for (std::size_t rows : {1, 2, 5, 10, 11, 1000}) {
    for (std::size_t servers : {1, 2, 3, 4}) {
      const auto m = meta("v", rows, 1);
      const auto shards = p.place(m, servers);
      CHECK_NOTHROW(psx::detail::check_placement(m, shards, servers));
      CHECK(shards.size() == std::min(rows, servers));
      std::set<std::size_t> used;
      std::size_t lo = rows, hi = 0;
      for (const auto& s : shards) {
        used.insert(s.server);
        lo = std::min(lo, s.rows());
        hi = std::max(hi, s.rows());
      }
      CHECK(used.size() == shards.size());  // one range per server
      CHECK(hi - lo <= 1);
    }
  }
  CHECK(psx::partition::RowRange{.min_rows = 100}.place(meta("v", 250), 4).size() == 2);
}

namespace {
psx::VariableMeta shaped(std::vector<std::size_t> shape, std::uint32_t id = 0, psx::DType dtype = psx::DType::float32) {
  psx::VariableSpec spec = psx::dense("v", std::move(shape));
  spec.dtype = dtype;
  return psx::detail::make_meta(spec, id);
}
std::vector<std::size_t> sizes(const std::vector<psx::Shard>& shards) {
  std::vector<std::size_t> n;
  for (const auto& s : shards) n.push_back(s.rows());
  return n;
}
}  // namespace

TEST_CASE("FixedShards, MinSize and MaxSize shard as TensorFlow's partitioners do") {
  using namespace psx::partition;
  // fixed_size_partitioner(3) of 10 rows: slices of 4, 3, 3; dealt from id % servers on.
  const auto fixed = FixedShards{3}.place(shaped({10, 4}, 1), 2);
  CHECK(sizes(fixed) == std::vector<std::size_t>{4, 3, 3});
  CHECK(fixed[0].server == 1);
  CHECK(fixed[1].server == 0);
  CHECK(fixed[2].server == 1);
  CHECK(FixedShards{8}.place(shaped({5, 4}), 3).size() == 5);  // at most one shard per row
  // min_max_variable_partitioner: the docstring's example, a float32 [1024, 1024] with 256 KiB slices.
  CHECK(MinSize{.max_shards = 16}.place(shaped({1024, 1024}), 4).size() == 16);
  CHECK(MinSize{.max_shards = 100}.place(shaped({1024, 1024}), 4).size() == 16);
  CHECK(MinSize{.max_shards = 8}.place(shaped({1024, 1024}), 4).size() == 8);
  CHECK(MinSize{.max_shards = 100}.place(shaped({1024, 1024}, 0, psx::DType::bfloat16), 4).size() == 8);
  CHECK(MinSize{.max_shards = 100}.place(shaped({10, 4}), 4).size() == 1);           // 160 B: one shard
  CHECK(MinSize{.max_shards = 100, .min_shard_bytes = 1}.place(shaped({3, 4}), 4).size() == 3);  // one per row
  // variable_axis_size_partitioner: 1000 rows of 256 B; 64 KiB shards hold 256 rows.
  CHECK(sizes(MaxSize{.max_shard_bytes = 64 << 10}.place(shaped({1000, 64}), 4)) ==
        std::vector<std::size_t>{250, 250, 250, 250});
  CHECK(MaxSize{.max_shard_bytes = (64 << 10) + 255}.place(shaped({1000, 64}), 4).size() == 4);
  CHECK(MaxSize{.max_shard_bytes = 64 << 10, .max_shards = 3}.place(shaped({1000, 64}), 4).size() == 3);
  CHECK(MaxSize{.max_shard_bytes = 100}.place(shaped({1000, 64}), 4).size() == 1000);  // a row is bigger: one each
  CHECK(MaxSize{.max_shard_bytes = 1 << 30}.place(shaped({1000, 64}), 4).size() == 1);
  // Every placement tiles the rows, for any shape and server count.
  std::mt19937_64 rng(9);
  for (int k = 0; k < 300; ++k) {
    const std::size_t rows = 1 + rng() % 5000, width = 1 + rng() % 300, servers = 1 + rng() % 9;
    const auto m = shaped({rows, width}, static_cast<std::uint32_t>(rng() % 7));
    CHECK_NOTHROW(psx::detail::check_placement(m, FixedShards{1 + rng() % 20}.place(m, servers), servers));
    CHECK_NOTHROW(psx::detail::check_placement(
        m, MinSize{.max_shards = 1 + rng() % 20, .min_shard_bytes = 1 + rng() % (1 << 20)}.place(m, servers), servers));
    CHECK_NOTHROW(psx::detail::check_placement(
        m, MaxSize{.max_shard_bytes = 1 + rng() % (1 << 20), .max_shards = rng() % 4}.place(m, servers), servers));
  }
  CHECK_THROWS_AS(FixedShards{0}.place(shaped({4}), 1), psx::config_error);
  CHECK_THROWS_AS(MinSize{.min_shard_bytes = 0}.place(shaped({4}), 1), psx::config_error);
  CHECK_THROWS_AS(MaxSize{.max_shard_bytes = 0}.place(shaped({4}), 1), psx::config_error);
  // No servers: refused by name (called directly, they divided by zero).
  const auto none = [&](const auto& p) {
    return message_of<psx::config_error>([&] { (void)p.place(shaped({4}), 0); });
  };
  CHECK(none(psx::partition::HashByName{}) == "psx: partition::HashByName: no servers to place 'v' on");
  CHECK(none(psx::partition::RoundRobin{}).find("RoundRobin: no servers") != std::string::npos);
  CHECK(none(psx::partition::RowRange{}).find("RowRange: no servers") != std::string::npos);
  CHECK(none(FixedShards{2}).find("FixedShards: no servers") != std::string::npos);
  CHECK(none(MinSize{}).find("MinSize: no servers") != std::string::npos);
  CHECK(none(MaxSize{}).find("MaxSize: no servers") != std::string::npos);
  CHECK(none(psx::partition::ConsistentHash{}).find("ConsistentHash: no servers") != std::string::npos);
}

TEST_CASE("a placement report gives each server's bytes and the balance") {
  psx::ParameterServer<psx::partition::FixedShards, psx::sync::Asynchronous, psx::optim::Adam> ps(
      {3, 1}, psx::partition::FixedShards{2});
  ps.declare(psx::dense("big", {1000, 256}));  // 2 shards of 500 rows: servers 0 and 1
  ps.declare(psx::dense("small", {10, 256}));  // 2 shards of 5 rows: servers 1 and 2
  const psx::PlacementReport r = ps.placement();
  const std::uint64_t row = 256 * 4 * 3;  // Adam: parameters and 2 slots
  CHECK(r.bytes == std::vector<std::uint64_t>{500 * row, 505 * row, 5 * row});
  CHECK(r.shards == std::vector<std::size_t>{1, 2, 1});
  CHECK(r.max_over_mean() == doctest::Approx(505.0 / (1010.0 / 3)));
  std::ostringstream os;
  os << r;
  CHECK(os.str() ==
        "server 0: 1 shards, 1.46 MiB\nserver 1: 2 shards, 1.48 MiB\nserver 2: 1 shards, 0.01 MiB\n"
        "max/mean bytes per server: 1.50");
  // HashByName ignores sizes: a report shows it.
  psx::ParameterServer<> hashed({4, 1});
  hashed.declare(psx::dense("big", {1000, 256}));
  CHECK(hashed.placement().max_over_mean() == doctest::Approx(4.0));
}

TEST_CASE("LeastLoaded puts each shard on the server holding the fewest bytes, largest first") {
  using psx::partition::LeastLoaded;
  // Whole variables of 100, 60, 50, 40, 30 and 20 rows over 2 servers, in
  // that order: 100 -> 0, 60 -> 1, 50 -> 1 (60 < 100), 40 -> 0 (100 < 110),
  // 30 -> 1 (110 < 140), 20 -> 0 (140 = 140: the lower index).
  psx::ParameterServer<LeastLoaded<>, psx::sync::Asynchronous, psx::optim::SGD> ps({2, 1});
  psx::ParameterServer<psx::partition::RoundRobin, psx::sync::Asynchronous, psx::optim::SGD> dealt({2, 1});
  const std::vector<std::size_t> rows = {100, 60, 50, 40, 30, 20};
  for (std::size_t k = 0; k < rows.size(); ++k) {
    ps.declare(psx::dense("v" + std::to_string(k), {rows[k], 8}));
    dealt.declare(psx::dense("v" + std::to_string(k), {rows[k], 8}));
  }
  std::vector<std::size_t> servers;
  for (std::size_t k = 0; k < rows.size(); ++k)
    servers.push_back(ps.variable("v" + std::to_string(k)).shards[0].server);
  CHECK(servers == std::vector<std::size_t>{0, 1, 1, 0, 1, 0});
  CHECK(ps.placement().bytes == std::vector<std::uint64_t>{160 * 32, 140 * 32});
  CHECK(ps.placement().max_over_mean() == doctest::Approx(160.0 / 150.0));
  CHECK(dealt.placement().max_over_mean() == doctest::Approx(180.0 / 150.0));  // by count: 100 + 50 + 30 on 0
  // Shards cut by another partitioner, the largest first: 4 shards of 250,
  // 250, 250, 250 rows after 1000 rows already on server 0 of 3.
  const std::vector<std::uint64_t> held = {1000 * 256, 0, 0};
  const auto split = LeastLoaded<psx::partition::FixedShards>{{4}}.place(shaped({1000, 64}), 3, held);
  CHECK(sizes(split) == std::vector<std::size_t>{250, 250, 250, 250});
  std::vector<std::size_t> on;
  for (const psx::Shard& sh : split) on.push_back(sh.server);
  CHECK(on == std::vector<std::size_t>{1, 2, 1, 2});
  // Every placement tiles the rows; the two-argument form starts from nothing.
  std::mt19937_64 rng(11);
  for (int k = 0; k < 200; ++k) {
    const std::size_t r = 1 + rng() % 5000, servers_n = 1 + rng() % 9;
    const auto m = shaped({r, 1 + rng() % 300}, static_cast<std::uint32_t>(rng() % 7));
    const LeastLoaded<psx::partition::MaxSize> p{{.max_shard_bytes = 1 + rng() % (1 << 20), .max_shards = rng() % 4}};
    CHECK_NOTHROW(psx::detail::check_placement(m, p.place(m, servers_n), servers_n));
  }
  // The heap it keeps gives what a scan for the least loaded server gives
  // (ties: the lower index), with many ties (equal loads and sizes).
  for (int k = 0; k < 300; ++k) {
    const std::size_t servers_n = 1 + rng() % 40;
    const auto m = shaped({1 + rng() % 3000, 1 + rng() % 8});
    std::vector<std::uint64_t> start_bytes(servers_n);
    for (auto& b : start_bytes) b = (rng() % 4) * 1000;  // few distinct loads: ties
    const LeastLoaded<psx::partition::FixedShards> p{{1 + rng() % 60}};
    const std::vector<psx::Shard> got = p.place(m, servers_n, start_bytes);
    std::vector<std::size_t> order(got.size());
    for (std::size_t j = 0; j < order.size(); ++j) order[j] = j;
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return got[a].rows() > got[b].rows(); });
    std::vector<std::uint64_t> load = start_bytes;
    bool same = true;
    for (const std::size_t j : order) {
      const auto least = static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin());
      same = same && got[j].server == least;
      load[least] += std::uint64_t{got[j].rows()} * psx::detail::row_bytes(m);
    }
    CHECK(same);
  }
  // The cluster keeps what each server holds as variables come: every
  // placement is the one the report of the variables before it gives.
  {
    using P = LeastLoaded<psx::partition::MaxSize>;
    const P p{{.max_shard_bytes = 4096, .max_shards = 0}};
    psx::ParameterServer<P, psx::sync::Asynchronous, psx::optim::SGD> many({7, 1}, p);
    for (int k = 0; k < 150; ++k) {
      psx::VariableSpec spec = psx::dense("m" + std::to_string(k), {1 + rng() % 500, 1 + rng() % 16});
      if (k % 5 == 0) spec.dtype = psx::DType::bfloat16;
      const std::vector<psx::VariableInfo> before = many.variables();
      const psx::VariableInfo placed = many.declare(spec);
      const auto want = p.place(placed.meta, 7, psx::placement_report(before, 7).bytes);
      bool same = want.size() == placed.shards.size();
      for (std::size_t j = 0; same && j < want.size(); ++j)
        same = want[j].server == placed.shards[j].server && want[j].row_begin == placed.shards[j].row_begin &&
               want[j].row_end == placed.shards[j].row_end;
      CHECK(same);
    }
  }
  std::ostringstream os;
  os << LeastLoaded<psx::partition::FixedShards>{{2}};
  CHECK(os.str() == "LeastLoaded{FixedShards{shards=2}}");
}

TEST_CASE("placements that do not tile the rows are refused") {
  const auto m = meta("w", 10);
  auto msg = [&](std::vector<psx::Shard> shards) {
    return message_of<psx::config_error>([&] { psx::detail::check_placement(m, shards, 2); });
  };
  CHECK(msg({}).find("no shard") != std::string::npos);
  CHECK(msg({{2, 0, 10}}).find("names server 2") != std::string::npos);
  CHECK(msg({{0, 0, 4}, {1, 5, 10}}).find("next row to cover is 4") != std::string::npos);
  CHECK(msg({{0, 0, 4}}).find("end at row 4") != std::string::npos);
}

TEST_CASE("VariableInfo::shard_of_row finds the owning shard") {
  psx::VariableInfo v;
  v.meta = meta("w", 10);
  v.shards = psx::partition::RowRange{}.place(v.meta, 3);  // [0,4) [4,7) [7,10)
  CHECK(v.shard_of_row(0) == 0);
  CHECK(v.shard_of_row(3) == 0);
  CHECK(v.shard_of_row(4) == 1);
  CHECK(v.shard_of_row(6) == 1);
  CHECK(v.shard_of_row(9) == 2);
  // Every row, for even splits (the guess hits) and uneven ones (a guess
  // far off: the search), against a scan of the shards.
  std::mt19937_64 rng(3);
  for (int round = 0; round < 40; ++round) {
    const std::size_t rows = 1 + rng() % 3000, n = 1 + rng() % std::min<std::size_t>(rows, 70);
    v.meta = meta("w", rows);
    if (round % 2 == 0) {
      v.shards = psx::partition::RowRange{}.place(v.meta, n);
    } else {  // cut points anywhere, one shard per server
      std::set<std::size_t> cuts = {0, rows};
      while (cuts.size() < n + 1) cuts.insert(1 + rng() % (rows - 1));
      v.shards.clear();
      for (auto it = cuts.begin(); std::next(it) != cuts.end(); ++it)
        v.shards.push_back({v.shards.size(), *it, *std::next(it)});
    }
    for (std::size_t row = 0; row < rows; ++row) {
      const std::size_t k = v.shard_of_row(row);
      REQUIRE(k < v.shards.size());
      if (v.shards[k].row_begin > row || row >= v.shards[k].row_end) FAIL("row " << row << " not in shard " << k);
    }
  }
}

TEST_CASE("ShardRange splits a data set like tf.data's shard") {
  const psx::ShardRange r(10, 4, 1);
  CHECK(std::vector<std::size_t>(r.begin(), r.end()) == std::vector<std::size_t>{1, 5, 9});
  CHECK(r.size() == 3);
  CHECK(r[2] == 9);
  CHECK(psx::ShardRange(3, 4, 3).empty());
  CHECK(psx::ShardRange(0, 2, 0).empty());
  std::vector<int> seen(103, 0);
  for (std::size_t i = 0; i < 5; ++i)
    for (std::size_t k : psx::ShardRange(103, 5, i)) ++seen[k];
  CHECK(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; }));
}

TEST_CASE("policy values print what they are") {
  auto str = [](const auto& v) {
    std::ostringstream os;
    os << v;
    return os.str();
  };
  CHECK(str(psx::partition::HashByName{}) == "HashByName");
  CHECK(str(psx::partition::RowRange{.min_rows = 8}) == "RowRange{min_rows=8}");
  CHECK(str(psx::sync::Synchronous{}) == "Synchronous{mean, on_worker_lost=fail}");
  CHECK(str(psx::sync::BoundedStaleness<2>{psx::sync::Aggregate::sum, psx::OnWorkerLost::shrink}) ==
        "BoundedStaleness<2>{sum, on_worker_lost=shrink}");
  CHECK(str(psx::sync::BoundedStaleness<psx::sync::unbounded>{}) ==
        "BoundedStaleness<unbounded>{mean, on_worker_lost=fail}");
  CHECK(str(psx::sync::SyncReplicas<3>{}) == "SyncReplicas<3>{mean}");
  CHECK(str(psx::sync::Asynchronous{true, 0.5f}) == "Asynchronous{staleness_scaled_lr=true, delay_compensation=0.5}");
  psx::sync::Hybrid<psx::sync::Synchronous, psx::sync::Asynchronous> h{.second_names = {"emb/*"}};
  CHECK(str(h) == "Hybrid{Synchronous{mean, on_worker_lost=fail}, "
                  "Asynchronous{staleness_scaled_lr=false, delay_compensation=0} for 'emb/*'}");
  CHECK(h == h);
  CHECK(str(psx::optim::SGD{0.25f}) == "SGD{lr=0.25}");
  CHECK(str(psx::transport::InProcess{}) == "InProcess");
  CHECK(str(psx::transport::InProcess{.waiters_serve = true}) == "InProcess{waiters_serve=true}");
  CHECK(str(psx::transport::InProcess{.waiters_serve = true, .spin = std::chrono::microseconds{0}}) ==
        "InProcess{waiters_serve=true, spin=0us}");
  CHECK(str(psx::transport::InProcess{.wait_spin = std::chrono::microseconds{300}}) == "InProcess{wait_spin=300us}");
  CHECK(str(psx::transport::InProcess{.wait_spin = std::chrono::microseconds{0}}) == "InProcess{wait_spin=0us}");
  CHECK(str(psx::ClusterConfig{2, 4}) == "ClusterConfig{servers=2, workers=4, peer_timeout=transport default}");
  CHECK(str(psx::ClusterConfig{2, 4, std::chrono::milliseconds(0)}) ==
        "ClusterConfig{servers=2, workers=4, peer_timeout=0ms}");
}

TEST_CASE("peer_timeout: the transport's default unless set, off in one process, explicit values kept") {
  using namespace std::chrono_literals;
  // In one process a thread cannot die in silence: the default is off.
  psx::ParameterServer<> in({.num_servers = 1, .num_workers = 2});
  CHECK(in.config().peer_timeout == 0ms);
  psx::ParameterServer<> set({.num_servers = 1, .num_workers = 2, .peer_timeout = 1500ms});
  CHECK(set.config().peer_timeout == 1500ms);
  CHECK_THROWS_AS(psx::ParameterServer<>({.num_servers = 1, .num_workers = 1, .peer_timeout = -2ms}),
                  psx::config_error);
}

TEST_CASE("RowAccumulator: sums repeated rows in order of first appearance, reused across widths and sizes") {
  // The server's sum of a push_rows request's repeated ids (open addressing):
  // checked against std::map over rounds that grow the table, shrink the
  // request again (only the used slots are emptied) and change the width.
  psx::detail::RowAccumulator acc;
  std::mt19937_64 rng(7);
  for (int round = 0; round < 12; ++round) {
    const std::size_t width = 1 + round % 5;
    const std::size_t n = round % 3 == 0 ? 20000 : 1 + rng() % 300;
    const std::uint64_t range = round % 2 ? 50 : std::uint64_t{1} << 62;
    acc.reset(width);
    std::map<std::uint64_t, std::vector<float>> want;
    std::vector<std::uint64_t> order;
    for (std::size_t j = 0; j < n; ++j) {
      // Ids near 0 and near the top of the range, and many repeats.
      const std::uint64_t row = rng() % 4 == 0 ? rng() % 8 : rng() % range;
      std::vector<float> g(width);
      for (auto& x : g) x = static_cast<float>(rng() % 100) - 50.0f;
      acc.add(row, g.data());
      auto [it, fresh] = want.try_emplace(row, width, 0.0f);
      if (fresh) order.push_back(row);
      for (std::size_t i = 0; i < width; ++i) it->second[i] += g[i];
    }
    INFO("round " << round);
    REQUIRE(acc.rows() == order);
    REQUIRE(acc.data().size() == order.size() * width);
    for (std::size_t k = 0; k < order.size(); ++k)
      CHECK(std::equal(acc.row_data(k), acc.row_data(k) + width, want[order[k]].begin()));
  }
  acc.clear();
  CHECK(acc.empty());
  const float one = 1.0f;
  acc.reset(1);
  acc.add(UINT64_MAX, &one);
  acc.add(0, &one);
  acc.add(UINT64_MAX, &one);
  CHECK(acc.rows() == std::vector<std::uint64_t>{UINT64_MAX, 0});
  CHECK(acc.data() == std::vector<float>{2.0f, 1.0f});
}

// Checkpoints written while training goes on: DynamicTable::Snapshot (the
// rows as they were at one moment, whatever changes while they are read),
// checkpoint::save_in_background and BackgroundSave::finish (the state of
// its step exactly, its failures leaving the earlier checkpoints whole),
// and checkpoint::Manager's `background`.
#include <psx/checkpoint.hpp>
#include <psx/psx.hpp>

#include "../splitmix.hpp"
#include "../support.hpp"
#include "gate.hpp"

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <thread>
#include <vector>

namespace fs = std::filesystem;
using psx_test::message_of;
using psx_test::TempDir;
using psx_test::Watchdog;

namespace {

// -- a table alone ---------------------------------------------------------------------------

using Table = psx::DynamicTable<psx::optim::Adagrad>;
const psx::optim::Adagrad kOpt{.lr = 0.1};
constexpr std::size_t kDim = 16;

psx::UpdateContext at(std::uint64_t step) {
  psx::UpdateContext c;
  c.global_step = step;
  return c;
}

std::vector<std::uint64_t> ids_from(std::uint64_t first, std::size_t n, std::uint64_t stride = 1) {
  std::vector<std::uint64_t> ids(n);
  for (std::size_t k = 0; k < n; ++k) ids[k] = psx_test::Splitmix64{first + k * stride}.next();
  return ids;
}

void push(Table& t, const std::vector<std::uint64_t>& ids, std::uint64_t step) {
  std::vector<float> g(ids.size() * kDim);
  for (std::size_t i = 0; i < g.size(); ++i) g[i] = 0.01f * static_cast<float>(i % 13) - 0.05f;
  t.push(kOpt, ids, g, at(step));
}

void pull(const Table& t, const std::vector<std::uint64_t>& ids, std::uint64_t step) {
  std::vector<float> out(ids.size() * kDim);
  t.pull(ids, {}, out, step);
}

// Rows as a checkpoint holds them (id, last update, last use, row, slots), by id.
using Rows = std::map<std::uint64_t, std::vector<std::byte>>;

void add_rows(Rows& into, std::span<const std::byte> bytes) {
  const std::size_t row = psx::detail::table_row_bytes(kDim, kOpt.slots());
  REQUIRE(bytes.size() % row == 0);
  for (std::size_t at = 0; at < bytes.size(); at += row) {
    std::uint64_t id;
    std::memcpy(&id, bytes.data() + at, sizeof id);
    const bool once = into.emplace(id, std::vector<std::byte>(bytes.begin() + at, bytes.begin() + at + row)).second;
    CHECK(once);  // no row twice
  }
}

Rows rows_now(const Table& t) {
  Rows r;
  t.checkpoint_rows([&](std::span<const std::byte> b) { add_rows(r, b); });
  return r;
}

void check_same_state(const psx::detail::TableState& a, const psx::detail::TableState& b) {
  CHECK(a.rows == b.rows);
  CHECK(a.version == b.version);
  CHECK(a.next_sweep == b.next_sweep);
  CHECK(a.admitted == b.admitted);
  CHECK(a.refused == b.refused);
  CHECK(a.evicted_ttl == b.evicted_ttl);
  CHECK(a.evicted_memory == b.evicted_memory);
  CHECK(a.sketch_added == b.sketch_added);
  CHECK(a.layout == b.layout);
}

// Two stripes of 60,000 rows (three 4 MiB blocks each), a time to live, a
// memory cap that the rows fill (each new id evicts), admission after two
// pushes (a sketch).
psx::TableOptions full_table_options(std::uint64_t cap) {
  psx::TableOptions o;
  o.stripes = 2;
  o.ttl_steps = 40;
  o.ttl_sweep_steps = 1000000;  // sweeps only when the test calls expire
  o.memory_cap_bytes = cap;
  o.admission = psx::Admission::after_pushes(2, 1 << 14, 2);
  return o;
}

constexpr std::size_t kRows = 120000;

// A table holding kRows rows, pushed twice each (admitted at the second),
// its cap what they take: each id admitted from now on evicts.
std::unique_ptr<Table> full_table(std::uint64_t& cap) {
  if (cap == 0) {  // what kRows rows take, measured on a table without a cap
    Table probe("emb", kDim, psx::Initializer::uniform(-0.1f, 0.1f, 3), full_table_options(0), kOpt);
    push(probe, ids_from(1, kRows), 1);
    push(probe, ids_from(1, kRows), 2);
    cap = probe.stats().bytes;
  }
  auto t = std::make_unique<Table>("emb", kDim, psx::Initializer::uniform(-0.1f, 0.1f, 3), full_table_options(cap), kOpt);
  push(*t, ids_from(1, kRows), 1);
  push(*t, ids_from(1, kRows), 2);
  return t;
}

// Round r of changes: updates of stored rows, new ids admitted (evicting
// the least recently used rows), pulls moving rows' last use, and in round
// 3 a sweep that expires every row not updated since the start.
void change(Table& t, int r) {
  const std::uint64_t step = 10 + static_cast<std::uint64_t>(r) * 5;
  push(t, ids_from(1 + static_cast<std::uint64_t>(r) * 997, 3000, 37), step);   // stored rows updated
  const auto fresh = ids_from(5000000 + static_cast<std::uint64_t>(r) * 4000, 3000);
  push(t, fresh, step);
  push(t, fresh, step);  // admitted, each evicting
  pull(t, ids_from(2 + static_cast<std::uint64_t>(r) * 331, 3000, 11), step + 1);  // last use moved
  if (r == 3) t.expire(step + 45);
}

}  // namespace

TEST_CASE("background save: a table's snapshot gives every row as it was, whatever changes while it is read") {
  Watchdog dog("snapshot", std::chrono::seconds(120));
  std::uint64_t cap = 0;
  auto t = full_table(cap);
  auto twin = full_table(cap);  // the same changes, no snapshot
  pull(*t, ids_from(1, 5000, 3), 3);
  pull(*twin, ids_from(1, 5000, 3), 3);
  const Rows before = rows_now(*t);
  const psx::detail::TableState state = t->checkpoint_state();
  const std::vector<std::uint8_t> sketch = t->checkpoint_sketch();
  REQUIRE(before.size() > kRows / 2);

  auto snap = t->snapshot();
  CHECK(message_of<psx::checkpoint_error>([&] { (void)t->snapshot(); }).find("one at a time") != std::string::npos);
  check_same_state(snap->state(), state);
  CHECK(snap->sketch() == sketch);
  Rows seen;
  int blocks = 0;
  snap->rows([&](std::span<const std::byte> b) {
    add_rows(seen, b);
    change(*t, blocks);  // between any two blocks: within a stripe, and between stripes
    change(*twin, blocks);
    ++blocks;
  });
  MESSAGE(blocks << " blocks; " << snap->copied_bytes() << " bytes copied before they changed");
  CHECK(blocks >= 4);
  CHECK(snap->copied_bytes() > 0);
  CHECK(seen.size() == state.rows);
  CHECK(seen == before);  // every row, bit for bit: parameters, slots, last update, last use
  const psx::TableStats s = t->stats();
  CHECK(s.evicted_memory > 0);
  CHECK(s.evicted_ttl > 0);
  CHECK(message_of<psx::checkpoint_error>([&] { snap->rows([](std::span<const std::byte>) {}); })
            .find("read once") != std::string::npos);
  snap.reset();
  // The table itself went on as if no snapshot had been taken.
  CHECK(rows_now(*t) == rows_now(*twin));
  check_same_state(t->checkpoint_state(), twin->checkpoint_state());
  // And the next snapshot sees it as it is now.
  const Rows now = rows_now(*t);
  auto again = t->snapshot();
  Rows seen_again;
  again->rows([&](std::span<const std::byte> b) { add_rows(seen_again, b); });
  CHECK(seen_again == now);
}

TEST_CASE("background save: a snapshot read while other threads push and pull is the table of its moment") {
  Watchdog dog("snapshot threads", std::chrono::seconds(120));
  std::uint64_t cap = 0;
  auto t = full_table(cap);
  const Rows before = rows_now(*t);
  auto snap = t->snapshot();
  std::atomic<bool> done{false};
  std::atomic<int> rounds{0};
  auto hammer = [&](int who) {
    for (int r = 0; r < 400 && !done.load(); ++r) {
      const std::uint64_t step = 10 + static_cast<std::uint64_t>(r);
      if (who == 0) {
        push(*t, ids_from(1 + static_cast<std::uint64_t>(r) * 101, 500, 7), step);
        const auto fresh = ids_from(9000000 + static_cast<std::uint64_t>(r) * 600, 500);
        push(*t, fresh, step);
        push(*t, fresh, step);
      } else {
        pull(*t, ids_from(3 + static_cast<std::uint64_t>(r) * 211, 500, 5), step);
      }
      rounds.fetch_add(1);
    }
  };
  std::thread pusher(hammer, 0), puller(hammer, 1);
  Rows seen;
  snap->rows([&](std::span<const std::byte> b) {
    add_rows(seen, b);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // let the others in between blocks
  });
  done.store(true);
  pusher.join();
  puller.join();
  MESSAGE(rounds.load() << " rounds of pushes and pulls while it was read; " << snap->copied_bytes() << " bytes copied");
  CHECK(rounds.load() > 0);
  CHECK(seen == before);
}

TEST_CASE("background save: a snapshot called off stops where it is, and the next one can begin") {
  Watchdog dog("snapshot stop");
  std::uint64_t cap = 0;
  auto t = full_table(cap);
  auto snap = t->snapshot();
  std::atomic<bool> stop{false};
  int blocks = 0;
  const std::string what = message_of<psx::checkpoint_error>([&] {
    snap->rows(
        [&](std::span<const std::byte>) {
          ++blocks;
          stop.store(true);
        },
        &stop);
  });
  CHECK(what.find("called off") != std::string::npos);
  CHECK(blocks == 1);
  change(*t, 0);  // the stripes not read yet still copy, until the snapshot ends
  CHECK(snap->copied_bytes() > 0);
  snap.reset();
  const Rows now = rows_now(*t);
  auto again = t->snapshot();  // the first one is over
  CHECK(again->copied_bytes() == 0);
  Rows seen;
  again->rows([&](std::span<const std::byte> b) { add_rows(seen, b); });
  CHECK(seen == now);
}

// -- a cluster -------------------------------------------------------------------------------------

namespace {

using PS = psx::ParameterServer<psx::partition::RoundRobin, psx::sync::Synchronous, psx::optim::Adagrad>;
constexpr std::size_t kServers = 2, kWorkers = 2;

psx::TableOptions cluster_table() {
  psx::TableOptions o;
  o.stripes = 4;
  o.ttl_steps = 6;
  o.ttl_sweep_steps = 2;
  o.admission = psx::Admission::after_pushes(2, 1 << 12, 2);
  return o;
}

void declare(PS& ps) {
  ps.declare(psx::embedding("emb", 8, psx::Initializer::uniform(-0.1f, 0.1f, 5), cluster_table()));
  ps.declare(psx::dense("w", {64, 8}, psx::Initializer::uniform(-0.2f, 0.2f, 6)));
}

// One step: ids drawn from a stream that moves on, gradients from the rows pulled.
void train_step(psx::Worker& w) {
  const std::uint64_t t = w.clock();
  std::vector<std::uint64_t> ids(64);
  for (std::size_t k = 0; k < ids.size(); ++k)
    ids[k] = psx_test::Splitmix64{1 + (w.index() * 131 + t * 17 + k * 7) % (400 + 40 * t)}.next();
  std::vector<float> rows(ids.size() * 8), dense(64 * 8);
  w.pull_rows("emb", ids, rows);
  w.pull("w", dense);
  std::vector<float> g(rows.size()), gd(dense.size());
  for (std::size_t i = 0; i < g.size(); ++i) g[i] = 0.5f * rows[i] + dense[i % dense.size()] - 0.01f;
  for (std::size_t i = 0; i < gd.size(); ++i) gd[i] = 0.25f * dense[i] + 0.001f * static_cast<float>(t);
  w.push_rows("emb", ids, g);
  w.push("w", gd);
  w.step();
}

fs::path dir_of(const fs::path& root, std::uint64_t step) {
  return root / psx::checkpoint::detail::checkpoint_dir_name(step);
}

// Two checkpoints hold the same state: every variable, every table part.
void check_same_checkpoint(const fs::path& a, const fs::path& b) {
  const auto x = psx::checkpoint::load_variable(a, "w"), y = psx::checkpoint::load_variable(b, "w");
  CHECK(x.values == y.values);
  CHECK(x.slots == y.slots);
  CHECK(x.version == y.version);
  const auto s = psx::checkpoint::load_table(a, "emb"), t = psx::checkpoint::load_table(b, "emb");
  REQUIRE(s.ids.size() > 50);
  CHECK(s.ids == t.ids);
  CHECK(s.values == t.values);
  CHECK(s.slots == t.slots);
  CHECK(s.updated == t.updated);
  CHECK(s.used == t.used);
  REQUIRE(s.parts.size() == t.parts.size());
  for (std::size_t k = 0; k < s.parts.size(); ++k) {
    check_same_state(s.parts[k].state, t.parts[k].state);
    CHECK(s.parts[k].state.shard_version == t.parts[k].state.shard_version);
    CHECK(s.parts[k].sketch == t.parts[k].sketch);
  }
}

}  // namespace

TEST_CASE("background save: the checkpoint holds its step exactly while training goes on, and training is as without it") {
  Watchdog dog("background save", std::chrono::seconds(120));
  TempDir stopped("bg-stopped"), background("bg-background");
  psx_test::WriteGate gate;
  gate.open();
  PS ps({kServers, kWorkers}, {}, {}, kOpt);
  declare(ps);
  bool written_early = true;
  ps.run([&](psx::Worker& w) {
    while (w.clock() < 6) train_step(w);
    psx::checkpoint::save(ps, w, stopped.path);  // the reference: training waits for it
    if (w.is_chief()) gate.close();
    psx::checkpoint::BackgroundSave b = psx::checkpoint::save_in_background(ps, w, background.path);
    CHECK(b.pending());
    CHECK(b.step() == 6);
    CHECK(b.directory() == dir_of(fs::absolute(background.path), 6));
    while (w.clock() < 10) train_step(w);  // the servers' writers wait at the gate meanwhile
    w.barrier();
    if (w.is_chief()) {
      written_early = b.written(w);
      gate.open_when_waited(static_cast<int>(kServers));
    }
    const psx::checkpoint::Info info = b.finish(w);
    CHECK(info.step == 6);
    CHECK(!b.pending());
    while (w.clock() < 14) train_step(w);
  });
  CHECK(!written_early);
  CHECK(gate.waited() == static_cast<int>(kServers));
  psx::checkpoint::verify(dir_of(background.path, 6));
  check_same_checkpoint(dir_of(stopped.path, 6), dir_of(background.path, 6));
  // Training went on as if there had been no save at all.
  PS straight({kServers, kWorkers}, {}, {}, kOpt);
  declare(straight);
  straight.run([&](psx::Worker& w) {
    while (w.clock() < 14) train_step(w);
  });
  CHECK(ps.read("w") == straight.read("w"));
  CHECK(ps.export_table("emb").sorted() == straight.export_table("emb").sorted());
}

TEST_CASE("background save: one save at a time, and no restore while one is written") {
  Watchdog dog("background one at a time", std::chrono::seconds(120));
  TempDir root("bg-one");
  psx_test::WriteGate gate;
  PS ps({kServers, kWorkers}, {}, {}, kOpt);
  declare(ps);
  std::vector<std::string> chief;
  ps.run([&](psx::Worker& w) {
    while (w.clock() < 2) train_step(w);
    psx::checkpoint::save(ps, w, root.path);
    train_step(w);
    psx::checkpoint::BackgroundSave b = psx::checkpoint::save_in_background(ps, w, root.path);
    train_step(w);
    auto refused = [&](auto&& f) {
      try {
        f();
      } catch (const psx::checkpoint_error& e) {
        if (w.is_chief()) chief.push_back(e.what());
        return true;
      }
      return false;
    };
    CHECK(refused([&] { (void)psx::checkpoint::save_in_background(ps, w, root.path); }));
    CHECK(refused([&] { psx::checkpoint::save(ps, w, root.path); }));
    CHECK(refused([&] { psx::checkpoint::restore(ps, w, dir_of(root.path, 2)); }));
    CHECK(w.clock() == 4);
    if (w.is_chief()) gate.open();
    CHECK(b.finish(w).step == 3);
    CHECK(refused([&] { (void)b.finish(w); }));
    CHECK(refused([&] { (void)b.written(w); }));
    psx::checkpoint::restore(ps, w, dir_of(root.path, 3));  // no save pending now
    CHECK(w.clock() == 3);
  });
  REQUIRE(chief.size() == 5);
  CHECK(chief[0].find("in the background while it still writes step 3 (one save at a time)") != std::string::npos);
  CHECK(chief[1].find("while it still writes step 3") != std::string::npos);
  CHECK(chief[2].find("while it writes step 3 in the background") != std::string::npos);
  CHECK(chief[3].find("no save is pending") != std::string::npos);
  CHECK(chief[4].find("no save is pending") != std::string::npos);
  psx::checkpoint::verify(dir_of(root.path, 3));
}

TEST_CASE("background save: a save that fails at any point leaves the previous checkpoint, and training unharmed") {
  Watchdog dog("background faults", std::chrono::seconds(120));
  TempDir root("bg-faults");
  PS ps({kServers, kWorkers}, {}, {}, kOpt);
  declare(ps);
  auto& countdown = psx::checkpoint::detail::fault_countdown();
  int failures = 0;
  bool saved = false;
  ps.run([&](psx::Worker& w) {
    while (w.clock() < 3) train_step(w);
    psx::checkpoint::save(ps, w, root.path);
    bool mine = false;  // every worker learns the same outcome
    for (long k = 1; k < 200 && !mine; ++k) {
      w.barrier();
      if (w.is_chief()) countdown = k;
      w.barrier();
      try {
        psx::checkpoint::BackgroundSave b = psx::checkpoint::save_in_background(ps, w, root.path);
        train_step(w);
        b.finish(w);
        mine = true;
      } catch (const psx::checkpoint_error& e) {
        if (w.is_chief()) {
          const std::string what = e.what();
          CHECK(what.find("injected failure") != std::string::npos);
          ++failures;
          psx::checkpoint::verify(dir_of(root.path, 3));
          // Only the last fsync, of the directory holding it, fails after the checkpoint is complete.
          const auto latest = psx::checkpoint::latest(root.path);
          REQUIRE(latest);
          CHECK((latest->step == 3 || what.find("fsync") != std::string::npos));
        }
      }
      w.barrier();
      if (w.is_chief()) countdown = 0;
    }
    if (w.is_chief()) saved = mine;
    train_step(w);
  });
  MESSAGE(failures << " failures injected");
  CHECK(saved);
  CHECK(failures >= 10);
  const auto latest = psx::checkpoint::latest(root.path);
  REQUIRE(latest);
  psx::checkpoint::verify(latest->path);
  CHECK(latest->step > 3);
  // No temporary directory left behind but the newest's own.
  int temporary = 0;
  for (const auto& e : fs::directory_iterator(root.path))
    if (e.path().filename().string().rfind(".ckpt-", 0) == 0) ++temporary;
  CHECK(temporary == 0);
}

TEST_CASE("background save: a Manager saving in the background keeps the same checkpoints as one that stops") {
  Watchdog dog("background manager", std::chrono::seconds(120));
  TempDir stopping("bg-manager-stop"), background("bg-manager-bg");
  for (const bool in_background : {false, true}) {
    PS ps({kServers, kWorkers}, {}, {}, kOpt);
    declare(ps);
    psx::checkpoint::Manager<PS> ckpt(ps, {.directory = in_background ? background.path : stopping.path,
                                           .every_steps = 3,
                                           .max_to_keep = 2,
                                           .background = in_background});
    ps.run([&](psx::Worker& w) {
      while (w.clock() < 10) {
        train_step(w);
        ckpt.maybe_save(w);
      }
      const auto last = ckpt.finish(w);
      CHECK(last.has_value() == in_background);
      CHECK(!ckpt.finish(w));
    });
  }
  for (const fs::path& root : {stopping.path, background.path}) {
    const auto all = psx::checkpoint::list(root);
    REQUIRE(all.size() == 2);
    CHECK(all[0].step == 6);
    CHECK(all[1].step == 9);
  }
  check_same_checkpoint(dir_of(stopping.path, 9), dir_of(background.path, 9));
  check_same_checkpoint(dir_of(stopping.path, 6), dir_of(background.path, 6));
  PS ps({kServers, kWorkers}, {}, {}, kOpt);
  declare(ps);
  psx::checkpoint::Manager<PS> ckpt(ps, {.directory = background.path, .background = true});
  ps.run([&](psx::Worker& w) { CHECK(ckpt.restore_or_init(w) == 9); });
}

// Checkpoints: exact resume, restore into other layouts, atomic saves under
// injected failures, every corruption named, the golden files of each format.
#include <psx/checkpoint.hpp>
#include <psx/psx.hpp>

#include "../support.hpp"
#include "faults.hpp"

#include <doctest/doctest.h>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace fs = std::filesystem;
using psx_test::TempDir;
using psx_test::Watchdog;

namespace {

constexpr std::size_t kWorkers = 2;
constexpr std::size_t kRows = 7, kCols = 5;       // "w": dense, split by rows
constexpr std::size_t kTable = 40, kDim = 4;      // "emb": sparse
constexpr std::size_t kBatch = 6;

float grad(float x, std::size_t worker, std::uint64_t t, std::size_t i) {
  // Deterministic, depends on the value pulled (so a wrong restore shows).
  const float noise = static_cast<float>((worker * 131 + t * 31 + i * 7) % 17) / 17.0f - 0.5f;
  return 0.3f * x + noise;
}

std::vector<std::uint64_t> batch_ids(std::size_t worker, std::uint64_t t) {
  std::vector<std::uint64_t> ids(kBatch);
  for (std::size_t j = 0; j < kBatch; ++j) ids[j] = (worker * 13 + t * 7 + j * j * 3) % kTable;
  return ids;
}

void train_step(psx::Worker& w) {
  const std::uint64_t t = w.clock();
  psx_test::toy_step(w, t, batch_ids(w.index(), t), kRows * kCols, kDim, grad);
}

template <class PS>
void declare(PS& ps) {
  ps.declare(psx::dense("w", {kRows, kCols}, psx::Initializer::normal(0, 1, 3)));
  ps.declare(psx::sparse("emb", kTable, kDim, psx::Initializer::uniform(-1, 1, 4)));
  ps.declare(psx::dense("frozen", {3}, psx::Initializer::constant(2.5f), false));
}

template <class O, class P = psx::partition::RowRange>
using Cluster = psx::ParameterServer<P, psx::sync::Synchronous, O>;

// Trains a fresh cluster: restores `from` first when given, trains until
// the clock reaches `until`, saves into `root` at the end when given.
template <class O, class P = psx::partition::RowRange>
std::uint64_t train(const O& opt, std::size_t servers, std::uint64_t until, const fs::path& from,
                    const fs::path& root) {
  Cluster<O, P> ps({servers, kWorkers}, P{}, {}, opt);
  declare(ps);
  std::atomic<std::uint64_t> resumed{0};
  ps.run([&](psx::Worker& w) {
    if (!from.empty()) {
      const auto step = psx::checkpoint::restore(ps, w, from);
      CHECK(w.clock() == step);
      if (w.is_chief()) resumed = step;
    }
    while (w.clock() < until) train_step(w);
    if (!root.empty()) psx::checkpoint::save(ps, w, root);
  });
  return resumed;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Every variable of two checkpoints, parameters and slots, bit for bit.
void check_same_state(const fs::path& a, const fs::path& b) {
  for (const char* name : {"w", "emb", "frozen"}) {
    CAPTURE(name);
    const auto va = psx::checkpoint::load_variable(a, name), vb = psx::checkpoint::load_variable(b, name);
    CHECK(va.num_slots == vb.num_slots);
    CHECK(va.version == vb.version);
    CHECK(same_bits(va.values, vb.values));
    CHECK(same_bits(va.slots, vb.slots));
  }
}

fs::path dir_of(const fs::path& root, std::uint64_t step) {
  return root / psx::checkpoint::detail::checkpoint_dir_name(step);
}

template <class O>
void check_exact_resume(const O& opt) {
  Watchdog dog("exact resume");
  TempDir straight("straight"), halves("halves");
  train(opt, 3, 100, {}, straight.path);
  train(opt, 3, 50, {}, halves.path);
  // A new cluster, another server count and partitioner, resumes at 50.
  CHECK(train<O, psx::partition::HashByName>(opt, 2, 100, dir_of(halves.path, 50), halves.path) == 50);
  check_same_state(dir_of(straight.path, 100), dir_of(halves.path, 100));
  const auto v = psx::checkpoint::load_variable(dir_of(straight.path, 100), "w");
  CHECK(v.num_slots == opt.slots());
  CHECK(v.version == 100);
}

// Overwrites `n` bytes at `offset` of `file`.
void poke(const fs::path& file, std::uintmax_t offset, const std::string& bytes) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string restore_error(const fs::path& dir, std::size_t servers = 2,
                          psx::VariableSpec w_spec = psx::dense("w", {kRows, kCols})) {
  Cluster<psx::optim::Adam> ps({servers, 1}, {}, {}, {});
  ps.declare(w_spec);
  ps.declare(psx::sparse("emb", kTable, kDim, psx::Initializer::uniform(-1, 1, 4)));
  ps.declare(psx::dense("frozen", {3}, psx::Initializer::constant(2.5f), false));
  const auto before = ps.read("emb");
  std::string message;
  ps.run([&](psx::Worker& w) {
    try {
      psx::checkpoint::restore(ps, w, dir);
    } catch (const psx::checkpoint_error& e) {
      message = e.what();
    }
  });
  // A refused checkpoint changes nothing.
  CHECK(same_bits(ps.read("emb"), before));
  return message;
}

// What this process writes to file descriptor 2 while it lives (psx logs
// with fprintf(stderr)), read back by text().
class StderrCapture {
 public:
  StderrCapture() : file_(std::tmpfile()) {
    REQUIRE(file_ != nullptr);
    std::fflush(stderr);
    saved_ = ::dup(2);
    REQUIRE(saved_ >= 0);
    REQUIRE(::dup2(::fileno(file_), 2) == 2);
  }
  StderrCapture(const StderrCapture&) = delete;
  StderrCapture& operator=(const StderrCapture&) = delete;
  ~StderrCapture() {
    put_back();
    std::fclose(file_);
  }
  std::string text() {
    put_back();
    std::rewind(file_);
    std::string out;
    for (int c; (c = std::fgetc(file_)) != EOF;) out += static_cast<char>(c);
    return out;
  }

 private:
  void put_back() {
    if (saved_ < 0) return;
    std::fflush(stderr);
    ::dup2(saved_, 2);
    ::close(saved_);
    saved_ = -1;
  }
  std::FILE* file_;
  int saved_ = -1;
};

using FallbackPS = Cluster<psx::optim::Adam>;

// Checkpoints of steps 4, 8 and 12 under `root`, saved by a Manager.
void save_steps_4_8_12(const fs::path& root) {
  FallbackPS ps({2, kWorkers}, {}, {}, {.lr = 0.01});
  declare(ps);
  psx::checkpoint::Manager<FallbackPS> ckpt(ps, {.directory = root, .every_steps = 4, .max_to_keep = 0});
  ps.run([&](psx::Worker& w) {
    while (w.clock() < 12) {
      train_step(w);
      ckpt.maybe_save(w);
    }
  });
  REQUIRE(ckpt.all().size() == 3);
}

// A new cluster's restore_or_init, on every worker: what each returned or
// threw, what stderr said meanwhile, and the parameters afterwards.
struct Resumed {
  std::vector<std::uint64_t> steps = std::vector<std::uint64_t>(kWorkers, 99);
  std::vector<std::string> errors = std::vector<std::string>(kWorkers);
  std::string log;
  std::vector<float> w, emb, w_before, emb_before;
};

Resumed resume(const fs::path& root) {
  FallbackPS ps({2, kWorkers}, {}, {}, {.lr = 0.01});
  declare(ps);
  psx::checkpoint::Manager<FallbackPS> ckpt(ps, {.directory = root});
  Resumed out;
  out.w_before = ps.read("w");
  out.emb_before = ps.read("emb");
  {
    StderrCapture err;
    ps.run([&](psx::Worker& w) {
      try {
        out.steps[w.index()] = ckpt.restore_or_init(w);
        CHECK(w.clock() == out.steps[w.index()]);
      } catch (const psx::checkpoint_error& e) {
        out.errors[w.index()] = e.what();
        CHECK(w.clock() == 0);  // unchanged
      }
    });
    out.log = err.text();
  }
  out.w = ps.read("w");
  out.emb = ps.read("emb");
  return out;
}

// The line restore_or_init prints for a checkpoint it skips.
std::string skip_line(const fs::path& root, std::uint64_t step, const fs::path& file, const std::string& why) {
  return "psx: warning: checkpoint: skipping step " + std::to_string(step) + " in " + root.string() +
         ": checkpoint file " + (dir_of(root, step) / file).string() + ": " + why + "\n";
}

// Flips the 4 bytes that end `from_end` bytes before the end of `file` (its data part).
void flip_data(const fs::path& file, std::uintmax_t from_end = 16) {
  const auto at = fs::file_size(file) - from_end;
  std::ifstream in(file, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(at));
  std::string bytes(4, '\0');
  in.read(bytes.data(), 4);
  in.close();
  for (char& c : bytes) c = static_cast<char>(~c);
  poke(file, at, bytes);
}

}  // namespace

TEST_CASE("checkpoint: 100 steps equal 50, a checkpoint, a new cluster and 50 more, bit for bit (Adam)") {
  check_exact_resume(psx::optim::Adam{.lr = 0.01});
}

TEST_CASE("checkpoint: 100 steps equal 50, a checkpoint, a new cluster and 50 more, bit for bit (FTRL)") {
  check_exact_resume(psx::optim::Ftrl{.lr = 0.05, .l1 = 0.01, .l2 = 0.001});
}

TEST_CASE("checkpoint: saved with 3 servers, restored with 2 and with 5, every value and slot comes back") {
  Watchdog dog("restore anywhere");
  TempDir three("three"), again("again");
  const psx::optim::Adam adam{.lr = 0.01};
  train(adam, 3, 20, {}, three.path);
  for (const std::size_t servers : {2u, 5u}) {
    CAPTURE(servers);
    fs::remove_all(again.path);
    // Restore, then save at once: the new layout's files hold the same state.
    train(adam, servers, 20, dir_of(three.path, 20), again.path);
    check_same_state(dir_of(three.path, 20), dir_of(again.path, 20));
    CHECK(psx::checkpoint::read_manifest(dir_of(again.path, 20)).num_servers == servers);
  }
  // And pulls after a restore return the saved parameters.
  Cluster<psx::optim::Adam, psx::partition::RoundRobin> ps({5, 1}, {}, {}, adam);
  declare(ps);
  ps.run([&](psx::Worker& w) { psx::checkpoint::restore(ps, w, dir_of(three.path, 20)); });
  CHECK(same_bits(ps.read("emb"), psx::checkpoint::load_variable(dir_of(three.path, 20), "emb").values));
}

TEST_CASE("checkpoint: the manifest records variables, layout, step and optimizer") {
  TempDir root("manifest");
  train(psx::optim::Adam{.lr = 0.01}, 3, 4, {}, root.path);
  const auto m = psx::checkpoint::verify(dir_of(root.path, 4));
  CHECK(m.format_version == psx::checkpoint::format_version);
  CHECK(m.step == 4);
  CHECK(m.num_servers == 3);
  CHECK(m.num_workers == kWorkers);
  CHECK(m.optimizer_slots == 2);
  CHECK(m.optimizer.find("Adam") != std::string::npos);
  REQUIRE(m.variables.size() == 3);
  CHECK(m.variables[0].name == "w");
  CHECK(m.variables[0].shape == std::vector<std::uint64_t>{kRows, kCols});
  CHECK(m.variables[0].shards.size() == 3);
  CHECK(m.variables[1].kind == "sparse");
  CHECK(!m.variables[2].trainable);
  CHECK(m.files.size() == 3);
  const auto frozen = psx::checkpoint::load_variable(dir_of(root.path, 4), "frozen");
  CHECK(frozen.values == std::vector<float>{2.5f, 2.5f, 2.5f});
}

TEST_CASE("checkpoint: a save that fails at any point leaves the previous checkpoint loadable and latest() on it") {
  Watchdog dog("injected failures", std::chrono::seconds(120));
  TempDir root("faults");
  using PS = Cluster<psx::optim::Adam>;
  PS ps({3, 1}, {}, {}, {.lr = 0.01});
  declare(ps);
  int failures = 0;
  ps.run([&](psx::Worker& w) {
    for (int i = 0; i < 3; ++i) train_step(w);
    psx::checkpoint::save(ps, w, root.path);  // the good one, at step 3
    for (int i = 0; i < 2; ++i) train_step(w);
    failures = psx_test::save_through_each_failure(ps, w, root.path, 3, [] {});
  });
  CHECK(failures >= 10);  // open, writes, fsyncs and renames of 3 shard files and the manifest
  const auto latest = psx::checkpoint::latest(root.path);
  REQUIRE(latest);
  CHECK(latest->step == 5);
  // Nothing of the failed attempts is left behind.
  std::size_t entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(root.path)) ++entries;
  CHECK(entries == 2);  // ckpt-3 and ckpt-5
  MESSAGE("a save failed at each of " << failures << " points; the previous checkpoint survived every one");
}

TEST_CASE("checkpoint: every kind of damage is named, and a refused checkpoint changes nothing") {
  Watchdog dog("damage");
  TempDir root("damage");
  train(psx::optim::Adam{.lr = 0.01}, 3, 2, {}, root.path);
  const fs::path good = dir_of(root.path, 2);
  auto fresh = [&](const std::string& name) {
    const fs::path d = root.path / name;
    fs::remove_all(d);
    fs::copy(good, d);
    return d;
  };
  const std::string shard0 = psx::checkpoint::detail::server_file_name(0);
  SUBCASE("truncated shard file") {
    const fs::path d = fresh("truncated");
    fs::resize_file(d / shard0, fs::file_size(d / shard0) - 10);
    const auto m = restore_error(d);
    CHECK(m.find(shard0) != std::string::npos);
    CHECK(m.find("truncated: the header promises") != std::string::npos);
  }
  SUBCASE("a flipped bit in the data") {
    const fs::path d = fresh("flipped");
    const auto size = fs::file_size(d / shard0);
    std::ifstream in(d / shard0, std::ios::binary);
    in.seekg(static_cast<std::streamoff>(size - 5));
    char c = 0;
    in.get(c);
    in.close();
    poke(d / shard0, size - 5, std::string(1, static_cast<char>(c ^ 0x10)));
    const auto m = restore_error(d);
    CHECK(m.find(shard0) != std::string::npos);
    CHECK(m.find("corrupted data (CRC-32C mismatch)") != std::string::npos);
    CHECK_THROWS_WITH_AS(psx::checkpoint::verify(d), doctest::Contains("corrupted data"), psx::checkpoint_error);
  }
  SUBCASE("a flipped bit in a header") {
    const fs::path d = fresh("header");
    poke(d / shard0, 17, "\x7f");
    CHECK(restore_error(d).find("corrupted header (CRC-32C mismatch)") != std::string::npos);
  }
  SUBCASE("a missing shard file") {
    const fs::path d = fresh("missing");
    fs::remove(d / psx::checkpoint::detail::server_file_name(2));
    const auto m = restore_error(d);
    CHECK(m.find("server-00002.psx: missing") != std::string::npos);
  }
  SUBCASE("a manifest from a newer format") {
    const fs::path d = fresh("newer");
    psx::checkpoint::detail::Header h;
    h.version = psx::checkpoint::format_version + 1;
    h.kind = psx::checkpoint::detail::FileKind::manifest;
    const auto bytes = psx::checkpoint::detail::encode_header(h);
    fs::resize_file(d / "manifest.psx", 0);
    poke(d / "manifest.psx", 0, std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
    const auto m = restore_error(d);
    CHECK(m.find("manifest.psx") != std::string::npos);
    const std::string newer = std::to_string(psx::checkpoint::format_version + 1);
    const std::string newest = std::to_string(psx::checkpoint::format_version);
    CHECK(m.find("written in checkpoint format " + newer + "; this psx reads formats 1 to " + newest +
                 " (a newer psx wrote it: upgrade psx to read it)") != std::string::npos);
  }
  SUBCASE("a manifest whose optimizer slots would overflow a size, its CRC right") {
    // load_variable sized its buffers by slots + 1: 2^64 - 1 slots divided by zero.
    const fs::path d = fresh("slots");
    auto m = psx::checkpoint::read_manifest(d);
    m.optimizer_slots = std::numeric_limits<std::uint64_t>::max();
    psx::checkpoint::detail::write_manifest(d, m);
    CHECK_THROWS_WITH_AS(psx::checkpoint::load_variable(d, "w"),
                         doctest::Contains("its optimizer keeps 18446744073709551615 floats per parameter, more than 64"),
                         psx::checkpoint_error);
  }
  SUBCASE("not a checkpoint at all") {
    const fs::path d = fresh("garbage");
    std::ofstream(d / "manifest.psx") << std::string(100, 'x');
    CHECK(restore_error(d).find("not a psx checkpoint file (bad magic)") != std::string::npos);
  }
  SUBCASE("wrong shapes for the declared variables") {
    const auto m = restore_error(good, 2, psx::dense("w", {kRows, kCols + 1}));
    CHECK(m.find("variable 'w' has shape [7, 5], declared [7, 6]") != std::string::npos);
  }
  SUBCASE("a declared variable the checkpoint lacks") {
    const auto m = restore_error(good, 2, psx::dense("w2", {kRows, kCols}));
    CHECK(m.find("has no variable 'w2', which this program declares") != std::string::npos);
  }
}

// Row blocks of 2 alternately on servers 0 and 1: several shards of one
// variable on one server (the Partitioner concept allows it).
struct Alternating {
  std::vector<psx::Shard> place(const psx::VariableMeta& v, std::size_t num_servers) const {
    std::vector<psx::Shard> out;
    for (std::size_t r = 0, k = 0; r < v.rows; r += 2, ++k) out.push_back({k % num_servers, r, std::min(r + 2, v.rows)});
    return out;
  }
};

TEST_CASE("checkpoint: several shards of a variable on one server restore into another layout") {
  TempDir root("ckpt-alternating");
  std::vector<float> w_saved;
  {
    psx::ParameterServer<Alternating, psx::sync::Synchronous, psx::optim::Adam> ps({2, 1}, {}, {}, {.lr = 0.01});
    declare(ps);
    ps.run([&](psx::Worker& w) {
      for (int i = 0; i < 3; ++i) train_step(w);
      psx::checkpoint::save(ps, w, root.path);
    });
    w_saved = ps.read("w");
  }
  CHECK(same_bits(psx::checkpoint::load_variable(dir_of(root.path, 3), "w").values, w_saved));
  Cluster<psx::optim::Adam> one({1, 1}, {}, {}, {.lr = 0.01});
  declare(one);
  one.run([&](psx::Worker& w) { CHECK(psx::checkpoint::restore(one, w, dir_of(root.path, 3)) == 3); });
  CHECK(same_bits(one.read("w"), w_saved));
}

TEST_CASE("checkpoint: a save or a restore that fails throws on every worker, not on the chief alone") {
  Watchdog dog("failure on every worker");
  TempDir root("ckpt-everyone");
  Cluster<psx::optim::Adam> ps({2, 3}, {}, {}, {.lr = 0.01});
  declare(ps);
  std::atomic<int> save_errors{0}, restore_errors{0};
  ps.run([&](psx::Worker& w) {
    train_step(w);
    if (w.is_chief()) psx::checkpoint::detail::fault_countdown() = 3;
    w.barrier();
    try {
      psx::checkpoint::save(ps, w, root.path);
    } catch (const psx::checkpoint_error& e) {
      ++save_errors;
      if (!w.is_chief()) CHECK(std::string(e.what()).find("the chief could not save") != std::string::npos);
    }
    w.barrier();
    if (w.is_chief()) psx::checkpoint::detail::fault_countdown() = 0;
    psx::checkpoint::save(ps, w, root.path);  // a good one, at step 1
    const fs::path dir = dir_of(root.path, 1);
    w.barrier();
    if (w.is_chief()) fs::resize_file(dir / "server-00001.psx", 100);  // then damaged
    w.barrier();
    try {
      psx::checkpoint::restore(ps, w, dir);
    } catch (const psx::checkpoint_error&) {
      ++restore_errors;
      CHECK(w.clock() == 1);  // unchanged
    }
  });
  CHECK(save_errors == 3);
  CHECK(restore_errors == 3);
}

TEST_CASE("checkpoint: another optimizer's state is refused with both named") {
  TempDir root("optimizer");
  train(psx::optim::Adam{.lr = 0.01}, 2, 2, {}, root.path);
  Cluster<psx::optim::SGD> ps({2, 1}, {}, {}, {});
  declare(ps);
  ps.run([&](psx::Worker& w) {
    CHECK_THROWS_WITH_AS(psx::checkpoint::restore(ps, w, dir_of(root.path, 2)),
                         doctest::Contains("keeps 2 slots per parameter, this program's 0"), psx::checkpoint_error);
  });
  // As many slots, other meanings: SGD's momentum is not Adagrad's
  // accumulator (restored, its negative values made parameters NaN).
  TempDir momentum("momentum");
  const psx::optim::SGD sgd{.lr = 0.1, .momentum = 0.9};
  train(sgd, 2, 2, {}, momentum.path);
  Cluster<psx::optim::Adagrad> adagrad({2, 1}, {}, {}, {});  // one worker: the chief, whose error names the cause
  declare(adagrad);
  adagrad.run([&](psx::Worker& w) {
    CHECK_THROWS_WITH_AS(psx::checkpoint::restore(adagrad, w, dir_of(momentum.path, 2)),
                         doctest::Contains("(SGD vs Adagrad)"), psx::checkpoint_error);
  });
  // A schedule keeps no state: SGD's checkpoint restores under one.
  const auto scheduled = psx::optim::scheduled(sgd, psx::schedule::Cosine{.decay_steps = 10});
  Cluster<std::decay_t<decltype(scheduled)>> with_schedule({2, kWorkers}, {}, {}, scheduled);
  declare(with_schedule);
  with_schedule.run([&](psx::Worker& w) { CHECK(psx::checkpoint::restore(with_schedule, w, dir_of(momentum.path, 2)) == 2); });
  CHECK(psx::checkpoint::detail::optimizer_kind("Scheduled{Scheduled{Adam{lr=1}, Cosine{}}, Warmup{}}") == "Adam");
  CHECK(psx::checkpoint::detail::optimizer_kind("Pruned{Scheduled{SGD{lr=1}, X{}}, P{}, names=[]}") == "Pruned{SGD}");
  CHECK(psx::checkpoint::detail::optimizer_kind("N5MyOpt") == "N5MyOpt");  // no operator<<: the type's name
  CHECK(psx::checkpoint::detail::optimizer_kind("MyOpt(lr=0.1)") == "MyOpt");
  CHECK(psx::checkpoint::detail::optimizer_kind("AdamW{lr=1}") == "Adam");  // the same slots
}

TEST_CASE("checkpoint: restore during a run, a rolled-back Manager, steps of 11 digits, an empty path") {
  Watchdog dog("checkpoint edges");
  TempDir root("edges");
  using PS = Cluster<psx::optim::SGD>;
  {
    // Every worker restores at the same clock while one is still in its
    // last step: restore waits for it (it hung when the chief went ahead).
    PS ps({2, kWorkers}, {}, {}, {.lr = 0.1});
    declare(ps);
    ps.run([&](psx::Worker& w) {
      while (w.clock() < 3) train_step(w);
      psx::checkpoint::save(ps, w, root.path);
      while (w.clock() < 5) {
        if (w.index() == 1 && w.clock() == 4) std::this_thread::sleep_for(std::chrono::milliseconds(200));
        train_step(w);
      }
      CHECK(psx::checkpoint::restore(ps, w, dir_of(root.path, 3)) == 3);
      CHECK(w.clock() == 3);
    });
  }
  {
    // Steps 4 and 8 saved, then back to 4 and on to 6 with max_to_keep = 1:
    // the new 6 stays (an older rule deleted it, 8 being newer), 4 goes, and 8,
    // of the run rolled back, is left alone (latest() is still 8).
    TempDir managed("edges-manager");
    PS ps({2, kWorkers}, {}, {}, {.lr = 0.1});
    declare(ps);
    psx::checkpoint::Manager<PS> ckpt(ps, {.directory = managed.path, .every_steps = 4, .max_to_keep = 2});
    ps.run([&](psx::Worker& w) {
      while (w.clock() < 8) {
        train_step(w);
        ckpt.maybe_save(w);
      }
    });
    psx::checkpoint::Manager<PS> again(ps, {.directory = managed.path, .every_steps = 6, .max_to_keep = 1});
    ps.run([&](psx::Worker& w) {
      CHECK(psx::checkpoint::restore(ps, w, dir_of(managed.path, 4)) == 4);
      while (w.clock() < 6) {
        train_step(w);
        again.maybe_save(w);
      }
    });
    const auto all = again.all();
    REQUIRE(all.size() == 2);
    CHECK(all[0].step == 6);
    CHECK(all[1].step == 8);
    CHECK(again.latest()->step == 8);
  }
  // Names of steps from 10^10 on have more than 10 digits.
  CHECK(psx::checkpoint::detail::step_of_dir_name("ckpt-10000000000") == std::uint64_t{10000000000});
  CHECK(psx::checkpoint::detail::step_of_dir_name("ckpt-18446744073709551615") ==
        std::numeric_limits<std::uint64_t>::max());
  CHECK_FALSE(psx::checkpoint::detail::step_of_dir_name("ckpt-18446744073709551616"));  // beyond 64 bits
  CHECK_FALSE(psx::checkpoint::detail::step_of_dir_name("ckpt-00000000001"));           // not how 1 is written
  CHECK_FALSE(psx::checkpoint::detail::step_of_dir_name("ckpt-000000001"));
  CHECK(psx::checkpoint::detail::step_of_dir_name("ckpt-0000000001") == 1u);
  // An empty path is a checkpoint_error, not a filesystem_error.
  PS ps({1, kWorkers}, {}, {}, {.lr = 0.1});
  declare(ps);
  ps.run([&](psx::Worker& w) {
    CHECK_THROWS_WITH_AS(psx::checkpoint::save(ps, w, ""), doctest::Contains("directory is empty"), psx::checkpoint_error);
    CHECK_THROWS_WITH_AS(psx::checkpoint::restore(ps, w, ""), doctest::Contains("path is empty"), psx::checkpoint_error);
  });
}

TEST_CASE("checkpoint: Manager saves by time too: the chief's clock decides, every worker follows") {
  Watchdog dog("manager by time");
  TempDir root("manager-time");
  using PS = Cluster<psx::optim::Adam>;
  PS ps({2, 3}, {}, {}, {.lr = 0.01});
  declare(ps);
  psx::checkpoint::Manager<PS> ckpt(
      ps, {.directory = root.path, .every_seconds = std::chrono::seconds(1), .check_every_steps = 2});
  std::atomic<int> saves{0};
  std::vector<std::uint64_t> saved_at(3, 0);
  ps.run([&](psx::Worker& w) {
    while (w.clock() < 8) {
      train_step(w);
      if (w.is_chief() && w.clock() == 3) std::this_thread::sleep_for(std::chrono::milliseconds(1100));
      if (ckpt.maybe_save(w)) {
        ++saves;
        saved_at[w.index()] = w.clock();
      }
    }
  });
  CHECK(saves == 3);  // once, by all three workers, at the first check after the second passed
  CHECK(saved_at == std::vector<std::uint64_t>{4, 4, 4});
  const auto all = ckpt.all();
  REQUIRE(all.size() == 1);
  CHECK(all[0].step == 4);
}

TEST_CASE("checkpoint: Worker::agree_max gives every worker the largest value passed") {
  Cluster<psx::optim::SGD> ps({3, 4}, {}, {}, {});
  declare(ps);
  std::vector<std::uint64_t> got(4);
  ps.run([&](psx::Worker& w) {
    got[w.index()] = w.agree_max(w.index() == 2 ? (std::uint64_t{1} << 40) + 7 : w.index());
    CHECK(w.agree_max(0) == 0);
  });
  CHECK(got == std::vector<std::uint64_t>(4, (std::uint64_t{1} << 40) + 7));
}

TEST_CASE("checkpoint: Manager saves every N steps, keeps the last ones and resumes from the newest") {
  Watchdog dog("manager");
  TempDir root("manager");
  using PS = Cluster<psx::optim::Adam>;
  const psx::checkpoint::Options options{.directory = root.path, .every_steps = 4, .max_to_keep = 2};
  {
    PS ps({2, kWorkers}, {}, {}, {.lr = 0.01});
    declare(ps);
    psx::checkpoint::Manager<PS> ckpt(ps, options);
    ps.run([&](psx::Worker& w) {
      CHECK(ckpt.restore_or_init(w) == 0);
      while (w.clock() < 13) {
        train_step(w);
        ckpt.maybe_save(w);
      }
    });
    const auto all = ckpt.all();
    REQUIRE(all.size() == 2);
    CHECK(all[0].step == 8);
    CHECK(all[1].step == 12);
  }
  // A new run resumes at 12 and reaches the state of a run that never stopped.
  PS ps({3, kWorkers}, {}, {}, {.lr = 0.01});
  declare(ps);
  psx::checkpoint::Manager<PS> ckpt(ps, options);
  ps.run([&](psx::Worker& w) {
    CHECK(ckpt.restore_or_init(w) == 12);
    while (w.clock() < 16) {
      train_step(w);
      ckpt.maybe_save(w);
    }
  });
  TempDir straight("manager-straight");
  train(psx::optim::Adam{.lr = 0.01}, 2, 16, {}, straight.path);
  check_same_state(dir_of(straight.path, 16), dir_of(root.path, 16));
}

TEST_CASE("checkpoint: the chief's view of the checkpoints decides a restore, whatever the other workers see") {
  // Each worker once read the directory itself: one that saw no checkpoint
  // (or could not read the manifest) went on while the chief restored, and
  // the collectives of the two no longer matched (a hang).
  Watchdog dog("chief's view");
  TempDir root("views"), empty("views-empty");
  train(psx::optim::Adam{.lr = 0.01}, 2, 4, {}, root.path);
  using PS = Cluster<psx::optim::Adam>;
  {
    PS ps({2, kWorkers}, {}, {}, {.lr = 0.01});
    declare(ps);
    std::vector<psx::checkpoint::Manager<PS>> managers;
    for (std::size_t k = 0; k < kWorkers; ++k)  // worker 0, the chief, sees the checkpoint; the others an empty directory
      managers.emplace_back(ps, psx::checkpoint::Options{.directory = k == 0 ? root.path : empty.path});
    std::vector<std::uint64_t> resumed(kWorkers, 99);
    ps.run([&](psx::Worker& w) { resumed[w.index()] = managers[w.index()].restore_or_init(w); });
    CHECK(resumed == std::vector<std::uint64_t>(kWorkers, 4));
  }
  {
    PS ps({2, kWorkers}, {}, {}, {.lr = 0.01});
    declare(ps);
    std::vector<std::uint64_t> resumed(kWorkers, 99);
    ps.run([&](psx::Worker& w) {
      resumed[w.index()] = psx::checkpoint::restore(ps, w, w.is_chief() ? dir_of(root.path, 4) : empty.path / "nowhere");
      CHECK(w.clock() == 4);
    });
    CHECK(resumed == std::vector<std::uint64_t>(kWorkers, 4));
  }
  {  // and the chief seeing none: nobody restores
    PS ps({2, kWorkers}, {}, {}, {.lr = 0.01});
    declare(ps);
    std::vector<psx::checkpoint::Manager<PS>> managers;
    for (std::size_t k = 0; k < kWorkers; ++k)
      managers.emplace_back(ps, psx::checkpoint::Options{.directory = k == 0 ? empty.path : root.path});
    std::vector<std::uint64_t> resumed(kWorkers, 99);
    ps.run([&](psx::Worker& w) { resumed[w.index()] = managers[w.index()].restore_or_init(w); });
    CHECK(resumed == std::vector<std::uint64_t>(kWorkers, 0));
  }
}

TEST_CASE("checkpoint: restore_or_init falls back past a damaged newest checkpoint, saying why on stderr") {
  // Four flipped bytes in the newest shard's data once made every restart
  // throw; a truncated shard or a deleted manifest made it resume from the
  // previous checkpoint with no word.
  Watchdog dog("fallback");
  TempDir root("fallback");
  save_steps_4_8_12(root.path);
  const fs::path abs = fs::absolute(root.path);
  const std::string shard1 = psx::checkpoint::detail::server_file_name(1);
  std::string expected_log;
  SUBCASE("four flipped bytes in the newest shard's data") {
    flip_data(dir_of(root.path, 12) / shard1);
    expected_log = skip_line(abs, 12, shard1, "corrupted data (CRC-32C mismatch)");
  }
  SUBCASE("the newest shard file truncated") {
    const fs::path file = dir_of(root.path, 12) / shard1;
    const auto h = psx::checkpoint::detail::read_header(file, psx::checkpoint::detail::FileKind::shards);
    fs::resize_file(file, fs::file_size(file) - 10);
    expected_log = skip_line(abs, 12, shard1,
                             "truncated: the header promises " + std::to_string(h.meta_bytes) + " + " +
                                 std::to_string(h.data_bytes) + " bytes after it, the file has " +
                                 std::to_string(h.meta_bytes + h.data_bytes - 10) +
                                 " (it ends inside shard 1 of 'frozen')");  // the last in its data part
  }
  SUBCASE("the newest manifest deleted") {
    fs::remove(dir_of(root.path, 12) / "manifest.psx");
    expected_log = skip_line(abs, 12, "manifest.psx", "missing");
  }
  const Resumed r = resume(root.path);
  CHECK(r.errors == std::vector<std::string>(kWorkers));
  CHECK(r.steps == std::vector<std::uint64_t>(kWorkers, 8));
  CHECK(r.log == expected_log);
  // The previous checkpoint's parameters exactly, nothing of the damaged one.
  CHECK(same_bits(r.w, psx::checkpoint::load_variable(dir_of(root.path, 8), "w").values));
  CHECK(same_bits(r.emb, psx::checkpoint::load_variable(dir_of(root.path, 8), "emb").values));
}

TEST_CASE("checkpoint: restore_or_init throws, naming each, when every checkpoint is damaged") {
  // Starting from scratch then would throw away the run without a word.
  Watchdog dog("fallback, all damaged");
  TempDir root("fallback-all");
  save_steps_4_8_12(root.path);
  const fs::path abs = fs::absolute(root.path);
  const std::string shard0 = psx::checkpoint::detail::server_file_name(0);
  flip_data(dir_of(root.path, 12) / shard0);
  fs::resize_file(dir_of(root.path, 8) / shard0, 100);
  fs::remove(dir_of(root.path, 4) / "manifest.psx");
  const Resumed r = resume(root.path);
  CHECK(r.steps == std::vector<std::uint64_t>(kWorkers, 99));  // none returned
  const std::string& chief = r.errors[0];
  CHECK(chief.find("no checkpoint in " + abs.string() + " can be restored (3 found)") != std::string::npos);
  CHECK(chief.find("step 12: checkpoint file " + (dir_of(abs, 12) / shard0).string() +
                   ": corrupted data (CRC-32C mismatch)") != std::string::npos);
  CHECK(chief.find("step 8: checkpoint file " + (dir_of(abs, 8) / shard0).string() + ": truncated") != std::string::npos);
  CHECK(chief.find("step 4: checkpoint file " + (dir_of(abs, 4) / "manifest.psx").string() + ": missing") !=
        std::string::npos);
  for (std::size_t k = 1; k < kWorkers; ++k)
    CHECK(r.errors[k].find("the chief could not restore a checkpoint from") != std::string::npos);
  // One line per checkpoint skipped, newest first, and nothing restored.
  std::istringstream lines(r.log);
  std::vector<std::string> skipped;
  for (std::string line; std::getline(lines, line);) skipped.push_back(line);
  REQUIRE(skipped.size() == 3);
  CHECK(skipped[0].starts_with("psx: warning: checkpoint: skipping step 12 in "));
  CHECK(skipped[1].starts_with("psx: warning: checkpoint: skipping step 8 in "));
  CHECK(skipped[2].starts_with("psx: warning: checkpoint: skipping step 4 in "));
  CHECK(same_bits(r.w, r.w_before));
  CHECK(same_bits(r.emb, r.emb_before));
}

TEST_CASE("crc32c: the three-lane hardware version equals the table version, and both the standard check values") {
  const char* check = "123456789";
  const auto nine = std::as_bytes(std::span(check, 9));
  CHECK(psx::detail::crc32c(nine) == 0xE3069283u);
  CHECK(psx::detail::crc32c_portable(nine) == 0xE3069283u);
  CHECK(psx::detail::crc32_ieee(nine) == 0xCBF43926u);
  std::vector<std::byte> data(200000);
  std::uint64_t x = 88172645463325252ull;
  for (auto& b : data) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    b = static_cast<std::byte>(x);
  }
  for (std::size_t len : {0u, 1u, 7u, 8u, 9u, 24575u, 24576u, 24577u, 49152u, 73735u, 199990u})
    for (std::size_t off : {0u, 1u, 5u}) {
      CAPTURE(len);
      CAPTURE(off);
      const auto s = std::span<const std::byte>(data).subspan(off, len);
      CHECK(psx::detail::crc32c(s) == psx::detail::crc32c_portable(s));
      CHECK(psx::detail::crc32c(s, 0x12345678u) == psx::detail::crc32c_portable(s, 0x12345678u));
      // Extending over two parts equals one pass over both.
      CHECK(psx::detail::crc32c(s.subspan(len / 3), psx::detail::crc32c(s.first(len / 3))) == psx::detail::crc32c(s));
    }
}

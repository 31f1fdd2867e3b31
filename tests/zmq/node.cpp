// One task of a psx cluster over ZeroMQ, as a process: reads TF_CONFIG and
// PSX_RENDEZVOUS, declares the test program's variables and runs it. The
// chief then trains the same program on an in-process cluster and compares
// the two bit for bit. Run through psx-launch by the zmq.* tests.
//
//   psx_zmq_node [--steps N] [--pause-ms MS] [--peer-timeout-ms MS (default: the transport's)]
//                [--optimizer sgd|adam|ftrl] [--restore DIR] [--save ROOT]
//   psx_zmq_node --compare DIR1 DIR2
//   psx_zmq_node ... --checkpoint DIR --every N [--ballast-mb M] [--background 1]   (the chaos test)
//   psx_zmq_node ... --sync async   (Asynchronous instead of Synchronous: no comparison)
//   psx_zmq_node --tables DIR [--stage reader]   (a dynamic table's stats and exports: tests/zmq/tables.sh)
//
// With --restore every task restores the checkpoint DIR first (the clock
// starts at its step); with --save the cluster saves a checkpoint under
// ROOT when it has trained; either skips the in-process comparison.
// --compare checks that two checkpoints hold the same parameters and
// optimizer slots, bit for bit, without a cluster.
//
// With --checkpoint every task resumes from the newest checkpoint in DIR
// that restores whole (CheckpointManager::restore_or_init), saves every N
// steps there, and meets a barrier every 7 steps; the chief still compares
// the end result with an undisturbed in-process run. It says "saving step
// N" and "barrier at N" first, for tests/zmq/chaos.sh to aim its kills.
// --ballast-mb declares a frozen variable of M MiB that every save writes
// (a save long enough to be killed in). --background 1: the manager saves in
// the background (training goes on while the servers write), and the last
// save is finished when training ends.
//
// With --tables the workers train a dynamic table (and a small dense
// variable) instead, and the chief reads it over the transport: table_stats,
// a full export, more training, a delta merged into it, which must equal a
// full export, then export_model of everything into DIR/zmq-export; it
// writes the last export's cursor into DIR/cursor, says "tables: waiting
// for the reader", and waits (60 s at most) for DIR/reader-done. Then it
// trains the same program in process and compares: the same rows, and
// model.psx and model.npz byte for byte. With --stage reader, a worker
// process started later (tables.sh restarts a server meanwhile) asks for a
// delta from DIR/cursor, which must be refused with checkpoint_error naming
// the restarted server, takes a full export, and writes DIR/reader-done.
//
// Exit status: 0 when the run (and, for the chief, the comparison) passed;
// 1 when the parameters differ; 3 when a psx error ended the run (printed).
#include "program.hpp"

#include <psx/checkpoint.hpp>
#include <psx/export.hpp>
#include <psx/psx.hpp>
#include <psx/transport/zmq.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace {

struct Flags {
  int steps = psx_zmq_test::steps;
  int pause_ms = 0;
  long peer_timeout_ms = -1;  // ClusterConfig::transport_default
  std::string optimizer = "sgd", restore, save, checkpoint;
  int every = 10;
  int ballast_mb = 0;
  bool alone = false;  // --alone 1: no final barrier, no comparison (workers of unequal steps end in any order)
  bool background = false;
  std::string sync = "bsp";  // or "async"
  std::string tables;         // --tables DIR
  std::string stage;          // --stage reader
};

template <class PS>
void declare_all(PS& ps, const Flags& f) {
  psx_zmq_test::declare(ps);
  if (f.ballast_mb > 0)
    ps.declare({.name = "ballast",
                .shape = {static_cast<std::size_t>(f.ballast_mb) << 18},
                .init = psx::Initializer::constant(1.0f),
                .trainable = false});
}

// Whether two float vectors hold the same bits (memcmp must not see the
// null data of an empty vector: SGD keeps no slots).
bool same_bits(const std::vector<float>& x, const std::vector<float>& y) {
  return x.size() == y.size() && (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0);
}

int compare(const char* a, const char* b) {
  for (const auto& name : psx_zmq_test::names()) {
    const auto x = psx::checkpoint::load_variable(a, name), y = psx::checkpoint::load_variable(b, name);
    if (x.version != y.version || !same_bits(x.values, y.values) || !same_bits(x.slots, y.slots)) {
      std::printf("compare: variable %s differs (parameters or optimizer slots)\n", name.c_str());
      return 1;
    }
  }
  std::printf("compare: %s and %s hold the same parameters and optimizer slots, bit for bit\n", a, b);
  return 0;
}

template <class S, class O>
int run(const Flags& f, const O& optimizer) {
  using Policies = psx::ParameterServer<psx::partition::RowRange, S, O, psx::transport::Zmq>;
  auto z = psx::transport::Zmq::from_env();
  const std::string role = z.tf.task.type + " " + std::to_string(z.tf.task.index);
  psx::ClusterConfig config{z.tf.cluster.num_servers(), z.tf.cluster.num_workers(),
                            f.peer_timeout_ms < 0 ? psx::ClusterConfig::transport_default
                                                  : std::chrono::milliseconds(f.peer_timeout_ms)};
  std::map<std::string, std::vector<float>> trained;
  {
    Policies cluster(config, {}, {}, optimizer, z);
    declare_all(cluster, f);
    std::optional<psx::CheckpointManager<Policies>> ckpt;
    if (!f.checkpoint.empty())
      ckpt.emplace(cluster, psx::checkpoint::Options{.directory = f.checkpoint,
                                                     .every_steps = static_cast<std::uint64_t>(f.every),
                                                     .max_to_keep = 3,
                                                     .background = f.background});
    cluster.run([&](psx::Worker& w) {
      if (!f.restore.empty()) psx::checkpoint::restore(cluster, w, f.restore);
      std::uint64_t start = 0;
      if (ckpt) {
        start = ckpt->restore_or_init(w);
        const char* again = std::getenv("PSX_RESTART_COUNT");
        std::printf("%s: starts at step %llu (restart %s%s)\n", role.c_str(), static_cast<unsigned long long>(start),
                    again ? again : "0", w.rejoined() ? ", rejoined a running job" : "");
        std::fflush(stdout);
      }
      bool said = false;
      psx_zmq_test::train_for(w, f.steps, [&] {
        if (ckpt && w.clock() > start) {
          const std::uint64_t c = w.clock();
          if (c % static_cast<std::uint64_t>(f.every) == 0 && w.is_chief()) {
            std::printf("%s: saving step %llu\n", role.c_str(), static_cast<unsigned long long>(c));
            std::fflush(stdout);
          }
          ckpt->maybe_save(w);
          if (c % 7 == 0 && f.sync != "async") {  // (async: a worker may rejoin, and a barrier under way would miss it)
            std::printf("%s: barrier at %llu\n", role.c_str(), static_cast<unsigned long long>(c));
            std::fflush(stdout);
            w.barrier();
          }
        }
        if (f.pause_ms <= 0) return;
        // Paced (the fault tests): say so once training runs, for faults.sh to wait on.
        if (!said && w.clock() >= 2) {
          std::printf("%s: training\n", role.c_str());
          std::fflush(stdout);
          said = true;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(f.pause_ms));
      }, !f.alone);
      if (ckpt) ckpt->finish(w);  // a background save still pending
      if (!f.save.empty()) {
        const auto info = psx::checkpoint::save(cluster, w, f.save);
        if (w.is_chief()) std::printf("%s: saved %s\n", role.c_str(), info.path.c_str());
      }
      if (w.is_chief() && !f.alone) {
        // What reconnects cost (faults.sh reads it).
        psx::ServerStats all;
        for (const auto& st : w.server_stats()) all += st;
        std::printf("%s: servers counted %llu requests sent again, %llu of them duplicates\n", role.c_str(),
                    static_cast<unsigned long long>(all.retried), static_cast<unsigned long long>(all.duplicates));
      }
    });
    if (z.tf.task.type == "chief") trained = psx_zmq_test::read_all(cluster);
    std::printf("%s: done\n", role.c_str());
  }
  if (z.tf.task.type != "chief" || !f.restore.empty() || !f.save.empty() || f.alone) return 0;
  if constexpr (!std::is_same_v<S, psx::sync::Synchronous>) {
    std::printf("chief: %zu servers, %zu workers, %d steps trained (no comparison: not synchronous)\n",
                config.num_servers, config.num_workers, f.steps);
    return 0;
  }
  psx::ParameterServer<psx::partition::RowRange, psx::sync::Synchronous, O> local(
      psx::ClusterConfig{config.num_servers, config.num_workers}, {}, {}, optimizer);
  declare_all(local, f);
  local.run([&](psx::Worker& w) { psx_zmq_test::train_for(w, f.steps, [] {}); });
  for (const auto& [name, values] : trained) {
    const auto expected = local.read(name);
    if (expected.size() != values.size() ||
        std::memcmp(expected.data(), values.data(), values.size() * sizeof(float)) != 0) {
      std::printf("chief: variable %s differs from the in-process cluster\n", name.c_str());
      return 1;
    }
  }
  std::printf("chief: %zu servers, %zu workers, %d steps: parameters bit-identical to the in-process cluster\n",
              config.num_servers, config.num_workers, f.steps);
  return 0;
}

// -- --tables ---------------------------------------------------------------------

namespace fs = std::filesystem;

template <class PS>
void declare_tables(PS& ps) {
  psx::TableOptions o;
  o.ttl_steps = 4;  // ids not drawn for 4 steps go: deltas carry removals
  o.ttl_sweep_steps = 1;
  ps.declare(psx::dense("w", {16}, psx::Initializer::uniform(-0.1f, 0.1f, 7)));
  ps.declare(psx::embedding("tbl", 8, psx::Initializer::normal(0.0f, 0.05f, 3), o));
}

// Steps [from, to): 16 ids a worker a step out of 200, the dense variable too.
void train_tables(psx::Worker& w, int from, int to) {
  std::vector<float> dense(16), g(16), rows(16 * 8), grows(16 * 8);
  std::vector<std::uint64_t> ids(16);
  for (int t = from; t < to; ++t) {
    for (std::size_t k = 0; k < ids.size(); ++k)
      ids[k] = psx::detail::mix64(static_cast<std::uint64_t>(t) * 5 + k + w.index() * 3) % 200 * 0x9e3779b97f4a7c15ull;
    w.pull("w", dense);
    w.pull_rows("tbl", ids, rows);
    for (std::size_t i = 0; i < g.size(); ++i) g[i] = psx_zmq_test::grad(dense[i], w.index(), t, i);
    for (std::size_t i = 0; i < grows.size(); ++i) grows[i] = psx_zmq_test::grad(rows[i], w.index(), t, i);
    w.push("w", g);
    w.push_rows("tbl", ids, grows);
    w.step();
  }
  w.barrier();  // every push in before the chief reads
}

// What the chief saw.
struct TablesSeen {
  psx::TableExport merged, full;
  std::uint64_t rows = 0, removed = 0;
  bool ok = true;
};

// The worker function of the --tables program (over ZeroMQ and in process alike).
template <class PS>
TablesSeen tables_program(PS& ps, psx::Worker& w, const fs::path& export_base, const std::string& role) {
  TablesSeen seen;
  const std::size_t page = 512;  // bytes: pages of 11 rows of 8 floats (several a server)
  train_tables(w, 0, 10);
  psx::TableExport e;
  if (w.is_chief()) {
    const std::vector<psx::TableStats> stats = ps.table_stats("tbl");
    e = ps.export_table("tbl", {}, page);
    std::uint64_t rows = 0;
    for (const psx::TableStats& s : stats) rows += s.rows;
    std::printf("%s: table_stats: %llu rows on %zu servers (%llu, %llu); a full export of %zu rows\n", role.c_str(),
                static_cast<unsigned long long>(rows), stats.size(), static_cast<unsigned long long>(stats[0].rows),
                static_cast<unsigned long long>(stats.back().rows), e.ids.size());
    seen.ok = seen.ok && rows == e.ids.size() && stats.size() == 2 && stats[0].rows > 0 && stats[1].rows > 0;
  }
  w.barrier();
  train_tables(w, 10, 20);
  if (w.is_chief()) {
    const psx::TableExport delta = ps.export_table("tbl", e.cursor, page);
    e.merge(delta);
    seen.full = ps.export_table("tbl");
    seen.merged = e;
    seen.removed = delta.removed.size();
    const bool same = e.sorted() == seen.full.sorted();
    std::printf("%s: a delta of %zu rows and %zu removed ids; the export merged with it %s a full export (%zu rows)\n",
                role.c_str(), delta.ids.size(), delta.removed.size(), same ? "equals" : "DIFFERS FROM",
                seen.full.ids.size());
    seen.ok = seen.ok && same && !delta.ids.empty() && !delta.removed.empty();
  }
  psx::ExportOptions o;
  o.base = export_base;
  o.version = 1;
  psx::export_model(ps, w, o);
  return seen;
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

int run_tables(const Flags& f) {
  using Policies = psx::ParameterServer<psx::partition::RowRange, psx::sync::Synchronous, psx::optim::Adagrad,
                                        psx::transport::Zmq>;
  const psx::optim::Adagrad adagrad{.lr = 0.1};
  auto z = psx::transport::Zmq::from_env();
  const std::string role = z.tf.task.type + " " + std::to_string(z.tf.task.index);
  const psx::ClusterConfig config{z.tf.cluster.num_servers(), z.tf.cluster.num_workers(),
                                  f.peer_timeout_ms < 0 ? psx::ClusterConfig::transport_default
                                                        : std::chrono::milliseconds(f.peer_timeout_ms)};
  const fs::path dir = f.tables;
  if (f.stage == "reader") {
    // A worker process of a cluster whose server 1 restarted since the cursor was taken.
    Policies cluster(config, {}, {}, adagrad, z);
    declare_tables(cluster);
    cluster.start();  // connects to both servers (no run: this process does not train)
    psx::TableCursor cursor;
    std::istringstream in(read_text(dir / "cursor"));
    for (std::uint64_t inc = 0, ver = 0; in >> inc >> ver;) {
      cursor.incarnation.push_back(inc);
      cursor.version.push_back(ver);
    }
    int status = 1;
    try {
      (void)cluster.export_table("tbl", cursor);
      std::printf("%s: a delta from before the restart was NOT refused\n", role.c_str());
    } catch (const psx::checkpoint_error& e) {
      const std::string what = e.what();
      const bool named = what.ends_with("(server 1 of 2)");
      std::printf("%s: a delta from before the restart is refused%s: %s\n", role.c_str(),
                  named ? ", naming the restarted server" : ", NOT naming server 1", what.c_str());
      status = named ? 0 : 1;
    }
    // A full export reaches both servers: the restarted one holds nothing yet.
    const psx::TableExport full = cluster.export_table("tbl");
    const std::vector<psx::TableStats> stats = cluster.table_stats("tbl");
    std::printf("%s: a full export now: %zu rows (server 0: %llu rows, server 1: %llu rows)\n", role.c_str(),
                full.ids.size(), static_cast<unsigned long long>(stats[0].rows),
                static_cast<unsigned long long>(stats[1].rows));
    if (stats[1].rows != 0 || stats[0].rows != full.ids.size() || full.ids.empty()) status = 1;
    std::ofstream(dir / "reader-done") << status << '\n';
    std::fflush(stdout);
    return status;
  }
  TablesSeen seen;
  {
    Policies cluster(config, {}, {}, adagrad, z);
    declare_tables(cluster);
    cluster.run([&](psx::Worker& w) {
      TablesSeen mine = tables_program(cluster, w, dir / "zmq-export", role);
      if (!w.is_chief()) return;
      seen = std::move(mine);
      std::ofstream out(dir / "cursor.tmp");
      for (std::size_t s = 0; s < seen.full.cursor.version.size(); ++s)
        out << seen.full.cursor.incarnation[s] << ' ' << seen.full.cursor.version[s] << '\n';
      out.close();
      fs::rename(dir / "cursor.tmp", dir / "cursor");
      std::printf("%s: tables: waiting for the reader\n", role.c_str());
      std::fflush(stdout);
      // tables.sh restarts server 1 and runs the reader meanwhile.
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (!fs::exists(dir / "reader-done") && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      if (!fs::exists(dir / "reader-done")) throw psx::error("psx test: no reader-done within 60 s");
    });
    std::printf("%s: done\n", role.c_str());
  }
  if (z.tf.task.type != "chief") return 0;
  // The same program in process.
  psx::ParameterServer<psx::partition::RowRange, psx::sync::Synchronous, psx::optim::Adagrad> local(
      psx::ClusterConfig{config.num_servers, config.num_workers}, {}, {}, adagrad);
  declare_tables(local);
  TablesSeen here;
  local.run([&](psx::Worker& w) {
    TablesSeen mine = tables_program(local, w, dir / "local-export", "in process");
    if (w.is_chief()) here = std::move(mine);
  });
  bool ok = seen.ok && here.ok && seen.merged.sorted() == here.full.sorted() && seen.full.sorted() == here.full.sorted();
  std::printf("chief: the merged export over ZeroMQ %s the in-process cluster's full export (%zu rows)\n",
              ok ? "equals" : "DIFFERS FROM", here.full.ids.size());
  for (const char* file : {"model.psx", "model.npz"}) {
    const std::string a = read_text(dir / "zmq-export" / "1" / file), b = read_text(dir / "local-export" / "1" / file);
    const bool same = !a.empty() && a == b;
    std::printf("chief: export_model's %s over ZeroMQ and in process: %s (%zu bytes)\n", file,
                same ? "the same bytes" : "DIFFERENT", a.size());
    ok = ok && same;
  }
  const psx::Export model = psx::load_export(dir / "zmq-export" / "1");
  ok = ok && model["tbl.ids"].to_ids().size() == here.full.ids.size();
  if (!ok) return 1;
  std::printf("chief: tables over ZeroMQ equal the in-process cluster's\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  try {
    if (argc == 4 && std::string(argv[1]) == "--compare") return compare(argv[2], argv[3]);
    for (int i = 1; i + 1 < argc; i += 2) {
      const std::string flag = argv[i];
      if (flag == "--steps") f.steps = std::atoi(argv[i + 1]);
      else if (flag == "--pause-ms") f.pause_ms = std::atoi(argv[i + 1]);
      else if (flag == "--peer-timeout-ms") f.peer_timeout_ms = std::atol(argv[i + 1]);
      else if (flag == "--optimizer") f.optimizer = argv[i + 1];
      else if (flag == "--restore") f.restore = argv[i + 1];
      else if (flag == "--save") f.save = argv[i + 1];
      else if (flag == "--checkpoint") f.checkpoint = argv[i + 1];
      else if (flag == "--every") f.every = std::max(1, std::atoi(argv[i + 1]));
      else if (flag == "--ballast-mb") f.ballast_mb = std::atoi(argv[i + 1]);
      else if (flag == "--alone") f.alone = std::atoi(argv[i + 1]) != 0;
      else if (flag == "--background") f.background = std::atoi(argv[i + 1]) != 0;
      else if (flag == "--sync" && (std::string(argv[i + 1]) == "bsp" || std::string(argv[i + 1]) == "async")) f.sync = argv[i + 1];
      else if (flag == "--tables") f.tables = argv[i + 1];
      else if (flag == "--stage" && std::string(argv[i + 1]) == "reader") f.stage = argv[i + 1];
      else {
        std::fprintf(stderr, "psx_zmq_node: unknown flag %s\n", argv[i]);
        return 2;
      }
    }
    if (!f.tables.empty()) return run_tables(f);
    if (f.sync == "async") return run<psx::sync::Asynchronous>(f, psx::optim::SGD{0.05f});
    if (f.optimizer == "adam") return run<psx::sync::Synchronous>(f, psx::optim::Adam{.lr = 0.01});
    if (f.optimizer == "ftrl") return run<psx::sync::Synchronous>(f, psx::optim::Ftrl{.lr = 0.05, .l1 = 0.001, .l2 = 0.001});
    return run<psx::sync::Synchronous>(f, psx::optim::SGD{0.05f});
  } catch (const psx::error& e) {
    std::printf("psx error: %s\n", e.what());
    return 3;
  } catch (const std::exception& e) {
    std::printf("error: %s\n", e.what());
    return 4;
  }
}

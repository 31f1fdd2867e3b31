// Faults in simulated time (psx/transport/simulated.hpp, FaultModel): the
// network drops, duplicates and delays messages, partitions a link, kills a
// process, from a seed; the recovery code (the workers' resends, the
// servers' exactly-once window, checkpoint::Manager's restore_or_init)
// brings every schedule to the parameters of the undisturbed run, bit for
// bit, or to a typed error the schedule allows. Also detail::Window, the
// exactly-once window itself.
//
// PSX_SIM_FAULT_SCHEDULES=N runs N schedules (1,000 by default);
// PSX_SIM_FAULT_SEED=S replays the one of seed S (what a failure prints).
#include "../support.hpp"

#include <psx/checkpoint.hpp>
#include <psx/detail/window.hpp>
#include <psx/psx.hpp>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <sstream>
#include <string>
#include <vector>

using psx_test::Watchdog;

namespace {

constexpr std::size_t kRows = 6, kCols = 4;   // dense "w"
constexpr std::size_t kTable = 30, kDim = 3;  // sparse "emb"
constexpr std::size_t kServers = 2, kWorkers = 3;
constexpr std::uint64_t kSteps = 12, kEvery = 4;

using Sim = psx::ParameterServer<psx::partition::RoundRobin, psx::sync::Synchronous, psx::optim::SGD,
                                 psx::transport::Simulated>;

std::vector<std::uint64_t> batch_ids(std::size_t w, std::uint64_t t) {
  std::mt19937_64 rng(977 * w + t);
  std::vector<std::uint64_t> ids(5);
  for (auto& id : ids) id = rng() % kTable;
  return ids;
}

void declare(auto& ps) {
  ps.declare(psx::dense("w", {kRows, kCols}, psx::Initializer::normal(0, 1, 5)));
  ps.declare(psx::sparse("emb", kTable, kDim, psx::Initializer::uniform(-1, 1, 6)));
}

psx::transport::Simulated model(psx::transport::FaultModel faults = {}) {
  return {.network = {.latency = 20e-6, .bandwidth = 1e9},
          .compute = {.step_seconds = 1e-3, .jitter = 0.2},
          .seed = 3,
          .faults = std::move(faults)};
}

// No faults but `schedule` (detected `detect` after they happen).
psx::transport::FaultModel with(std::vector<psx::transport::Fault> schedule, double detect = 50e-3) {
  psx::transport::FaultModel m;
  m.schedule = std::move(schedule);
  m.detect = detect;
  return m;
}

bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct Attempt {
  std::vector<float> w, emb;
  std::exception_ptr error;
  double now = 0;
  psx::transport::FaultCounts counts;
  psx::ServerStats stats;
};

// One run of the job: resumes from `dir`'s newest checkpoint (if any),
// saves every kEvery steps there, meets a barrier every 5 steps.
Attempt attempt(const psx::transport::Simulated& sim, const std::filesystem::path& dir) {
  Sim ps({kServers, kWorkers}, {}, {}, {0.05f}, sim);
  declare(ps);
  psx::CheckpointManager<Sim> ckpt(ps, {.directory = dir, .every_steps = kEvery, .max_to_keep = 2});
  Attempt a;
  try {
    ps.run([&](psx::Worker& w) {
      for (std::uint64_t t = ckpt.restore_or_init(w); t < kSteps; ++t) {
        psx_test::toy_step(w, t, batch_ids(w.index(), t), kRows * kCols, kDim, psx_test::toy_grad);
        ckpt.maybe_save(w);
        if (w.clock() % 5 == 0) w.barrier();
      }
    });
    a.w = ps.read("w");
    a.emb = ps.read("emb");
  } catch (...) {
    a.error = std::current_exception();
  }
  a.now = sim.timeline->now();
  a.counts = sim.timeline->faults();
  a.stats = ps.stats();
  return a;
}

// A fresh checkpoint directory (tmpfs where there is one: saves are many).
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& name) {
    const std::filesystem::path shm = "/dev/shm";
    const auto base = std::filesystem::is_directory(shm) ? shm : std::filesystem::temp_directory_path();
    path = base / ("psx_simfaults_" + std::to_string(::getpid()) + "_" + name);
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

std::string what_of(const std::exception_ptr& e) {
  if (!e) return "no error";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "a non-standard exception";
  }
}

// Whether the schedule may end a run with an error: a process killed, or
// a link cut for longer than the peer timeout.
bool may_fail(const psx::transport::FaultModel& m) {
  for (const auto& f : m.schedule)
    if (f.kind != psx::transport::Fault::Kind::partition || f.duration >= m.detect) return true;
  return false;
}

// The error's kind, if it is one a fault may cause: empty otherwise.
std::string allowed_error(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const psx::peer_lost&) {
    return "peer_lost";
  } catch (const psx::sync_error&) {
    return "sync_error";
  } catch (...) {
    return {};
  }
}

struct Undisturbed {
  std::vector<float> w, emb;
  double seconds = 0;
};
const Undisturbed& undisturbed() {
  static const Undisturbed u = [] {
    TempDir dir("reference");
    const Attempt a = attempt(model(), dir.path);
    REQUIRE_FALSE(a.error);
    return Undisturbed{a.w, a.emb, a.now};
  }();
  return u;
}

struct Verdict {
  std::string failure;  // empty: passed
  std::size_t restarts = 0;
  psx::transport::FaultCounts counts;
  std::uint64_t duplicates = 0, retried = 0;

  void add(const psx::transport::FaultCounts& c, std::uint64_t dups, std::uint64_t resent) {
    counts.dropped += c.dropped;
    counts.lost += c.lost;
    counts.duplicated += c.duplicated;
    counts.delayed += c.delayed;
    counts.resent += c.resent;
    counts.partitions += c.partitions;
    counts.kills += c.kills;
    duplicates += dups;
    retried += resent;
  }
};

// Runs the job under the faults of `seed` (FaultModel::random), restarting
// it from its checkpoint after each run that ended in an allowed error, as
// a supervisor restarts a real job; the restarts draw faults of their own
// (seed, restart), the fourth none.
Verdict run_schedule(std::uint64_t seed) {
  const Undisturbed& ref = undisturbed();
  TempDir dir("seed" + std::to_string(seed));
  Verdict v;
  for (std::size_t k = 0; k < 5; ++k) {
    const psx::transport::FaultModel faults =
        k < 4 ? psx::transport::FaultModel::random(seed + (std::uint64_t{k} << 40), kServers, kWorkers, ref.seconds)
              : psx::transport::FaultModel{};
    const Attempt a = attempt(model(faults), dir.path);
    v.add(a.counts, a.stats.duplicates, a.stats.retried);
    std::ostringstream why;
    why << "seed " << seed << ", run " << k << " (" << faults << "): ";
    if (!a.error) {
      if (!bit_equal(a.w, ref.w) || !bit_equal(a.emb, ref.emb))
        v.failure = why.str() + "the parameters differ from the undisturbed run's";
      return v;
    }
    const std::string kind = allowed_error(a.error);
    if (kind.empty() || !may_fail(faults)) {
      v.failure = why.str() + "ended with an error its faults do not allow: " + what_of(a.error);
      return v;
    }
    ++v.restarts;
  }
  v.failure = "seed " + std::to_string(seed) + ": no run finished";
  return v;
}

std::uint64_t env_number(const char* name, std::uint64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtoull(v, nullptr, 10) : fallback;
}

}  // namespace

TEST_CASE("detail::Window executes each message once and in order, and keeps answers to send again") {
  using W = psx::detail::Window<int, std::string>;
  W win(7, {.bytes = 10, .calls = 3});
  CHECK(win.process() == 7);
  int c = 1;
  CHECK(win.arrive(1, c, false) == W::Arrival::run);
  c = 3;
  CHECK(win.arrive(3, c, false) == W::Arrival::held);  // 2 is missing
  CHECK_FALSE(win.release());
  CHECK(win.held() == 1);
  c = 2;
  CHECK(win.arrive(2, c, true) == W::Arrival::run);
  const auto next = win.release();  // 3 goes now
  REQUIRE(next);
  CHECK(next->first == 3);
  CHECK(next->second == 3);
  CHECK_FALSE(win.release());
  CHECK(win.next() == 4);
  // Duplicates: in progress until answered, then answered with what was kept.
  CHECK(win.arrive(1, c, false) == W::Arrival::running);
  win.remember(1, "one");
  CHECK(win.arrive(1, c, false) == W::Arrival::answered);
  CHECK(win.find(1)->answer == "one");
  // A read's answer counts against the bytes; over them, the oldest read is forgotten.
  win.remember(2, "two", 8);
  CHECK(win.bytes() == 8);
  win.remember(3, "three", 0);
  c = 4;
  CHECK(win.arrive(4, c, true) == W::Arrival::run);
  win.remember(4, "four", 6);  // 14 bytes > 10: read 2 goes (executed again if it comes again)
  CHECK(win.bytes() == 6);
  CHECK(win.find(2) == nullptr);
  CHECK(win.arrive(2, c, true) == W::Arrival::running);
  // Over 3 calls kept: the oldest answered non-read is forgotten, and a
  // message sent again below it is refused, not executed twice.
  c = 5;
  CHECK(win.arrive(5, c, false) == W::Arrival::run);
  win.remember(5, "five");
  CHECK(win.find(1) == nullptr);
  CHECK(win.arrive(1, c, false) == W::Arrival::forgotten);
  // The worker's floor: answers below are forgotten.
  win.acknowledge(5);
  CHECK(win.kept() == 1);
  CHECK(win.find(5) != nullptr);
  // At most `calls` early messages wait.
  for (std::uint64_t id = 7; id < 10; ++id) CHECK(win.arrive(id, c, false) == W::Arrival::held);
  CHECK(win.arrive(10, c, false) == W::Arrival::overflow);
}

TEST_CASE("dropped, duplicated and delayed messages and a partition: the run ends as the undisturbed one, bit for bit") {
  Watchdog dog("simulated faults: network");
  const Undisturbed& ref = undisturbed();
  psx::transport::FaultModel faults;
  faults.drop = 0.03;
  faults.duplicate = 0.05;
  faults.delay = 0.1;
  faults.max_delay = ref.seconds / 20;
  faults.reconnect = ref.seconds / 50;
  faults.detect = ref.seconds;
  faults.seed = 11;
  faults.schedule.push_back(psx::transport::Fault::partition(1, 0, ref.seconds / 3, ref.seconds / 10));
  // (Both runs save into a directory of the same name: its path travels in
  // the save requests, and its length in their simulated bytes.)
  const auto run = [&] {
    TempDir dir("network");
    return attempt(model(faults), dir.path);
  };
  const Attempt a = run();
  REQUIRE_MESSAGE(!a.error, what_of(a.error));
  CHECK(bit_equal(a.w, ref.w));
  CHECK(bit_equal(a.emb, ref.emb));
  // Each kind of fault happened, and the recovery code ran.
  CHECK(a.counts.dropped > 0);
  CHECK(a.counts.duplicated > 0);
  CHECK(a.counts.delayed > 0);
  CHECK(a.counts.partitions == 1);
  CHECK(a.counts.lost > 0);
  CHECK(a.counts.resent > 0);
  CHECK(a.stats.retried > 0);
  CHECK(a.stats.duplicates > 0);
  CHECK(a.now > ref.seconds);  // the faults cost simulated time
  // The same seed replays exactly: parameters, time, every count.
  const Attempt b = run();
  REQUIRE_FALSE(b.error);
  CHECK(bit_equal(a.w, b.w));
  CHECK(a.now == b.now);
  CHECK(a.counts == b.counts);
  CHECK(a.stats.duplicates == b.stats.duplicates);
  CHECK(a.stats.retried == b.stats.retried);
}

TEST_CASE("a killed server or worker fails the synchronous job with peer_lost after the simulated peer timeout") {
  Watchdog dog("simulated faults: kills");
  const Undisturbed& ref = undisturbed();
  const double at = ref.seconds / 2, detect = ref.seconds / 4;
  SUBCASE("server") {
    TempDir dir("kill_server");
    const Attempt a = attempt(model(with({psx::transport::Fault::kill_server(1, at)}, detect)), dir.path);
    REQUIRE(a.error);
    CHECK_THROWS_AS(std::rethrow_exception(a.error), psx::peer_lost);
    CHECK(what_of(a.error).find("server 1 was lost") != std::string::npos);
    CHECK(a.counts.kills == 1);
    CHECK(a.now >= at + detect);
    // Restarted from its checkpoint, the job ends as if nothing happened.
    const Attempt b = attempt(model(), dir.path);
    REQUIRE_FALSE(b.error);
    CHECK(bit_equal(b.w, ref.w));
    CHECK(bit_equal(b.emb, ref.emb));
  }
  SUBCASE("worker") {
    TempDir dir("kill_worker");
    const Attempt a = attempt(model(with({psx::transport::Fault::kill_worker(2, at)}, detect)), dir.path);
    REQUIRE(a.error);
    CHECK_FALSE(allowed_error(a.error).empty());
    CHECK(what_of(a.error).find("worker 2") != std::string::npos);
    CHECK(a.counts.kills == 1);
    const Attempt b = attempt(model(), dir.path);
    REQUIRE_FALSE(b.error);
    CHECK(bit_equal(b.w, ref.w));
  }
  SUBCASE("a partition longer than the peer timeout") {
    TempDir dir("long_partition");
    const Attempt a =
        attempt(model(with({psx::transport::Fault::partition(0, 1, at, 2 * detect)}, detect)), dir.path);
    REQUIRE(a.error);
    CHECK_THROWS_AS(std::rethrow_exception(a.error), psx::peer_lost);
    CHECK(what_of(a.error).find("could not reach each other") != std::string::npos);
  }
}

TEST_CASE("a fault model that names no such process or an impossible rate is a config_error") {
  using psx::transport::Fault;
  const auto refused = [](psx::transport::FaultModel m, const char* what) {
    try {
      Sim ps({kServers, kWorkers}, {}, {}, {0.05f}, model(std::move(m)));
      ps.start();
      FAIL("accepted");
    } catch (const psx::config_error& e) {
      CHECK(std::string(e.what()).find(what) != std::string::npos);
    }
  };
  psx::transport::FaultModel m;
  m.drop = 1.5;
  refused(m, "faults.drop");
  m = {};
  m.detect = -1;
  refused(m, "faults.detect");
  refused(with({Fault::kill_server(2, 0.1)}), "2 servers");
  refused(with({Fault::partition(3, 0, 0.1, 0.1)}), "3 workers");
  refused(with({Fault::kill_worker(0, -1)}), "finite and >= 0");
}

TEST_CASE("seeded fault schedules in simulated time: every one ends bit-identical or with an error it allows") {
  Watchdog dog("simulated fault schedules", std::chrono::seconds(1800));
  const std::uint64_t only = env_number("PSX_SIM_FAULT_SEED", 0);
  const std::uint64_t count = only != 0 ? 1 : env_number("PSX_SIM_FAULT_SCHEDULES", 1000);
  const std::uint64_t first = only != 0 ? only : 1;
  const auto started = std::chrono::steady_clock::now();
  std::size_t restarted = 0, failed = 0;
  Verdict total;
  for (std::uint64_t seed = first; seed < first + count; ++seed) {
    const Verdict v = run_schedule(seed);
    restarted += v.restarts > 0;
    total.add(v.counts, v.duplicates, v.retried);
    if (!v.failure.empty()) {
      ++failed;
      FAIL_CHECK(v.failure << "\n  replay: PSX_SIM_FAULT_SEED=" << seed
                               << " psx_tests -tc='seeded fault schedules*'");
    }
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::printf("simulated faults: %llu schedules, seeds %llu to %llu, %zu failed, %zu restarted from a checkpoint, "
              "in %.1f s\n"
              "  messages dropped %llu, lost %llu, duplicated %llu, delayed %llu, resent %llu; partitions %llu, "
              "kills %llu; servers saw %llu resent and %llu duplicates\n",
              static_cast<unsigned long long>(count), static_cast<unsigned long long>(first),
              static_cast<unsigned long long>(first + count - 1), failed, restarted, secs,
              static_cast<unsigned long long>(total.counts.dropped), static_cast<unsigned long long>(total.counts.lost),
              static_cast<unsigned long long>(total.counts.duplicated),
              static_cast<unsigned long long>(total.counts.delayed), static_cast<unsigned long long>(total.counts.resent),
              static_cast<unsigned long long>(total.counts.partitions),
              static_cast<unsigned long long>(total.counts.kills), static_cast<unsigned long long>(total.retried),
              static_cast<unsigned long long>(total.duplicates));
  std::fflush(stdout);
  CHECK(failed == 0);
  if (only == 0 && count >= 100) {  // the schedules did inject every kind of fault
    CHECK(total.counts.dropped > 0);
    CHECK(total.counts.duplicated > 0);
    CHECK(total.counts.delayed > 0);
    CHECK(total.counts.partitions > 0);
    CHECK(total.counts.kills > 0);
    CHECK(restarted > 0);
  }
}

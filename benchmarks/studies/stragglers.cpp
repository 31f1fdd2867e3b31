// psx-stragglers: the straggler study of docs/studies.md. Trains one
// workload on a simulated cluster (transport::Simulated) under BSP, SSP with
// several staleness bounds, SyncReplicas with backup workers and ASP, while
// transient stragglers get slower, and reports each policy's simulated
// time to a target loss, its step rate and its staleness. Simulated time
// does not depend on this machine: the same command prints the same table.
//
//   psx-stragglers --out docs/images     # the study: 64 workers, 4 servers
//   psx-stragglers --quick --out DIR     # 16 workers, 3 severities (a smoke test)
//
// The workload: logistic regression on 1024 features (one dense variable,
// RowRange over the servers), 16384 Gaussian examples whose labels come
// from a hidden linear teacher; each worker takes batches of 32 at random
// (its own stream), pulls, computes its gradient, pushes, steps. Every
// policy sums the workers' gradients (Aggregate::sum; ASP applies each as
// it arrives), so all of them apply the same update per worker-step and
// differ only in what they wait for and how stale a gradient may be.
//
// The cluster model: 50 us latency and 10 Gbit/s per node; each step
// computes for 5 ms times a lognormal jitter (sigma 0.1); each worker's
// step is, with probability 5%, a straggler step `severity` times as long.
//
// Loss: the chief (worker 0) evaluates the log loss of the parameters it
// pulled on 1024 held-out examples at every step; time to target is the
// chief's simulated clock at the first step whose loss, averaged with the
// four steps before it, is at or below the target: the same average BSP
// reaches without stragglers after a third of its steps.
#include <psx/psx.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace fs = std::filesystem;

namespace {

constexpr std::size_t kFeatures = 1024;
constexpr std::size_t kTrain = 16384;
constexpr std::size_t kEval = 1024;
constexpr std::size_t kBatch = 32;
constexpr double kStepSeconds = 5e-3;
constexpr double kStragglerProbability = 0.05;

using psx::detail::mix64;
double uniform(std::uint64_t key) { return static_cast<double>(mix64(key) >> 11) * 0x1.0p-53; }
float gaussian(std::uint64_t key) {
  const double u1 = uniform(2 * key), u2 = uniform(2 * key + 1);
  return static_cast<float>(std::sqrt(-2.0 * std::log1p(-u1)) * std::cos(6.283185307179586 * u2));
}

// Examples x ~ N(0, I); labels y = 1 with probability sigmoid(4 <teacher, x> / |teacher|): the
// teacher's logits have standard deviation 4.
struct Data {
  std::vector<float> x;  // (kTrain + kEval) x kFeatures
  std::vector<float> y;
  Data() : x((kTrain + kEval) * kFeatures), y(kTrain + kEval) {
    std::vector<float> teacher(kFeatures);
    double norm = 0;
    for (std::size_t j = 0; j < kFeatures; ++j) {
      teacher[j] = gaussian(0x7eac4e7ull * kFeatures + j);
      norm += double(teacher[j]) * teacher[j];
    }
    const double scale = 4.0 / std::sqrt(norm);
    for (std::size_t i = 0; i < kTrain + kEval; ++i) {
      double z = 0;
      for (std::size_t j = 0; j < kFeatures; ++j) {
        const float v = gaussian((i + 1) * 0x100000ull + j);
        x[i * kFeatures + j] = v;
        z += double(v) * teacher[j];
      }
      const double p = 1.0 / (1.0 + std::exp(-z * scale));
      y[i] = uniform(0x1abe1ull + i) < p ? 1.0f : 0.0f;
    }
  }
  std::span<const float> row(std::size_t i) const { return {x.data() + i * kFeatures, kFeatures}; }
};

double dot(std::span<const float> a, std::span<const float> b) {
  double s = 0;
  for (std::size_t j = 0; j < a.size(); ++j) s += double(a[j]) * b[j];
  return s;
}

double eval_loss(const Data& d, std::span<const float> w) {
  double loss = 0;
  for (std::size_t i = kTrain; i < kTrain + kEval; ++i) {
    const double z = dot(d.row(i), w);
    // log(1 + e^z) - y z, computed stably
    loss += (z > 0 ? z + std::log1p(std::exp(-z)) : std::log1p(std::exp(z))) - d.y[i] * z;
  }
  return loss / kEval;
}

struct Point {
  double time;
  std::uint64_t step;
  double loss;
  double smooth;  // mean of the last (up to) 5 losses: what the target is checked against
};

struct Result {
  std::vector<Point> trace;  // the chief's
  double end = 0;            // simulated time when the last worker finished
  double staleness_mean = 0;
  std::uint64_t staleness_max = 0;
  std::uint64_t dropped = 0;
  double waiting = 0;  // mean fraction of a worker's time spent waiting
};

struct Study {
  std::size_t workers = 64, servers = 4, steps = 240;
  float lr = 0;  // per gradient; 0: 0.25 / workers
  std::vector<double> severities{1, 2, 4, 8, 16};
  std::uint64_t seed = 1;
};

template <class Sync>
Result train(const Data& data, const Study& st, Sync sync, double severity) {
  psx::transport::Simulated sim{
      .network = {.latency = 50e-6, .bandwidth = 1.25e9},
      .compute = {.step_seconds = kStepSeconds,
                  .jitter = 0.1,
                  .straggler_probability = severity > 1 ? kStragglerProbability : 0.0,
                  .straggler_slowdown = severity},
      .seed = st.seed};
  psx::ParameterServer<psx::partition::RowRange, Sync, psx::optim::SGD, psx::transport::Simulated> ps(
      {.num_servers = st.servers, .num_workers = st.workers}, {}, sync, {st.lr}, sim);
  ps.declare(psx::dense("w", {kFeatures}, psx::Initializer::zeros()));
  Result r;
  ps.run([&](psx::Worker& w) {
    std::vector<float> wv(kFeatures), g(kFeatures);
    for (std::size_t t = 0; t < st.steps; ++t) {
      w.pull("w", wv);
      if (w.is_chief()) {
        const double loss = eval_loss(data, wv);
        double sum = loss;
        std::size_t n = 1;
        for (std::size_t k = r.trace.size(); k > 0 && n < 5; --k, ++n) sum += r.trace[k - 1].loss;
        r.trace.push_back({sim.timeline->worker_time(0), t, loss, sum / static_cast<double>(n)});
      }
      std::fill(g.begin(), g.end(), 0.0f);
      for (std::size_t b = 0; b < kBatch; ++b) {
        const std::size_t i = mix64((st.seed << 48) ^ (w.index() << 32) ^ (t * kBatch + b)) % kTrain;
        const auto x = data.row(i);
        const double p = 1.0 / (1.0 + std::exp(-dot(x, wv)));
        const float c = static_cast<float>((p - data.y[i]) / kBatch);
        for (std::size_t j = 0; j < kFeatures; ++j) g[j] += c * x[j];
      }
      w.push("w", g);
      w.step();
    }
  });
  r.end = sim.timeline->now();
  const psx::ServerStats s = ps.stats();
  std::uint64_t n = 0;
  double sum = 0;
  for (std::size_t k = 0; k < s.staleness.size(); ++k) {
    n += s.staleness[k];
    sum += static_cast<double>(k) * static_cast<double>(s.staleness[k]);
    if (s.staleness[k]) r.staleness_max = k;
  }
  r.staleness_mean = n ? sum / static_cast<double>(n) : 0;
  r.dropped = s.dropped;
  double waiting = 0;
  for (std::size_t k = 0; k < st.workers; ++k) {
    const auto me = sim.timeline->worker(k);
    waiting += me.time > 0 ? me.waiting / me.time : 0;
  }
  r.waiting = waiting / static_cast<double>(st.workers);
  return r;
}

struct Policy {
  std::string name;
  std::function<Result(const Data&, const Study&, double)> run;
};

template <std::size_t M>
Policy sync_replicas() {
  return {"SyncReplicas<" + std::to_string(M) + ">", [](const Data& d, const Study& s, double sev) {
            return train(d, s, psx::sync::SyncReplicas<M>{psx::sync::Aggregate::sum}, sev);
          }};
}

std::vector<Policy> policies(std::size_t workers) {
  using psx::sync::Aggregate;
  std::vector<Policy> p;
  p.push_back({"BSP", [](const Data& d, const Study& s, double sev) {
                 return train(d, s, psx::sync::Synchronous{Aggregate::sum}, sev);
               }});
  p.push_back({"SSP K=1", [](const Data& d, const Study& s, double sev) {
                 return train(d, s, psx::sync::BoundedStaleness<1>{Aggregate::sum}, sev);
               }});
  p.push_back({"SSP K=4", [](const Data& d, const Study& s, double sev) {
                 return train(d, s, psx::sync::BoundedStaleness<4>{Aggregate::sum}, sev);
               }});
  p.push_back({"SSP K=16", [](const Data& d, const Study& s, double sev) {
                 return train(d, s, psx::sync::BoundedStaleness<16>{Aggregate::sum}, sev);
               }});
  // Backup workers: the first 7/8 of the gradients of a step make it.
  if (workers == 64) p.push_back(sync_replicas<56>());
  if (workers == 16) p.push_back(sync_replicas<14>());
  if (workers == 256) p.push_back(sync_replicas<224>());
  p.push_back({"ASP", [](const Data& d, const Study& s, double sev) {
                 return train(d, s, psx::sync::Asynchronous{}, sev);
               }});
  return p;
}

double time_to(const Result& r, double target) {
  for (const Point& p : r.trace)
    if (p.smooth <= target) return p.time;
  return std::numeric_limits<double>::quiet_NaN();
}

std::string fixed(double v, int digits) {
  if (std::isnan(v)) return "-";
  std::ostringstream os;
  os << std::fixed << std::setprecision(digits) << v;
  return os.str();
}

std::string gp_quote(std::string_view s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("''") : std::string(1, c);
  return q + "'";
}

int usage(const char* why) {
  std::cerr << "psx-stragglers: " << why
            << "\nusage: psx-stragglers [--out DIR] [--quick] [--workers 16|64|256] [--servers S] [--steps T] "
               "[--seed N] [--lr X]"
               " [--severities 1,2,4,...]\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Study st;
  fs::path out = "stragglers";
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(std::string(a) + " needs a value");
      return argv[++i];
    };
    try {
      if (a == "--out") out = value();
      else if (a == "--quick") {
        st.workers = 16;
        st.steps = 150;
        st.severities = {1, 4, 16};
      } else if (a == "--workers") st.workers = std::stoul(value());
      else if (a == "--servers") st.servers = std::stoul(value());
      else if (a == "--steps") st.steps = std::stoul(value());
      else if (a == "--seed") st.seed = std::stoull(value());
      else if (a == "--lr") st.lr = std::stof(value());
      else if (a == "--severities") {
        st.severities.clear();
        std::stringstream list(value());
        for (std::string item; std::getline(list, item, ',');) st.severities.push_back(std::stod(item));
        if (st.severities.empty() || st.severities.front() != 1)
          throw std::invalid_argument("--severities must start with 1 (the run the target comes from)");
        for (double v : st.severities)
          if (!(v >= 1)) throw std::invalid_argument("--severities: each must be >= 1");
      }
      else return usage(("unknown flag " + std::string(a)).c_str());
    } catch (const std::exception& e) {
      return usage(e.what());
    }
  }
  if (st.workers != 16 && st.workers != 64 && st.workers != 256) return usage("--workers must be 16, 64 or 256");
  if (st.servers == 0 || st.steps < 10) return usage("--servers must be >= 1 and --steps >= 10");
  if (st.lr <= 0) st.lr = 0.25f / static_cast<float>(st.workers);  // a summed step of 0.25 x the mean gradient
  fs::create_directories(out);

  std::cerr << "psx-stragglers: generating " << kTrain + kEval << " examples of " << kFeatures << " features\n";
  const Data data;
  const std::vector<Policy> pols = policies(st.workers);

  // The target: what BSP reaches without stragglers after a third of its
  // steps, while its loss still falls steeply (it flattens after about half).
  std::vector<std::vector<Result>> results(pols.size(), std::vector<Result>(st.severities.size()));
  results[0][0] = pols[0].run(data, st, st.severities[0]);
  const double target = results[0][0].trace[st.steps / 3].smooth;

  const std::size_t cells = pols.size() * st.severities.size();
  std::size_t done = 1;
  for (std::size_t p = 0; p < pols.size(); ++p)
    for (std::size_t s = 0; s < st.severities.size(); ++s) {
      if (p == 0 && s == 0) continue;
      std::cerr << "\r[" << done << "/" << cells << "] " << pols[p].name << ", severity " << st.severities[s]
                << "          " << std::flush;
      results[p][s] = pols[p].run(data, st, st.severities[s]);
      ++done;
    }
  std::cerr << "\n";

  std::ostringstream head;
  head << st.workers << " workers, " << st.servers << " servers, " << st.steps
       << " steps each; compute 5 ms/step (jitter 0.1), straggler steps p = 0.05 x severity; target loss "
       << fixed(target, 4) << " (initial " << fixed(results[0][0].trace.front().loss, 4) << ")";
  std::cout << "psx-stragglers: " << head.str() << "\n\n";
  auto table = [&](const char* title, auto cell) {
    std::cout << title << "\n" << std::left << std::setw(18) << "policy \\ severity";
    for (double s : st.severities) {
      std::string label = "x";
      label += fixed(s, 0);
      std::cout << std::right << std::setw(10) << label;
    }
    std::cout << "\n";
    for (std::size_t p = 0; p < pols.size(); ++p) {
      std::cout << std::left << std::setw(18) << pols[p].name;
      for (std::size_t s = 0; s < st.severities.size(); ++s) std::cout << std::right << std::setw(10) << cell(p, s);
      std::cout << "\n";
    }
    std::cout << "\n";
  };
  table("simulated seconds to the target loss (- = not reached)",
        [&](std::size_t p, std::size_t s) { return fixed(time_to(results[p][s], target), 3); });
  table("worker-steps per simulated second (all workers)", [&](std::size_t p, std::size_t s) {
    return fixed(double(st.workers * st.steps) / results[p][s].end, 0);
  });
  table("final loss (the chief's last evaluation)",
        [&](std::size_t p, std::size_t s) { return fixed(results[p][s].trace.back().loss, 4); });
  table("mean staleness of applied gradients (versions of the shard: one per step; ASP: one per gradient)",
        [&](std::size_t p, std::size_t s) { return fixed(results[p][s].staleness_mean, 2); });
  table("mean share of a worker's time spent waiting",
        [&](std::size_t p, std::size_t s) { return fixed(results[p][s].waiting, 2); });

  {
    std::ofstream csv(out / "stragglers.csv");
    csv << "policy,severity,time_to_target_s,end_s,worker_steps_per_s,final_loss,staleness_mean,staleness_max,"
           "dropped,waiting_share,target\n";
    for (std::size_t p = 0; p < pols.size(); ++p)
      for (std::size_t s = 0; s < st.severities.size(); ++s) {
        const Result& r = results[p][s];
        csv << pols[p].name << ',' << st.severities[s] << ',' << fixed(time_to(r, target), 6) << ','
            << fixed(r.end, 6) << ',' << fixed(double(st.workers * st.steps) / r.end, 1) << ','
            << fixed(r.trace.back().loss, 6) << ',' << fixed(r.staleness_mean, 4) << ',' << r.staleness_max << ','
            << r.dropped << ',' << fixed(r.waiting, 4) << ',' << fixed(target, 6) << "\n";
      }
    std::ofstream loss(out / "stragglers-loss.csv");
    loss << "policy,severity,time_s,step,loss,smoothed_loss\n";
    for (std::size_t p = 0; p < pols.size(); ++p)
      for (std::size_t s = 0; s < st.severities.size(); ++s)
        for (const Point& pt : results[p][s].trace)
          loss << pols[p].name << ',' << st.severities[s] << ',' << fixed(pt.time, 6) << ',' << pt.step << ','
               << fixed(pt.loss, 6) << ',' << fixed(pt.smooth, 6) << "\n";
    if (!csv || !loss) {
      std::cerr << "psx-stragglers: cannot write the CSV files in " << out << "\n";
      return 1;
    }
  }
  {
    // Left: time to target vs severity; right: loss vs simulated time at the worst severity.
    const double worst = st.severities.back();
    std::ofstream gp(out / "stragglers.gp");
    gp << "# psx-stragglers: run in this directory (reads stragglers*.csv, writes stragglers.png)\n"
          "set terminal pngcairo size 1400,520 noenhanced font ',10'\n"
          "set output 'stragglers.png'\n"
          "set datafile separator ','\n"
          "set multiplot layout 1,2 title "
       << gp_quote("psx-stragglers: " + head.str())
       << " font ',9'\n"
          "set grid\nset key top left\nset logscale x 2\n"
          "set xlabel 'straggler severity (a straggler step takes this many times as long)'\n"
          "set ylabel 'simulated seconds to the target loss'\n"
          "set title 'time to target'\n"
          "plot ";
    for (std::size_t p = 0; p < pols.size(); ++p)
      gp << (p ? ", \\\n     " : "") << "'stragglers.csv' skip 1 using 2:(strcol(1) eq \"" << pols[p].name
         << "\" ? $3 : NaN) with linespoints lw 2 pt " << p + 5 << " title " << gp_quote(pols[p].name);
    gp << "\nunset logscale x\nset key top right\n"
          "set xlabel 'simulated seconds'\nset ylabel \"chief's held-out log loss (mean of 5 steps)\"\n"
          "set title "
       << gp_quote("loss vs simulated time, severity x" + fixed(worst, 0)) << "\nplot ";
    for (std::size_t p = 0; p < pols.size(); ++p)
      gp << (p ? ", \\\n     " : "") << "'stragglers-loss.csv' skip 1 using 3:(strcol(1) eq \"" << pols[p].name
         << "\" && $2 == " << worst << " ? $6 : NaN) with lines lw 2 title " << gp_quote(pols[p].name);
    gp << ", \\\n     " << fixed(target, 6) << " with lines lc 'black' dt 3 title 'target'\nunset multiplot\n";
  }
  std::string plot = "stragglers.png";
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    plot = "no PNG (gnuplot not found; run gnuplot stragglers.gp there)";
  } else {
    std::string dir = "'";
    for (char c : out.string()) dir += c == '\'' ? std::string("'\\''") : std::string(1, c);
    const std::string cmd = "cd " + dir + "' && gnuplot stragglers.gp";
    if (std::system(cmd.c_str()) != 0) plot = "no PNG (gnuplot failed on stragglers.gp)";
  }
  std::cout << "psx-stragglers: " << cells << " runs; stragglers.csv, stragglers-loss.csv, " << plot << " in "
            << out.string() << "\n";
  return 0;
}

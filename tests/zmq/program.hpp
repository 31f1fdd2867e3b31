// The training program the ZeroMQ tests run on every transport: the same
// declarations and the same worker function, so that a cluster of processes
// can be compared bit for bit with the in-process cluster.
#pragma once

#include <psx/psx.hpp>

#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace psx_zmq_test {

inline constexpr std::size_t dense_size = 1000;
inline constexpr std::size_t table_rows = 500;
inline constexpr std::size_t table_dim = 8;
inline constexpr int steps = 20;

inline std::vector<std::string> names() { return {"w", "b", "emb"}; }

template <class PS>
void declare(PS& ps) {
  ps.declare({.name = "w", .shape = {dense_size}, .init = psx::Initializer::uniform(-0.1f, 0.1f, 7)});
  ps.declare({.name = "b", .shape = {3}, .init = psx::Initializer::constant(0.5f)});
  ps.declare({.name = "emb",
              .shape = {table_rows, table_dim},
              .kind = psx::VariableKind::sparse,
              .init = psx::Initializer::normal(0.0f, 0.05f, 3)});
}

// A deterministic "gradient": depends on the values pulled, the worker and
// the step, so any difference in what a worker read shows in the result.
inline float grad(float value, std::size_t worker, int step, std::size_t i) {
  return 0.1f * value + std::sin(static_cast<float>(worker * 31 + static_cast<std::size_t>(step) * 7 + i) * 0.01f);
}

// Trains until the worker's clock reaches `n` (from a restored checkpoint's
// step, or 0); the data of step t depends on t only, so a resumed run sees
// what an uninterrupted one does. `pause` is a callback between steps (the
// fault tests slow a worker down). Unless `together` is false, the workers
// end with a barrier and an agree_max (a worker that trained fewer steps
// waits there for the others).
template <class Pause>
void train_for(psx::Worker& w, int n, Pause&& pause, bool together = true) {
  std::vector<float> dense(dense_size), g(dense_size), b(3), gb(3);
  std::vector<std::uint64_t> ids;
  for (int t = static_cast<int>(w.clock()); t < n; ++t) {
    pause();
    w.pull("w", dense);
    w.pull("b", b);
    for (std::size_t i = 0; i < dense_size; ++i) g[i] = grad(dense[i], w.index(), t, i);
    for (std::size_t i = 0; i < 3; ++i) gb[i] = grad(b[i], w.index(), t, i);
    // Rows spread over both servers, one repeated (their gradients add up).
    ids.clear();
    for (std::size_t k = 0; k < 24; ++k) ids.push_back((w.index() * 97 + static_cast<std::size_t>(t) * 13 + k * 41) % table_rows);
    ids.push_back(ids.front());
    std::vector<float> rows(ids.size() * table_dim), grows(ids.size() * table_dim);
    w.pull_rows("emb", ids, rows);
    for (std::size_t k = 0; k < grows.size(); ++k) grows[k] = grad(rows[k], w.index(), t, k);
    w.push("w", g);
    w.push("b", gb);
    w.push_rows("emb", ids, grows);
    w.step();
  }
  if (!together) return;
  // Every push of every worker is in before anyone reads the result.
  w.barrier();
  // And every worker learns the largest number any of them passed.
  const std::uint64_t agreed = w.agree_max(100 + w.index());
  if (agreed != 100 + w.num_workers() - 1)
    throw psx::error("psx test: agree_max returned " + std::to_string(agreed) + ", expected " +
                     std::to_string(100 + w.num_workers() - 1));
}

inline void train(psx::Worker& w) {
  train_for(w, steps, [] {});
}

template <class PS>
std::map<std::string, std::vector<float>> read_all(PS& ps) {
  std::map<std::string, std::vector<float>> out;
  for (const auto& n : names()) out[n] = ps.read(n);
  return out;
}

}  // namespace psx_zmq_test

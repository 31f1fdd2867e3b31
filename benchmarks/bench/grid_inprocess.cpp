// psx-bench: the InProcess half of the grid (servers and workers as threads
// of one ParameterServer).
#include "grid.hpp"

namespace psx_bench {
namespace {

template <class P, class S>
std::vector<psx::ServerStats> run_inprocess(const ClusterSetup& c, const WorkerFn& fn) {
  psx::ParameterServer<P, S, psx::optim::SGD, psx::transport::InProcess> ps({c.servers, c.workers}, P{}, S{},
                                                                             psx::optim::SGD{c.lr});
  for (const psx::VariableSpec& v : c.variables) ps.declare(v);
  {
    Watchdog dog(c.time_limit);
    dog.watch(ps);
    try {
      ps.run(fn);
    } catch (...) {
      dog.check();  // say why, if the time limit was the cause
      throw;
    }
    dog.check();
  }
  std::vector<psx::ServerStats> stats;
  for (std::size_t s = 0; s < c.servers; ++s) stats.push_back(ps.server_stats(s));
  return stats;
}

}  // namespace

std::vector<Entry> inprocess_entries() {
  return make_entries("inprocess", "InProcess", []<class P, class S>() -> RunFn { return &run_inprocess<P, S>; });
}

}  // namespace psx_bench

// custom_partitioner: a user-written partitioner plugged into the same
// ParameterServer. `BySize` keeps small variables whole (dealt to servers in
// declaration order) and splits large ones by rows over every server.
#include <psx/psx.hpp>

#include <cstdio>
#include <vector>

// A Partitioner needs one const member: place(meta, num_servers) -> shards
// tiling [0, meta.rows). It must answer the same for the same input, so that
// every process of a cluster computes the same placement.
struct BySize {
  std::size_t split_above_bytes = 1 << 16;

  std::vector<psx::Shard> place(const psx::VariableMeta& v, std::size_t num_servers) const {
    if (v.bytes() > split_above_bytes) return psx::partition::RowRange{}.place(v, num_servers);
    // Small variables: whole, dealt round-robin by declaration order.
    return {{v.id % num_servers, 0, v.rows}};
  }
};
static_assert(psx::Partitioner<BySize>);

int main() {
  psx::ParameterServer<BySize, psx::sync::Synchronous, psx::optim::SGD> ps({3, 2}, BySize{}, {}, {0.1f});
  ps.declare(psx::dense("bias", {10}));
  ps.declare(psx::dense("small", {32, 32}));
  ps.declare(psx::dense("big", {4096, 64}));
  for (const auto& v : ps.variables()) {
    std::printf("%-6s %8zu bytes:", v.name().c_str(), v.meta.bytes());
    for (const auto& s : v.shards) std::printf("  server %zu rows [%zu, %zu)", s.server, s.row_begin, s.row_end);
    std::printf("\n");
  }
  ps.run([](psx::Worker& w) {
    std::vector<float> big(4096 * 64), grad(4096 * 64, 1.0f);
    w.pull("big", big);
    w.push("big", grad);
    w.step();
    w.pull("big", big);
    if (w.is_chief()) std::printf("big[0] after one step: %g\n", static_cast<double>(big[0]));
  });
}

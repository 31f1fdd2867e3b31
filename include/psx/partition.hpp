//! @file psx/partition.hpp
//! Built-in partitioners: which server owns which rows of each variable.
//! The concept is `psx::Partitioner` in `psx/concepts.hpp`.
#pragma once

#include <psx/concepts.hpp>
#include <psx/detail/hash.hpp>

#include <psx/errors.hpp>
#include <psx/variable.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <ostream>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace psx {
inline namespace v0 {
namespace detail {

// Rows split into `n` contiguous ranges (the first `rows % n` one row
// longer, as TensorFlow slices a partitioned variable); range i on server
// `(i + v.id) % num_servers`, so each variable starts on another server.
inline std::vector<Shard> split_rows(const VariableMeta& v, std::size_t n, std::size_t num_servers) {
  n = std::clamp<std::size_t>(n, 1, std::max<std::size_t>(v.rows, 1));
  std::vector<Shard> shards;
  shards.reserve(n);
  std::size_t begin = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t count = v.rows / n + (i < v.rows % n ? 1 : 0);
    shards.push_back({(i + v.id) % num_servers, begin, begin + count});
    begin += count;
  }
  return shards;
}

// Every partitioner places on at least one server (ParameterServer refuses
// none; a partitioner called directly with none divided by zero).
inline void require_servers(const char* partitioner, const VariableMeta& v, std::size_t num_servers) {
  if (num_servers == 0)
    throw config_error(std::string("psx: partition::") + partitioner + ": no servers to place '" + v.name + "' on");
}

inline std::uint64_t row_bytes(const VariableMeta& v) noexcept { return std::uint64_t{v.row_width} * dtype_size(v.dtype); }

}  // namespace detail

namespace partition {

//! The whole variable on server `fnv1a64(name) % num_servers`.
//! FNV-1a 64 is specified, so every process and host agrees on the placement.
struct HashByName {
  std::vector<Shard> place(const VariableMeta& v, std::size_t num_servers) const {
    detail::require_servers("HashByName", v, num_servers);
    return {{static_cast<std::size_t>(detail::fnv1a64(v.name) % num_servers), 0, v.rows}};
  }
  friend bool operator==(const HashByName&, const HashByName&) = default;
  friend std::ostream& operator<<(std::ostream& os, const HashByName&) { return os << "HashByName"; }
};
static_assert(Partitioner<HashByName>);

//! The whole variable on server `id % num_servers`, `id` being the
//! declaration order: variables are dealt to servers like cards.
struct RoundRobin {
  std::vector<Shard> place(const VariableMeta& v, std::size_t num_servers) const {
    detail::require_servers("RoundRobin", v, num_servers);
    return {{v.id % num_servers, 0, v.rows}};
  }
  friend bool operator==(const RoundRobin&, const RoundRobin&) = default;
  friend std::ostream& operator<<(std::ostream& os, const RoundRobin&) { return os << "RoundRobin"; }
};
static_assert(Partitioner<RoundRobin>);

//! Splits a variable by rows into `min(rows / min_rows, num_servers)` contiguous
//! ranges of nearly equal size (the first `rows % n` ranges get one row more);
//! range `i` lives on server `(i + offset) % num_servers`, `offset` being the
//! declaration order, so small variables spread over servers too.
struct RowRange {
  //! No shard gets fewer rows than this (unless the variable has fewer).
  std::size_t min_rows = 1;

  std::vector<Shard> place(const VariableMeta& v, std::size_t num_servers) const {
    detail::require_servers("RowRange", v, num_servers);
    const std::size_t per = std::max<std::size_t>(min_rows, 1);
    return detail::split_rows(v, std::clamp<std::size_t>(v.rows / per, 1, num_servers), num_servers);
  }
  friend bool operator==(const RowRange&, const RowRange&) = default;
  friend std::ostream& operator<<(std::ostream& os, const RowRange& p) {
    return os << "RowRange{min_rows=" << p.min_rows << '}';
  }
};
static_assert(Partitioner<RowRange>);

//! Exactly `shards` row ranges per variable (fewer when it has fewer rows),
//! dealt to servers from `id % num_servers` on: TensorFlow's
//! `fixed_size_partitioner(num_shards)`. Shards may outnumber servers.
struct FixedShards {
  std::size_t shards = 1;

  std::vector<Shard> place(const VariableMeta& v, std::size_t num_servers) const {
    detail::require_servers("FixedShards", v, num_servers);
    if (shards == 0) throw config_error("psx: partition::FixedShards{shards = 0}: a variable needs at least one shard");
    return detail::split_rows(v, shards, num_servers);
  }
  friend bool operator==(const FixedShards&, const FixedShards&) = default;
  friend std::ostream& operator<<(std::ostream& os, const FixedShards& p) {
    return os << "FixedShards{shards=" << p.shards << '}';
  }
};
static_assert(Partitioner<FixedShards>);

//! As many shards as keep each at least `min_shard_bytes`, at most
//! `max_shards` (and at most one per row): `max(1, min(rows, max_shards,
//! ceil(bytes / min_shard_bytes)))`, TensorFlow's
//! `min_max_variable_partitioner(max_partitions, axis = 0, min_slice_size)`;
//! dealt to servers like FixedShards.
struct MinSize {
  std::size_t max_shards = 1;
  std::uint64_t min_shard_bytes = 256 << 10;

  std::vector<Shard> place(const VariableMeta& v, std::size_t num_servers) const {
    detail::require_servers("MinSize", v, num_servers);
    if (min_shard_bytes == 0) throw config_error("psx: partition::MinSize{min_shard_bytes = 0}: must be positive");
    const std::uint64_t bytes = std::uint64_t{v.rows} * detail::row_bytes(v);
    const std::uint64_t wanted = bytes / min_shard_bytes + (bytes % min_shard_bytes != 0);
    const std::uint64_t n = std::min<std::uint64_t>({std::uint64_t{v.rows}, std::uint64_t{max_shards}, wanted});
    return detail::split_rows(v, static_cast<std::size_t>(std::max<std::uint64_t>(n, 1)), num_servers);
  }
  friend bool operator==(const MinSize&, const MinSize&) = default;
  friend std::ostream& operator<<(std::ostream& os, const MinSize& p) {
    return os << "MinSize{max_shards=" << p.max_shards << ", min_shard_bytes=" << p.min_shard_bytes << '}';
  }
};
static_assert(Partitioner<MinSize>);

//! As few shards as keep each at most `max_shard_bytes` (a shard holds at
//! least one row, so a row larger than that is a shard of its own), at most
//! `max_shards` when that is not 0: `ceil(rows / max(1, floor(max_shard_bytes
//! / row bytes)))`, TensorFlow's `variable_axis_size_partitioner(
//! max_shard_bytes, axis = 0, max_shards)`; dealt to servers like FixedShards.
struct MaxSize {
  std::uint64_t max_shard_bytes = 64 << 20;
  std::size_t max_shards = 0;  //!< 0: no limit

  std::vector<Shard> place(const VariableMeta& v, std::size_t num_servers) const {
    detail::require_servers("MaxSize", v, num_servers);
    if (max_shard_bytes == 0) throw config_error("psx: partition::MaxSize{max_shard_bytes = 0}: must be positive");
    const std::uint64_t per_shard = std::max<std::uint64_t>(1, max_shard_bytes / std::max<std::uint64_t>(detail::row_bytes(v), 1));
    std::uint64_t n = v.rows / per_shard + (v.rows % per_shard != 0);
    if (max_shards != 0) n = std::min<std::uint64_t>(n, max_shards);
    return detail::split_rows(v, static_cast<std::size_t>(std::max<std::uint64_t>(n, 1)), num_servers);
  }
  friend bool operator==(const MaxSize&, const MaxSize&) = default;
  friend std::ostream& operator<<(std::ostream& os, const MaxSize& p) {
    return os << "MaxSize{max_shard_bytes=" << p.max_shard_bytes << ", max_shards=" << p.max_shards << '}';
  }
};
static_assert(Partitioner<MaxSize>);

//! Balances bytes: cuts each variable into shards with `split` (by default
//! whole variables), then puts each shard, largest first, on the server
//! holding the fewest bytes so far (ties: the lowest index), counting the
//! variables declared before it: TensorFlow's `GreedyLoadBalancingStrategy`
//! for `replica_device_setter`, by bytes. Where the others deal shards by
//! count (a 1 GiB table and a bias vector are one shard each), this keeps
//! the busiest server near the mean; `ParameterServer::placement()` shows
//! it. Declaration order matters, and every process declares alike anyway.
//! Dynamic tables (`psx::embedding`) are not placed by partitioners.
template <class Split = FixedShards>
struct LeastLoaded {
  Split split{};

  //! As if no server held anything yet.
  std::vector<Shard> place(const VariableMeta& v, std::size_t num_servers) const {
    return place(v, num_servers, std::vector<std::uint64_t>(num_servers, 0));
  }
  //! `server_bytes[s]`: what server `s` holds of the variables declared
  //! before `v` (the cluster passes it).
  std::vector<Shard> place(const VariableMeta& v, std::size_t num_servers,
                           std::span<const std::uint64_t> server_bytes) const {
    if (num_servers == 0) throw config_error("psx: partition::LeastLoaded: no servers to place '" + v.name + "' on");
    std::vector<Shard> shards = split.place(v, num_servers);
    // (bytes held, server), the least first: a min-heap, so that many shards
    // over many servers cost shards x log(servers), not shards x servers.
    std::vector<std::pair<std::uint64_t, std::size_t>> load(num_servers);
    for (std::size_t s = 0; s < num_servers; ++s) load[s] = {s < server_bytes.size() ? server_bytes[s] : 0, s};
    const auto more = std::greater<>{};
    std::make_heap(load.begin(), load.end(), more);
    std::vector<std::size_t> order(shards.size());
    for (std::size_t k = 0; k < order.size(); ++k) order[k] = k;
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return shards[a].rows() > shards[b].rows(); });
    for (const std::size_t k : order) {
      std::pop_heap(load.begin(), load.end(), more);  // ties: the lower index, as (bytes, index) orders them
      shards[k].server = load.back().second;
      load.back().first += std::uint64_t{shards[k].rows()} * detail::row_bytes(v);
      std::push_heap(load.begin(), load.end(), more);
    }
    return shards;
  }
  friend bool operator==(const LeastLoaded&, const LeastLoaded&) = default;
  friend std::ostream& operator<<(std::ostream& os, const LeastLoaded& p) {
    return os << "LeastLoaded{" << p.split << '}';
  }
};
static_assert(Partitioner<LeastLoaded<>>);
static_assert(Partitioner<LeastLoaded<MaxSize>>);

//! Consistent hashing with virtual nodes (Karger et al. 1997): every server
//! holds `virtual_nodes` points of a 64-bit ring, and each variable lives
//! whole on the owner of the first point at or after the hash of its name.
//! A server's points depend only on its index, so going from n to n + 1
//! servers moves only the variables the new server's points take, about
//! 1/(n+1) of them, where `% num_servers` moves almost all. The ids of a
//! dynamic table (`psx::embedding`) go to servers on a ring of the same
//! kind (`VariableInfo::ring`, `TableOptions::virtual_nodes`), whatever the
//! partitioner.
struct ConsistentHash {
  std::uint32_t virtual_nodes = 1024;

  std::vector<Shard> place(const VariableMeta& v, std::size_t num_servers) const {
    detail::require_servers("ConsistentHash", v, num_servers);
    return {{ring(num_servers).server(detail::fnv1a64(v.name)), 0, v.rows}};
  }
  //! The ring over `num_servers` servers: `ring(n).server(key)`.
  detail::HashRing ring(std::size_t num_servers) const {
    if (virtual_nodes == 0 || virtual_nodes > 65536)
      throw config_error("psx: partition::ConsistentHash{virtual_nodes = " + std::to_string(virtual_nodes) +
                         "}: needs 1 to 65536 points per server");
    return detail::HashRing(num_servers, virtual_nodes);
  }
  friend bool operator==(const ConsistentHash&, const ConsistentHash&) = default;
  friend std::ostream& operator<<(std::ostream& os, const ConsistentHash& p) {
    return os << "ConsistentHash{virtual_nodes=" << p.virtual_nodes << '}';
  }
};
static_assert(Partitioner<ConsistentHash>);

}  // namespace partition

//! Bytes each server holds under a placement: parameters (rows x row width x
//! the dtype's size) times `1 + slots` for an optimizer keeping `slots`
//! floats of state per parameter (a float32 variable; 16-bit variables also
//! keep a float32 master, which this does not count).
struct PlacementReport {
  std::vector<std::uint64_t> bytes;  //!< per server
  std::vector<std::size_t> shards;   //!< per server

  std::uint64_t max() const noexcept { return bytes.empty() ? 0 : *std::max_element(bytes.begin(), bytes.end()); }
  double mean() const noexcept {
    std::uint64_t sum = 0;
    for (std::uint64_t b : bytes) sum += b;
    return bytes.empty() ? 0.0 : static_cast<double>(sum) / static_cast<double>(bytes.size());
  }
  //! The busiest server over the mean: 1 when balanced, S when one of S holds all.
  double max_over_mean() const noexcept { return mean() > 0 ? static_cast<double>(max()) / mean() : 1.0; }

  //! One line per server and the balance, e.g. `server 0: 3 shards, 1.50 MiB`.
  friend std::ostream& operator<<(std::ostream& os, const PlacementReport& r) {
    char line[96];
    for (std::size_t s = 0; s < r.bytes.size(); ++s) {
      std::snprintf(line, sizeof line, "server %zu: %zu shards, %.2f MiB\n", s, r.shards[s],
                    static_cast<double>(r.bytes[s]) / (1 << 20));
      os << line;
    }
    std::snprintf(line, sizeof line, "max/mean bytes per server: %.2f", r.max_over_mean());
    return os << line;
  }
};

//! The placement report of `variables` over `num_servers` servers.
inline PlacementReport placement_report(std::span<const VariableInfo> variables, std::size_t num_servers,
                                        std::size_t slots = 0) {
  PlacementReport r{std::vector<std::uint64_t>(num_servers, 0), std::vector<std::size_t>(num_servers, 0)};
  for (const VariableInfo& v : variables)
    for (const Shard& sh : v.shards) {
      if (sh.server >= num_servers)
        throw config_error("psx: placement_report: variable '" + v.meta.name + "' has a shard on server " +
                           std::to_string(sh.server) + " of " + std::to_string(num_servers));
      r.bytes[sh.server] += std::uint64_t{sh.rows()} * detail::row_bytes(v.meta) * (1 + slots);
      ++r.shards[sh.server];
    }
  return r;
}

}  // namespace v0
}  // namespace psx

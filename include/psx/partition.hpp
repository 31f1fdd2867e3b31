//! @file psx/partition.hpp
//! Built-in partitioners: which server owns which rows of each variable.
//! The concept is `psx::Partitioner` in `psx/concepts.hpp`.
#pragma once

#include <psx/concepts.hpp>
#include <psx/detail/hash.hpp>

#include <algorithm>
#include <cstddef>
#include <ostream>
#include <vector>

namespace psx {
inline namespace v0 {
namespace partition {

//! The whole variable on server `fnv1a64(name) % num_servers`.
//! FNV-1a 64 is specified, so every process and host agrees on the placement.
struct HashByName {
  std::vector<Shard> place(const VariableMeta& v, std::size_t num_servers) const {
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
    const std::size_t per = std::max<std::size_t>(min_rows, 1);
    const std::size_t n = std::clamp<std::size_t>(v.rows / per, 1, num_servers);
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
  friend bool operator==(const RowRange&, const RowRange&) = default;
  friend std::ostream& operator<<(std::ostream& os, const RowRange& p) {
    return os << "RowRange{min_rows=" << p.min_rows << '}';
  }
};
static_assert(Partitioner<RowRange>);

}  // namespace partition
}  // namespace v0
}  // namespace psx

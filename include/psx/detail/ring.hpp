//! @file psx/detail/ring.hpp
//! A consistent-hash ring with virtual nodes (Karger et al. 1997): each
//! server owns `virtual_nodes` points of the 64-bit circle, and a key goes
//! to the owner of the first point at or after its hash (wrapping around).
//! A server's points depend only on its index and the seed, so adding
//! server n leaves every other point where it was: only the keys the new
//! server's points take move, about 1/(n+1) of them.
#pragma once

#include <psx/detail/hash.hpp>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace psx {
inline namespace v0 {
namespace detail {

class HashRing {
 public:
  HashRing() = default;

  HashRing(std::size_t servers, std::uint32_t virtual_nodes, std::uint64_t seed = 0) : servers_(servers) {
    std::vector<std::pair<std::uint64_t, std::uint32_t>> points;
    points.reserve(servers * virtual_nodes);
    for (std::size_t s = 0; s < servers; ++s)
      for (std::uint32_t v = 0; v < virtual_nodes; ++v)
        points.emplace_back(point(seed, s, v), static_cast<std::uint32_t>(s));
    std::sort(points.begin(), points.end());  // ties (never seen) go to the lower server
    points_.reserve(points.size());
    owners_.reserve(points.size());
    for (const auto& [p, s] : points) {
      points_.push_back(p);
      owners_.push_back(s);
    }
    // A jump table over the top bits of the hash: where the search starts.
    shift_ = 64 - std::clamp(static_cast<int>(std::bit_width(points_.size())) + 1, 1, 20);
    starts_.resize((std::size_t{1} << (64 - shift_)) + 1);
    std::size_t k = 0;
    for (std::size_t b = 0; b + 1 < starts_.size(); ++b) {
      const std::uint64_t low = std::uint64_t{b} << shift_;
      while (k < points_.size() && points_[k] < low) ++k;
      starts_[b] = static_cast<std::uint32_t>(k);
    }
    starts_.back() = static_cast<std::uint32_t>(points_.size());
    // Most buckets (about 4 for each point) hold no point, or only points of
    // the server that also owns the first point after the bucket: every key
    // of such a bucket has that one owner, found without a search (with 2
    // servers of 1024 points each, 88% of the buckets).
    bucket_owner_.resize(starts_.size() - 1, mixed);
    for (std::size_t b = 0; b < bucket_owner_.size() && !points_.empty(); ++b) {
      const std::uint32_t first = starts_[b], last = starts_[b + 1];
      const std::uint32_t after = owners_[last == points_.size() ? 0 : last];
      bool one = true;
      for (std::uint32_t q = first; q < last && one; ++q) one = owners_[q] == after;
      bucket_owner_[b] = one && after < mixed ? static_cast<std::uint16_t>(after) : mixed;
    }
  }

  //! Servers on the ring.
  std::size_t servers() const noexcept { return servers_; }
  //! The ring's points in order, and their owners.
  const std::vector<std::uint64_t>& points() const noexcept { return points_; }
  const std::vector<std::uint32_t>& owners() const noexcept { return owners_; }

  //! Where a key hashes to on the circle.
  static constexpr std::uint64_t position(std::uint64_t key) noexcept { return mix64(key ^ 0x5851f42d4c957f2dull); }

  //! The server of `key` (0 on an empty ring).
  std::size_t server(std::uint64_t key) const noexcept {
    if (points_.empty()) return 0;
    const std::uint64_t h = position(key);
    const std::size_t b = h >> shift_;
    if (const std::uint16_t owner = bucket_owner_[b]; owner != mixed) return owner;
    auto first = points_.begin() + starts_[b];
    auto last = points_.begin() + starts_[b + 1];
    // Past the bucket's points: the next bucket's first point, or around to the first.
    const auto it = std::lower_bound(first, last, h);
    return owners_[it == points_.end() ? 0 : static_cast<std::size_t>(it - points_.begin())];
  }

  friend bool operator==(const HashRing& a, const HashRing& b) noexcept {
    return a.points_ == b.points_ && a.owners_ == b.owners_;
  }

 private:
  static constexpr std::uint64_t point(std::uint64_t seed, std::size_t server, std::uint32_t vnode) noexcept {
    return mix64(mix64(seed ^ (std::uint64_t{server} << 32 | vnode)) + 0x2545f4914f6cdd1dull);
  }

  std::size_t servers_ = 0;
  std::vector<std::uint64_t> points_;
  std::vector<std::uint32_t> owners_;
  std::vector<std::uint32_t> starts_;
  // The one owner of each bucket's keys, or `mixed` (several owners, or a
  // server index too large for 16 bits): 16 bits keep the table in cache.
  static constexpr std::uint16_t mixed = 0xffff;
  std::vector<std::uint16_t> bucket_owner_;
  int shift_ = 63;
};

}  // namespace detail
}  // namespace v0
}  // namespace psx

//! @file psx/cluster.hpp
//! The shape of a cluster, and the data-set shard each worker reads.
#pragma once

#include <chrono>
#include <cstddef>
#include <iterator>
#include <ostream>

namespace psx {
inline namespace v0 {

//! How many servers and workers the cluster has. Worker 0 is the chief.
struct ClusterConfig {
  std::size_t num_servers = 1;
  std::size_t num_workers = 1;
  //! `peer_timeout`'s default: the transport's own choice. Between
  //! processes that is a deadline (`transport::Zmq::default_peer_timeout`,
  //! 30 s); in one process it is off, since a thread cannot die in silence
  //! (a worker function that throws fails or leaves its worker) and a
  //! worker's calls are its only heartbeat there. `ParameterServer::config()`
  //! shows the value in force.
  static constexpr std::chrono::milliseconds transport_default = std::chrono::milliseconds::min();
  //! A worker that sends nothing for this long while a server holds requests
  //! waiting on progress (and it has none waiting itself) is lost; the sync
  //! policy then decides (`psx::OnWorkerLost`). A server silent this long
  //! while a worker's calls wait on it fails them with `psx::peer_lost`.
  //! Zero: never time out (an explicit choice). In one process a worker's
  //! calls are its heartbeat, so set this above the longest computation a
  //! worker makes between two calls.
  std::chrono::milliseconds peer_timeout = transport_default;
  friend bool operator==(const ClusterConfig&, const ClusterConfig&) = default;
  friend std::ostream& operator<<(std::ostream& os, const ClusterConfig& c) {
    os << "ClusterConfig{servers=" << c.num_servers << ", workers=" << c.num_workers << ", peer_timeout=";
    if (c.peer_timeout == transport_default) return os << "transport default}";
    return os << c.peer_timeout.count() << "ms}";
  }
};

//! The example indices `index, index + num_shards, index + 2 * num_shards, ...`
//! below `total`: shard `index` of `num_shards` of a data set, as
//! `tf.data.Dataset.shard(num_shards, index)` takes it.
class ShardRange {
 public:
  //! Forward iterator over the indices of the shard.
  class iterator {
   public:
    using value_type = std::size_t;
    using difference_type = std::ptrdiff_t;
    using iterator_category = std::forward_iterator_tag;

    iterator() = default;
    iterator(std::size_t value, std::size_t stride) noexcept : value_(value), stride_(stride) {}
    std::size_t operator*() const noexcept { return value_; }
    iterator& operator++() noexcept {
      value_ += stride_;
      return *this;
    }
    iterator operator++(int) noexcept {
      iterator old = *this;
      ++*this;
      return old;
    }
    friend bool operator==(const iterator& a, const iterator& b) noexcept { return a.value_ == b.value_; }

   private:
    std::size_t value_ = 0;
    std::size_t stride_ = 1;
  };

  //! Requires `num_shards > 0` and `index < num_shards`.
  ShardRange(std::size_t total, std::size_t num_shards, std::size_t index) noexcept
      : first_(index < total ? index : total),
        stride_(num_shards),
        count_(index < total ? (total - index + num_shards - 1) / num_shards : 0) {}

  iterator begin() const noexcept { return {first_, stride_}; }
  iterator end() const noexcept { return {first_ + count_ * stride_, stride_}; }
  //! Number of indices in the shard.
  std::size_t size() const noexcept { return count_; }
  bool empty() const noexcept { return count_ == 0; }
  //! The `k`-th index of the shard.
  std::size_t operator[](std::size_t k) const noexcept { return first_ + k * stride_; }

 private:
  std::size_t first_;
  std::size_t stride_;
  std::size_t count_;
};

}  // namespace v0
}  // namespace psx

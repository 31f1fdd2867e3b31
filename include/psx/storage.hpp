//! @file psx/storage.hpp
//! Where a server keeps its shards: the fifth, optional parameter of
//! `psx::ParameterServer<P, S, O, T, Storage>`. `storage::Host` (the default)
//! keeps parameters, optimizer slots and 16-bit copies in host memory and
//! applies the optimizer's `update`; `psx::cuda::Device` (`psx/cuda/storage.cuh`,
//! compiled by nvcc) keeps them in GPU memory and applies the optimizer's CUDA
//! specialization. The server's logic (sync policies, clocks, errors) is the
//! same for both.
//!
//! A storage type `St` provides `St::shard<O>`, constructed from
//! `(const O& optimizer, const VariableInfo& v, const Shard& shard)`, with the
//! members `psx::storage::Host::shard` shows, and `St::host_visible`: whether
//! `values()` exposes the parameters in host memory (which delay compensation
//! needs). Checkpoints (psx/checkpoint.hpp) need `save_state` and `assign`,
//! or `values()`, `slot_values(k)` and `assign` for a storage in host memory.
#pragma once

#include <psx/concepts.hpp>
#include <psx/detail/hash.hpp>
#include <psx/detail/persist.hpp>
#include <psx/detail/span.hpp>
#include <psx/half.hpp>
#include <psx/variable.hpp>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <stdexcept>
#include <type_traits>
#include <vector>

namespace psx {
inline namespace v0 {

namespace detail {

// Gradient rows of one shard by distinct (shard-local) row id, summed in
// order of arrival; rows in order of first appearance. The index is open
// addressing with linear probing (slot = row's position + 1, 0 = empty),
// kept at most half full; `reset` keeps the memory, so a server that reuses
// one accumulator allocates nothing per request in steady state.
class RowAccumulator {
 public:
  explicit RowAccumulator(std::size_t width = 0) : width_(width) {}

  void add(std::uint64_t row, const float* g) {
    if (2 * (rows_.size() + 1) > slots_.size()) grow();
    const std::size_t mask = slots_.size() - 1;
    for (std::size_t h = mix64(row) & mask;; h = (h + 1) & mask) {
      const std::uint32_t slot = slots_[h];
      if (slot == 0) {
        // Stored before the slot points at it: a bad_alloc leaves the sum as it was.
        data_.insert(data_.end(), g, g + width_);
        try {
          rows_.push_back(row);
        } catch (...) {
          data_.resize(data_.size() - width_);
          throw;
        }
        slots_[h] = static_cast<std::uint32_t>(rows_.size());
        return;
      }
      if (rows_[slot - 1] == row) {
        float* dst = data_.data() + std::size_t{slot - 1} * width_;
        for (std::size_t i = 0; i < width_; ++i) dst[i] += g[i];
        return;
      }
    }
  }

  //! Empties it for rows of `width` floats, keeping its memory.
  void reset(std::size_t width) noexcept {
    clear();
    width_ = width;
  }

  void clear() noexcept {
    // A table a few times the rows in use is emptied whole (a memset is
    // cheaper than finding each row again); only the slots in use of one
    // once grown large, so that it costs a small request nothing.
    if (slots_.size() <= 64 * rows_.size()) {
      std::fill(slots_.begin(), slots_.end(), 0u);
    } else if (!slots_.empty()) {
      const std::size_t mask = slots_.size() - 1;
      for (const std::uint64_t row : rows_) {
        std::size_t h = mix64(row) & mask;
        while (slots_[h] == 0 || rows_[slots_[h] - 1] != row) h = (h + 1) & mask;
        slots_[h] = 0;
      }
    }
    rows_.clear();
    data_.clear();
  }

  bool empty() const noexcept { return rows_.empty(); }
  std::size_t width() const noexcept { return width_; }
  const std::vector<std::uint64_t>& rows() const noexcept { return rows_; }
  std::vector<float>& data() noexcept { return data_; }
  const std::vector<float>& data() const noexcept { return data_; }
  const float* row_data(std::size_t k) const noexcept { return data_.data() + k * width_; }

 private:
  void grow() {
    if (rows_.size() >= std::numeric_limits<std::uint32_t>::max() - 1)
      throw std::length_error("psx: more than 2^32 - 2 distinct rows in one sum");
    const std::size_t capacity = std::max<std::size_t>(64, std::bit_ceil(4 * (rows_.size() + 1)));
    slots_.assign(capacity, 0);
    const std::size_t mask = capacity - 1;
    for (std::size_t k = 0; k < rows_.size(); ++k) {
      std::size_t h = mix64(rows_[k]) & mask;
      while (slots_[h] != 0) h = (h + 1) & mask;
      slots_[h] = static_cast<std::uint32_t>(k + 1);
    }
  }

  std::size_t width_;
  std::vector<std::uint64_t> rows_;
  std::vector<float> data_;
  std::vector<std::uint32_t> slots_;
};

}  // namespace detail

namespace storage {

//! Shards in host memory; the optimizer's `update` applies gradients.
struct Host {
  static constexpr bool host_visible = true;

  template <Optimizer O>
  class shard {
   public:
    shard(const O& optimizer, const VariableInfo& v, const Shard& sh)
        : dtype_(v.meta.dtype), width_(v.meta.row_width) {
      const std::size_t n = sh.rows() * width_;
      params_.resize(n);
      v.init.fill(v.meta.name, sh.row_begin * width_, params_);
      const std::size_t num_slots = optimizer.slots();
      slots_.resize(num_slots * n);
      for (std::size_t k = 0; k < num_slots; ++k) {
        bases_.push_back(slots_.data() + k * n);
        std::fill_n(bases_.back(), n, initial_slot(optimizer, k));
      }
      if (dtype_ != DType::float32) {
        low_.resize(n);
        detail::to_low(dtype_, params_.data(), low_.data(), n);
      }
    }
    // bases_ points into slots_: a copy would point into the original.
    shard(const shard&) = delete;
    shard& operator=(const shard&) = delete;

    //! Floats in the shard.
    std::size_t size() const noexcept { return params_.size(); }
    //! Whether a 16-bit copy is kept (bfloat16/float16 variables).
    bool low_precision() const noexcept { return !low_.empty(); }
    std::size_t parameter_bytes() const noexcept {
      return params_.size() * sizeof(float) + low_.size() * sizeof(std::uint16_t);
    }
    std::size_t slot_bytes() const noexcept { return slots_.size() * sizeof(float); }
    //! The float32 parameters, in host memory.
    std::span<const float> values() const noexcept { return params_; }
    //! Optimizer slot `k` (`k < optimizer.slots()`), as many floats as the parameters.
    std::span<const float> slot_values(std::size_t k) const noexcept { return {bases_[k], size()}; }
    //! Copies the parameters and the slots (slot-major: slot k at `k * size()`) out.
    void save_state(std::span<float> params, std::span<float> slots) const noexcept {
      std::memcpy(params.data(), params_.data(), size() * sizeof(float));
      std::memcpy(slots.data(), slots_.data(), slots_.size() * sizeof(float));
    }
    //! Replaces the parameters and the slots (laid out as `save_state`
    //! writes them; the sizes are the caller's to check) and refreshes the
    //! 16-bit copy: a checkpoint restore.
    void assign(std::span<const float> params, std::span<const float> slots) noexcept {
      std::memcpy(params_.data(), params.data(), size() * sizeof(float));
      std::memcpy(slots_.data(), slots.data(), slots_.size() * sizeof(float));
      if (!low_.empty()) detail::to_low(dtype_, params_.data(), low_.data(), size());
    }

    //! Like assign, taking the buffers over instead of copying them.
    void adopt(detail::FloatBuffer& params, detail::FloatBuffer& slots) noexcept {
      params_.swap(params);
      slots_.swap(slots);
      for (std::size_t k = 0; k < bases_.size(); ++k) bases_[k] = slots_.data() + k * params_.size();
      if (!low_.empty()) detail::to_low(dtype_, params_.data(), low_.data(), size());
    }

    //! Copies the whole shard (float32 master or 16-bit copy) into `out`.
    void read(std::span<float> out) const noexcept { std::memcpy(out.data(), params_.data(), size() * sizeof(float)); }
    void read(std::span<std::uint16_t> out) const noexcept {
      std::memcpy(out.data(), low_.data(), size() * sizeof(std::uint16_t));
    }
    //! Copies rows `ids[j] - first_row` to rows `positions[j]` (or j) of `out`.
    //! Random rows of a large shard miss the caches: each row is asked for
    //! (its first 256 bytes; the hardware fetches on along a row) a few rows
    //! before it is copied, so that the misses overlap (100k rows of 16
    //! floats from a 64 MiB shard: 3.1-3.5 ms where 4.3-5.4 ms without).
    template <class T>
    void read_rows(std::span<const std::uint64_t> ids, std::size_t first_row, std::span<const std::uint32_t> positions,
                   std::span<T> out) const noexcept {
      const T* base = source<T>();
      constexpr std::size_t ahead = 8;
      const std::size_t ask = std::min<std::size_t>(width_ * sizeof(T), 256);
      auto prefetch = [&](std::size_t j) {
        if (ask != 0) detail::prefetch_bytes(base + (ids[j] - first_row) * width_, ask);
      };
      for (std::size_t j = 0; j < ids.size() && j < ahead; ++j) prefetch(j);
      for (std::size_t j = 0; j < ids.size(); ++j) {
        if (j + ahead < ids.size()) prefetch(j + ahead);
        const std::size_t pos = positions.empty() ? j : positions[j];
        const std::size_t row = ids[j] - first_row;
        if constexpr (std::is_same_v<T, float>) detail::copy_floats(out.data() + pos * width_, base + row * width_, width_);
        else std::memcpy(out.data() + pos * width_, base + row * width_, width_ * sizeof(T));
      }
    }

    //! Applies a gradient for the whole shard.
    void apply(const O& optimizer, std::span<const float> g, const UpdateContext& ctx) {
      optimizer.update(params_, g, slot_view(0, size()), ctx);
      if (!low_.empty()) detail::to_low(dtype_, params_.data(), low_.data(), size());
    }
    //! Applies summed gradient rows (`ctx.rows` set), row by row.
    void apply_rows(const O& optimizer, const detail::RowAccumulator& rows, const UpdateContext& ctx) {
      const std::vector<std::uint64_t>& ids = rows.rows();
      update_rows(optimizer, ids.size(), [&](std::size_t k) { return ids[k]; },
                  [&](std::size_t k) { return rows.row_data(k); }, ctx);
    }

    //! Applies a row push as it came: shard row `ids[j] - first_row` gets
    //! gradient row `positions[j]` (or j) of `grads` (`ctx.rows` set). Where
    //! no id repeats (ids in increasing order, or none seen twice by a bit a
    //! row kept between calls), each row is updated straight from `grads`;
    //! otherwise the rows are summed first, in push order, as `apply_rows`
    //! gets them from a RowAccumulator, and both give the same bits. (Summing
    //! only the repeated ids and updating the others straight from `grads`
    //! was slower for a Zipf(1.1) stream: 100k ids, 24k distinct, 2.7 ms
    //! against 2.1 for summing all.) A bad_alloc while summing leaves every
    //! row as it was.
    void apply_raw_rows(const O& optimizer, std::span<const std::uint64_t> ids, std::size_t first_row,
                        std::span<const std::uint32_t> positions, std::span<const float> grads,
                        const UpdateContext& ctx) {
      if (ids.empty() || width_ == 0) return;
      auto grad = [&](std::size_t j) { return grads.data() + (positions.empty() ? j : positions[j]) * width_; };
      auto direct = [&] { update_rows(optimizer, ids.size(), [&](std::size_t j) { return ids[j] - first_row; }, grad, ctx); };
      if (std::is_sorted(ids.begin(), ids.end(), std::less_equal<>())) return direct();  // strictly increasing
      const std::size_t words = (size() / width_ + 63) / 64;
      if (seen_.size() != words) {
        std::vector<std::uint64_t> seen(words, 0);
        seen_.swap(seen);
      }
      // Marks each row, up to the first repeat; then unmarks what it marked.
      std::size_t marked = 0;
      bool repeats = false;
      for (; marked < ids.size(); ++marked) {
        const std::uint64_t row = ids[marked] - first_row, bit = std::uint64_t{1} << (row % 64);
        std::uint64_t& word = seen_[row / 64];
        if (word & bit) {
          repeats = true;
          break;
        }
        word |= bit;
      }
      for (std::size_t j = 0; j < marked; ++j) seen_[(ids[j] - first_row) / 64] = 0;
      if (!repeats) return direct();
      sums_.reset(width_);
      for (std::size_t j = 0; j < ids.size(); ++j) sums_.add(ids[j] - first_row, grad(j));
      apply_rows(optimizer, sums_, ctx);
    }

   private:
    SlotView slot_view(std::size_t offset, std::size_t length) const noexcept {
      return {bases_.data(), bases_.size(), offset, length};
    }

    // Updates shard rows `row(k)` with gradient rows `grad(k)`, k < n. Rows
    // out of order miss the caches: each row and its slots are asked for
    // 16 rows before their update, so the misses overlap (100k random rows
    // of a 1M-row shard, caches emptied first, CPU time: SGD 8.5 -> 2.3 ms
    // at width 8, 24 -> 9 ms at 64; Adam 14 -> 6 and 49 -> 31 ms; 8 rows
    // ahead gave 10-30% less, 32 and 64 no more).
    template <class Row, class Grad>
    void update_rows(const O& optimizer, std::size_t n, Row&& row, Grad&& grad, const UpdateContext& ctx) {
      constexpr std::size_t ahead = 16;
      const std::size_t ask = std::min<std::size_t>(width_ * sizeof(float), 256);
      auto prefetch = [&](std::size_t k) {
        const std::size_t offset = row(k) * width_;
        detail::prefetch_bytes(params_.data() + offset, ask);
        for (float* base : bases_) detail::prefetch_bytes(base + offset, ask);
      };
      for (std::size_t k = 0; k < n && k < ahead; ++k) prefetch(k);
      for (std::size_t k = 0; k < n; ++k) {
        if (k + ahead < n) prefetch(k + ahead);
        const std::size_t offset = row(k) * width_;
        optimizer.update(std::span<float>(params_.data() + offset, width_), std::span<const float>(grad(k), width_),
                         slot_view(offset, width_), ctx);
        if (!low_.empty()) detail::to_low(dtype_, params_.data() + offset, low_.data() + offset, width_);
      }
    }
    template <class T>
    const T* source() const noexcept {
      if constexpr (std::is_same_v<T, float>) return params_.data();
      else return low_.data();
    }

    DType dtype_;
    std::size_t width_;
    detail::FloatBuffer params_;
    detail::FloatBuffer slots_;
    std::vector<float*> bases_;
    std::vector<std::uint16_t> low_;
    // apply_raw_rows's scratch: a bit per row (all clear between calls),
    // and the sums of a push with repeated ids.
    std::vector<std::uint64_t> seen_;
    detail::RowAccumulator sums_;
  };
};

}  // namespace storage
}  // namespace v0
}  // namespace psx

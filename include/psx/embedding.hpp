//! @file psx/embedding.hpp
//! Dynamic embedding tables: rows of `dim` floats keyed by any 64-bit
//! feature id, for recommender models whose ids are hashed, unknown in
//! advance and without end.
//!
//! A table (`psx::embedding(name, dim, init, options)`) has no row count.
//! Its ids go to servers by consistent hashing (`VariableInfo::ring`); each
//! server keeps its part in a `DynamicTable`:
//!  - a pull of an id not stored returns its initial value
//!    (`Initializer::fill_row`: a function of the name, seed and id) and
//!    stores nothing;
//!  - a push of an id not stored asks the admission policy (`Admission`:
//!    always, after n pushes counted in a count-min sketch, or with
//!    probability p); an admitted id is stored with its initial value and
//!    its own optimizer slots, then updated; a refused push changes nothing
//!    (and is counted);
//!  - rows not updated for `ttl_steps` global steps are evicted by a sweep,
//!    and a server at `memory_cap_bytes` evicts its least recently used rows
//!    (pulled or pushed, by global step) before it grows;
//!  - every change gets a version, so `export_rows(since)` returns the rows
//!    changed after `since` and the ids removed after it: a serving copy
//!    applies the increments (`TableExport::merge`);
//!  - checkpoints (psx/checkpoint.hpp) save a server's part with what
//!    decides its future (`checkpoint_state`, `checkpoint_rows`,
//!    `checkpoint_sketch`) and restore it, from the same ring or merged
//!    from another's parts, through a `Restorer` swapped in by `adopt`.
//!
//! The table is a concurrent hash table: `stripes` independently locked
//! parts (a reader-writer lock each), each an open-addressing index
//! (linear probing, backward-shift deletion) over records allocated in
//! chunks (the row's bookkeeping, then its parameters and slots, `dim * (1 +
//! slots)` floats). A call groups its ids by stripe and takes them a window
//! at a time: the stripes holding the next 128 ids are locked in ascending
//! order (so two calls never wait on each other in a cycle), every index
//! entry of the window is asked for, then every record, before any is read,
//! so that the cache misses of random ids overlap instead of following one
//! another; then the window's locks are let go. A memory cap is split evenly
//! over the stripes, each evicting its own least recently used rows
//! (RocksDB's sharded LRU cache does the same).
#pragma once

#include <psx/concepts.hpp>
#include <psx/detail/hash.hpp>
#include <psx/detail/persist.hpp>
#include <psx/detail/ring.hpp>
#include <psx/errors.hpp>
#include <psx/storage.hpp>
#include <psx/variable.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <ostream>
#include <random>
#include <shared_mutex>
#include <span>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace psx {
inline namespace v0 {

//! What one server holds of a dynamic table (`DynamicTable::stats`,
//! `ParameterServer::table_stats`); `+=` sums servers.
struct TableStats {
  std::uint64_t rows = 0;            //!< ids stored now
  std::uint64_t bytes = 0;           //!< memory held: records, index, admission sketch (what the cap bounds)
  std::uint64_t ideal_row_bytes = 0; //!< `dim * 4 * (1 + slots)`: a row's parameters and slots alone
  std::uint64_t admitted = 0;        //!< ids stored (an id evicted and admitted again counts twice)
  std::uint64_t refused = 0;         //!< pushes of ids the admission policy did not (yet) store
  std::uint64_t evicted_ttl = 0;     //!< rows evicted for not being updated within `ttl_steps`
  std::uint64_t evicted_memory = 0;  //!< rows evicted, least recently used, to stay under the memory cap
  std::uint64_t removal_log = 0;     //!< removals remembered for delta exports
  std::uint64_t removal_log_bytes = 0;  //!< their memory (outside the cap)

  //! Bytes held per stored row (index, chunk slack and sketch included).
  double bytes_per_row() const noexcept { return rows ? static_cast<double>(bytes) / static_cast<double>(rows) : 0.0; }

  TableStats& operator+=(const TableStats& o) noexcept {
    rows += o.rows;
    bytes += o.bytes;
    ideal_row_bytes = std::max(ideal_row_bytes, o.ideal_row_bytes);
    admitted += o.admitted;
    refused += o.refused;
    evicted_ttl += o.evicted_ttl;
    evicted_memory += o.evicted_memory;
    removal_log += o.removal_log;
    removal_log_bytes += o.removal_log_bytes;
    return *this;
  }

  //! `rows 1200, 0.29 MiB (254.1 B/row, ideal 192), admitted 1500, refused 300, evicted 300 (ttl 100, memory 200)`
  friend std::ostream& operator<<(std::ostream& os, const TableStats& s) {
    char line[200];
    std::snprintf(line, sizeof line,
                  "rows %llu, %.2f MiB (%.1f B/row, ideal %llu), admitted %llu, refused %llu, evicted %llu "
                  "(ttl %llu, memory %llu)",
                  static_cast<unsigned long long>(s.rows), static_cast<double>(s.bytes) / (1 << 20), s.bytes_per_row(),
                  static_cast<unsigned long long>(s.ideal_row_bytes), static_cast<unsigned long long>(s.admitted),
                  static_cast<unsigned long long>(s.refused),
                  static_cast<unsigned long long>(s.evicted_ttl + s.evicted_memory),
                  static_cast<unsigned long long>(s.evicted_ttl), static_cast<unsigned long long>(s.evicted_memory));
    return os << line;
  }
};

//! Where a delta export starts, per server: which table (a number drawn when
//! the server made it, so a cursor of a restarted cluster is refused, not
//! misread) and the version an earlier export was complete up to.
struct TableCursor {
  std::vector<std::uint64_t> incarnation;
  std::vector<std::uint64_t> version;

  bool empty() const noexcept { return version.empty(); }
  friend bool operator==(const TableCursor&, const TableCursor&) = default;
};

//! Rows of a dynamic table: a full export (every stored row) or a delta
//! (rows changed and ids removed after a cursor). A serving copy starts
//! from a full export and `merge`s each delta into it.
struct TableExport {
  std::size_t dim = 0;
  //! Where the next delta export starts.
  TableCursor cursor;
  //! Stored ids and their rows (`ids.size() * dim` floats), in no particular order.
  std::vector<std::uint64_t> ids;
  std::vector<float> values;
  //! Delta only: ids removed (evicted) after the cursor it was taken from.
  std::vector<std::uint64_t> removed;

  std::span<const float> row(std::size_t k) const noexcept { return {values.data() + k * dim, dim}; }

  //! Applies a delta: drops its removed ids, then inserts or replaces its
  //! rows; takes its cursor. Throws checkpoint_error on another row width,
  //! or when this export's or the delta's floats are not its rows. Indexes
  //! this export's ids on each call: a merge costs the whole copy.
  void merge(const TableExport& delta) {
    if (delta.dim != dim)
      throw checkpoint_error("psx: merging a delta of rows of " + std::to_string(delta.dim) +
                             " floats into an export of rows of " + std::to_string(dim));
    auto check = [](const TableExport& e, const char* which) {
      if (e.values.size() != e.ids.size() * e.dim)
        throw checkpoint_error(std::string("psx: merging a delta: ") + which + " has " + std::to_string(e.ids.size()) +
                               " ids and " + std::to_string(e.values.size()) + " floats, not rows of " +
                               std::to_string(e.dim));
    };
    check(*this, "the export");
    check(delta, "the delta");
    // Room for every row first: an allocation that fails below leaves the
    // export whole (its ids and floats agree), partly merged; merging the
    // same delta again then gives what one merge gives.
    ids.reserve(ids.size() + delta.ids.size());
    values.reserve((ids.size() + delta.ids.size()) * dim);
    std::unordered_map<std::uint64_t, std::size_t> at;
    at.reserve(ids.size());
    for (std::size_t k = 0; k < ids.size(); ++k) at.emplace(ids[k], k);
    auto drop = [&](std::uint64_t id) {
      const auto it = at.find(id);
      if (it == at.end()) return;
      const std::size_t k = it->second, last = ids.size() - 1;
      if (k != last) {
        ids[k] = ids[last];
        std::memcpy(values.data() + k * dim, values.data() + last * dim, dim * sizeof(float));
        at[ids[k]] = k;
      }
      ids.pop_back();
      values.resize(ids.size() * dim);
      at.erase(it);
    };
    for (const std::uint64_t id : delta.removed) drop(id);
    for (std::size_t k = 0; k < delta.ids.size(); ++k) {
      const auto [it, fresh] = at.emplace(delta.ids[k], ids.size());
      if (fresh) {
        ids.push_back(delta.ids[k]);
        values.resize(ids.size() * dim);
      }
      std::memcpy(values.data() + it->second * dim, delta.values.data() + k * dim, dim * sizeof(float));
    }
    cursor = delta.cursor;
  }

  //! The rows sorted by id (to compare two exports).
  std::vector<std::pair<std::uint64_t, std::vector<float>>> sorted() const {
    std::vector<std::pair<std::uint64_t, std::vector<float>>> out;
    out.reserve(ids.size());
    for (std::size_t k = 0; k < ids.size(); ++k) out.emplace_back(ids[k], std::vector<float>(row(k).begin(), row(k).end()));
    std::sort(out.begin(), out.end());
    return out;
  }
};

//! One page of an export (`DynamicTable::export_page`): what a server
//! answers when the rows of its part travel in messages of bounded size.
struct TablePage {
  std::uint64_t incarnation = 0;  //!< the table's when the page was taken
  std::uint64_t version = 0;      //!< the table's version, read before the page's rows
  std::size_t rows = 0;           //!< rows written (their ids first, then their floats)
  std::size_t removed = 0;        //!< removed ids written after the rows' ids (a delta)
  std::uint64_t next = 0;         //!< where the next page starts: after this id hash
  bool more = false;              //!< rows or removed ids may follow: ask for the page after `next`
};

namespace detail {

// A count-min sketch of 8-bit saturating counters with conservative update
// (only the smallest counters grow): how often an id not yet stored was
// pushed; every `window` counts (0: never) each counter is halved.
class PushSketch {
 public:
  PushSketch(std::uint32_t width, std::uint32_t depth, std::uint64_t window)
      : mask_(width - 1),
        depth_(depth),
        window_(window),
        counts_(std::make_unique<std::atomic<std::uint8_t>[]>(std::size_t{width} * depth)) {}

  std::uint64_t bytes() const noexcept { return (std::uint64_t{mask_} + 1) * depth_; }
  std::uint32_t width() const noexcept { return mask_ + 1; }
  std::uint32_t depth() const noexcept { return depth_; }
  // Pushes counted (with a window: where it stands).
  std::uint64_t added() const noexcept { return added_.load(std::memory_order_relaxed); }

  // The counters, row after row (`bytes()` of them).
  std::vector<std::uint8_t> counters() const {
    std::vector<std::uint8_t> out(bytes());
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = counts_[i].load(std::memory_order_relaxed);
    return out;
  }
  // Replaces the counters (`bytes()` of them, or none: all zero) and the pushes counted.
  void assign(std::span<const std::uint8_t> counters, std::uint64_t added) noexcept {
    for (std::size_t i = 0; i < bytes(); ++i)
      counts_[i].store(counters.empty() ? std::uint8_t{0} : counters[i], std::memory_order_relaxed);
    added_.store(added, std::memory_order_relaxed);
  }

  // Counts one push of `id`; returns its estimate, this push included.
  unsigned add(std::uint64_t id) noexcept {
    std::size_t at[16];
    unsigned lo = 255;
    for (std::uint32_t r = 0; r < depth_; ++r) {
      at[r] = r * (std::size_t{mask_} + 1) + (mix64(id ^ (0x8cb92ba72f3d8dd7ull * (r + 1))) & mask_);
      lo = std::min<unsigned>(lo, counts_[at[r]].load(std::memory_order_relaxed));
    }
    if (lo < 255)
      for (std::uint32_t r = 0; r < depth_; ++r) {
        auto low = static_cast<std::uint8_t>(lo);  // another thread may have raised it: then it is left as it is
        counts_[at[r]].compare_exchange_strong(low, static_cast<std::uint8_t>(lo + 1), std::memory_order_relaxed);
      }
    if (window_ != 0 && (added_.fetch_add(1, std::memory_order_relaxed) + 1) % window_ == 0) halve();
    return std::min(lo + 1, 255u);
  }

 private:
  void halve() noexcept {
    const std::size_t n = (std::size_t{mask_} + 1) * depth_;
    for (std::size_t i = 0; i < n; ++i)
      counts_[i].store(static_cast<std::uint8_t>(counts_[i].load(std::memory_order_relaxed) >> 1),
                       std::memory_order_relaxed);
  }

  std::uint32_t mask_;
  std::uint32_t depth_;
  std::uint64_t window_;
  std::atomic<std::uint64_t> added_{0};
  std::unique_ptr<std::atomic<std::uint8_t>[]> counts_;
};

// Bytes of one record: the row's bookkeeping (3 words), then its floats.
inline std::uint64_t table_record_bytes(std::size_t dim, std::size_t slots) noexcept {
  return 3 * sizeof(std::uint64_t) + (std::uint64_t{dim} * sizeof(float) * (1 + slots) + 7) / 8 * 8;
}

// Records per chunk (a stripe grows by a chunk at a time): 16, or fewer
// (a power of two) so that a chunk of wide rows stays within 64 KiB.
inline std::uint32_t table_chunk_rows(std::uint64_t record_bytes) noexcept {
  return std::bit_floor(static_cast<std::uint32_t>(std::clamp<std::uint64_t>((64u << 10) / record_bytes, 1, 16)));
}

// The smallest cap a dynamic table accepts: per stripe, an index of 32
// entries (16 and its first doubling) and two chunks of records; and the
// admission sketch.
inline std::uint64_t table_minimum_bytes(std::size_t dim, std::size_t slots, const TableOptions& o) {
  const std::uint64_t record = table_record_bytes(dim, slots);
  const std::uint64_t sketch = o.admission.kind == Admission::Kind::after_pushes
                                   ? std::uint64_t{o.admission.sketch_width} * o.admission.sketch_depth
                                   : 0;
  return sketch + std::uint64_t{o.stripes} * (32 * 16 + 2 * table_chunk_rows(record) * record);
}

// Refuses a memory cap below table_minimum_bytes (config_error naming the table).
inline void check_table_cap(const std::string& name, std::size_t dim, std::size_t slots, const TableOptions& o) {
  const std::uint64_t minimum = table_minimum_bytes(dim, slots, o);
  if (o.memory_cap_bytes != 0 && o.memory_cap_bytes < minimum)
    throw config_error("psx: dynamic table '" + name + "': memory_cap_bytes " + std::to_string(o.memory_cap_bytes) +
                       " is below its minimum of " + std::to_string(minimum) + " per server (dim " +
                       std::to_string(dim) + ", " + std::to_string(slots) + " optimizer slots, " +
                       std::to_string(o.stripes) + " stripes)");
}

}  // namespace detail

//! One server's part of a dynamic table, updated by optimizer type `O`.
//! Every member may be called from any number of threads at once.
template <Optimizer O>
class DynamicTable {
 public:
  //! Throws config_error when the memory cap is below the table's minimum.
  DynamicTable(std::string name, std::size_t dim, const Initializer& init, const TableOptions& options,
               const O& optimizer)
      : name_(std::move(name)),
        dim_(dim),
        slots_(optimizer.slots()),
        record_floats_(dim * (1 + optimizer.slots())),
        init_(init),
        options_(validated(name_, dim, init, options)),
        stripes_(std::make_unique<Stripe[]>(options_.stripes)),
        stripe_shift_(64 - std::countr_zero(options.stripes)) {
    incarnation_.store(fresh_incarnation(), std::memory_order_relaxed);
    for (std::size_t k = 0; k < slots_; ++k) slot_init_.push_back(initial_slot(optimizer, k));
    detail::check_table_cap(name_, dim, slots_, options);  // before the sketch is allocated
    if (options.admission.kind == Admission::Kind::after_pushes)
      sketch_ = std::make_unique<detail::PushSketch>(options.admission.sketch_width, options.admission.sketch_depth,
                                                     options.admission.sketch_window);
    stride_ = detail::table_record_bytes(dim, slots_);
    static_assert(sizeof(RowMeta) == 3 * sizeof(std::uint64_t));
    chunk_rows_ = detail::table_chunk_rows(stride_);
    chunk_shift_ = std::countr_zero(chunk_rows_);
    chunk_bytes_ = std::uint64_t{chunk_rows_} * stride_;
    if (options.memory_cap_bytes != 0) {
      stripe_budget_ = (options.memory_cap_bytes - (sketch_ ? sketch_->bytes() : 0)) / options.stripes;
    }
    for (std::uint32_t s = 0; s < options.stripes; ++s) {
      stripes_[s].index.assign(16, Entry{});
      add_bytes(stripes_[s], 16 * sizeof(Entry));
    }
    bytes_.fetch_add(sketch_ ? sketch_->bytes() : 0, std::memory_order_relaxed);
    removal_limit_ = std::max<std::uint64_t>(1, options.removal_log_limit / options.stripes);
    const std::uint64_t ttl = options.ttl_steps;
    sweep_every_ = options.ttl_sweep_steps ? options.ttl_sweep_steps : std::max<std::uint64_t>(1, ttl / 16);
  }

  DynamicTable(const DynamicTable&) = delete;
  DynamicTable& operator=(const DynamicTable&) = delete;

 private:
  // The checks of psx::embedding's declaration, for a table made directly.
  static const TableOptions& validated(const std::string& name, std::size_t dim, const Initializer& init,
                                       const TableOptions& options) {
    (void)detail::make_dynamic_meta({name, {dim}, VariableKind::dynamic, init, true, DType::float32, {}, options}, 0);
    return options;
  }

 public:

  const std::string& name() const noexcept { return name_; }
  std::size_t dim() const noexcept { return dim_; }
  //! Changes so far (an update, or an admission with its first update,
  //! and a removal each count one).
  std::uint64_t version() const noexcept { return version_.load(std::memory_order_acquire); }
  //! Ids stored now.
  std::size_t size() const noexcept { return static_cast<std::size_t>(rows_.load(std::memory_order_relaxed)); }

  //! Copies the rows of `ids` into rows `positions[j]` (or `j`) of `out`:
  //! stored rows as they are, other ids their initial value. `step` (the
  //! global step) marks the stored rows as used for the LRU eviction.
  void pull(std::span<const std::uint64_t> ids, std::span<const std::uint32_t> positions, std::span<float> out,
            std::uint64_t step) const {
    const std::size_t rows = out.size() / dim_;
    if (out.size() % dim_ != 0 || (positions.empty() && rows != ids.size()) ||
        (!positions.empty() && positions.size() != ids.size()))
      throw shape_error("psx: dynamic table '" + name_ + "': a pull of " + std::to_string(ids.size()) + " ids (" +
                        std::to_string(positions.size()) + " positions) into " + std::to_string(out.size()) +
                        " floats of rows of " + std::to_string(dim_));
    for (const std::uint32_t p : positions)
      if (p >= rows)
        throw shape_error("psx: dynamic table '" + name_ + "': row position " + std::to_string(p) + " beyond the " +
                          std::to_string(rows) + "-row buffer");
    if (ids.size() > std::numeric_limits<std::uint32_t>::max())
      throw shape_error("psx: dynamic table '" + name_ + "': at most 2^32 - 1 ids per call");
    auto dst = [&](std::size_t j) { return out.data() + (positions.empty() ? j : positions[j]) * dim_; };
    const ScratchLease<Scratch> lease(ids.size() * kScratchBytesPerId);
    Scratch& scratch = lease.get();
    std::vector<std::uint32_t>& unseen = scratch.unseen;
    unseen.clear();
    const Batch& batch = group(ids, scratch.batch);
    std::vector<std::uint32_t>& slots = scratch.slots;
    slots.resize(ids.size());
    for_each_window<std::shared_lock<std::shared_mutex>>(batch, [&](std::uint32_t first, std::uint32_t last) {
      find_window(ids, batch, first, last, slots, false);
      for (std::uint32_t k = first; k < last; ++k) {
        const std::uint32_t j = batch.order[k];
        if (slots[k] == empty_slot) {
          unseen.push_back(j);
          continue;
        }
        const Stripe& st = stripe(batch.hash[j]);
        copy_row(dst(j), record(st, slots[k]));
        if (stripe_budget_ != 0) {  // the LRU clock: read only under a cap
          if (st.snap) [[unlikely]]
            touch_kept(st, ids[j], slots[k], step);
          else
            touch(meta(st, slots[k]).used, step);
        }
      }
    });
    for (const std::uint32_t j : unseen) init_.fill_row(name_, ids[j], std::span<float>(dst(j), dim_));
  }

  //! Whether `id` is stored.
  bool contains(std::uint64_t id) const {
    const std::uint64_t h = hash(id);
    const Stripe& st = stripe(h);
    std::shared_lock lock(st.mu);
    return find(st, id, h) != empty_slot;
  }

  //! Applies summed gradient rows (each id once) with `optimizer` at
  //! `ctx.global_step`: admits ids not stored, updates their row and slots,
  //! then runs the time-to-live sweep when one is due. Throws shape_error
  //! for sums of another width.
  void apply(const O& optimizer, const detail::RowAccumulator& rows, const UpdateContext& ctx) {
    if (rows.width() != dim_ || rows.data().size() != rows.rows().size() * dim_)
      throw shape_error("psx: dynamic table '" + name_ + "': applying " + std::to_string(rows.rows().size()) +
                        " summed rows of " + std::to_string(rows.width()) + " floats to rows of " +
                        std::to_string(dim_));
    const ScratchLease<Scratch> lease(rows.rows().size() * kScratchBytesPerId);
    Scratch& scratch = lease.get();
    std::vector<float*>& bases = scratch.bases;
    bases.resize(slots_);
    const std::span<const std::uint64_t> ids(rows.rows());
    const Batch& batch = group(ids, scratch.batch);
    std::vector<std::uint32_t>& slots = scratch.slots;
    slots.resize(ids.size());
    std::vector<RowMeta*>& changed = scratch.changed;
    for_each_window<std::unique_lock<std::shared_mutex>>(batch, [&](std::uint32_t first, std::uint32_t last) {
      find_window(ids, batch, first, last, slots, true);
      // The rows changed get one version each, taken together at the end
      // (still under the window's locks, so no export reads a row of it
      // before its version is there), and also when an admission or an
      // eviction throws halfway: a row updated without a new version would
      // be missing from every later delta. A record updated, evicted and
      // reused within the window is listed twice and keeps the later version.
      changed.clear();
      changed.reserve(last - first);  // each id adds at most one: no push_back below throws
      auto versions = [&] {
        if (changed.empty()) return;
        const std::uint64_t base = version_.fetch_add(changed.size(), std::memory_order_acq_rel);
        for (std::size_t i = 0; i < changed.size(); ++i) changed[i]->version = base + 1 + i;
      };
      // A stripe's ids are applied one after the other, and only their own
      // evictions erase its rows meanwhile: a slot found stays the id's
      // until then (an eviction frees the evicted ids' records, which an
      // admission may take over; then the ids left are looked up again).
      const Stripe* current = nullptr;
      std::uint64_t erasures = 0;
      try {
        for (std::uint32_t i = first; i < last; ++i) {
          const std::uint32_t k = batch.order[i];
          Stripe& st = stripe(batch.hash[k]);
          if (&st != current) current = &st, erasures = st.erasures;
          const std::uint32_t slot = st.erasures == erasures ? slots[i] : find(st, ids[k], batch.hash[k]);
          apply_row(optimizer, st, ids[k], batch.hash[k], slot, rows.row_data(k), bases, changed, ctx);
        }
      } catch (...) {
        versions();
        throw;
      }
      versions();
    });
    sweep_if_due(ctx.global_step);
  }

  //! Sums the gradient rows of repeated ids, then applies them (`apply`).
  void push(const O& optimizer, std::span<const std::uint64_t> ids, std::span<const float> grads,
            const UpdateContext& ctx) {
    if (grads.size() != ids.size() * dim_)
      throw shape_error("psx: dynamic table '" + name_ + "': a push of " + std::to_string(ids.size()) + " ids of dim " +
                        std::to_string(dim_) + " needs " + std::to_string(ids.size() * dim_) + " floats, got " +
                        std::to_string(grads.size()));
    // Each thread keeps its sum's memory from call to call, as ScratchLease says.
    // The sum: a row and an id per id, and its hash slots.
    const ScratchLease<detail::RowAccumulator> lease(ids.size() * (dim_ * sizeof(float) + 3 * sizeof(std::uint64_t)));
    detail::RowAccumulator& sum = lease.get();
    sum.reset(dim_);
    for (std::size_t j = 0; j < ids.size(); ++j) sum.add(ids[j], grads.data() + j * dim_);
    apply(optimizer, sum, ctx);
  }

  //! Evicts the rows not updated within `ttl_steps` of global step `now`
  //! (every row updated at `u` with `u + ttl_steps < now`); returns how many.
  std::size_t expire(std::uint64_t now) {
    if (options_.ttl_steps == 0) return 0;
    std::size_t evicted = 0;
    std::vector<std::uint64_t> old;
    for (std::uint32_t s = 0; s < options_.stripes; ++s) {
      Stripe& st = stripes_[s];
      std::unique_lock lock(st.mu);
      old.clear();
      for (const Entry& e : st.index)
        if (e.slot != empty_slot && expired(meta(st, e.slot).updated, now)) old.push_back(e.key);
      for (const std::uint64_t id : old) {
        erase(st, id);  // a bad_alloc here leaves the rows erased so far counted
        ++evicted;
        evicted_ttl_.fetch_add(1, std::memory_order_relaxed);
      }
    }
    return evicted;
  }

  //! A number drawn when the table was made: what tells its cursors from
  //! those of an earlier table of the same name.
  std::uint64_t incarnation() const noexcept { return incarnation_.load(std::memory_order_relaxed); }

  //! Every stored row (`since` empty), or the rows changed after the cursor
  //! `since` (of this table: one incarnation and version) and the ids
  //! removed after it. Throws checkpoint_error for a cursor of another
  //! table or from its future, and for a delta from before the oldest
  //! removal remembered (take a full export instead).
  TableExport export_rows(const TableCursor& since = {}) const { return export_since(delta_base(since)); }

  //! One page of an export (`export_rows` in pieces of bounded size, for a
  //! server answering over a transport): the rows, and with a cursor the
  //! removed ids, whose id hashes come after `after` (none: from the
  //! first), in increasing hash order, as many as `out` holds. `out` holds
  //! `capacity = out.size() / (2 + dim)` entries: an id region of
  //! `capacity` u64 (each written as the bits of two floats: the rows' ids,
  //! then the removed ids), then the rows' floats (`capacity * dim`). A row
  //! or a removed id counts as one entry. Ask again from `next` while
  //! `more`. The pages of one export, taken while the table changes, hold
  //! what one `export_rows` would: each id once, and every row changed
  //! after the first page's `version` is in the pages or in the next
  //! delta from it. Throws as `export_rows`, and shape_error for an `out`
  //! without room for one entry.
  TablePage export_page(const TableCursor& since, std::optional<std::uint64_t> after, std::span<float> out) const {
    const std::size_t capacity = out.size() / (2 + dim_);
    if (capacity == 0)
      throw shape_error("psx: dynamic table '" + name_ + "': an export page of " + std::to_string(out.size()) +
                        " floats has no room for one row of " + std::to_string(dim_) + " floats and its id");
    const std::optional<std::uint64_t> from = delta_base(since);
    TablePage page;
    // Read first, as export_since does: a change after it has a higher version.
    page.incarnation = incarnation();
    page.version = version();
    auto* ids = reinterpret_cast<std::byte*>(out.data());
    float* values = out.data() + 2 * capacity;
    std::vector<std::uint64_t> gone;  // removed ids, written after the rows' ids
    struct Found {
      std::uint64_t hash;
      std::uint64_t id;
      std::uint32_t slot;  // empty_slot: a removed id
    };
    std::vector<Found> found;
    std::size_t taken = 0;
    for (std::uint32_t s = after ? static_cast<std::uint32_t>(stripe_of(*after)) : 0; s < options_.stripes; ++s) {
      if (taken == capacity) {  // full at a stripe's end: more may follow
        page.more = true;
        break;
      }
      const Stripe& st = stripes_[s];
      std::shared_lock lock(st.mu);
      if (from && *from < st.removed_floor)
        throw checkpoint_error("psx: dynamic table '" + name_ + "': a delta since version " + std::to_string(*from) +
                               ", but removals up to version " + std::to_string(st.removed_floor) +
                               " are forgotten (removal_log_limit); take a full export");
      found.clear();
      for (const Entry& e : st.index) {
        if (e.slot == empty_slot || (from && meta(st, e.slot).version <= *from)) continue;
        const std::uint64_t h = hash(e.key);
        if (!after || h > *after) found.push_back({h, e.key, e.slot});
      }
      if (from)
        for (const auto& [id, v] : st.removed) {
          const std::uint64_t h = hash(id);
          if (v > *from && (!after || h > *after)) found.push_back({h, id, empty_slot});
        }
      // Full before the stripe's end: its smallest hashes now, the rest later.
      if (found.size() > capacity - taken) {
        const auto cut = found.begin() + static_cast<std::ptrdiff_t>(capacity - taken);
        std::nth_element(found.begin(), cut - 1, found.end(), [](const Found& a, const Found& b) { return a.hash < b.hash; });
        found.erase(cut, found.end());
        page.more = true;
      }
      for (const Found& f : found) {
        page.next = std::max(page.next, f.hash);
        if (f.slot == empty_slot) {
          gone.push_back(f.id);
          continue;
        }
        std::memcpy(ids + page.rows * sizeof f.id, &f.id, sizeof f.id);
        copy_row(values + page.rows * dim_, record(st, f.slot));
        ++page.rows;
      }
      taken += found.size();
      if (page.more) break;
    }
    if (!gone.empty()) std::memcpy(ids + page.rows * sizeof(std::uint64_t), gone.data(), gone.size() * sizeof(std::uint64_t));
    page.removed = gone.size();
    return page;
  }

 private:
  // The version a delta from `since` starts after (none: a full export);
  // checkpoint_error for a cursor of another table or from its future.
  std::optional<std::uint64_t> delta_base(const TableCursor& since) const {
    std::optional<std::uint64_t> from;
    if (!since.empty()) {
      if (since.version.size() != 1 || since.incarnation.size() != 1 || since.incarnation[0] != incarnation())
        throw checkpoint_error("psx: dynamic table '" + name_ + "': a delta from a cursor of another table (" +
                               (since.incarnation.size() == 1 ? "incarnation " + std::to_string(since.incarnation[0])
                                                               : std::to_string(since.incarnation.size()) + " incarnations") +
                               ", this one is " + std::to_string(incarnation()) + "); take a full export");
      if (since.version[0] > version())
        throw checkpoint_error("psx: dynamic table '" + name_ + "': a delta from version " +
                               std::to_string(since.version[0]) + ", beyond its version " + std::to_string(version()));
      from = since.version[0];
    }
    return from;
  }

  TableExport export_since(std::optional<std::uint64_t> since) const {
    TableExport out;
    out.dim = dim_;
    // Read first: a change that any stripe shows later has a higher version,
    // so the next delta from this cursor has it.
    out.cursor = {{incarnation()}, {version()}};
    for (std::uint32_t s = 0; s < options_.stripes; ++s) {
      const Stripe& st = stripes_[s];
      std::shared_lock lock(st.mu);
      if (since && *since < st.removed_floor)
        throw checkpoint_error("psx: dynamic table '" + name_ + "': a delta since version " + std::to_string(*since) +
                               ", but removals up to version " + std::to_string(st.removed_floor) +
                               " are forgotten (removal_log_limit); take a full export");
      for (const Entry& e : st.index) {
        if (e.slot == empty_slot || (since && meta(st, e.slot).version <= *since)) continue;
        out.ids.push_back(e.key);
        const float* w = record(st, e.slot);
        out.values.insert(out.values.end(), w, w + dim_);
      }
      if (since)
        for (const auto& [id, v] : st.removed)
          if (v > *since) out.removed.push_back(id);
    }
    return out;
  }

 public:
  //! The counters and memory now.
  TableStats stats() const noexcept {
    auto get = [](const std::atomic<std::uint64_t>& a) { return a.load(std::memory_order_relaxed); };
    TableStats s;
    s.rows = get(rows_);
    s.bytes = get(bytes_);
    s.ideal_row_bytes = record_floats_ * sizeof(float);
    s.admitted = get(admitted_);
    s.refused = get(refused_);
    s.evicted_ttl = get(evicted_ttl_);
    s.evicted_memory = get(evicted_memory_);
    s.removal_log = get(removals_);
    s.removal_log_bytes = s.removal_log * removal_entry_bytes;
    return s;
  }

 private:
  struct Stripe;

 public:
  // -- checkpoints (psx/checkpoint.hpp saves and restores a table through these) --

  //! What a checkpoint keeps of this table besides its rows and sketch
  //! counters (`TableState::shard_version` is the server's to fill in).
  //! Like the two below, called while no other thread changes the table:
  //! a server saves from the one thread that updates its tables.
  detail::TableState checkpoint_state() const {
    std::vector<std::shared_lock<std::shared_mutex>> locks;
    locks.reserve(options_.stripes);
    for (std::uint32_t k = 0; k < options_.stripes; ++k) locks.emplace_back(stripes_[k].mu);
    return state_locked();
  }

 private:
  // checkpoint_state, every stripe locked by the caller.
  detail::TableState state_locked() const {
    auto get = [](const std::atomic<std::uint64_t>& a) { return a.load(std::memory_order_relaxed); };
    detail::TableState s;
    s.dim = dim_;
    s.slots = slots_;
    s.rows = get(rows_);
    s.version = version();
    s.next_sweep = get(next_sweep_);
    s.admitted = get(admitted_);
    s.refused = get(refused_);
    s.evicted_ttl = get(evicted_ttl_);
    s.evicted_memory = get(evicted_memory_);
    if (sketch_) {
      s.sketch_width = sketch_->width();
      s.sketch_depth = sketch_->depth();
      s.sketch_added = sketch_->added();
    }
    s.layout.reserve(std::size_t{2} * options_.stripes);
    for (std::uint32_t k = 0; k < options_.stripes; ++k) {
      const Stripe& st = stripes_[k];
      s.layout.push_back(std::max(st.index.size(), st.reserved_index));
      s.layout.push_back(std::max(st.chunks.size(), st.reserved_chunks));
    }
    return s;
  }

 public:

  //! The admission sketch's counters, row after row (none without one).
  std::vector<std::uint8_t> checkpoint_sketch() const { return sketch_ ? sketch_->counters() : std::vector<std::uint8_t>{}; }

  //! Calls `sink` with every stored row as a checkpoint holds it
  //! (`detail::table_row_bytes`: id, last update, last use, the row and its
  //! slots), whole rows in blocks of up to 4 MiB, each copied under its
  //! stripe's lock and handed over after it is let go.
  void checkpoint_rows(const std::function<void(std::span<const std::byte>)>& sink) const {
    const std::size_t row = detail::table_row_bytes(dim_, slots_);
    const std::size_t block = std::max<std::size_t>(row, std::size_t{4} << 20);
    std::vector<std::byte> buf;
    buf.reserve(block);
    for (std::uint32_t k = 0; k < options_.stripes; ++k) {
      const Stripe& st = stripes_[k];
      // Several blocks of one stripe: its index cannot change in between,
      // the server's one updating thread being the one saving.
      for (std::size_t i = 0, end = 1; i < end;) {
        buf.clear();
        {
          std::shared_lock lock(st.mu);
          end = st.index.size();
          for (; i < end && buf.size() + row <= block; ++i) {
            const Entry& e = st.index[i];
            if (e.slot == empty_slot) continue;
            const RowMeta& m = meta(st, e.slot);
            const std::uint64_t head[3] = {e.key, m.updated, m.used.load(std::memory_order_relaxed)};
            const std::size_t at = buf.size();
            buf.resize(at + row);
            std::memcpy(buf.data() + at, head, sizeof head);
            std::memcpy(buf.data() + at + sizeof head, record(st, e.slot), record_floats_ * sizeof(float));
          }
        }
        if (!buf.empty()) sink(buf);
      }
    }
  }

  //! This table as it is at one moment, read while it goes on changing: a
  //! checkpoint written while training runs (a background save,
  //! psx/checkpoint.hpp). Made in the time it takes to lock every stripe
  //! once (the counters, layout and admission sketch are copied then); its
  //! rows are read later, stripe by stripe, by `rows`. Copy-on-write by
  //! row: until the snapshot has read a stripe, a row of the snapshot that
  //! an update or a removal is about to change is copied first (and a
  //! pull's touch of a row's last use, under a memory cap, keeps the value
  //! it replaces), so `rows` gives every row as it was at the moment the
  //! snapshot was made, whatever changed since. The copies are the cost:
  //! at most the snapshot's rows once, outside the memory cap, each
  //! stripe's let go as soon as it is read. One snapshot at a time per
  //! table; the table must outlive it, and must not be restored (`adopt`)
  //! meanwhile.
  class Snapshot {
   public:
    Snapshot(const Snapshot&) = delete;
    Snapshot& operator=(const Snapshot&) = delete;
    //! Stops copying; what was copied for stripes not read yet is let go.
    ~Snapshot() { table_->end_snapshot(); }

    //! The table's counters, layout and sketch size at the snapshot
    //! (`TableState::shard_version` is the server's to fill in).
    const detail::TableState& state() const noexcept { return state_; }
    //! The admission sketch's counters at the snapshot (none without one).
    const std::vector<std::uint8_t>& sketch() const noexcept { return sketch_; }
    //! Bytes of rows copied so far because they changed before they were read.
    std::uint64_t copied_bytes() const noexcept { return table_->snap_copied_.load(std::memory_order_relaxed); }

    //! Calls `sink` with every row of the snapshot, `state().rows` rows in
    //! all, as `checkpoint_rows` does (whole rows in blocks of up to 4 MiB,
    //! each handed over with no lock held); once. `stop`, when set between
    //! two blocks, ends it with a checkpoint_error.
    void rows(const std::function<void(std::span<const std::byte>)>& sink, const std::atomic<bool>* stop = nullptr) {
      if (read_) throw checkpoint_error("psx: dynamic table '" + table_->name_ + "': a snapshot's rows are read once");
      read_ = true;
      DynamicTable& t = *table_;
      const std::size_t row = detail::table_row_bytes(t.dim_, t.slots_);
      const std::size_t block = std::max<std::size_t>(row, std::size_t{4} << 20) / row * row;
      // Rows looked at per hold of a stripe's lock: a push to the stripe
      // waits for at most this many rows' copies (about 16 KiB; with 256
      // KiB, a table of 5M rows pushed 4096 ids a step from another thread
      // took steps 2-3 times longer while it was read, with 16 KiB about
      // 1.4 times: bench_table_save).
      const std::size_t per_lock = std::max<std::size_t>(1, (std::size_t{16} << 10) / row);
      std::vector<std::byte> buf;
      buf.reserve(block);
      auto hand_over = [&](std::size_t room) {  // when fewer than `room` bytes are left in the block
        if (buf.size() + room <= block) return;
        if (stop && stop->load(std::memory_order_relaxed))
          throw checkpoint_error("psx: dynamic table '" + t.name_ + "': the save was called off");
        if (!buf.empty()) sink(buf);
        buf.clear();
      };
      // A few stripes at a time, a batch of each in turn: a lock taken
      // again as soon as it was let go keeps a push that waits for it
      // waiting (glibc's locks let the running thread in first), for a
      // whole stripe (steps of 12 ms instead of 1 while a save was read).
      constexpr std::uint32_t kTogether = 8;
      std::vector<Entry> entries[kTogether];
      std::size_t next[kTogether] = {};
      for (std::uint32_t first = 0; first < t.options_.stripes; first += kTogether) {
        const std::uint32_t n = std::min(kTogether, t.options_.stripes - first);
        for (std::uint32_t j = 0; j < n; ++j) {  // the ids stored now: the snapshot's among them (the others, since removed, were copied)
          const Stripe& st = t.stripes_[first + j];
          std::shared_lock lock(st.mu);
          entries[j].clear();
          entries[j].reserve(st.count);
          for (const Entry& e : st.index)
            if (e.slot != empty_slot) entries[j].push_back(e);
          next[j] = 0;
        }
        for (bool more = true; more;) {
          more = false;
          for (std::uint32_t j = 0; j < n; ++j) {
            if (next[j] == entries[j].size()) continue;
            hand_over(per_lock * row);
            Stripe& st = t.stripes_[first + j];
            // For writing, though it only reads: pulls wait for one batch.
            std::unique_lock lock(st.mu);
            StripeSnapshot& sn = *st.snap;
            const std::vector<Entry>& es = entries[j];
            std::size_t& i = next[j];
            for (const std::size_t end = std::min(es.size(), i + per_lock); i < end; ++i) {
              const std::uint32_t slot = es[i].slot;
              const RowMeta& m = t.meta(st, slot);
              // Changed or added after the snapshot, removed (the record
              // free or another id's), or copied before it changed: not
              // read here. A row at its version of the snapshot, in its
              // record, is the snapshot's.
              if (m.version > t.snap_version_ || sn.was_taken(slot)) continue;
              const auto seen = sn.used_before.find(es[i].key);
              const std::uint64_t head[3] = {
                  es[i].key, m.updated,
                  seen != sn.used_before.end() ? seen->second : m.used.load(std::memory_order_relaxed)};
              const std::size_t at = buf.size();
              buf.resize(at + row);
              std::memcpy(buf.data() + at, head, sizeof head);
              std::memcpy(buf.data() + at + sizeof head, t.record(st, slot), t.record_floats_ * sizeof(float));
              if ((slot >> 6) >= sn.taken.size()) sn.taken.resize((slot >> 6) + 1);
              sn.taken[slot >> 6] |= std::uint64_t{1} << (slot & 63);
            }
            more = more || i < es.size();
          }
        }
        for (std::uint32_t j = 0; j < n; ++j) {
          // Every row of the stripe read or copied: no more copies; then the copies.
          Stripe& st = t.stripes_[first + j];
          std::unique_ptr<StripeSnapshot> done;
          {
            std::unique_lock lock(st.mu);
            done = std::move(st.snap);
          }
          for (std::vector<std::byte>& part : done->before) {
            hand_over(part.size());
            buf.insert(buf.end(), part.begin(), part.end());
            std::vector<std::byte>().swap(part);  // let go as soon as it is in the block
          }
        }
      }
      hand_over(block + 1);  // the last block
    }

   private:
    friend class DynamicTable;
    explicit Snapshot(DynamicTable& t) : table_(&t) {}

    DynamicTable* table_;
    detail::TableState state_;
    std::vector<std::uint8_t> sketch_;
    bool read_ = false;
  };

  //! Makes a Snapshot of this table (every stripe locked for writing at
  //! once, briefly: the counters and sketch are copied, the rows are not).
  //! Throws checkpoint_error while another snapshot of it is open.
  std::unique_ptr<Snapshot> snapshot() {
    if (snapshot_open_.exchange(true, std::memory_order_acq_rel))
      throw checkpoint_error("psx: dynamic table '" + name_ + "': a snapshot of it is open already (one at a time)");
    std::unique_ptr<Snapshot> snap(new Snapshot(*this));  // from here, its destructor ends the snapshot
    std::vector<std::unique_lock<std::shared_mutex>> locks;
    locks.reserve(options_.stripes);
    for (std::uint32_t k = 0; k < options_.stripes; ++k) locks.emplace_back(stripes_[k].mu);
    // Every stripe locked: no update is halfway, every version handed out is on its row.
    for (std::uint32_t k = 0; k < options_.stripes; ++k) {
      Stripe& st = stripes_[k];
      st.snap = std::make_unique<StripeSnapshot>();
      st.snap->taken.assign((st.chunks.size() * chunk_rows_ + 63) / 64, 0);
    }
    snap_version_ = version();
    snap_copied_.store(0, std::memory_order_relaxed);
    snap->state_ = state_locked();
    snap->sketch_ = checkpoint_sketch();
    return snap;
  }

  //! Takes the saved parts of a table while a checkpoint is read, for
  //! server `server` of the ring `ring` (the table's, which must outlive
  //! it): the rows the ring gives that server, in stripes of its own, and
  //! the counters, sketch and sweep merged over the parts; the table does
  //! not change until `adopt`. Parts merge so that nothing is lost:
  //!  - the table's version, its shard's update count and the sketch's
  //!    pushes counted: the largest of the parts'; the next sweep: the
  //!    earliest; the counters of saved server k go to server k mod the
  //!    servers now (their sums stay what they were);
  //!  - a count-min sketch cannot be split by id: each server takes the
  //!    largest of every part's counter in each cell, so no id's count goes
  //!    down (an id may count higher, as if every part's pushes had gone to
  //!    one sketch). A sketch of another width or depth than this table's
  //!    is left out (the restored sketch starts from zero);
  //!  - from one part (the ring the saved one), each stripe counts the
  //!    memory it counted when saved (it then grows and evicts as the saved
  //!    one would); otherwise what its rows take. A stripe over its share
  //!    of the memory cap refuses the restore (`finish`).
  class Restorer final : public detail::TableLoader {
   public:
    Restorer(const DynamicTable& table, const detail::HashRing& ring, std::size_t server)
        : table_(&table),
          ring_(&ring),
          server_(server),
          stripes_(std::make_unique<Stripe[]>(table.options_.stripes)),
          incarnation_(fresh_incarnation()) {
      for (std::uint32_t k = 0; k < table.options_.stripes; ++k) stripes_[k].index.assign(16, Entry{});
    }

    void begin_part(std::size_t server, std::size_t servers, std::uint32_t virtual_nodes,
                    const detail::TableState& s) override {
      const DynamicTable& t = *table_;
      part_ = server;
      part_ok_ = s.dim == t.dim_ && s.slots == t.slots_;
      if (!part_ok_ && damage_.second.empty())
        damage_ = {server, "dynamic table '" + t.name_ + "': rows of " + std::to_string(s.dim) + " floats and " +
                               std::to_string(s.slots) + " slots, this program's " + std::to_string(t.dim_) +
                               " and " + std::to_string(t.slots_)};
      ++parts_;
      shard_version_ = std::max(shard_version_, s.shard_version);
      version_ = std::max(version_, s.version);
      next_sweep_ = parts_ == 1 ? s.next_sweep : std::min(next_sweep_, s.next_sweep);
      if (server % std::max<std::size_t>(1, ring_->servers()) == server_) {
        admitted_ += s.admitted;
        refused_ += s.refused;
        evicted_ttl_ += s.evicted_ttl;
        evicted_memory_ += s.evicted_memory;
      }
      sketch_part_ = t.sketch_ && s.sketch_width == t.sketch_->width() && s.sketch_depth == t.sketch_->depth();
      if (sketch_part_) sketch_added_ = std::max(sketch_added_, s.sketch_added);
      // The memory as saved: only where this server's rows are one saved
      // server's, in stripes alike.
      whole_ = parts_ == 1 && servers == ring_->servers() && virtual_nodes == t.options_.virtual_nodes &&
               server == server_ && s.layout.size() == std::size_t{2} * t.options_.stripes;
      if (whole_) layout_ = s.layout;
    }

    void add_rows(std::span<const std::byte> rows) override {
      const DynamicTable& t = *table_;
      const std::size_t row = detail::table_row_bytes(t.dim_, t.slots_);
      if (!part_ok_) return;
      for (std::size_t at = 0; at + row <= rows.size(); at += row) {
        std::uint64_t head[3];
        std::memcpy(head, rows.data() + at, sizeof head);
        if (ring_->servers() > 1 && ring_->server(head[0]) != server_) continue;
        const std::uint64_t h = hash(head[0]);
        Stripe& st = stripes_[t.stripe_of(h)];
        if (find(st, head[0], h) != empty_slot) {
          if (damage_.second.empty())
            damage_ = {part_, "dynamic table '" + t.name_ + "': id " + std::to_string(head[0]) +
                                  " is saved twice (again in server " + std::to_string(part_) + "'s rows)"};
          continue;
        }
        if ((st.count + 1) * 4 > st.index.size() * 3) grow_index(st);
        if (st.free.empty()) t.add_chunk(st);
        const std::uint32_t slot = take_slot(st, head[0], h);
        RowMeta& m = t.meta(st, slot);
        m.version = 0;  // no delta reaches back before a restore (a new incarnation)
        m.updated = head[1];
        m.used.store(head[2], std::memory_order_relaxed);
        std::memcpy(t.record(st, slot), rows.data() + at + sizeof head, t.record_floats_ * sizeof(float));
        ++rows_;
      }
    }

    void add_sketch(std::uint64_t offset, std::span<const std::byte> counters) override {
      if (!sketch_part_) return;
      if (sketch_.empty()) sketch_.assign(table_->sketch_->bytes(), 0);
      for (std::size_t i = 0; i < counters.size() && offset + i < sketch_.size(); ++i)
        sketch_[offset + i] = std::max(sketch_[offset + i], static_cast<std::uint8_t>(counters[i]));
    }

    std::pair<std::size_t, std::string> damage() const override { return damage_; }

    void finish() override {
      const DynamicTable& t = *table_;
      for (std::uint32_t k = 0; k < t.options_.stripes && damage_.second.empty(); ++k) {
        Stripe& st = stripes_[k];
        st.reserved_index = st.index.size();
        st.reserved_chunks = st.chunks.size();
        if (whole_) {
          const std::uint64_t entries = layout_[2 * k], chunks = layout_[2 * k + 1];
          if (!std::has_single_bit(entries) || entries < st.index.size() || chunks < st.chunks.size() ||
              entries > (std::uint64_t{1} << 34) || chunks > (std::uint64_t{1} << 32)) {
            damage_ = {server_, "dynamic table '" + t.name_ + "': stripe " + std::to_string(k) + " counts " +
                                    std::to_string(entries) + " index entries and " + std::to_string(chunks) +
                                    " chunks, too few for its " + std::to_string(st.count) + " rows"};
            return;
          }
          const std::uint64_t saved = entries * sizeof(Entry) + chunks * t.chunk_bytes_;
          if (t.stripe_budget_ == 0 || saved <= t.stripe_budget_) {  // else what its rows take, if that fits
            st.reserved_index = entries;
            st.reserved_chunks = chunks;
          }
        }
        st.bytes = st.reserved_index * sizeof(Entry) + st.reserved_chunks * t.chunk_bytes_;
        if (t.stripe_budget_ != 0 && st.bytes > t.stripe_budget_)
          throw checkpoint_error("psx: dynamic table '" + t.name_ + "' on server " + std::to_string(server_) +
                                 ": its restored rows need " + std::to_string(st.bytes) + " bytes in stripe " +
                                 std::to_string(k) + ", over the stripe's share (" + std::to_string(t.stripe_budget_) +
                                 ") of memory_cap_bytes " + std::to_string(t.options_.memory_cap_bytes) +
                                 "; raise memory_cap_bytes or restore into more servers");
      }
    }

    //! The saved shard's update count (the largest of the parts').
    std::uint64_t shard_version() const noexcept { return shard_version_; }

   private:
    friend class DynamicTable;
    const DynamicTable* table_;
    const detail::HashRing* ring_;
    std::size_t server_;
    std::unique_ptr<Stripe[]> stripes_;
    std::uint64_t incarnation_;
    std::size_t parts_ = 0, part_ = 0;
    bool part_ok_ = false, sketch_part_ = false, whole_ = false;
    std::vector<std::uint64_t> layout_;
    std::vector<std::uint8_t> sketch_;
    std::uint64_t rows_ = 0, shard_version_ = 0, version_ = 0, next_sweep_ = 0, sketch_added_ = 0;
    std::uint64_t admitted_ = 0, refused_ = 0, evicted_ttl_ = 0, evicted_memory_ = 0;
    std::pair<std::size_t, std::string> damage_;
  };

  //! Replaces the table by what `r` (this table's Restorer, finished)
  //! took: rows, counters, sketch, sweep, and a new incarnation (every
  //! cursor of before is refused: take a full export after a restore).
  //! Each stripe is swapped under its lock; exports and stats called
  //! meanwhile see the table before or after, stripe by stripe.
  void adopt(Restorer& r) noexcept {
    std::uint64_t bytes = sketch_ ? sketch_->bytes() : 0;
    for (std::uint32_t k = 0; k < options_.stripes; ++k) {
      Stripe& st = stripes_[k];
      Stripe& in = r.stripes_[k];
      std::unique_lock lock(st.mu);
      st.index.swap(in.index);
      std::swap(st.count, in.count);
      st.chunks.swap(in.chunks);
      st.free.swap(in.free);
      std::swap(st.bytes, in.bytes);
      std::swap(st.reserved_index, in.reserved_index);
      std::swap(st.reserved_chunks, in.reserved_chunks);
      st.removed.swap(in.removed);  // the restorer's is empty
      st.removed_floor = 0;
      ++st.erasures;
      bytes += st.bytes;
    }
    if (sketch_) sketch_->assign(r.sketch_, r.sketch_added_);
    auto set = [](std::atomic<std::uint64_t>& a, std::uint64_t v) { a.store(v, std::memory_order_relaxed); };
    set(rows_, r.rows_);
    set(bytes_, bytes);
    set(admitted_, r.admitted_);
    set(refused_, r.refused_);
    set(evicted_ttl_, r.evicted_ttl_);
    set(evicted_memory_, r.evicted_memory_);
    set(removals_, 0);
    set(next_sweep_, r.next_sweep_);
    version_.store(r.version_, std::memory_order_release);
    incarnation_.store(r.incarnation_, std::memory_order_relaxed);
  }

 private:
  static std::uint64_t fresh_incarnation() {
    return detail::mix64(std::random_device{}() ^ (static_cast<std::uint64_t>(std::random_device{}()) << 32) ^
                         static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  }

  static constexpr std::uint32_t empty_slot = 0xffffffffu;
  // The version of a record being changed (until its window ends) or free:
  // above every snapshot's.
  static constexpr std::uint64_t changing = std::numeric_limits<std::uint64_t>::max();
  // Ids looked up together (find_window): enough misses in flight to hide
  // the memory latency (64-256 measured alike, 16 slower), few enough
  // stripes locked at once.
  static constexpr std::uint32_t kWindow = 128;
  // An unordered_map node with its bucket: what one remembered removal costs.
  static constexpr std::uint64_t removal_entry_bytes = 48;

  struct Entry {
    std::uint64_t key = 0;
    std::uint32_t slot = empty_slot;
  };
  struct RowMeta {
    std::uint64_t version = 0;                   // of its last change
    std::uint64_t updated = 0;                   // global step of its last update
    mutable std::atomic<std::uint64_t> used{0};  // global step of its last pull or push
  };
  static_assert(sizeof(RowMeta) % alignof(float) == 0 && alignof(RowMeta) <= __STDCPP_DEFAULT_NEW_ALIGNMENT__);
  // What a Snapshot keeps of one stripe until it has read it: the rows of
  // the snapshot changed or removed before it read them, copied just
  // before (`table_row_bytes` each, as the checkpoint holds them), and the
  // last use of rows a pull touched meanwhile (the LRU clock, under a cap).
  // `taken`: a bit per record slot, set when the snapshot read the row
  // there (a row read needs no copy). The stripe's lock for writing
  // guards all of it (the snapshot's reader takes it so); pulls, which
  // hold it for reading only, take `mu` for `used_before` and `taken`.
  struct StripeSnapshot {
    std::vector<std::vector<std::byte>> before;  // in parts of up to 1 MiB: none is ever moved as it grows
    std::vector<std::uint64_t> taken;
    std::mutex mu;
    std::unordered_map<std::uint64_t, std::uint64_t> used_before;

    bool was_taken(std::uint32_t slot) const noexcept {
      const std::size_t word = slot >> 6;
      return word < taken.size() && ((taken[word] >> (slot & 63)) & 1) != 0;
    }
  };
  struct Stripe {
    mutable std::shared_mutex mu;
    std::vector<Entry> index;  // a power of two, at most 3/4 full
    std::size_t count = 0;
    std::vector<std::unique_ptr<std::byte[]>> chunks;  // chunk_rows_ records each
    std::vector<std::uint32_t> free;
    std::uint64_t bytes = 0;  // index and chunks: what the stripe's budget bounds
    std::unordered_map<std::uint64_t, std::uint64_t> removed;  // id -> version of its removal
    std::uint64_t removed_floor = 0;  // removals up to this version are forgotten
    std::uint64_t erasures = 0;       // rows erased so far (a record freed may be taken by another id)
    // Index entries and chunks whose memory `bytes` counts, allocated or
    // not: a restored stripe counts what it held when it was saved (so it
    // grows and evicts from then on as the saved one would) and allocates
    // it as rows come (Restorer).
    std::size_t reserved_index = 0;
    std::size_t reserved_chunks = 0;
    // While a Snapshot has not yet read this stripe: what it needs of the
    // rows that change before it does (null otherwise).
    std::unique_ptr<StripeSnapshot> snap;
  };

  // One stored id's update (under its stripe's lock), admitting it first when it is not stored.
  // `slot`: where the id is stored (empty_slot: it is not).
  // The row goes to `changed`, for its version, before the optimizer runs:
  // an optimizer that throws (one refusing a non-finite gradient, say) may
  // have changed the row halfway, and an admitted row is stored either way;
  // a row changed without a new version would be missing from every later
  // delta.
  void apply_row(const O& optimizer, Stripe& st, std::uint64_t id, std::uint64_t h, std::uint32_t slot, const float* g,
                 std::vector<float*>& bases, std::vector<RowMeta*>& changed, const UpdateContext& ctx) {
    const std::uint64_t step = ctx.global_step;
    if (slot == empty_slot) {
      if (!admit(id, step)) {
        refused_.fetch_add(1, std::memory_order_relaxed);
        return;
      }
      slot = insert(st, id, h);
      changed.push_back(&meta(st, slot));  // reserved by the caller: does not throw
      float* w = record(st, slot);
      init_.fill_row(name_, id, std::span<float>(w, dim_));
      for (std::size_t s = 0; s < slots_; ++s) std::fill_n(w + (1 + s) * dim_, dim_, slot_init_[s]);
      RowMeta& m = meta(st, slot);
      m.updated = step;
      m.used.store(step, std::memory_order_relaxed);
      if (!st.removed.empty() && st.removed.erase(id)) sub_removal(1);
      admitted_.fetch_add(1, std::memory_order_relaxed);
    } else {
      if (st.snap) [[unlikely]]
        keep_before(st, id, slot);  // may throw: nothing changed yet
      changed.push_back(&meta(st, slot));  // reserved by the caller: does not throw
    }
    RowMeta& m = meta(st, slot);
    float* w = record(st, slot);
    for (std::size_t s = 0; s < slots_; ++s) bases[s] = w + (1 + s) * dim_;
    optimizer.update(std::span<float>(w, dim_), std::span<const float>(g, dim_), SlotView(bases.data(), slots_, 0, dim_),
                     ctx);
    m.updated = std::max(m.updated, step);
    // The stripe is locked for writing: no pull's touch races this one.
    if (m.used.load(std::memory_order_relaxed) < step) m.used.store(step, std::memory_order_relaxed);
  }

  // The ids of one call grouped by stripe (a counting sort), so that each
  // stripe is locked once per call: ids `order[start[s]..start[s+1])` are
  // stripe s's, with their hashes.
  struct Batch {
    std::vector<std::uint64_t> hash;
    std::vector<std::uint32_t> order;
    std::vector<std::uint32_t> start;
    std::vector<std::uint32_t> next;  // group's cursor per stripe
  };

  // A thread's working memory of type T (pull's and apply's Scratch,
  // push's sum), kept from call to call (a fresh allocation per call cost
  // up to a fifth of a push of wide rows: page faults on buffers beyond
  // malloc's mmap threshold), up to calls whose working memory is within
  // kKeepBytes (16 MiB: a push of 1000 rows of 4096 floats): a larger
  // call's memory goes when it returns, or throws, so what a thread keeps
  // is bounded whatever the calls' ids and widths (twice that at most, with
  // the vectors' slack; it is outside every table's memory cap). One T
  // per thread and optimizer type, shared by that type's tables: no call
  // takes the same T twice (push's sum and apply's Scratch differ), and
  // nothing they run (the optimizer's update, the initializer) calls a
  // table.
  static constexpr std::size_t kKeepBytes = std::size_t{16} << 20;
  // Scratch bytes per id: hash, order, slot, unseen or changed entry.
  static constexpr std::size_t kScratchBytesPerId = 2 * sizeof(std::uint64_t) + 3 * sizeof(std::uint32_t);
  struct Scratch {
    Batch batch;
    std::vector<std::uint32_t> slots, unseen;
    std::vector<RowMeta*> changed;
    std::vector<float*> bases;
  };
  template <class T>
  class ScratchLease {
   public:
    explicit ScratchLease(std::size_t bytes) : bytes_(bytes) {}
    ScratchLease(const ScratchLease&) = delete;
    ScratchLease& operator=(const ScratchLease&) = delete;
    ~ScratchLease() {
      if (bytes_ > kKeepBytes) get() = T{};
    }
    T& get() const noexcept {
      thread_local T scratch;
      return scratch;
    }

   private:
    std::size_t bytes_;
  };

  const Batch& group(std::span<const std::uint64_t> ids, Batch& b) const {
    const std::size_t n = ids.size();
    b.hash.resize(n);
    b.order.resize(n);
    b.start.assign(std::size_t{options_.stripes} + 1, 0);
    for (std::size_t j = 0; j < n; ++j) {
      b.hash[j] = hash(ids[j]);
      ++b.start[stripe_of(b.hash[j]) + 1];
    }
    for (std::uint32_t s = 0; s < options_.stripes; ++s) b.start[s + 1] += b.start[s];
    b.next.assign(b.start.begin(), b.start.end() - 1);
    for (std::size_t j = 0; j < n; ++j) b.order[b.next[stripe_of(b.hash[j])]++] = static_cast<std::uint32_t>(j);
    return b;
  }

  // Locks the stripes of the next kWindow ids of `batch` (or more: whole
  // stripes), in ascending order, and calls body(first, last) on positions
  // [first, last) of `batch.order`; then lets them go.
  template <class Lock, class Body>
  void for_each_window(const Batch& batch, Body&& body) const {
    std::vector<Lock> locks;
    for (std::uint32_t s0 = 0; s0 < options_.stripes;) {
      std::uint32_t s1 = s0;
      while (s1 < options_.stripes && batch.start[s1] - batch.start[s0] < kWindow) ++s1;
      for (std::uint32_t s = s0; s < s1; ++s)
        if (batch.start[s] != batch.start[s + 1]) locks.emplace_back(stripes_[s].mu);
      if (batch.start[s0] != batch.start[s1]) body(batch.start[s0], batch.start[s1]);
      locks.clear();
      s0 = s1;
    }
  }

  // Random lookups are bound by memory latency: asks for every index entry
  // of a window at once, then finds each id (`slots[k]`, empty_slot when not
  // stored) and asks for the record lines a pull or an update reads, so
  // that the misses overlap instead of following one another (the caller
  // holds the window's locks). `whole`: the slots too, not only the row.
  void find_window(std::span<const std::uint64_t> ids, const Batch& batch, std::uint32_t first, std::uint32_t last,
                   std::vector<std::uint32_t>& slots, bool whole) const noexcept {
    for (std::uint32_t k = first; k < last; ++k) {
      const std::uint64_t h = batch.hash[batch.order[k]];
      const Stripe& st = stripe(h);
      __builtin_prefetch(&st.index[h & (st.index.size() - 1)]);
    }
    // A wide row's later lines come by the hardware's own (sequential) prefetch.
    const std::size_t bytes = std::min<std::size_t>(whole ? stride_ : sizeof(RowMeta) + dim_ * sizeof(float), 1024);
    for (std::uint32_t k = first; k < last; ++k) {
      const std::uint32_t j = batch.order[k];
      const Stripe& st = stripe(batch.hash[j]);
      slots[k] = find(st, ids[j], batch.hash[j]);
      if (slots[k] == empty_slot) continue;
      const std::size_t skip = whole ? 0 : sizeof(RowMeta);
      detail::prefetch_bytes(record_bytes(st, slots[k]) + skip, bytes - skip);
    }
  }

  // A row's copy, inlined (a libc memcpy call per short row costs more than the copy).
  void copy_row(float* __restrict dst, const float* __restrict src) const noexcept {
    std::size_t i = 0;
    for (; i + 16 <= dim_; i += 16) std::memcpy(dst + i, src + i, 16 * sizeof(float));
    for (; i + 4 <= dim_; i += 4) std::memcpy(dst + i, src + i, 4 * sizeof(float));
    for (; i < dim_; ++i) dst[i] = src[i];
  }

  static std::uint64_t hash(std::uint64_t id) noexcept { return detail::mix64(id ^ 0x9e6c63d0676a9a99ull); }
  std::size_t stripe_of(std::uint64_t h) const noexcept { return stripe_shift_ == 64 ? 0 : h >> stripe_shift_; }
  Stripe& stripe(std::uint64_t h) const noexcept { return stripes_[stripe_of(h)]; }

  // A snapshot ends: its stripes not read yet stop copying.
  void end_snapshot() noexcept {
    for (std::uint32_t k = 0; k < options_.stripes; ++k) {
      Stripe& st = stripes_[k];
      std::unique_ptr<StripeSnapshot> left;
      std::unique_lock lock(st.mu);
      left = std::move(st.snap);
    }
    snapshot_open_.store(false, std::memory_order_release);
  }

  // Before a row of the snapshot being read changes or goes (under the
  // stripe's lock for writing): unless the snapshot has it already (read,
  // or copied before), a copy of it as the snapshot saw it. Throws
  // bad_alloc, having changed nothing.
  void keep_before(Stripe& st, std::uint64_t id, std::uint32_t slot) {
    StripeSnapshot& sn = *st.snap;
    const RowMeta& m = meta(st, slot);
    if (m.version > snap_version_ || sn.was_taken(slot)) return;  // a row after the snapshot, or one it has
    const auto seen = sn.used_before.find(id);
    const std::uint64_t head[3] = {id, m.updated,
                                   seen != sn.used_before.end() ? seen->second : m.used.load(std::memory_order_relaxed)};
    const std::size_t row = detail::table_row_bytes(dim_, slots_);
    if (sn.before.empty() || sn.before.back().size() + row > sn.before.back().capacity())
      sn.before.emplace_back().reserve(std::max<std::size_t>(1, (std::size_t{1} << 20) / row) * row);
    std::vector<std::byte>& part = sn.before.back();
    const std::size_t at = part.size();
    part.resize(at + row);
    std::memcpy(part.data() + at, head, sizeof head);
    std::memcpy(part.data() + at + sizeof head, record(st, slot), record_floats_ * sizeof(float));
    if ((slot >> 6) >= sn.taken.size()) sn.taken.resize((slot >> 6) + 1);  // (rows at the snapshot are below)
    sn.taken[slot >> 6] |= std::uint64_t{1} << (slot & 63);
    snap_copied_.fetch_add(row, std::memory_order_relaxed);
  }

  // A pull's touch of a row while a snapshot has not read its stripe (under
  // the stripe's lock for reading): the row's last use as the snapshot saw
  // it is kept first, once.
  void touch_kept(const Stripe& st, std::uint64_t id, std::uint32_t slot, std::uint64_t step) const {
    RowMeta& m = meta(st, slot);
    if (m.version > snap_version_ || m.used.load(std::memory_order_relaxed) >= step) return touch(m.used, step);
    StripeSnapshot& sn = *st.snap;
    std::lock_guard lock(sn.mu);
    if (!sn.was_taken(slot)) sn.used_before.try_emplace(id, m.used.load(std::memory_order_relaxed));
    touch(m.used, step);
  }

  // Raises the LRU clock to `step`, never lowers it (pulls of several
  // threads at other steps race here).
  static void touch(std::atomic<std::uint64_t>& used, std::uint64_t step) noexcept {
    std::uint64_t seen = used.load(std::memory_order_relaxed);
    while (seen < step && !used.compare_exchange_weak(seen, step, std::memory_order_relaxed)) {
    }
  }

  // A record: the row's RowMeta, then its parameters and slots, so one
  // cache line holds the bookkeeping and the row's first floats.
  std::byte* record_bytes(const Stripe& st, std::uint32_t slot) const noexcept {
    return st.chunks[slot >> chunk_shift_].get() + std::size_t{slot & (chunk_rows_ - 1)} * stride_;
  }
  float* record(const Stripe& st, std::uint32_t slot) const noexcept {
    return reinterpret_cast<float*>(record_bytes(st, slot) + sizeof(RowMeta));
  }
  RowMeta& meta(const Stripe& st, std::uint32_t slot) const noexcept {
    return *std::launder(reinterpret_cast<RowMeta*>(record_bytes(st, slot)));
  }

  static std::uint32_t find(const Stripe& st, std::uint64_t id, std::uint64_t h) noexcept {
    const std::size_t mask = st.index.size() - 1;
    for (std::size_t i = h & mask;; i = (i + 1) & mask) {
      const Entry& e = st.index[i];
      if (e.slot == empty_slot) return empty_slot;
      if (e.key == id) return e.slot;
    }
  }

  std::uint64_t next_version() noexcept { return version_.fetch_add(1, std::memory_order_acq_rel) + 1; }

  bool admit(std::uint64_t id, std::uint64_t step) noexcept {
    const Admission& a = options_.admission;
    switch (a.kind) {
      case Admission::Kind::always: return true;
      case Admission::Kind::after_pushes: return sketch_->add(id) >= a.pushes;
      case Admission::Kind::probability:
        return detail::uniform01(detail::mix64(a.seed ^ id), step) < a.probability;
    }
    return true;
  }

  void add_bytes(Stripe& st, std::uint64_t n) noexcept {
    st.bytes += n;
    bytes_.fetch_add(n, std::memory_order_relaxed);
  }
  bool fits(const Stripe& st, std::uint64_t more) const noexcept {
    return stripe_budget_ == 0 || st.bytes + more <= stripe_budget_;
  }

  // A free record slot and an index entry for `id` (not stored), evicting
  // the stripe's least recently used rows where the cap allows no growth.
  std::uint32_t insert(Stripe& st, std::uint64_t id, std::uint64_t h) {
    if ((st.count + 1) * 4 > st.index.size() * 3) {
      const std::uint64_t more = st.index.size() * sizeof(Entry);
      if (st.index.size() < st.reserved_index) {
        grow_index(st);  // counted already
      } else if (fits(st, more)) {
        grow_index(st);
        add_bytes(st, more);
      } else {
        evict_lru(st);
      }
    }
    if (st.free.empty()) {
      if (st.chunks.size() < st.reserved_chunks) {
        add_chunk(st);  // counted already
      } else if (fits(st, chunk_bytes_)) {
        add_chunk(st);
        add_bytes(st, chunk_bytes_);
      } else {
        evict_lru(st);
      }
    }
    const std::uint32_t slot = take_slot(st, id, h);
    meta(st, slot).version = changing;  // its version comes at the end of the caller's window
    rows_.fetch_add(1, std::memory_order_relaxed);
    return slot;
  }

  // A free record slot of `st` (there is one) and an index entry for `id`
  // (not stored; the index has room).
  static std::uint32_t take_slot(Stripe& st, std::uint64_t id, std::uint64_t h) noexcept {
    const std::uint32_t slot = st.free.back();
    st.free.pop_back();
    const std::size_t mask = st.index.size() - 1;
    std::size_t i = h & mask;
    while (st.index[i].slot != empty_slot) i = (i + 1) & mask;
    st.index[i] = Entry{id, slot};
    ++st.count;
    return slot;
  }

  // Doubles the index (the caller counts its memory).
  static void grow_index(Stripe& st) {
    std::vector<Entry> bigger(st.index.size() * 2);
    const std::size_t mask = bigger.size() - 1;
    for (const Entry& e : st.index) {
      if (e.slot == empty_slot) continue;
      std::size_t i = hash(e.key) & mask;
      while (bigger[i].slot != empty_slot) i = (i + 1) & mask;
      bigger[i] = e;
    }
    st.index.swap(bigger);
  }

  // One more chunk of free records (the caller counts its memory).
  void add_chunk(Stripe& st) const {
    const auto first = static_cast<std::uint64_t>(st.chunks.size()) * chunk_rows_;
    if (first + chunk_rows_ > empty_slot)
      throw std::length_error("psx: dynamic table '" + name_ + "': more than 2^32 - 1 rows in one stripe");
    st.free.reserve(st.free.size() + chunk_rows_);  // nothing below throws once the chunk is kept
    st.chunks.push_back(std::make_unique<std::byte[]>(std::size_t{chunk_rows_} * stride_));
    for (std::uint32_t k = 0; k < chunk_rows_; ++k)
      new (st.chunks.back().get() + std::size_t{k} * stride_) RowMeta{};
    for (std::uint32_t k = chunk_rows_; k-- > 0;) st.free.push_back(static_cast<std::uint32_t>(first + k));
  }

  // Removes a sixteenth of the stripe's rows (at least one), least recently
  // used first (ties: smaller id first).
  void evict_lru(Stripe& st) {
    std::vector<std::pair<std::uint64_t, std::uint64_t>> by_use;  // (used, id)
    by_use.reserve(st.count);
    for (const Entry& e : st.index)
      if (e.slot != empty_slot) by_use.emplace_back(meta(st, e.slot).used.load(std::memory_order_relaxed), e.key);
    const std::size_t n = std::min(by_use.size(), std::max<std::size_t>(1, by_use.size() / 16));
    std::nth_element(by_use.begin(), by_use.begin() + static_cast<std::ptrdiff_t>(n - 1), by_use.end());
    for (std::size_t k = 0; k < n; ++k) {
      erase(st, by_use[k].second);  // a bad_alloc here leaves the rows erased so far counted
      evicted_memory_.fetch_add(1, std::memory_order_relaxed);
    }
  }

  // Removes stored `id`: backward-shift deletion keeps every probe chain
  // unbroken without tombstones; the removal is versioned and remembered.
  // Its free slot and log entry are made first: a bad_alloc then leaves the
  // row stored and the log as it was (a removal made but not logged was
  // missing from every later delta).
  void erase(Stripe& st, std::uint64_t id) {
    const std::size_t mask = st.index.size() - 1;
    std::size_t i = hash(id) & mask;
    while (st.index[i].key != id || st.index[i].slot == empty_slot) i = (i + 1) & mask;
    const std::uint32_t slot = st.index[i].slot;
    if (st.snap) [[unlikely]]
      keep_before(st, id, slot);  // may throw: nothing changed yet
    st.free.push_back(slot);  // may throw: nothing changed yet
    std::unordered_map<std::uint64_t, std::uint64_t>::iterator logged;
    bool fresh = false;
    if (options_.removal_log_limit != 0) {
      try {
        std::tie(logged, fresh) = st.removed.try_emplace(id, 0);
      } catch (...) {
        st.free.pop_back();
        throw;
      }
    }
    for (std::size_t j = (i + 1) & mask; st.index[j].slot != empty_slot; j = (j + 1) & mask) {
      const std::size_t home = hash(st.index[j].key) & mask;
      // Entry j may move back to i when its home is not in (i, j] (cyclically).
      const bool stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
      if (stays) continue;
      st.index[i] = st.index[j];
      i = j;
    }
    st.index[i] = Entry{};
    meta(st, slot).version = changing;  // free: a snapshot's reader passes over it
    --st.count;
    ++st.erasures;
    rows_.fetch_sub(1, std::memory_order_relaxed);
    const std::uint64_t v = next_version();
    if (options_.removal_log_limit == 0) {  // nothing remembered: no delta from before this removal
      st.removed_floor = v;
      return;
    }
    logged->second = v;
    if (fresh) add_removal(1);
    if (st.removed.size() > removal_limit_) {
      try {
        forget_removals(st);
      } catch (...) {  // no memory to sort the log: it stays longer than its limit until the next removal
      }
    }
  }

  // Forgets the older half of a stripe's removal log.
  void forget_removals(Stripe& st) {
    std::vector<std::uint64_t> versions;
    versions.reserve(st.removed.size());
    for (const auto& [id, v] : st.removed) versions.push_back(v);
    // The oldest half (versions are distinct): the size / 2 smallest.
    const auto mid = versions.begin() + static_cast<std::ptrdiff_t>(versions.size() / 2);
    std::nth_element(versions.begin(), mid, versions.end());
    const std::uint64_t floor = *std::max_element(versions.begin(), mid);
    const std::size_t before = st.removed.size();
    std::erase_if(st.removed, [&](const auto& kv) { return kv.second <= floor; });
    st.removed_floor = std::max(st.removed_floor, floor);
    sub_removal(before - st.removed.size());
  }

  void add_removal(std::uint64_t n) noexcept { removals_.fetch_add(n, std::memory_order_relaxed); }
  void sub_removal(std::uint64_t n) noexcept { removals_.fetch_sub(n, std::memory_order_relaxed); }

  void sweep_if_due(std::uint64_t step) {
    if (options_.ttl_steps == 0) return;
    std::uint64_t due = next_sweep_.load(std::memory_order_relaxed);
    const std::uint64_t next = step > std::numeric_limits<std::uint64_t>::max() - sweep_every_
                                   ? std::numeric_limits<std::uint64_t>::max()
                                   : step + sweep_every_;
    if (step < due || !next_sweep_.compare_exchange_strong(due, next, std::memory_order_relaxed)) return;
    // The push is applied by now: a sweep that runs out of memory keeps the
    // evictions made so far and is due again at the next push, and the push
    // does not look failed (one retried would apply its gradients twice).
    try {
      expire(step);
    } catch (const std::bad_alloc&) {
      std::uint64_t mine = next;
      next_sweep_.compare_exchange_strong(mine, due, std::memory_order_relaxed);
    }
  }

  // Updated at step `updated`, not since: more than ttl_steps before `now`.
  bool expired(std::uint64_t updated, std::uint64_t now) const noexcept {
    return now > updated && now - updated > options_.ttl_steps;
  }

  std::string name_;
  std::size_t dim_;
  std::size_t slots_;
  std::size_t record_floats_;
  Initializer init_;
  TableOptions options_;
  std::vector<float> slot_init_;
  std::unique_ptr<detail::PushSketch> sketch_;  // after_pushes only
  std::unique_ptr<Stripe[]> stripes_;
  int stripe_shift_;
  std::size_t stride_ = 0;  // bytes per record
  std::uint32_t chunk_rows_ = 1;  // records per chunk, a power of two
  int chunk_shift_ = 0;
  std::uint64_t chunk_bytes_ = 0;
  std::uint64_t stripe_budget_ = 0;  // 0: no cap
  std::uint64_t removal_limit_ = 1;  // per stripe
  std::uint64_t sweep_every_ = 1;
  std::atomic<std::uint64_t> next_sweep_{0};
  std::atomic<std::uint64_t> version_{0};
  std::atomic<std::uint64_t> incarnation_{0};  // replaced by a restore (adopt), read by exports meanwhile
  // The open Snapshot's version (set with every stripe locked, read under a stripe's lock).
  std::uint64_t snap_version_ = 0;
  std::atomic<bool> snapshot_open_{false};
  std::atomic<std::uint64_t> snap_copied_{0};
  std::atomic<std::uint64_t> rows_{0}, bytes_{0}, admitted_{0}, refused_{0}, evicted_ttl_{0}, evicted_memory_{0},
      removals_{0};
};

}  // namespace v0
}  // namespace psx

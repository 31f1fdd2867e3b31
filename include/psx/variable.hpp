//! @file psx/variable.hpp
//! Variables: what a user declares (VariableSpec), how its initial values are
//! drawn (Initializer), and what the cluster knows of it once placed
//! (VariableMeta, Shard, VariableInfo).
#pragma once

#include <psx/detail/hash.hpp>
#include <psx/detail/ring.hpp>
#include <psx/detail/span.hpp>
#include <psx/errors.hpp>
#include <psx/half.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numbers>
#include <ostream>
#include <span>
#include <string>
#include <vector>

namespace psx {
inline namespace v0 {

//! Dense variables are pulled and pushed whole; sparse ones (embedding
//! tables of a fixed row count) by row id as well; dynamic ones (embedding
//! tables keyed by any 64-bit feature id, psx/embedding.hpp) by id only.
enum class VariableKind : std::uint8_t { dense, sparse, dynamic };

inline std::ostream& operator<<(std::ostream& os, VariableKind k) {
  return os << (k == VariableKind::dense ? "dense" : k == VariableKind::sparse ? "sparse" : "dynamic");
}

//! How a variable's initial values are drawn.
//!
//! The value of element `i` (row-major flat index) depends only on the seed,
//! the variable's name and `i`: a counter-based generator, so the initial
//! values do not depend on how the variable is partitioned or on which
//! server draws them.
struct Initializer {
  //! The distribution.
  enum class Kind : std::uint8_t { zeros, constant, uniform, normal, truncated_normal };

  Kind kind = Kind::zeros;
  //! constant: the value; uniform: low; normal, truncated normal: mean.
  float a = 0.0f;
  //! uniform: high; normal, truncated normal: standard deviation.
  float b = 0.0f;
  //! Combined with the variable's name, so two variables with the same seed differ.
  std::uint64_t seed = 0;

  //! All zeros.
  static constexpr Initializer zeros() noexcept { return {}; }
  //! Every element `value`.
  static constexpr Initializer constant(float value) noexcept {
    return {Kind::constant, value, 0.0f, 0};
  }
  //! Uniform in `[low, high)`.
  static constexpr Initializer uniform(float low, float high, std::uint64_t seed = 0) noexcept {
    return {Kind::uniform, low, high, seed};
  }
  //! Normal with the given mean and standard deviation.
  static constexpr Initializer normal(float mean, float stddev, std::uint64_t seed = 0) noexcept {
    return {Kind::normal, mean, stddev, seed};
  }
  //! Normal, with draws more than two standard deviations from the mean
  //! redrawn (TensorFlow's `truncated_normal`).
  static constexpr Initializer truncated_normal(float mean, float stddev,
                                                std::uint64_t seed = 0) noexcept {
    return {Kind::truncated_normal, mean, stddev, seed};
  }

  //! The value of flat element `index` of the variable named `name`.
  float value(std::string_view name, std::uint64_t index) const noexcept {
    return value_at(stream_key(name), index);
  }

  //! Fills `out` with flat elements `first, first + 1, ...` of variable `name`.
  void fill(std::string_view name, std::uint64_t first, std::span<float> out) const noexcept {
    // One value for all: a fill the compiler vectorizes (drawing each of a
    // 512 MiB variable's zeros on its own took 11% of the CPU time of its
    // push and pull round trip).
    if (kind == Kind::zeros || kind == Kind::constant) {
      std::fill(out.begin(), out.end(), kind == Kind::zeros ? 0.0f : a);
      return;
    }
    const std::uint64_t key = stream_key(name);
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = value_at(key, first + i);
  }

  //! Fills `out` with the initial row of feature id `id` of the dynamic
  //! table `name` (psx/embedding.hpp): element `i` is drawn from a stream
  //! keyed by the name, the seed and the id, so any 64-bit id has its own
  //! values and no two ids share a stream. Uniform rows take two 24-bit
  //! draws (a float's precision) from each word of the stream (SplitMix64:
  //! word `w` is mix64(key + (w + 1) * golden)): a table pulls an unseen
  //! id's row on every pull, so this is on the hot path.
  void fill_row(std::string_view name, std::uint64_t id, std::span<float> out) const noexcept {
    const std::uint64_t key = detail::mix64(stream_key(name) ^ detail::mix64(id ^ 0x6a09e667f3bcc908ull));
    if (kind != Kind::uniform) {
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = value_at(key, i);
      return;
    }
    const double low = a, width = static_cast<double>(b) - a;
    const float below_high = a < b ? std::nextafter(b, a) : std::numeric_limits<float>::infinity();
    auto at = [&](std::uint64_t bits24) {
      // The top draws of [low, high) may round to `high` as a float: keep them below it.
      return std::min(static_cast<float>(low + width * (static_cast<double>(bits24) * 0x1.0p-24)), below_high);
    };
    const std::size_t n = out.size();
    std::size_t i = 0;
    for (std::uint64_t w = 1; i + 2 <= n; i += 2, ++w) {
      const std::uint64_t bits = detail::mix64(key + w * 0x9e3779b97f4a7c15ull);
      out[i] = at(bits >> 40);
      out[i + 1] = at((bits >> 16) & 0xffffff);
    }
    if (i < n) out[i] = at(detail::mix64(key + (i / 2 + 1) * 0x9e3779b97f4a7c15ull) >> 40);
  }

  friend bool operator==(const Initializer&, const Initializer&) = default;

 private:
  std::uint64_t stream_key(std::string_view name) const noexcept {
    return detail::mix64(seed ^ detail::fnv1a64(name));
  }

  // A standard normal from draw number `k` of element `index` (Box-Muller).
  static double standard_normal(std::uint64_t key, std::uint64_t index, std::uint64_t k) noexcept {
    const std::uint64_t counter = detail::mix64(index) + 2 * k;
    const double u1 = 1.0 - detail::uniform01(key, counter);  // (0, 1]: log is finite
    const double u2 = detail::uniform01(key, counter + 1);
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
  }

  float value_at(std::uint64_t key, std::uint64_t index) const noexcept {
    switch (kind) {
      case Kind::zeros: return 0.0f;
      case Kind::constant: return a;
      case Kind::uniform: {
        // The top draws of [low, high) may round to `high` as a float: keep them below it.
        const auto v = static_cast<float>(a + (static_cast<double>(b) - a) * detail::uniform01(key, index));
        return a < b ? std::min(v, std::nextafter(b, a)) : v;
      }
      case Kind::normal: return static_cast<float>(a + b * standard_normal(key, index, 0));
      case Kind::truncated_normal: {
        // P(|z| > 2) = 4.6%: 64 redraws all failing has probability 1e-85.
        double z = standard_normal(key, index, 0);
        for (std::uint64_t k = 1; std::abs(z) > 2.0 && k < 64; ++k) z = standard_normal(key, index, k);
        return static_cast<float>(a + b * std::clamp(z, -2.0, 2.0));
      }
    }
    return 0.0f;
  }
};

//! When a dynamic table stores a feature id it has not stored yet: until
//! then a pull of the id returns its initial value and a push of it changes
//! nothing (psx/embedding.hpp).
struct Admission {
  enum class Kind : std::uint8_t {
    always,        //!< at its first push
    after_pushes,  //!< once pushed `pushes` times (counted in a count-min sketch)
    probability,   //!< at each push with probability `probability`
  };
  Kind kind = Kind::always;
  //! after_pushes: the pushes an id needs (1..255).
  std::uint32_t pushes = 1;
  //! probability: the chance per push, in (0, 1].
  double probability = 1.0;
  //! probability: the coin of id `x` at global step `t` depends on (seed, x, t) only.
  std::uint64_t seed = 0;
  //! after_pushes: counters per row of the sketch (a power of two) and rows;
  //! an id is counted too high with probability about `e^-depth` once more
  //! than `width / e` ids were pushed (Cormode & Muthukrishnan 2005).
  std::uint32_t sketch_width = 1u << 20;
  std::uint32_t sketch_depth = 4;
  //! after_pushes: pushes counted between two halvings of every counter
  //! (TinyLFU's reset, Einziger et al. 2017), so that the sketch counts
  //! recent pushes and does not fill up over an endless stream; 0: never.
  std::uint64_t sketch_window = 0;

  static constexpr Admission always() noexcept { return {}; }
  static constexpr Admission after_pushes(std::uint32_t n, std::uint32_t width = 1u << 20, std::uint32_t depth = 4,
                                          std::uint64_t window = 0) noexcept {
    return {Kind::after_pushes, n, 1.0, 0, width, depth, window};
  }
  static constexpr Admission with_probability(double p, std::uint64_t seed = 0) noexcept {
    return {Kind::probability, 1, p, seed, 1u << 20, 4, 0};
  }
  friend bool operator==(const Admission&, const Admission&) = default;
};

//! How a dynamic table (`psx::embedding`) admits, evicts and is placed.
struct TableOptions {
  Admission admission = Admission::always();
  //! Evict a row not updated for more than `ttl_steps` global steps (0: never).
  std::uint64_t ttl_steps = 0;
  //! How often the time-to-live sweep runs, in global steps (0: every
  //! `max(1, ttl_steps / 16)` steps): a row outlives its ttl by less than this.
  std::uint64_t ttl_sweep_steps = 0;
  //! Bytes each server may hold for this table: rows, slots, index and
  //! sketch (0: no cap). A server at its cap evicts its least recently used
  //! rows (pulled or pushed) to store new ones. Outside it: the removal log
  //! (`removal_log_limit`, about 48 bytes a removal) and the calling
  //! threads' working memory (docs/embedding.md, "Resident memory").
  std::uint64_t memory_cap_bytes = 0;
  //! Points per server on the consistent-hash ring that places ids (1024:
  //! adding a server moves within 6% of 1/(n+1) of the ids for n <= 32).
  std::uint32_t virtual_nodes = 1024;
  //! Independently locked parts of each server's table (a power of two).
  std::uint32_t stripes = 64;
  //! Removals remembered for delta exports, per server (split over the
  //! stripes, at least one each); beyond it a stripe forgets its oldest
  //! half, and a delta from before them is refused (0: none remembered).
  //! Outside `memory_cap_bytes`: 1M removals hold up to 48 MiB per server.
  std::uint64_t removal_log_limit = 1u << 20;

  friend bool operator==(const TableOptions&, const TableOptions&) = default;
};

//! The longest variable name, in bytes: what checkpoints and exports store
//! (a longer one was saved, and the checkpoint then never restored).
inline constexpr std::size_t max_variable_name_bytes = std::size_t{1} << 16;

//! What a user declares.
struct VariableSpec {
  //! Unique name, 1 to `max_variable_name_bytes` bytes; the partitioners and the initializer hash it.
  std::string name;
  //! Extents, row-major. The first extent is the row count (what sparse
  //! access and row partitioning index); the rest multiply into the row
  //! width. An empty shape is a scalar (one row of one element).
  std::vector<std::size_t> shape;
  VariableKind kind = VariableKind::dense;
  Initializer init = Initializer::zeros();
  //! A frozen variable (`false`) is served but never updated; pushing to it throws.
  bool trainable = true;
  //! Storage on the server: float32, or bfloat16/float16 with a float32
  //! master copy (mixed precision, see psx/half.hpp).
  DType dtype = DType::float32;
  //! A free-form group a sync policy may route on (see `sync::Hybrid`).
  std::string sync_group = {};
  //! Dynamic tables only: admission, eviction, placement.
  TableOptions table = {};
};

//! A dense variable.
inline VariableSpec dense(std::string name, std::vector<std::size_t> shape,
                          Initializer init = Initializer::zeros(), bool trainable = true) {
  return {std::move(name), std::move(shape), VariableKind::dense, init, trainable, DType::float32, {}};
}

//! A sparse variable (embedding table) of `rows` rows of `dim` floats.
inline VariableSpec sparse(std::string name, std::size_t rows, std::size_t dim,
                           Initializer init = Initializer::zeros(), bool trainable = true) {
  return {std::move(name), {rows, dim}, VariableKind::sparse, init, trainable, DType::float32, {}};
}

//! A dynamic embedding table: rows of `dim` floats keyed by any 64-bit
//! feature id, stored when admitted, evicted by age or memory (see
//! psx/embedding.hpp). Shape `[dim]`; float32.
inline VariableSpec embedding(std::string name, std::size_t dim, Initializer init = Initializer::zeros(),
                              TableOptions options = {}) {
  return {std::move(name), {dim}, VariableKind::dynamic, init, true, DType::float32, {}, options};
}

//! What a partitioner sees of a variable.
struct VariableMeta {
  std::string name;
  std::vector<std::size_t> shape;
  VariableKind kind = VariableKind::dense;
  //! From `VariableSpec::sync_group`.
  std::string sync_group;
  //! Declaration order, 0-based.
  std::uint32_t id = 0;
  std::size_t rows = 0;
  //! Floats per row.
  std::size_t row_width = 0;
  //! From `VariableSpec::dtype`.
  DType dtype = DType::float32;

  //! Elements (rows x row width).
  std::size_t size() const noexcept { return rows * row_width; }
  //! Bytes of its values in its dtype (2 per element for bfloat16 and
  //! float16), as TensorFlow's partitioners by size count them and
  //! partition::MinSize / MaxSize and the placement report do.
  std::size_t bytes() const noexcept { return size() * dtype_size(dtype); }
};

//! A contiguous range of rows of one variable, owned by one server.
struct Shard {
  std::size_t server = 0;
  std::size_t row_begin = 0;
  std::size_t row_end = 0;

  std::size_t rows() const noexcept { return row_end - row_begin; }
  friend bool operator==(const Shard&, const Shard&) = default;
};

//! A declared, placed variable.
struct VariableInfo {
  VariableMeta meta;
  Initializer init;
  bool trainable = true;
  //! Ordered by row, tiling `[0, rows)`. A dynamic table: shard k on
  //! server k, rows [0, 0) (its ids go by `ring`).
  std::vector<Shard> shards;
  //! Dynamic tables: the options and the ring that places ids on servers.
  TableOptions table;
  detail::HashRing ring;

  const std::string& name() const noexcept { return meta.name; }

  //! Index in `shards` of the shard holding `row` (row < rows).
  std::size_t shard_of_row(std::size_t row) const noexcept {
    const std::size_t n = shards.size();
    if (n <= 1) return 0;
    // Shards hold the rows in order. Where a partitioner splits them evenly
    // (RowRange), `row` is in shard row * n / rows or a neighbour: try
    // those first (a row lookup per id of every sparse call), then search.
    const auto holds = [&](std::size_t k) { return shards[k].row_begin <= row && row < shards[k].row_end; };
    const double rows = static_cast<double>(shards.back().row_end);
    const auto guess = std::min(n - 1, static_cast<std::size_t>(static_cast<double>(row) / rows * static_cast<double>(n)));
    if (holds(guess)) return guess;
    if (guess + 1 < n && holds(guess + 1)) return guess + 1;
    if (guess > 0 && holds(guess - 1)) return guess - 1;
    std::size_t lo = 0, hi = n;
    while (hi - lo > 1) {
      const std::size_t mid = (lo + hi) / 2;
      (shards[mid].row_begin <= row ? lo : hi) = mid;
    }
    return lo;
  }
};

namespace detail {

// A dynamic table's meta: no rows (ids are unbounded), `dim` floats a row.
inline VariableMeta make_dynamic_meta(const VariableSpec& spec, std::uint32_t id) {
  const std::string what = "psx: dynamic table '" + spec.name + "'";
  if (spec.shape.size() != 1 || spec.shape[0] == 0 || spec.shape[0] > (1u << 20))
    throw shape_error(what + " needs a shape [dim] with 0 < dim <= 2^20, got " + shape_string(spec.shape));
  if (spec.dtype != DType::float32) throw config_error(what + " is stored as float32 only");
  const TableOptions& o = spec.table;
  const Admission& a = o.admission;
  if (a.kind == Admission::Kind::after_pushes &&
      (a.pushes < 1 || a.pushes > 255 || !std::has_single_bit(a.sketch_width) || a.sketch_depth < 1 ||
       a.sketch_depth > 16 || (a.sketch_window != 0 && a.sketch_window < a.sketch_width)))
    throw config_error(what + ": admission after n pushes needs 1 <= n <= 255, a power-of-two sketch width, "
                              "1 to 16 sketch rows, and a window of 0 (none) or at least the width");
  // A byte per counter, on every server: 4 GiB is far beyond what a
  // count-min sketch of any stream needs (width ~ e / error).
  if (a.kind == Admission::Kind::after_pushes && std::uint64_t{a.sketch_width} * a.sketch_depth > (std::uint64_t{1} << 32))
    throw config_error(what + ": an admission sketch of " + std::to_string(a.sketch_width) + " x " +
                       std::to_string(a.sketch_depth) + " counters is over 4 GiB per server");
  if (a.kind == Admission::Kind::probability && !(a.probability > 0.0 && a.probability <= 1.0))
    throw config_error(what + ": admission probability must be in (0, 1], got " + std::to_string(a.probability));
  if (!std::has_single_bit(o.stripes) || o.stripes > 4096)
    throw config_error(what + ": stripes must be a power of two up to 4096, got " + std::to_string(o.stripes));
  if (o.virtual_nodes < 1 || o.virtual_nodes > 65536)
    throw config_error(what + ": virtual_nodes must be in [1, 65536], got " + std::to_string(o.virtual_nodes));
  VariableMeta m;
  m.name = spec.name;
  m.shape = spec.shape;
  m.kind = VariableKind::dynamic;
  m.sync_group = spec.sync_group;
  m.id = id;
  m.rows = 0;
  m.row_width = spec.shape[0];
  return m;
}

// Checks a spec and derives rows and row width; throws shape_error.
inline VariableMeta make_meta(const VariableSpec& spec, std::uint32_t id) {
  if (spec.name.empty()) throw config_error("psx: a variable needs a non-empty name");
  if (spec.name.size() > max_variable_name_bytes)
    throw config_error("psx: a variable name of " + std::to_string(spec.name.size()) + " bytes (\"" +
                       spec.name.substr(0, 32) + "...\"), over the limit of " +
                       std::to_string(max_variable_name_bytes) + " that checkpoints and exports store");
  if (spec.kind == VariableKind::dynamic) return make_dynamic_meta(spec, id);
  if (spec.kind == VariableKind::sparse && spec.shape.size() != 2)
    throw shape_error("psx: sparse variable '" + spec.name + "' needs a shape [rows, dim], got " +
                      shape_string(spec.shape));
  std::size_t total = 1;
  for (std::size_t extent : spec.shape) {
    if (extent == 0)
      throw shape_error("psx: variable '" + spec.name + "' has a zero extent in shape " +
                        shape_string(spec.shape));
    if (total > std::numeric_limits<std::size_t>::max() / sizeof(float) / extent)
      throw shape_error("psx: variable '" + spec.name + "' of shape " + shape_string(spec.shape) +
                        " is too large to address");
    total *= extent;
  }
  VariableMeta m;
  m.name = spec.name;
  m.shape = spec.shape;
  m.kind = spec.kind;
  m.sync_group = spec.sync_group;
  m.id = id;
  m.rows = spec.shape.empty() ? 1 : spec.shape[0];
  m.row_width = total / m.rows;
  m.dtype = spec.dtype;
  if (m.dtype != DType::float32 && m.dtype != DType::bfloat16 && m.dtype != DType::float16)
    throw config_error("psx: variable '" + spec.name + "' has an unknown dtype " +
                       std::to_string(static_cast<int>(m.dtype)));
  return m;
}

// Checks that a partitioner's answer tiles [0, rows) in order on existing servers.
inline void check_placement(const VariableMeta& m, const std::vector<Shard>& shards,
                            std::size_t num_servers) {
  auto fail = [&](const std::string& why) {
    throw config_error("psx: invalid placement of variable '" + m.name + "' (" +
                       std::to_string(m.rows) + " rows, " + std::to_string(num_servers) +
                       " servers): " + why);
  };
  if (shards.empty()) fail("the partitioner returned no shard");
  std::size_t next = 0;
  for (std::size_t i = 0; i < shards.size(); ++i) {
    const Shard& s = shards[i];
    if (s.server >= num_servers)
      fail("shard " + std::to_string(i) + " names server " + std::to_string(s.server));
    if (s.row_begin != next || s.row_end <= s.row_begin)
      fail("shard " + std::to_string(i) + " covers rows [" + std::to_string(s.row_begin) + ", " +
           std::to_string(s.row_end) + ") but the next row to cover is " + std::to_string(next));
    next = s.row_end;
  }
  if (next != m.rows) fail("the shards end at row " + std::to_string(next));
}

}  // namespace detail
}  // namespace v0
}  // namespace psx

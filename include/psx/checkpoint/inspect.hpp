//! @file psx/checkpoint/inspect.hpp
//! Reading checkpoints without a cluster: the manifest, a whole variable,
//! a full check of every file, and the complete checkpoints under a
//! directory.
#pragma once

#include <psx/checkpoint/files.hpp>
#include <psx/checkpoint/format.hpp>
#include <psx/checkpoint/manifest.hpp>
#include <psx/checkpoint/shards.hpp>
#include <psx/variable.hpp>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <system_error>
#include <vector>

namespace psx {
inline namespace v0 {
namespace checkpoint {

//! Reads and checks the manifest of the checkpoint in `dir` (not its shard
//! files: `verify` does that).
inline Manifest read_manifest(const std::filesystem::path& dir) { return detail::load_manifest(dir); }

//! Checks every file of the checkpoint in `dir`: headers, sizes, CRCs,
//! indexes; throws checkpoint_error naming the first bad file.
inline Manifest verify(const std::filesystem::path& dir) {
  Manifest m = detail::load_manifest(dir);
  for (std::size_t s = 0; s < m.files.size(); ++s) {
    const auto file = dir / m.files[s].name;
    detail::check_shard_file(detail::read_file(file), static_cast<std::uint32_t>(s), m.files[s], m.step, file);
  }
  return m;
}

//! One variable of a checkpoint, whole, read on this machine without a
//! cluster (inspection, export, tests).
struct Variable {
  ManifestVariable meta;
  std::vector<float> values;  //!< the float32 parameters, row-major
  std::vector<float> slots;   //!< optimizer slots, slot-major: slot k at `k * values.size()`
  std::uint64_t num_slots = 0;
  std::uint64_t version = 0;  //!< updates applied (the largest over its shards)
};

//! Reads variable `name` of the checkpoint in `dir`, checking every file it
//! touches; throws checkpoint_error (also when there is no such variable).
inline Variable load_variable(const std::filesystem::path& dir, const std::string& name) {
  const Manifest m = detail::load_manifest(dir);
  const ManifestVariable* mv = detail::find_variable(m, name);
  if (!mv && detail::find_table(m, name))
    detail::fail(dir / detail::manifest_name, "holds '" + name + "' as a dynamic table (checkpoint::load_table reads it)");
  if (!mv) detail::fail(dir / detail::manifest_name, "has no variable '" + name + "'");
  VariableInfo info;
  info.meta.name = mv->name;
  info.meta.shape.assign(mv->shape.begin(), mv->shape.end());
  info.meta.rows = mv->shape.empty() ? 1 : mv->shape[0];
  info.meta.row_width = mv->row_width;
  info.meta.dtype = detail::parse_dtype(mv->dtype, dir / detail::manifest_name);
  info.shards = {Shard{0, 0, info.meta.rows}};
  ::psx::detail::RestoredShard target{&info, 0, m.optimizer_slots, {}, {}, 0};
  detail::read_shards({dir.string(), m.step, 0}, std::span(&target, 1), {});
  return {*mv, {target.params.begin(), target.params.end()}, {target.slots.begin(), target.slots.end()},
          m.optimizer_slots, target.version};
}

//! One saved server's part of a dynamic table, besides its rows.
struct TablePart {
  std::uint64_t server = 0;
  ::psx::detail::TableState state;  //!< counters, sweep, sketch geometry, memory layout
  std::vector<std::uint8_t> sketch;  //!< its admission sketch's counters, row after row
};

//! A dynamic table of a checkpoint, whole, read on this machine without a
//! cluster (inspection, tests): every saved row with its slots and its
//! eviction state, and each saved server's part.
struct Table {
  ManifestTable meta;
  std::uint64_t num_slots = 0;
  std::vector<std::uint64_t> ids;      //!< ascending
  std::vector<float> values;           //!< `meta.dim` floats per id, row k at `k * meta.dim`
  std::vector<float> slots;            //!< slot-major: slot j's rows at `j * values.size()`
  std::vector<std::uint64_t> updated;  //!< the global step of each row's last update (time to live)
  std::vector<std::uint64_t> used;     //!< and of its last pull or push (least recently used, under a cap)
  std::vector<std::uint32_t> server;   //!< the server whose file held it
  std::vector<TablePart> parts;        //!< in server order
};

namespace detail {

// Takes every saved part of a table as it is read (load_table).
class TableCollector final : public ::psx::detail::TableLoader {
 public:
  explicit TableCollector(Table& out) : out_(&out) {}

  void begin_part(std::size_t server, std::size_t, std::uint32_t, const ::psx::detail::TableState& s) override {
    // Its counters are bounded by the data part (decode_index), so by the file.
    out_->parts.push_back({server, s, std::vector<std::uint8_t>(std::uint64_t{s.sketch_width} * s.sketch_depth)});
  }
  void add_rows(std::span<const std::byte> rows) override {
    const TablePart& part = out_->parts.back();
    const std::size_t floats = part.state.dim * (1 + part.state.slots);
    const std::size_t row = ::psx::detail::table_row_bytes(part.state.dim, part.state.slots);
    for (std::size_t at = 0; at + row <= rows.size(); at += row) {
      std::uint64_t head[3];
      std::memcpy(head, rows.data() + at, sizeof head);
      out_->ids.push_back(head[0]);
      out_->updated.push_back(head[1]);
      out_->used.push_back(head[2]);
      out_->server.push_back(static_cast<std::uint32_t>(part.server));
      const std::size_t k = floats_.size();
      floats_.resize(k + floats);
      std::memcpy(floats_.data() + k, rows.data() + at + sizeof head, floats * sizeof(float));
    }
  }
  void add_sketch(std::uint64_t offset, std::span<const std::byte> counters) override {
    std::vector<std::uint8_t>& sketch = out_->parts.back().sketch;
    for (std::size_t i = 0; i < counters.size() && offset + i < sketch.size(); ++i)
      sketch[offset + i] = static_cast<std::uint8_t>(counters[i]);
  }
  std::pair<std::size_t, std::string> damage() const override { return damage_; }

  // Sorts the rows by id (an id twice is damage) and lays the slots out slot-major.
  void finish() override {
    Table& t = *out_;
    const std::size_t n = t.ids.size(), dim = t.meta.dim, per_row = dim * (1 + t.num_slots);
    std::vector<std::size_t> order(n);
    for (std::size_t k = 0; k < n; ++k) order[k] = k;
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return t.ids[a] < t.ids[b]; });
    Table sorted;
    sorted.values.resize(n * dim);
    sorted.slots.resize(n * dim * t.num_slots);
    for (std::size_t k = 0; k < n; ++k) {
      const std::size_t from = order[k];
      if (k > 0 && t.ids[from] == sorted.ids.back() && damage_.second.empty())
        damage_ = {t.server[from], "dynamic table '" + t.meta.name + "': id " + std::to_string(t.ids[from]) +
                                       " is saved twice (servers " + std::to_string(sorted.server.back()) + " and " +
                                       std::to_string(t.server[from]) + ")"};
      sorted.ids.push_back(t.ids[from]);
      sorted.updated.push_back(t.updated[from]);
      sorted.used.push_back(t.used[from]);
      sorted.server.push_back(t.server[from]);
      const float* row = floats_.data() + from * per_row;
      std::copy_n(row, dim, sorted.values.data() + k * dim);
      for (std::size_t j = 0; j < t.num_slots; ++j)
        std::copy_n(row + (1 + j) * dim, dim, sorted.slots.data() + (j * n + k) * dim);
    }
    t.ids = std::move(sorted.ids);
    t.values = std::move(sorted.values);
    t.slots = std::move(sorted.slots);
    t.updated = std::move(sorted.updated);
    t.used = std::move(sorted.used);
    t.server = std::move(sorted.server);
    floats_ = {};
  }

 private:
  Table* out_;
  std::vector<float> floats_;  // each row's floats and slots, as saved
  std::pair<std::size_t, std::string> damage_;
};

}  // namespace detail

//! Reads dynamic table `name` of the checkpoint in `dir`: every server's
//! part, checking every file it reads; throws checkpoint_error (also when
//! there is no such table, or an id is in two servers' parts).
inline Table load_table(const std::filesystem::path& dir, const std::string& name) {
  const Manifest m = detail::load_manifest(dir);
  const ManifestTable* mt = detail::find_table(m, name);
  if (!mt && detail::find_variable(m, name))
    detail::fail(dir / detail::manifest_name, "holds '" + name + "' as a fixed-size variable (checkpoint::load_variable reads it)");
  if (!mt) detail::fail(dir / detail::manifest_name, "has no dynamic table '" + name + "'");
  Table out;
  out.meta = *mt;
  out.num_slots = m.optimizer_slots;
  VariableInfo info;  // its ring empty: every server's part is read
  info.meta.name = mt->name;
  info.meta.shape = {static_cast<std::size_t>(mt->dim)};
  info.meta.kind = VariableKind::dynamic;
  info.meta.row_width = static_cast<std::size_t>(mt->dim);
  info.table = mt->options;
  detail::TableCollector collector(out);
  ::psx::detail::RestoredTable target{&info, 0, &collector};
  detail::read_shards({dir.string(), m.step, 0}, {}, std::span(&target, 1));
  return out;
}

namespace detail {

// Every directory under `root` named as a checkpoint (`ckpt-<step>`),
// complete or not, oldest first.
inline std::vector<Info> checkpoint_dirs(const fs::path& root) {
  std::vector<Info> out;
  std::error_code ec;
  // Each step with an error code: a directory pruned while it is listed
  // ends the listing, with no filesystem_error.
  for (fs::directory_iterator it(root, ec), last; !ec && it != last; it.increment(ec)) {
    const fs::directory_entry& e = *it;
    const auto step = step_of_dir_name(e.path().filename().string());
    std::error_code kind;  // not the listing's: an entry gone meanwhile is skipped
    if (step && e.is_directory(kind)) out.push_back({e.path(), *step});
  }
  std::sort(out.begin(), out.end(), [](const Info& a, const Info& b) { return a.step < b.step; });
  return out;
}

}  // namespace detail

//! The complete checkpoints under `root`, oldest first: those whose
//! manifest reads, is of the step the directory's name says, and lists
//! shard files that are all there with the headers and sizes it records.
//! Their data is not read: `verify` checks its CRCs, and a restore does
//! (`Manager::restore_or_init` then falls back to an older checkpoint).
inline std::vector<Info> list(const std::filesystem::path& root) {
  std::vector<Info> out;
  for (Info& c : detail::checkpoint_dirs(root)) {
    try {
      detail::load_complete(c.path, c.step);
      out.push_back(std::move(c));
    } catch (const checkpoint_error&) {  // incomplete or damaged: not a candidate
    }
  }
  return out;
}

//! The newest complete checkpoint under `root` (as `list` means it), if
//! any; its data is not read.
inline std::optional<Info> latest(const std::filesystem::path& root) {
  auto all = list(root);
  if (all.empty()) return std::nullopt;
  return all.back();
}

}  // namespace checkpoint

}  // namespace v0
}  // namespace psx

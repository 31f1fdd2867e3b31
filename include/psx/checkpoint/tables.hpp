//! @file psx/checkpoint/tables.hpp
//! A dynamic table's part of a server's shard file (format 2 on): its
//! record in the file's index (the state that decides its future: counters,
//! sweep, sketch geometry, memory layout), its rows and its admission
//! sketch's counters in the data part, each with a CRC-32C of its own; and
//! what hands them to a `TableLoader` as the file is read.
#pragma once

#include <psx/checkpoint/files.hpp>
#include <psx/checkpoint/format.hpp>
#include <psx/detail/crc32c.hpp>
#include <psx/detail/persist.hpp>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace psx {
inline namespace v0 {
namespace checkpoint {
namespace detail {

namespace fs = std::filesystem;

// One table's part in a server's file: its state, then where its rows
// (`state.rows` of `table_row_bytes(dim, slots)` bytes) and its sketch's
// counters (`sketch_width * sketch_depth` bytes) lie in the data part.
struct TableRecord {
  std::string variable;
  ::psx::detail::TableState state;
  std::uint64_t rows_offset = 0;
  std::uint32_t rows_crc = 0;
  std::uint64_t sketch_offset = 0;
  std::uint32_t sketch_crc = 0;

  std::uint64_t row_bytes() const noexcept { return ::psx::detail::table_row_bytes(state.dim, state.slots); }
  std::uint64_t rows_bytes() const noexcept { return state.rows * row_bytes(); }
  std::uint64_t sketch_bytes() const noexcept { return std::uint64_t{state.sketch_width} * state.sketch_depth; }
};
// The fewest bytes a table record takes in an index (its fixed fields).
inline constexpr std::size_t min_table_record_bytes = 8 * 16;
// Stripes a table has at most (TableOptions::stripes), two layout numbers each.
inline constexpr std::size_t max_layout_numbers = 2 * 4096;

template <class Ar>
void table_record_fields(Ar& ar, TableRecord& r) {
  ::psx::detail::TableState& s = r.state;
  ar(BoundedString{&r.variable}, s.dim, s.slots, s.rows, s.shard_version, s.version, s.next_sweep, s.admitted,
     s.refused, s.evicted_ttl, s.evicted_memory, s.sketch_width, s.sketch_depth, s.sketch_added, r.rows_offset,
     r.rows_crc, r.sketch_offset, r.sketch_crc);
}

template <class Ar>
void save_table_record(Ar& ar, TableRecord& r) {
  table_record_fields(ar, r);
  ar(static_cast<std::uint64_t>(r.state.layout.size()));
  for (std::uint64_t& x : r.state.layout) ar(x);
}

template <class Ar>
void load_table_record(Ar& ar, TableRecord& r) {
  table_record_fields(ar, r);
  std::uint64_t n = 0;
  ar(n);
  if (n > max_layout_numbers) throw checkpoint_error("a layout of " + std::to_string(n) + " numbers");
  r.state.layout.resize(n);
  for (std::uint64_t& x : r.state.layout) ar(x);
}

// Whether a table record describes a part that fits in a data part of
// `data_bytes` bytes; names what does not.
inline void check_table_record(const TableRecord& r, std::uint64_t data_bytes, const fs::path& file) {
  const ::psx::detail::TableState& s = r.state;
  const std::string what = "dynamic table '" + r.variable.substr(0, 256) + "'";
  if (s.dim == 0 || s.dim > (std::uint64_t{1} << 20) || s.slots > 64)
    fail(file, what + ": rows of " + std::to_string(s.dim) + " floats with " + std::to_string(s.slots) + " slots");
  const std::uint64_t stripes = s.layout.size() / 2;
  if (s.layout.size() % 2 != 0 || !std::has_single_bit(stripes))
    fail(file, what + ": a layout of " + std::to_string(s.layout.size()) + " numbers, not two per stripe");
  if ((s.sketch_width == 0) != (s.sketch_depth == 0) ||
      (s.sketch_width != 0 && (!std::has_single_bit(s.sketch_width) || s.sketch_depth > 16)))
    fail(file, what + ": an admission sketch of " + std::to_string(s.sketch_width) + " x " +
                   std::to_string(s.sketch_depth) + " counters");
  auto check_part = [&](const char* part, std::uint64_t offset, std::uint64_t count, std::uint64_t each) {
    if (each != 0 && count > data_bytes / each)
      fail(file, what + ": " + std::to_string(count) + " " + part + " of " + std::to_string(each) +
                     " bytes, more than the " + std::to_string(data_bytes) + "-byte data part holds");
    const std::uint64_t bytes = count * each;
    if (offset > data_bytes || bytes > data_bytes - offset)
      fail(file, what + ": " + std::to_string(bytes) + " bytes of " + part + " at offset " + std::to_string(offset) +
                     " do not fit in the " + std::to_string(data_bytes) + "-byte data part");
  };
  check_part("rows", r.rows_offset, s.rows, r.row_bytes());
  check_part("sketch counters", r.sketch_offset, s.sketch_depth, s.sketch_width);
}

// Writes a table's rows and sketch counters through `put`, which appends
// bytes to the data part, filling in their CRCs in `r`; throws when the
// table gave another number of rows than its state says.
template <class Put>
void write_table_part(const ::psx::detail::SavedTable& t, TableRecord& r, Put&& put, const fs::path& file) {
  std::uint64_t written = 0;
  r.rows_crc = 0;
  t.rows([&](std::span<const std::byte> rows) {
    r.rows_crc = ::psx::detail::crc32c(rows, r.rows_crc);
    written += rows.size();
    if (written <= r.rows_bytes()) put(rows);
  });
  if (written != r.rows_bytes())
    fail(file, "dynamic table '" + r.variable + "' gave " + std::to_string(written) + " bytes of rows, its state " +
                   std::to_string(r.rows_bytes()) + " (" + std::to_string(r.state.rows) + " rows): it changed while saved");
  const auto sketch = std::as_bytes(std::span(t.sketch));
  r.sketch_crc = ::psx::detail::crc32c(sketch);
  put(sketch);
}

// What a table's rows go through as the data part is read: whole rows to
// the loader (a row may straddle two blocks), and their CRC.
class RowFeed {
 public:
  RowFeed(::psx::detail::TableLoader& loader, std::uint64_t row_bytes) : loader_(&loader), row_(row_bytes) {}
  void operator()(std::span<const std::byte> b) {
    crc_ = ::psx::detail::crc32c(b, crc_);
    if (!carry_.empty()) {
      const std::size_t n = std::min<std::size_t>(row_ - carry_.size(), b.size());
      carry_.insert(carry_.end(), b.begin(), b.begin() + static_cast<std::ptrdiff_t>(n));
      b = b.subspan(n);
      if (carry_.size() < row_) return;
      loader_->add_rows(carry_);
      carry_.clear();
    }
    const std::size_t whole = b.size() / row_ * row_;
    if (whole != 0) loader_->add_rows(b.first(whole));
    carry_.assign(b.begin() + static_cast<std::ptrdiff_t>(whole), b.end());
  }
  std::uint32_t crc() const noexcept { return crc_; }

 private:
  ::psx::detail::TableLoader* loader_;
  std::size_t row_;
  std::vector<std::byte> carry_;
  std::uint32_t crc_ = 0;
};

// What a table's sketch counters go through: to the loader at their
// offset, and their CRC.
class SketchFeed {
 public:
  explicit SketchFeed(::psx::detail::TableLoader& loader) : loader_(&loader) {}
  void operator()(std::span<const std::byte> b) {
    crc_ = ::psx::detail::crc32c(b, crc_);
    loader_->add_sketch(at_, b);
    at_ += b.size();
  }
  std::uint32_t crc() const noexcept { return crc_; }

 private:
  ::psx::detail::TableLoader* loader_;
  std::uint64_t at_ = 0;
  std::uint32_t crc_ = 0;
};

}  // namespace detail
}  // namespace checkpoint
}  // namespace v0
}  // namespace psx

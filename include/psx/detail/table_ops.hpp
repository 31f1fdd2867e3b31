//! @file psx/detail/table_ops.hpp
//! What the two table operations (`Op::table_stats`, `Op::table_export`)
//! carry, for the server that answers them and the worker that asks
//! (docs/wire.md). Every 64-bit value travels as the bits of two floats:
//! the transports move floats.
#pragma once

#include <psx/embedding.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

namespace psx {
inline namespace v0 {
namespace detail {

// The k-th 64-bit word of a float buffer.
inline void put_word(std::span<float> out, std::size_t k, std::uint64_t v) noexcept {
  std::memcpy(out.data() + 2 * k, &v, sizeof v);
}
inline std::uint64_t get_word(std::span<const float> in, std::size_t k) noexcept {
  std::uint64_t v;
  std::memcpy(&v, in.data() + 2 * k, sizeof v);
  return v;
}

// An Op::table_stats answer: TableStats' counters, in this order.
inline constexpr std::size_t table_stats_words = 9;
inline constexpr std::size_t table_stats_floats = 2 * table_stats_words;

inline void put_table_stats(const TableStats& s, std::span<float> out) noexcept {
  const std::uint64_t w[table_stats_words] = {s.rows,        s.bytes,          s.ideal_row_bytes,
                                              s.admitted,    s.refused,        s.evicted_ttl,
                                              s.evicted_memory, s.removal_log, s.removal_log_bytes};
  for (std::size_t k = 0; k < table_stats_words; ++k) put_word(out, k, w[k]);
}

inline TableStats get_table_stats(std::span<const float> in) noexcept {
  TableStats s;
  std::uint64_t* w[table_stats_words] = {&s.rows,        &s.bytes,          &s.ideal_row_bytes,
                                         &s.admitted,    &s.refused,        &s.evicted_ttl,
                                         &s.evicted_memory, &s.removal_log, &s.removal_log_bytes};
  for (std::size_t k = 0; k < table_stats_words; ++k) *w[k] = get_word(in, k);
  return s;
}

// An Op::table_export request carries 4 words as its item's ids: the
// cursor's incarnation and version (a delta), the hash the page starts
// after (a page after the first), and flags saying which of them count.
inline constexpr std::size_t page_ask_words = 4;
inline constexpr std::uint64_t page_delta = 1;      // the cursor counts: a delta
inline constexpr std::uint64_t page_continues = 2;  // the hash counts: not the first page

// Its answer: a header of 8 words (incarnation, version, rows, removed ids,
// next hash, more, rows stored now, removals remembered now), then the page
// (DynamicTable::export_page): `capacity` ids, then `capacity` rows.
inline constexpr std::size_t page_header_words = 8;
inline constexpr std::size_t page_header_floats = 2 * page_header_words;

// Floats of a page answer with room for `capacity` entries of rows of `dim`.
inline constexpr std::size_t page_floats(std::size_t capacity, std::size_t dim) noexcept {
  return page_header_floats + capacity * (2 + dim);
}

// Whether `floats` is the size of a page answer for rows of `dim` (room for one entry at least).
inline constexpr bool is_page_size(std::uint64_t floats, std::size_t dim) noexcept {
  return floats >= page_floats(1, dim) && (floats - page_header_floats) % (2 + dim) == 0;
}

struct PageHeader {
  TablePage page;
  std::uint64_t stored = 0;    // rows the server's part holds now
  std::uint64_t removals = 0;  // removals it remembers now
};

inline void put_page_header(const PageHeader& h, std::span<float> out) noexcept {
  const std::uint64_t w[page_header_words] = {h.page.incarnation, h.page.version, h.page.rows, h.page.removed,
                                              h.page.next,        h.page.more,    h.stored,    h.removals};
  for (std::size_t k = 0; k < page_header_words; ++k) put_word(out, k, w[k]);
}

inline PageHeader get_page_header(std::span<const float> in) noexcept {
  PageHeader h;
  h.page.incarnation = get_word(in, 0);
  h.page.version = get_word(in, 1);
  h.page.rows = static_cast<std::size_t>(get_word(in, 2));
  h.page.removed = static_cast<std::size_t>(get_word(in, 3));
  h.page.next = get_word(in, 4);
  h.page.more = get_word(in, 5) != 0;
  h.stored = get_word(in, 6);
  h.removals = get_word(in, 7);
  return h;
}

}  // namespace detail
}  // namespace v0
}  // namespace psx

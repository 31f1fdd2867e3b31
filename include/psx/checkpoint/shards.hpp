//! @file psx/checkpoint/shards.hpp
//! A server's shard file: its index (which rows of which variable, and
//! which parts of which dynamic table, lie where in the data part) and
//! data, written by each server, and read by any server for what its own
//! shards and tables need.
#pragma once

#include <psx/checkpoint/files.hpp>
#include <psx/checkpoint/format.hpp>
#include <psx/checkpoint/manifest.hpp>
#include <psx/checkpoint/tables.hpp>
#include <psx/detail/persist.hpp>
#include <psx/variable.hpp>

#include <cereal/archives/portable_binary.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <istream>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

namespace psx {
inline namespace v0 {
namespace checkpoint {

namespace detail {

namespace fs = std::filesystem;

// -- a server's shard file ----------------------------------------------------------------

// One shard in a server's file: parameters at `offset` in the data part,
// then each slot, each `(row_end - row_begin) * width` floats.
struct IndexRecord {
  std::string variable;
  std::uint64_t shard = 0;
  std::uint64_t row_begin = 0;
  std::uint64_t row_end = 0;
  std::uint64_t width = 0;
  std::uint64_t slots = 0;
  std::uint64_t version = 0;
  std::uint64_t offset = 0;
  std::uint64_t floats() const noexcept { return (row_end - row_begin) * width; }
};
inline constexpr std::size_t min_record_bytes = 8 * 8;

// A shard file's index: its shards, and (format 2 on) its part of every dynamic table.
struct Index {
  std::vector<IndexRecord> shards;
  std::vector<TableRecord> tables;
};

inline std::string encode_index(std::uint32_t server, Index& index) {
  std::ostringstream os;
  {
    cereal::PortableBinaryOutputArchive ar(os, cereal::PortableBinaryOutputArchive::Options::LittleEndian());
    ar(server, static_cast<std::uint64_t>(index.shards.size()));
    for (IndexRecord& r : index.shards)
      ar(BoundedString{&r.variable}, r.shard, r.row_begin, r.row_end, r.width, r.slots, r.version, r.offset);
    ar(static_cast<std::uint64_t>(index.tables.size()));
    for (TableRecord& t : index.tables) save_table_record(ar, t);
  }
  return std::move(os).str();
}

//! Parses and checks the index of a shard file of format `version` whose
//! data part has `data_bytes` bytes; throws checkpoint_error (the fuzz
//! target calls this).
inline Index decode_index(std::span<const std::byte> meta, std::uint64_t data_bytes, std::uint32_t server,
                          const fs::path& file, std::uint32_t version = format_version) {
  Index index;
  try {
    MemoryBuf buf(meta);
    std::istream is(&buf);
    cereal::PortableBinaryInputArchive ar(is, cereal::PortableBinaryInputArchive::Options::LittleEndian());
    std::uint32_t s = 0;
    std::uint64_t n = 0;
    ar(s, n);
    if (s != server) fail(file, "its index says server " + std::to_string(s) + ", its header server " + std::to_string(server));
    if (n > meta.size() / min_record_bytes)
      fail(file, "its index claims " + std::to_string(n) + " shards, more than its " + std::to_string(meta.size()) +
                     " bytes can hold");
    index.shards.resize(n);
    for (IndexRecord& r : index.shards)
      ar(BoundedString{&r.variable}, r.shard, r.row_begin, r.row_end, r.width, r.slots, r.version, r.offset);
    if (version >= 2) {
      ar(n);
      if (n > meta.size() / min_table_record_bytes)
        fail(file, "its index claims " + std::to_string(n) + " dynamic tables, more than its " +
                       std::to_string(meta.size()) + " bytes can hold");
      index.tables.resize(n);
      for (TableRecord& t : index.tables) load_table_record(ar, t);
    }
    if (is.rdbuf()->in_avail() != 0) fail(file, std::to_string(is.rdbuf()->in_avail()) + " bytes after its index");
  } catch (const checkpoint_error& e) {
    const std::string what = e.what();
    if (what.rfind("psx: checkpoint file", 0) == 0) throw;
    fail(file, "bad index: " + what);
  } catch (const std::exception& e) {  // cereal's "failed to read" on a short index
    fail(file, std::string("bad index: ") + e.what());
  }
  for (const IndexRecord& r : index.shards) {
    const std::string what = "shard " + std::to_string(r.shard) + " of '" + r.variable + "'";
    constexpr std::uint64_t limit = std::uint64_t{1} << 60;
    if (r.row_begin >= r.row_end || r.row_end > limit || r.width == 0 || r.width > limit || r.slots > 64)
      fail(file, what + ": impossible rows [" + std::to_string(r.row_begin) + ", " + std::to_string(r.row_end) +
                     ") x " + std::to_string(r.width) + " with " + std::to_string(r.slots) + " slots");
    const std::uint64_t rows = r.row_end - r.row_begin;
    if (rows > limit / r.width || r.floats() > limit / 4 / (r.slots + 1)) fail(file, what + ": a size that overflows");
    const std::uint64_t bytes = r.floats() * (r.slots + 1) * 4;
    if (r.offset > data_bytes || bytes > data_bytes - r.offset || r.offset % 4 != 0)
      fail(file, what + ": " + std::to_string(bytes) + " bytes at offset " + std::to_string(r.offset) +
                     " do not fit in the " + std::to_string(data_bytes) + "-byte data part");
  }
  for (std::size_t k = 0; k < index.tables.size(); ++k) {
    check_table_record(index.tables[k], data_bytes, file);
    for (std::size_t j = 0; j < k; ++j)
      if (index.tables[j].variable == index.tables[k].variable)
        fail(file, "dynamic table '" + index.tables[k].variable.substr(0, 256) + "' has two parts in it");
  }
  return index;
}

// What a shard file cut short lost, from its index where that is whole:
// " (it ends inside <the part at its end>)"; "" where the header is not a
// shard file's, or is whole, or the index is cut or damaged too.
template <class ReadAt>
std::string cut_inside(std::span<const std::byte> head, std::uint64_t file_size, std::uint32_t server,
                       const fs::path& file, ReadAt&& read_at) {
  if (head.size() < header_bytes || std::memcmp(head.data(), magic, 8) != 0 ||
      get<std::uint32_t>(head.data() + 60) != ::psx::detail::crc32c(head.first(60)))
    return {};
  const auto version = get<std::uint32_t>(head.data() + 8);
  const auto meta_bytes = get<std::uint64_t>(head.data() + 24), data_bytes = get<std::uint64_t>(head.data() + 32);
  if (version == 0 || version > format_version || get<std::uint32_t>(head.data() + 12) != 2) return {};
  const std::uint64_t rest = file_size - header_bytes;
  if (meta_bytes > rest) return " (it ends inside its index)";
  if (data_bytes <= rest - meta_bytes) return {};
  const std::uint64_t end = rest - meta_bytes;  // of the data part
  std::vector<std::byte> meta(meta_bytes);  // within the file's size
  read_at(meta.data(), meta.size(), header_bytes);
  if (::psx::detail::crc32c(meta) != get<std::uint32_t>(head.data() + 40)) return {};
  Index index;
  try {
    index = decode_index(meta, data_bytes, server, file, version);
  } catch (const checkpoint_error&) {
    return {};
  }
  std::string part;
  auto inside = [&](std::uint64_t offset, std::uint64_t bytes, const std::string& what) {
    if (part.empty() && offset <= end && end < offset + bytes) part = what;
  };
  for (const IndexRecord& r : index.shards)
    inside(r.offset, r.floats() * (r.slots + 1) * 4, "shard " + std::to_string(r.shard) + " of '" + r.variable + "'");
  for (const TableRecord& t : index.tables) {
    inside(t.rows_offset, t.rows_bytes(), "the rows of dynamic table '" + t.variable + "'");
    inside(t.sketch_offset, t.sketch_bytes(), "the admission sketch of dynamic table '" + t.variable + "'");
  }
  return part.empty() ? std::string() : " (it ends inside " + part + ")";
}

// A shard file's header, checked as decode_header checks it; a truncated
// file's error also says what it ends inside.
template <class ReadAt>
Header decode_shard_header(std::span<const std::byte> head, std::uint64_t file_size, std::uint32_t server,
                           const fs::path& file, ReadAt&& read_at) {
  try {
    return decode_header(head, file_size, FileKind::shards, file);
  } catch (const checkpoint_error& e) {
    const std::string where = cut_inside(head, file_size, server, file, read_at);
    if (where.empty()) throw;
    throw checkpoint_error(e.what() + where);
  }
}

// A shard file's header, and its size: as read_header, naming what a
// truncated file ends inside.
inline Header read_shard_header(const fs::path& file, std::uint32_t server, std::uint64_t& size) {
  const InputFile in(file);
  size = in.size();
  std::array<std::byte, header_bytes> b{};
  return decode_shard_header(in.head(b), size, server, file,
                             [&](std::byte* out, std::size_t n, std::uint64_t at) { in.read(out, n, at); });
}

// Whether every shard file of the checkpoint `m` in `dir` has the header
// and size the manifest lists (their data is not read).
inline void check_files(const Manifest& m, const fs::path& dir) {
  for (std::size_t s = 0; s < m.files.size(); ++s) {
    std::uint64_t size = 0;
    const Header h = read_shard_header(dir / m.files[s].name, static_cast<std::uint32_t>(s), size);
    check_listed(dir / m.files[s].name, size, h, m.files[s], m.step);
  }
}

// The manifest of a complete checkpoint in `dir`: it reads, it is of the
// step its directory's name says (`step`, where given), and every shard
// file it lists is there with its header and size. What `list()` asks of a
// checkpoint; a restore then checks the data's CRCs too.
inline Manifest load_complete(const fs::path& dir, std::optional<std::uint64_t> step = std::nullopt) {
  Manifest m = load_manifest(dir);
  if (step && m.step != *step)
    fail(dir / manifest_name, "is of step " + std::to_string(m.step) + ", its directory's name says " +
                                  std::to_string(*step));
  check_files(m, dir);
  return m;
}

// Checks a dynamic table's part after its bytes were read: its sections'
// CRCs, then what the loader found wrong with its rows.
inline void check_table_crcs(const TableRecord& t, const RowFeed& rows, const SketchFeed& sketch, const fs::path& file) {
  if (rows.crc() != t.rows_crc) fail(file, "dynamic table '" + t.variable + "': corrupted rows (CRC-32C mismatch)");
  if (sketch.crc() != t.sketch_crc)
    fail(file, "dynamic table '" + t.variable + "': corrupted admission sketch (CRC-32C mismatch)");
}

// Checks a whole shard file in memory: its header (a truncated file's
// error says what it ends inside), that it is the file the manifest lists,
// its index, and its CRCs (each dynamic table's parts by their own first,
// so that the error names the table).
inline void check_shard_file(const Loaded& f, std::uint32_t server, const ManifestFile& listed, std::uint64_t step,
                             const fs::path& file) {
  const auto all = f.all();
  const Header h = decode_shard_header(all.first(std::min(header_bytes, all.size())), f.size, server, file,
                                       [&](std::byte* out, std::size_t n, std::uint64_t at) {
                                         std::memcpy(out, all.data() + at, n);
                                       });
  check_listed(file, f.size, h, listed, step);
  const auto meta = all.subspan(header_bytes, h.meta_bytes);
  const auto data = all.subspan(header_bytes + h.meta_bytes, h.data_bytes);
  if (::psx::detail::crc32c(meta) != h.meta_crc) fail(file, "corrupted metadata (CRC-32C mismatch)");
  const Index index = decode_index(meta, h.data_bytes, server, file, h.version);
  for (const TableRecord& t : index.tables) {
    if (::psx::detail::crc32c(data.subspan(t.rows_offset, t.rows_bytes())) != t.rows_crc)
      fail(file, "dynamic table '" + t.variable + "': corrupted rows (CRC-32C mismatch)");
    if (::psx::detail::crc32c(data.subspan(t.sketch_offset, t.sketch_bytes())) != t.sketch_crc)
      fail(file, "dynamic table '" + t.variable + "': corrupted admission sketch (CRC-32C mismatch)");
  }
  if (::psx::detail::crc32c(data) != h.data_crc) fail(file, "corrupted data (CRC-32C mismatch)");
}

inline void write_server_file(const ::psx::detail::PersistRequest& r, std::span<const ::psx::detail::SavedShard> shards,
                              std::span<const ::psx::detail::SavedTable> tables) {
  const fs::path file = fs::path(r.directory) / server_file_name(r.server);
  Index index;
  std::uint64_t offset = 0;
  for (const auto& s : shards) {
    const Shard& sh = s.variable->shards[s.index];
    IndexRecord rec{s.variable->meta.name, s.index, sh.row_begin, sh.row_end, s.variable->meta.row_width,
                    s.slots.size(), s.version, offset};
    offset += rec.floats() * (rec.slots + 1) * 4;
    index.shards.push_back(std::move(rec));
  }
  for (const auto& t : tables) {
    TableRecord rec{t.variable->meta.name, t.state, offset, 0, 0, 0};
    if (t.sketch.size() != rec.sketch_bytes())
      fail(file, "dynamic table '" + rec.variable + "': a sketch of " + std::to_string(t.sketch.size()) +
                     " counters, its state says " + std::to_string(rec.sketch_bytes()));
    offset += rec.rows_bytes();
    rec.sketch_offset = offset;
    offset += rec.sketch_bytes();
    index.tables.push_back(std::move(rec));
  }
  Header h;
  h.kind = FileKind::shards;
  h.step = r.step;
  h.server = static_cast<std::uint32_t>(r.server);
  h.data_bytes = offset;
  // The index's CRCs of the tables' parts are known once they are written:
  // its bytes are written again then (the same size: fixed-width fields).
  std::string encoded = encode_index(h.server, index);
  AtomicFile out(file);
  std::array<std::byte, header_bytes> zero{};
  out.write(zero);  // the real header, with the data's CRC, goes in last
  out.write(std::as_bytes(std::span(encoded)));
  std::uint32_t crc = 0;
  // Written a block at a time, each CRC'd while in cache.
  constexpr std::size_t block = std::size_t{4} << 20;
  std::vector<std::byte> pending;
  auto flush = [&] {
    crc = ::psx::detail::crc32c(pending, crc);
    out.write(pending);
    pending.clear();
  };
  auto put = [&](std::span<const std::byte> bytes) {
    if (!pending.empty() && pending.size() + bytes.size() > block) flush();
    if (bytes.size() >= block) {  // large: straight from where it is
      crc = out.write_summed(bytes, crc, ::psx::detail::crc32c);
    } else {
      pending.insert(pending.end(), bytes.begin(), bytes.end());
    }
  };
  for (const auto& s : shards) {
    put(std::as_bytes(s.params));
    for (const auto& slot : s.slots) put(std::as_bytes(slot));
  }
  for (std::size_t k = 0; k < tables.size(); ++k) write_table_part(tables[k], index.tables[k], put, file);
  if (!pending.empty()) flush();
  if (!tables.empty()) {
    const std::string again = encode_index(h.server, index);
    if (again.size() != encoded.size()) fail(file, "its index changed size when written again");
    encoded = again;
    out.write_at(header_bytes, std::as_bytes(std::span(encoded)));
  }
  h.meta_bytes = encoded.size();
  h.meta_crc = ::psx::detail::crc32c(std::as_bytes(std::span(encoded)));
  h.data_crc = crc;
  out.write_at(0, encode_header(h));
  out.commit();
}

// Where bytes of a data part go as it is read: `bytes` bytes at `src`
// copied to `dst`, or handed to `take` (in order, a block at a time).
struct Copy {
  std::uint64_t src, bytes;
  std::byte* dst;
};
struct Stream {
  std::uint64_t src, bytes;
  std::function<void(std::span<const std::byte>)> take;
};

// Reads the data part (`data_bytes` at `data_at`) of `file` in blocks that
// are CRC'd while in cache, making the copies and feeding the streams;
// returns its CRC-32C.
inline std::uint32_t read_data(const InputFile& file, std::uint64_t data_at, std::uint64_t data_bytes,
                               std::vector<Copy>& copies, std::vector<Stream>& streams) {
  auto by_src = [](const auto& a, const auto& b) { return a.src < b.src; };
  std::sort(copies.begin(), copies.end(), by_src);
  std::sort(streams.begin(), streams.end(), by_src);
  constexpr std::size_t block = std::size_t{4} << 20;
  auto buf = std::make_unique_for_overwrite<std::byte[]>(block);
  std::uint32_t crc = 0;
  bool disjoint = streams.empty();
  for (std::size_t c = 1; c < copies.size(); ++c)
    disjoint = disjoint && copies[c - 1].src + copies[c - 1].bytes <= copies[c].src;
  if (disjoint) {
    // Straight into the staging buffers, a block at a time, CRC'd while in
    // cache; what no shard here needs goes through `buf` for the CRC alone.
    std::uint64_t at = 0;
    std::size_t c = 0;
    while (at < data_bytes) {
      std::byte* dst;
      std::size_t len;
      if (c < copies.size() && copies[c].src <= at) {
        const Copy& cp = copies[c];
        const std::uint64_t left = cp.src + cp.bytes - at;
        len = static_cast<std::size_t>(std::min<std::uint64_t>(block, left));
        dst = cp.dst + (at - cp.src);
        if (len == left) ++c;
      } else {
        const std::uint64_t stop = c < copies.size() ? copies[c].src : data_bytes;
        len = static_cast<std::size_t>(std::min<std::uint64_t>(block, stop - at));
        dst = buf.get();
      }
      file.read(dst, len, data_at + at);
      crc = ::psx::detail::crc32c(std::span<const std::byte>(dst, len), crc);
      at += len;
    }
    return crc;
  }
  std::size_t next_copy = 0, next_stream = 0;
  for (std::uint64_t at = 0; at < data_bytes; at += block) {
    const std::size_t len = static_cast<std::size_t>(std::min<std::uint64_t>(block, data_bytes - at));
    file.read(buf.get(), len, data_at + at);
    crc = ::psx::detail::crc32c(std::span<const std::byte>(buf.get(), len), crc);
    for (std::size_t k = next_copy; k < copies.size() && copies[k].src < at + len; ++k) {
      const Copy& cp = copies[k];
      const std::uint64_t lo = std::max(cp.src, at), hi = std::min(cp.src + cp.bytes, at + len);
      if (lo < hi) std::memcpy(cp.dst + (lo - cp.src), buf.get() + (lo - at), static_cast<std::size_t>(hi - lo));
      if (k == next_copy && cp.src + cp.bytes <= at + len) ++next_copy;
    }
    for (std::size_t k = next_stream; k < streams.size() && streams[k].src < at + len; ++k) {
      const Stream& s = streams[k];
      const std::uint64_t lo = std::max(s.src, at), hi = std::min(s.src + s.bytes, at + len);
      if (lo < hi) s.take(std::span<const std::byte>(buf.get() + (lo - at), static_cast<std::size_t>(hi - lo)));
      if (k == next_stream && s.src + s.bytes <= at + len) ++next_stream;
    }
  }
  return crc;
}

// Reads, from the checkpoint in `r.directory`, the rows of the shards
// `targets` and the dynamic tables `tables` (each to its loader: every
// saved server's part, or only its own server's where the table's ring is
// the saved one), checking every CRC of every file it reads; returns the
// checkpoint's step.
inline std::uint64_t read_shards(const ::psx::detail::PersistRequest& r, std::span<::psx::detail::RestoredShard> targets,
                                 std::span<::psx::detail::RestoredTable> tables) {
  const fs::path dir = r.directory;
  const fs::path manifest_file = dir / manifest_name;
  const Manifest m = load_manifest(dir);
  std::map<std::string, const ManifestVariable*, std::less<>> by_name;
  for (const ManifestVariable& v : m.variables) by_name.emplace(v.name, &v);
  // Which file holds which rows of what each target needs, and which parts of which table.
  struct Wanted {
    std::vector<std::size_t> shards, tables;
  };
  std::map<std::uint64_t, Wanted> files;  // server -> targets
  std::vector<std::vector<std::pair<std::uint64_t, std::uint64_t>>> covered(targets.size());  // rows read
  for (std::size_t t = 0; t < targets.size(); ++t) {
    auto& target = targets[t];
    const VariableMeta& meta = target.variable->meta;
    auto it = by_name.find(meta.name);
    check_variable(m, manifest_file, it == by_name.end() ? nullptr : it->second, meta, target.num_slots);
    const ManifestVariable& v = *it->second;
    const Shard& sh = target.variable->shards[target.index];
    std::uint64_t holding = 0;  // bytes of the files that hold its rows, each counted once
    for (const ManifestShard& s : v.shards)
      if (s.row_begin < sh.row_end && sh.row_begin < s.row_end) {
        auto& wanted = files[s.server].shards;
        if (!wanted.empty() && wanted.back() == t) continue;  // several of its shards in one file
        wanted.push_back(t);
        const fs::path file = dir / m.files[s.server].name;
        std::error_code ec;
        holding += fs::file_size(file, ec);
        if (ec) fail(file, "missing");
      }
    // Nothing is allocated for more than the files can hold (a manifest
    // that claims more rows than were saved is refused here).
    const std::uint64_t n = sh.rows() * meta.row_width;
    if (meta.row_width != 0 && (sh.rows() > (std::uint64_t{1} << 60) / meta.row_width ||
                                n > holding / 4 / (target.num_slots + 1)))
      fail(manifest_file, "variable '" + meta.name + "': rows [" + std::to_string(sh.row_begin) + ", " +
                              std::to_string(sh.row_end) + ") of " + std::to_string(meta.row_width) +
                              " floats are more than its shard files hold (" + std::to_string(holding) + " bytes)");
    // Uninitialized: every float is read into (or the restore fails).
    target.params.clear();
    target.params.resize(n);
    target.slots.clear();
    target.slots.resize(n * target.num_slots);
    target.version = 0;
  }
  std::vector<const ManifestTable*> saved(tables.size());
  for (std::size_t t = 0; t < tables.size(); ++t) {
    const VariableInfo& v = *tables[t].variable;
    saved[t] = find_table(m, v.meta.name);
    check_table(m, manifest_file, saved[t], v.meta, m.optimizer_slots);
    const bool same_ring = v.ring.servers() == m.num_servers && saved[t]->options.virtual_nodes == v.table.virtual_nodes;
    for (std::uint64_t s = 0; s < m.num_servers; ++s)
      if (!same_ring || s == tables[t].server) files[s].tables.push_back(t);
  }
  for (const auto& [server, wanted] : files) {
    const ManifestFile& mf = m.files[server];
    const fs::path file = dir / mf.name;
    // Streamed: header and index first, then the data part in blocks that
    // are CRC'd while in cache and copied straight to where they go; no
    // whole-file buffer (its page faults cost more than the copy).
    const InputFile in(file);
    auto read_at = [&](std::byte* out, std::size_t n, std::uint64_t at) { in.read(out, n, at); };
    std::array<std::byte, header_bytes> hb{};
    const Header header = decode_shard_header(in.head(hb), in.size(), static_cast<std::uint32_t>(server), file, read_at);
    check_listed(file, in.size(), header, mf, m.step);
    std::vector<std::byte> meta_bytes(header.meta_bytes);
    read_at(meta_bytes.data(), meta_bytes.size(), header_bytes);
    if (::psx::detail::crc32c(meta_bytes) != header.meta_crc) fail(file, "corrupted metadata (CRC-32C mismatch)");
    const Index index = decode_index(meta_bytes, header.data_bytes, static_cast<std::uint32_t>(server), file, header.version);
    std::vector<Copy> copies;
    for (const std::size_t t : wanted.shards) {
      auto& target = targets[t];
      const VariableMeta& meta = target.variable->meta;
      const Shard& sh = target.variable->shards[target.index];
      const std::size_t w = meta.row_width;
      const std::size_t n = sh.rows() * w;
      for (const IndexRecord& rec : index.shards) {
        if (rec.variable != meta.name || rec.row_begin >= sh.row_end || sh.row_begin >= rec.row_end) continue;
        if (rec.width != w || rec.slots != target.num_slots)
          fail(file, "shard " + std::to_string(rec.shard) + " of '" + meta.name + "' has rows of " +
                         std::to_string(rec.width) + " floats and " + std::to_string(rec.slots) + " slots, expected " +
                         std::to_string(w) + " and " + std::to_string(target.num_slots));
        const std::uint64_t lo = std::max<std::uint64_t>(rec.row_begin, sh.row_begin);
        const std::uint64_t hi = std::min<std::uint64_t>(rec.row_end, sh.row_end);
        const std::size_t count = (hi - lo) * w;
        const std::size_t from = (lo - rec.row_begin) * w, to = (lo - sh.row_begin) * w;
        copies.push_back({rec.offset + from * 4, count * 4, reinterpret_cast<std::byte*>(target.params.data() + to)});
        for (std::size_t k = 0; k < target.num_slots; ++k)
          copies.push_back({rec.offset + ((k + 1) * rec.floats() + from) * 4, count * 4,
                            reinterpret_cast<std::byte*>(target.slots.data() + k * n + to)});
        target.version = std::max(target.version, rec.version);
        covered[t].emplace_back(lo, hi);
      }
    }
    // Each table's part: begun from its record, then its rows and sketch
    // streamed to its loader.
    std::vector<Stream> streams;
    struct Feeds {
      const TableRecord* record;
      std::unique_ptr<RowFeed> rows;  // at stable addresses: the streams call them
      std::unique_ptr<SketchFeed> sketch;
    };
    std::vector<Feeds> feeds;
    for (const std::size_t t : wanted.tables) {
      const std::string& name = tables[t].variable->meta.name;
      const auto rec = std::find_if(index.tables.begin(), index.tables.end(),
                                    [&](const TableRecord& x) { return x.variable == name; });
      if (rec == index.tables.end()) fail(file, "holds no part of dynamic table '" + name + "', which its manifest lists");
      if (rec->state.dim != saved[t]->dim || rec->state.slots != m.optimizer_slots)
        fail(file, "dynamic table '" + name + "' has rows of " + std::to_string(rec->state.dim) + " floats and " +
                       std::to_string(rec->state.slots) + " slots, its manifest says " + std::to_string(saved[t]->dim) +
                       " and " + std::to_string(m.optimizer_slots));
      ::psx::detail::TableLoader& loader = *tables[t].loader;
      loader.begin_part(server, m.num_servers, saved[t]->options.virtual_nodes, rec->state);
      auto rows = std::make_unique<RowFeed>(loader, rec->row_bytes());
      auto sketch = std::make_unique<SketchFeed>(loader);
      streams.push_back({rec->rows_offset, rec->rows_bytes(), [f = rows.get()](auto b) { (*f)(b); }});
      streams.push_back({rec->sketch_offset, rec->sketch_bytes(), [f = sketch.get()](auto b) { (*f)(b); }});
      feeds.push_back({&*rec, std::move(rows), std::move(sketch)});
    }
    const std::uint32_t crc = read_data(in, header_bytes + header.meta_bytes, header.data_bytes, copies, streams);
    for (const Feeds& f : feeds) check_table_crcs(*f.record, *f.rows, *f.sketch, file);
    if (crc != header.data_crc) fail(file, "corrupted data (CRC-32C mismatch)");
    for (const std::size_t t : wanted.tables)
      if (const auto [at, problem] = tables[t].loader->damage(); !problem.empty()) fail(dir / m.files[at].name, problem);
  }
  for (std::size_t t = 0; t < tables.size(); ++t) {
    tables[t].loader->finish();
    if (const auto [at, problem] = tables[t].loader->damage(); !problem.empty())
      fail(dir / m.files[std::min<std::size_t>(at, m.files.size() - 1)].name, problem);
  }
  for (std::size_t t = 0; t < targets.size(); ++t) {
    const Shard& sh = targets[t].variable->shards[targets[t].index];
    // Every row exactly once: the rows read, in order, tile the shard.
    auto& got = covered[t];
    std::sort(got.begin(), got.end());
    std::uint64_t expect = sh.row_begin;
    std::size_t used = 0;
    for (; used < got.size() && got[used].first == expect; ++used) expect = got[used].second;
    if (expect != sh.row_end || used != got.size())
      fail(dir, "the shard files do not hold the rows [" + std::to_string(sh.row_begin) + ", " +
                    std::to_string(sh.row_end) + ") of '" + targets[t].variable->meta.name +
                    "' exactly once (from row " + std::to_string(expect) +
                    ": two files claim the same rows, or none has them)");
  }
  return m.step;
}

// Installed when a program includes this header: servers then save and restore.
inline const bool hooks_installed = [] {
  ::psx::detail::persist_hooks().save = &write_server_file;
  ::psx::detail::persist_hooks().restore = &read_shards;
  return true;
}();

}  // namespace detail

}  // namespace checkpoint

}  // namespace v0
}  // namespace psx

//! @file psx/checkpoint/shards.hpp
//! A server's shard file: its index (which rows of which variable lie where
//! in the data part) and data, written by each server, and read by any
//! server for the rows its own shards need.
#pragma once

#include <psx/checkpoint/files.hpp>
#include <psx/checkpoint/format.hpp>
#include <psx/checkpoint/manifest.hpp>
#include <psx/detail/persist.hpp>
#include <psx/variable.hpp>

#include <cereal/archives/portable_binary.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <istream>
#include <map>
#include <memory>
#include <span>
#include <sstream>
#include <string>
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

inline std::string encode_index(std::uint32_t server, std::vector<IndexRecord>& records) {
  std::ostringstream os;
  {
    cereal::PortableBinaryOutputArchive ar(os, cereal::PortableBinaryOutputArchive::Options::LittleEndian());
    ar(server, static_cast<std::uint64_t>(records.size()));
    for (IndexRecord& r : records)
      ar(BoundedString{&r.variable}, r.shard, r.row_begin, r.row_end, r.width, r.slots, r.version, r.offset);
  }
  return std::move(os).str();
}

//! Parses and checks the index of a shard file whose data part has
//! `data_bytes` bytes; throws checkpoint_error (the fuzz target calls this).
inline std::vector<IndexRecord> decode_index(std::span<const std::byte> meta, std::uint64_t data_bytes,
                                             std::uint32_t server, const fs::path& file) {
  std::vector<IndexRecord> records;
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
    records.resize(n);
    for (IndexRecord& r : records)
      ar(BoundedString{&r.variable}, r.shard, r.row_begin, r.row_end, r.width, r.slots, r.version, r.offset);
    if (is.rdbuf()->in_avail() != 0) fail(file, std::to_string(is.rdbuf()->in_avail()) + " bytes after its index");
  } catch (const checkpoint_error& e) {
    const std::string what = e.what();
    if (what.rfind("psx: checkpoint file", 0) == 0) throw;
    fail(file, "bad index: " + what);
  } catch (const std::exception& e) {  // cereal's "failed to read" on a short index
    fail(file, std::string("bad index: ") + e.what());
  }
  for (const IndexRecord& r : records) {
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
  return records;
}

inline void write_server_file(const ::psx::detail::PersistRequest& r, std::span<const ::psx::detail::SavedShard> shards) {
  const fs::path file = fs::path(r.directory) / server_file_name(r.server);
  std::vector<IndexRecord> records;
  std::uint64_t offset = 0;
  for (const auto& s : shards) {
    const Shard& sh = s.variable->shards[s.index];
    IndexRecord rec{s.variable->meta.name, s.index, sh.row_begin, sh.row_end, s.variable->meta.row_width,
                    s.slots.size(), s.version, offset};
    offset += rec.floats() * (rec.slots + 1) * 4;
    records.push_back(std::move(rec));
  }
  const std::string index = encode_index(static_cast<std::uint32_t>(r.server), records);
  Header h;
  h.kind = FileKind::shards;
  h.step = r.step;
  h.server = static_cast<std::uint32_t>(r.server);
  h.meta_bytes = index.size();
  h.data_bytes = offset;
  h.meta_crc = ::psx::detail::crc32c(std::as_bytes(std::span(index)));
  AtomicFile out(file);
  std::array<std::byte, header_bytes> zero{};
  out.write(zero);  // the real header, with the data's CRC, goes in last
  out.write(std::as_bytes(std::span(index)));
  std::uint32_t crc = 0;
  auto put_floats = [&](std::span<const float> v) {
    constexpr std::size_t block = std::size_t{4} << 20;  // CRC a block while it is in cache, then write it
    const auto bytes = std::as_bytes(v);
    for (std::size_t at = 0; at < bytes.size(); at += block) {
      const auto part = bytes.subspan(at, std::min(block, bytes.size() - at));
      crc = ::psx::detail::crc32c(part, crc);
      out.write(part);
    }
  };
  for (const auto& s : shards) {
    put_floats(s.params);
    for (const auto& slot : s.slots) put_floats(slot);
  }
  h.data_crc = crc;
  out.write_at(0, encode_header(h));
  out.commit();
}

inline std::uint64_t read_shards(const ::psx::detail::PersistRequest& r, std::span<::psx::detail::RestoredShard> targets) {
  const fs::path dir = r.directory;
  const fs::path manifest_file = dir / manifest_name;
  const Manifest m = load_manifest(dir);
  std::map<std::string, const ManifestVariable*, std::less<>> by_name;
  for (const ManifestVariable& v : m.variables) by_name.emplace(v.name, &v);
  // Which file holds which rows of what each target needs.
  std::map<std::uint64_t, std::vector<std::size_t>> files;  // server -> targets
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
        auto& wanted = files[s.server];
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
  for (const auto& [server, wanted] : files) {
    const ManifestFile& mf = m.files[server];
    const fs::path file = dir / mf.name;
    // Streamed: header and index first, then the data part in blocks that
    // are CRC'd while in cache and copied straight to where they go; no
    // whole-file buffer (its page faults cost more than the copy).
    const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail(file, errno == ENOENT ? "missing" : "cannot open: " + errno_text());
    struct Closer {
      int fd;
      ~Closer() { ::close(fd); }
    } closer{fd};
    struct ::stat st {};
    if (::fstat(fd, &st) != 0) fail(file, "cannot stat: " + errno_text());
    const auto file_size = static_cast<std::uint64_t>(st.st_size);
    auto read_exact = [&](std::byte* out, std::size_t n, std::uint64_t at) {
      std::size_t done = 0;
      while (done < n) {
        const ::ssize_t got = ::pread(fd, out + done, n - done, static_cast<off_t>(at + done));
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) fail(file, "cannot read: " + errno_text());
        if (got == 0) fail(file, "the file shrank while being read");
        done += static_cast<std::size_t>(got);
      }
    };
    std::array<std::byte, header_bytes> hb{};
    const auto head = std::span<const std::byte>(hb).first(std::min<std::size_t>(header_bytes, file_size));
    read_exact(hb.data(), head.size(), 0);
    const Header header = decode_header(head, file_size, FileKind::shards, file);
    check_listed(file, file_size, header, mf, m.step);
    std::vector<std::byte> meta_bytes(header.meta_bytes);
    read_exact(meta_bytes.data(), meta_bytes.size(), header_bytes);
    if (::psx::detail::crc32c(meta_bytes) != header.meta_crc) fail(file, "corrupted metadata (CRC-32C mismatch)");
    const auto records = decode_index(meta_bytes, header.data_bytes, static_cast<std::uint32_t>(server), file);
    struct Copy {
      std::uint64_t src, bytes;  // in the data part
      std::byte* dst;
    };
    std::vector<Copy> copies;
    for (const std::size_t t : wanted) {
      auto& target = targets[t];
      const VariableMeta& meta = target.variable->meta;
      const Shard& sh = target.variable->shards[target.index];
      const std::size_t w = meta.row_width;
      const std::size_t n = sh.rows() * w;
      for (const IndexRecord& rec : records) {
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
    std::sort(copies.begin(), copies.end(), [](const Copy& a, const Copy& b) { return a.src < b.src; });
    constexpr std::size_t block = std::size_t{4} << 20;
    auto buf = std::make_unique_for_overwrite<std::byte[]>(block);
    const std::uint64_t data_at = header_bytes + header.meta_bytes;
    std::uint32_t crc = 0;
    bool disjoint = true;
    for (std::size_t c = 1; c < copies.size(); ++c)
      disjoint = disjoint && copies[c - 1].src + copies[c - 1].bytes <= copies[c].src;
    if (disjoint) {
      // Straight into the staging buffers, a block at a time, CRC'd while in
      // cache; what no shard here needs goes through `buf` for the CRC alone.
      std::uint64_t at = 0;
      std::size_t c = 0;
      while (at < header.data_bytes) {
        std::byte* dst;
        std::size_t len;
        if (c < copies.size() && copies[c].src <= at) {
          const Copy& cp = copies[c];
          const std::uint64_t left = cp.src + cp.bytes - at;
          len = static_cast<std::size_t>(std::min<std::uint64_t>(block, left));
          dst = cp.dst + (at - cp.src);
          if (len == left) ++c;
        } else {
          const std::uint64_t stop = c < copies.size() ? copies[c].src : header.data_bytes;
          len = static_cast<std::size_t>(std::min<std::uint64_t>(block, stop - at));
          dst = buf.get();
        }
        read_exact(dst, len, data_at + at);
        crc = ::psx::detail::crc32c(std::span<const std::byte>(dst, len), crc);
        at += len;
      }
    } else {
      std::size_t next = 0;
      for (std::uint64_t at = 0; at < header.data_bytes; at += block) {
        const std::size_t len = static_cast<std::size_t>(std::min<std::uint64_t>(block, header.data_bytes - at));
        read_exact(buf.get(), len, data_at + at);
        crc = ::psx::detail::crc32c(std::span<const std::byte>(buf.get(), len), crc);
        for (std::size_t k = next; k < copies.size() && copies[k].src < at + len; ++k) {
          const Copy& cp = copies[k];
          const std::uint64_t lo = std::max(cp.src, at), hi = std::min(cp.src + cp.bytes, at + len);
          if (lo < hi) std::memcpy(cp.dst + (lo - cp.src), buf.get() + (lo - at), static_cast<std::size_t>(hi - lo));
          if (k == next && cp.src + cp.bytes <= at + len) ++next;
        }
      }
    }
    if (crc != header.data_crc) fail(file, "corrupted data (CRC-32C mismatch)");
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

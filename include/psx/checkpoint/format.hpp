//! @file psx/checkpoint/format.hpp
//! What every psx file starts with: the 64-byte envelope (magic, format
//! version, kind, lengths, CRC-32C checksums), the names of a checkpoint's
//! files and directories, and the error that names a bad file.
#pragma once

#include <psx/detail/crc32c.hpp>
#include <psx/errors.hpp>
#include <psx/variable.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <span>
#include <string>

namespace psx {
inline namespace v0 {
namespace checkpoint {

//! The newest format this psx writes and reads; every older one stays
//! readable. 1: fixed-size variables; 2: and dynamic tables (their rows,
//! slots, admission and eviction state in each server's file, their
//! declarations in the manifest).
inline constexpr std::uint32_t format_version = 2;

namespace detail {

namespace fs = std::filesystem;

inline constexpr char magic[8] = {'P', 'S', 'X', 'C', 'K', 'P', 'T', '\n'};
inline constexpr std::size_t header_bytes = 64;
enum class FileKind : std::uint32_t { manifest = 1, shards = 2, exported = 3 };
inline constexpr const char* manifest_name = "manifest.psx";
inline constexpr std::size_t max_name_bytes = ::psx::max_variable_name_bytes;

inline std::string server_file_name(std::size_t s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "server-%05zu.psx", s);
  return buf;
}
inline std::string checkpoint_dir_name(std::uint64_t step) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "ckpt-%010llu", static_cast<unsigned long long>(step));
  return buf;
}
// "ckpt-" and the step: 10 digits, more for steps of 10^10 and beyond
// (%010llu), and never a name the step would not be written as.
inline std::optional<std::uint64_t> step_of_dir_name(const std::string& name) {
  if (name.size() < 15 || name.size() > 25 || name.compare(0, 5, "ckpt-") != 0) return std::nullopt;
  std::uint64_t step = 0;
  for (std::size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    const auto digit = static_cast<std::uint64_t>(name[i] - '0');
    if (step > (std::numeric_limits<std::uint64_t>::max() - digit) / 10) return std::nullopt;
    step = step * 10 + digit;
  }
  if (checkpoint_dir_name(step) != name) return std::nullopt;
  return step;
}

[[noreturn]] inline void fail(const fs::path& file, const std::string& problem) {
  throw checkpoint_error("psx: checkpoint file " + file.string() + ": " + problem);
}

// -- the envelope every file has ----------------------------------------------------
//
//  0  8  magic "PSXCKPT\n"        32  u64 data bytes
//  8  u32 format version          40  u32 CRC-32C of the meta part
// 12  u32 kind (1 manifest,       44  u32 CRC-32C of the data part
//         2 a server's shards)    48  u32 server (shard files)
// 16  u64 step                    52  u32 reserved, 0
// 24  u64 meta bytes              56  u32 reserved, 0
//                                 60  u32 CRC-32C of bytes [0, 60)
// then the meta part (cereal), then the data part (raw little-endian floats).

struct Header {
  std::uint32_t version = format_version;
  FileKind kind = FileKind::manifest;
  std::uint64_t step = 0;
  std::uint64_t meta_bytes = 0;
  std::uint64_t data_bytes = 0;
  std::uint32_t meta_crc = 0;
  std::uint32_t data_crc = 0;
  std::uint32_t server = 0;
  std::uint32_t crc = 0;  // of the encoded bytes [0, 60)
};

template <class T>
void put(std::byte* out, T v) noexcept {
  std::memcpy(out, &v, sizeof v);
}
template <class T>
T get(const std::byte* in) noexcept {
  T v;
  std::memcpy(&v, in, sizeof v);
  return v;
}

inline std::array<std::byte, header_bytes> encode_header(Header& h) {
  std::array<std::byte, header_bytes> b{};
  std::memcpy(b.data(), magic, 8);
  put(b.data() + 8, h.version);
  put(b.data() + 12, static_cast<std::uint32_t>(h.kind));
  put(b.data() + 16, h.step);
  put(b.data() + 24, h.meta_bytes);
  put(b.data() + 32, h.data_bytes);
  put(b.data() + 40, h.meta_crc);
  put(b.data() + 44, h.data_crc);
  put(b.data() + 48, h.server);
  h.crc = ::psx::detail::crc32c(std::span<const std::byte>(b.data(), 60));
  put(b.data() + 60, h.crc);
  return b;
}

inline std::string kind_name(std::uint32_t k) {
  return k == 1 ? "a manifest" : k == 2 ? "a server's shard file" : k == 3 ? "an export's model.psx" : "of unknown kind " + std::to_string(k);
}

// Checks the header of a file of `file_size` bytes; the rest is checked
// against it by the caller.
inline Header decode_header(std::span<const std::byte> b, std::uint64_t file_size, FileKind want, const fs::path& file) {
  if (b.size() < header_bytes)
    fail(file, "truncated: " + std::to_string(b.size()) + " bytes, shorter than the " + std::to_string(header_bytes) +
                   "-byte header");
  if (std::memcmp(b.data(), magic, 8) != 0) fail(file, "not a psx checkpoint file (bad magic)");
  Header h;
  h.version = get<std::uint32_t>(b.data() + 8);
  h.crc = get<std::uint32_t>(b.data() + 60);
  if (h.crc != ::psx::detail::crc32c(b.first(60))) fail(file, "corrupted header (CRC-32C mismatch)");
  if (h.version == 0 || h.version > format_version)
    fail(file, "written in checkpoint format " + std::to_string(h.version) + "; this psx reads formats 1 to " +
                   std::to_string(format_version) + (h.version == 0 ? std::string(" (no psx writes format 0)")
                                                                     : " (a newer psx wrote it: upgrade psx to read it)"));
  const auto kind = get<std::uint32_t>(b.data() + 12);
  if (kind != static_cast<std::uint32_t>(want))
    fail(file, "is " + kind_name(kind) + ", expected " + kind_name(static_cast<std::uint32_t>(want)));
  h.kind = want;
  h.step = get<std::uint64_t>(b.data() + 16);
  h.meta_bytes = get<std::uint64_t>(b.data() + 24);
  h.data_bytes = get<std::uint64_t>(b.data() + 32);
  h.meta_crc = get<std::uint32_t>(b.data() + 40);
  h.data_crc = get<std::uint32_t>(b.data() + 44);
  h.server = get<std::uint32_t>(b.data() + 48);
  const std::uint64_t rest = file_size - header_bytes;
  if (h.meta_bytes > rest || h.data_bytes > rest - h.meta_bytes)
    fail(file, "truncated: the header promises " + std::to_string(h.meta_bytes) + " + " + std::to_string(h.data_bytes) +
                   " bytes after it, the file has " + std::to_string(rest));
  if (h.meta_bytes + h.data_bytes != rest)
    fail(file, std::to_string(rest - h.meta_bytes - h.data_bytes) + " bytes beyond what the header describes");
  return h;
}

}  // namespace detail

}  // namespace checkpoint

}  // namespace v0
}  // namespace psx

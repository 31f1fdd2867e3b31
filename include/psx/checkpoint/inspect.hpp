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
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
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
    auto v = detail::verify_bytes(detail::read_file(file), detail::FileKind::shards, file);
    detail::check_listed(file, v.file.size, v.header, m.files[s], m.step);
    detail::decode_index(v.meta, v.header.data_bytes, static_cast<std::uint32_t>(s), file);
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
  if (!mv) detail::fail(dir / detail::manifest_name, "has no variable '" + name + "'");
  VariableInfo info;
  info.meta.name = mv->name;
  info.meta.shape.assign(mv->shape.begin(), mv->shape.end());
  info.meta.rows = mv->shape.empty() ? 1 : mv->shape[0];
  info.meta.row_width = mv->row_width;
  info.meta.dtype = detail::parse_dtype(mv->dtype, dir / detail::manifest_name);
  info.shards = {Shard{0, 0, info.meta.rows}};
  ::psx::detail::RestoredShard target{&info, 0, m.optimizer_slots, {}, {}, 0};
  detail::read_shards({dir.string(), m.step, 0}, std::span(&target, 1));
  return {*mv, {target.params.begin(), target.params.end()}, {target.slots.begin(), target.slots.end()},
          m.optimizer_slots, target.version};
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

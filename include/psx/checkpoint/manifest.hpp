//! @file psx/checkpoint/manifest.hpp
//! The manifest the chief writes last (JSON: the step, the cluster, every
//! variable's declaration and layout, every dynamic table's declaration,
//! every shard file's size and header CRC), and the checks that tell
//! whether a checkpoint can restore the variables a program declares.
#pragma once

#include <psx/checkpoint/files.hpp>
#include <psx/checkpoint/format.hpp>
#include <psx/variable.hpp>

#include <cereal/archives/json.hpp>
#include <cereal/types/string.hpp>
#include <cereal/types/vector.hpp>

#include <bit>
#include <cctype>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <istream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace psx {
inline namespace v0 {
namespace checkpoint {

//! One shard of a variable as the manifest lists it.
struct ManifestShard {
  std::uint64_t server = 0;
  std::uint64_t row_begin = 0;
  std::uint64_t row_end = 0;
  template <class Ar>
  void serialize(Ar& ar) {
    ar(CEREAL_NVP(server), CEREAL_NVP(row_begin), CEREAL_NVP(row_end));
  }
};

//! A variable as saved: its declaration and where its rows were.
struct ManifestVariable {
  std::string name;
  std::vector<std::uint64_t> shape;
  std::string kind;   //!< "dense" or "sparse"
  std::string dtype;  //!< "float32", "bfloat16" or "float16" (the float32 master is saved)
  bool trainable = true;
  std::uint64_t row_width = 0;
  std::vector<ManifestShard> shards;  //!< ordered by row, tiling [0, rows)
  template <class Ar>
  void serialize(Ar& ar) {
    ar(CEREAL_NVP(name), CEREAL_NVP(shape), CEREAL_NVP(kind), CEREAL_NVP(dtype), CEREAL_NVP(trainable),
       CEREAL_NVP(row_width), CEREAL_NVP(shards));
  }
};

namespace detail {

// A table's options as the manifest's JSON holds them: the admission by
// name, its probability as the bits of the double (the manifest's JSON has
// integers only: check_json_depth).
struct TableOptionsFields {
  TableOptions* o;
  static constexpr const char* admission_names[] = {"always", "after_pushes", "probability"};
  template <class Ar>
  void save(Ar& ar) const {
    const std::string admission = admission_names[static_cast<std::size_t>(o->admission.kind)];
    ar(cereal::make_nvp("admission", admission), cereal::make_nvp("pushes", o->admission.pushes),
       cereal::make_nvp("probability_bits", std::bit_cast<std::uint64_t>(o->admission.probability)),
       cereal::make_nvp("seed", o->admission.seed), cereal::make_nvp("sketch_width", o->admission.sketch_width),
       cereal::make_nvp("sketch_depth", o->admission.sketch_depth),
       cereal::make_nvp("sketch_window", o->admission.sketch_window), cereal::make_nvp("ttl_steps", o->ttl_steps),
       cereal::make_nvp("ttl_sweep_steps", o->ttl_sweep_steps), cereal::make_nvp("memory_cap_bytes", o->memory_cap_bytes),
       cereal::make_nvp("virtual_nodes", o->virtual_nodes), cereal::make_nvp("stripes", o->stripes),
       cereal::make_nvp("removal_log_limit", o->removal_log_limit));
  }
  template <class Ar>
  void load(Ar& ar) {
    std::string admission;
    std::uint64_t probability_bits = 0;
    ar(cereal::make_nvp("admission", admission), cereal::make_nvp("pushes", o->admission.pushes),
       cereal::make_nvp("probability_bits", probability_bits), cereal::make_nvp("seed", o->admission.seed),
       cereal::make_nvp("sketch_width", o->admission.sketch_width),
       cereal::make_nvp("sketch_depth", o->admission.sketch_depth),
       cereal::make_nvp("sketch_window", o->admission.sketch_window), cereal::make_nvp("ttl_steps", o->ttl_steps),
       cereal::make_nvp("ttl_sweep_steps", o->ttl_sweep_steps), cereal::make_nvp("memory_cap_bytes", o->memory_cap_bytes),
       cereal::make_nvp("virtual_nodes", o->virtual_nodes), cereal::make_nvp("stripes", o->stripes),
       cereal::make_nvp("removal_log_limit", o->removal_log_limit));
    std::size_t k = 0;
    while (k < std::size(admission_names) && admission != admission_names[k]) ++k;
    if (k == std::size(admission_names)) throw checkpoint_error("an admission '" + admission.substr(0, 64) + "' psx does not know");
    o->admission.kind = static_cast<Admission::Kind>(k);
    o->admission.probability = std::bit_cast<double>(probability_bits);
  }
};

}  // namespace detail

//! A dynamic table as saved: its declaration. Its ids were placed by the
//! consistent-hash ring of the manifest's `num_servers` servers and
//! `options.virtual_nodes` points each; every server's file holds its rows.
struct ManifestTable {
  std::string name;
  std::uint64_t dim = 0;  //!< floats per row
  TableOptions options;
  template <class Ar>
  void serialize(Ar& ar) {
    ar(CEREAL_NVP(name), CEREAL_NVP(dim), cereal::make_nvp("options", detail::TableOptionsFields{&options}));
  }
};

//! A server's shard file as the manifest lists it.
struct ManifestFile {
  std::string name;             //!< in the checkpoint directory
  std::uint64_t bytes = 0;      //!< its size
  std::uint32_t header_crc = 0; //!< its header's CRC-32C, which covers the CRCs of the rest
  template <class Ar>
  void serialize(Ar& ar) {
    ar(CEREAL_NVP(name), CEREAL_NVP(bytes), CEREAL_NVP(header_crc));
  }
};

//! What the chief writes last: a checkpoint is complete once its manifest is.
struct Manifest {
  std::uint32_t format_version = checkpoint::format_version;
  std::uint64_t step = 0;          //!< the global step (the chief's clock) when saved
  std::int64_t created_unix = 0;   //!< seconds since 1970, UTC
  std::uint64_t num_servers = 0;
  std::uint64_t num_workers = 0;
  std::string partitioner;         //!< descriptions (operator<< where the type has one)
  std::string sync_policy;
  std::string optimizer;           //!< includes a schedule wrapped around it
  std::uint64_t optimizer_slots = 0;  //!< floats of state per parameter
  std::vector<ManifestVariable> variables;  //!< the fixed-size (dense and sparse) variables
  std::vector<ManifestFile> files;  //!< one per server, server s at index s
  std::vector<ManifestTable> tables;  //!< the dynamic tables (format 2 on)
  template <class Ar>
  void serialize(Ar& ar) {
    ar(CEREAL_NVP(format_version), CEREAL_NVP(step), CEREAL_NVP(created_unix), CEREAL_NVP(num_servers),
       CEREAL_NVP(num_workers), CEREAL_NVP(partitioner), CEREAL_NVP(sync_policy), CEREAL_NVP(optimizer),
       CEREAL_NVP(optimizer_slots), CEREAL_NVP(variables), CEREAL_NVP(files));
    if (format_version >= 2) ar(CEREAL_NVP(tables));  // read: the version read just above
  }
};

//! A complete checkpoint found on disk.
struct Info {
  std::filesystem::path path;
  std::uint64_t step = 0;
};

namespace detail {

namespace fs = std::filesystem;

// -- the manifest ------------------------------------------------------------------------

inline void write_manifest(const fs::path& dir, const Manifest& m) {
  std::ostringstream os;
  {
    cereal::JSONOutputArchive ar(os);
    ar(cereal::make_nvp("psx_checkpoint", m));
  }
  const std::string json = std::move(os).str() + "\n";
  Header h;
  h.kind = FileKind::manifest;
  h.step = m.step;
  h.meta_bytes = json.size();
  h.meta_crc = ::psx::detail::crc32c(std::as_bytes(std::span(json)));
  h.data_crc = ::psx::detail::crc32c({});
  AtomicFile out(dir / manifest_name);
  out.write(encode_header(h));
  out.write(std::as_bytes(std::span(json)));
  out.commit();
}

inline DType parse_dtype(const std::string& s, const fs::path& file) {
  for (DType d : {DType::float32, DType::bfloat16, DType::float16})
    if (s == dtype_name(d)) return d;
  fail(file, "unknown dtype '" + s + "'");
}

inline std::string shape_text(const std::vector<std::uint64_t>& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// What RapidJSON (under cereal) must never see: JSON nested deeper than any
// psx file writes (it parses recursively, so the stack could run out), and
// numbers that are not integers (psx writes none, and RapidJSON 1.1.0, the
// one Debian has, misparses some, e.g. `0e60`: Tencent/rapidjson#1249).
inline void check_json_depth(std::span<const std::byte> json, const fs::path& file) {
  constexpr int max_depth = 32;
  int depth = 0;
  bool in_string = false, escaped = false;
  char before = 0;
  for (const std::byte b : json) {
    const char c = static_cast<char>(b);
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) fail(file, "bad JSON: nested deeper than " + std::to_string(max_depth) + " levels");
    } else if (c == ']' || c == '}') {
      if (depth > 0) --depth;
    } else if (c == '.' || ((c == 'e' || c == 'E') && before >= '0' && before <= '9')) {
      fail(file, "bad JSON: a number that is not an integer");
    }
    before = c;
  }
}

//! Parses and checks a manifest's JSON (the fuzz target calls this).
inline Manifest decode_manifest(std::span<const std::byte> json, const Header& h, const fs::path& file) {
  check_json_depth(json, file);
  Manifest m;
  try {
    MemoryBuf buf(json);
    std::istream is(&buf);
    cereal::JSONInputArchive ar(is);
    ar(cereal::make_nvp("psx_checkpoint", m));
  } catch (const std::exception& e) {
    fail(file, std::string("bad manifest: ") + e.what());
  }
  if (m.format_version != h.version)
    fail(file, "its header says format " + std::to_string(h.version) + ", its body " + std::to_string(m.format_version));
  if (m.step != h.step) fail(file, "its header says step " + std::to_string(h.step) + ", its body " + std::to_string(m.step));
  if (m.num_servers == 0 || m.files.size() != m.num_servers)
    fail(file, std::to_string(m.files.size()) + " shard files for " + std::to_string(m.num_servers) + " servers");
  // As a shard record's (decode_index): reading a variable without a
  // cluster (load_variable) sizes its buffers by this.
  if (m.optimizer_slots > 64)
    fail(file, "its optimizer keeps " + std::to_string(m.optimizer_slots) + " floats per parameter, more than 64");
  for (std::size_t s = 0; s < m.files.size(); ++s)
    if (m.files[s].name != server_file_name(s))
      fail(file, "shard file " + std::to_string(s) + " is named '" + m.files[s].name + "', expected '" +
                     server_file_name(s) + "'");
  for (const ManifestVariable& v : m.variables) {
    const std::string what = "variable '" + v.name + "'";
    parse_dtype(v.dtype, file);
    std::uint64_t width = 1;
    for (std::size_t i = 1; i < v.shape.size(); ++i) {
      if (v.shape[i] != 0 && width > (std::uint64_t{1} << 60) / v.shape[i]) fail(file, what + ": a shape that overflows");
      width *= v.shape[i];
    }
    if (v.row_width != width)
      fail(file, what + ": rows of " + std::to_string(v.row_width) + " floats for shape " + shape_text(v.shape));
    std::uint64_t expect = 0;
    for (const ManifestShard& s : v.shards) {
      if (s.row_begin != expect || s.row_end <= s.row_begin || s.server >= m.num_servers)
        fail(file, what + ": its shards do not tile its rows (a shard [" + std::to_string(s.row_begin) + ", " +
                       std::to_string(s.row_end) + ") on server " + std::to_string(s.server) + " after row " +
                       std::to_string(expect) + ")");
      expect = s.row_end;
    }
    const std::uint64_t rows = v.shape.empty() ? 1 : v.shape[0];
    if (expect != rows) fail(file, what + ": its shards cover " + std::to_string(expect) + " of " + std::to_string(rows) + " rows");
  }
  for (std::size_t k = 0; k < m.tables.size(); ++k) {
    const ManifestTable& t = m.tables[k];
    const std::string what = "dynamic table '" + t.name.substr(0, 256) + "'";
    if (t.name.empty() || t.name.size() > max_name_bytes) fail(file, "a dynamic table with a name of " + std::to_string(t.name.size()) + " bytes");
    for (std::size_t j = 0; j < k; ++j)
      if (m.tables[j].name == t.name) fail(file, what + " is listed twice");
    for (const ManifestVariable& v : m.variables)
      if (v.name == t.name) fail(file, what + " has the name of a variable too");
    if (t.dim == 0 || t.dim > (std::uint64_t{1} << 20)) fail(file, what + ": rows of " + std::to_string(t.dim) + " floats");
    try {  // the checks of its declaration
      (void)::psx::detail::make_dynamic_meta(embedding(t.name, static_cast<std::size_t>(t.dim), {}, t.options), 0);
    } catch (const std::exception& e) {
      fail(file, what + ": options psx refuses (" + e.what() + ")");
    }
  }
  return m;
}

inline Manifest load_manifest(const fs::path& dir) {
  const fs::path file = dir / manifest_name;
  Verified v = verify_bytes(read_file(file), FileKind::manifest, file);
  return decode_manifest(v.meta, v.header, file);
}

// -- whether a checkpoint restores the declared variables ------------------------------

inline const ManifestVariable* find_variable(const Manifest& m, const std::string& name) {
  for (const ManifestVariable& v : m.variables)
    if (v.name == name) return &v;
  return nullptr;
}

inline const ManifestTable* find_table(const Manifest& m, const std::string& name) {
  for (const ManifestTable& t : m.tables)
    if (t.name == name) return &t;
  return nullptr;
}

inline void check_slots(const Manifest& m, const fs::path& manifest_file, std::size_t num_slots) {
  if (m.optimizer_slots != num_slots)
    fail(manifest_file, "its optimizer (" + m.optimizer + ") keeps " + std::to_string(m.optimizer_slots) +
                            " slots per parameter, this program's " + std::to_string(num_slots));
}

// Whether the checkpoint `m` can restore a variable: it is in it with the
// same shape, dtype and row width, and the optimizer keeps as many slots.
inline void check_variable(const Manifest& m, const fs::path& manifest_file, const ManifestVariable* v,
                           const VariableMeta& meta, std::size_t num_slots) {
  if (!v && find_table(m, meta.name))
    fail(manifest_file, "holds '" + meta.name + "' as a dynamic table, which this program declares as a " +
                            (meta.kind == VariableKind::sparse ? "sparse" : "dense") + " variable");
  if (!v) fail(manifest_file, "has no variable '" + meta.name + "', which this program declares");
  std::vector<std::uint64_t> declared(meta.shape.begin(), meta.shape.end());
  if (v->shape != declared)
    fail(manifest_file, "variable '" + meta.name + "' has shape " + shape_text(v->shape) + ", declared " + shape_text(declared));
  if (v->dtype != dtype_name(meta.dtype))
    fail(manifest_file, "variable '" + meta.name + "' is " + v->dtype + ", declared " + dtype_name(meta.dtype));
  if (v->row_width != meta.row_width)
    fail(manifest_file, "variable '" + meta.name + "' has rows of " + std::to_string(v->row_width) + " floats, declared " +
                            std::to_string(meta.row_width));
  check_slots(m, manifest_file, num_slots);
}

// Whether the checkpoint `m` can restore a dynamic table: it is in it with
// rows as wide, and the optimizer keeps as many slots. Its options may
// differ: the declared ones hold from the restore on (an admission sketch
// of another width or depth starts from zero).
inline void check_table(const Manifest& m, const fs::path& manifest_file, const ManifestTable* t,
                        const VariableMeta& meta, std::size_t num_slots) {
  if (!t && find_variable(m, meta.name))
    fail(manifest_file, "holds '" + meta.name + "' as a " + find_variable(m, meta.name)->kind +
                            " variable, which this program declares as a dynamic table");
  if (!t) fail(manifest_file, "has no dynamic table '" + meta.name + "', which this program declares");
  if (t->dim != meta.row_width)
    fail(manifest_file, "dynamic table '" + meta.name + "' has rows of " + std::to_string(t->dim) + " floats, declared " +
                            std::to_string(meta.row_width));
  check_slots(m, manifest_file, num_slots);
}

// Whether a shard file (of `size` bytes, with header `h`) is the one the
// manifest of step `step` lists as `f`.
inline void check_listed(const fs::path& file, std::uint64_t size, const Header& h, const ManifestFile& f,
                         std::uint64_t step) {
  if (size != f.bytes || h.crc != f.header_crc)
    fail(file, "is not the file the manifest lists (" + std::to_string(size) + " bytes, header CRC " +
                   std::to_string(h.crc) + "; the manifest says " + std::to_string(f.bytes) + " bytes, " +
                   std::to_string(f.header_crc) + ")");
  if (h.step != step) fail(file, "is of step " + std::to_string(h.step) + ", the manifest of step " + std::to_string(step));
}

// What an optimizer's slots mean, from its description: its type's name
// without its settings ("Adagrad{lr=0.1, ...}": "Adagrad"), through a
// schedule (which keeps no state: "Scheduled{Adam{...}, Cosine{...}}" is
// "Adam"), a pruning wrapper kept ("Pruned{SGD{...}, ...}": "Pruned{SGD}").
// Its leading name ends at the first character that is not part of one
// (a user's "MyOpt(lr=0.1)" is "MyOpt"); AdamW keeps Adam's slots.
inline std::string optimizer_kind(std::string_view d) {
  while (d.starts_with("Scheduled{")) d.remove_prefix(10);
  if (d.starts_with("Pruned{")) return "Pruned{" + optimizer_kind(d.substr(7)) + "}";
  std::size_t n = 0;
  while (n < d.size() && (std::isalnum(static_cast<unsigned char>(d[n])) || d[n] == '_' || d[n] == ':')) ++n;
  const std::string name(d.substr(0, n));
  return name == "AdamW" ? "Adam" : name;
}

inline void check_compatible(const Manifest& m, const fs::path& dir, const std::vector<VariableInfo>& variables,
                             std::size_t num_slots, const std::string& optimizer = {}) {
  // The same number of slots is not enough: SGD's momentum restored as
  // Adagrad's accumulator (negative) made parameters NaN.
  if (!optimizer.empty() && num_slots > 0 && optimizer_kind(m.optimizer) != optimizer_kind(optimizer))
    fail(dir / manifest_name, "was saved with optimizer " + m.optimizer + ", whose slots are not those of this "
                              "program's " + optimizer + " (" + optimizer_kind(m.optimizer) + " vs " +
                              optimizer_kind(optimizer) + ")");
  for (const VariableInfo& v : variables) {
    if (v.meta.kind == VariableKind::dynamic) check_table(m, dir / manifest_name, find_table(m, v.meta.name), v.meta, num_slots);
    else check_variable(m, dir / manifest_name, find_variable(m, v.meta.name), v.meta, num_slots);
  }
}

}  // namespace detail

}  // namespace checkpoint

}  // namespace v0
}  // namespace psx

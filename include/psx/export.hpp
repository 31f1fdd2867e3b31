//! @file psx/export.hpp
//! Export for inference: parameters only (trainable and frozen, no optimizer
//! slots) with metadata, in a versioned directory `base/<version>/` that
//! appears whole (written under a temporary name, renamed), the layout
//! TensorFlow Serving watches. A dynamic table is two tensors: its rows
//! (`name`, [rows, dim], sorted by id, stored like any variable's) and
//! their ids (`name.ids`, uint64, ascending). Each version holds the same tensors three
//! ways: `model.psx` (psx's own, checksummed; what `load_export` reads),
//! `model.npz` (`numpy.load`) and `model.safetensors` (the `safetensors`
//! package), plus `metadata.json`. The formats are in docs/formats.md.
//!
//! Options: float16/bfloat16, int8 symmetric quantization per tensor or per
//! output channel (row) with the scales stored, and sparse storage of
//! tensors that are mostly zeros (pruned ones, psx/pruning.hpp).
//!
//! @code
//! psx::ExportOptions options{.base = "export", .precision = psx::ExportPrecision::int8_per_channel};
//! options.signature = {.method = "predict", .inputs = {{"x", "float32", {-1, 784}}}, .outputs = {{"logits", "float32", {-1, 10}}}};
//! const auto dir = psx::export_model(ps, w, options);  // collective, like a checkpoint save
//! const psx::Export model = psx::load_export(dir, {.dequantize = true});
//! @endcode
#pragma once

#include <psx/checkpoint.hpp>
#include <psx/detail/crc32c.hpp>
#include <psx/embedding.hpp>
#include <psx/errors.hpp>
#include <psx/half.hpp>
#include <psx/quantize.hpp>
#include <psx/sync.hpp>
#include <psx/variable.hpp>
#include <psx/worker.hpp>

#include <cereal/archives/json.hpp>
#include <cereal/archives/portable_binary.hpp>
#include <cereal/types/string.hpp>
#include <cereal/types/vector.hpp>

#include <algorithm>
#include <array>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace psx {
inline namespace v0 {

//! How exported tensors are stored.
enum class ExportPrecision : std::uint8_t {
  float32,
  float16,
  bfloat16,
  int8,              //!< symmetric, one scale per tensor (psx/quantize.hpp)
  int8_per_channel,  //!< symmetric, one scale per row (output channel of a [out, in] weight); rank < 2: per tensor
};

//! A tensor of a signature: name, dtype and shape (-1: any size).
struct TensorSpec {
  std::string name;
  std::string dtype = "float32";
  std::vector<std::int64_t> shape;
  template <class Ar>
  void serialize(Ar& ar) {
    ar(CEREAL_NVP(name), CEREAL_NVP(dtype), CEREAL_NVP(shape));
  }
  friend bool operator==(const TensorSpec&, const TensorSpec&) = default;
};

//! What the exported model computes, for whoever serves it (as a
//! SavedModel's signature_def: a method name, named inputs and outputs).
struct Signature {
  std::string method = "predict";
  std::vector<TensorSpec> inputs;
  std::vector<TensorSpec> outputs;
  template <class Ar>
  void serialize(Ar& ar) {
    ar(CEREAL_NVP(method), CEREAL_NVP(inputs), CEREAL_NVP(outputs));
  }
  friend bool operator==(const Signature&, const Signature&) = default;
};

struct ExportOptions {
  //! The base directory; the export goes into `base/<version>/`.
  std::filesystem::path base;
  //! The version directory's number; by default the global step. An existing
  //! version is never overwritten (checkpoint_error).
  std::optional<std::uint64_t> version;
  ExportPrecision precision = ExportPrecision::float32;
  //! Variables (glob patterns) kept in float32 whatever `precision` says (biases, say).
  std::vector<std::string> keep_float32;
  //! Tensors with at least this fraction of zero elements (as stored) are
  //! stored sparsely: flat indices of the others, and their values. Above 1: never.
  double sparse_above = 0.5;
  Signature signature;
  //! Variables exported (glob patterns); empty: every variable.
  std::vector<std::string> variables;
  bool npz = true;
  bool safetensors = true;
};

//! One exported tensor, as stored.
struct ExportedTensor {
  std::string name;
  std::vector<std::uint64_t> shape;
  std::string dtype = "float32";     //!< "float32", "float16", "bfloat16", "int8", or "uint64" (a table's ids)
  std::string quantization = "none"; //!< "none", "per_tensor" or "per_channel"
  std::vector<float> scales;         //!< int8: one, or one per row
  bool trainable = true;
  bool sparse = false;
  std::vector<std::uint64_t> indices;  //!< sparse: increasing flat positions of the stored elements
  std::vector<std::byte> values;       //!< every element (dense) or the stored ones (sparse), in `dtype`

  std::uint64_t elements() const noexcept {
    std::uint64_t n = 1;
    for (auto e : shape) n *= e;
    return n;
  }
  //! Floats per row (int8 per-channel groups): the product of all but the first extent.
  std::uint64_t row_width() const noexcept { return shape.size() < 2 ? elements() : elements() / std::max<std::uint64_t>(shape[0], 1); }
  //! The tensor as dense float32 (int8 dequantized, 16-bit widened, zeros
  //! filled in); config_error for a uint64 tensor (`to_ids`).
  std::vector<float> to_float() const;
  //! A uint64 tensor's elements (a dynamic table's ids); config_error for another dtype.
  std::vector<std::uint64_t> to_ids() const;
};

//! What `metadata.json` says, and `load_export` returns.
struct ExportMetadata {
  std::uint32_t format_version = 1;
  std::uint64_t step = 0;
  std::uint64_t version = 0;
  std::int64_t created_unix = 0;
  Signature signature;
  struct Tensor {
    std::string name;
    std::vector<std::uint64_t> shape;
    std::string dtype, quantization;
    bool trainable = true;
    bool sparse = false;
    std::uint64_t stored = 0;  //!< elements stored (all, or the nonzeros)
    template <class Ar>
    void serialize(Ar& ar) {
      ar(CEREAL_NVP(name), CEREAL_NVP(shape), CEREAL_NVP(dtype), CEREAL_NVP(quantization), CEREAL_NVP(trainable),
         CEREAL_NVP(sparse), CEREAL_NVP(stored));
    }
    friend bool operator==(const Tensor&, const Tensor&) = default;
    //! What metadata.json says of a stored tensor.
    static Tensor of(const ExportedTensor& t) {
      return {t.name, t.shape, t.dtype, t.quantization, t.trainable, t.sparse,
              t.sparse ? t.indices.size() : t.elements()};
    }
  };
  std::vector<Tensor> tensors;
  std::vector<std::string> files;
  template <class Ar>
  void serialize(Ar& ar) {
    ar(CEREAL_NVP(format_version), CEREAL_NVP(step), CEREAL_NVP(version), CEREAL_NVP(created_unix),
       CEREAL_NVP(signature), CEREAL_NVP(tensors), CEREAL_NVP(files));
  }
};

//! A loaded export.
struct Export {
  std::filesystem::path path;
  ExportMetadata metadata;
  std::vector<ExportedTensor> tensors;
  //! The tensor `name`; throws psx::unknown_variable.
  const ExportedTensor& operator[](std::string_view name) const;
};

struct LoadOptions {
  //! Return every tensor as dense float32 (int8 dequantized); a table's ids stay uint64.
  bool dequantize = false;
};

namespace detail::exports {

namespace fs = std::filesystem;
namespace ck = ::psx::checkpoint::detail;

// The newest export format written: 1, fixed-size variables; 2 adds the
// dynamic tables (their ids, the dtype uint64). An export is written in
// the oldest format that holds it, so one without a table stays readable
// by a psx that reads format 1 only.
inline constexpr std::uint32_t format_version = 2;

inline std::size_t dtype_bytes(const std::string& d) {
  return d == "float32" ? 4 : d == "int8" ? 1 : d == "uint64" ? 8 : 2;
}

// A variable's values, as read from the cluster or a checkpoint; a dynamic
// table's rows ([rows, dim]) sorted by id, with `ids` ascending.
struct Source {
  std::string name;
  std::vector<std::uint64_t> shape;
  bool trainable = true;
  std::vector<float> values;
  bool table = false;
  std::vector<std::uint64_t> ids;
};

// A table's export (TableExport, in no order) as a Source: rows sorted by id.
inline Source table_source(const std::string& name, bool trainable, const TableExport& e) {
  std::vector<std::size_t> order(e.ids.size());
  for (std::size_t k = 0; k < order.size(); ++k) order[k] = k;
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return e.ids[a] < e.ids[b]; });
  Source s{name, {e.ids.size(), e.dim}, trainable, std::vector<float>(e.values.size()), true,
           std::vector<std::uint64_t>(e.ids.size())};
  for (std::size_t k = 0; k < order.size(); ++k) {
    s.ids[k] = e.ids[order[k]];
    if (e.dim) std::memcpy(s.values.data() + k * e.dim, e.values.data() + order[k] * e.dim, e.dim * sizeof(float));
  }
  return s;
}

// A table's ids as a tensor of their own (`name.ids`).
inline ExportedTensor ids_tensor(const Source& s) {
  ExportedTensor t;
  t.name = s.name + ".ids";
  t.shape = {s.ids.size()};
  t.dtype = "uint64";
  t.trainable = s.trainable;
  t.values.resize(s.ids.size() * sizeof(std::uint64_t));
  if (!s.ids.empty()) std::memcpy(t.values.data(), s.ids.data(), t.values.size());
  return t;
}

inline bool matches(const std::vector<std::string>& patterns, const std::string& name) {
  return std::any_of(patterns.begin(), patterns.end(),
                     [&](const std::string& p) { return ::psx::sync::detail::glob_match(p, name); });
}

// Elements of `e` bytes (as a dtype stores them) that are zero, of either
// sign: float32 without its sign bit, the 16-bit types likewise, int8 and
// uint64 as they are.
inline bool zero_at(const std::byte* p, std::size_t e) noexcept {
  if (e == 4) return (ck::get<std::uint32_t>(p) & 0x7fffffffu) == 0;
  if (e == 2) return (ck::get<std::uint16_t>(p) & 0x7fffu) == 0;
  if (e == 8) return ck::get<std::uint64_t>(p) == 0;
  return *p == std::byte{0};
}
inline std::size_t count_zeros(std::span<const std::byte> values, std::size_t e) noexcept {
  std::size_t zeros = 0;
  const std::size_t n = values.size() / e;
  // One loop per width (the compiler vectorizes them): this runs over
  // every exported element.
  if (e == 4) {
    for (std::size_t i = 0; i < n; ++i) zeros += (ck::get<std::uint32_t>(values.data() + 4 * i) & 0x7fffffffu) == 0;
  } else if (e == 2) {
    for (std::size_t i = 0; i < n; ++i) zeros += (ck::get<std::uint16_t>(values.data() + 2 * i) & 0x7fffu) == 0;
  } else {
    for (std::size_t i = 0; i < n; ++i) zeros += zero_at(values.data() + e * i, e);
  }
  return zeros;
}

// The tensor `s` is stored as, as `o` says. With `borrow`, a float32 tensor
// stored whole is not copied: its `values` stay empty and its bytes are
// the source's floats (`stored_bytes`), which must then outlive it.
inline ExportedTensor convert(const Source& s, const ExportOptions& o, bool borrow = false) {
  ExportedTensor t;
  t.name = s.name;
  t.shape = s.shape;
  t.trainable = s.trainable;
  const std::size_t n = s.values.size();
  const ExportPrecision p = matches(o.keep_float32, s.name) ? ExportPrecision::float32 : o.precision;
  std::span<const std::byte> as_stored;
  switch (p) {
    case ExportPrecision::float32:
      if (borrow) {
        as_stored = std::as_bytes(std::span(s.values));
      } else {
        t.values.resize(n * 4);
        if (n) std::memcpy(t.values.data(), s.values.data(), n * 4);
      }
      break;
    case ExportPrecision::float16:
    case ExportPrecision::bfloat16: {
      t.dtype = p == ExportPrecision::float16 ? "float16" : "bfloat16";
      std::vector<std::uint16_t> bits(n);
      ::psx::detail::to_low(p == ExportPrecision::float16 ? DType::float16 : DType::bfloat16, s.values.data(),
                            bits.data(), n);
      t.values.resize(n * 2);
      if (n) std::memcpy(t.values.data(), bits.data(), n * 2);
      break;
    }
    case ExportPrecision::int8:
    case ExportPrecision::int8_per_channel: {
      // int8 has no infinity or NaN: an infinite value would make the scale
      // infinite and every value of its tensor (or row) NaN, a NaN would
      // become 0, either without a word.
      for (std::size_t i = 0; i < n; ++i)
        if (!std::isfinite(s.values[i]))
          throw checkpoint_error("psx: export: variable '" + s.name + "' has " +
                                 (std::isnan(s.values[i]) ? "NaN" : "an infinity") + " at element " +
                                 std::to_string(i) + ", which int8 cannot hold; export it in float32 "
                                 "(ExportOptions::keep_float32) or fix the parameter");
      const bool per_channel = p == ExportPrecision::int8_per_channel && s.shape.size() >= 2;
      const std::size_t rows = per_channel ? s.shape[0] : 1;
      const auto q = quantize_int8(s.values, rows, rows ? n / rows : 0, per_channel);
      t.dtype = "int8";
      t.quantization = per_channel ? "per_channel" : "per_tensor";
      t.scales = q.scales;
      t.values.resize(n);
      if (n) std::memcpy(t.values.data(), q.values.data(), n);
      break;
    }
  }
  if (as_stored.empty()) as_stored = t.values;
  // Mostly zeros: keep the others only.
  const std::size_t e = dtype_bytes(t.dtype);
  const std::size_t zeros = count_zeros(as_stored, e);
  if (n > 0 && static_cast<double>(zeros) >= o.sparse_above * static_cast<double>(n)) {
    std::vector<std::byte> kept((n - zeros) * e);
    t.indices.reserve(n - zeros);
    for (std::size_t i = 0; i < n; ++i)
      if (!zero_at(as_stored.data() + i * e, e)) {
        std::memcpy(kept.data() + t.indices.size() * e, as_stored.data() + i * e, e);
        t.indices.push_back(i);
      }
    t.values = std::move(kept);
    t.sparse = true;
  }
  return t;
}

// The bytes `t` stores: its own values, or the floats of the source it was
// converted from with `borrow`.
inline std::span<const std::byte> stored_bytes(const ExportedTensor& t, const Source& s) noexcept {
  if (t.values.empty() && !t.sparse && t.dtype == "float32") return std::as_bytes(std::span(s.values));
  return t.values;
}

// A tensor as the files get it: its description and its stored bytes.
struct Written {
  const ExportedTensor* tensor = nullptr;
  std::span<const std::byte> values;
};

inline std::vector<Written> written(const std::vector<ExportedTensor>& tensors) {
  std::vector<Written> out;
  out.reserve(tensors.size());
  for (const ExportedTensor& t : tensors) out.push_back({&t, t.values});
  return out;
}

// -- model.psx: the checkpoint envelope, kind 3 ------------------------------------

inline std::string encode_index(std::span<const Written> tensors, std::uint64_t& data_bytes) {
  std::ostringstream os;
  data_bytes = 0;
  {
    cereal::PortableBinaryOutputArchive ar(os, cereal::PortableBinaryOutputArchive::Options::LittleEndian());
    ar(static_cast<std::uint64_t>(tensors.size()));
    for (const Written& w : tensors) {
      const ExportedTensor& t = *w.tensor;
      std::string name = t.name, dtype = t.dtype, quant = t.quantization;
      ar(ck::BoundedString{&name}, ck::BoundedString{&dtype}, ck::BoundedString{&quant},
         static_cast<std::uint64_t>(t.shape.size()));
      for (auto e : t.shape) ar(e);
      ar(static_cast<std::uint64_t>(t.scales.size()));
      for (float s : t.scales) ar(s);
      ar(t.trainable, t.sparse, static_cast<std::uint64_t>(t.indices.size()), static_cast<std::uint64_t>(w.values.size()));
      data_bytes += t.indices.size() * 8 + w.values.size();
    }
  }
  return std::move(os).str();
}

//! Parses a model.psx index and takes each tensor's bytes from `data`;
//! throws checkpoint_error (the fuzz target calls decode_model).
//!
//! The general form (decode_model_with): the data part has `data_bytes` bytes, and `take(at,
//! out, n)` puts its `n` bytes at offset `at` into the vector `out` (each
//! byte of it once, in order: a reader from a file may CRC them as they
//! pass); `taken()` is called once they all are, before the sparse indices
//! read are checked (a reader checks their CRC there first).
template <class Take, class Taken>
std::vector<ExportedTensor> decode_model_with(std::span<const std::byte> meta, std::uint64_t data_bytes,
                                              const fs::path& file, std::uint32_t version, Take&& take, Taken&& taken) {
  std::vector<ExportedTensor> out;
  std::uint64_t at = 0;
  auto bounded = [&](std::uint64_t n, std::uint64_t each, const char* what) {
    if (n > meta.size() / each) ck::fail(file, "its index claims " + std::to_string(n) + " " + what + ", more than it can hold");
  };
  try {
    ck::MemoryBuf buf(meta);
    std::istream is(&buf);
    cereal::PortableBinaryInputArchive ar(is, cereal::PortableBinaryInputArchive::Options::LittleEndian());
    std::uint64_t count = 0;
    ar(count);
    bounded(count, 40, "tensors");
    out.resize(count);
    for (ExportedTensor& t : out) {
      std::uint64_t rank = 0, scales = 0, indices = 0, bytes = 0;
      ar(ck::BoundedString{&t.name}, ck::BoundedString{&t.dtype}, ck::BoundedString{&t.quantization}, rank);
      bounded(rank, 8, "extents");
      t.shape.resize(rank);
      for (auto& e : t.shape) ar(e);
      ar(scales);
      bounded(scales, 4, "scales");
      t.scales.resize(scales);
      for (float& s : t.scales) ar(s);
      std::uint8_t trainable = 0, sparse = 0;  // cereal writes a bool as one byte; any other value is refused
      ar(trainable, sparse, indices, bytes);
      const std::string what = "tensor '" + t.name + "'";
      if (trainable > 1 || sparse > 1) ck::fail(file, what + ": a flag byte that is neither 0 nor 1");
      t.trainable = trainable == 1;
      t.sparse = sparse == 1;
      if (t.dtype != "float32" && t.dtype != "float16" && t.dtype != "bfloat16" && t.dtype != "int8" &&
          (t.dtype != "uint64" || version < 2))
        ck::fail(file, what + ": unknown dtype '" + t.dtype + "'" +
                           (t.dtype == "uint64" ? " in export format " + std::to_string(version) : std::string()));
      if (t.dtype == "uint64" && t.sparse) ck::fail(file, what + ": a uint64 tensor stored sparsely");
      std::uint64_t elements = 1;
      for (auto e : t.shape) {
        if (e != 0 && elements > (std::uint64_t{1} << 60) / e) ck::fail(file, what + ": a shape that overflows");
        elements *= e;
      }
      const std::uint64_t e = dtype_bytes(t.dtype);
      const std::uint64_t stored = t.sparse ? indices : elements;
      if (indices > data_bytes / 8 || (!t.sparse && indices != 0) || stored > elements ||
          bytes != stored * e || at > data_bytes || indices * 8 + bytes > data_bytes - at)
        ck::fail(file, what + ": " + std::to_string(indices) + " indices and " + std::to_string(bytes) +
                           " bytes do not fit its shape or the data part");
      const bool q = t.dtype == "int8";
      const std::uint64_t groups = t.quantization == "per_channel" ? (t.shape.empty() ? 1 : t.shape[0]) : 1;
      if (q != (t.quantization != "none") || (q && scales != groups) || (!q && scales != 0) ||
          (t.quantization != "none" && t.quantization != "per_tensor" && t.quantization != "per_channel"))
        ck::fail(file, what + ": quantization '" + t.quantization + "' with " + std::to_string(scales) + " scales for " +
                           t.dtype);
      if (indices) {
        std::vector<std::byte> raw;
        take(at, raw, static_cast<std::size_t>(indices * 8));
        t.indices.resize(indices);
        std::memcpy(t.indices.data(), raw.data(), raw.size());
      }
      at += indices * 8;
      take(at, t.values, static_cast<std::size_t>(bytes));
      at += bytes;
    }
    if (is.rdbuf()->in_avail() != 0) ck::fail(file, "bytes after its index");
  } catch (const checkpoint_error& e) {
    const std::string what = e.what();
    if (what.rfind("psx: checkpoint file", 0) == 0) throw;
    ck::fail(file, "bad index: " + what);  // a BoundedString's refusal
  } catch (const std::exception& e) {
    ck::fail(file, std::string("bad index: ") + e.what());
  }
  if (at != data_bytes) ck::fail(file, std::to_string(data_bytes - at) + " data bytes no tensor claims");
  taken();
  for (const ExportedTensor& t : out) {
    const std::uint64_t elements = t.elements();
    for (std::size_t i = 0; i < t.indices.size(); ++i)
      if (t.indices[i] >= elements || (i > 0 && t.indices[i] <= t.indices[i - 1]))
        ck::fail(file, "tensor '" + t.name + "': sparse indices out of order or beyond its " + std::to_string(elements) +
                           " elements");
  }
  return out;
}

inline std::vector<ExportedTensor> decode_model(std::span<const std::byte> meta, std::span<const std::byte> data,
                                                const fs::path& file, std::uint32_t version = format_version) {
  return decode_model_with(
      meta, data.size(), file, version,
      [&](std::uint64_t at, std::vector<std::byte>& out, std::size_t n) {
        const auto from = data.begin() + static_cast<std::ptrdiff_t>(at);
        out.assign(from, from + static_cast<std::ptrdiff_t>(n));
      },
      [] {});
}

inline void write_model(const fs::path& file, std::span<const Written> tensors, std::uint64_t step,
                        std::uint32_t version) {
  ck::Header h;
  h.version = version;
  h.kind = ck::FileKind::exported;
  h.step = step;
  const std::string index = encode_index(tensors, h.data_bytes);
  h.meta_bytes = index.size();
  h.meta_crc = ::psx::detail::crc32c(std::as_bytes(std::span(index)));
  ck::AtomicFile out(file);
  std::array<std::byte, ck::header_bytes> zero{};
  out.write(zero);  // the real header, with the data's CRC, goes in last
  out.write(std::as_bytes(std::span(index)));
  // One pass: a block at a time CRC'd while in cache, then written.
  std::uint32_t crc = 0;
  for (const Written& w : tensors) {
    crc = out.write_summed(std::as_bytes(std::span(w.tensor->indices)), crc, ::psx::detail::crc32c);
    crc = out.write_summed(w.values, crc, ::psx::detail::crc32c);
  }
  h.data_crc = crc;
  out.write_at(0, ck::encode_header(h));
  out.commit();
}
inline void write_model(const fs::path& file, const std::vector<ExportedTensor>& tensors, std::uint64_t step,
                        std::uint32_t version) {
  write_model(file, written(tensors), step, version);
}

// -- model.npz: a zip (stored) of .npy arrays ----------------------------------------

inline std::string npy_header(const char* descr, const std::vector<std::uint64_t>& shape) {
  std::string dict = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (";
  for (std::size_t i = 0; i < shape.size(); ++i) dict += std::to_string(shape[i]) + (shape.size() == 1 ? "," : i + 1 < shape.size() ? ", " : "");
  dict += "), }";
  std::size_t total = 10 + dict.size() + 1;  // magic, version, length, dict, newline
  dict.append((64 - total % 64) % 64, ' ');
  dict += '\n';
  std::string out("\x93NUMPY\x01\x00", 8);
  const auto len = static_cast<std::uint16_t>(dict.size());
  out += static_cast<char>(len & 0xff);
  out += static_cast<char>(len >> 8);
  return out + dict;
}

// A zip archive of stored (uncompressed) members, written as it goes: each
// member's bytes once, CRC'd a block at a time while in cache, its local
// header's CRC written in after them. ZIP64 (APPNOTE 4.5) where a member,
// an offset or the member count needs it, and only there: an archive that
// fits classic zip stays classic zip.
class ZipWriter {
 public:
  explicit ZipWriter(const fs::path& file) : out_(file), file_(file) {}
  void add(const std::string& name, const std::string& head, std::span<const std::byte> body) {
    const std::uint64_t size = head.size() + body.size();
    if (name.size() > 0xffffu) ck::fail(file_, "an .npz member name over 65535 bytes: zip has no room for it");
    const bool big = size >= 0xffffffffu;           // its sizes in a ZIP64 extra field
    const bool far = offset_ >= 0xffffffffu;        // its header's offset, likewise (central directory)
    std::string local;
    put32(local, 0x04034b50);
    // Flag bit 11: the name is UTF-8 (else readers take it as code page 437).
    const bool utf8 = std::any_of(name.begin(), name.end(), [](char c) { return static_cast<unsigned char>(c) >= 0x80; });
    const std::uint16_t flags = utf8 ? 0x0800 : 0;
    const std::uint16_t needed = big || far ? 45 : 20;  // 4.5: ZIP64
    put16(local, needed);
    put16(local, flags);
    put16(local, 0);     // stored
    put16(local, 0);     // time
    put16(local, 0x21);  // date: 1980-01-01
    put32(local, 0);     // CRC-32, written in once the body is
    put32(local, big ? 0xffffffffu : static_cast<std::uint32_t>(size));
    put32(local, big ? 0xffffffffu : static_cast<std::uint32_t>(size));
    put16(local, static_cast<std::uint16_t>(name.size()));
    put16(local, big ? 20 : 0);
    local += name;
    if (big) {
      put16(local, 0x0001);  // the ZIP64 extra field: original and compressed sizes
      put16(local, 16);
      put64(local, size);
      put64(local, size);
    }
    out_.write(std::as_bytes(std::span(local)));
    std::uint32_t crc = out_.write_summed(std::as_bytes(std::span(head)), 0, ::psx::detail::crc32_ieee);
    crc = out_.write_summed(body, crc, ::psx::detail::crc32_ieee);
    std::string crc_bytes;
    put32(crc_bytes, crc);
    out_.write_at(static_cast<std::size_t>(offset_) + 14, std::as_bytes(std::span(crc_bytes)));
    std::string central;
    put32(central, 0x02014b50);
    put16(central, needed);  // made by (MS-DOS, this version)
    put16(central, needed);
    put16(central, flags);
    put16(central, 0);
    put16(central, 0);
    put16(central, 0x21);
    put32(central, crc);
    put32(central, big ? 0xffffffffu : static_cast<std::uint32_t>(size));
    put32(central, big ? 0xffffffffu : static_cast<std::uint32_t>(size));
    put16(central, static_cast<std::uint16_t>(name.size()));
    put16(central, static_cast<std::uint16_t>((big ? 16 : 0) + (far ? 8 : 0) + (big || far ? 4 : 0)));
    put16(central, 0);  // comment
    put16(central, 0);  // disk
    put16(central, 0);  // internal attributes
    put32(central, 0);  // external attributes
    put32(central, far ? 0xffffffffu : static_cast<std::uint32_t>(offset_));
    central += name;
    if (big || far) {  // the fields set to 0xffffffff above, in this order
      put16(central, 0x0001);
      put16(central, static_cast<std::uint16_t>((big ? 16 : 0) + (far ? 8 : 0)));
      if (big) {
        put64(central, size);
        put64(central, size);
      }
      if (far) put64(central, offset_);
    }
    directory_ += central;
    offset_ += local.size() + size;
    ++entries_;
  }
  void finish() {
    const std::uint64_t at = offset_;
    const bool zip64 = entries_ >= 0xffffu || at >= 0xffffffffu || directory_.size() >= 0xffffffffu;
    std::string end;
    if (zip64) {
      put32(end, 0x06064b50);  // the ZIP64 end of central directory record
      put64(end, 44);          // its size after this field
      put16(end, 45);
      put16(end, 45);
      put32(end, 0);
      put32(end, 0);
      put64(end, entries_);
      put64(end, entries_);
      put64(end, directory_.size());
      put64(end, at);
      put32(end, 0x07064b50);  // its locator
      put32(end, 0);
      put64(end, at + directory_.size());
      put32(end, 1);
    }
    put32(end, 0x06054b50);
    put16(end, 0);
    put16(end, 0);
    put16(end, static_cast<std::uint16_t>(std::min<std::uint64_t>(entries_, 0xffffu)));
    put16(end, static_cast<std::uint16_t>(std::min<std::uint64_t>(entries_, 0xffffu)));
    put32(end, static_cast<std::uint32_t>(std::min<std::uint64_t>(directory_.size(), 0xffffffffu)));
    put32(end, static_cast<std::uint32_t>(std::min<std::uint64_t>(at, 0xffffffffu)));
    put16(end, 0);
    out_.write(std::as_bytes(std::span(directory_)));
    out_.write(std::as_bytes(std::span(end)));
    out_.commit();
  }

 private:
  static void put16(std::string& s, std::uint16_t v) { s.append(reinterpret_cast<const char*>(&v), 2); }
  static void put32(std::string& s, std::uint32_t v) { s.append(reinterpret_cast<const char*>(&v), 4); }
  static void put64(std::string& s, std::uint64_t v) { s.append(reinterpret_cast<const char*>(&v), 8); }
  ck::AtomicFile out_;
  fs::path file_;
  std::string directory_;
  std::uint64_t offset_ = 0;
  std::uint64_t entries_ = 0;
};

inline const char* npy_descr(const std::string& dtype) {
  return dtype == "float32" ? "<f4"
         : dtype == "float16" ? "<f2"
         : dtype == "int8"    ? "|i1"
         : dtype == "uint64"  ? "<u8"
                              : "<u2";  // bfloat16: its bits
}

// Whether `name`, as a zip member's path, could be written outside the
// directory it is unzipped into: absolute ("/x", or a Windows drive "C:x"),
// with a ".." part, or with a backslash or NUL (separators and terminators
// to some unzippers). A ':' elsewhere ("dense/kernel:0") is kept.
inline bool escapes_directory(std::string_view name) {
  if (name.starts_with('/') || name.find('\\') != std::string_view::npos || name.find('\0') != std::string_view::npos)
    return true;
  const auto letter = [](char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); };
  if (name.size() >= 2 && letter(name[0]) && name[1] == ':') return true;
  for (std::size_t at = 0; at <= name.size();) {
    const std::size_t end = std::min(name.find('/', at), name.size());
    if (name.substr(at, end - at) == "..") return true;
    at = end + 1;
  }
  return false;
}

inline void write_npz(const fs::path& file, std::span<const Written> tensors) {
  ZipWriter zip(file);
  for (const Written& w : tensors) {
    const ExportedTensor& t = *w.tensor;
    const std::vector<std::uint64_t> stored = t.sparse ? std::vector<std::uint64_t>{t.indices.size()} : t.shape;
    zip.add(t.name + (t.sparse ? ".values" : "") + ".npy", npy_header(npy_descr(t.dtype), stored), w.values);
    if (t.sparse) {
      zip.add(t.name + ".indices.npy", npy_header("<u8", {t.indices.size()}), std::as_bytes(std::span(t.indices)));
      zip.add(t.name + ".shape.npy", npy_header("<u8", {t.shape.size()}), std::as_bytes(std::span(t.shape)));
    }
    if (!t.scales.empty())
      zip.add(t.name + ".scale.npy", npy_header("<f4", {t.scales.size()}), std::as_bytes(std::span(t.scales)));
  }
  zip.finish();
}

// -- model.safetensors ----------------------------------------------------------------

inline std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') out += '\\', out += c;
    else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
      out += buf;
    } else out += c;
  }
  return out + "\"";
}

inline void write_safetensors(const fs::path& file, std::span<const Written> tensors,
                              const std::string& metadata_json) {
  struct Entry {
    std::string name, dtype;
    std::vector<std::uint64_t> shape;
    std::span<const std::byte> bytes;
  };
  std::vector<Entry> entries;
  auto st = [](const std::string& d) {
    return d == "float32" ? "F32" : d == "float16" ? "F16" : d == "int8" ? "I8" : d == "uint64" ? "U64" : "BF16";
  };
  for (const Written& w : tensors) {
    const ExportedTensor& t = *w.tensor;
    if (t.sparse) {
      entries.push_back({t.name + ".values", st(t.dtype), {t.indices.size()}, w.values});
      entries.push_back({t.name + ".indices", "U64", {t.indices.size()}, std::as_bytes(std::span(t.indices))});
      entries.push_back({t.name + ".shape", "U64", {t.shape.size()}, std::as_bytes(std::span(t.shape))});
    } else {
      entries.push_back({t.name, st(t.dtype), t.shape, w.values});
    }
    if (!t.scales.empty()) entries.push_back({t.name + ".scale", "F32", {t.scales.size()}, std::as_bytes(std::span(t.scales))});
  }
  std::string head = "{\"__metadata__\":{\"psx\":" + json_string(metadata_json) + "}";
  std::uint64_t at = 0;
  for (const Entry& e : entries) {
    head += "," + json_string(e.name) + ":{\"dtype\":\"" + e.dtype + "\",\"shape\":[";
    for (std::size_t i = 0; i < e.shape.size(); ++i) head += (i ? "," : "") + std::to_string(e.shape[i]);
    head += "],\"data_offsets\":[" + std::to_string(at) + "," + std::to_string(at + e.bytes.size()) + "]}";
    at += e.bytes.size();
  }
  head += "}";
  head.append((8 - head.size() % 8) % 8, ' ');
  ck::AtomicFile out(file);
  const std::uint64_t n = head.size();
  out.write(std::as_bytes(std::span(&n, 1)));
  out.write(std::as_bytes(std::span(head)));
  for (const Entry& e : entries) out.write(e.bytes);
  out.commit();
}

// -- the version directory -------------------------------------------------------------

inline fs::path write_export(std::vector<Source> sources, std::uint64_t step, const ExportOptions& o) {
  if (o.base.empty()) throw config_error("psx: ExportOptions::base is empty");
  const fs::path base = fs::absolute(o.base);
  const std::uint64_t version = o.version.value_or(step);
  const fs::path final_dir = base / std::to_string(version);
  try {
    if (fs::exists(final_dir)) ck::fail(final_dir, "exists: an export version is never overwritten");
  } catch (const fs::filesystem_error& e) {
    throw checkpoint_error("psx: export into " + base.string() + ": " + e.what());
  }
  // A float32 tensor stored whole is written from its source's floats (no
  // copy); a source converted to another dtype is let go of at once. So an
  // export holds each variable once, and one converted copy at a time.
  std::deque<ExportedTensor> tensors;  // stable addresses: `files` points at them
  std::vector<Written> files;
  std::vector<std::string> owner;  // per tensor, the variable it stores (a table's ids: the table)
  bool tables = false;
  for (Source& s : sources)
    if (o.variables.empty() || matches(o.variables, s.name)) {
      const ExportedTensor& t = tensors.emplace_back(convert(s, o, true));
      files.push_back({&t, stored_bytes(t, s)});
      if (files.back().values.data() != static_cast<const void*>(s.values.data())) std::vector<float>().swap(s.values);
      owner.push_back(s.name);
      if (s.table) {
        const ExportedTensor& ids = tensors.emplace_back(ids_tensor(s));
        files.push_back({&ids, ids.values});
        owner.push_back(s.name);
      }
      tables = tables || s.table;
    }
  const std::uint32_t written_format = tables ? 2 : 1;
  // The names the files use, the extra ones included (.npz and .safetensors):
  // a variable named like another's scales or indices would overwrite them.
  std::map<std::string, std::string> names;
  if (o.safetensors) names.emplace("__metadata__", "");  // the safetensors header's own key
  for (std::size_t k = 0; k < tensors.size(); ++k) {
    const ExportedTensor& t = tensors[k];
    // A zip member is a path to whoever unzips model.npz: one that leaves the
    // directory it is unzipped into ("zip slip") is refused.
    if (o.npz && escapes_directory(t.name))
      throw config_error("psx: export: variable " + json_string(owner[k]) +  // quoted: a NUL would end what()
                         " would name an .npz member outside the archive's directory (an absolute path or drive, "
                         "a '..' part, a backslash or a NUL); rename it or export without npz");
    std::vector<std::string> own = {t.name};
    if (t.sparse) own = {t.name + ".values", t.name + ".indices", t.name + ".shape"};
    if (!t.scales.empty()) own.push_back(t.name + ".scale");
    for (const std::string& n : own)
      if (!names.emplace(n, owner[k]).second)
        throw config_error(names[n].empty()
                               ? "psx: export: variable '" + owner[k] + "' takes the name '" + n +
                                     "', which model.safetensors keeps for its metadata; rename it or export "
                                     "without safetensors"
                               : "psx: export: '" + n + "' names a tensor of variable '" + owner[k] +
                                     "' and of variable '" + names[n] + "'; rename one");
  }
  ExportMetadata m;
  m.format_version = written_format;
  m.step = step;
  m.version = version;
  m.created_unix =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  m.signature = o.signature;
  for (const ExportedTensor& t : tensors) m.tensors.push_back(ExportMetadata::Tensor::of(t));
  m.files = {"metadata.json", "model.psx"};
  if (o.npz) m.files.push_back("model.npz");
  if (o.safetensors) m.files.push_back("model.safetensors");
  std::ostringstream os;
  {
    cereal::JSONOutputArchive ar(os);
    ar(cereal::make_nvp("psx_export", m));
  }
  const std::string json = std::move(os).str() + "\n";
  // TensorFlow Serving loads any numeric directory it sees: the version
  // is written under a dotted name and renamed when complete.
  const fs::path temp = base / (".tmp-" + std::to_string(version) + "-" + std::to_string(ck::random64()));
  try {  // only now that nothing is refused: a refused export leaves no trace
    fs::create_directories(base);
    fs::create_directory(temp);
  } catch (const fs::filesystem_error& e) {
    throw checkpoint_error("psx: export into " + base.string() + ": " + e.what());
  }
  try {
    {
      ck::AtomicFile meta(temp / "metadata.json");
      meta.write(std::as_bytes(std::span(json)));
      meta.commit();
    }
    write_model(temp / "model.psx", files, step, written_format);
    if (o.npz) write_npz(temp / "model.npz", files);
    if (o.safetensors) write_safetensors(temp / "model.safetensors", files, json);
    ck::fsync_path(temp, true);
    ck::rename_path(temp, final_dir);
    ck::fsync_path(base, true);
  } catch (const fs::filesystem_error& e) {
    std::error_code ec;
    fs::remove_all(temp, ec);
    throw checkpoint_error("psx: export into " + base.string() + ": " + e.what());
  } catch (...) {
    std::error_code ec;
    fs::remove_all(temp, ec);
    throw;
  }
  return final_dir;
}

}  // namespace detail::exports

inline std::vector<float> ExportedTensor::to_float() const {
  if (dtype == "uint64")
    throw config_error("psx: tensor '" + name + "' holds uint64 values (a dynamic table's ids): read them with to_ids()");
  const std::size_t n = elements();
  // A sparse tensor's shape is not bounded by its file: a damaged or
  // crafted one may claim more than memory holds. (A dense one is its
  // stored elements, made into floats with no second buffer.)
  std::vector<float> out;
  if (sparse) {
    try {
      out.assign(n, 0.0f);
    } catch (const std::exception& e) {  // bad_alloc, length_error
      throw checkpoint_error("psx: tensor '" + name + "' of " + std::to_string(n) +
                             " elements does not fit in memory as float32 (" + std::to_string(indices.size()) +
                             " stored): " + e.what());
    }
  }
  const std::size_t stored = sparse ? indices.size() : n;
  std::vector<float> dense(stored);
  if (dtype == "float32") {
    if (stored) std::memcpy(dense.data(), values.data(), stored * 4);
  } else if (dtype == "int8") {
    const std::uint64_t width = quantization == "per_channel" ? row_width() : std::max<std::uint64_t>(n, 1);
    for (std::size_t i = 0; i < stored; ++i) {
      const std::size_t at = sparse ? indices[i] : i;
      const float scale = scales[quantization == "per_channel" ? at / width : 0];
      dense[i] = static_cast<float>(static_cast<std::int8_t>(values[i])) * scale;
    }
  } else {
    std::vector<std::uint16_t> bits(stored);
    if (stored) std::memcpy(bits.data(), values.data(), stored * 2);
    ::psx::detail::from_low(dtype == "float16" ? DType::float16 : DType::bfloat16, bits.data(), dense.data(), stored);
  }
  if (!sparse) return dense;
  for (std::size_t i = 0; i < stored; ++i) out[indices[i]] = dense[i];
  return out;
}

inline std::vector<std::uint64_t> ExportedTensor::to_ids() const {
  if (dtype != "uint64")
    throw config_error("psx: tensor '" + name + "' holds " + dtype + " values, not uint64 ids: read them with to_float()");
  std::vector<std::uint64_t> out(values.size() / sizeof(std::uint64_t));
  if (!out.empty()) std::memcpy(out.data(), values.data(), out.size() * sizeof(std::uint64_t));
  return out;
}

inline const ExportedTensor& Export::operator[](std::string_view name) const {
  for (const ExportedTensor& t : tensors)
    if (t.name == name) return t;
  throw unknown_variable("psx: export " + path.string() + " has no tensor '" + std::string(name) + "'");
}

//! Exports the cluster's variables into `options.base/<version>/`; returns
//! that directory. Collective like a checkpoint save: every worker calls it
//! at the same step, the chief reads every variable (a dynamic table with
//! `Worker::export_table`, from every server over the transport) and
//! writes, the others wait on barriers. An export that fails throws on
//! every worker (the chief's own error on the chief); the base directory
//! then holds no new version.
template <class PS>
std::filesystem::path export_model(const PS&, Worker& w, const ExportOptions& options) {
  const std::uint64_t step = w.clock();
  const std::filesystem::path dir =
      std::filesystem::absolute(options.base) / std::to_string(options.version.value_or(step));
  w.barrier();
  // Everyone learns whether it was written.
  checkpoint::detail::on_chief(w, "export into " + dir.string(), [&] {
    std::vector<detail::exports::Source> sources, tables;  // the tables after the others, as export_checkpoint has them
    for (const VariableInfo& v : ::psx::detail::WorkerAccess::variables(w)) {
      if (!options.variables.empty() && !detail::exports::matches(options.variables, v.meta.name)) continue;
      if (v.meta.kind == VariableKind::dynamic) {  // its rows now, sorted by id
        tables.push_back(detail::exports::table_source(v.meta.name, v.trainable, w.export_table(v.meta.name)));
        continue;
      }
      detail::exports::Source s{v.meta.name, {v.meta.shape.begin(), v.meta.shape.end()}, v.trainable,
                                std::vector<float>(v.meta.size()), false, {}};
      ::psx::detail::WorkerAccess::read(w, v.meta.name, s.values);
      sources.push_back(std::move(s));
    }
    for (auto& t : tables) sources.push_back(std::move(t));
    detail::exports::write_export(std::move(sources), step, options);
  });
  return dir;
}

//! Exports a checkpoint's variables, without a cluster; returns the version
//! directory. Its dynamic tables are read whole (checkpoint::load_table:
//! every server's file) and exported as `export_model` exports them.
inline std::filesystem::path export_checkpoint(const std::filesystem::path& checkpoint_dir, const ExportOptions& options) {
  const checkpoint::Manifest m = checkpoint::read_manifest(checkpoint_dir);
  std::vector<detail::exports::Source> sources;
  for (const checkpoint::ManifestVariable& v : m.variables) {
    if (!options.variables.empty() && !detail::exports::matches(options.variables, v.name)) continue;
    auto loaded = checkpoint::load_variable(checkpoint_dir, v.name);
    sources.push_back({v.name, v.shape, v.trainable, std::move(loaded.values), false, {}});
  }
  for (const checkpoint::ManifestTable& t : m.tables) {
    if (!options.variables.empty() && !detail::exports::matches(options.variables, t.name)) continue;
    checkpoint::Table loaded = checkpoint::load_table(checkpoint_dir, t.name);  // ids ascending
    sources.push_back({t.name, {loaded.ids.size(), t.dim}, true, std::move(loaded.values), true, std::move(loaded.ids)});
  }
  return detail::exports::write_export(std::move(sources), m.step, options);
}

//! Reads an export: `path` is a version directory, or a base directory
//! (then its highest version). Checks every CRC; throws checkpoint_error
//! naming the file and the problem.
inline Export load_export(const std::filesystem::path& path, const LoadOptions& options = {}) {
  namespace fs = std::filesystem;
  namespace ck = checkpoint::detail;
  fs::path dir = path;
  std::error_code exists_error;
  if (!fs::exists(dir / "model.psx", exists_error)) {  // an unreadable directory: named below
    // The highest version: a directory named by a number of up to 2^64 - 1
    // (a name of digits beyond it is not a version).
    std::optional<std::pair<std::uint64_t, std::string>> best;
    std::error_code ec;
    // Each step with an error code: a directory that cannot be listed is
    // named below, not thrown as filesystem_error.
    for (fs::directory_iterator it(path, ec), last; !ec && it != last; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (name.empty() || !std::all_of(name.begin(), name.end(), [](char c) { return c >= '0' && c <= '9'; }))
        continue;
      std::uint64_t v = 0;
      const auto [end, err] = std::from_chars(name.data(), name.data() + name.size(), v);
      if (err != std::errc() || end != name.data() + name.size()) continue;
      if (!best || v > best->first) best.emplace(v, name);
    }
    if (!best)
      ck::fail(path, "holds neither model.psx nor a version directory" + (ec ? " (" + ec.message() + ")" : std::string()));
    if (ec) ck::fail(path, "could not be listed to the end: " + ec.message());
    dir = path / best->second;
  }
  Export out;
  out.path = dir;
  const fs::path model = dir / "model.psx";
  ck::Header h;
  {
    // Streamed: the envelope of a checkpoint file (kind 3) and the index
    // first, then each tensor's bytes read straight into it, a block at a
    // time CRC'd while in cache (no whole-file buffer: a tensor is held
    // once, not twice), the data's CRC checked before anything read is
    // trusted.
    const ck::InputFile in(model);
    std::array<std::byte, ck::header_bytes> head{};
    h = ck::decode_header(in.head(head), in.size(), ck::FileKind::exported, model);
    std::vector<std::byte> meta(static_cast<std::size_t>(h.meta_bytes));
    in.read(meta.data(), meta.size(), ck::header_bytes);
    if (::psx::detail::crc32c(meta) != h.meta_crc) ck::fail(model, "corrupted metadata (CRC-32C mismatch)");
    if (h.version > detail::exports::format_version)
      ck::fail(model, "is in export format " + std::to_string(h.version) + "; this psx reads formats 1 to " +
                          std::to_string(detail::exports::format_version));
    const std::uint64_t data_at = ck::header_bytes + h.meta_bytes;
    std::uint32_t crc = 0;
    out.tensors = detail::exports::decode_model_with(
        meta, h.data_bytes, model, h.version,
        [&](std::uint64_t at, std::vector<std::byte>& bytes, std::size_t n) {
          bytes.resize(n);
          constexpr std::size_t block = std::size_t{4} << 20;
          for (std::size_t done = 0; done < n; done += block) {
            const std::size_t len = std::min(block, n - done);
            in.read(bytes.data() + done, len, data_at + at + done);
            crc = ::psx::detail::crc32c(std::span<const std::byte>(bytes.data() + done, len), crc);
          }
        },
        [&] {
          if (crc != h.data_crc) ck::fail(model, "corrupted data (CRC-32C mismatch)");
        });
  }
  const fs::path meta_file = dir / "metadata.json";
  const ck::Loaded json = ck::read_file(meta_file);
  ck::check_json_depth(json.all(), meta_file);
  try {
    ck::MemoryBuf buf(json.all());
    std::istream is(&buf);
    cereal::JSONInputArchive ar(is);
    ar(cereal::make_nvp("psx_export", out.metadata));
  } catch (const std::exception& e) {
    ck::fail(meta_file, std::string("bad metadata: ") + e.what());
  }
  if (out.metadata.step != h.step) ck::fail(meta_file, "is of step " + std::to_string(out.metadata.step) + ", model.psx of step " + std::to_string(h.step));
  if (out.metadata.format_version == 0 || out.metadata.format_version > detail::exports::format_version)
    ck::fail(meta_file, "is in export format " + std::to_string(out.metadata.format_version) +
                            "; this psx reads formats 1 to " + std::to_string(detail::exports::format_version));
  if (out.metadata.format_version != h.version)
    ck::fail(meta_file, "says export format " + std::to_string(out.metadata.format_version) + ", model.psx is in format " +
                            std::to_string(h.version));
  // metadata.json has no checksum of its own: what it says of each tensor
  // must be what model.psx (checked) holds.
  if (out.metadata.tensors.size() != out.tensors.size())
    ck::fail(meta_file, "lists " + std::to_string(out.metadata.tensors.size()) + " tensors, model.psx holds " +
                            std::to_string(out.tensors.size()));
  for (std::size_t i = 0; i < out.tensors.size(); ++i) {
    const ExportedTensor& t = out.tensors[i];
    if (out.metadata.tensors[i] != ExportMetadata::Tensor::of(t))
      ck::fail(meta_file, "says tensor " + std::to_string(i) + " is '" + out.metadata.tensors[i].name + "' " +
                              ck::shape_text(out.metadata.tensors[i].shape) + " " + out.metadata.tensors[i].dtype +
                              ", model.psx holds '" + t.name + "' " + ck::shape_text(t.shape) + " " + t.dtype +
                              " (or their quantization, trainable, sparse or stored count differ)");
  }
  if (options.dequantize)
    for (ExportedTensor& t : out.tensors) {
      if (t.dtype == "uint64") continue;  // a table's ids stay ids
      if (t.dtype == "float32" && !t.sparse) continue;  // dense float32 already (not copied twice)
      std::vector<float> f = t.to_float();
      t.values.resize(f.size() * 4);
      if (!f.empty()) std::memcpy(t.values.data(), f.data(), f.size() * 4);
      t.dtype = "float32";
      t.quantization = "none";
      t.scales.clear();
      t.sparse = false;
      t.indices.clear();
    }
  return out;
}

}  // namespace v0
}  // namespace psx

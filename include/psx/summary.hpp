//! @file psx/summary.hpp
//! TensorBoard summaries without TensorFlow or protobuf: scalars, histograms
//! and text, written to an event file that `tensorboard --logdir` reads, and
//! a reader of such files that checks every record.
//!
//! @code
//! psx::SummaryWriter summaries("runs/adam");   // runs/adam/events.out.tfevents.<s>.<host>.<pid>.<n>
//! summaries.scalar("loss", loss, step);
//! summaries.histogram("weights", weights, step);
//! summaries.text("notes", "lr 0.1", step);
//! summaries.flush();                            // else every 2 minutes, 1 MiB, and on close
//! for (const auto& event : psx::summary::read_events(summaries.path())) ...
//! @endcode
//!
//! The file is a TFRecord file of `tensorflow.Event` protos, encoded here by
//! hand (only the fields below) in protobuf's canonical form: fields in
//! number order, proto3 defaults left out, repeated doubles packed, so that
//! protobuf itself would serialize the same bytes. The format is in
//! docs/monitoring.md.
#pragma once

#include <psx/detail/crc32c.hpp>
#include <psx/errors.hpp>
#include <psx/message.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>
#include <ostream>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace psx {
inline namespace v0 {

namespace detail::pb {

// The protobuf wire types psx writes and reads (groups, 3 and 4, are refused).
enum Wire : unsigned { wire_varint = 0, wire_fixed64 = 1, wire_bytes = 2, wire_fixed32 = 5 };

inline void put_varint(std::string& out, std::uint64_t v) {
  for (; v >= 0x80; v >>= 7) out.push_back(static_cast<char>(v | 0x80));
  out.push_back(static_cast<char>(v));
}
inline void put_key(std::string& out, unsigned field, Wire w) { put_varint(out, std::uint64_t{field} << 3 | w); }
inline void put_le(std::string& out, std::uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}
// Singular proto3 scalars are left out when zero (bitwise, as protobuf does:
// -0.0 is written). Members of a oneof (simple_value) are always written.
inline void put_double(std::string& out, unsigned field, double v) {
  if (std::bit_cast<std::uint64_t>(v) == 0) return;
  put_key(out, field, wire_fixed64);
  put_le(out, std::bit_cast<std::uint64_t>(v), 8);
}
inline void put_bytes(std::string& out, unsigned field, std::string_view s) {
  put_key(out, field, wire_bytes);
  put_varint(out, s.size());
  out.append(s);
}
inline void put_packed(std::string& out, unsigned field, std::span<const double> v) {
  if (v.empty()) return;
  put_key(out, field, wire_bytes);
  put_varint(out, v.size() * 8);
  for (double d : v) put_le(out, std::bit_cast<std::uint64_t>(d), 8);
}

// A bounds-checked cursor over one message; `base` is where the message
// starts in the record, so errors name a byte of the record.
struct Reader {
  std::string_view in;
  std::size_t base = 0;
  std::size_t pos = 0;

  [[noreturn]] void fail(const std::string& what) const {
    throw summary_error(what + " at byte " + std::to_string(base + pos) + " of the record");
  }
  bool done() const noexcept { return pos >= in.size(); }
  std::uint64_t varint() {
    std::uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos >= in.size()) fail("malformed protobuf: a varint runs past the end");
      const auto b = static_cast<unsigned char>(in[pos++]);
      v |= std::uint64_t{b & 0x7fu} << shift;
      if ((b & 0x80u) == 0) return v;
    }
    fail("malformed protobuf: a varint longer than 10 bytes");
  }
  std::uint64_t fixed(std::size_t n) {
    if (in.size() - pos < n) fail("malformed protobuf: a fixed-width field runs past the end");
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < n; ++i) v |= std::uint64_t{static_cast<unsigned char>(in[pos + i])} << (8 * i);
    pos += n;
    return v;
  }
  double f64() { return std::bit_cast<double>(fixed(8)); }
  float f32() { return std::bit_cast<float>(static_cast<std::uint32_t>(fixed(4))); }
  std::string_view bytes() {
    const std::uint64_t n = varint();
    if (n > in.size() - pos) fail("malformed protobuf: a length of " + std::to_string(n) + " runs past the end");
    const auto s = in.substr(pos, static_cast<std::size_t>(n));
    pos += static_cast<std::size_t>(n);
    return s;
  }
  // The reader of a length-delimited submessage.
  Reader sub() {
    const auto s = bytes();
    return Reader{s, base + pos - s.size(), 0};
  }
  // The next field's number and wire type.
  std::pair<std::uint64_t, unsigned> key() {
    const std::uint64_t k = varint();
    const auto wire = static_cast<unsigned>(k & 7);
    if (k >> 3 == 0 || k >> 3 > 0x1fffffff) fail("malformed protobuf: field number " + std::to_string(k >> 3));
    if (wire != wire_varint && wire != wire_fixed64 && wire != wire_bytes && wire != wire_fixed32)
      fail("malformed protobuf: wire type " + std::to_string(wire));
    return {k >> 3, wire};
  }
  void skip(unsigned wire) {
    if (wire == wire_varint) varint();
    else if (wire == wire_fixed64) fixed(8);
    else if (wire == wire_fixed32) fixed(4);
    else bytes();
  }
  // A repeated double, packed (wire type 2) or not (1), appended to `out`.
  void doubles(unsigned wire, std::vector<double>& out) {
    if (wire == wire_fixed64) {
      out.push_back(f64());
      return;
    }
    Reader p = sub();
    if (p.in.size() % 8 != 0) p.fail("malformed protobuf: packed doubles of " + std::to_string(p.in.size()) + " bytes");
    while (!p.done()) out.push_back(p.f64());
  }
};

}  // namespace detail::pb

namespace summary {

//! When a `Writer` writes its buffer out (besides `flush()` and `close()`).
struct Options {
  //! Appended to the file name (TensorFlow's `filename_suffix`).
  std::string filename_suffix = {};
  //! Write out when the buffer holds this many bytes.
  std::size_t flush_bytes = std::size_t{1} << 20;
  //! Write out at the first call this long after the last write-out
  //! (TensorFlow's and tensorboardX's default, 120 s; 0: at every call).
  std::chrono::milliseconds flush_every{120'000};
  friend bool operator==(const Options&, const Options&) = default;
  friend std::ostream& operator<<(std::ostream& os, const Options& o) {
    return os << "summary::Options{filename_suffix=\"" << o.filename_suffix << "\", flush_bytes=" << o.flush_bytes
              << ", flush_every=" << o.flush_every.count() << "ms}";
  }
};

//! A HistogramProto: statistics and buckets; bucket `i` counts the values in
//! `[bucket_limit[i-1], bucket_limit[i])` (from -DBL_MAX for `i` = 0).
struct Histogram {
  double min = 0, max = 0, num = 0, sum = 0, sum_squares = 0;
  std::vector<double> bucket_limit;
  std::vector<double> bucket;
  friend bool operator==(const Histogram&, const Histogram&) = default;
};

//! TensorFlow's default bucket limits (tensorflow/core/lib/histogram/histogram.cc):
//! ±1e-12 * 1.1^k below 1e20, ±DBL_MAX and 0, ascending: 1551 limits, bit for
//! bit the same doubles (the same repeated multiplication).
inline const std::vector<double>& default_bucket_limits() {
  static const std::vector<double> limits = [] {
    std::vector<double> pos;
    for (double v = 1.0e-12; v < 1.0e20; v *= 1.1) pos.push_back(v);
    pos.push_back(DBL_MAX);
    std::vector<double> all;
    all.reserve(2 * pos.size() + 1);
    for (auto it = pos.rbegin(); it != pos.rend(); ++it) all.push_back(-*it);
    all.push_back(0.0);
    all.insert(all.end(), pos.begin(), pos.end());
    return all;
  }();
  return limits;
}

//! The histogram TensorFlow's summary op writes for `values`: min, max,
//! count, sum and sum of squares in double, the default buckets, and, as
//! `EncodeToProto(proto, false)` does, every non-empty bucket with each run
//! of empty buckets collapsed into one zero bucket (TensorBoard takes a
//! bucket's left edge from the limit before it, so the runs must stay).
//! NaN and ±inf are left out (TensorFlow's op refuses them); with no value
//! left, min is DBL_MAX and max -DBL_MAX, as TensorFlow writes.
inline Histogram make_histogram(std::span<const float> values) {
  const auto& limits = default_bucket_limits();
  std::vector<double> counts(limits.size(), 0.0);
  Histogram h;
  h.min = DBL_MAX;
  h.max = -DBL_MAX;
  for (const float f : values) {
    if (!std::isfinite(f)) continue;
    const double v = f;
    // Finite floats are below DBL_MAX, the last limit: the index stays in range.
    counts[static_cast<std::size_t>(std::upper_bound(limits.begin(), limits.end(), v) - limits.begin())] += 1.0;
    h.min = std::min(h.min, v);
    h.max = std::max(h.max, v);
    h.num += 1.0;
    h.sum += v;
    h.sum_squares += v * v;
  }
  for (std::size_t i = 0; i < counts.size();) {
    double end = limits[i], count = counts[i];
    ++i;
    if (count <= 0.0)
      for (; i < counts.size() && counts[i] <= 0.0; ++i) end = limits[i];
    h.bucket_limit.push_back(end);
    h.bucket.push_back(count);
  }
  return h;
}

//! One Summary.Value as `read_events` decodes it.
struct Value {
  enum class Kind { scalar, histogram, text, other };
  std::string tag;
  Kind kind = Kind::other;
  float scalar = 0;         //!< simple_value (Kind::scalar)
  Histogram histogram;      //!< histo (Kind::histogram)
  std::string text;         //!< the first string of a DT_STRING tensor (Kind::text)
  std::string plugin_name;  //!< metadata.plugin_data.plugin_name ("text" for text)
};

//! One Event as `read_events` decodes it.
struct Event {
  double wall_time = 0;
  std::int64_t step = 0;
  std::string file_version;  //!< "brain.Event:2" in a file's first event
  std::vector<Value> values;
};

}  // namespace summary

namespace detail {

inline std::uint32_t masked_crc32c(std::string_view s) noexcept {
  const std::uint32_t c = crc32c(std::as_bytes(std::span(s.data(), s.size())));
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

// The offset of the first byte of `s` that is not well-formed UTF-8 (RFC
// 3629: no overlong forms, surrogates or code points above U+10FFFF, as
// protobuf requires of a string field), or npos when all of it is.
inline std::size_t invalid_utf8_at(std::string_view s) noexcept {
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    std::size_t n = 0;
    std::uint32_t cp = 0, least = 0;
    if (c < 0x80) {
      ++i;
      continue;
    }
    if ((c & 0xE0) == 0xC0) n = 1, cp = c & 0x1Fu, least = 0x80;
    else if ((c & 0xF0) == 0xE0) n = 2, cp = c & 0x0Fu, least = 0x800;
    else if ((c & 0xF8) == 0xF0) n = 3, cp = c & 0x07u, least = 0x10000;
    else return i;
    if (s.size() - i <= n) return i;
    for (std::size_t k = 1; k <= n; ++k) {
      const auto b = static_cast<unsigned char>(s[i + k]);
      if ((b & 0xC0) != 0x80) return i;
      cp = cp << 6 | (b & 0x3Fu);
    }
    if (cp < least || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += n + 1;
  }
  return std::string_view::npos;
}

// `s` for a message: printable ASCII as it is, other bytes as \xNN.
inline std::string escaped(std::string_view s) {
  std::string out;
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c >= 0x20 && c < 0x7F && c != '\\') {
      out += ch;
    } else {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02X", c);
      out += hex;
    }
  }
  return out;
}

// TFRecord framing: length, masked CRC of the length, data, masked CRC of the data.
inline void append_record(std::string& out, std::string_view data) {
  std::string len;
  pb::put_le(len, data.size(), 8);
  out += len;
  pb::put_le(out, masked_crc32c(len), 4);
  out.append(data);
  pb::put_le(out, masked_crc32c(data), 4);
}

// An Event holding `value`, a serialized Summary.Value (none: the file_version event).
inline std::string summary_event(double wall_time, std::int64_t step, std::string_view value,
                                 std::string_view file_version = {}) {
  std::string e;
  pb::put_double(e, 1, wall_time);
  if (step != 0) {
    pb::put_key(e, 2, pb::wire_varint);
    pb::put_varint(e, static_cast<std::uint64_t>(step));
  }
  if (!file_version.empty()) pb::put_bytes(e, 3, file_version);
  if (!value.empty()) {
    std::string summary;
    pb::put_bytes(summary, 1, value);
    pb::put_bytes(e, 5, summary);
  }
  return e;
}

inline std::string scalar_value(std::string_view tag, float v) {
  std::string out;
  if (!tag.empty()) pb::put_bytes(out, 1, tag);
  pb::put_key(out, 2, pb::wire_fixed32);  // a oneof member: written even when 0
  pb::put_le(out, std::bit_cast<std::uint32_t>(v), 4);
  return out;
}

inline std::string histogram_value(std::string_view tag, const summary::Histogram& h) {
  std::string histo;
  pb::put_double(histo, 1, h.min);
  pb::put_double(histo, 2, h.max);
  pb::put_double(histo, 3, h.num);
  pb::put_double(histo, 4, h.sum);
  pb::put_double(histo, 5, h.sum_squares);
  pb::put_packed(histo, 6, h.bucket_limit);
  pb::put_packed(histo, 7, h.bucket);
  std::string out;
  if (!tag.empty()) pb::put_bytes(out, 1, tag);
  pb::put_bytes(out, 5, histo);
  return out;
}

// As TensorBoard's text plugin writes it (text_pb): a scalar DT_STRING tensor
// with an empty, present shape, and plugin_name "text".
inline std::string text_value(std::string_view tag, std::string_view text) {
  std::string tensor;
  pb::put_key(tensor, 1, pb::wire_varint);
  pb::put_varint(tensor, 7);  // DT_STRING
  pb::put_bytes(tensor, 2, {});
  pb::put_bytes(tensor, 8, text);
  std::string plugin, metadata, out;
  pb::put_bytes(plugin, 1, "text");
  pb::put_bytes(metadata, 1, plugin);
  if (!tag.empty()) pb::put_bytes(out, 1, tag);
  pb::put_bytes(out, 8, tensor);
  pb::put_bytes(out, 9, metadata);
  return out;
}

inline summary::Histogram decode_histogram(pb::Reader r) {
  summary::Histogram h;
  while (!r.done()) {
    const auto [field, wire] = r.key();
    if (field >= 1 && field <= 5 && wire == pb::wire_fixed64) {
      double* stats[] = {&h.min, &h.max, &h.num, &h.sum, &h.sum_squares};
      *stats[field - 1] = r.f64();
    } else if (field == 6 && (wire == pb::wire_fixed64 || wire == pb::wire_bytes)) {
      r.doubles(wire, h.bucket_limit);
    } else if (field == 7 && (wire == pb::wire_fixed64 || wire == pb::wire_bytes)) {
      r.doubles(wire, h.bucket);
    } else {
      r.skip(wire);
    }
  }
  if (h.bucket_limit.size() != h.bucket.size())
    r.fail("malformed histogram: " + std::to_string(h.bucket_limit.size()) + " bucket limits but " +
           std::to_string(h.bucket.size()) + " buckets, ending");
  return h;
}

inline summary::Value decode_value(pb::Reader r) {
  summary::Value v;
  std::uint64_t dtype = 0;
  bool has_string = false;
  while (!r.done()) {
    const auto [field, wire] = r.key();
    if (field == 1 && wire == pb::wire_bytes) {
      v.tag = r.bytes();
    } else if (field == 2 && wire == pb::wire_fixed32) {
      v.scalar = r.f32();
      v.kind = summary::Value::Kind::scalar;
    } else if (field == 5 && wire == pb::wire_bytes) {
      v.histogram = decode_histogram(r.sub());
      v.kind = summary::Value::Kind::histogram;
    } else if (field == 8 && wire == pb::wire_bytes) {  // TensorProto
      for (pb::Reader t = r.sub(); !t.done();) {
        const auto [f, w] = t.key();
        if (f == 1 && w == pb::wire_varint) {
          dtype = t.varint();
        } else if (f == 8 && w == pb::wire_bytes && !has_string) {
          v.text = t.bytes();
          has_string = true;
        } else {
          t.skip(w);
        }
      }
    } else if (field == 9 && wire == pb::wire_bytes) {  // SummaryMetadata
      for (pb::Reader m = r.sub(); !m.done();) {
        const auto [f, w] = m.key();
        if (f != 1 || w != pb::wire_bytes) {
          m.skip(w);
          continue;
        }
        for (pb::Reader p = m.sub(); !p.done();) {  // PluginData
          const auto [pf, pw] = p.key();
          if (pf == 1 && pw == pb::wire_bytes) v.plugin_name = p.bytes();
          else p.skip(pw);
        }
      }
    } else {
      r.skip(wire);
    }
  }
  if (v.kind == summary::Value::Kind::other && v.plugin_name == "text" && dtype == 7 && has_string)
    v.kind = summary::Value::Kind::text;
  else if (v.kind != summary::Value::Kind::text)
    v.text.clear();
  return v;
}

inline summary::Event decode_event(std::string_view data) {
  summary::Event e;
  for (pb::Reader r{data}; !r.done();) {
    const auto [field, wire] = r.key();
    if (field == 1 && wire == pb::wire_fixed64) {
      e.wall_time = r.f64();
    } else if (field == 2 && wire == pb::wire_varint) {
      e.step = static_cast<std::int64_t>(r.varint());
    } else if (field == 3 && wire == pb::wire_bytes) {
      e.file_version = r.bytes();
    } else if (field == 5 && wire == pb::wire_bytes) {
      for (pb::Reader s = r.sub(); !s.done();) {
        const auto [f, w] = s.key();
        if (f == 1 && w == pb::wire_bytes) e.values.push_back(decode_value(s.sub()));
        else s.skip(w);
      }
    } else {
      r.skip(wire);  // graph_def, session_log, ...: not read here
    }
  }
  return e;
}

inline std::uint64_t next_event_file_number() noexcept {
  static std::atomic<std::uint64_t> counter{0};
  return counter.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace detail

namespace summary {

//! Writes scalars, histograms and text to a new event file in `logdir`.
//! Thread-safe: any thread may log, flush or close. Records are buffered and
//! written out on `flush()`, `close()` and by `Options`; loggers never wait
//! for I/O unless their call is the one that writes the buffer out.
class Writer {
 public:
  //! Creates `logdir` if need be and `events.out.tfevents.<unix seconds, 10
  //! digits>.<hostname>.<pid>.<counter><suffix>` in it, for appending, and
  //! writes the file_version event ("brain.Event:2") at once.
  explicit Writer(const std::filesystem::path& logdir, Options options = {}) : options_(std::move(options)) {
    std::error_code ec;
    std::filesystem::create_directories(logdir, ec);
    if (ec)
      throw summary_error("psx::summary: cannot create the log directory " + logdir.string() + ": " + ec.message());
    const double now = wall_time();
    char host[256] = {};
    if (::gethostname(host, sizeof host - 1) != 0 || host[0] == '\0') std::strcpy(host, "localhost");
    char stamp[32];
    std::snprintf(stamp, sizeof stamp, "%010lld", static_cast<long long>(now));
    // A file of its own: another writer with the same host name and pid in
    // the same second (containers with a fixed host name, each process pid
    // 1) takes the next counter rather than appending to the other's file.
    for (int attempt = 0;; ++attempt) {
      path_ = logdir / ("events.out.tfevents." + std::string(stamp) + "." + host + "." + std::to_string(::getpid()) +
                        "." + std::to_string(detail::next_event_file_number()) + options_.filename_suffix);
      fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0644);
      if (fd_ >= 0) break;
      if (errno != EEXIST || attempt == 1000)
        throw summary_error("psx::summary: cannot create " + path_.string() + ": " + std::strerror(errno));
    }
    std::string header;
    detail::append_record(header, detail::summary_event(now, 0, {}, "brain.Event:2"));
    try {
      write_all(header);
    } catch (...) {
      ::close(fd_);
      throw;
    }
  }
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;
  //! Closes; an error is printed to stderr (call `close()` to see it thrown).
  ~Writer() {
    try {
      close();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
    }
  }

  //! The event file.
  const std::filesystem::path& path() const noexcept { return path_; }
  const Options& options() const noexcept { return options_; }

  // Every tag must be UTF-8 (a protobuf string): TensorBoard stops reading
  // a file at a record whose tag is not, so such a tag throws summary_error
  // and nothing is written.

  //! A scalar (simple_value); NaN and ±inf are written as given.
  void scalar(std::string_view tag, float value, std::int64_t step) {
    check_tag(tag);
    append_event(step, detail::scalar_value(tag, value));
  }
  //! A histogram of `values` (`make_histogram`: TensorFlow's buckets).
  void histogram(std::string_view tag, std::span<const float> values, std::int64_t step) {
    check_tag(tag);
    append_event(step, detail::histogram_value(tag, make_histogram(values)));
  }
  //! A histogram made elsewhere (counts already in buckets: `staleness_histogram`):
  //! as many counts as limits, limits strictly ascending, counts finite and
  //! not negative, and when it counts anything (`num > 0`) a finite `min` at
  //! most `max` (TensorBoard draws the outer buckets' edges from them), or
  //! summary_error (TensorBoard stops reading a file at a histogram it cannot
  //! draw).
  void histogram(std::string_view tag, const Histogram& h, std::int64_t step) {
    check_tag(tag);
    const auto bad = [&](const std::string& what) {
      return summary_error("psx::summary: histogram \"" + detail::escaped(tag) + "\": " + what + "; nothing written");
    };
    if (h.bucket.size() != h.bucket_limit.size())
      throw bad(std::to_string(h.bucket_limit.size()) + " bucket limits but " + std::to_string(h.bucket.size()) +
                " buckets");
    for (std::size_t i = 0; i < h.bucket.size(); ++i) {
      if (!(h.bucket[i] >= 0) || std::isinf(h.bucket[i]))
        throw bad("bucket " + std::to_string(i) + " counts " + std::to_string(h.bucket[i]));
      if (i > 0 && !(h.bucket_limit[i - 1] < h.bucket_limit[i]))
        throw bad("bucket limits not ascending at " + std::to_string(i) + " (" + std::to_string(h.bucket_limit[i - 1]) +
                  ", then " + std::to_string(h.bucket_limit[i]) + ")");
    }
    if (h.num > 0 && !(std::isfinite(h.min) && std::isfinite(h.max) && h.min <= h.max))
      throw bad("min " + std::to_string(h.min) + " and max " + std::to_string(h.max) + " of " + std::to_string(h.num) +
                " values");
    append_event(step, detail::histogram_value(tag, h));
  }
  //! Text for TensorBoard's text plugin (Markdown), UTF-8 as the tag (the
  //! plugin decodes it so: other bytes fail its view), or summary_error.
  void text(std::string_view tag, std::string_view text, std::int64_t step) {
    check_tag(tag);
    if (const std::size_t at = detail::invalid_utf8_at(text); at != std::string_view::npos)
      throw summary_error("psx::summary: the text of \"" + detail::escaped(tag) + "\" is not UTF-8 (byte " +
                          std::to_string(at) + "); nothing written");
    append_event(step, detail::text_value(tag, text));
  }

  //! Writes the buffered records out to the file (no fsync; `close()` syncs);
  //! throws summary_error after `close()`.
  void flush() {
    std::lock_guard io(io_mu_);
    std::string out;
    {
      std::lock_guard lock(mu_);
      check_open();
      out.swap(buffer_);
      last_write_ = std::chrono::steady_clock::now();
    }
    write_all(out);
  }

  //! Writes the buffer out, syncs and closes the file; later logging throws
  //! summary_error. Throws summary_error when that fails, or when an
  //! earlier write failed and records logged meanwhile by other threads
  //! were not written. A second call does nothing.
  void close() {
    std::lock_guard io(io_mu_);
    std::string out;
    {
      std::lock_guard lock(mu_);
      if (closed_) return;
      closed_ = true;
      out.swap(buffer_);
    }
    std::string error;
    const bool failed_before = !failed_.empty();
    try {
      if (!failed_before) write_all(out);
    } catch (const summary_error& e) {
      error = e.what();
    }
    // Records logged while an earlier write that failed was under way
    // (other threads' calls returned before it failed) are lost: say so.
    if (failed_before && !out.empty())
      error = failed_ + "; " + std::to_string(out.size()) + " bytes of records logged since were not written";
    if (error.empty() && failed_.empty() && ::fsync(fd_) != 0) error = io_message("sync");
    if (::close(fd_) != 0 && error.empty() && failed_.empty()) error = io_message("close");
    if (!error.empty()) throw summary_error(error);
  }

 private:
  static double wall_time() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  }
  std::string io_message(const char* what) const {
    return std::string("psx::summary: cannot ") + what + " " + path_.string() + ": " + std::strerror(errno);
  }
  static void check_tag(std::string_view tag) {
    const std::size_t at = detail::invalid_utf8_at(tag);
    if (at != std::string_view::npos)
      throw summary_error("psx::summary: tag \"" + detail::escaped(tag) + "\" is not UTF-8 (byte " +
                          std::to_string(at) + "); nothing written");
  }
  // Under mu_.
  void check_open() const {
    if (closed_) throw summary_error("psx::summary: " + path_.string() + " is closed");
    if (!failed_.empty()) throw summary_error(failed_);
  }

  void append_event(std::int64_t step, const std::string& value) {
    std::string record;
    detail::append_record(record, detail::summary_event(wall_time(), step, value));
    bool due = false;
    {
      std::lock_guard lock(mu_);
      check_open();
      buffer_ += record;
      due = buffer_.size() >= options_.flush_bytes ||
            std::chrono::steady_clock::now() - last_write_ >= options_.flush_every;
    }
    if (due) flush();
  }

  // Under io_mu_ (or in the constructor). A failed write may leave part of a
  // record behind, so the writer refuses every later record.
  void write_all(std::string_view data) {
    while (!data.empty()) {
      const ::ssize_t n = ::write(fd_, data.data(), data.size());
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const std::string message = io_message("write to");
        std::lock_guard lock(mu_);
        failed_ = message;
        throw summary_error(message);
      }
      data.remove_prefix(static_cast<std::size_t>(n));
    }
  }

  Options options_;
  std::filesystem::path path_;
  int fd_ = -1;
  std::mutex io_mu_;  // one write-out at a time, in the order of the buffer
  std::mutex mu_;     // the members below
  std::string buffer_;
  bool closed_ = false;
  std::string failed_;  // the message of a failed write, if one failed
  std::chrono::steady_clock::time_point last_write_ = std::chrono::steady_clock::now();
};

//! What `read_events` does with a last record cut short by the end of the
//! file, as a file has while another process is writing that record.
enum class Tail {
  refuse,  //!< throw summary_error: a finished file ends after a whole record
  stop,    //!< return the events before it (read again later for the rest)
};

//! Every event of an event file, in order. Checks each record's length CRC
//! and data CRC and decodes the fields above (unknown fields are skipped);
//! a truncated, corrupted or malformed record throws summary_error naming
//! the file and the record's byte offset. With `Tail::stop`, a record that
//! the end of the file cuts short (a header of under 12 bytes, or a length
//! whose CRC matches and that runs past the end) ends the events instead;
//! a CRC that does not match still throws. Memory grows with the file, never
//! with what its bytes claim: a length beyond the file is refused before
//! anything is allocated; each value decoded takes sizeof(Value) bytes (a
//! few hundred), where the file may spend as few as 2 on it.
inline std::vector<Event> read_events(const std::filesystem::path& file, Tail tail = Tail::refuse) {
  std::error_code ec;
  const std::uint64_t size = std::filesystem::file_size(file, ec);
  if (ec) throw summary_error("psx::summary: cannot read " + file.string() + ": " + ec.message());
  std::ifstream in(file, std::ios::binary);
  if (!in) throw summary_error("psx::summary: cannot open " + file.string());
  const auto fail = [&](std::uint64_t offset, const std::string& what) {
    return summary_error("psx::summary: " + file.string() + ": record at byte offset " + std::to_string(offset) +
                         ": " + what);
  };
  const auto le = [](const char* p, int n) {
    std::uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= std::uint64_t{static_cast<unsigned char>(p[i])} << (8 * i);
    return v;
  };
  std::vector<Event> events;
  std::string data;
  for (std::uint64_t offset = 0; offset < size;) {
    const std::uint64_t left = size - offset;
    char head[12];
    if (left < 12) {
      if (tail == Tail::stop) break;
      throw fail(offset, "truncated: a 12-byte header, " + std::to_string(left) + " bytes left");
    }
    if (!in.read(head, 12)) throw fail(offset, "read error");
    const std::uint64_t length = le(head, 8);
    if (le(head + 8, 4) != detail::masked_crc32c({head, 8}))
      throw fail(offset, "the length's CRC does not match (corrupted)");
    if (length > left - 12 || left - 12 - length < 4) {
      if (tail == Tail::stop) break;
      throw fail(offset, "truncated: " + std::to_string(length) + " bytes of data and 4 of CRC, " +
                             std::to_string(left - 12) + " bytes left");
    }
    data.resize(static_cast<std::size_t>(length));
    char crc[4];
    if (!in.read(data.data(), static_cast<std::streamsize>(length)) || !in.read(crc, 4))
      throw fail(offset, "read error");
    if (le(crc, 4) != detail::masked_crc32c(data)) throw fail(offset, "the data's CRC does not match (corrupted)");
    try {
      events.push_back(detail::decode_event(data));
    } catch (const summary_error& e) {
      throw fail(offset, e.what());
    }
    offset += 16 + length;
  }
  return events;
}

//! A server's staleness counts (`ServerStats::staleness`: `counts[k]`
//! gradients k versions old, the last bucket k or more) as a histogram:
//! bucket k spans [k - 0.5, k + 0.5), so TensorBoard centres it on k (but
//! for the first and last buckets that count any: TensorBoard ends those
//! at `min` and `max`, here the smallest and largest k counted).
inline Histogram staleness_histogram(std::span<const std::uint64_t> counts) {
  Histogram h;
  h.min = DBL_MAX;
  h.max = -DBL_MAX;
  for (std::size_t k = 0; k < counts.size(); ++k) {
    h.bucket_limit.push_back(k + 1 < counts.size() ? static_cast<double>(k) + 0.5 : DBL_MAX);
    const auto n = static_cast<double>(counts[k]);
    h.bucket.push_back(n);
    if (counts[k] == 0) continue;
    const auto v = static_cast<double>(k);
    h.min = std::min(h.min, v);
    h.max = std::max(h.max, v);
    h.num += n;
    h.sum += n * v;
    h.sum_squares += n * v * v;
  }
  return h;
}

//! What a chief watches of its servers (`Worker::server_stats()`), at
//! `step`: for each server s the scalars `servers/<s>/requests`, `pulls`,
//! `pushes`, `bytes_in`, `bytes_out`, `errors`, `dropped`, `rejected`,
//! `undelivered`, `retried`, `duplicates`, `parameter_bytes` and `slot_bytes` (cumulative counts, as
//! the servers keep them), `waiting` (requests held now: the queue's depth)
//! and `waiting_max`; the load balance `servers/bytes_max_over_mean`
//! (the busiest server's bytes in + out over the mean, 1 when balanced);
//! and the staleness of every server together as the histogram
//! `servers/staleness`.
inline void write_server_stats(Writer& w, std::span<const ServerStats> servers, std::int64_t step) {
  ServerStats total;
  double max_bytes = 0.0, sum_bytes = 0.0;
  for (std::size_t s = 0; s < servers.size(); ++s) {
    const ServerStats& st = servers[s];
    const std::string at = "servers/" + std::to_string(s) + "/";
    const std::pair<const char*, std::uint64_t> counters[] = {
        {"requests", st.requests},       {"pulls", st.pulls},         {"pushes", st.pushes},
        {"bytes_in", st.bytes_in},       {"bytes_out", st.bytes_out}, {"errors", st.errors},
        {"dropped", st.dropped},         {"rejected", st.rejected},   {"undelivered", st.undelivered},
        {"retried", st.retried},         {"duplicates", st.duplicates},
        {"parameter_bytes", st.parameter_bytes}, {"slot_bytes", st.slot_bytes}, {"waiting", st.waiting},
        {"waiting_max", st.waiting_max}};
    for (const auto& [name, value] : counters) w.scalar(at + name, static_cast<float>(value), step);
    const auto bytes = static_cast<double>(st.bytes_in + st.bytes_out);
    max_bytes = std::max(max_bytes, bytes);
    sum_bytes += bytes;
    total += st;
  }
  if (!servers.empty() && sum_bytes > 0.0)
    w.scalar("servers/bytes_max_over_mean",
             static_cast<float>(max_bytes / (sum_bytes / static_cast<double>(servers.size()))), step);
  w.histogram("servers/staleness", staleness_histogram(total.staleness), step);
}

//! Progress of a long run for a line on the terminal: how far, how fast,
//! how long still (rate over the whole run so far). Updated by one thread.
//!
//! @code
//! psx::summary::Progress progress(steps);
//! progress.update(step + 1);
//! std::fprintf(stderr, "\r%s", progress.line().c_str());  // 250/1500 steps (16.7%), 833 steps/s, ...
//! @endcode
class Progress {
 public:
  using clock_type = std::chrono::steady_clock;

  explicit Progress(std::uint64_t total, std::string unit = "steps", clock_type::time_point start = clock_type::now())
      : total_(total), unit_(std::move(unit)), start_(start), now_(start) {}

  //! `done` units are finished at `now`.
  void update(std::uint64_t done, clock_type::time_point now = clock_type::now()) noexcept {
    done_ = done;
    now_ = std::max(now, start_);
  }

  std::uint64_t done() const noexcept { return done_; }
  std::uint64_t total() const noexcept { return total_; }
  double elapsed_seconds() const noexcept { return std::chrono::duration<double>(now_ - start_).count(); }
  //! Units per second since the start; 0 until some time passed.
  double rate() const noexcept {
    const double s = elapsed_seconds();
    return s > 0 ? static_cast<double>(done_) / s : 0.0;
  }
  //! Seconds left at the rate so far: 0 when done, NaN while unknown
  //! (nothing done yet).
  double eta_seconds() const noexcept {
    if (done_ >= total_) return 0.0;
    const double r = rate();
    return r > 0 ? static_cast<double>(total_ - done_) / r : std::numeric_limits<double>::quiet_NaN();
  }

  //! `250/1500 steps (16.7%), 833 steps/s, 0.3 s elapsed, ETA 1.5 s`.
  std::string line() const {
    char pct[32], rate_text[32];
    std::snprintf(pct, sizeof pct, "%.1f%%",
                  total_ > 0 ? 100.0 * static_cast<double>(done_) / static_cast<double>(total_) : 100.0);
    std::snprintf(rate_text, sizeof rate_text, "%.4g", rate());
    const double eta = eta_seconds();
    return std::to_string(done_) + "/" + std::to_string(total_) + " " + unit_ + " (" + pct + "), " + rate_text + " " +
           unit_ + "/s, " + duration(elapsed_seconds()) + " elapsed, ETA " +
           (std::isnan(eta) ? std::string("-") : duration(eta));
  }

  //! `0.3 s`, `42 s`, `3m05s`, `2h03m`.
  static std::string duration(double seconds) {
    char out[48];
    if (!(seconds < 1e9)) return "-";
    // Thresholds where the rounded figure would reach the next unit.
    if (seconds < 9.95) std::snprintf(out, sizeof out, "%.1f s", seconds);
    else if (seconds < 59.5) std::snprintf(out, sizeof out, "%.0f s", seconds);
    else if (seconds < 3599.5) {
      const auto s = static_cast<long long>(seconds + 0.5);
      std::snprintf(out, sizeof out, "%lldm%02llds", s / 60, s % 60);
    } else {
      const auto m = static_cast<long long>(seconds / 60 + 0.5);
      std::snprintf(out, sizeof out, "%lldh%02lldm", m / 60, m % 60);
    }
    return out;
  }

 private:
  std::uint64_t total_;
  std::string unit_;
  clock_type::time_point start_, now_;
  std::uint64_t done_ = 0;
};

}  // namespace summary

//! `psx::SummaryWriter`: the same as `psx::summary::Writer`.
using SummaryWriter = summary::Writer;

}  // namespace v0
}  // namespace psx

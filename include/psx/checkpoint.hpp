//! @file psx/checkpoint.hpp
//! Sharded checkpoints: every server writes its own shards (parameters and
//! optimizer slots), the chief writes a manifest, and a checkpoint restores
//! into any number of servers and any partitioner, bit for bit.
//!
//! @code
//! psx::checkpoint::Manager ckpt(ps, {.directory = "/shared/run1", .every_steps = 100, .max_to_keep = 5});
//! ps.run([&](psx::Worker& w) {
//!   for (std::uint64_t step = ckpt.restore_or_init(w); step < 1000; ++step) {
//!     ...pull, compute, push...
//!     w.step();
//!     ckpt.maybe_save(w);  // every worker calls it; only the chief writes
//!   }
//! });
//! @endcode
//!
//! Save and restore are collective: every worker calls them at the same
//! step; the others wait on a barrier while the chief saves, never on a
//! sleep. Servers write into the directory the chief names, so between hosts
//! it must be a file system every task sees at the same path (as with
//! TensorFlow). The format is in docs/checkpoints.md; only this header
//! includes cereal.
#pragma once

#include <psx/detail/crc32c.hpp>
#include <psx/detail/persist.hpp>
#include <psx/errors.hpp>
#include <psx/half.hpp>
#include <psx/message.hpp>
#include <psx/variable.hpp>
#include <psx/worker.hpp>

#include <cereal/archives/json.hpp>
#include <cereal/archives/portable_binary.hpp>
#include <cereal/types/string.hpp>
#include <cereal/types/vector.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <istream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <streambuf>
#include <typeinfo>
#include <string>
#include <string_view>
#include <vector>

namespace psx {
inline namespace v0 {

namespace detail {

// The checkpoint code's way into a Worker.
struct WorkerAccess {
  static void call_every_server(Worker& w, Op op, std::uint64_t clock, const std::string& text) {
    w.call_every_server(op, clock, text);
  }
  static void set_clock(Worker& w, std::uint64_t clock) { w.core_->clocks[w.index_] = clock; }
  static const std::vector<VariableInfo>& variables(const Worker& w) { return w.core_->variables; }
  //! The whole variable, without waiting for the sync policy (as ParameterServer::read).
  static void read(Worker& w, std::string_view name, std::span<float> out) {
    const PullItem item{name, out};
    w.read_async(std::span<const PullItem>(&item, 1)).wait();
  }
};

}  // namespace detail

namespace checkpoint {

//! The newest format this psx writes and reads; every older one stays readable.
inline constexpr std::uint32_t format_version = 1;

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
  std::vector<ManifestVariable> variables;
  std::vector<ManifestFile> files;  //!< one per server, server s at index s
  template <class Ar>
  void serialize(Ar& ar) {
    ar(CEREAL_NVP(format_version), CEREAL_NVP(step), CEREAL_NVP(created_unix), CEREAL_NVP(num_servers),
       CEREAL_NVP(num_workers), CEREAL_NVP(partitioner), CEREAL_NVP(sync_policy), CEREAL_NVP(optimizer),
       CEREAL_NVP(optimizer_slots), CEREAL_NVP(variables), CEREAL_NVP(files));
  }
};

//! A complete checkpoint found on disk.
struct Info {
  std::filesystem::path path;
  std::uint64_t step = 0;
};

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

// -- injected failures (tests) ---------------------------------------------------

//! Tests set this to n > 0: the n-th step of writing a checkpoint from now
//! (opening, each write, each fsync, each rename) fails with
//! checkpoint_error, as a crash there would stop it. 0: off.
inline std::atomic<long>& fault_countdown() noexcept {
  static std::atomic<long> n{0};
  return n;
}
inline void fault_point(const char* what, const fs::path& file) {
  long n = fault_countdown().load(std::memory_order_relaxed);
  while (n > 0) {
    if (fault_countdown().compare_exchange_weak(n, n - 1)) {
      if (n == 1) fail(file, std::string("injected failure at ") + what);
      return;
    }
  }
}

// -- files -------------------------------------------------------------------------

inline std::string errno_text() { return std::strerror(errno); }

inline void fsync_path(const fs::path& p, bool directory) {
  fault_point("fsync", p);
  const int fd = ::open(p.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) fail(p, "cannot open to fsync: " + errno_text());
  const int rc = ::fsync(fd);
  const std::string why = rc != 0 ? errno_text() : "";
  ::close(fd);
  if (rc != 0) fail(p, "fsync failed: " + why);
}

inline void rename_path(const fs::path& from, const fs::path& to) {
  fault_point("rename", to);
  if (::rename(from.c_str(), to.c_str()) != 0) fail(to, "cannot rename " + from.string() + " to it: " + errno_text());
}

// A file written under a temporary name, fsynced and renamed into place by
// `commit`; removed when destroyed uncommitted.
class AtomicFile {
 public:
  explicit AtomicFile(fs::path final_path)
      : final_(std::move(final_path)), temp_(final_.string() + ".tmp-" + std::to_string(::getpid())) {
    fault_point("open", final_);
    fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) fail(temp_, "cannot create: " + errno_text());
  }
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(temp_.c_str());
  }

  void write(std::span<const std::byte> bytes) {
    constexpr std::size_t step = std::size_t{64} << 20;  // a failure point per 64 MiB
    for (std::size_t at = 0; at < bytes.size();) {
      fault_point("write", final_);
      const std::size_t n = std::min(step, bytes.size() - at);
      std::size_t done = 0;
      while (done < n) {
        const ::ssize_t w = ::write(fd_, bytes.data() + at + done, n - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) fail(temp_, "write failed: " + errno_text());
        done += static_cast<std::size_t>(w);
      }
      at += n;
      written_ += n;
    }
  }
  void write_at(std::size_t offset, std::span<const std::byte> bytes) {
    fault_point("write", final_);
    std::size_t done = 0;
    while (done < bytes.size()) {
      const ::ssize_t w = ::pwrite(fd_, bytes.data() + done, bytes.size() - done, static_cast<off_t>(offset + done));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) fail(temp_, "write failed: " + errno_text());
      done += static_cast<std::size_t>(w);
    }
  }
  std::uint64_t written() const noexcept { return written_; }

  void commit() {
    fault_point("fsync", final_);
    if (::fsync(fd_) != 0) fail(temp_, "fsync failed: " + errno_text());
    const int rc = ::close(fd_);
    fd_ = -1;
    if (rc != 0) fail(temp_, "close failed: " + errno_text());
    rename_path(temp_, final_);
    committed_ = true;
  }

 private:
  fs::path final_;
  fs::path temp_;
  int fd_ = -1;
  bool committed_ = false;
  std::uint64_t written_ = 0;
};

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
                   std::to_string(format_version) + " (a newer psx wrote it)");
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

// A whole file in memory, uninitialized before the read.
struct Loaded {
  std::unique_ptr<std::byte[]> bytes;
  std::size_t size = 0;
  std::span<const std::byte> all() const noexcept { return {bytes.get(), size}; }
};

inline Loaded read_file(const fs::path& file) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(file, errno == ENOENT ? "missing" : "cannot open: " + errno_text());
  struct ::stat st {};
  if (::fstat(fd, &st) != 0) {
    const std::string why = errno_text();
    ::close(fd);
    fail(file, "cannot stat: " + why);
  }
  Loaded out;
  out.size = static_cast<std::size_t>(st.st_size);
  try {
    out.bytes = std::make_unique_for_overwrite<std::byte[]>(out.size);
  } catch (const std::bad_alloc&) {  // a damaged file system's size, say
    ::close(fd);
    fail(file, "of " + std::to_string(out.size) + " bytes does not fit in memory");
  }
  std::size_t done = 0;
  while (done < out.size) {
    const ::ssize_t r = ::read(fd, out.bytes.get() + done, out.size - done);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      const std::string why = r < 0 ? errno_text() : "the file shrank while being read";
      ::close(fd);
      fail(file, "read failed: " + why);
    }
    done += static_cast<std::size_t>(r);
  }
  ::close(fd);
  return out;
}

// A file checked end to end: its header, and the CRCs of its two parts.
struct Verified {
  Loaded file;
  Header header;
  std::span<const std::byte> meta, data;
};

inline Verified verify_bytes(Loaded file, FileKind want, const fs::path& path) {
  Verified v;
  v.header = decode_header(file.all(), file.size, want, path);
  v.meta = file.all().subspan(header_bytes, v.header.meta_bytes);
  v.data = file.all().subspan(header_bytes + v.header.meta_bytes, v.header.data_bytes);
  if (::psx::detail::crc32c(v.meta) != v.header.meta_crc) fail(path, "corrupted metadata (CRC-32C mismatch)");
  if (::psx::detail::crc32c(v.data) != v.header.data_crc) fail(path, "corrupted data (CRC-32C mismatch)");
  v.file = std::move(file);
  return v;
}

// The header alone (what the chief records in the manifest, and what
// `latest()` checks without reading the data).
inline Header read_header(const fs::path& file, FileKind want, std::uint64_t* size = nullptr) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(file, errno == ENOENT ? "missing" : "cannot open: " + errno_text());
  struct ::stat st {};
  std::array<std::byte, header_bytes> b{};
  ::ssize_t got = 0;
  if (::fstat(fd, &st) == 0) got = ::pread(fd, b.data(), b.size(), 0);
  ::close(fd);
  if (got < 0) fail(file, "cannot read: " + errno_text());
  if (size) *size = static_cast<std::uint64_t>(st.st_size);
  return decode_header(std::span<const std::byte>(b.data(), static_cast<std::size_t>(got)),
                       static_cast<std::uint64_t>(st.st_size), want, file);
}

// -- cereal over memory ----------------------------------------------------------------

struct MemoryBuf : std::streambuf {
  explicit MemoryBuf(std::span<const std::byte> b) {
    char* p = const_cast<char*>(reinterpret_cast<const char*>(b.data()));
    setg(p, p, p + b.size());
  }
};

// A string whose length is checked before anything is allocated for it.
struct BoundedString {
  std::string* s;
  template <class Ar>
  void save(Ar& ar) const {
    ar(static_cast<std::uint64_t>(s->size()));
    ar(cereal::binary_data(s->data(), s->size()));
  }
  template <class Ar>
  void load(Ar& ar) {
    std::uint64_t n = 0;
    ar(n);
    if (n > max_name_bytes) throw checkpoint_error("a " + std::to_string(n) + "-byte name, over the limit of " + std::to_string(max_name_bytes));
    s->resize(n);
    ar(cereal::binary_data(s->data(), n));
  }
};

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
  return m;
}

inline Manifest load_manifest(const fs::path& dir) {
  const fs::path file = dir / manifest_name;
  Verified v = verify_bytes(read_file(file), FileKind::manifest, file);
  return decode_manifest(v.meta, v.header, file);
}

// -- restore: what a server reads ----------------------------------------------------------


// Whether the checkpoint `m` can restore a variable: it is in it with the
// same shape, dtype and row width, and the optimizer keeps as many slots.
inline void check_variable(const Manifest& m, const fs::path& manifest_file, const ManifestVariable* v,
                           const VariableMeta& meta, std::size_t num_slots) {
  if (!v) fail(manifest_file, "has no variable '" + meta.name + "', which this program declares");
  std::vector<std::uint64_t> declared(meta.shape.begin(), meta.shape.end());
  if (v->shape != declared)
    fail(manifest_file, "variable '" + meta.name + "' has shape " + shape_text(v->shape) + ", declared " + shape_text(declared));
  if (v->dtype != dtype_name(meta.dtype))
    fail(manifest_file, "variable '" + meta.name + "' is " + v->dtype + ", declared " + dtype_name(meta.dtype));
  if (v->row_width != meta.row_width)
    fail(manifest_file, "variable '" + meta.name + "' has rows of " + std::to_string(v->row_width) + " floats, declared " +
                            std::to_string(meta.row_width));
  if (m.optimizer_slots != num_slots)
    fail(manifest_file, "its optimizer (" + m.optimizer + ") keeps " + std::to_string(m.optimizer_slots) +
                            " slots per parameter, this program's " + std::to_string(num_slots));
}

inline const ManifestVariable* find_variable(const Manifest& m, const std::string& name) {
  for (const ManifestVariable& v : m.variables)
    if (v.name == name) return &v;
  return nullptr;
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
  for (const VariableInfo& v : variables)
    check_variable(m, dir / manifest_name, find_variable(m, v.meta.name), v.meta, num_slots);
}

// Whether every shard file of the checkpoint `m` in `dir` has the header
// and size the manifest lists (their data is not read).
inline void check_files(const Manifest& m, const fs::path& dir) {
  for (const ManifestFile& f : m.files) {
    std::uint64_t size = 0;
    const Header h = read_header(dir / f.name, FileKind::shards, &size);
    check_listed(dir / f.name, size, h, f, m.step);
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

template <class T>
std::string describe(const T& x) {
  if constexpr (requires(std::ostream& os) { os << x; }) {
    std::ostringstream os;
    os << x;
    return std::move(os).str();
  } else {
    return typeid(T).name();
  }
}

// What a ParameterServer tells the manifest about itself.
struct ClusterDescription {
  std::string partitioner, sync_policy, optimizer;
  std::uint64_t optimizer_slots = 0;
  std::uint64_t num_servers = 0, num_workers = 0;
};

template <class PS>
ClusterDescription describe_cluster(const PS& ps) {
  return {describe(ps.partitioner()), describe(ps.sync_policy()), describe(ps.optimizer()), ps.optimizer().slots(),
          ps.config().num_servers, ps.config().num_workers};
}

inline std::uint64_t random64() {
  std::random_device rd;
  return (std::uint64_t{rd()} << 32) ^ rd();
}

}  // namespace detail

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

namespace detail {

// Servers that read their part of the checkpoint of `step` drop it.
inline void drop_staged_restore(Worker& w, std::uint64_t step) noexcept {
  try {
    ::psx::detail::WorkerAccess::call_every_server(w, Op::restore, step, "-");
  } catch (...) {  // a server that cannot be told drops it at the next restore
  }
}

// Runs `f` on the chief alone, then a barrier in which every worker learns
// whether it worked (Worker::agree_max): the chief rethrows its own error,
// the others throw a checkpoint_error saying the chief could not `what`.
template <class F>
void on_chief(Worker& w, const std::string& what, F&& f) {
  std::exception_ptr error;
  if (w.is_chief()) {
    try {
      f();
    } catch (const std::filesystem::filesystem_error& e) {  // creating or removing a directory
      error = std::make_exception_ptr(checkpoint_error("psx: " + what + ": " + e.what()));
    } catch (...) {
      error = std::current_exception();
    }
  }
  const bool failed = w.agree_max(error ? 1 : 0) != 0;
  if (error) std::rethrow_exception(error);
  if (failed)
    throw checkpoint_error("psx: worker " + std::to_string(w.index()) + ": the chief could not " + what +
                           " (its error says why)");
}

// A checkpoint whose own files are at fault (a manifest or shard file
// missing, truncated, corrupted, or not the one the manifest lists), as
// opposed to one this program cannot restore (other variables, another
// optimizer) or a cluster that failed: `Manager::restore_or_init` goes on
// to an older checkpoint.
class damaged_checkpoint : public checkpoint_error {
 public:
  using checkpoint_error::checkpoint_error;
};

// The chief's part of a restore (inside on_chief): checks the checkpoint in
// `dir` (of step `step`, where its directory's name says it), has every
// server read and check its part, CRCs included, and keep it aside; only
// when all of them could, has them apply it. Returns its step. Throws
// damaged_checkpoint when its files are at fault, with nothing applied on
// any server.
template <class PS>
std::uint64_t restore_on_chief(const PS& ps, Worker& w, const fs::path& dir,
                               std::optional<std::uint64_t> step = std::nullopt) {
  Manifest m;
  try {
    m = load_complete(dir, step);
  } catch (const checkpoint_error& e) {
    throw damaged_checkpoint(e.what());
  }
  check_compatible(m, dir, ::psx::detail::WorkerAccess::variables(w), ps.optimizer().slots(),
                   describe(ps.optimizer()));
  try {
    ::psx::detail::WorkerAccess::call_every_server(w, Op::restore, m.step, dir.string());
  } catch (const checkpoint_error& e) {
    drop_staged_restore(w, m.step);
    // A server passes on the reader's error as it is, and the reader's
    // errors all come from `fail`, which names the file first; the
    // server's own (a dynamic table) name the server.
    if (std::string_view(e.what()).starts_with("psx: checkpoint file ")) throw damaged_checkpoint(e.what());
    throw;
  } catch (...) {
    drop_staged_restore(w, m.step);
    throw;
  }
  ::psx::detail::WorkerAccess::call_every_server(w, Op::restore, m.step, "");
  return m.step;
}

}  // namespace detail

//! Saves the cluster's state into `root/ckpt-<step>` (step: the worker's
//! clock, the same on every worker). Collective: every worker calls it; the
//! chief has every server write its shards into a temporary directory,
//! writes the manifest, and renames the directory into place; the others
//! wait on barriers. A save that fails (on any server) leaves the earlier
//! checkpoints as they were and throws checkpoint_error on every worker
//! (the chief's own error on the chief).
template <class PS>
Info save(const PS& ps, Worker& w, const std::filesystem::path& root) {
  namespace fs = std::filesystem;
  if (root.empty()) throw checkpoint_error("psx: checkpoint::save: the checkpoint directory is empty");
  const std::uint64_t step = w.clock();
  const fs::path abs_root = fs::absolute(root);
  const fs::path final_dir = abs_root / detail::checkpoint_dir_name(step);
  w.barrier();  // every worker's pushes of this step have reached the servers
  // Nobody trains on while the chief saves, and everyone learns whether it could.
  detail::on_chief(w, "save the checkpoint of step " + std::to_string(step) + " in " + abs_root.string(), [&] {
    fs::create_directories(abs_root);
    // What a save that failed or crashed left: a temporary directory is
    // never complete; a replaced one (".old-") goes back into place when
    // the crash came between the two renames that swap a step's checkpoint.
    std::vector<fs::path> left;
    for (const auto& e : fs::directory_iterator(abs_root))
      if (e.path().filename().string().rfind(".ckpt-", 0) == 0) left.push_back(e.path());
    for (const fs::path& p : left) {
      const std::string name = p.filename().string();
      const auto old = name.find(".old-");
      const fs::path original = abs_root / name.substr(1, old == std::string::npos ? 0 : old - 1);
      if (old != std::string::npos && !fs::exists(original)) detail::rename_path(p, original);
      else fs::remove_all(p);
    }
    char suffix[24];
    std::snprintf(suffix, sizeof suffix, "%016llx", static_cast<unsigned long long>(detail::random64()));
    const fs::path temp = abs_root / ("." + detail::checkpoint_dir_name(step) + ".tmp-" + suffix);
    fs::create_directory(temp);
    ::psx::detail::WorkerAccess::call_every_server(w, Op::save, step, temp.string());
    const auto cluster = detail::describe_cluster(ps);
    Manifest m;
    m.step = step;
    m.created_unix = std::chrono::duration_cast<std::chrono::seconds>(
                         std::chrono::system_clock::now().time_since_epoch())
                         .count();
    m.num_servers = cluster.num_servers;
    m.num_workers = cluster.num_workers;
    m.partitioner = cluster.partitioner;
    m.sync_policy = cluster.sync_policy;
    m.optimizer = cluster.optimizer;
    m.optimizer_slots = cluster.optimizer_slots;
    for (const VariableInfo& v : ::psx::detail::WorkerAccess::variables(w)) {
      ManifestVariable mv{v.meta.name, {v.meta.shape.begin(), v.meta.shape.end()},
                          v.meta.kind == VariableKind::dense ? "dense" : "sparse", dtype_name(v.meta.dtype),
                          v.trainable, v.meta.row_width, {}};
      for (const Shard& s : v.shards) mv.shards.push_back({s.server, s.row_begin, s.row_end});
      m.variables.push_back(std::move(mv));
    }
    for (std::size_t s = 0; s < cluster.num_servers; ++s) {
      const std::string name = detail::server_file_name(s);
      std::uint64_t size = 0;
      const auto h = detail::read_header(temp / name, detail::FileKind::shards, &size);
      if (h.step != step || h.server != s) detail::fail(temp / name, "written for another step or server");
      m.files.push_back({name, size, h.crc});
    }
    detail::write_manifest(temp, m);
    detail::fsync_path(temp, true);
    if (fs::exists(final_dir)) {  // this step was saved before: the new one replaces it
      const fs::path old = abs_root / ("." + detail::checkpoint_dir_name(step) + ".old-" + suffix);
      detail::rename_path(final_dir, old);
      detail::rename_path(temp, final_dir);
      fs::remove_all(old);
    } else {
      detail::rename_path(temp, final_dir);
    }
    detail::fsync_path(abs_root, true);
  });
  return {final_dir, step};
}

//! Restores the checkpoint in `dir` into the cluster, whatever its number of
//! servers and partitioner, and sets every worker's clock to its step;
//! returns the step. Collective: every worker calls it before training
//! (the chief reads the manifest and has every server load its shards; the
//! others learn the step from it).
//!
//! All or nothing up to the last step: the chief checks the manifest
//! against the declared variables and every shard file's header and size;
//! then every server reads what its shards need and checks every CRC,
//! keeping it aside; only when all of them could does the chief have them
//! apply it. A checkpoint refused before that changes nothing anywhere (no
//! clock either); a server failing while it applies (a ZeroMQ server
//! restarted meanwhile, a device error) leaves the servers before it on
//! the checkpoint (restore again). A failure throws on every worker: on the
//! chief the checkpoint_error naming the file and the problem, on the
//! others one saying the chief could not.
template <class PS>
std::uint64_t restore(const PS& ps, Worker& w, const std::filesystem::path& dir) {
  if (dir.empty()) throw checkpoint_error("psx: checkpoint::restore: the checkpoint path is empty");
  const std::filesystem::path abs_dir = std::filesystem::absolute(dir);
  // Only the chief reads the manifest (in on_chief), and everyone learns
  // its step: a worker that could not read it (a host that does not see the
  // shared directory) once threw while the others waited at the barrier.
  std::optional<std::uint64_t> restored;
  // Every worker is here, none still in its last step: the servers' clocks
  // are about to be set to the checkpoint's step (without this, a restore
  // called during a run could hang a slower worker).
  w.barrier();
  // Everyone learns whether it was restored.
  detail::on_chief(w, "restore " + abs_dir.string(), [&] {
    try {
      restored = detail::restore_on_chief(ps, w, abs_dir);
    } catch (const detail::damaged_checkpoint& e) {  // the public type: only restore_or_init tells them apart
      throw checkpoint_error(e.what());
    }
  });
  const std::uint64_t step = w.agree_max(restored.value_or(0));
  ::psx::detail::WorkerAccess::set_clock(w, step);
  return step;
}

//! When and where to save, and how many checkpoints to keep.
struct Options {
  std::filesystem::path directory;
  //! Save when a worker's clock is a multiple of this (0: never by itself).
  std::uint64_t every_steps = 0;
  //! Also save when this long has passed since the last save (or the start),
  //! by the chief's clock (0: never by time). The workers agree on it every
  //! `check_every_steps` steps (`Worker::agree_max`, a barrier), so a save
  //! comes at the first such step after the time is up.
  std::chrono::seconds every_seconds{0};
  std::uint64_t check_every_steps = 10;
  //! Complete checkpoints kept; older ones are deleted after a save (0: keep all).
  std::size_t max_to_keep = 5;
};

//! Saves every N steps, keeps the last `max_to_keep`, and resumes a run
//! from the newest checkpoint that restores whole.
template <class PS>
class Manager {
 public:
  Manager(const PS& ps, Options options) : ps_(&ps), options_(std::move(options)) {
    if (options_.directory.empty()) throw config_error("psx: checkpoint::Manager needs a directory");
    if (options_.every_seconds.count() < 0 || (options_.every_seconds.count() > 0 && options_.check_every_steps == 0))
      throw config_error("psx: checkpoint::Manager: every_seconds must be >= 0, and check_every_steps >= 1 with it");
  }

  const Options& options() const noexcept { return options_; }
  //! The newest complete checkpoint (`checkpoint::latest`: its data is not
  //! read), if any.
  std::optional<Info> latest() const { return checkpoint::latest(options_.directory); }
  //! Every complete checkpoint, oldest first (`checkpoint::list`).
  std::vector<Info> all() const { return checkpoint::list(options_.directory); }

  //! Collective, before training: restores the newest checkpoint that
  //! verifies whole (manifest, every shard file at its full length, every
  //! CRC, data included) and returns its step; returns 0 and changes
  //! nothing when the directory holds no checkpoint. Each newer one passed
  //! over for its files prints one line on stderr, `psx: warning:
  //! checkpoint: skipping step <step> in <directory>: <why>`; a checkpoint
  //! this program cannot restore (other variables, another optimizer)
  //! throws, as does a directory whose checkpoints are all damaged (the
  //! checkpoint_error lists each and why): a run never silently starts
  //! over from an older state, or from scratch. A worker that rejoined a
  //! job that went on without it (`Worker::rejoined`: a restarted process
  //! under `Asynchronous` or a `shrink` policy) restores nothing and calls
  //! no collective: it returns the clock `run` gave it, the others' step.
  std::uint64_t restore_or_init(Worker& w) {
    // A restarted process of a worker that the others trained on without
    // (Worker::rejoined): the job's start is long past, and the others
    // make no collective for it; it goes on from the step `run` gave it,
    // with the parameters as the others trained them.
    if (w.rejoined()) return w.clock();
    // The chief's view decides, and everyone learns it: workers that each
    // looked for themselves could see different newest checkpoints (one
    // written meanwhile, a host's stale view of a shared directory), and
    // one restoring while another went on to train called the collectives
    // out of step.
    const std::filesystem::path root = std::filesystem::absolute(options_.directory);
    std::optional<std::uint64_t> restored;
    // As in restore: no worker is still in a step when the servers' clocks are set.
    w.barrier();
    // A listing or restore that throws on the chief throws on every worker,
    // none left waiting in a collective.
    detail::on_chief(w, "restore a checkpoint from " + root.string(), [&] {
      const std::vector<Info> found = detail::checkpoint_dirs(root);
      // Tried newest first, each read once: a restore whose data fails its
      // CRC on any server is dropped by all of them before anything is
      // applied, so the next older one starts from the same state.
      std::string problems;
      for (auto c = found.rbegin(); c != found.rend(); ++c) {
        try {
          restored = detail::restore_on_chief(*ps_, w, c->path, c->step);
          return;
        } catch (const detail::damaged_checkpoint& e) {
          const std::string why(::psx::detail::without_psx_prefix(e.what()));
          std::fprintf(stderr, "psx: warning: checkpoint: skipping step %llu in %s: %s\n",
                       static_cast<unsigned long long>(c->step), root.c_str(), why.c_str());
          problems += "; step " + std::to_string(c->step) + ": " + why;
        }
      }
      if (!found.empty())
        throw checkpoint_error("psx: checkpoint: no checkpoint in " + root.string() + " can be restored (" +
                               std::to_string(found.size()) + " found), and starting from scratch would silently "
                               "discard them; repair or remove them to start afresh: " + problems.substr(2));
    });
    if (w.agree_max(restored ? 1 : 0) == 0) return 0;
    const std::uint64_t step = w.agree_max(restored.value_or(0));
    ::psx::detail::WorkerAccess::set_clock(w, step);
    return step;
  }

  //! Collective, after `w.step()`: saves when the clock is a multiple of
  //! `every_steps`, or when `every_seconds` have passed (checked every
  //! `check_every_steps` steps); returns whether it saved.
  bool maybe_save(Worker& w) {
    const std::uint64_t clock = w.clock();
    bool due = options_.every_steps > 0 && clock % options_.every_steps == 0;
    if (options_.every_seconds.count() > 0 && clock % options_.check_every_steps == 0) {
      // Only the chief's clock counts; the others learn its answer.
      const bool late = w.is_chief() && std::chrono::steady_clock::now() - last_save_ >= options_.every_seconds;
      due = w.agree_max(late ? 1 : 0) == 1 || due;
    }
    if (!due) return false;
    save(w);
    return true;
  }

  //! Collective: saves now, then deletes the oldest checkpoints of steps up
  //! to this one beyond `max_to_keep`, never the one just saved.
  //! Checkpoints of later steps (a run rolled back to an earlier one) are
  //! left alone, and `latest()` takes the highest step: remove them, or
  //! save into another directory, to resume the new run.
  Info save(Worker& w) {
    Info info = checkpoint::save(*ps_, w, options_.directory);
    if (w.is_chief()) last_save_ = std::chrono::steady_clock::now();
    if (w.is_chief() && options_.max_to_keep > 0) {
      std::vector<Info> older;  // oldest first, up to the one just saved
      for (const Info& c : checkpoint::list(options_.directory))
        if (c.step <= info.step) older.push_back(c);
      for (std::size_t i = 0; i + options_.max_to_keep < older.size(); ++i) {
        if (older[i].step == info.step) continue;
        std::error_code ec;
        // The manifest first: a half-deleted checkpoint is never "complete".
        std::filesystem::remove(older[i].path / detail::manifest_name, ec);
        std::filesystem::remove_all(older[i].path, ec);
      }
    }
    return info;
  }

 private:
  const PS* ps_;
  Options options_;
  std::chrono::steady_clock::time_point last_save_ = std::chrono::steady_clock::now();  // the chief's only
};

}  // namespace checkpoint

//! `psx::CheckpointManager<PS>`: the same as `psx::checkpoint::Manager<PS>`.
template <class PS>
using CheckpointManager = checkpoint::Manager<PS>;

}  // namespace v0
}  // namespace psx

//! @file psx/checkpoint/files.hpp
//! Writing files durably (a temporary name, fsync, rename, with injected
//! failures for tests) and reading whole files checked against their
//! envelope; cereal archives over bytes in memory.
#pragma once

#include <psx/checkpoint/format.hpp>

#include <cereal/archives/portable_binary.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <new>
#include <span>
#include <streambuf>
#include <string>
#include <utility>

namespace psx {
inline namespace v0 {
namespace checkpoint {

namespace detail {

namespace fs = std::filesystem;

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
  //! Writes `bytes` a block of 4 MiB at a time, each put through `crc`
  //! (`crc(block, so_far)`, e.g. detail::crc32c) while in cache; returns
  //! the checksum of everything summed so far, `so_far` included.
  template <class Crc>
  std::uint32_t write_summed(std::span<const std::byte> bytes, std::uint32_t so_far, Crc&& crc) {
    constexpr std::size_t block = std::size_t{4} << 20;
    for (std::size_t at = 0; at < bytes.size(); at += block) {
      const auto part = bytes.subspan(at, std::min(block, bytes.size() - at));
      so_far = crc(part, so_far);
      write(part);
    }
    return so_far;
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

// A whole file in memory, uninitialized before the read.
struct Loaded {
  std::unique_ptr<std::byte[]> bytes;
  std::size_t size = 0;
  std::span<const std::byte> all() const noexcept { return {bytes.get(), size}; }
};

// A file open for reading (closed with this), and its size.
class InputFile {
 public:
  explicit InputFile(fs::path file) : path_(std::move(file)) {
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) fail(path_, errno == ENOENT ? "missing" : "cannot open: " + errno_text());
    struct ::stat st {};
    if (::fstat(fd_, &st) != 0) {
      const std::string why = errno_text();
      ::close(fd_);
      fail(path_, "cannot stat: " + why);
    }
    size_ = static_cast<std::uint64_t>(st.st_size);
  }
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;
  ~InputFile() { ::close(fd_); }

  std::uint64_t size() const noexcept { return size_; }
  const fs::path& path() const noexcept { return path_; }
  //! Reads `n` bytes at `at`, all of them.
  void read(std::byte* out, std::size_t n, std::uint64_t at) const {
    std::size_t done = 0;
    while (done < n) {
      const ::ssize_t got = ::pread(fd_, out + done, n - done, static_cast<off_t>(at + done));
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) fail(path_, "cannot read: " + errno_text());
      if (got == 0) fail(path_, "the file shrank while being read");
      done += static_cast<std::size_t>(got);
    }
  }
  //! Its first `header_bytes` bytes (all of it, when shorter), read into `b`.
  std::span<const std::byte> head(std::array<std::byte, header_bytes>& b) const {
    const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(header_bytes, size_));
    read(b.data(), n, 0);
    return std::span<const std::byte>(b).first(n);
  }

 private:
  fs::path path_;
  int fd_ = -1;
  std::uint64_t size_ = 0;
};

inline Loaded read_file(const fs::path& file) {
  const InputFile in(file);
  Loaded out;
  out.size = static_cast<std::size_t>(in.size());
  try {
    out.bytes = std::make_unique_for_overwrite<std::byte[]>(out.size);
  } catch (const std::bad_alloc&) {  // a damaged file system's size, say
    fail(file, "of " + std::to_string(out.size) + " bytes does not fit in memory");
  }
  in.read(out.bytes.get(), out.size, 0);
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
  const InputFile in(file);
  std::array<std::byte, header_bytes> b{};
  const auto head = in.head(b);
  if (size) *size = in.size();
  return decode_header(head, in.size(), want, file);
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

}  // namespace detail

}  // namespace checkpoint

}  // namespace v0
}  // namespace psx

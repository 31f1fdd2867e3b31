// What the checkpoint benchmarks measure psx against: a plain sequential
// file of the same bytes (write() + fsync, read() into a new buffer), and
// the page cache dropped between reads where this process may.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

namespace psx_bench {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

inline double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

[[noreturn]] inline void die(const std::string& what) {
  throw std::runtime_error(what + ": " + std::strerror(errno));
}

// Empties the page cache; false where this process may not.
inline bool drop_caches() {
  ::sync();
  const int fd = ::open("/proc/sys/vm/drop_caches", O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = ::write(fd, "3", 1) == 1;
  ::close(fd);
  return ok;
}

// `sync`: fsync before closing, as psx's checkpoint and export files are.
inline void plain_write(const fs::path& file, const std::byte* data, std::size_t size, bool sync = true) {
  const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) die("open " + file.string());
  for (std::size_t done = 0; done < size;) {
    const ::ssize_t w = ::write(fd, data + done, size - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) die("write " + file.string());
    done += static_cast<std::size_t>(w);
  }
  if (sync && ::fsync(fd) != 0) die("fsync " + file.string());
  ::close(fd);
}

// Reads the whole file into a new buffer, which the caller frees (untimed).
inline std::unique_ptr<std::byte[]> plain_read(const fs::path& file, std::size_t size) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) die("open " + file.string());
  auto buf = std::make_unique_for_overwrite<std::byte[]>(size);
  for (std::size_t done = 0; done < size;) {
    const ::ssize_t r = ::read(fd, buf.get() + done, size - done);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) die("read " + file.string());
    done += static_cast<std::size_t>(r);
  }
  ::close(fd);
  return buf;
}

inline std::uint64_t shard_bytes(const fs::path& dir) {
  std::uint64_t sum = 0;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().rfind("server-", 0) == 0) sum += e.file_size();
  return sum;
}

// A directory of this run's own under the temp directory (or `base`),
// removed with what it holds when the run ends.
struct ScratchDir {
  explicit ScratchDir(const std::string& prefix, const fs::path& base = fs::temp_directory_path())
      : path(base / (prefix + "-" + std::to_string(::getpid()))) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  // Whether `bytes` fit in its file system; says why not on stderr.
  bool has_room(double bytes, const char* program) const {
    const double free = static_cast<double>(fs::space(path).available);
    if (free >= bytes) return true;
    std::fprintf(stderr, "%s: %s has %.1f GiB free, this run needs %.1f GiB: ask for a smaller size\n", program,
                 path.c_str(), free / (1 << 30), bytes / (1 << 30));
    return false;
  }

  fs::path path;
};

}  // namespace psx_bench

// Tensors of any size round-trip bit for bit, 2^31 - 4, 2^31 and 2^32 bytes
// among them (docs/wire.md "Large tensors"): pushed (SGD with lr 1 onto
// zeros: the parameters become the negated gradient exactly) and pulled
// back, over the in-process transport and over ZeroMQ, through a checkpoint
// (saved, the cluster let go, restored into another cluster of 2 servers)
// and through an export (written by export_model, read back by load_export,
// and the tensor's bytes in model.safetensors and model.npz read in place).
//
// Element i holds bits that no other element holds (`pattern`), and every
// element is checked: a chunk misplaced, a byte lost where a frame splits a
// float, or a piece written twice shows, with its index and the chunk it
// lies in.
//
// A program of its own, each case a process of its own (as table_memory):
// peak resident memory is a property of the process. It prints VmHWM and
// checks it against a bound in tensors (`bound` below; docs/wire.md gives
// the figures).
//
//   psx_big_tensors [--gated] inprocess|zmq|checkpoint|export FLOATS [CHUNK_BYTES]
//
// FLOATS: the dense variable's floats (2^29 - 1: 2^31 - 4 bytes, the largest
// float tensor below 2 GiB, one frame at the default chunk; 2^29: 2^31 bytes,
// a frame of 2^31 - 1 bytes and one of 1; 2^30: 2^32 bytes). CHUNK_BYTES:
// `Zmq::chunk_bytes` (default its default, 2^31 - 1).
//
// A case whose bound is over 6 GiB, or run `--gated`, is skipped (exit 77)
// unless PSX_BIG_TENSORS=1; any case is skipped when the machine has less
// memory available than its bound or too little room in the temp
// directory for its files, and under a sanitizer when over 64 MiB (the
// sanitizers' shadow memory and quarantine make such runs slow and their
// memory figures meaningless).
#include <psx/checkpoint.hpp>
#include <psx/export.hpp>
#include <psx/psx.hpp>
#include <psx/transport/zmq.hpp>

#include "../../benchmarks/proc_status.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define PSX_BIG_TENSORS_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
#define PSX_BIG_TENSORS_SANITIZED 1
#endif
#endif

namespace {

namespace fs = std::filesystem;
using psx_bench::proc_status;
using Clock = std::chrono::steady_clock;

constexpr std::uint64_t GiB = std::uint64_t{1} << 30;

// Element i's value: its bits are i's, every index its own (exponents 64 to
// 191 and both signs: finite, normal, never a NaN), for i < 2^31. A
// gradient of -pattern(i) onto zero parameters with SGD at lr 1 gives
// 0 - 1 * -p = p exactly.
inline float pattern(std::uint64_t i) noexcept {
  const auto bits = static_cast<std::uint32_t>((((i >> 30) & 1) << 31) | ((64 + ((i >> 23) & 127)) << 23) | (i & 0x7fffff));
  return std::bit_cast<float>(bits);
}

// A buffer of floats that is not zeroed first (its pages are touched only
// where it is written, as a program's own would be).
struct Floats {
  explicit Floats(std::size_t n) : data(std::make_unique_for_overwrite<float[]>(n)), size(n) {}
  std::unique_ptr<float[]> data;
  std::size_t size;
  std::span<float> span() noexcept { return {data.get(), size}; }
};

void fill_negated(std::span<float> out) {
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = -pattern(i);
}

// Elements [first, first + got.size()) against the pattern; throws naming
// the first element that differs and where it lies.
void check_values(std::span<const float> got, std::uint64_t first, const std::string& what, std::uint32_t chunk) {
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::bit_cast<std::uint32_t>(got[i]) == std::bit_cast<std::uint32_t>(pattern(first + i))) continue;
    const std::uint64_t at = first + i, byte = at * 4;
    std::size_t bad = 0;
    for (std::size_t j = i; j < got.size(); ++j)
      bad += std::bit_cast<std::uint32_t>(got[j]) != std::bit_cast<std::uint32_t>(pattern(first + j));
    throw std::runtime_error(what + ": element " + std::to_string(at) + " (byte " + std::to_string(byte) +
                             ", in chunk " + std::to_string(byte / chunk) + " at byte " +
                             std::to_string(byte % chunk) + ") holds bits " +
                             std::to_string(std::bit_cast<std::uint32_t>(got[i])) + ", expected " +
                             std::to_string(std::bit_cast<std::uint32_t>(pattern(at))) + "; " + std::to_string(bad) +
                             " of the " + std::to_string(got.size() - i) + " from there differ");
  }
}

// The case: its way, its size, the chunk, and where its files go.
struct Case {
  std::string way;
  std::uint64_t floats = 0;
  std::uint32_t chunk = psx::detail::wire::max_chunk_bytes;
  fs::path dir;  // scratch, under the temp directory
  std::uint64_t bytes() const noexcept { return floats * 4; }
  std::string name() const { return way + " of " + std::to_string(floats) + " floats (" + std::to_string(bytes()) + " bytes)"; }
};

psx::VariableSpec variable(const Case& c) {
  return {.name = "x", .shape = {static_cast<std::size_t>(c.floats)}, .init = psx::Initializer::zeros()};
}

// Pushes -pattern, lets go of the gradient, pulls into a fresh buffer and
// checks it: what a worker does, with at most one tensor of its own.
void push_pull(psx::Worker& w, const Case& c, const std::string& what) {
  double push_s = 0, pull_s = 0;
  {
    Floats g(c.floats);
    fill_negated(g.span());
    const auto t0 = Clock::now();
    w.push("x", std::span<const float>(g.span()));
    push_s = std::chrono::duration<double>(Clock::now() - t0).count();
  }
  w.step();
  Floats back(c.floats);
  const auto t0 = Clock::now();
  w.pull("x", back.span());
  pull_s = std::chrono::duration<double>(Clock::now() - t0).count();
  check_values(back.span(), 0, what, c.chunk);
  // The push includes the server's update, the pull the first touch of
  // the fresh buffer's pages: what a user's first call sees.
  std::printf("big tensors: %s: push %.2f s (%.2f GB/s), pull %.2f s (%.2f GB/s)\n", what.c_str(), push_s,
              static_cast<double>(c.bytes()) / push_s / 1e9, pull_s, static_cast<double>(c.bytes()) / pull_s / 1e9);
}

using Sgd = psx::optim::SGD;
const Sgd kSgd{.lr = 1.0};

void run_inprocess(const Case& c) {
  psx::ParameterServer<psx::partition::RowRange, psx::sync::Asynchronous, Sgd> ps({1, 1}, {}, {}, kSgd);
  ps.declare(variable(c));
  ps.run([&](psx::Worker& w) { push_pull(w, c, "in-process push and pull"); });
}

// One server and the chief, each a thread with its own ZeroMQ context,
// over tcp on loopback.
void run_zmq(const Case& c) {
  using psx::transport::ClusterSpec;
  using psx::transport::Zmq;
  const ClusterSpec spec = ClusterSpec::local(1, 1);
  std::mutex mu;
  std::exception_ptr first;
  auto task = [&](std::string type) {
    try {
      Zmq z;
      z.tf.cluster = spec;
      z.tf.task = {type, 0};
      z.rendezvous = c.dir.string();
      z.start_timeout = std::chrono::milliseconds(60000);
      z.chunk_bytes = c.chunk;
      psx::ParameterServer<psx::partition::RowRange, psx::sync::Asynchronous, Sgd, Zmq> ps({1, 1}, {}, {}, kSgd, z);
      ps.declare(variable(c));
      ps.run([&](psx::Worker& w) { push_pull(w, c, "ZeroMQ push and pull"); });
    } catch (...) {
      std::lock_guard lock(mu);
      if (!first) first = std::current_exception();
    }
  };
  std::thread server(task, "ps");
  task("chief");
  server.join();
  if (first) std::rethrow_exception(first);
}

// Saved from a cluster of one server, restored into a new one of two
// (each reads its rows from the one file), pulled and checked.
void run_checkpoint(const Case& c) {
  fs::path saved;
  {
    psx::ParameterServer<psx::partition::RowRange, psx::sync::Asynchronous, Sgd> ps({1, 1}, {}, {}, kSgd);
    ps.declare(variable(c));
    ps.run([&](psx::Worker& w) {
      {
        Floats g(c.floats);
        fill_negated(g.span());
        w.push("x", std::span<const float>(g.span()));
      }
      w.step();
      saved = psx::checkpoint::save(ps, w, c.dir / "ckpt").path;
    });
  }
  psx::ParameterServer<psx::partition::RowRange, psx::sync::Asynchronous, Sgd> ps({2, 1}, {}, {}, kSgd);
  ps.declare(variable(c));
  ps.run([&](psx::Worker& w) {
    if (psx::checkpoint::restore(ps, w, saved) != 1) throw std::runtime_error("restored another step than 1");
    Floats back(c.floats);
    w.pull("x", back.span());
    check_values(back.span(), 0, "pulled after a checkpoint restore", c.chunk);
  });
}

// Reads `bytes` bytes at `at` of `file` a block at a time, checking them as
// floats from element `first` on (without holding them all: the check's own
// memory stays small).
void check_file_part(const fs::path& file, std::uint64_t at, std::uint64_t floats, const std::string& what) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("cannot open " + file.string());
  constexpr std::size_t block = std::size_t{16} << 20;
  Floats buf(block / 4);
  try {
    for (std::uint64_t done = 0; done < floats;) {
      const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(block / 4, floats - done));
      std::size_t got = 0;
      while (got < n * 4) {
        const ::ssize_t r = ::pread(fd, reinterpret_cast<char*>(buf.data.get()) + got, n * 4 - got,
                                    static_cast<off_t>(at + done * 4 + got));
        if (r <= 0) throw std::runtime_error(file.string() + ": short read");
        got += static_cast<std::size_t>(r);
      }
      check_values(std::span<const float>(buf.data.get(), n), done, what, psx::detail::wire::max_chunk_bytes);
      done += n;
    }
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
}

std::string read_bytes(const fs::path& file, std::uint64_t at, std::size_t n) {
  std::ifstream in(file, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(at));
  std::string s(n, '\0');
  if (!in.read(s.data(), static_cast<std::streamsize>(n))) throw std::runtime_error(file.string() + ": short read");
  return s;
}

template <class T>
T le(const std::string& s, std::size_t at) {
  T v;
  std::memcpy(&v, s.data() + at, sizeof v);
  return v;
}

// model.safetensors: the 8-byte header length, the JSON header, the data.
void check_safetensors(const fs::path& file, const Case& c) {
  const auto n = le<std::uint64_t>(read_bytes(file, 0, 8), 0);
  const std::string head = read_bytes(file, 8, static_cast<std::size_t>(n));
  const std::string want = "\"x\":{\"dtype\":\"F32\",\"shape\":[" + std::to_string(c.floats) + "],\"data_offsets\":[";
  const std::size_t at = head.find(want);
  if (at == std::string::npos) throw std::runtime_error("model.safetensors: no " + want + " in its header");
  const std::uint64_t begin = std::strtoull(head.c_str() + at + want.size(), nullptr, 10);
  const std::size_t comma = head.find(',', at + want.size());
  const std::uint64_t end = std::strtoull(head.c_str() + comma + 1, nullptr, 10);
  if (end - begin != c.bytes()) throw std::runtime_error("model.safetensors: data_offsets span " + std::to_string(end - begin) + " bytes");
  check_file_part(file, 8 + n + begin, c.floats, "model.safetensors");
}

// model.npz: "x.npy" is its first member (stored); above 4 GiB its sizes
// are in the ZIP64 extra field. The .npy header, then the data.
void check_npz(const fs::path& file, const Case& c) {
  const std::string local = read_bytes(file, 0, 30);
  if (le<std::uint32_t>(local, 0) != 0x04034b50) throw std::runtime_error("model.npz: no local header at 0");
  const auto name_len = le<std::uint16_t>(local, 26), extra_len = le<std::uint16_t>(local, 28);
  const std::string name = read_bytes(file, 30, name_len);
  if (name != "x.npy") throw std::runtime_error("model.npz: first member " + name);
  std::uint64_t size = le<std::uint32_t>(local, 22);
  if (size == 0xffffffffu) {
    const std::string extra = read_bytes(file, 30 + name_len, extra_len);
    if (extra_len < 20 || le<std::uint16_t>(extra, 0) != 1) throw std::runtime_error("model.npz: no ZIP64 extra field");
    size = le<std::uint64_t>(extra, 4);
  }
  const std::uint64_t npy = 30 + name_len + extra_len;
  const std::string magic = read_bytes(file, npy, 10);
  const auto header_len = le<std::uint16_t>(magic, 8);
  if (size != 10 + header_len + c.bytes())
    throw std::runtime_error("model.npz: member of " + std::to_string(size) + " bytes, expected " +
                             std::to_string(10 + header_len + c.bytes()));
  const std::string dict = read_bytes(file, npy + 10, header_len);
  if (dict.find("'shape': (" + std::to_string(c.floats) + ",)") == std::string::npos)
    throw std::runtime_error("model.npz: .npy header " + dict);
  check_file_part(file, npy + 10 + header_len, c.floats, "model.npz");
#if defined(PSX_PYTHON3) && defined(PSX_CHECK_NPZ)
  // And as numpy's users read it: Python's zipfile (ZIP64 above 4 GiB),
  // where that Python has numpy.
  if (std::system(PSX_PYTHON3 " -c 'import numpy' 2>/dev/null") == 0) {
    const std::string command = std::string(PSX_PYTHON3) + " " + PSX_CHECK_NPZ + " '" + file.string() + "' " +
                                std::to_string(c.floats);
    if (std::system(command.c_str()) != 0) throw std::runtime_error("model.npz: " + command + " failed");
  } else {
    std::printf("big tensors: no numpy in %s: model.npz not read by Python\n", PSX_PYTHON3);
  }
#endif
}

// Exported by the chief of a cluster of one server, then (the cluster let
// go) read back by load_export, and the two other files checked in place.
// A small variable "b" after it: in model.npz its member lies beyond x's
// bytes (above 4 GiB: an offset in a ZIP64 extra field).
void run_export(const Case& c) {
  fs::path dir;
  {
    psx::ParameterServer<psx::partition::RowRange, psx::sync::Asynchronous, Sgd> ps({1, 1}, {}, {}, kSgd);
    ps.declare(variable(c));
    ps.declare(psx::dense("b", {3}, psx::Initializer::constant(0.5f)));
    ps.run([&](psx::Worker& w) {
      {
        Floats g(c.floats);
        fill_negated(g.span());
        w.push("x", std::span<const float>(g.span()));
      }
      w.step();
      psx::ExportOptions options;
      options.base = c.dir / "export";
      dir = psx::export_model(ps, w, options);
    });
  }
  check_safetensors(dir / "model.safetensors", c);
  check_npz(dir / "model.npz", c);
  const psx::Export e = psx::load_export(dir);
  const psx::ExportedTensor& t = e["x"];
  if (t.dtype != "float32" || t.sparse || t.values.size() != c.bytes())
    throw std::runtime_error("load_export: x is " + t.dtype + (t.sparse ? ", sparse" : "") + ", " +
                             std::to_string(t.values.size()) + " bytes");
  check_values(std::span<const float>(reinterpret_cast<const float*>(t.values.data()), c.floats), 0, "load_export",
               psx::detail::wire::max_chunk_bytes);
  if (e["b"].to_float() != std::vector<float>(3, 0.5f)) throw std::runtime_error("load_export: b is not 3 x 0.5");
}

// The most this case may hold resident, in tensors, beyond what the process
// held before: see docs/wire.md ("Large tensors") for what each copy is.
double bound_in_tensors(const std::string& way) {
  if (way == "inprocess") return 2.0;   // the server's parameters, the worker's buffer
  if (way == "checkpoint") return 2.0;  // parameters, and the restore's staging buffer (or the pull's)
  if (way == "export") return 2.0;      // parameters and the copy read for the export; then the loaded export
  // zmq, both ends in this process: a push holds the parameters, the
  // worker's gradient and the frames received (a joined tensor's frames
  // given back as they are copied); a pull the parameters, the frames
  // received and the worker's buffer as they are copied into it.
  return 3.0;
}

std::uint64_t bound_bytes(const Case& c) {
  // A frame is given back a step at a time as it is copied, or whole when
  // smaller: one step or chunk of a joined copy held twice.
  const std::uint64_t step = std::min<std::uint64_t>({c.chunk, psx::detail::wire::release_step, c.bytes()});
  // 64 MiB for the rest: threads, libzmq's buffers, the checks' blocks.
  return static_cast<std::uint64_t>(bound_in_tensors(c.way) * static_cast<double>(c.bytes())) +
         (c.way == "zmq" ? step : 0) + (std::uint64_t{64} << 20);
}

// Bytes the case writes under the temp directory at most: a checkpoint's
// file, or an export's three.
std::uint64_t disk_bytes(const Case& c) {
  return c.way == "checkpoint" ? c.bytes() : c.way == "export" ? 3 * c.bytes() : 0;
}

std::uint64_t mem_available() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("MemAvailable:", 0) == 0) return std::strtoull(line.c_str() + 13, nullptr, 10) * 1024;
  return 0;
}

double gib(std::uint64_t b) { return static_cast<double>(b) / GiB; }

}  // namespace

int main(int argc, char** argv) {
  // --gated: skipped unless PSX_BIG_TENSORS=1, whatever its size.
  bool gated = false;
  if (argc > 1 && std::string(argv[1]) == "--gated") {
    gated = true;
    --argc;
    ++argv;
  }
  if (argc < 3) {
    std::fprintf(stderr, "usage: psx_big_tensors [--gated] inprocess|zmq|checkpoint|export FLOATS [CHUNK_BYTES]\n");
    return 2;
  }
  Case c;
  c.way = argv[1];
  c.floats = std::strtoull(argv[2], nullptr, 10);
  if (argc > 3) c.chunk = static_cast<std::uint32_t>(std::strtoul(argv[3], nullptr, 10));
  if (c.chunk == 0 || c.chunk > psx::detail::wire::max_chunk_bytes) {
    std::fprintf(stderr, "big tensors: CHUNK_BYTES must be in [1, 2^31 - 1]\n");
    return 2;
  }
  if (c.way != "inprocess" && c.way != "zmq" && c.way != "checkpoint" && c.way != "export") {
    std::fprintf(stderr, "big tensors: unknown way '%s'\n", c.way.c_str());
    return 2;
  }
  if (c.floats == 0 || c.floats > (std::uint64_t{1} << 31)) {
    std::fprintf(stderr, "big tensors: FLOATS must be in [1, 2^31]\n");
    return 2;
  }
  const std::uint64_t bound = bound_bytes(c);
#ifdef PSX_BIG_TENSORS_SANITIZED
  if (c.bytes() > (std::uint64_t{64} << 20)) {
    std::printf("big tensors: %s skipped under a sanitizer\n", c.name().c_str());
    return 77;
  }
#endif
  const char* flag = std::getenv("PSX_BIG_TENSORS");
  const bool asked = flag && std::string(flag) == "1";
  if ((gated || bound > 6 * GiB) && !asked) {
    std::printf("big tensors: %s skipped: it may hold %.1f GiB (PSX_BIG_TENSORS=1 runs it)\n", c.name().c_str(), gib(bound));
    return 77;
  }
  if (const std::uint64_t free = mem_available(); free != 0 && free < bound) {
    std::printf("big tensors: %s skipped: it may hold %.1f GiB, %.1f GiB available\n", c.name().c_str(), gib(bound),
                gib(free));
    return 77;
  }
  if (const std::uint64_t room = fs::space(fs::temp_directory_path()).available; room < disk_bytes(c) + GiB) {
    std::printf("big tensors: %s skipped: it writes %.1f GiB, %s has %.1f GiB free\n", c.name().c_str(),
                gib(disk_bytes(c)), fs::temp_directory_path().c_str(), gib(room));
    return 77;
  }
  c.dir = fs::temp_directory_path() / ("psx-big-" + std::to_string(::getpid()));
  fs::remove_all(c.dir);
  fs::create_directories(c.dir);
  const std::uint64_t base = proc_status("VmRSS");
  const auto t0 = Clock::now();
  int rc = 0;
  try {
    if (c.way == "inprocess") run_inprocess(c);
    else if (c.way == "zmq") run_zmq(c);
    else if (c.way == "checkpoint") run_checkpoint(c);
    else run_export(c);
  } catch (const std::exception& e) {
    std::printf("big tensors: %s FAILED: %s\n", c.name().c_str(), e.what());
    rc = 1;
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  std::error_code ec;
  fs::remove_all(c.dir, ec);
  const std::uint64_t peak = proc_status("VmHWM");
  const double held = peak > base ? static_cast<double>(peak - base) : 0.0;
  std::printf("big tensors: %s: %.1f s, peak RSS %.2f GiB (%.2f tensors over the %.0f MiB before; bound %.2f GiB)\n",
              c.name().c_str(), seconds, gib(peak), held / static_cast<double>(c.bytes()),
              static_cast<double>(base) / (1 << 20), gib(bound));
#ifdef PSX_BIG_TENSORS_SANITIZED
  constexpr bool sanitized = true;  // its shadow memory and quarantine are resident too
#else
  constexpr bool sanitized = false;
#endif
  if (sanitized) std::printf("big tensors: peak RSS not checked under a sanitizer\n");
  if (rc == 0 && !sanitized && peak != 0 && peak - std::min(peak, base) > bound) {
    std::printf("big tensors: %s FAILED: peak RSS over its bound\n", c.name().c_str());
    rc = 1;
  }
  if (rc == 0) std::printf("big tensors: passed\n");
  return rc;
}

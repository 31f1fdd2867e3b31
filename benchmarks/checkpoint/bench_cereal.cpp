// bench_cereal: one tensor of 1e8 floats (400 MB) through cereal's binary
// archives, next to plain write(2)/read(2) of the same bytes in the same
// run and directory; and psx's own paths for a variable of that size (a
// checkpoint save and restore, an export and load_export) next to plain
// I/O that does what they do (fsync where they fsync).
//
//   ./bench_cereal [floats = 100000000] [reps = 5] [directory = the temp directory]
//
// cereal: a std::vector<float> archived by BinaryOutputArchive, and by
// PortableBinaryOutputArchive in little-endian (as psx's checkpoint index
// uses it), over a std::ofstream, closed; read back by the input archives
// over a std::ifstream into a fresh vector. cereal writes and reads such a
// vector with one binary_data call, which the stream hands to write(2) and
// read(2) directly (it is larger than the stream's buffer).
// Plain: write(2) of the same bytes from memory into a new file, closed;
// read(2) into a fresh buffer. Neither side fsyncs here: both measure the
// way from memory to the page cache and back, which is what a library adds.
// psx: checkpoint::save (the server CRCs and writes its file and fsyncs it;
// the manifest; renames) next to write(2) + fsync of the same bytes;
// checkpoint::restore next to read(2); export_model (model.psx, model.npz
// and model.safetensors, each fsynced) next to three write(2) + fsync;
// load_export (model.psx, CRC'd) next to read(2). Reads come from the page
// cache (just written). Figures: bytes written or read per second, median
// of `reps`, psx and plain runs alternating.
//
// Goal (issue 36): cereal's binary path for 1e8 floats at least 1 GB/s.
#include <psx/checkpoint.hpp>
#include <psx/export.hpp>
#include <psx/psx.hpp>

#include "plain_io.hpp"

#include <cereal/archives/binary.hpp>
#include <cereal/archives/portable_binary.hpp>
#include <cereal/types/vector.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace psx_bench;

struct Row {
  const char* what;
  double bytes;
  std::vector<double> ours, plain;
};

// Runs `ours` and `plain` `reps` times each, alternating which goes first;
// `after` (untimed) cleans up after each run.
void measure(Row& row, int reps, const std::function<void()>& ours, const std::function<void()>& plain,
             const std::function<void()>& after = [] {}) {
  for (int rep = 0; rep < reps; ++rep) {
    auto time = [&](const std::function<void()>& f, std::vector<double>& into) {
      const auto t0 = Clock::now();
      f();
      into.push_back(seconds_since(t0));
      after();
    };
    if (rep % 2 == 0) time(ours, row.ours), time(plain, row.plain);
    else time(plain, row.plain), time(ours, row.ours);
  }
}

void print(const Row& r) {
  const double o = median(r.ours), p = median(r.plain);
  std::printf("%-34s %8.2f %8.3f   %8.2f %8.3f   %5.2fx\n", r.what, r.bytes / o / 1e9, o, r.bytes / p / 1e9, p, o / p);
}

template <class Archive, class Stream>
Archive make_archive(Stream& s) {
  if constexpr (std::is_same_v<Archive, cereal::PortableBinaryOutputArchive> ||
                std::is_same_v<Archive, cereal::PortableBinaryInputArchive>)
    return Archive(s, Archive::Options::LittleEndian());
  else
    return Archive(s);
}

template <class Out>
void cereal_write(const fs::path& file, const std::vector<float>& v) {
  std::ofstream os(file, std::ios::binary | std::ios::trunc);
  {
    Out ar = make_archive<Out>(os);
    ar(v);
  }
  os.close();
  if (!os) throw std::runtime_error("cereal: writing " + file.string() + " failed");
}

template <class In>
std::vector<float> cereal_read(const fs::path& file) {
  std::ifstream is(file, std::ios::binary);
  std::vector<float> v;
  In ar = make_archive<In>(is);
  ar(v);
  return v;
}

}  // namespace

int main(int argc, char** argv) try {
  const std::size_t n = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 100'000'000;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 5;
  if (n == 0 || reps < 1) {
    std::fprintf(stderr, "usage: %s [floats = 100000000] [reps = 5] [directory]\n", argv[0]);
    return 2;
  }
  const ScratchDir scratch("psx-bench-cereal", argc > 3 ? fs::path(argv[3]) : fs::temp_directory_path());
  const fs::path& dir = scratch.path;
  const double bytes = static_cast<double>(n) * 4;
  if (!scratch.has_room(6.5 * bytes, "bench_cereal")) return 2;  // an export's three files, a plain file and a cereal one

  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>(i % 1000003) * 1e-3f - 500.0f;
  const auto* src = reinterpret_cast<const std::byte*>(v.data());
  const fs::path plain = dir / "plain.bin", archived = dir / "cereal.bin";
  auto remove = [&] {
    std::error_code ec;
    fs::remove(plain, ec);
    fs::remove(archived, ec);
  };
  bool same = true;

  Row bw{"cereal BinaryOutputArchive write", bytes + 8, {}, {}};
  Row pw{"cereal PortableBinary write", bytes + 9, {}, {}};  // + the size, + portable's endianness byte
  Row br{"cereal BinaryInputArchive read", bytes + 8, {}, {}};
  Row pr{"cereal PortableBinary read", bytes + 9, {}, {}};
  auto write_plain = [&] { plain_write(plain, src, n * 4, false); };
  auto read_plain = [&] { plain_read(plain, n * 4).reset(); };
  measure(bw, reps, [&] { cereal_write<cereal::BinaryOutputArchive>(archived, v); }, write_plain, remove);
  measure(pw, reps, [&] { cereal_write<cereal::PortableBinaryOutputArchive>(archived, v); }, write_plain, remove);
  cereal_write<cereal::BinaryOutputArchive>(archived, v);
  write_plain();
  measure(br, reps, [&] { same = same && cereal_read<cereal::BinaryInputArchive>(archived) == v; }, read_plain);
  cereal_write<cereal::PortableBinaryOutputArchive>(archived, v);
  measure(pr, reps, [&] { same = same && cereal_read<cereal::PortableBinaryInputArchive>(archived) == v; }, read_plain);
  remove();
  if (!same) throw std::runtime_error("cereal read back other values than it wrote");
  // The vector comparison above is inside the timed read: time it alone,
  // to take it out of the figures.
  std::vector<float> copy = v;
  std::vector<double> compare;
  for (int rep = 0; rep < reps; ++rep) {
    const auto t0 = Clock::now();
    same = same && copy == v;
    compare.push_back(seconds_since(t0));
  }
  for (Row* r : {&br, &pr})
    for (double& t : r->ours) t -= median(compare);
  copy = {};

  // psx's own paths for a variable of n floats (SGD without momentum: no
  // optimizer slot, the file holds the parameters only).
  Row save{"psx checkpoint::save (fsync)", bytes, {}, {}};
  Row restore{"psx checkpoint::restore", bytes, {}, {}};
  Row exported{"psx export_model (3 files, fsync)", 3 * bytes, {}, {}};
  Row loaded{"psx load_export (model.psx)", bytes, {}, {}};
  psx::ParameterServer<psx::partition::RowRange, psx::sync::Asynchronous, psx::optim::SGD> ps({1, 1}, {}, {},
                                                                                               {.lr = 1.0});
  ps.declare(psx::dense("x", {n}));
  ps.run([&](psx::Worker& w) {
    w.push("x", v);  // x = -v
    w.step();
    fs::path ckpt;
    std::uint64_t version = 0;
    fs::path last_export;
    auto plain_synced = [&](int files) {
      for (int f = 0; f < files; ++f) plain_write(dir / ("plain-" + std::to_string(f) + ".bin"), src, n * 4, true);
    };
    auto clean = [&] {
      std::error_code ec;
      for (int f = 0; f < 3; ++f) fs::remove(dir / ("plain-" + std::to_string(f) + ".bin"), ec);
    };
    measure(save, reps, [&] { ::sync(), ckpt = psx::checkpoint::save(ps, w, dir / "ckpt").path; },
            [&] { ::sync(), plain_synced(1); },
            [&] {
              clean();
              if (save.ours.size() < static_cast<std::size_t>(reps)) {
                std::error_code ec;
                fs::remove_all(ckpt, ec);
              }
            });
    plain_synced(1);
    measure(restore, reps, [&] { psx::checkpoint::restore(ps, w, ckpt); },
            [&] { plain_read(dir / "plain-0.bin", n * 4).reset(); });
    fs::remove_all(dir / "ckpt");
    clean();
    measure(exported, reps,
            [&] {
              ::sync();
              psx::ExportOptions o;
              o.base = dir / "export";
              o.version = ++version;
              last_export = psx::export_model(ps, w, o);
            },
            [&] { ::sync(), plain_synced(3); },
            [&] {
              clean();
              if (exported.ours.size() < static_cast<std::size_t>(reps)) {
                std::error_code ec;
                fs::remove_all(last_export, ec);
              }
            });
    plain_synced(1);
    measure(loaded, reps,
            [&] {
              const psx::Export e = psx::load_export(last_export);
              same = same && e["x"].values.size() == n * 4;
            },
            [&] { plain_read(dir / "plain-0.bin", n * 4).reset(); });
    clean();
  });
  if (!same) throw std::runtime_error("psx read back another size than it wrote");

  std::printf("bench_cereal: %zu floats (%.1f MB), median of %d, directory %s\n", n, bytes / 1e6, reps, dir.c_str());
  std::printf("%-34s %8s %8s   %8s %8s   %s\n", "", "GB/s", "s", "plain", "plain s", "time ratio");
  print(bw);
  print(pw);
  print(br);
  print(pr);
  print(save);
  print(restore);
  print(exported);
  print(loaded);
  const double slowest = std::min({bw.bytes / median(bw.ours), pw.bytes / median(pw.ours), br.bytes / median(br.ours),
                                   pr.bytes / median(pr.ours)}) / 1e9;
  std::printf("goal (for 1e8 floats): cereal's binary path >= 1 GB/s: slowest %.2f GB/s, %s\n", slowest,
              slowest >= 1.0 ? "met" : "MISSED");
  std::printf("plain: write(2) into a new file and close (fsync where psx fsyncs); read(2) into a new buffer; "
              "reads from the page cache\n");
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_cereal: %s\n", e.what());
  return 1;
}

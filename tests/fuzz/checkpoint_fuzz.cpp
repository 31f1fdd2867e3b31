// Fuzz target for the checkpoint readers (psx/checkpoint.hpp) and the
// export's model.psx reader (psx/export.hpp, decode_model): whatever the
// bytes, a reader returns what it checked or throws psx::checkpoint_error
// naming the file; never another exception (cereal's, std::length_error...),
// a crash, an overrun or a huge allocation. Each input goes through
//  - the envelope: decode_header, then verify_bytes on the bytes as a whole
//    file, as a manifest and as a shard file, and the parser behind the CRCs
//    when they match (decode_manifest, decode_index);
//  - the parsers alone: decode_index and decode_manifest fed the bytes
//    directly, so that a mutation need not fix three CRCs to reach them;
//  - end to end, when the envelope and its parser accept the bytes: put in
//    a checkpoint next to the real files of a small one (the manifest, or
//    server s's shard file with the manifest listing it), each variable is
//    read back with load_variable (read_shards: the copies out of the files)
//    and each dynamic table with load_table (its rows and sketch streamed
//    out of every server's file).
// Whatever a reader accepts is checked again here (an index's shards lie in
// the data part, a manifest's shards tile its rows, a variable has the size
// its manifest gives); a violation, or any other exception, prints the
// input and aborts.
//
// With clang: -fsanitize=fuzzer,address,undefined -DPSX_LIBFUZZER gives a
// libFuzzer binary (cmake -DPSX_FUZZ=ON builds psx_checkpoint_libfuzzer;
// -fno-sanitize=pointer-overflow: RapidJSON 1.1.0, under cereal, offsets a
// null pointer on every parse, Tencent/rapidjson#1724):
//
//   clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all
//     -fno-sanitize=pointer-overflow -DPSX_LIBFUZZER -Iinclude tests/fuzz/checkpoint_fuzz.cpp
//     -o checkpoint_fuzz                                        (one line)
//   build/dev/tests/psx_checkpoint_fuzz --write-corpus corpus  # real files, their parts, regressions
//   ./checkpoint_fuzz -max_total_time=60 -malloc_limit_mb=256 corpus
//
// Without it, this file builds a standalone driver that runs the seeds, the
// regression inputs and a fixed number of mutated or random inputs through
// the same entry point (a ctest test); `psx_checkpoint_fuzz FILE...` replays
// inputs, e.g. one a failure wrote.
#include <psx/checkpoint.hpp>
#include <psx/export.hpp>

#ifndef PSX_LIBFUZZER
#include "../replace_new.hpp"  // the driver bounds every allocation (psx_test::allocate, below)
#endif

#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <new>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <typeinfo>
#include <vector>

namespace cd = psx::checkpoint::detail;
namespace fs = std::filesystem;

namespace {

// The seeds' step: decode_manifest, fed a manifest's JSON alone, gets a header
// of this step, so a seed's body agrees with it.
constexpr std::uint64_t kStep = 3;
const fs::path kPath = "fuzz-input";

std::span<const std::byte> current;  // the input under test, for reports
fs::path fixture_dir;                // removed by `bug` too, which skips destructors

// Per reader: inputs it accepted and refused (the summary shows how deep
// the mutations reach).
struct Tally {
  const char* reader;
  std::size_t accepted = 0, refused = 0;
};
std::vector<Tally> tallies;
Tally& tally(const char* reader) {
  for (Tally& t : tallies)
    if (std::strcmp(t.reader, reader) == 0) return t;
  return tallies.emplace_back(Tally{reader});
}

void dump(std::FILE* out, std::span<const std::byte> in) {
  constexpr std::size_t shown = 4096;
  std::fprintf(out, "input (%zu bytes, hex):\n", in.size());
  for (std::size_t i = 0; i < std::min(in.size(), shown); ++i)
    std::fprintf(out, "%02x%s", static_cast<unsigned>(in[i]), i % 32 == 31 ? "\n" : "");
  if (in.size() > shown) std::fprintf(out, "... (%zu more bytes)", in.size() - shown);
  std::fprintf(out, "\n");
}

[[noreturn]] void bug(const std::string& what) {
  std::fprintf(stderr, "checkpoint fuzz: BUG: %s\n", what.c_str());
  dump(stderr, current);
#ifndef PSX_LIBFUZZER  // libFuzzer keeps the crashing input itself
  std::ofstream("checkpoint-fuzz-failure.bin", std::ios::binary)
      .write(reinterpret_cast<const char*>(current.data()), static_cast<std::streamsize>(current.size()));
  std::fprintf(stderr, "written to checkpoint-fuzz-failure.bin (replay: psx_checkpoint_fuzz FILE)\n");
#endif
  std::fflush(stderr);
  std::error_code ec;
  if (!fixture_dir.empty()) fs::remove_all(fixture_dir, ec);
  std::abort();
}

// Runs one reader: it returns, or throws checkpoint_error naming the file.
template <class F>
void guarded(const char* reader, F&& f, const fs::path& file = kPath) {
  try {
    f();
    ++tally(reader).accepted;
  } catch (const psx::checkpoint_error& e) {
    if (std::string(e.what()).find(file.string()) == std::string::npos)
      bug(std::string(reader) + " threw checkpoint_error without naming the file: " + e.what());
    ++tally(reader).refused;
  } catch (const std::exception& e) {
    bug(std::string(reader) + " threw " + typeid(e).name() + " (not psx::checkpoint_error): " + e.what());
  } catch (...) {
    bug(std::string(reader) + " threw something not derived from std::exception");
  }
}

bool mul(std::uint64_t a, std::uint64_t b, std::uint64_t& out) { return !__builtin_mul_overflow(a, b, &out); }

// What decode_index returns must describe shards and table parts that lie in the data part.
void check_index(const cd::Index& index, std::uint64_t data_bytes) {
  for (const cd::TableRecord& t : index.tables) {
    const std::string what = "decode_index accepted dynamic table '" + t.variable + "' of " +
                             std::to_string(t.state.rows) + " rows of " + std::to_string(t.state.dim) + " floats and " +
                             std::to_string(t.state.slots) + " slots at offset " + std::to_string(t.rows_offset) +
                             ", a sketch of " + std::to_string(t.state.sketch_width) + " x " +
                             std::to_string(t.state.sketch_depth) + " at " + std::to_string(t.sketch_offset) +
                             ", in a " + std::to_string(data_bytes) + "-byte data part";
    std::uint64_t rows = 0, sketch = 0;
    if (t.state.dim == 0 || t.state.dim > (1u << 20) || t.state.slots > 64 || t.state.layout.empty() ||
        t.state.layout.size() % 2 != 0)
      bug(what + ": impossible rows or layout");
    if (!mul(t.state.rows, psx::detail::table_row_bytes(t.state.dim, t.state.slots), rows) || t.rows_offset > data_bytes ||
        rows > data_bytes - t.rows_offset)
      bug(what + ": its rows do not fit in the data part");
    if (!mul(t.state.sketch_width, t.state.sketch_depth, sketch) || t.sketch_offset > data_bytes ||
        sketch > data_bytes - t.sketch_offset)
      bug(what + ": its sketch does not fit in the data part");
  }
  for (const cd::IndexRecord& r : index.shards) {
    const std::string what = "decode_index accepted shard " + std::to_string(r.shard) + " rows [" +
                             std::to_string(r.row_begin) + ", " + std::to_string(r.row_end) + ") x " +
                             std::to_string(r.width) + " floats, " + std::to_string(r.slots) + " slots, at offset " +
                             std::to_string(r.offset) + " of a " + std::to_string(data_bytes) + "-byte data part";
    std::uint64_t floats = 0, copies = 0, bytes = 0;
    if (r.row_begin >= r.row_end || r.width == 0 || r.offset % 4 != 0) bug(what + ": impossible rows or offset");
    if (!mul(r.row_end - r.row_begin, r.width, floats) || !mul(floats, r.slots + 1, copies) || !mul(copies, 4, bytes) ||
        r.offset > data_bytes || bytes > data_bytes - r.offset)
      bug(what + ": its parameters and slots do not fit in the data part (a size that overflows?)");
  }
}

// What decode_manifest returns must be what it says it checked.
void check_manifest(const psx::checkpoint::Manifest& m, const cd::Header& h) {
  if (m.format_version != h.version || m.step != h.step) bug("decode_manifest accepted another version or step");
  if (m.num_servers == 0 || m.files.size() != m.num_servers) bug("decode_manifest accepted files that are not one per server");
  for (std::size_t s = 0; s < m.files.size(); ++s)
    if (m.files[s].name != cd::server_file_name(s)) bug("decode_manifest accepted a shard file named " + m.files[s].name);
  for (const auto& v : m.variables) {
    std::uint64_t expect = 0;
    for (const auto& s : v.shards) {
      if (s.row_begin != expect || s.row_end <= s.row_begin || s.server >= m.num_servers)
        bug("decode_manifest accepted shards of '" + v.name + "' that do not tile its rows");
      expect = s.row_end;
    }
    if (expect != (v.shape.empty() ? 1 : v.shape[0])) bug("decode_manifest accepted '" + v.name + "' with rows uncovered");
  }
}

void check_verified(const cd::Verified& v) {
  const auto all = v.file.all();
  if (v.meta.data() != all.data() + cd::header_bytes || v.meta.size() != v.header.meta_bytes ||
      v.data.data() != v.meta.data() + v.meta.size() || v.data.size() != v.header.data_bytes ||
      v.data.data() + v.data.size() != all.data() + all.size())
    bug("verify_bytes returned parts that are not the file's meta and data parts");
  if (psx::detail::crc32c(v.meta) != v.header.meta_crc || psx::detail::crc32c(v.data) != v.header.data_crc)
    bug("verify_bytes accepted parts whose CRC-32C does not match");
}

// -- a real checkpoint ------------------------------------------------------------------

using Bytes = std::vector<std::byte>;

template <class T>
T get(const Bytes& b, std::size_t at) {
  T v{};
  std::memcpy(&v, b.data() + at, sizeof v);
  return v;
}
template <class T>
void put(Bytes& b, std::size_t at, T v) {
  std::memcpy(b.data() + at, &v, sizeof v);
}

Bytes bytes_of(std::string_view s) {
  const auto b = std::as_bytes(std::span(s));
  return {b.begin(), b.end()};
}

Bytes read_all(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  const std::string s{std::istreambuf_iterator<char>(f), {}};
  return bytes_of(s);
}

void write_all(const fs::path& p, std::span<const std::byte> b) {
  std::ofstream(p, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// A manifest file as write_manifest writes it, without its fsyncs.
Bytes manifest_file(const psx::checkpoint::Manifest& m) {
  std::ostringstream os;
  {
    cereal::JSONOutputArchive ar(os);
    ar(cereal::make_nvp("psx_checkpoint", m));
  }
  const std::string json = std::move(os).str() + "\n";
  cd::Header h;
  h.kind = cd::FileKind::manifest;
  h.step = m.step;
  h.meta_bytes = json.size();
  h.meta_crc = psx::detail::crc32c(std::as_bytes(std::span(json)));
  h.data_crc = psx::detail::crc32c({});
  const auto head = cd::encode_header(h);
  Bytes f(head.begin(), head.end());
  const Bytes body = bytes_of(json);
  f.insert(f.end(), body.begin(), body.end());
  return f;
}

// A small checkpoint written by the writers: two servers, Adam's two slots,
// the three kinds of variable and a dynamic table "t" (rows of 3 floats,
// an admission sketch of 8 x 2 counters) with rows in both servers' files.
// The seeds are its files and their parts; the end-to-end reads put an
// input among them in `scratch`.
struct Fixture {
  fs::path scratch;
  psx::checkpoint::Manifest manifest;
  std::vector<Bytes> servers;                   // server s's shard file
  Bytes model;                                  // an export's model.psx
  std::vector<std::vector<std::string>> names;  // the variables of server s's shards, in its index
  std::vector<std::vector<std::size_t>> layouts;  // the layout sizes of server s's table parts, in its index
  static constexpr std::size_t kTableDim = 3;

  Fixture() {
    const fs::path dir = fs::temp_directory_path() / ("psx-checkpoint-fuzz-" + std::to_string(::getpid()));
    fixture_dir = dir;
    fs::remove_all(dir);
    fs::create_directories(dir / "scratch");
    scratch = dir / "scratch";
    auto info = [](std::string name, std::vector<std::size_t> shape, psx::VariableKind kind, psx::DType dtype,
                   std::vector<psx::Shard> shards) {
      psx::VariableInfo v;
      v.meta.name = std::move(name);
      v.meta.shape = std::move(shape);
      v.meta.kind = kind;
      v.meta.rows = v.meta.shape[0];
      v.meta.row_width = v.meta.shape.size() > 1 ? v.meta.shape[1] : 1;
      v.meta.dtype = dtype;
      v.shards = std::move(shards);
      return v;
    };
    const std::vector<psx::VariableInfo> vars = {
        info("w", {3, 4}, psx::VariableKind::dense, psx::DType::float32, {{0, 0, 2}, {1, 2, 3}}),
        info("emb", {6, 2}, psx::VariableKind::sparse, psx::DType::float32, {{1, 0, 3}, {0, 3, 6}}),
        info("h", {5}, psx::VariableKind::dense, psx::DType::bfloat16, {{0, 0, 5}})};
    std::vector<float> values(64);
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i) * 0.25f - 3.0f;
    auto saved = [&](std::size_t v, std::uint32_t index) {
      const std::size_t n = vars[v].shards[index].rows() * vars[v].meta.row_width;
      const std::span<const float> all(values);
      return psx::detail::SavedShard{&vars[v], index, kStep, all.first(n), {all.subspan(1, n), all.subspan(2, n)}};
    };
    const std::vector<std::vector<psx::detail::SavedShard>> on = {{saved(0, 0), saved(1, 1), saved(2, 0)},
                                                                  {saved(0, 1), saved(1, 0)}};
    psx::VariableInfo table = info("t", {kTableDim}, psx::VariableKind::dynamic, psx::DType::float32, {});
    table.meta.rows = 0;
    table.meta.row_width = kTableDim;
    // Server s's part: 2 + s rows (ids 100 s + k), 2 stripes, a sketch of 8 x 2.
    auto table_part = [&](std::size_t s) {
      psx::detail::SavedTable t;
      t.variable = &table;
      t.state.dim = kTableDim;
      t.state.slots = 2;
      t.state.rows = 2 + s;
      t.state.shard_version = 5 + s;
      t.state.version = 9 + s;
      t.state.next_sweep = 4;
      t.state.admitted = 3 + s;
      t.state.refused = 1;
      t.state.sketch_width = 8;
      t.state.sketch_depth = 2;
      t.state.sketch_added = 6;
      t.state.layout = {16, 1, 16, 1};
      for (std::size_t i = 0; i < 16; ++i) t.sketch.push_back(static_cast<std::uint8_t>((i * 7 + s) % 5));
      t.rows = [s](const std::function<void(std::span<const std::byte>)>& sink) {
        for (std::uint64_t k = 0; k < 2 + s; ++k) {
          std::vector<std::byte> row(psx::detail::table_row_bytes(kTableDim, 2));
          const std::uint64_t head[3] = {100 * s + k, k + 1, k + 2};
          std::memcpy(row.data(), head, sizeof head);
          for (std::size_t i = 0; i < kTableDim * 3; ++i) {
            const float x = static_cast<float>(k * 10 + i) * 0.5f;
            std::memcpy(row.data() + sizeof head + i * sizeof(float), &x, sizeof x);
          }
          sink(row);
        }
      };
      return t;
    };
    manifest.step = kStep;
    manifest.created_unix = 1700000000;
    manifest.num_servers = on.size();
    manifest.num_workers = 1;
    manifest.partitioner = "RowRange{min_rows=1}";
    manifest.sync_policy = "Synchronous";
    manifest.optimizer = "Adam{lr=0.01, beta1=0.9, beta2=0.999, eps=1e-08, weight_decay=0}";
    manifest.optimizer_slots = 2;
    for (std::size_t s = 0; s < on.size(); ++s) {
      const std::vector<psx::detail::SavedTable> tables = {table_part(s)};
      cd::write_server_file({dir.string(), kStep, s}, on[s], tables);
      layouts.push_back({tables[0].state.layout.size()});
      const std::string name = cd::server_file_name(s);
      servers.push_back(read_all(dir / name));
      const auto h = cd::decode_header(servers.back(), servers.back().size(), cd::FileKind::shards, name);
      manifest.files.push_back({name, servers.back().size(), h.crc});
      names.emplace_back();
      for (const auto& sh : on[s]) names.back().push_back(sh.variable->meta.name);
    }
    {  // an export of four kinds of tensor: float32, int8 per channel, sparse float16, a table's uint64 ids
      psx::ExportOptions o;
      o.sparse_above = 0.5;
      std::vector<psx::detail::exports::Source> sources = {
          {"k", {3, 4}, true, std::vector<float>(values.begin(), values.begin() + 12), false, {}},
          {"q", {2, 3}, true, std::vector<float>(values.begin() + 20, values.begin() + 26), false, {}},
          {"s", {10}, false, {0, 0, 1.5f, 0, 0, 0, -2.0f, 0, 0, 0}, false, {}},
          {"t", {2, 2}, true, std::vector<float>(values.begin() + 30, values.begin() + 34), true, {5, 1ull << 63}}};
      std::vector<psx::ExportedTensor> tensors;
      o.precision = psx::ExportPrecision::float32;
      tensors.push_back(psx::detail::exports::convert(sources[0], o));
      o.precision = psx::ExportPrecision::int8_per_channel;
      tensors.push_back(psx::detail::exports::convert(sources[1], o));
      o.precision = psx::ExportPrecision::float16;
      tensors.push_back(psx::detail::exports::convert(sources[2], o));
      tensors.push_back(psx::detail::exports::ids_tensor(sources[3]));
      psx::detail::exports::write_model(dir / "model.psx", tensors, kStep, 2);
      model = read_all(dir / "model.psx");
    }
    for (const auto& v : vars) {
      psx::checkpoint::ManifestVariable mv{v.meta.name, {v.meta.shape.begin(), v.meta.shape.end()},
                                           v.meta.kind == psx::VariableKind::dense ? "dense" : "sparse",
                                           psx::dtype_name(v.meta.dtype), true, v.meta.row_width, {}};
      for (const auto& sh : v.shards) mv.shards.push_back({sh.server, sh.row_begin, sh.row_end});
      manifest.variables.push_back(std::move(mv));
    }
    manifest.tables.push_back({"t", kTableDim, psx::TableOptions{.admission = psx::Admission::after_pushes(2, 8, 2), .stripes = 2}});
  }
  ~Fixture() {
    std::error_code ec;
    fs::remove_all(scratch.parent_path(), ec);
  }
};

const Fixture& fixture() {
  static const Fixture f;
  return f;
}

// Reads every dynamic table of the checkpoint in the scratch directory.
void load_tables(const psx::checkpoint::Manifest& m) {
  const fs::path& dir = fixture().scratch;
  for (std::size_t k = 0; k < std::min<std::size_t>(m.tables.size(), 2); ++k)
    guarded("load_table (end to end)", [&] {
      const psx::checkpoint::Table t = psx::checkpoint::load_table(dir, m.tables[k].name);
      const std::size_t n = t.ids.size();
      std::uint64_t floats = 0, slots = 0;
      if (!mul(n, t.meta.dim, floats) || t.values.size() != floats || !mul(floats, t.num_slots, slots) ||
          t.slots.size() != slots || t.updated.size() != n || t.used.size() != n || t.server.size() != n)
        bug("load_table returned '" + t.meta.name + "' with " + std::to_string(n) + " ids, " +
            std::to_string(t.values.size()) + " values and " + std::to_string(t.slots.size()) +
            " slot floats, not rows of its dim and slots");
      for (std::size_t i = 1; i < n; ++i)
        if (t.ids[i - 1] >= t.ids[i]) bug("load_table returned ids out of order, or one twice");
      for (const auto& part : t.parts)
        if (part.sketch.size() != std::uint64_t{part.state.sketch_width} * part.state.sketch_depth)
          bug("load_table returned a sketch of another size than its width and depth");
    }, dir);
}

// Reads every variable of the checkpoint in the scratch directory.
void load_variables(const std::vector<std::string>& names) {
  const fs::path& dir = fixture().scratch;
  for (std::size_t k = 0; k < std::min<std::size_t>(names.size(), 4); ++k)
    guarded("load_variable (end to end)", [&] {
      const psx::checkpoint::Variable v = psx::checkpoint::load_variable(dir, names[k]);
      std::uint64_t size = 0, slots = 0;
      if (!mul(v.meta.shape.empty() ? 1 : v.meta.shape[0], v.meta.row_width, size) || v.values.size() != size ||
          !mul(size, v.num_slots, slots) || v.slots.size() != slots)
        bug("load_variable returned '" + names[k] + "' with " + std::to_string(v.values.size()) + " values and " +
            std::to_string(v.slots.size()) + " slot floats, not what its manifest's shape and slots say");
    }, dir);
}

// The input, accepted as a manifest, with the fixture's shard files.
void end_to_end_manifest(std::span<const std::byte> in, const psx::checkpoint::Manifest& m) {
  const Fixture& f = fixture();
  write_all(f.scratch / cd::manifest_name, in);
  for (std::size_t s = 0; s < f.servers.size(); ++s) write_all(f.scratch / cd::server_file_name(s), f.servers[s]);
  std::vector<std::string> names;
  for (const auto& v : m.variables) names.push_back(v.name);
  load_variables(names);
  load_tables(m);
}

// The input, accepted as server s's shard file, with the fixture's other
// files and a manifest that lists it.
void end_to_end_shards(std::span<const std::byte> in, const cd::Header& h) {
  const Fixture& f = fixture();
  if (h.server >= f.servers.size()) return;
  psx::checkpoint::Manifest m = f.manifest;
  m.files[h.server].bytes = in.size();
  m.files[h.server].header_crc = h.crc;
  write_all(f.scratch / cd::manifest_name, manifest_file(m));
  for (std::size_t s = 0; s < f.servers.size(); ++s)
    write_all(f.scratch / cd::server_file_name(s), s == h.server ? in : std::span<const std::byte>(f.servers[s]));
  std::vector<std::string> names;
  for (const auto& v : m.variables) names.push_back(v.name);
  load_variables(names);
  load_tables(m);
}

// What decode_model returns must be tensors whose bytes fit their shapes.
void check_model(const std::vector<psx::ExportedTensor>& tensors) {
  for (const auto& t : tensors) {
    const std::uint64_t e = psx::detail::exports::dtype_bytes(t.dtype);
    const std::uint64_t stored = t.sparse ? t.indices.size() : t.elements();
    if (t.values.size() != stored * e) bug("decode_model accepted '" + t.name + "' whose bytes do not fit its shape");
    for (std::size_t i = 0; i < t.indices.size(); ++i)
      if (t.indices[i] >= t.elements() || (i > 0 && t.indices[i] <= t.indices[i - 1]))
        bug("decode_model accepted '" + t.name + "' with sparse indices out of order or range");
    const bool ids = t.dtype == "uint64";  // a table's ids: read as such, never as floats
    if (t.elements() <= (std::uint64_t{1} << 16) && (ids ? t.to_ids().size() : t.to_float().size()) != t.elements())
      bug((ids ? "to_ids of '" : "to_float of '") + t.name + "' has the wrong size");
  }
}

// -- the entry point ---------------------------------------------------------------------

void run_one(std::span<const std::byte> in) {
  current = in;
  // The bytes as a whole file, of each kind.
  for (const cd::FileKind kind : {cd::FileKind::manifest, cd::FileKind::shards}) {
    guarded("decode_header", [&] { (void)cd::decode_header(in, in.size(), kind, kPath); });
    guarded("verify_bytes", [&] {
      cd::Loaded file;
      file.size = in.size();
      file.bytes = std::make_unique_for_overwrite<std::byte[]>(in.size());
      if (!in.empty()) std::memcpy(file.bytes.get(), in.data(), in.size());
      const cd::Verified v = cd::verify_bytes(std::move(file), kind, kPath);
      check_verified(v);
      if (kind == cd::FileKind::manifest)
        guarded("decode_manifest (after verify_bytes)", [&] {
          const auto m = cd::decode_manifest(v.meta, v.header, kPath);
          check_manifest(m, v.header);
          end_to_end_manifest(in, m);
        });
      else
        guarded("decode_index (after verify_bytes)", [&] {
          check_index(cd::decode_index(v.meta, v.header.data_bytes, v.header.server, kPath, v.header.version), v.header.data_bytes);
          end_to_end_shards(in, v.header);
        });
    });
  }
  guarded("verify_bytes (export)", [&] {
    cd::Loaded file;
    file.size = in.size();
    file.bytes = std::make_unique_for_overwrite<std::byte[]>(in.size());
    if (!in.empty()) std::memcpy(file.bytes.get(), in.data(), in.size());
    const cd::Verified v = cd::verify_bytes(std::move(file), cd::FileKind::exported, kPath);
    guarded("decode_model (after verify_bytes)",
            [&] { check_model(psx::detail::exports::decode_model(v.meta, v.data, kPath)); });
  });
  guarded("decode_model", [&] { check_model(psx::detail::exports::decode_model(in, in, kPath)); });
  // The parsers alone. The index's own server (after PortableBinary's
  // endianness byte) for the header's, so that check lets it through.
  std::uint32_t server = 0;
  if (in.size() >= 5) std::memcpy(&server, in.data() + 1, 4);
  for (const std::uint64_t data_bytes : {std::uint64_t{0}, std::uint64_t{4096}, ~std::uint64_t{0}})
    guarded("decode_index", [&] { check_index(cd::decode_index(in, data_bytes, server, kPath), data_bytes); });
  cd::Header h;
  h.step = kStep;
  guarded("decode_manifest", [&] { check_manifest(cd::decode_manifest(in, h, kPath), h); });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  run_one({reinterpret_cast<const std::byte*>(data), size});
  return 0;
}

#ifndef PSX_LIBFUZZER

// -- huge allocations ---------------------------------------------------------------
//
// No reader may allocate more than a bounded multiple of what it was given:
// a length field believed before it is checked would. libFuzzer has
// -malloc_limit_mb; the driver replaces operator new.
namespace {
constexpr std::size_t kMaxAllocation = std::size_t{64} << 20;  // inputs here are at most 1 MiB
}  // namespace

void* psx_test::allocate(std::size_t n) {
  if (n > kMaxAllocation) bug("an allocation of " + std::to_string(n) + " bytes");
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}

namespace {

enum class SeedKind { manifest_file, shard_file, manifest_json, index, export_file };

struct Seed {
  std::string name;
  SeedKind kind = SeedKind::index;
  Bytes bytes;
  std::vector<std::size_t> u64_fields;  // offsets of its 64-bit length, row and offset fields
  std::vector<std::size_t> u32_fields;
};

// The 64-bit and 32-bit fields of an index as encode_index writes it: an
// endianness byte, the server (u32), the count (u64), then per shard a name
// (u64 length and bytes) and seven u64; then the count of tables (u64) and
// per table a name, ten u64, two u32 (the sketch's width and depth), two
// u64, a u32 (the rows' CRC), a u64, a u32 (the sketch's CRC), and the
// layout: a u64 count and as many u64.
struct Fields {
  std::vector<std::size_t> u64s, u32s;
};
Fields index_fields(const std::vector<std::string>& shards, const std::vector<std::pair<std::string, std::size_t>>& tables,
                    std::size_t base) {
  Fields out{{base + 5}, {base + 1}};
  std::size_t at = base + 13;
  auto u64 = [&](int n) {
    for (int k = 0; k < n; ++k, at += 8) out.u64s.push_back(at);
  };
  auto u32 = [&](int n) {
    for (int k = 0; k < n; ++k, at += 4) out.u32s.push_back(at);
  };
  for (const auto& name : shards) {
    out.u64s.push_back(at);
    at += 8 + name.size();
    u64(7);
  }
  u64(1);
  for (const auto& [name, layout] : tables) {
    out.u64s.push_back(at);
    at += 8 + name.size();
    u64(10);
    u32(2);
    u64(2);
    u32(1);
    u64(1);
    u32(1);
    u64(1 + static_cast<int>(layout));
  }
  return out;
}

// Re-seals a file after a mutation: the parts' CRCs (when the header's
// lengths fit the file) and the header's, so the mutation reaches the parsers.
void reseal(Bytes& f) {
  if (f.size() < cd::header_bytes || std::memcmp(f.data(), cd::magic, 8) != 0) return;
  const std::uint64_t meta = get<std::uint64_t>(f, 24), data = get<std::uint64_t>(f, 32);
  const std::uint64_t rest = f.size() - cd::header_bytes;
  if (meta <= rest && data <= rest - meta) {
    const std::span<const std::byte> all(f);
    put(f, 40, psx::detail::crc32c(all.subspan(cd::header_bytes, meta)));
    put(f, 44, psx::detail::crc32c(all.subspan(cd::header_bytes + meta, data)));
  }
  put(f, 60, psx::detail::crc32c(std::span<const std::byte>(f).first(60)));
}

// A file with this header and parts, lengths and CRCs right.
Bytes rebuild(const Bytes& original, const Bytes& meta, const Bytes& data) {
  Bytes f(original.begin(), original.begin() + cd::header_bytes);
  put(f, 24, static_cast<std::uint64_t>(meta.size()));
  put(f, 32, static_cast<std::uint64_t>(data.size()));
  f.insert(f.end(), meta.begin(), meta.end());
  f.insert(f.end(), data.begin(), data.end());
  reseal(f);
  return f;
}

// The fixture's files and their parts.
std::vector<Seed> seeds() {
  const Fixture& f = fixture();
  std::vector<Seed> out;
  for (std::size_t s = 0; s < f.servers.size(); ++s) {
    const Bytes& file = f.servers[s];
    const std::vector<std::pair<std::string, std::size_t>> tables = {{"t", f.layouts[s][0]}};
    const std::uint64_t meta = get<std::uint64_t>(file, 24);
    Seed whole{cd::server_file_name(s), SeedKind::shard_file, file, {24, 32}, {8, 12, 48}};
    const Fields fields = index_fields(f.names[s], tables, cd::header_bytes);
    whole.u64_fields.insert(whole.u64_fields.end(), fields.u64s.begin(), fields.u64s.end());
    whole.u32_fields.insert(whole.u32_fields.end(), fields.u32s.begin(), fields.u32s.end());
    out.push_back(std::move(whole));
    const Fields alone = index_fields(f.names[s], tables, 0);
    out.push_back({cd::server_file_name(s) + " index", SeedKind::index,
                   Bytes(file.begin() + cd::header_bytes, file.begin() + static_cast<std::ptrdiff_t>(cd::header_bytes + meta)),
                   alone.u64s, alone.u32s});
  }
  const Bytes manifest = manifest_file(f.manifest);
  out.push_back({cd::manifest_name, SeedKind::manifest_file, manifest, {16, 24, 32}, {8, 12}});
  out.push_back({"manifest json", SeedKind::manifest_json, Bytes(manifest.begin() + cd::header_bytes, manifest.end()), {}, {}});
  out.push_back({"model.psx", SeedKind::export_file, f.model, {16, 24, 32}, {8, 12}});
  return out;
}

// Inputs that once found a bug, or that aim at one a random mutation hardly
// reaches; each runs once, before the mutations.
std::vector<Seed> regressions() {
  std::vector<Seed> out;
  // A shard of 2^60 floats and 15 slots: (slots + 1) * floats * 4 wraps to 0,
  // which "fits" in any data part.
  cd::Index wrap{{{"v", 0, 0, std::uint64_t{1} << 60, 1, 15, kStep, 0}}, {}};
  out.push_back({"index: a shard size that overflows 64 bits", SeedKind::index, bytes_of(cd::encode_index(0, wrap)), {}, {}});
  // A name as long as the limit, and one byte longer.
  for (const std::size_t n : {cd::max_name_bytes, cd::max_name_bytes + 1}) {
    cd::Index named{{{std::string(n, 'x'), 0, 0, 1, 1, 0, 0, 0}}, {}};
    out.push_back({"index: a name of " + std::to_string(n) + " bytes", SeedKind::index, bytes_of(cd::encode_index(0, named)), {}, {}});
  }
  // Table parts whose sizes overflow: 2^62 rows of 2^20 floats and 64
  // slots, a sketch of 2^31 x 16 counters; a layout of 2^60 numbers.
  {
    cd::TableRecord huge;
    huge.variable = "t";
    huge.state.dim = std::uint64_t{1} << 20;
    huge.state.slots = 64;
    huge.state.rows = std::uint64_t{1} << 62;
    huge.state.sketch_width = 1u << 31;
    huge.state.sketch_depth = 16;
    huge.state.layout = {16, 1};
    cd::Index index{{}, {huge}};
    out.push_back({"index: a table part whose sizes overflow 64 bits", SeedKind::index, bytes_of(cd::encode_index(0, index)), {}, {}});
    Bytes layout = bytes_of(cd::encode_index(0, index));
    put(layout, layout.size() - 24, std::uint64_t{1} << 60);  // the layout's count
    out.push_back({"index: a layout of 2^60 numbers", SeedKind::index, layout, {}, {}});
  }
  // A zero with an exponent: rapidjson 1.1.0 (Debian's, which cereal uses)
  // passes 0 to __builtin_clzll, undefined (Tencent/rapidjson#1249).
  out.push_back({"manifest json: 0e60", SeedKind::manifest_json,
                 bytes_of("{\"psx_checkpoint\": {\"format_version\": 0e60}}"), {}, {}});
  // Manifests whose variable "w" has 2^36 rows of 4 floats (load_variable
  // must not allocate 3 x 1 TiB for it before finding that the shard files
  // hold 3 rows), and 2^62 + 1 rows (rows * row_width wraps to 4 floats:
  // no room for the 12 the shard files hold).
  for (const std::uint64_t rows : {std::uint64_t{1} << 36, (std::uint64_t{1} << 62) + 1}) {
    psx::checkpoint::Manifest m = fixture().manifest;
    m.variables[0].shape[0] = rows;
    m.variables[0].shards.back().row_end = rows;
    out.push_back({"manifest: 'w' of " + std::to_string(rows) + " rows of 4 floats", SeedKind::manifest_file,
                   manifest_file(m), {}, {}});
  }
  // JSON nested a million deep: a recursive parser runs out of stack.
  constexpr std::size_t depth = std::size_t{1} << 20;
  out.push_back({"manifest json: arrays nested " + std::to_string(depth) + " deep", SeedKind::manifest_json,
                 bytes_of("{\"psx_checkpoint\": " + std::string(depth, '[')), {}, {}});
  return out;
}

// -- mutations ------------------------------------------------------------------------

constexpr std::uint64_t kInteresting[] = {0, 1, 2, 3, 4, 7, 8, 15, 16, 63, 64, 65, 255, 256, 4095, 4096,
                                          cd::max_name_bytes, cd::max_name_bytes + 1, 0x7fffffff, 0x80000000,
                                          0xffffffff, std::uint64_t{1} << 32, std::uint64_t{1} << 58,
                                          std::uint64_t{1} << 59, std::uint64_t{1} << 60,
                                          (std::uint64_t{1} << 60) + 1, std::uint64_t{1} << 62,
                                          std::uint64_t{1} << 63, ~std::uint64_t{0} - 63, ~std::uint64_t{0}};
constexpr const char* kInterestingText[] = {"0", "1", "-1", "3", "2", "64", "65", "4294967296", "1152921504606846976",
                                            "18446744073709551615", "18446744073709551616", "-9223372036854775808",
                                            "1e308", "1e999", "0e60", "0.5", "1E2", "-0", "null", "true", "\"\"", "\"x\"", "[]",
                                            "{}", "[0]", "\"float32\"", "\"bfloat16\"", "\"server-00000.psx\""};

struct Mutator {
  std::mt19937_64 rng{7};

  std::size_t below(std::size_t n) { return n == 0 ? 0 : static_cast<std::size_t>(rng() % n); }
  std::uint64_t interesting() {
    const std::uint64_t v = kInteresting[below(std::size(kInteresting))];
    return rng() % 4 == 0 ? v + rng() % 3 - 1 : v;
  }

  // Replaces a number or literal of JSON text with an interesting one.
  void json_token(Bytes& b) {
    std::vector<std::size_t> starts;
    for (std::size_t i = 0; i < b.size(); ++i) {
      const char c = static_cast<char>(b[i]);
      const char before = i ? static_cast<char>(b[i - 1]) : ' ';
      const bool starts_token = (c >= '0' && c <= '9') || c == '"' || c == 't' || c == 'f' || c == '[' || c == '{';
      if (starts_token && (before == ' ' || before == ':' || before == '[' || before == ',' || before == '\n'))
        starts.push_back(i);
    }
    if (starts.empty()) return;
    const std::size_t at = starts[below(starts.size())];
    std::size_t end = at + 1;
    if (static_cast<char>(b[at]) == '"') {
      while (end < b.size() && static_cast<char>(b[end]) != '"') ++end;
      end = std::min(end + 1, b.size());
    } else if (static_cast<char>(b[at]) != '[' && static_cast<char>(b[at]) != '{') {
      while (end < b.size() && std::strchr(",]} \n", static_cast<char>(b[end])) == nullptr) ++end;
    }
    const Bytes with = bytes_of(kInterestingText[below(std::size(kInterestingText))]);
    b.erase(b.begin() + static_cast<std::ptrdiff_t>(at), b.begin() + static_cast<std::ptrdiff_t>(end));
    b.insert(b.begin() + static_cast<std::ptrdiff_t>(at), with.begin(), with.end());
  }

  // One to four changes: bit flips, random bytes, a field set to an
  // interesting value, a JSON token replaced, a span deleted or repeated,
  // the end cut or extended.
  void mutate(Bytes& b, const std::vector<std::size_t>& u64s, const std::vector<std::size_t>& u32s, bool json) {
    for (std::size_t n = 1 + below(4), k = 0; k < n; ++k) {
      switch (rng() % 8) {
        case 0:
          for (std::size_t f = 1 + below(8); f > 0 && !b.empty(); --f)
            b[below(b.size())] ^= static_cast<std::byte>(1u << below(8));
          break;
        case 1:
          for (std::size_t f = 1 + below(6); f > 0 && !b.empty(); --f) b[below(b.size())] = static_cast<std::byte>(rng());
          break;
        case 2:
        case 3:
          if (!u64s.empty() && (u32s.empty() || rng() % 3 != 0)) {
            const std::size_t at = u64s[below(u64s.size())];
            if (at + 8 <= b.size()) put(b, at, interesting());
          } else if (!u32s.empty()) {
            const std::size_t at = u32s[below(u32s.size())];
            if (at + 4 <= b.size()) put(b, at, static_cast<std::uint32_t>(interesting()));
          } else if (b.size() >= 8) {
            put(b, below(b.size() - 7), interesting());
          }
          break;
        case 4:
          if (json) json_token(b);
          else if (!b.empty()) b[below(b.size())] = static_cast<std::byte>(rng());
          break;
        case 5:
          if (!b.empty()) {
            const std::size_t at = below(b.size()), len = std::min(b.size() - at, 1 + below(16));
            if (rng() % 2) {
              b.erase(b.begin() + static_cast<std::ptrdiff_t>(at), b.begin() + static_cast<std::ptrdiff_t>(at + len));
            } else {
              const Bytes part(b.begin() + static_cast<std::ptrdiff_t>(at), b.begin() + static_cast<std::ptrdiff_t>(at + len));
              b.insert(b.begin() + static_cast<std::ptrdiff_t>(below(b.size() + 1)), part.begin(), part.end());
            }
          }
          break;
        case 6: b.resize(below(b.size() + 1)); break;
        default: b.resize(b.size() + below(64), static_cast<std::byte>(rng())); break;
      }
    }
  }

  Bytes next(const std::vector<Seed>& all, long k) {
    if (k % 8 == 0) {  // random bytes, now and then behind a valid magic
      Bytes b(below(600));
      for (auto& x : b) x = static_cast<std::byte>(rng());
      if (rng() % 2 && b.size() >= cd::header_bytes) {
        std::memcpy(b.data(), cd::magic, 8);
        put(b, 8, std::uint32_t{1});
        put(b, 12, static_cast<std::uint32_t>(1 + rng() % 3));
        put(b, 24, static_cast<std::uint64_t>(below(b.size() - cd::header_bytes + 1)));
        put(b, 32, static_cast<std::uint64_t>(b.size() - cd::header_bytes - get<std::uint64_t>(b, 24)));
        reseal(b);
      }
      return b;
    }
    const Seed& s = all[below(all.size())];
    Bytes b = s.bytes;
    const bool file =
        s.kind == SeedKind::manifest_file || s.kind == SeedKind::shard_file || s.kind == SeedKind::export_file;
    if (file && rng() % 2) {
      // Mutate a part as what it is and rebuild the file around it, lengths
      // and CRCs right: what a writer with a bug could produce.
      const std::uint64_t meta = get<std::uint64_t>(b, 24);
      const auto mid = b.begin() + static_cast<std::ptrdiff_t>(cd::header_bytes + meta);
      Bytes m(b.begin() + cd::header_bytes, mid), d(mid, b.end());
      if (s.kind == SeedKind::manifest_file) {
        mutate(m, {}, {}, true);
      } else if (s.kind == SeedKind::export_file) {
        mutate(rng() % 2 ? m : d, {}, {}, false);
      } else if (rng() % 4 != 0) {
        std::vector<std::size_t> fields;  // the index's, from the start of the meta part
        for (std::size_t f : s.u64_fields)
          if (f >= cd::header_bytes) fields.push_back(f - cd::header_bytes);
        mutate(m, fields, {1}, false);
      } else {
        mutate(d, {}, {}, false);
      }
      b = rebuild(b, m, d);
      if (rng() % 4 == 0) {  // and the header's fields too, sealed
        mutate(b, {16, 24, 32}, {8, 12, 48}, false);
        reseal(b);
      }
      return b;
    }
    mutate(b, s.u64_fields, s.u32_fields, s.kind == SeedKind::manifest_json);
    if (file && rng() % 2) reseal(b);
    return b;
  }
};

}  // namespace

int main(int argc, char** argv) {
  const auto all = seeds();
  const auto regress = regressions();
  if (argc == 3 && std::string(argv[1]) == "--write-corpus") {
    std::size_t k = 0;
    for (const auto* list : {&all, &regress})
      for (const Seed& s : *list) {
        std::ofstream f(std::string(argv[2]) + "/seed-" + std::to_string(k++), std::ios::binary);
        f.write(reinterpret_cast<const char*>(s.bytes.data()), static_cast<std::streamsize>(s.bytes.size()));
      }
    std::printf("wrote %zu seeds to %s\n", k, argv[2]);
    return 0;
  }
  if (argc >= 2 && (argv[1][0] < '0' || argv[1][0] > '9')) {  // replay files
    for (int i = 1; i < argc; ++i) {
      const Bytes in = read_all(argv[i]);
      std::fprintf(stderr, "replaying %s (%zu bytes)\n", argv[i], in.size());
      run_one(in);
    }
    std::printf("checkpoint readers: %d inputs read or refused with checkpoint_error\n", argc - 1);
    return 0;
  }
  const long runs = argc == 2 ? std::atol(argv[1]) : 200000;
  for (const Seed& s : all) run_one(s.bytes);
  for (const Seed& s : regress) {
    std::fprintf(stderr, "regression input: %s\n", s.name.c_str());  // a crash names what it was running
    run_one(s.bytes);
  }
  Mutator mutator;
  for (long k = 0; k < runs; ++k) run_one(mutator.next(all, k));
  for (const Tally& t : tallies) std::printf("  %-55s accepted %8zu, refused %8zu\n", t.reader, t.accepted, t.refused);
  std::printf("checkpoint readers: %zu seeds, %zu regression inputs and %ld mutated or random inputs read or refused "
              "with checkpoint_error\n",
              all.size(), regress.size(), runs);
  return 0;
}
#endif

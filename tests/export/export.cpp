// Export for inference (psx/export.hpp) and magnitude pruning (psx/pruning.hpp).
// The cluster spec's header comes first on purpose: it includes RapidJSON,
// and the JSON checks of export metadata must not depend on the order of
// psx's headers ("export: metadata.json that says ..." below).
#if __has_include(<rapidjson/document.h>)
#include <psx/transport/cluster_spec.hpp>
#endif
#include <psx/export.hpp>
#include <psx/psx.hpp>

#include "../support.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using psx_test::TempDir;

namespace {

std::vector<float> ramp(std::size_t n, float a, float b) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>(i) * a + b;
  return v;
}

using SGDCluster = psx::ParameterServer<psx::partition::RowRange, psx::sync::Synchronous, psx::optim::SGD>;

// A cluster whose variables hold `values` (one SGD step of lr 1 from zeros).
void set_values(SGDCluster& ps, psx::Worker& w, const std::vector<std::pair<std::string, std::vector<float>>>& values) {
  (void)ps;
  for (const auto& [name, v] : values) {
    std::vector<float> g(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) g[i] = -v[i];
    w.push(name, g);
  }
  w.step();
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

}  // namespace

TEST_CASE("export: every precision loads back as what it stores, with its metadata") {
  psx_test::Watchdog dog("export precisions");
  TempDir base("precisions");
  const auto kernel = ramp(6 * 4, 0.37f, -2.1f), bias = ramp(4, 0.5f, -1.0f);
  SGDCluster ps({2, 1}, {}, {}, {1.0});
  ps.declare(psx::dense("kernel", {6, 4}));
  ps.declare(psx::dense("bias", {4}));
  ps.declare(psx::dense("frozen", {2}, psx::Initializer::constant(0.75f), false));
  ps.run([&](psx::Worker& w) {
    set_values(ps, w, {{"kernel", kernel}, {"bias", bias}});
    const psx::ExportPrecision all[] = {psx::ExportPrecision::float32, psx::ExportPrecision::float16,
                                        psx::ExportPrecision::bfloat16, psx::ExportPrecision::int8,
                                        psx::ExportPrecision::int8_per_channel};
    std::uint64_t version = 10;
    for (const auto p : all) {
      CAPTURE(static_cast<int>(p));
      psx::ExportOptions o;
      o.base = base.path;
      o.version = version;
      o.precision = p;
      o.keep_float32 = {"bias"};
      o.signature = {.method = "predict", .inputs = {{"x", "float32", {-1, 6}}}, .outputs = {{"y", "float32", {-1, 4}}}};
      const fs::path dir = psx::export_model(ps, w, o);
      CHECK(dir == fs::absolute(base.path) / std::to_string(version));
      const psx::Export e = psx::load_export(dir);
      CHECK(e.metadata.step == 1);
      CHECK(e.metadata.version == version);
      CHECK(e.metadata.signature == o.signature);
      CHECK(e.metadata.tensors.size() == 3);
      CHECK(same_bits(e["bias"].to_float(), bias));  // kept float32
      CHECK(e["frozen"].trainable == false);
      const psx::ExportedTensor& k = e["kernel"];
      std::vector<float> want = kernel;
      switch (p) {
        case psx::ExportPrecision::float32:
          CHECK(k.dtype == "float32");
          break;
        case psx::ExportPrecision::float16:
          CHECK(k.dtype == "float16");
          for (float& x : want) x = psx::float16::from_float(x).to_float();
          break;
        case psx::ExportPrecision::bfloat16:
          CHECK(k.dtype == "bfloat16");
          for (float& x : want) x = psx::bfloat16::from_float(x).to_float();
          break;
        case psx::ExportPrecision::int8:
        case psx::ExportPrecision::int8_per_channel: {
          const bool per_channel = p == psx::ExportPrecision::int8_per_channel;
          const auto q = psx::quantize_int8(kernel, per_channel ? 6 : 1, per_channel ? 4 : 24, per_channel);
          psx::dequantize(q, want);
          CHECK(k.dtype == "int8");
          CHECK(k.quantization == (per_channel ? "per_channel" : "per_tensor"));
          CHECK(k.scales == q.scales);
          CHECK(k.values.size() == 24);
          break;
        }
      }
      CHECK(same_bits(k.to_float(), want));
      // Dequantized on request: the same values, as float32.
      const psx::Export d = psx::load_export(dir, {.dequantize = true});
      CHECK(d["kernel"].dtype == "float32");
      CHECK(same_bits(d["kernel"].to_float(), want));
      ++version;
    }
  });
  // The base directory holds the numbered versions only; the newest is found.
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(base.path)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"10", "11", "12", "13", "14"});
  CHECK(psx::load_export(base.path).metadata.version == 14);
  for (const char* f : {"metadata.json", "model.psx", "model.npz", "model.safetensors"})
    CHECK(fs::exists(base.path / "10" / f));
}

TEST_CASE("export: an existing version is never overwritten, and a damaged model.psx is named") {
  TempDir base("versions");
  SGDCluster ps({1, 1}, {}, {}, {1.0});
  ps.declare(psx::dense("w", {16}));
  ps.run([&](psx::Worker& w) {
    set_values(ps, w, {{"w", ramp(16, 1.0f, 1.0f)}});
    psx::ExportOptions o;
    o.base = base.path;
    psx::export_model(ps, w, o);  // version = step = 1
    CHECK_THROWS_WITH_AS(psx::export_model(ps, w, o), doctest::Contains("exists: an export version is never overwritten"),
                         psx::checkpoint_error);
  });
  const fs::path model = base.path / "1" / "model.psx";
  {
    std::fstream f(model, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x55');
  }
  CHECK_THROWS_WITH_AS(psx::load_export(base.path / "1"), doctest::Contains("model.psx: corrupted data (CRC-32C mismatch)"),
                       psx::checkpoint_error);
  // The highest version is loaded, up to 2^64 - 1 (20 digits); a name of
  // digits beyond that is not a version.
  {
    SGDCluster other({1, 1}, {}, {}, {1.0});
    other.declare(psx::dense("w", {16}));
    other.run([&](psx::Worker& w) {
      set_values(other, w, {{"w", ramp(16, 2.0f, 0.0f)}});
      psx::ExportOptions o;
      o.base = base.path;
      o.version = std::numeric_limits<std::uint64_t>::max();
      psx::export_model(other, w, o);
    });
    fs::create_directory(base.path / "99999999999999999999");
    CHECK(psx::load_export(base.path).path == base.path / "18446744073709551615");
    fs::remove_all(base.path / "18446744073709551615");
  }
  fs::resize_file(model, 20);
  CHECK_THROWS_WITH_AS(psx::load_export(base.path / "1"), doctest::Contains("model.psx: truncated"), psx::checkpoint_error);
  CHECK_THROWS_WITH_AS(psx::load_export(base.path / "nothing"), doctest::Contains("holds neither model.psx nor a version"),
                       psx::checkpoint_error);
}

TEST_CASE("export: metadata.json that says other than model.psx holds, or a field of the wrong type, is refused") {
  // metadata.json has no checksum: a tensor's shape or dtype there was
  // returned as it said, whatever model.psx held. And with
  // psx/transport/cluster_spec.hpp included before psx/export.hpp (as in
  // this file), RapidJSON's assertions were plain asserts: a field of the
  // wrong type aborted the program (a read of the wrong bits under NDEBUG).
  TempDir base("metadata");
  SGDCluster ps({1, 1}, {}, {}, {1.0});
  ps.declare(psx::dense("w", {4, 2}));
  ps.declare(psx::dense("b", {2}));
  ps.run([&](psx::Worker& w) {
    psx::ExportOptions o;
    o.base = base.path;
    psx::export_model(ps, w, o);
  });
  const fs::path version = *fs::directory_iterator(base.path);
  const fs::path meta = version / "metadata.json";
  std::string original;
  {
    std::ifstream in(meta);
    original.assign(std::istreambuf_iterator<char>(in), {});
  }
  fs::permissions(meta, fs::perms::owner_write, fs::perm_options::add);
  auto edited = [&](const std::string& from, const std::string& to) {
    std::string json = original;
    const auto at = json.find(from);
    REQUIRE(at != std::string::npos);
    json.replace(at, from.size(), to);
    std::ofstream(meta, std::ios::trunc) << json;
    return psx_test::message_of<psx::checkpoint_error>([&] { (void)psx::load_export(version); });
  };
  CHECK(edited("\"format_version\": 1", "\"format_version\": 3")
            .find("metadata.json: is in export format 3; this psx reads formats 1 to 2") != std::string::npos);
  CHECK(edited("\"format_version\": 1", "\"format_version\": 2")
            .find("metadata.json: says export format 2, model.psx is in format 1") != std::string::npos);
  CHECK(edited("\"float32\"", "\"int8\"").find("metadata.json: says tensor 0 is 'w' [4, 2] int8, model.psx holds 'w' "
                                                   "[4, 2] float32") != std::string::npos);
  CHECK(edited("\"trainable\": true", "\"trainable\": false").find("says tensor 0") != std::string::npos);
  std::ofstream(meta, std::ios::trunc) << original;
  const std::string step = "\"step\": " + std::to_string(psx::load_export(version).metadata.step);
  CHECK(edited(step, "\"step\": \"one\"").find("metadata.json: bad metadata") != std::string::npos);
  std::ofstream(meta, std::ios::trunc) << original;
  CHECK(psx::load_export(version).metadata.tensors.size() == 2);
}

TEST_CASE("export: a variable named like another's scales is refused before anything is written") {
  TempDir base("psx-export-collide");
  SGDCluster ps({1, 1}, {}, {}, {1.0});
  ps.declare(psx::dense("x", {4, 4}));
  ps.declare(psx::dense("x.scale", {4}));
  ps.run([&](psx::Worker& w) {
    set_values(ps, w, {{"x", ramp(16, 0.1f, -0.5f)}, {"x.scale", ramp(4, 1.0f, 1.0f)}});
    psx::ExportOptions o;
    o.base = base.path;
    o.precision = psx::ExportPrecision::int8_per_channel;
    CHECK_THROWS_WITH_AS(psx::export_model(ps, w, o), doctest::Contains("'x.scale' names a tensor of variable"),
                         psx::config_error);
  });
  CHECK(fs::is_empty(base.path));
}

TEST_CASE("export: a name that would unzip outside the npz's directory is refused, slashes within are kept") {
  TempDir base("psx-export-zipslip");
  SGDCluster ps({1, 1}, {}, {}, {1.0});
  const std::vector<std::string> refused = {"../up", "a/../../up", "..", "a/..", "/etc/x", "a\\b",
                                            std::string("a\0b", 3), "C:x", "c:/x"};
  // As the message shows them: JSON strings (a NUL in what() would end it).
  const std::vector<std::string> shown = {R"("../up")", R"("a/../../up")", R"("..")", R"("a/..")", R"("/etc/x")",
                                          R"("a\\b")", R"("a\u0000b")", R"("C:x")", R"("c:/x")"};
  for (const std::string& name : refused) ps.declare(psx::dense(name, {2}));
  ps.declare(psx::dense("layer/w", {2}));
  ps.declare(psx::dense("..x", {2}));
  ps.declare(psx::dense("dense/kernel:0", {2}));
  ps.run([&](psx::Worker& w) {
    for (const std::string& name : refused) set_values(ps, w, {{name, ramp(2, 1.0f, 1.0f)}});
    set_values(ps, w, {{"layer/w", ramp(2, 1.0f, 1.0f)}, {"..x", ramp(2, 1.0f, 1.0f)},
                       {"dense/kernel:0", ramp(2, 1.0f, 1.0f)}});
    psx::ExportOptions o;
    o.base = base.path / "exports";  // not made by a refused export
    for (std::size_t i = 0; i < refused.size(); ++i) {
      CAPTURE(shown[i]);
      o.variables = {refused[i]};
      const std::string message = psx_test::message_of<psx::config_error>([&] { psx::export_model(ps, w, o); });
      CHECK(message.find("variable " + shown[i] + " would name an .npz member outside") != std::string::npos);
    }
    CHECK(!fs::exists(o.base));
    // Without the npz the same names export (safetensors and model.psx keep them as keys).
    o.variables = {"../up"};
    o.npz = false;
    o.version = 1;
    const psx::Export e = psx::load_export(psx::export_model(ps, w, o));
    CHECK(e["../up"].to_float() == std::vector<float>{1.0f, 2.0f});
    // A slash inside a name is a folder within the archive, and ".." only
    // as a whole part is refused.
    o.variables = {"layer/w", "..x", "dense/kernel:0"};
    o.npz = true;
    o.version = 2;
    const fs::path dir = psx::export_model(ps, w, o);
    std::ifstream in(dir / "model.npz", std::ios::binary);
    const std::string zip{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    CHECK(zip.find("layer/w.npy") != std::string::npos);
    CHECK(zip.find("..x.npy") != std::string::npos);
    CHECK(zip.find("dense/kernel:0.npy") != std::string::npos);
  });
}

TEST_CASE("export: what the formats cannot hold is refused, names as readers take them") {
  TempDir base("psx-export-edges");
  SGDCluster ps({1, 1}, {}, {}, {1.0});
  ps.declare(psx::dense("caf\xC3\xA9", {4}));  // "café"
  ps.declare(psx::dense("__metadata__", {2}));
  ps.declare(psx::dense("bad", {4}));
  ps.run([&](psx::Worker& w) {
    constexpr float inf = std::numeric_limits<float>::infinity();
    set_values(ps, w, {{"caf\xC3\xA9", ramp(4, 1.0f, 1.0f)}, {"__metadata__", ramp(2, 1.0f, 0.5f)},
                       {"bad", {1.0f, -2.0f, inf, 3.0f}}});
    psx::ExportOptions o;
    o.base = base.path;
    // The safetensors header keeps "__metadata__" for itself.
    CHECK_THROWS_WITH_AS(psx::export_model(ps, w, o),
                         doctest::Contains("variable '__metadata__' takes the name '__metadata__', which "
                                           "model.safetensors keeps for its metadata"),
                         psx::config_error);
    // int8 has no infinity (it made every value of the tensor NaN, or 0 stored sparsely).
    o.variables = {"bad"};
    o.precision = psx::ExportPrecision::int8;
    CHECK_THROWS_WITH_AS(psx::export_model(ps, w, o),
                         doctest::Contains("variable 'bad' has an infinity at element 2, which int8 cannot hold"),
                         psx::checkpoint_error);
    CHECK(fs::is_empty(base.path));
    // In .npz, a name that is not ASCII is marked UTF-8 (zip flag bit 11),
    // as numpy.load then reads it; an ASCII one is not marked.
    o.variables = {"caf*", "__metadata__"};
    o.precision = psx::ExportPrecision::float32;
    o.safetensors = false;
    const fs::path dir = psx::export_model(ps, w, o);
    std::ifstream in(dir / "model.npz", std::ios::binary);
    const std::string zip{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    std::size_t marked = 0, plain = 0;
    for (std::size_t at = zip.find("PK\x03\x04"); at != std::string::npos; at = zip.find("PK\x03\x04", at + 4)) {
      const auto flags = static_cast<unsigned>(static_cast<unsigned char>(zip[at + 6]) |
                                               static_cast<unsigned char>(zip[at + 7]) << 8);
      const std::string name = zip.substr(at + 30, static_cast<unsigned char>(zip[at + 26]));
      if (name == "caf\xC3\xA9.npy") marked += flags == 0x0800;
      if (name == "__metadata__.npy") plain += flags == 0;
    }
    CHECK(marked == 1);
    CHECK(plain == 1);
  });
  // A base that cannot be made is a checkpoint_error naming it (it escaped
  // as a filesystem_error from export_checkpoint).
  TempDir root("psx-export-edges-ckpt");
  SGDCluster small({1, 1}, {}, {}, {1.0});
  small.declare(psx::dense("w", {2}));
  small.run([&](psx::Worker& w) {
    set_values(small, w, {{"w", ramp(2, 1.0f, 1.0f)}});
    psx::checkpoint::save(small, w, root.path);
  });
  std::ofstream(base.path / "file") << "x";
  psx::ExportOptions under_file;
  under_file.base = base.path / "file" / "exports";
  const std::string refused = psx_test::message_of<psx::checkpoint_error>(
      [&] { psx::export_checkpoint(root.path / "ckpt-0000000001", under_file); });
  CHECK(refused.starts_with("psx: export into " + (base.path / "file" / "exports").string()));
  // A sparse tensor claiming more elements than memory holds (its file need
  // not be large) is refused when it is made dense, typed and named.
  psx::ExportedTensor huge;
  huge.name = "huge";
  huge.dtype = "float32";
  huge.sparse = true;
  huge.shape = {std::uint64_t{1} << 31, std::uint64_t{1} << 31};
  CHECK_THROWS_WITH_AS((void)huge.to_float(), doctest::Contains("tensor 'huge' of 4611686018427387904 elements does not fit"),
                       psx::checkpoint_error);
}

TEST_CASE("export: a dynamic table is its rows sorted by id and their ids, from a cluster and from a checkpoint") {
  TempDir base("tables");
  psx::checkpoint::Info plain;
  {  // a checkpoint of "w" alone, for the restore below
    SGDCluster ps({1, 1}, {}, {}, {1.0});
    ps.declare(psx::dense("w", {4}));
    ps.run([&](psx::Worker& w) {
      set_values(ps, w, {{"w", ramp(4, 1.0f, 1.0f)}});
      plain = psx::checkpoint::save(ps, w, base.path / "plain");
    });
  }
  SGDCluster ps({2, 1}, {}, {}, {1.0});
  ps.declare(psx::dense("w", {4}));
  ps.declare(psx::embedding("emb", 4));
  ps.declare(psx::embedding("empty", 2));
  // Pushed in no order, over both servers; SGD with lr 1 from zeros: the row is -gradient.
  const std::vector<std::uint64_t> ids = {1u << 20, 42, UINT64_MAX, 7, 3000000000ull, 0};
  auto row_of = [](std::uint64_t id, std::size_t j) { return static_cast<float>(id % 1000) * 0.5f - static_cast<float>(j); };
  std::vector<std::uint64_t> sorted = ids;
  std::sort(sorted.begin(), sorted.end());
  const std::uint64_t id = 42;
  ps.run([&](psx::Worker& w) {
    std::vector<float> g(ids.size() * 4);
    for (std::size_t k = 0; k < ids.size(); ++k)
      for (std::size_t j = 0; j < 4; ++j) g[k * 4 + j] = -row_of(ids[k], j);
    w.push_rows("emb", ids, g);
    set_values(ps, w, {{"w", ramp(4, 1.0f, 1.0f)}});
    psx::ExportOptions o;
    o.base = base.path / "exports";
    const psx::Export e = psx::load_export(psx::export_model(ps, w, o));
    CHECK(e.metadata.format_version == 2);
    REQUIRE(e.tensors.size() == 5);
    CHECK(e.tensors[0].name == "w");
    CHECK(e.tensors[1].name == "emb");
    CHECK(e.tensors[2].name == "emb.ids");
    CHECK(e["w"].to_float() == ramp(4, 1.0f, 1.0f));
    CHECK(e["emb"].shape == std::vector<std::uint64_t>{ids.size(), 4});
    CHECK(e["emb.ids"].dtype == "uint64");
    CHECK(e["emb.ids"].shape == std::vector<std::uint64_t>{ids.size()});
    CHECK(e["emb.ids"].to_ids() == sorted);
    std::vector<float> want;
    for (const std::uint64_t k : sorted)
      for (std::size_t j = 0; j < 4; ++j) want.push_back(row_of(k, j));
    CHECK(e["emb"].to_float() == want);
    CHECK(e["empty"].shape == std::vector<std::uint64_t>{0, 2});
    CHECK(e["empty.ids"].to_ids().empty());
    CHECK_THROWS_WITH_AS((void)e["emb.ids"].to_float(), doctest::Contains("read them with to_ids()"), psx::config_error);
    CHECK_THROWS_AS((void)e["emb"].to_ids(), psx::config_error);
    // Dequantized, the ids stay ids; int8 per channel: a scale per row.
    o.version = 2;
    o.precision = psx::ExportPrecision::int8_per_channel;
    const psx::Export q = psx::load_export(psx::export_model(ps, w, o));
    CHECK(q["emb"].dtype == "int8");
    CHECK(q["emb"].scales.size() == ids.size());
    const psx::Export d = psx::load_export(q.path, {.dequantize = true});
    CHECK(d["emb.ids"].to_ids() == sorted);
    CHECK(d["emb"].dtype == "float32");
    // Without a table: format 1 (what a psx reading format 1 only reads).
    o.version = 3;
    o.precision = psx::ExportPrecision::float32;
    o.variables = {"w"};
    const psx::Export plain_export = psx::load_export(psx::export_model(ps, w, o));
    CHECK(plain_export.metadata.format_version == 1);
    CHECK(plain_export.tensors.size() == 1);
    // A checkpoint exports the same tensors, byte for byte.
    const auto saved = psx::checkpoint::save(ps, w, base.path / "ckpt");
    CHECK(psx::checkpoint::load_table(saved.path, "emb").ids == sorted);
    psx::ExportOptions from_ckpt;
    from_ckpt.base = base.path / "from-ckpt";
    const fs::path c = psx::export_checkpoint(saved.path, from_ckpt);
    o.variables = {};
    o.version = std::nullopt;
    o.base = base.path / "again";
    const fs::path again = psx::export_model(ps, w, o);
    for (const char* file : {"model.psx", "model.npz"}) {
      std::ifstream x(c / file, std::ios::binary), y(again / file, std::ios::binary);
      const std::string a((std::istreambuf_iterator<char>(x)), {}), b((std::istreambuf_iterator<char>(y)), {});
      CHECK_MESSAGE((!a.empty() && a == b), file);
    }
    // A checkpoint saved without the table is refused by name.
    CHECK_THROWS_WITH_AS(psx::checkpoint::restore(ps, w, plain.path),
                         doctest::Contains("has no dynamic table 'emb', which this program declares"), psx::checkpoint_error);
    // The refusals changed nothing.
    std::vector<float> row(4);
    w.pull_rows("emb", std::span<const std::uint64_t>(&id, 1), row);
    CHECK(row != std::vector<float>(4, 0.0f));
    std::vector<float> values(4);
    w.pull("w", values);
    CHECK(values == ramp(4, 1.0f, 1.0f));
  });
  // A variable named like a table's ids is refused before anything is written.
  SGDCluster clash({1, 1}, {}, {}, {1.0});
  clash.declare(psx::embedding("t", 2));
  clash.declare(psx::dense("t.ids", {2}, psx::Initializer::constant(1.0f)));  // not all zeros: stored whole
  clash.run([&](psx::Worker& w) {
    psx::ExportOptions o;
    o.base = base.path / "clash";
    CHECK_THROWS_WITH_AS(psx::export_model(clash, w, o), doctest::Contains("'t.ids' names a tensor of variable"),
                         psx::config_error);
    CHECK(!fs::exists(o.base / "0"));
  });
}

TEST_CASE("export: from a checkpoint, without a cluster") {
  TempDir root("from-ckpt"), base("from-ckpt-export");
  SGDCluster ps({2, 1}, {}, {}, {1.0});
  ps.declare(psx::dense("w", {5, 3}));
  ps.run([&](psx::Worker& w) {
    set_values(ps, w, {{"w", ramp(15, -0.25f, 1.5f)}});
    psx::checkpoint::save(ps, w, root.path);
  });
  psx::ExportOptions o;
  o.base = base.path;
  const auto dir = psx::export_checkpoint(root.path / "ckpt-0000000001", o);
  CHECK(same_bits(psx::load_export(dir)["w"].to_float(), ramp(15, -0.25f, 1.5f)));
}

TEST_CASE("pruning: the polynomial decay schedule follows TensorFlow Model Optimization's formula") {
  const psx::optim::PolynomialDecaySparsity s{.initial_sparsity = 0.1, .final_sparsity = 0.9, .begin_step = 10,
                                             .end_step = 110, .frequency = 25, .power = 3};
  CHECK(s.sparsity(0) == doctest::Approx(0.1));
  CHECK(s.sparsity(10) == doctest::Approx(0.1));
  CHECK(s.sparsity(60) == doctest::Approx(0.9 + (0.1 - 0.9) * 0.125));  // p = 0.5: (1 - p)^3 = 1/8
  CHECK(s.sparsity(110) == doctest::Approx(0.9));
  CHECK(s.sparsity(500) == doctest::Approx(0.9));
  CHECK(!s.prunes_at(9));
  CHECK(s.prunes_at(10));
  CHECK(!s.prunes_at(11));
  CHECK(s.prunes_at(35));
  CHECK(s.prunes_at(110));
  CHECK(!s.prunes_at(135));
  CHECK_THROWS_AS((psx::optim::PolynomialDecaySparsity{.initial_sparsity = 0.5, .final_sparsity = 0.2}.validate()),
                  psx::config_error);
  CHECK_THROWS_AS((psx::optim::PolynomialDecaySparsity{.begin_step = 5, .end_step = 5}.validate()), psx::config_error);
}

TEST_CASE("pruning: how many weights go, and ties at the threshold, as TensorFlow Model Optimization") {
  // One update at a step the schedule prunes at, at sparsity s throughout;
  // returns the weights after it.
  auto prune = [](std::vector<float> w, double s) {
    using Opt = psx::optim::Pruned<psx::optim::SGD>;
    const Opt opt{.optimizer = {0.0},
                  .schedule = {.initial_sparsity = s, .final_sparsity = s, .begin_step = 0, .end_step = 10, .frequency = 1}};
    psx::VariableMeta meta;
    meta.name = "w";
    const std::vector<float> g(w.size(), 0.0f);
    std::vector<float> mask(w.size(), 1.0f);
    float* bases[] = {mask.data()};
    opt.update(w, g, psx::SlotView(bases, 1, 0, w.size()), psx::UpdateContext{1, 1.0, &meta, 1, false});
    return w;
  };
  auto zeros = [](const std::vector<float>& v) { return std::count(v.begin(), v.end(), 0.0f); };
  std::vector<float> hundred(100);
  for (std::size_t i = 0; i < hundred.size(); ++i) hundred[i] = static_cast<float>(100 - i);
  // k = max(round(n * (1 - s)), 1) kept, in float32 with halves to even; it
  // pruned floor(s * n), which 0.57 * 100 = 56.99999999999999 cut to 56.
  CHECK(zeros(prune(hundred, 0.57)) == 57);
  CHECK(zeros(prune({5, 4, 3, 2, 1}, 0.5)) == 3);     // keeps round(2.5) = 2
  CHECK(zeros(prune({6, 5, 4, 3, 2, 1}, 0.25)) == 2);  // keeps round(4.5) = 4
  CHECK(zeros(prune({1, 2, 3}, 0.99)) == 2);           // keeps at least 1
  // The smallest go; every weight as large as the k-th stays, ties included.
  CHECK(prune({1, -5, 3, 2, -3, 4}, 0.5) == std::vector<float>{0, -5, 3, 0, -3, 4});
  CHECK(zeros(prune(std::vector<float>(8, 0.5f), 0.5)) == 0);  // all tied: none pruned (it pruned 4 by position)
}

TEST_CASE("pruning: during training the smallest weights go to zero and stay there, the export stores them sparsely") {
  psx_test::Watchdog dog("pruning");
  TempDir base("pruned");
  using Opt = psx::optim::Pruned<psx::optim::SGD>;
  const Opt opt{.optimizer = {0.01},
                .schedule = {.initial_sparsity = 0.0, .final_sparsity = 0.75, .begin_step = 0, .end_step = 20,
                             .frequency = 5, .power = 1},
                .names = {"w"}};
  psx::ParameterServer<psx::partition::HashByName, psx::sync::Synchronous, Opt> ps({1, 1}, {}, {}, opt);
  ps.declare(psx::dense("w", {10, 8}, psx::Initializer::normal(0, 1, 5)));
  ps.declare(psx::dense("other", {8}, psx::Initializer::normal(0, 1, 6)));
  std::vector<std::vector<float>> seen;
  ps.run([&](psx::Worker& w) {
    std::vector<float> v(80), g(80), o(8), go(8, 0.1f);
    for (int t = 0; t < 30; ++t) {
      w.pull("w", v);
      seen.push_back(v);
      for (std::size_t i = 0; i < v.size(); ++i) g[i] = 0.05f * static_cast<float>((i * 7 + t) % 5) - 0.1f;
      w.push({{"w", g}, {"other", go}});
      w.step();
    }
    w.pull("w", v);
    seen.push_back(v);
    psx::ExportOptions eo;
    eo.base = base.path;
    psx::export_model(ps, w, eo);
  });
  auto zeros = [](const std::vector<float>& v) { return std::count(v.begin(), v.end(), 0.0f); };
  // Pruned at steps 0, 5, 10, 15, 20 (update t + 1 happens before pull t + 1).
  CHECK(zeros(seen[1]) == 0);                  // sparsity(0) = 0
  CHECK(zeros(seen[6]) == 15);                 // floor(0.1875 * 80)
  CHECK(zeros(seen[11]) == 30);                // 0.375
  CHECK(zeros(seen[21]) == 60);                // 0.75
  CHECK(zeros(seen.back()) == 60);             // and no more afterwards
  // A pruned weight stays zero although its gradient is not.
  for (std::size_t i = 0; i < 80; ++i)
    if (seen[21][i] == 0.0f) CHECK(seen.back()[i] == 0.0f);
  // "other" is not pruned.
  const psx::Export e = psx::load_export(base.path);
  CHECK(e["w"].sparse);
  CHECK(e["w"].indices.size() == 20);
  CHECK(same_bits(e["w"].to_float(), seen.back()));
  CHECK(!e["other"].sparse);
  CHECK(zeros(e["other"].to_float()) == 0);
}

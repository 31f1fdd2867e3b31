// Writes exports of known values for tests/export/check_export.py, which
// reads them with numpy (and the safetensors package where installed):
//
//   write_export DIR   ->  DIR/1 float32, DIR/2 float16, DIR/3 bfloat16,
//                          DIR/4 int8 per tensor, DIR/5 int8 per channel
//
// Variables (value of flat element i): "dense/kernel" [3, 4]: i * 0.37 - 2.1;
// "bias" [4]: i * 0.5 - 1 (kept float32 in every version); "pruned" [8, 5]:
// i * 0.1 + 0.05 where i % 4 == 0, else 0 (stored sparsely). The dynamic
// table "table" (rows of 3): ids 1000, 7, 2^63 + 5 and 42 pushed in that
// order, the row of id k: (k % 97) * 0.25 + j * 0.5 - 1 for j = 0, 1, 2;
// exported as "table" [4, 3] (rows sorted by id) and "table.ids" (uint64).
#include <psx/export.hpp>
#include <psx/psx.hpp>

#include <cstdint>
#include <cstdio>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: write_export DIR\n");
    return 2;
  }
  const std::vector<std::pair<const char*, std::vector<std::size_t>>> vars = {
      {"dense/kernel", {3, 4}}, {"bias", {4}}, {"pruned", {8, 5}}};
  auto value = [](const std::string& name, std::size_t i) {
    if (name == "dense/kernel") return static_cast<float>(i) * 0.37f - 2.1f;
    if (name == "bias") return static_cast<float>(i) * 0.5f - 1.0f;
    return i % 4 == 0 ? static_cast<float>(i) * 0.1f + 0.05f : 0.0f;
  };
  // SGD with lr 1 from zeros: one step of gradient -v sets every value to v.
  psx::ParameterServer<psx::partition::RowRange, psx::sync::Synchronous, psx::optim::SGD> ps({2, 1}, {}, {}, {1.0});
  for (const auto& [name, shape] : vars) ps.declare(psx::dense(name, shape));
  ps.declare(psx::embedding("table", 3));
  ps.run([&](psx::Worker& w) {
    for (const auto& [name, shape] : vars) {
      std::vector<float> g(shape.size() == 1 ? shape[0] : shape[0] * shape[1]);
      for (std::size_t i = 0; i < g.size(); ++i) g[i] = -value(name, i);
      w.push(name, g);
    }
    const std::vector<std::uint64_t> ids = {1000, 7, (std::uint64_t{1} << 63) + 5, 42};
    std::vector<float> rows(ids.size() * 3);
    for (std::size_t k = 0; k < ids.size(); ++k)
      for (std::size_t j = 0; j < 3; ++j)
        rows[k * 3 + j] = -(static_cast<float>(ids[k] % 97) * 0.25f + static_cast<float>(j) * 0.5f - 1.0f);
    w.push_rows("table", ids, rows);
    w.step();
    const psx::ExportPrecision precisions[] = {psx::ExportPrecision::float32, psx::ExportPrecision::float16,
                                               psx::ExportPrecision::bfloat16, psx::ExportPrecision::int8,
                                               psx::ExportPrecision::int8_per_channel};
    for (std::uint64_t v = 1; v <= 5; ++v) {
      psx::ExportOptions o;
      o.base = argv[1];
      o.version = v;
      o.precision = precisions[v - 1];
      o.keep_float32 = {"bias"};
      o.signature = {.method = "predict", .inputs = {{"x", "float32", {-1, 3}}}, .outputs = {{"y", "float32", {-1, 4}}}};
      std::printf("wrote %s\n", psx::export_model(ps, w, o).c_str());
    }
  });
}

// Writes exports of known values for tests/export/check_export.py, which
// reads them with numpy (and the safetensors package where installed):
//
//   write_export DIR   ->  DIR/1 float32, DIR/2 float16, DIR/3 bfloat16,
//                          DIR/4 int8 per tensor, DIR/5 int8 per channel
//
// Variables (value of flat element i): "dense/kernel" [3, 4]: i * 0.37 - 2.1;
// "bias" [4]: i * 0.5 - 1 (kept float32 in every version); "pruned" [8, 5]:
// i * 0.1 + 0.05 where i % 4 == 0, else 0 (stored sparsely).
#include <psx/export.hpp>
#include <psx/psx.hpp>

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
  ps.run([&](psx::Worker& w) {
    for (const auto& [name, shape] : vars) {
      std::vector<float> g(shape.size() == 1 ? shape[0] : shape[0] * shape[1]);
      for (std::size_t i = 0; i < g.size(); ++i) g[i] = -value(name, i);
      w.push(name, g);
    }
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

// Writes the event file tests/summary/check_tensorboard.py reads back, with
// TensorBoard's reader and with its own: ten scalars, a histogram, a text and
// two non-finite scalars. Prints the file's path.
//
//   psx_write_summary LOGDIR
#include <psx/summary.hpp>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: psx_write_summary LOGDIR\n");
    return 2;
  }
  const std::filesystem::path logdir = argv[1];
  // -5.00 .. 4.99 (0 among them), one value past 1e20, one near -FLT_MAX, and
  // a NaN that the histogram leaves out.
  std::vector<float> weights;
  for (int i = 0; i < 1000; ++i) weights.push_back(static_cast<float>(i - 500) * 0.01f);
  weights.push_back(1e25f);
  weights.push_back(-3.0e38f);
  weights.push_back(std::numeric_limits<float>::quiet_NaN());

  // example-begin summary-writer
  psx::SummaryWriter summaries(logdir);
  for (std::int64_t step = 0; step < 10; ++step) {
    const float loss = 1.0f / static_cast<float>(step + 1);
    summaries.scalar("loss", loss, step);
  }
  summaries.histogram("weights", weights, 9);
  summaries.text("notes", "psx **summary** check: ünïcödé", 9);
  summaries.flush();
  // example-end

  summaries.scalar("nonfinite", std::numeric_limits<float>::quiet_NaN(), 10);
  summaries.scalar("nonfinite", -std::numeric_limits<float>::infinity(), 11);
  summaries.close();
  std::printf("%s\n", summaries.path().c_str());
  return 0;
}

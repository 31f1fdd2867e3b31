// custom_optimizer: a user-written optimizer, signSGD (Bernstein et al. 2018),
// plugged into the same ParameterServer through the psx::Optimizer concept.
#include <psx/psx.hpp>

#include <cstdio>
#include <vector>

// w -= lr * sign(g). No slots: the server keeps only the parameters.
struct SignSGD {
  double lr = 0.01;
  std::size_t slots() const { return 0; }
  void update(std::span<float> w, std::span<const float> g, const psx::SlotView&,
              const psx::UpdateContext& ctx) const {
    const auto step = static_cast<float>(lr * ctx.lr_scale);
    for (std::size_t i = 0; i < w.size(); ++i) w[i] -= g[i] > 0 ? step : g[i] < 0 ? -step : 0.0f;
  }
};
static_assert(psx::Optimizer<SignSGD>);

int main() {
  // Two workers minimise (x - 3)^2 for every element of x, starting at 0.
  psx::ParameterServer<psx::partition::RowRange, psx::sync::Synchronous, SignSGD> ps({2, 2}, {}, {}, {0.01});
  ps.declare(psx::dense("x", {8}));
  ps.run([](psx::Worker& w) {
    std::vector<float> x(8), g(8);
    for (int step = 0; step < 400; ++step) {
      w.pull("x", x);
      for (std::size_t i = 0; i < x.size(); ++i) g[i] = 2.0f * (x[i] - 3.0f);
      w.push("x", g);
      w.step();
    }
  });
  std::printf("x[0] after 400 signSGD steps: %.2f (optimum 3)\n", static_cast<double>(ps.read("x")[0]));
}

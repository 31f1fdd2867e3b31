// Trains one scalar with the embedded cluster, through psx as a package.
#include <psx/eigen.hpp>
#include <psx/psx.hpp>

#include <cstdio>

int main() {
  psx::ParameterServer<> ps({1, 2}, {}, {psx::sync::Aggregate::sum}, {1.0f});
  ps.declare(psx::dense("x", {1}));
  ps.run([](psx::Worker& w) {
    Eigen::VectorXf g = Eigen::VectorXf::Constant(1, 1.5f);
    w.push("x", g);
    w.step();
  });
  std::printf("consumer: trained x = %g\n", static_cast<double>(ps.read("x")[0]));
}

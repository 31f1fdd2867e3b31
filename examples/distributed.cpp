// distributed: one task of a cluster of processes over ZeroMQ. Every process
// runs this same program; TF_CONFIG says which task it is (tools/psx-launch
// sets it):
//
//   tools/psx-launch --ps 2 --workers 3 -- build/release/examples/distributed
//
// The workers fit w (1000 floats) to a target by least squares, each on its
// own noisy samples, synchronously; the chief prints how close w came.
#include <psx/psx.hpp>
#include <psx/transport/zmq.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

namespace {

float target(std::size_t i) { return std::sin(0.01f * static_cast<float>(i)); }

// One synchronous SGD step per pass: gradient of 0.5 |w - (target + noise)|^2.
void train(psx::Worker& w) {
  std::vector<float> values(1000), grad(1000);
  std::mt19937 rng(static_cast<unsigned>(w.index()));
  std::normal_distribution<float> noise(0.0f, 0.1f);
  for (int step = 0; step < 200; ++step) {
    w.pull("w", values);
    for (std::size_t i = 0; i < values.size(); ++i) grad[i] = values[i] - (target(i) + noise(rng));
    w.push("w", grad);
    w.step();
  }
  w.barrier();  // every worker's last push is in before the chief reads
}

}  // namespace

using Cluster = psx::ParameterServer<psx::partition::RowRange, psx::sync::Synchronous,
                                     psx::optim::SGD, psx::transport::Zmq>;

int main() {
  auto zmq = psx::transport::Zmq::from_env();  // TF_CONFIG, PSX_RENDEZVOUS
  psx::ClusterConfig config{zmq.tf.cluster.num_servers(), zmq.tf.cluster.num_workers(),
                            std::chrono::seconds(10)};  // peer timeout
  Cluster cluster(config, {}, {}, psx::optim::SGD{0.1f}, zmq);
  cluster.declare(psx::dense("w", {1000}));
  cluster.run(train);
  if (zmq.tf.task.type == "chief") {
    const std::vector<float> w = cluster.read("w");
    double err = 0;
    for (std::size_t i = 0; i < w.size(); ++i) err = std::max(err, std::abs(double(w[i]) - target(i)));
    std::printf("chief: %zu servers, %zu workers: max |w - target| = %.3f\n", config.num_servers,
                config.num_workers, err);
  }
}

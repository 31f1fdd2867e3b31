// The headers of psx's optional parts, as an outside project includes them.
#include <psx/checkpoint.hpp>
#include <psx/export.hpp>
#include <psx/pruning.hpp>
#include <psx/summary.hpp>
#include <psx/transport/cluster_spec.hpp>
#include <psx/transport/zmq.hpp>
#include <psx/xtensor.hpp>

// One use of each, so that a header that is there but empty would not pass.
int consumer_parts() {
  psx::ExportOptions options;
  psx::transport::ClusterSpec spec = psx::transport::ClusterSpec::local(1, 1);
  return static_cast<int>(options.npz) + static_cast<int>(spec.num_workers());
}

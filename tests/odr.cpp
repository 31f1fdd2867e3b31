// ODR guard: this translation unit includes every psx header, and the test
// binary links it beside the others, which include them too. A non-inline
// definition in a header then fails the link with a duplicate symbol.
#include <psx/eigen.hpp>
#include <psx/psx.hpp>
#include <psx/summary.hpp>
#include <psx/xtensor.hpp>
#if __has_include(<zmq.hpp>)
#include <psx/transport/zmq.hpp>
#endif

namespace psx_test {
int odr_anchor() { return PSX_VERSION_MAJOR; }
}  // namespace psx_test

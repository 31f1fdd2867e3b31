//! @file psx/optim.hpp
//! Built-in optimizers. The concept is `psx::Optimizer` in `psx/concepts.hpp`.
#pragma once

#include <psx/concepts.hpp>

#include <cstddef>
#include <ostream>
#include <span>

namespace psx {
inline namespace v0 {
namespace optim {

//! Plain stochastic gradient descent: `w -= lr * g` (times the sync policy's
//! learning-rate scale). No state: 4 bytes per parameter on the server.
struct SGD {
  float lr = 0.01f;

  std::size_t slots() const noexcept { return 0; }

  void update(std::span<float> w, std::span<const float> g, const SlotView&,
              const UpdateContext& ctx) const noexcept {
    const float step = lr * ctx.lr_scale;
    float* __restrict wp = w.data();
    const float* __restrict gp = g.data();
    const std::size_t n = w.size();
    for (std::size_t i = 0; i < n; ++i) wp[i] -= step * gp[i];
  }
  friend bool operator==(const SGD&, const SGD&) = default;
  friend std::ostream& operator<<(std::ostream& os, const SGD& o) { return os << "SGD{lr=" << o.lr << '}'; }
};
static_assert(Optimizer<SGD>);

}  // namespace optim
}  // namespace v0
}  // namespace psx

//! @file psx/xtensor.hpp
//! Opt-in: lets `Worker::pull`/`push` read and fill xtensor containers of
//! float (`xt::xarray<float>`, `xt::xtensor<float, N>`, adaptors) in place.
//! Only row-major layouts are accepted; others raise `psx::shape_error`.
#pragma once

#include <psx/errors.hpp>
#include <psx/worker.hpp>

#include <xtensor/xcontainer.hpp>
#include <xtensor/xlayout.hpp>

#include <concepts>
#include <cstddef>
#include <span>
#include <vector>

namespace psx {
inline namespace v0 {
namespace detail {

template <class T>
concept xtensor_float_container =
    std::derived_from<T, xt::xcontainer<T>> && std::same_as<typename T::value_type, float>;

}  // namespace detail

//! xtensor containers and adaptors of float with row-major layout.
template <class T>
  requires detail::xtensor_float_container<T>
struct tensor_traits<T> {
  static std::span<float> data(T& t) { return {t.data(), t.size()}; }
  static std::span<const float> data(const T& t) { return {t.data(), t.size()}; }
  static std::vector<std::size_t> shape(const T& t) {
    if (t.layout() != xt::layout_type::row_major && t.dimension() > 1)
      throw shape_error("psx: an xtensor container with a layout other than row_major cannot be viewed "
                        "as row-major parameters");
    return {t.shape().begin(), t.shape().end()};
  }
};

}  // namespace v0
}  // namespace psx

//! @file psx/xtensor.hpp
//! Opt-in: lets `Worker::pull`/`push` read and fill xtensor containers of
//! float (`xt::xarray<float>`, `xt::xtensor<float, N>`, adaptors) in place.
//! Only containers whose elements lie contiguously in row-major order are
//! accepted (a column-major one, or an adaptor with strides, of any
//! dimension, raises `psx::shape_error`).
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

//! xtensor containers and adaptors of float, contiguous and row-major.
template <class T>
  requires detail::xtensor_float_container<T>
struct tensor_traits<T> {
  static std::span<float> data(T& t) { return {t.data(), t.size()}; }
  static std::span<const float> data(const T& t) { return {t.data(), t.size()}; }
  static std::vector<std::size_t> shape(const T& t) {
    std::vector<std::size_t> shape(t.shape().begin(), t.shape().end());
    if (!contiguous(t)) {
      std::string strides;
      for (std::size_t d = 0; d < t.dimension(); ++d)
        strides += (d ? ", " : "") + std::to_string(static_cast<long long>(t.strides()[d]));
      throw shape_error("psx: an xtensor container of shape " + detail::shape_string(shape) + " and strides [" +
                        strides + "] cannot be viewed as row-major parameters: its elements are not contiguous "
                        "in row-major order");
    }
    return shape;
  }

 private:
  // Whether element (i, j, ...) is at i * shape[1] * ... + j * ... of data():
  // each stride is the product of the later extents (axes of extent 1 have
  // any stride; an empty container is contiguous).
  static bool contiguous(const T& t) {
    if (t.size() == 0) return true;
    long long expect = 1;
    for (std::size_t d = t.dimension(); d-- > 0;) {
      const auto n = static_cast<long long>(t.shape()[d]);
      if (n != 1 && static_cast<long long>(t.strides()[d]) != expect) return false;
      expect *= n;
    }
    return true;
  }
};

}  // namespace v0
}  // namespace psx

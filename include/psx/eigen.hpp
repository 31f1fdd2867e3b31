//! @file psx/eigen.hpp
//! Opt-in: lets `Worker::pull`/`push` read and fill Eigen matrices, arrays
//! and maps of float in place. Only row-major storage (or vectors) can be
//! viewed as a variable's row-major elements; a column-major matrix with
//! more than one row and column is refused with `psx::shape_error` rather
//! than read transposed.
#pragma once

#include <psx/errors.hpp>
#include <psx/worker.hpp>

#include <Eigen/Core>

#include <concepts>
#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>

namespace psx {
inline namespace v0 {
namespace detail {

template <class T>
concept eigen_dense_float =
    std::derived_from<T, Eigen::PlainObjectBase<T>> && std::same_as<typename T::Scalar, float>;

template <class T>
std::vector<std::size_t> eigen_shape(const T& m) {
  const bool vector = m.rows() == 1 || m.cols() == 1;
  if (!vector && !T::IsRowMajor)
    throw shape_error("psx: an Eigen " + std::to_string(m.rows()) + "x" + std::to_string(m.cols()) +
                      " column-major matrix cannot be viewed as row-major parameters; use "
                      "Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> or a vector");
  if (vector && (m.rows() == 1) != (m.cols() == 1)) return {static_cast<std::size_t>(m.size())};
  return {static_cast<std::size_t>(m.rows()), static_cast<std::size_t>(m.cols())};
}

template <class T>
struct eigen_traits {
  static std::span<float> data(T& m) { return {m.data(), static_cast<std::size_t>(m.size())}; }
  static std::span<const float> data(const T& m) { return {m.data(), static_cast<std::size_t>(m.size())}; }
  static std::vector<std::size_t> shape(const T& m) { return eigen_shape(m); }
};

}  // namespace detail

//! Eigen::Matrix / Eigen::Array of float (owning storage).
template <class T>
  requires detail::eigen_dense_float<T>
struct tensor_traits<T> : detail::eigen_traits<T> {};

//! Eigen::Map of a float matrix or array with the default (contiguous) stride.
template <class M, int MapOptions>
  requires detail::eigen_dense_float<M>
struct tensor_traits<Eigen::Map<M, MapOptions, Eigen::Stride<0, 0>>>
    : detail::eigen_traits<Eigen::Map<M, MapOptions, Eigen::Stride<0, 0>>> {};

//! A view of an Eigen object's elements (checked to be row-major or a vector).
template <class T>
  requires TensorLike<T>
std::span<float> as_span(T& tensor) {
  (void)tensor_traits<T>::shape(tensor);
  return tensor_traits<T>::data(tensor);
}

}  // namespace v0
}  // namespace psx

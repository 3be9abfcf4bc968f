// Elementwise algorithms on any executor: fill, cast, scale and axpy, each one MPX_HD
// functor in mpx::ops that mpx::transform (exec/transform.hpp) applies on both
// executors.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/convert_span.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/math.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/exec/transform.hpp>

#include <cstddef>
#include <type_traits>

namespace mpx {

namespace ops {

//! Every element becomes `value`.
template <class T>
struct fill_with {
  T value;
  MPX_HD T operator()() const noexcept { return value; }
};

//! Converts with mpx::cast (round to nearest even, overflow to inf).
template <class To>
struct cast_to {
  template <class From>
  MPX_HD To operator()(From x) const noexcept {
    return mpx::cast<To>(x);
  }
  //! The host's whole-array conversion between float and a 16-bit type (F16C for half),
  //! the same bits as the element-wise cast.
  template <class From>
    requires((std::is_same_v<From, float> && dtype16<To>) || (dtype16<From> && std::is_same_v<To, float>))
  void host_span(std::size_t n, To* out, From const* in) const {
    if constexpr (std::is_same_v<To, float>) detail::widen_span(in, out, n);
    else detail::round_span(in, out, n);
  }
};

//! x * factor, computed in float and rounded once to T.
template <class T>
struct scale_by {
  float factor;
  MPX_HD T operator()(T x) const noexcept { return mpx::cast<T>(mpx::cast<float>(x) * factor); }
};

//! alpha * x + y, computed in float with one rounding (an FMA), then rounded to Y.
template <class Y>
struct axpy_with {
  float alpha;
  template <class X>
  MPX_HD Y operator()(X x, Y y) const noexcept {
    return mpx::cast<Y>(mpx::fma(alpha, mpx::cast<float>(x), mpx::cast<float>(y)));
  }
};

}  // namespace ops

//! Sets every element of x to value.
template <executor Exec, tensor_like X>
void fill(Exec const& exec, X&& x, value_t<X> value) {
  transform(exec, x, ops::fill_with<value_t<X>>{value});
}

//! dst[i] = mpx::cast<D>(src[i]): round to nearest even, overflow to ±inf, NaN kept.
template <executor Exec, tensor_like Src, tensor_like Dst>
void cast(Exec const& exec, Src&& src, Dst&& dst) {
  detail::require_same_shape("cast", "src", mpx::view(src).shape(), "dst", mpx::view(dst).shape());
  transform(exec, dst, ops::cast_to<value_t<Dst>>{}, src);
}

//! x[i] *= factor, in place, computed in float and rounded once.
template <executor Exec, tensor_like X>
void scale(Exec const& exec, X&& x, float factor) {
  transform(exec, x, ops::scale_by<value_t<X>>{factor}, x);
}

//! y[i] = alpha * x[i] + y[i], computed in float with one rounding, then rounded to y's type.
template <executor Exec, tensor_like X, tensor_like Y>
void axpy(Exec const& exec, float alpha, X&& x, Y&& y) {
  detail::require_same_shape("axpy", "x", mpx::view(x).shape(), "y", mpx::view(y).shape());
  transform(exec, y, ops::axpy_with<value_t<Y>>{alpha}, x, y);
}

}  // namespace mpx

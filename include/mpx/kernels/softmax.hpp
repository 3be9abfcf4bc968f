// Softmax and log-softmax over the last axis, forward and backward, on any executor.
// Always computed in float with the row maximum subtracted, whatever the storage; a
// policy that accumulates in 16 bits is refused at compile time.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/elementary.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/policy.hpp>
#include <mpx/core/shape.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/for_each.hpp>
#include <mpx/exec/tensor.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

// Semantics at the edges: -inf entries (masks) get probability 0 (log-probability -inf)
// and leave the rest of the row exact; a row that is all -inf is undefined (0/0) and
// comes out NaN, as in PyTorch; a NaN or +inf anywhere in a row makes the whole row NaN
// (the maximum keeps NaN, and +inf - +inf is NaN), so a bad input is never hidden.

namespace mpx {

namespace detail {

//! The static_assert behind softmax, log_softmax and the losses: the message names why.
template <class P>
constexpr void require_float_softmax() {
  static_assert(policy_type<P>, "mpx::softmax: the template argument must be a policy such as mpx::mixed_float16");
  static_assert(float_accumulating_policy<P>,
                "mpx::softmax, mpx::log_softmax and the cross-entropy losses accumulate the row sum of "
                "exp(x - max) in float32 (in 16 bits that sum loses the small probabilities of a long row, "
                "and float16 overflows past 65504), but this policy's accumulate_type is 16-bit: use "
                "mpx::mixed_float16, mpx::mixed_bfloat16, mpx::float32 or a policy<Storage, Compute, float>");
}

// The row bodies, written once for both executors (exec/lanes.hpp): the maximum, the
// sum of exp(x - max), then the write, each a pass over the row by the row's lanes.
template <bool Log, class In, class Out>
struct softmax_row {
  In const* x;
  Out* y;  // may be x: a lane writes only the columns it alone reads
  std::size_t cols;
  template <class Lanes>
  MPX_HD void operator()(Lanes const& lanes, std::size_t r) const {
    In const* xr = x + r * cols;
    Out* yr = y + r * cols;
    float const m = lanes.reduce(cols, max_float{}, [&](std::size_t c) { return cast<float>(xr[c]); });
    float const s = lanes.reduce(cols, sum_float{}, [&](std::size_t c) { return exp_float(cast<float>(xr[c]) - m); });
    if constexpr (Log) {
      float const log_s = ::logf(s);
      lanes.for_each(cols, [&](std::size_t c) { yr[c] = cast<Out>((cast<float>(xr[c]) - m) - log_s); });
    } else {
      lanes.for_each(cols, [&](std::size_t c) { yr[c] = cast<Out>(exp_float(cast<float>(xr[c]) - m) / s); });
    }
  }
};

// softmax:     dx = y * (dy - sum(dy * y))
// log_softmax: dx = dy - exp(y) * sum(dy)
template <bool Log, class Y, class DY, class DX>
struct softmax_backward_row {
  Y const* y;
  DY const* dy;
  DX* dx;  // may be y or dy
  std::size_t cols;
  template <class Lanes>
  MPX_HD void operator()(Lanes const& lanes, std::size_t r) const {
    std::size_t const base = r * cols;
    float const dot = lanes.reduce(cols, sum_float{}, [&](std::size_t c) {
      float const g = cast<float>(dy[base + c]);
      return Log ? g : g * cast<float>(y[base + c]);
    });
    lanes.for_each(cols, [&](std::size_t c) {
      float const yv = cast<float>(y[base + c]);
      float const g = cast<float>(dy[base + c]);
      dx[base + c] = cast<DX>(Log ? g - exp_float(yv) * dot : yv * (g - dot));
    });
  }
};

template <bool Log, class Exec, class X, class Y>
void softmax_forward(std::string_view op, Exec const& exec, X&& x, Y&& y) {
  auto xv = mpx::view(x);
  auto yv = mpx::view(y);
  require_access<Exec, space_t<X>, space_t<Y>>();
  static_assert(!std::is_const_v<typename decltype(yv)::element_type>, "mpx::softmax: the output is const");
  row_shape const rs = last_axis_rows(op, xv.shape());
  require_same_shape(op, "x", xv.shape(), "y", yv.shape());
  require_in_place_or_disjoint(op, "y", yv, "x", xv);
  if (rs.cols == 0) return;
  using in_t = typename decltype(xv)::value_type;
  using out_t = typename decltype(yv)::element_type;
  for_each_row(exec, rs.rows, rs.cols, softmax_row<Log, in_t, out_t>{xv.data(), yv.data(), rs.cols});
}

template <bool Log, class Exec, class Y, class DY, class DX>
void softmax_backward_impl(std::string_view op, Exec const& exec, Y&& y, DY&& dy, DX&& dx) {
  auto yv = mpx::view(y);
  auto dyv = mpx::view(dy);
  auto dxv = mpx::view(dx);
  require_access<Exec, space_t<Y>, space_t<DY>, space_t<DX>>();
  static_assert(!std::is_const_v<typename decltype(dxv)::element_type>, "mpx::softmax_backward: dx is const");
  row_shape const rs = last_axis_rows(op, yv.shape());
  require_same_shape(op, "y", yv.shape(), "dy", dyv.shape());
  require_same_shape(op, "y", yv.shape(), "dx", dxv.shape());
  require_in_place_or_disjoint(op, "dx", dxv, "dy", dyv);
  require_in_place_or_disjoint(op, "dx", dxv, "y", yv);
  if (rs.cols == 0) return;
  using y_t = typename decltype(yv)::value_type;
  using dy_t = typename decltype(dyv)::value_type;
  using dx_t = typename decltype(dxv)::element_type;
  for_each_row(exec, rs.rows, rs.cols,
               softmax_backward_row<Log, y_t, dy_t, dx_t>{yv.data(), dyv.data(), dxv.data(), rs.cols});
}

}  // namespace detail

//! y = exp(x - max) / sum(exp(x - max)) along the last axis of x (any rank >= 1), in
//! float whatever x's and y's dtypes, one rounding to y's. Policy must accumulate in
//! float (a compile error otherwise); float32 when not given. y may be x (every element
//! is read before it is written, by the thread that writes it). Asynchronous on a
//! cuda_executor.
template <class Policy = float32, executor Exec, tensor_like X, tensor_like Y>
void softmax(Exec const& exec, X&& x, Y&& y) {
  detail::require_float_softmax<Policy>();
  detail::softmax_forward<false>("softmax", exec, x, y);
}

//! y = (x - max) - log(sum(exp(x - max))) along the last axis; as softmax otherwise.
template <class Policy = float32, executor Exec, tensor_like X, tensor_like Y>
void log_softmax(Exec const& exec, X&& x, Y&& y) {
  detail::require_float_softmax<Policy>();
  detail::softmax_forward<true>("log_softmax", exec, x, y);
}

//! dx = y * (dy - sum(dy * y)) along the last axis, from softmax's output y (as
//! TensorFlow and PyTorch do); float arithmetic, one rounding. dx may be dy.
template <class Policy = float32, executor Exec, tensor_like Y, tensor_like DY, tensor_like DX>
void softmax_backward(Exec const& exec, Y&& y, DY&& dy, DX&& dx) {
  detail::require_float_softmax<Policy>();
  detail::softmax_backward_impl<false>("softmax_backward", exec, y, dy, dx);
}

//! dx = dy - exp(y) * sum(dy) along the last axis, from log_softmax's output y. dx may be dy.
template <class Policy = float32, executor Exec, tensor_like Y, tensor_like DY, tensor_like DX>
void log_softmax_backward(Exec const& exec, Y&& y, DY&& dy, DX&& dx) {
  detail::require_float_softmax<Policy>();
  detail::softmax_backward_impl<true>("log_softmax_backward", exec, y, dy, dx);
}

}  // namespace mpx

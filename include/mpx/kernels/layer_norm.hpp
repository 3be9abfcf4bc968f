// Layer normalisation over the last axis, forward and backward, on any executor. The
// statistics are computed in float by two passes (mean, then the mean of squared
// deviations), whatever the storage, so a large common offset does not cancel them.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/policy.hpp>
#include <mpx/core/shape.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/for_each.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/exec/columns.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <type_traits>

namespace mpx {

namespace detail {

//! The static_assert behind the normalisation kernels.
template <class P>
constexpr void require_float_norm() {
  static_assert(policy_type<P>, "mpx::layer_norm / mpx::batch_norm: the template argument must be a policy such as "
                                "mpx::mixed_float16");
  static_assert(float_accumulating_policy<P>,
                "mpx::layer_norm and mpx::batch_norm accumulate means and variances in float32 (in 16 bits "
                "the sum of squared deviations loses its small terms and float16 overflows past 65504), but "
                "this policy's accumulate_type is 16-bit: use mpx::mixed_float16, mpx::mixed_bfloat16, "
                "mpx::float32 or a policy<Storage, Compute, float>");
}

template <class... Views>
constexpr void require_float_tensors() {
  static_assert((std::is_same_v<typename Views::value_type, float> && ...),
                "mpx::layer_norm / mpx::batch_norm: scale, shift, saved statistics, running statistics and "
                "their gradients are float32 tensors");
}

//! Throws shape_error "<what> of shape [a] does not match <other> of shape [b] (...)".
inline void require_extent(std::string_view op, std::string_view what, shape const& s, std::string_view other,
                           shape const& o, std::int64_t extent, std::string_view why) {
  if (s.rank() != 1 || s[0] != extent)
    fail<shape_error>(op, std::string(what) + " of shape " + s.to_string() + " does not match " + std::string(other) +
                              " of shape " + o.to_string() + " (" + std::string(why) + ")");
}

//! A norm's vector argument (gamma, a statistic, a gradient) and its name for messages.
struct named_vector {
  std::string_view name;
  shape const& extents;
};

//! Each vector must be [extent]; a mismatch names it, x, and "<name> <must_be>".
inline void require_vectors(std::string_view op, shape const& x, std::int64_t extent, std::string_view must_be,
                            std::initializer_list<named_vector> vectors) {
  for (named_vector const& v : vectors)
    require_extent(op, v.name, v.extents, "x", x, extent, std::string(v.name) + " " + std::string(must_be));
}

//! Column terms of a norm's dgamma (dy * xhat) and dbeta (dy), xhat = (x - mean) * rstd:
//! the statistics are per row for layer norm, per column (channel) for batch norm.
template <class X, class DY, bool StatisticsPerRow>
struct norm_param_terms {
  X const* x;
  DY const* dy;
  float const* mean;
  float const* rstd;
  std::size_t cols;
  MPX_HD void operator()(std::size_t r, std::size_t j, float& a, float& b) const {
    std::size_t const i = r * cols + j;
    std::size_t const s = StatisticsPerRow ? r : j;
    float const g = cast<float>(dy[i]);
    a = g * ((cast<float>(x[i]) - mean[s]) * rstd[s]);
    b = g;
  }
};

// ---- LayerNorm ----
// What layer norm's vectors must be (require_vectors' messages): gamma, beta and their
// gradients one value per column, mean and rstd one per row.
inline constexpr std::string_view per_column = "must be [cols], x's last extent";
inline constexpr std::string_view per_row = "must be [rows], one per row of x";

// The row bodies, written once for both executors (exec/lanes.hpp): three passes over a
// row forward (sum, squared deviations, write), two backward.

template <class X, class Y>
struct layer_norm_row {
  X const* x;
  float const* gamma;
  float const* beta;
  Y* y;  // may be x: a lane writes only the columns it alone reads
  float* mean;
  float* rstd;
  std::size_t cols;
  float eps;
  template <class Lanes>
  MPX_HD void operator()(Lanes const& lanes, std::size_t r) const {
    X const* xr = x + r * cols;
    Y* yr = y + r * cols;
    float const n = static_cast<float>(cols);
    float const m = lanes.reduce(cols, sum_float{}, [&](std::size_t c) { return cast<float>(xr[c]); }) / n;
    float const q = lanes.reduce(cols, sum_float{}, [&](std::size_t c) {
      float const d = cast<float>(xr[c]) - m;
      return d * d;
    });
    float const rs = 1.0f / ::sqrtf(q / n + eps);
    lanes.once([&] {
      mean[r] = m;
      rstd[r] = rs;
    });
    lanes.for_each(cols, [&](std::size_t c) { yr[c] = cast<Y>((cast<float>(xr[c]) - m) * rs * gamma[c] + beta[c]); });
  }
};

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma, xhat = (x - mean) * rstd
template <class X, class DY, class DX>
struct layer_norm_backward_row {
  X const* x;
  DY const* dy;
  float const* gamma;
  float const* mean;
  float const* rstd;
  DX* dx;  // may be dy
  std::size_t cols;
  template <class Lanes>
  MPX_HD void operator()(Lanes const& lanes, std::size_t r) const {
    std::size_t const base = r * cols;
    float const m = mean[r], rs = rstd[r];
    float_pair const sums = lanes.reduce(cols, sum_float_pair{}, [&](std::size_t c) {
      float const g = cast<float>(dy[base + c]) * gamma[c];
      return float_pair{g, g * ((cast<float>(x[base + c]) - m) * rs)};
    });
    float const inv = 1.0f / static_cast<float>(cols);
    // Every lane has read all of its columns of dy before writing dx.
    lanes.for_each(cols, [&](std::size_t c) {
      float const g = cast<float>(dy[base + c]) * gamma[c];
      float const xh = (cast<float>(x[base + c]) - m) * rs;
      dx[base + c] = cast<DX>(rs * (g - sums.first * inv - xh * (sums.second * inv)));
    });
  }
};

}  // namespace detail

//! y = (x - mean) / sqrt(var + eps) * gamma + beta along the last axis of x (any rank
//! >= 1, [rows, cols] with cols the last extent). mean and var are the row's, biased
//! (divided by cols), computed in float by two passes; the result is rounded once to
//! y's dtype. gamma, beta: float [cols]. mean, rstd: float [rows], written for the
//! backward pass (rstd = 1 / sqrt(var + eps)). eps > 0 (1e-5, PyTorch's default; Keras
//! uses 1e-3). y may be x. Policy must accumulate in float. Asynchronous on a
//! cuda_executor. Shape mismatches throw mpx::shape_error naming both shapes.
template <class Policy = float32, executor Exec, tensor_like X, tensor_like G, tensor_like B, tensor_like Y,
          tensor_like M, tensor_like R>
void layer_norm_forward(Exec const& exec, X&& x, G&& gamma, B&& beta, Y&& y, M&& mean, R&& rstd,
                        float eps = 1e-5f) {
  detail::require_float_norm<Policy>();
  auto [xv, gv, bv, yv, mv, rv] = detail::views_for<Exec>(x, gamma, beta, y, mean, rstd);
  detail::require_float_tensors<decltype(gv), decltype(bv), decltype(mv), decltype(rv)>();
  static_assert(detail::all_writable<decltype(yv), decltype(mv), decltype(rv)>,
                "mpx::layer_norm_forward: y, mean and rstd are outputs and cannot be const");
  constexpr std::string_view op = "layer_norm_forward";
  auto const [rows, cols] = detail::last_axis_rows(op, xv.shape());
  detail::require_same_shape(op, "x", xv.shape(), "y", yv.shape());
  detail::require_vectors(op, xv.shape(), static_cast<std::int64_t>(cols), detail::per_column,
                          {{"gamma", gv.shape()}, {"beta", bv.shape()}});
  detail::require_vectors(op, xv.shape(), static_cast<std::int64_t>(rows), detail::per_row,
                          {{"mean", mv.shape()}, {"rstd", rv.shape()}});
  if (!(eps > 0.0f)) detail::fail<invalid_argument>(op, "eps must be > 0, got " + detail::to_text(eps));
  detail::require_in_place_or_disjoint(op, "y", yv, "x", xv);
  if (rows * cols == 0) return;
  for_each_row(exec, rows, cols,
                       detail::layer_norm_row<value_t<X>, value_t<Y>>{xv.data(), gv.data(), bv.data(), yv.data(),
                                                                      mv.data(), rv.data(), cols, eps});
}

//! The backward pass of layer_norm_forward, from its input x and saved mean and rstd:
//!   xhat = (x - mean) * rstd, g = dy * gamma,
//!   dx = rstd * (g - mean_row(g) - xhat * mean_row(g * xhat))  (rounded once to dx's dtype),
//!   dgamma[j] = sum_rows dy * xhat, dbeta[j] = sum_rows dy      (float [cols]).
//! dgamma and dbeta are deterministic column reductions in float (no atomics). dx may
//! be dy. Asynchronous on a cuda_executor (allocates 2 x chunks x cols floats of partial
//! sums on the stream).
template <class Policy = float32, executor Exec, tensor_like X, tensor_like DY, tensor_like G, tensor_like M,
          tensor_like R, tensor_like DX, tensor_like DG, tensor_like DB>
void layer_norm_backward(Exec const& exec, X&& x, DY&& dy, G&& gamma, M&& mean, R&& rstd, DX&& dx,
                         DG&& dgamma, DB&& dbeta) {
  detail::require_float_norm<Policy>();
  auto [xv, dyv, gv, mv, rv, dxv, dgv, dbv] = detail::views_for<Exec>(x, dy, gamma, mean, rstd, dx, dgamma, dbeta);
  detail::require_float_tensors<decltype(gv), decltype(mv), decltype(rv), decltype(dgv), decltype(dbv)>();
  static_assert(detail::all_writable<decltype(dxv), decltype(dgv), decltype(dbv)>,
                "mpx::layer_norm_backward: dx, dgamma and dbeta are outputs and cannot be const");
  constexpr std::string_view op = "layer_norm_backward";
  auto const [rows, cols] = detail::last_axis_rows(op, xv.shape());
  detail::require_same_shape(op, "x", xv.shape(), "dy", dyv.shape());
  detail::require_same_shape(op, "x", xv.shape(), "dx", dxv.shape());
  detail::require_vectors(op, xv.shape(), static_cast<std::int64_t>(cols), detail::per_column,
                          {{"gamma", gv.shape()}, {"dgamma", dgv.shape()}, {"dbeta", dbv.shape()}});
  detail::require_vectors(op, xv.shape(), static_cast<std::int64_t>(rows), detail::per_row,
                          {{"mean", mv.shape()}, {"rstd", rv.shape()}});
  detail::require_in_place_or_disjoint(op, "dx", dxv, "dy", dyv);
  detail::require_in_place_or_disjoint(op, "dx", dxv, "x", xv);
  if (cols == 0) return;
  using x_t = value_t<X>;
  using dy_t = value_t<DY>;
  detail::norm_param_terms<x_t, dy_t, true> const terms{xv.data(), dyv.data(), mv.data(), rv.data(), cols};
  detail::store_two_sums const store{dgv.data(), dbv.data()};
  // The parameter sums read dy before dx is written, so dx may be dy.
  detail::column_sums(exec, terms, store, rows, cols);
  for_each_row(exec, rows, cols,
                       detail::layer_norm_backward_row<x_t, dy_t, value_t<DX>>{
                           xv.data(), dyv.data(), gv.data(), mv.data(), rv.data(), dxv.data(), cols});
}

}  // namespace mpx

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
#include <mpx/exec/launch.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/kernels/column_reduce.hpp>
#include <mpx/kernels/row_reduce.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
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

template <class V>
constexpr void require_float_tensor(char const*) {
  static_assert(std::is_same_v<typename V::value_type, float>,
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

//! [rows, cols] of a tensor normalised over its last axis.
inline void last_axis_layout(std::string_view op, shape const& x, std::size_t& rows, std::size_t& cols) {
  if (x.rank() < 1) fail<shape_error>(op, "expects a tensor of rank 1 or more, got shape " + x.to_string());
  cols = static_cast<std::size_t>(x[x.rank() - 1]);
  rows = cols ? x.size() / cols : 0;
  // The warp kernels count columns in int steps of 32: keep the last step below 2^31.
  if (cols > 0x7FFF'FFFFu - 1024)
    fail<invalid_argument>(op, "rows of more than 2^31 - 1025 elements are not supported");
}

// ---- LayerNorm ----

inline constexpr int norm_host_lanes = 32;  // as a warp's lanes: cols / 32 + 32 roundings

template <class X, class Y>
void host_layer_norm_rows(X const* x, float const* gamma, float const* beta, Y* y, float* mean, float* rstd,
                          std::size_t rows, std::size_t cols, float eps) {
  for (std::size_t r = 0; r < rows; ++r) {
    X const* xr = x + r * cols;
    float lanes[norm_host_lanes] = {};
    for (std::size_t c = 0; c < cols; ++c) lanes[c % norm_host_lanes] += cast<float>(xr[c]);
    float s = 0.0f;
    for (float l : lanes) s += l;
    float const m = s / static_cast<float>(cols);
    float sq[norm_host_lanes] = {};
    for (std::size_t c = 0; c < cols; ++c) {
      float const d = cast<float>(xr[c]) - m;
      sq[c % norm_host_lanes] += d * d;
    }
    float q = 0.0f;
    for (float l : sq) q += l;
    float const rs = 1.0f / ::sqrtf(q / static_cast<float>(cols) + eps);
    mean[r] = m;
    rstd[r] = rs;
    for (std::size_t c = 0; c < cols; ++c)
      y[r * cols + c] = cast<Y>((cast<float>(xr[c]) - m) * rs * gamma[c] + beta[c]);
  }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma, xhat = (x - mean) * rstd
template <class X, class DY, class DX>
void host_layer_norm_backward_rows(X const* x, DY const* dy, float const* gamma, float const* mean,
                                   float const* rstd, DX* dx, std::size_t rows, std::size_t cols) {
  for (std::size_t r = 0; r < rows; ++r) {
    std::size_t const base = r * cols;
    float la[norm_host_lanes] = {}, lb[norm_host_lanes] = {};
    for (std::size_t c = 0; c < cols; ++c) {
      float const g = cast<float>(dy[base + c]) * gamma[c];
      float const xh = (cast<float>(x[base + c]) - mean[r]) * rstd[r];
      la[c % norm_host_lanes] += g;
      lb[c % norm_host_lanes] += g * xh;
    }
    float sa = 0.0f, sb = 0.0f;
    for (int l = 0; l < norm_host_lanes; ++l) {
      sa += la[l];
      sb += lb[l];
    }
    float const inv = 1.0f / static_cast<float>(cols);
    for (std::size_t c = 0; c < cols; ++c) {
      float const g = cast<float>(dy[base + c]) * gamma[c];
      float const xh = (cast<float>(x[base + c]) - mean[r]) * rstd[r];
      dx[base + c] = cast<DX>(rstd[r] * (g - sa * inv - xh * (sb * inv)));
    }
  }
}

//! Column terms of layer_norm's dgamma (dy * xhat) and dbeta (dy).
template <class X, class DY>
struct layer_norm_param_terms {
  X const* x;
  DY const* dy;
  float const* mean;
  float const* rstd;
  std::size_t cols;
  MPX_HD void operator()(std::size_t r, std::size_t j, float& a, float& b) const {
    std::size_t const i = r * cols + j;
    float const g = cast<float>(dy[i]);
    a = g * ((cast<float>(x[i]) - mean[r]) * rstd[r]);
    b = g;
  }
};

#if MPX_HAS_CUDA
inline constexpr int norm_rows_per_block = 8;  // a warp per row, 256 threads

// A warp per row; three passes over the row (sum, squared deviations, write), the later
// ones mostly from L1/L2.
template <class X, class Y>
__global__ void __launch_bounds__(norm_rows_per_block * 32)
    layer_norm_warp_kernel(X const* x, float const* __restrict__ gamma, float const* __restrict__ beta,
                           Y* y,  // y may be x
                           float* __restrict__ mean, float* __restrict__ rstd, std::size_t rows,
                           int cols, float eps) {
  std::size_t const row = static_cast<std::size_t>(blockIdx.x) * norm_rows_per_block + (threadIdx.x >> 5);
  int const lane = static_cast<int>(threadIdx.x & 31u);
  if (row >= rows) return;
  X const* xr = x + row * static_cast<std::size_t>(cols);
  Y* yr = y + row * static_cast<std::size_t>(cols);
  float s = 0.0f;
  for (int c = lane; c < cols; c += 32) s += cast<float>(xr[c]);
  s = warp_all_reduce(s, sum_float{});
  float const m = s / static_cast<float>(cols);
  float q = 0.0f;
  for (int c = lane; c < cols; c += 32) {
    float const d = cast<float>(xr[c]) - m;
    q += d * d;
  }
  q = warp_all_reduce(q, sum_float{});
  float const rs = 1.0f / ::sqrtf(q / static_cast<float>(cols) + eps);
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = rs;
  }
  for (int c = lane; c < cols; c += 32) yr[c] = cast<Y>((cast<float>(xr[c]) - m) * rs * gamma[c] + beta[c]);
}

template <class X, class DY, class DX>
__global__ void __launch_bounds__(norm_rows_per_block * 32)
    layer_norm_backward_warp_kernel(X const* __restrict__ x, DY const* dy, float const* __restrict__ gamma,
                                    float const* __restrict__ mean, float const* __restrict__ rstd, DX* dx,
                                    std::size_t rows, int cols) {
  std::size_t const row = static_cast<std::size_t>(blockIdx.x) * norm_rows_per_block + (threadIdx.x >> 5);
  int const lane = static_cast<int>(threadIdx.x & 31u);
  if (row >= rows) return;
  std::size_t const base = row * static_cast<std::size_t>(cols);
  float const m = mean[row], rs = rstd[row];
  float sa = 0.0f, sb = 0.0f;
  for (int c = lane; c < cols; c += 32) {
    float const g = cast<float>(dy[base + c]) * gamma[c];
    sa += g;
    sb += g * ((cast<float>(x[base + c]) - m) * rs);
  }
  sa = warp_all_reduce(sa, sum_float{});
  sb = warp_all_reduce(sb, sum_float{});
  float const inv = 1.0f / static_cast<float>(cols);
  // Every lane has read all of its columns of dy before writing dx: dx may be dy.
  for (int c = lane; c < cols; c += 32) {
    float const g = cast<float>(dy[base + c]) * gamma[c];
    float const xh = (cast<float>(x[base + c]) - m) * rs;
    dx[base + c] = cast<DX>(rs * (g - sa * inv - xh * (sb * inv)));
  }
}

inline unsigned norm_row_blocks(std::string_view op, std::size_t rows) {
  std::size_t const blocks = (rows + norm_rows_per_block - 1) / norm_rows_per_block;
  if (blocks > 0x7FFF'FFFFu) fail<invalid_argument>(op, "too many rows for one launch");
  return static_cast<unsigned>(blocks);
}
#endif

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
void layer_norm_forward([[maybe_unused]] Exec const& exec, X&& x, G&& gamma, B&& beta, Y&& y, M&& mean, R&& rstd,
                        float eps = 1e-5f) {
  detail::require_float_norm<Policy>();
  auto xv = mpx::view(x);
  auto gv = mpx::view(gamma);
  auto bv = mpx::view(beta);
  auto yv = mpx::view(y);
  auto mv = mpx::view(mean);
  auto rv = mpx::view(rstd);
  detail::require_access<Exec, space_t<X>, space_t<G>, space_t<B>, space_t<Y>, space_t<M>, space_t<R>>();
  detail::require_float_tensor<decltype(gv)>("gamma");
  detail::require_float_tensor<decltype(bv)>("beta");
  detail::require_float_tensor<decltype(mv)>("mean");
  detail::require_float_tensor<decltype(rv)>("rstd");
  static_assert(!std::is_const_v<typename decltype(yv)::element_type> &&
                    !std::is_const_v<typename decltype(mv)::element_type> &&
                    !std::is_const_v<typename decltype(rv)::element_type>,
                "mpx::layer_norm_forward: y, mean and rstd are outputs and cannot be const");
  constexpr std::string_view op = "layer_norm_forward";
  std::size_t rows = 0, cols = 0;
  detail::last_axis_layout(op, xv.shape(), rows, cols);
  detail::require_same_shape(op, xv.shape(), yv.shape());
  auto const c = static_cast<std::int64_t>(cols);
  auto const r = static_cast<std::int64_t>(rows);
  detail::require_extent(op, "gamma", gv.shape(), "x", xv.shape(), c, "gamma must be [cols], x's last extent");
  detail::require_extent(op, "beta", bv.shape(), "x", xv.shape(), c, "beta must be [cols], x's last extent");
  detail::require_extent(op, "mean", mv.shape(), "x", xv.shape(), r, "mean must be [rows], one per row of x");
  detail::require_extent(op, "rstd", rv.shape(), "x", xv.shape(), r, "rstd must be [rows], one per row of x");
  if (!(eps > 0.0f)) detail::fail<invalid_argument>(op, "eps must be > 0, got " + detail::to_text(eps));
  if (rows * cols == 0) return;
  if constexpr (is_host_executor_v<Exec>) {
    detail::host_layer_norm_rows(xv.data(), gv.data(), bv.data(), yv.data(), mv.data(), rv.data(), rows, cols, eps);
  } else {
#if MPX_HAS_CUDA
    detail::layer_norm_warp_kernel<<<detail::norm_row_blocks(op, rows), detail::norm_rows_per_block * 32, 0,
                                     exec.stream()>>>(xv.data(), gv.data(), bv.data(), yv.data(), mv.data(),
                                                      rv.data(), rows, static_cast<int>(cols), eps);
    MPX_CUDA_CHECK_LAUNCH("mpx::layer_norm_warp_kernel");
#else
    detail::kernels_need_nvcc<Exec>();
#endif
  }
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
void layer_norm_backward([[maybe_unused]] Exec const& exec, X&& x, DY&& dy, G&& gamma, M&& mean, R&& rstd, DX&& dx,
                         DG&& dgamma, DB&& dbeta) {
  detail::require_float_norm<Policy>();
  auto xv = mpx::view(x);
  auto dyv = mpx::view(dy);
  auto gv = mpx::view(gamma);
  auto mv = mpx::view(mean);
  auto rv = mpx::view(rstd);
  auto dxv = mpx::view(dx);
  auto dgv = mpx::view(dgamma);
  auto dbv = mpx::view(dbeta);
  detail::require_access<Exec, space_t<X>, space_t<DY>, space_t<G>, space_t<M>, space_t<R>, space_t<DX>,
                         space_t<DG>, space_t<DB>>();
  detail::require_float_tensor<decltype(gv)>("gamma");
  detail::require_float_tensor<decltype(mv)>("mean");
  detail::require_float_tensor<decltype(rv)>("rstd");
  detail::require_float_tensor<decltype(dgv)>("dgamma");
  detail::require_float_tensor<decltype(dbv)>("dbeta");
  static_assert(!std::is_const_v<typename decltype(dxv)::element_type> &&
                    !std::is_const_v<typename decltype(dgv)::element_type> &&
                    !std::is_const_v<typename decltype(dbv)::element_type>,
                "mpx::layer_norm_backward: dx, dgamma and dbeta are outputs and cannot be const");
  constexpr std::string_view op = "layer_norm_backward";
  std::size_t rows = 0, cols = 0;
  detail::last_axis_layout(op, xv.shape(), rows, cols);
  detail::require_same_shape(op, xv.shape(), dyv.shape());
  detail::require_same_shape(op, xv.shape(), dxv.shape());
  auto const c = static_cast<std::int64_t>(cols);
  auto const r = static_cast<std::int64_t>(rows);
  detail::require_extent(op, "gamma", gv.shape(), "x", xv.shape(), c, "gamma must be [cols], x's last extent");
  detail::require_extent(op, "dgamma", dgv.shape(), "x", xv.shape(), c, "dgamma must be [cols], x's last extent");
  detail::require_extent(op, "dbeta", dbv.shape(), "x", xv.shape(), c, "dbeta must be [cols], x's last extent");
  detail::require_extent(op, "mean", mv.shape(), "x", xv.shape(), r, "mean must be [rows], one per row of x");
  detail::require_extent(op, "rstd", rv.shape(), "x", xv.shape(), r, "rstd must be [rows], one per row of x");
  if (cols == 0) return;
  using x_t = value_t<X>;
  using dy_t = value_t<DY>;
  detail::layer_norm_param_terms<x_t, dy_t> const terms{xv.data(), dyv.data(), mv.data(), rv.data(), cols};
  detail::store_two_sums const store{dgv.data(), dbv.data()};
  // The parameter sums read dy before dx is written, so dx may be dy.
  if constexpr (is_host_executor_v<Exec>) {
    detail::column_sums(exec, terms, store, rows, cols);
    detail::host_layer_norm_backward_rows(xv.data(), dyv.data(), gv.data(), mv.data(), rv.data(), dxv.data(), rows,
                                          cols);
  } else {
#if MPX_HAS_CUDA
    detail::column_sums(exec, terms, store, rows, cols);
    if (rows == 0) return;
    detail::layer_norm_backward_warp_kernel<<<detail::norm_row_blocks(op, rows), detail::norm_rows_per_block * 32,
                                              0, exec.stream()>>>(xv.data(), dyv.data(), gv.data(), mv.data(),
                                                                  rv.data(), dxv.data(), rows,
                                                                  static_cast<int>(cols));
    MPX_CUDA_CHECK_LAUNCH("mpx::layer_norm_backward_warp_kernel");
#else
    detail::kernels_need_nvcc<Exec>();
#endif
  }
}

}  // namespace mpx

// Batch normalisation over [N, C] (channels last: an NHWC tensor is [N*H*W, C]) in
// training mode (batch statistics, running statistics updated) and inference mode
// (running statistics), forward and backward, on any executor. Statistics in float.
#pragma once

#include <mpx/kernels/layer_norm.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <type_traits>

// Conventions. Momentum is Keras's: running = momentum * running + (1 - momentum) *
// batch, default 0.99 (PyTorch's momentum m is Keras's 1 - m: PyTorch's 0.1 is 0.9
// here). The batch is normalised with the biased variance (divided by N), and the
// running variance is updated with the unbiased one (divided by N - 1), as PyTorch
// does; Keras updates its moving variance with the biased one. Training therefore
// needs N >= 2 rows (PyTorch refuses N == 1 too).

namespace mpx {

//! Hyper-parameters of batch normalisation; the defaults are Keras's.
struct batch_norm_options {
  float momentum = 0.99f;  //!< running = momentum * running + (1 - momentum) * batch, in [0, 1].
  float eps = 1e-3f;       //!< Added to the variance before the square root; > 0.
};

namespace detail {

template <class X>
struct column_values {  // a = x
  X const* x;
  std::size_t cols;
  MPX_HD void operator()(std::size_t r, std::size_t j, float& a, float& b) const {
    a = cast<float>(x[r * cols + j]);
    b = 0.0f;
  }
};

template <class X>
struct column_squared_deviations {  // a = (x - mean)^2
  X const* x;
  float const* mean;
  std::size_t cols;
  MPX_HD void operator()(std::size_t r, std::size_t j, float& a, float& b) const {
    float const d = cast<float>(x[r * cols + j]) - mean[j];
    a = d * d;
    b = 0.0f;
  }
};

struct store_mean {
  float* mean;
  float inv_n;
  MPX_HD void operator()(std::size_t j, float sa, float) const { mean[j] = sa * inv_n; }
};

struct finish_batch_statistics {
  float const* mean;
  float* invstd;
  float* running_mean;
  float* running_var;
  float n;
  float momentum;
  float eps;
  MPX_HD void operator()(std::size_t j, float sa, float) const {
    float const var = sa / n;
    invstd[j] = 1.0f / ::sqrtf(var + eps);
    running_mean[j] = momentum * running_mean[j] + (1.0f - momentum) * mean[j];
    running_var[j] = momentum * running_var[j] + (1.0f - momentum) * (sa / (n - 1.0f));
  }
};

// y = (x - mean) * invstd * gamma + beta; with FromVariance, invstd = 1 / sqrt(var + eps).
template <bool FromVariance, class X, class Y>
struct batch_norm_apply_element {
  X const* x;
  float const* gamma;
  float const* beta;
  float const* mean;
  float const* scale;  // invstd, or the variance with FromVariance
  Y* y;                // may be x
  std::size_t cols;
  float eps;
  MPX_HD void operator()(std::size_t i) const {
    std::size_t const j = i % cols;
    float const s = FromVariance ? 1.0f / ::sqrtf(scale[j] + eps) : scale[j];
    y[i] = cast<Y>((cast<float>(x[i]) - mean[j]) * s * gamma[j] + beta[j]);
  }
};

// dx = gamma * invstd * (dy - dbeta / N - xhat * dgamma / N)
template <class X, class DY, class DX>
struct batch_norm_backward_element {
  X const* x;
  DY const* dy;
  float const* gamma;
  float const* mean;
  float const* invstd;
  float const* dgamma;
  float const* dbeta;
  DX* dx;  // may be dy
  std::size_t cols;
  float inv_n;
  MPX_HD void operator()(std::size_t i) const {
    std::size_t const j = i % cols;
    float const xh = (cast<float>(x[i]) - mean[j]) * invstd[j];
    dx[i] = cast<DX>(gamma[j] * invstd[j] * (cast<float>(dy[i]) - dbeta[j] * inv_n - xh * (dgamma[j] * inv_n)));
  }
};

template <bool FromVariance, class Exec, class X, class Y>
void batch_norm_apply(Exec const& exec, X const* x, float const* gamma, float const* beta, float const* mean,
                      float const* scale, Y* y, std::size_t n, std::size_t cols, float eps) {
  for_each_index(exec, n, batch_norm_apply_element<FromVariance, X, Y>{x, gamma, beta, mean, scale, y, cols, eps});
}

//! Checks x, y and the per-channel float tensors; returns [rows, channels].
template <class XV, class YV>
void batch_norm_layout(std::string_view op, XV const& xv, YV const& yv, std::size_t& rows, std::size_t& cols) {
  row_shape const rs = last_axis_rows(op, xv.shape());
  rows = rs.rows;
  cols = rs.cols;
  require_same_shape(op, "x", xv.shape(), "y", yv.shape());
}

//! Each vector must be [C], one value per channel.
inline void require_channels(std::string_view op, shape const& x, std::size_t cols,
                             std::initializer_list<named_vector> vectors) {
  require_vectors(op, x, static_cast<std::int64_t>(cols), "must be [C], x's last (channel) extent", vectors);
}

//! The checks both forward passes (training and inference) make, in this order: x and
//! y as batch_norm_layout, y is x or apart from it, each per-channel vector [C], and
//! eps > 0. Returns [rows, channels] as batch_norm_layout does.
template <class XV, class YV>
void check_batch_norm_forward(std::string_view op, XV const& xv, YV const& yv,
                              std::initializer_list<named_vector> channel_vectors, float eps, std::size_t& rows,
                              std::size_t& cols) {
  batch_norm_layout(op, xv, yv, rows, cols);
  require_in_place_or_disjoint(op, "y", yv, "x", xv);
  require_channels(op, xv.shape(), cols, channel_vectors);
  if (!(eps > 0.0f)) fail<invalid_argument>(op, "eps must be > 0, got " + to_text(eps));
}

}  // namespace detail

//! Training-mode forward over x of shape [..., C] (rows = N = x.size() / C): per
//! channel, the batch mean and biased variance in float (two passes), then
//! y = (x - mean) / sqrt(var + eps) * gamma + beta rounded once to y's dtype. Writes
//! save_mean and save_invstd (1 / sqrt(var + eps)) for the backward pass and updates
//! running_mean and running_var (Keras's momentum; the unbiased variance, as PyTorch).
//! gamma, beta, running_*, save_*: float [C]. Needs N >= 2 (mpx::invalid_argument
//! otherwise). y may be x. Asynchronous on a cuda_executor (allocates partial sums).
template <class Policy = float32, executor Exec, tensor_like X, tensor_like G, tensor_like B, tensor_like Y,
          tensor_like RM, tensor_like RV, tensor_like SM, tensor_like SI>
void batch_norm_forward_training(Exec const& exec, X&& x, G&& gamma, B&& beta, Y&& y, RM&& running_mean,
                                 RV&& running_var, SM&& save_mean, SI&& save_invstd,
                                 batch_norm_options const& options = {}) {
  detail::require_float_norm<Policy>();
  auto [xv, gv, bv, yv, rmv, rvv, smv, siv] =
      detail::views_for<Exec>(x, gamma, beta, y, running_mean, running_var, save_mean, save_invstd);
  detail::require_float_tensors<decltype(gv), decltype(bv), decltype(rmv), decltype(rvv), decltype(smv),
                                decltype(siv)>();
  static_assert(detail::all_writable<decltype(yv), decltype(rmv), decltype(rvv), decltype(smv), decltype(siv)>,
                "mpx::batch_norm_forward_training: y, the running and the saved statistics are written");
  constexpr std::string_view op = "batch_norm_forward_training";
  std::size_t rows = 0, cols = 0;
  detail::check_batch_norm_forward(op, xv, yv,
                                   {{"gamma", gv.shape()}, {"beta", bv.shape()}, {"running_mean", rmv.shape()},
                                    {"running_var", rvv.shape()}, {"save_mean", smv.shape()},
                                    {"save_invstd", siv.shape()}},
                                   options.eps, rows, cols);
  if (!(options.momentum >= 0.0f && options.momentum <= 1.0f))
    detail::fail<invalid_argument>(op, "momentum must be in [0, 1], got " + detail::to_text(options.momentum));
  if (cols == 0) return;
  if (rows < 2)
    detail::fail<invalid_argument>(op, "training needs at least 2 rows per channel for the unbiased running "
                                       "variance; x has shape " + xv.shape().to_string());
  using x_t = value_t<X>;
  float const n = static_cast<float>(rows);
  detail::column_sums(exec, detail::column_values<x_t>{xv.data(), cols}, detail::store_mean{smv.data(), 1.0f / n},
                      rows, cols);
  detail::column_sums(exec, detail::column_squared_deviations<x_t>{xv.data(), smv.data(), cols},
                      detail::finish_batch_statistics{smv.data(), siv.data(), rmv.data(), rvv.data(), n,
                                                      options.momentum, options.eps},
                      rows, cols);
  detail::batch_norm_apply<false>(exec, xv.data(), gv.data(), bv.data(), smv.data(), siv.data(), yv.data(),
                                  rows * cols, cols, options.eps);
}

//! Inference-mode forward: y = (x - running_mean) / sqrt(running_var + eps) * gamma +
//! beta, in float, rounded once; nothing is updated. y may be x. Asynchronous.
template <class Policy = float32, executor Exec, tensor_like X, tensor_like G, tensor_like B, tensor_like RM,
          tensor_like RV, tensor_like Y>
void batch_norm_forward_inference(Exec const& exec, X&& x, G&& gamma, B&& beta, RM&& running_mean,
                                  RV&& running_var, Y&& y, float eps = batch_norm_options{}.eps) {
  detail::require_float_norm<Policy>();
  auto [xv, gv, bv, rmv, rvv, yv] = detail::views_for<Exec>(x, gamma, beta, running_mean, running_var, y);
  detail::require_float_tensors<decltype(gv), decltype(bv), decltype(rmv), decltype(rvv)>();
  static_assert(detail::all_writable<decltype(yv)>, "mpx::batch_norm_forward_inference: y is const");
  constexpr std::string_view op = "batch_norm_forward_inference";
  std::size_t rows = 0, cols = 0;
  detail::check_batch_norm_forward(op, xv, yv,
                                   {{"gamma", gv.shape()}, {"beta", bv.shape()}, {"running_mean", rmv.shape()},
                                    {"running_var", rvv.shape()}},
                                   eps, rows, cols);
  if (cols == 0) return;
  detail::batch_norm_apply<true>(exec, xv.data(), gv.data(), bv.data(), rmv.data(), rvv.data(), yv.data(),
                                 rows * cols, cols, eps);
}

//! Training-mode backward, from x and the saved batch statistics:
//!   xhat = (x - mean) * invstd, dbeta[j] = sum_rows dy, dgamma[j] = sum_rows dy * xhat,
//!   dx = gamma * invstd * (dy - dbeta / N - xhat * dgamma / N), rounded once to dx's dtype.
//! dgamma and dbeta (float [C]) are deterministic column reductions in float. dx may be
//! dy. Asynchronous on a cuda_executor.
template <class Policy = float32, executor Exec, tensor_like X, tensor_like DY, tensor_like G, tensor_like SM,
          tensor_like SI, tensor_like DX, tensor_like DG, tensor_like DB>
void batch_norm_backward(Exec const& exec, X&& x, DY&& dy, G&& gamma, SM&& save_mean, SI&& save_invstd, DX&& dx,
                         DG&& dgamma, DB&& dbeta) {
  detail::require_float_norm<Policy>();
  auto [xv, dyv, gv, smv, siv, dxv, dgv, dbv] =
      detail::views_for<Exec>(x, dy, gamma, save_mean, save_invstd, dx, dgamma, dbeta);
  detail::require_float_tensors<decltype(gv), decltype(smv), decltype(siv), decltype(dgv), decltype(dbv)>();
  static_assert(detail::all_writable<decltype(dxv), decltype(dgv), decltype(dbv)>,
                "mpx::batch_norm_backward: dx, dgamma and dbeta are outputs and cannot be const");
  constexpr std::string_view op = "batch_norm_backward";
  std::size_t rows = 0, cols = 0;
  detail::batch_norm_layout(op, xv, dyv, rows, cols);
  detail::require_same_shape(op, "x", xv.shape(), "dx", dxv.shape());
  detail::require_channels(op, xv.shape(), cols,
                           {{"gamma", gv.shape()}, {"save_mean", smv.shape()}, {"save_invstd", siv.shape()},
                            {"dgamma", dgv.shape()}, {"dbeta", dbv.shape()}});
  detail::require_in_place_or_disjoint(op, "dx", dxv, "dy", dyv);
  detail::require_in_place_or_disjoint(op, "dx", dxv, "x", xv);
  if (cols == 0) return;
  using x_t = value_t<X>;
  using dy_t = value_t<DY>;
  detail::column_sums(exec,
                      detail::norm_param_terms<x_t, dy_t, false>{xv.data(), dyv.data(), smv.data(), siv.data(), cols},
                      detail::store_two_sums{dgv.data(), dbv.data()}, rows, cols);
  std::size_t const n = rows * cols;
  if (n == 0) return;
  float const inv_n = 1.0f / static_cast<float>(rows);
  for_each_index(exec, n,
                         detail::batch_norm_backward_element<x_t, dy_t, value_t<DX>>{
                             xv.data(), dyv.data(), gv.data(), smv.data(), siv.data(), dgv.data(), dbv.data(),
                             dxv.data(), cols, inv_n});
}

}  // namespace mpx

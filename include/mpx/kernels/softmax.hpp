// Softmax and log-softmax over the last axis, forward and backward, on any executor.
// Always computed in float with the row maximum subtracted, whatever the storage; a
// policy that accumulates in 16 bits is refused at compile time.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/policy.hpp>
#include <mpx/core/shape.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/launch.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/kernels/row_reduce.hpp>

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

//! [rows, cols] of a tensor whose last axis is the softmax axis.
inline void softmax_layout(std::string_view op, shape const& x, std::size_t& rows, std::size_t& cols) {
  if (x.rank() < 1) fail<shape_error>(op, "expects a tensor of rank 1 or more, got shape " + x.to_string());
  cols = static_cast<std::size_t>(x[x.rank() - 1]);
  rows = cols ? x.size() / cols : 0;
  // The kernels count columns in int steps of up to a block: keep the last step below 2^31.
  if (cols > 0x7FFF'FFFFu - 1024)
    fail<invalid_argument>(op, "rows of more than 2^31 - 1025 elements are not supported");
}

// The lanes of the host path mirror a warp's: 32 strided partial sums, then their total,
// so a long row's float sum carries about cols / 32 + 32 roundings rather than cols.
inline constexpr int host_lanes = 32;

template <bool Log, class In, class Out>
void host_softmax_rows(In const* x, Out* y, std::size_t rows, std::size_t cols) {
  for (std::size_t r = 0; r < rows; ++r) {
    In const* xr = x + r * cols;
    Out* yr = y + r * cols;
    float m = max_float::identity();
    for (std::size_t c = 0; c < cols; ++c) m = max_keeping_nan(m, cast<float>(xr[c]));
    float lanes[host_lanes] = {};
    for (std::size_t c = 0; c < cols; ++c) lanes[c % host_lanes] += ::expf(cast<float>(xr[c]) - m);
    float s = 0.0f;
    for (float l : lanes) s += l;
    if constexpr (Log) {
      float const log_s = ::logf(s);
      for (std::size_t c = 0; c < cols; ++c) yr[c] = cast<Out>((cast<float>(xr[c]) - m) - log_s);
    } else {
      for (std::size_t c = 0; c < cols; ++c) yr[c] = cast<Out>(::expf(cast<float>(xr[c]) - m) / s);
    }
  }
}

// softmax:     dx = y * (dy - sum(dy * y))
// log_softmax: dx = dy - exp(y) * sum(dy)
template <bool Log, class Y, class DY, class DX>
void host_softmax_backward_rows(Y const* y, DY const* dy, DX* dx, std::size_t rows, std::size_t cols) {
  for (std::size_t r = 0; r < rows; ++r) {
    std::size_t const base = r * cols;
    float lanes[host_lanes] = {};
    for (std::size_t c = 0; c < cols; ++c) {
      float const g = cast<float>(dy[base + c]);
      lanes[c % host_lanes] += Log ? g : g * cast<float>(y[base + c]);
    }
    float dot = 0.0f;
    for (float l : lanes) dot += l;
    for (std::size_t c = 0; c < cols; ++c) {
      float const yv = cast<float>(y[base + c]);
      float const g = cast<float>(dy[base + c]);
      dx[base + c] = cast<DX>(Log ? g - ::expf(yv) * dot : yv * (g - dot));
    }
  }
}

#if MPX_HAS_CUDA
inline constexpr int softmax_warp_rows_per_block = 8;  // 256 threads, a warp per row
inline constexpr int softmax_max_warp_cols = 1024;     // up to 32 values per lane, in registers
inline constexpr int softmax_block_threads = 512;
// A row up to this long is kept in (dynamic) shared memory by the block-per-row kernel:
// 44 KiB, under the 48 KiB a block gets without opting in.
inline constexpr int softmax_max_shared_cols = 11264;

// A warp per row, the row in registers: PerLane values per lane, lane l holding columns
// l, l + 32, ... (coalesced). One read of x, one write of y.
template <int PerLane, bool Log, class In, class Out>
__global__ void __launch_bounds__(softmax_warp_rows_per_block * 32)
    softmax_warp_kernel(In const* x, Out* y, std::size_t rows, int cols) {
  std::size_t const row = static_cast<std::size_t>(blockIdx.x) * softmax_warp_rows_per_block + (threadIdx.x >> 5);
  int const lane = static_cast<int>(threadIdx.x & 31u);
  if (row >= rows) return;  // the whole warp leaves together
  In const* xr = x + row * static_cast<std::size_t>(cols);
  Out* yr = y + row * static_cast<std::size_t>(cols);
  float v[PerLane];
  float m = max_float::identity();
  MPX_UNROLL
  for (int k = 0; k < PerLane; ++k) {
    int const c = lane + 32 * k;
    v[k] = c < cols ? cast<float>(xr[c]) : max_float::identity();
    m = max_keeping_nan(m, v[k]);
  }
  m = warp_all_reduce(m, max_float{});
  float s = 0.0f;
  MPX_UNROLL
  for (int k = 0; k < PerLane; ++k) {
    if (lane + 32 * k < cols) {
      float const e = ::expf(v[k] - m);
      s += e;
      if constexpr (!Log) v[k] = e;
    }
  }
  s = warp_all_reduce(s, sum_float{});
  float const log_s = Log ? ::logf(s) : 0.0f;
  MPX_UNROLL
  for (int k = 0; k < PerLane; ++k) {
    int const c = lane + 32 * k;
    if (c < cols) yr[c] = cast<Out>(Log ? (v[k] - m) - log_s : v[k] / s);
  }
}

// A block per row for rows longer than a warp holds. Cached: the row is read once into
// shared memory (as float); otherwise it is read three times (max, sum, write), the
// later reads mostly from L2.
template <bool Log, bool Cached, class In, class Out>
__global__ void __launch_bounds__(softmax_block_threads)
    softmax_block_kernel(In const* x, Out* y, int cols) {
  extern __shared__ float row_cache[];
  __shared__ float scratch[32];
  In const* xr = x + static_cast<std::size_t>(blockIdx.x) * static_cast<std::size_t>(cols);
  Out* yr = y + static_cast<std::size_t>(blockIdx.x) * static_cast<std::size_t>(cols);
  int const step = static_cast<int>(blockDim.x);
  float m = max_float::identity();
  for (int c = static_cast<int>(threadIdx.x); c < cols; c += step) {
    float const v = cast<float>(xr[c]);
    if constexpr (Cached) row_cache[c] = v;
    m = max_keeping_nan(m, v);
  }
  m = block_all_reduce(m, max_float{}, scratch);
  // Each thread revisits only the columns it wrote: no barrier needed for row_cache.
  float s = 0.0f;
  for (int c = static_cast<int>(threadIdx.x); c < cols; c += step) {
    float const v = Cached ? row_cache[c] : cast<float>(xr[c]);
    float const e = ::expf(v - m);
    if constexpr (Cached && !Log) row_cache[c] = e;
    s += e;
  }
  s = block_all_reduce(s, sum_float{}, scratch);
  if constexpr (Log) {
    float const log_s = ::logf(s);
    for (int c = static_cast<int>(threadIdx.x); c < cols; c += step) {
      float const v = Cached ? row_cache[c] : cast<float>(xr[c]);
      yr[c] = cast<Out>((v - m) - log_s);
    }
  } else {
    for (int c = static_cast<int>(threadIdx.x); c < cols; c += step) {
      float const e = Cached ? row_cache[c] : ::expf(cast<float>(xr[c]) - m);
      yr[c] = cast<Out>(e / s);
    }
  }
}

template <int PerLane, bool Log, class Y, class DY, class DX>
__global__ void __launch_bounds__(softmax_warp_rows_per_block * 32)
    softmax_backward_warp_kernel(Y const* y, DY const* dy, DX* dx,  // dx may be y or dy
                                 std::size_t rows, int cols) {
  std::size_t const row = static_cast<std::size_t>(blockIdx.x) * softmax_warp_rows_per_block + (threadIdx.x >> 5);
  int const lane = static_cast<int>(threadIdx.x & 31u);
  if (row >= rows) return;
  std::size_t const base = row * static_cast<std::size_t>(cols);
  float yv[PerLane], g[PerLane];
  float dot = 0.0f;
  MPX_UNROLL
  for (int k = 0; k < PerLane; ++k) {
    int const c = lane + 32 * k;
    yv[k] = c < cols ? cast<float>(y[base + c]) : 0.0f;
    g[k] = c < cols ? cast<float>(dy[base + c]) : 0.0f;
    if (c < cols) dot += Log ? g[k] : g[k] * yv[k];
  }
  dot = warp_all_reduce(dot, sum_float{});
  MPX_UNROLL
  for (int k = 0; k < PerLane; ++k) {
    int const c = lane + 32 * k;
    if (c < cols) dx[base + c] = cast<DX>(Log ? g[k] - ::expf(yv[k]) * dot : yv[k] * (g[k] - dot));
  }
}

template <bool Log, class Y, class DY, class DX>
__global__ void __launch_bounds__(softmax_block_threads)
    softmax_backward_block_kernel(Y const* y, DY const* dy, DX* dx, int cols) {  // dx may be y or dy
  __shared__ float scratch[32];
  std::size_t const base = static_cast<std::size_t>(blockIdx.x) * static_cast<std::size_t>(cols);
  int const step = static_cast<int>(blockDim.x);
  float dot = 0.0f;
  for (int c = static_cast<int>(threadIdx.x); c < cols; c += step) {
    float const g = cast<float>(dy[base + c]);
    dot += Log ? g : g * cast<float>(y[base + c]);
  }
  dot = block_all_reduce(dot, sum_float{}, scratch);
  for (int c = static_cast<int>(threadIdx.x); c < cols; c += step) {
    float const yv = cast<float>(y[base + c]);
    float const g = cast<float>(dy[base + c]);
    dx[base + c] = cast<DX>(Log ? g - ::expf(yv) * dot : yv * (g - dot));
  }
}

//! Calls launch(std::integral_constant<int, PerLane>) with the smallest power of two
//! PerLane such that 32 * PerLane >= cols (cols <= 1024).
template <class F>
void with_values_per_lane(int cols, F&& launch) {
  if (cols <= 32) launch(std::integral_constant<int, 1>{});
  else if (cols <= 64) launch(std::integral_constant<int, 2>{});
  else if (cols <= 128) launch(std::integral_constant<int, 4>{});
  else if (cols <= 256) launch(std::integral_constant<int, 8>{});
  else if (cols <= 512) launch(std::integral_constant<int, 16>{});
  else launch(std::integral_constant<int, 32>{});
}

template <bool Log, class In, class Out>
void cuda_softmax_rows(cudaStream_t stream, In const* x, Out* y, std::size_t rows, int cols) {
  if (cols <= softmax_max_warp_cols) {
    std::size_t const blocks = (rows + softmax_warp_rows_per_block - 1) / softmax_warp_rows_per_block;
    if (blocks > 0x7FFF'FFFFu) fail<invalid_argument>("softmax", "too many rows for one launch");
    with_values_per_lane(cols, [&](auto per_lane) {
      softmax_warp_kernel<decltype(per_lane)::value, Log>
          <<<static_cast<unsigned>(blocks), softmax_warp_rows_per_block * 32, 0, stream>>>(x, y, rows, cols);
    });
    MPX_CUDA_CHECK_LAUNCH("mpx::softmax_warp_kernel");
  } else {
    if (rows > 0x7FFF'FFFFu) fail<invalid_argument>("softmax", "too many rows for one launch");
    auto const grid = static_cast<unsigned>(rows);
    if (cols <= softmax_max_shared_cols) {
      std::size_t const bytes = static_cast<std::size_t>(cols) * sizeof(float);
      softmax_block_kernel<Log, true><<<grid, softmax_block_threads, bytes, stream>>>(x, y, cols);
    } else {
      softmax_block_kernel<Log, false><<<grid, softmax_block_threads, 0, stream>>>(x, y, cols);
    }
    MPX_CUDA_CHECK_LAUNCH("mpx::softmax_block_kernel");
  }
}

template <bool Log, class Y, class DY, class DX>
void cuda_softmax_backward_rows(cudaStream_t stream, Y const* y, DY const* dy, DX* dx, std::size_t rows, int cols) {
  if (cols <= softmax_max_warp_cols) {
    std::size_t const blocks = (rows + softmax_warp_rows_per_block - 1) / softmax_warp_rows_per_block;
    if (blocks > 0x7FFF'FFFFu) fail<invalid_argument>("softmax_backward", "too many rows for one launch");
    with_values_per_lane(cols, [&](auto per_lane) {
      softmax_backward_warp_kernel<decltype(per_lane)::value, Log>
          <<<static_cast<unsigned>(blocks), softmax_warp_rows_per_block * 32, 0, stream>>>(y, dy, dx, rows, cols);
    });
    MPX_CUDA_CHECK_LAUNCH("mpx::softmax_backward_warp_kernel");
  } else {
    if (rows > 0x7FFF'FFFFu) fail<invalid_argument>("softmax_backward", "too many rows for one launch");
    softmax_backward_block_kernel<Log>
        <<<static_cast<unsigned>(rows), softmax_block_threads, 0, stream>>>(y, dy, dx, cols);
    MPX_CUDA_CHECK_LAUNCH("mpx::softmax_backward_block_kernel");
  }
}
#endif

template <bool Log, class Exec, class X, class Y>
void softmax_forward(std::string_view op, [[maybe_unused]] Exec const& exec, X&& x, Y&& y) {
  auto xv = mpx::view(x);
  auto yv = mpx::view(y);
  require_access<Exec, space_t<X>, space_t<Y>>();
  static_assert(!std::is_const_v<typename decltype(yv)::element_type>, "mpx::softmax: the output is const");
  std::size_t rows = 0, cols = 0;
  softmax_layout(op, xv.shape(), rows, cols);
  require_same_shape(op, xv.shape(), yv.shape());
  if (rows * cols == 0) return;
  if constexpr (is_host_executor_v<Exec>) {
    host_softmax_rows<Log>(xv.data(), yv.data(), rows, cols);
  } else {
#if MPX_HAS_CUDA
    cuda_softmax_rows<Log>(exec.stream(), xv.data(), yv.data(), rows, static_cast<int>(cols));
#else
    kernels_need_nvcc<Exec>();
#endif
  }
}

template <bool Log, class Exec, class Y, class DY, class DX>
void softmax_backward_impl(std::string_view op, [[maybe_unused]] Exec const& exec, Y&& y, DY&& dy, DX&& dx) {
  auto yv = mpx::view(y);
  auto dyv = mpx::view(dy);
  auto dxv = mpx::view(dx);
  require_access<Exec, space_t<Y>, space_t<DY>, space_t<DX>>();
  static_assert(!std::is_const_v<typename decltype(dxv)::element_type>, "mpx::softmax_backward: dx is const");
  std::size_t rows = 0, cols = 0;
  softmax_layout(op, yv.shape(), rows, cols);
  require_same_shape(op, yv.shape(), dyv.shape());
  require_same_shape(op, yv.shape(), dxv.shape());
  if (rows * cols == 0) return;
  if constexpr (is_host_executor_v<Exec>) {
    host_softmax_backward_rows<Log>(yv.data(), dyv.data(), dxv.data(), rows, cols);
  } else {
#if MPX_HAS_CUDA
    cuda_softmax_backward_rows<Log>(exec.stream(), yv.data(), dyv.data(), dxv.data(), rows, static_cast<int>(cols));
#else
    kernels_need_nvcc<Exec>();
#endif
  }
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

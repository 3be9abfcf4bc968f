// The pieces of causal multi-head self-attention that are not matrix products (those
// go through mpx::gemm): moving projections between the token-major layout a dense
// layer writes and the head-major layout batched products read, and the causal softmax
// of the attention logits with its backward pass, in float.
//
// Layouts: tokens [B*T, parts*H*dh] (a row per token; `parts` = 3 for packed Q, K, V)
// and heads [parts, B*H, T, dh] (each head's T x dh matrix contiguous).
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/math.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/launch.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/kernels/row_reduce.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

namespace mpx {

//! The sizes of one attention: batch, tokens, heads, width per head.
struct attention_dims {
  std::int64_t batch = 0, tokens = 0, heads = 0, head_width = 0;
  [[nodiscard]] std::int64_t width() const noexcept { return heads * head_width; }
  [[nodiscard]] std::int64_t rows() const noexcept { return batch * tokens; }
};

namespace detail {

//! Where element e of the heads layout [parts, B*H, T, dh] lives in the tokens layout
//! [B*T, parts*H*dh].
MPX_HD inline std::size_t token_index_of(std::size_t e, std::size_t B, std::size_t T, std::size_t H, std::size_t dh,
                                         std::size_t parts) {
  std::size_t const j = e % dh;
  std::size_t r = e / dh;
  std::size_t const t = r % T;
  r /= T;
  std::size_t const h = r % H;
  r /= H;
  std::size_t const b = r % B;
  std::size_t const p = r / B;
  return ((b * T + t) * parts + p) * (H * dh) + h * dh + j;
}

//! One row of the causal softmax: keys 0..i (and below `length`) take part; every other
//! probability is 0. A row with no key (length 0) is all zeros, never NaN. NaN and inf
//! logits propagate (an overflowed logit must be seen, not hidden).
template <class S>
MPX_HD inline void causal_softmax_row(S const* logits, float* p, std::int64_t row, std::int64_t keys,
                                      std::int64_t length) {
  std::int64_t const valid = row + 1 < length ? row + 1 : length;
  float m = max_float::identity();
  for (std::int64_t j = 0; j < valid; ++j) m = max_keeping_nan(m, cast<float>(logits[j]));
  float s = 0.0f;
  for (std::int64_t j = 0; j < valid; ++j) s += ::expf(cast<float>(logits[j]) - m);
  for (std::int64_t j = 0; j < keys; ++j) p[j] = j < valid ? ::expf(cast<float>(logits[j]) - m) / s : 0.0f;
}

#if MPX_HAS_CUDA
template <class T>
__global__ void permute_heads_kernel(T const* __restrict__ from, T* __restrict__ to, std::size_t total, std::size_t B,
                                     std::size_t T_, std::size_t H, std::size_t dh, std::size_t parts, bool to_heads) {
  for (std::size_t e = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    std::size_t const t = token_index_of(e, B, T_, H, dh, parts);
    if (to_heads) to[e] = from[t];
    else to[t] = from[e];
  }
}

// A warp per row of logits [rows, T]: row r is query (r % T) of batch-head r / T.
template <class S, class P>
__global__ void causal_softmax_kernel(S const* __restrict__ logits, float* __restrict__ p, P* __restrict__ p_store,
                                      std::size_t rows, std::int64_t T, std::int64_t heads,
                                      std::int32_t const* __restrict__ lengths) {
  int const lane = static_cast<int>(threadIdx.x & 31u);
  std::size_t const warps = static_cast<std::size_t>(gridDim.x) * (blockDim.x / 32);
  for (std::size_t r = (static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; r < rows; r += warps) {
    std::int64_t const i = static_cast<std::int64_t>(r % static_cast<std::size_t>(T));
    std::int64_t const b = static_cast<std::int64_t>(r / static_cast<std::size_t>(T)) / heads;
    std::int64_t const length = lengths ? lengths[b] : T;
    std::int64_t const valid = i + 1 < length ? i + 1 : length;
    S const* x = logits + r * static_cast<std::size_t>(T);
    float m = max_float::identity();
    for (std::int64_t j = lane; j < valid; j += 32) m = max_keeping_nan(m, cast<float>(x[j]));
    m = warp_all_reduce(m, max_float{});
    float s = 0.0f;
    for (std::int64_t j = lane; j < valid; j += 32) s += ::expf(cast<float>(x[j]) - m);
    s = warp_all_reduce(s, sum_float{});
    for (std::int64_t j = lane; j < T; j += 32) {
      float const v = j < valid ? ::expf(cast<float>(x[j]) - m) / s : 0.0f;
      p[r * static_cast<std::size_t>(T) + static_cast<std::size_t>(j)] = v;
      p_store[r * static_cast<std::size_t>(T) + static_cast<std::size_t>(j)] = cast<P>(v);
    }
  }
}

template <class G>
__global__ void causal_softmax_backward_kernel(float const* __restrict__ p, float const* __restrict__ dp,
                                               G* __restrict__ ds, std::size_t rows, std::int64_t T, float scale) {
  int const lane = static_cast<int>(threadIdx.x & 31u);
  std::size_t const warps = static_cast<std::size_t>(gridDim.x) * (blockDim.x / 32);
  for (std::size_t r = (static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; r < rows; r += warps) {
    std::size_t const at = r * static_cast<std::size_t>(T);
    float dot = 0.0f;
    for (std::int64_t j = lane; j < T; j += 32) dot += p[at + j] * dp[at + j];
    dot = warp_all_reduce(dot, sum_float{});
    for (std::int64_t j = lane; j < T; j += 32) ds[at + j] = cast<G>(scale * p[at + j] * (dp[at + j] - dot));
  }
}
#endif

}  // namespace detail

//! Copies tokens [B*T, parts*H*dh] into heads [parts*B*H, T, dh] (to_heads) or back.
template <executor Exec, class T, class Space>
void permute_heads([[maybe_unused]] Exec const& exec, tensor_view<T, Space> tokens, tensor_view<T, Space> heads,
                   attention_dims const& d, std::int64_t parts, bool to_heads) {
  std::size_t const total = static_cast<std::size_t>(parts * d.rows() * d.width());
  if (tokens.size() != total || heads.size() != total)
    detail::fail<shape_error>("permute_heads", "tokens " + tokens.shape().to_string() + " and heads " +
                                                   heads.shape().to_string() + " for " + std::to_string(parts) +
                                                   " part(s) of [" + std::to_string(d.batch) + ", " +
                                                   std::to_string(d.tokens) + ", " + std::to_string(d.width()) + "]");
  auto const B = static_cast<std::size_t>(d.batch), Tn = static_cast<std::size_t>(d.tokens),
             H = static_cast<std::size_t>(d.heads), dh = static_cast<std::size_t>(d.head_width),
             P = static_cast<std::size_t>(parts);
  if (total == 0) return;
  if constexpr (is_host_executor_v<Exec>) {
    for (std::size_t e = 0; e < total; ++e) {
      std::size_t const t = detail::token_index_of(e, B, Tn, H, dh, P);
      if (to_heads) heads.data()[e] = tokens.data()[t];
      else tokens.data()[t] = heads.data()[e];
    }
  } else {
#if MPX_HAS_CUDA
    T const* from = to_heads ? tokens.data() : heads.data();
    T* to = to_heads ? heads.data() : tokens.data();
    detail::permute_heads_kernel<<<detail::grid_for(total), detail::block_size, 0, exec.stream()>>>(
        from, to, total, B, Tn, H, dh, P, to_heads);
    MPX_CUDA_CHECK_LAUNCH("mpx::permute_heads_kernel");
#else
    detail::kernels_need_nvcc<Exec>();
#endif
  }
}

//! The causal softmax of logits [B*H, T, T] (query rows, key columns) in float: p (float,
//! kept for the backward pass) and p_store (the dtype the next product reads). Key j
//! takes part in query i's row when j <= i and j < lengths[b] (lengths: int32 [B] in the
//! executor's memory, or null for all T); other entries are 0, and a row with no key is
//! all zeros, never NaN.
template <executor Exec, class S, class P, class Space>
void causal_softmax([[maybe_unused]] Exec const& exec, tensor_view<S const, Space> logits, tensor_view<float, Space> p,
                    tensor_view<P, Space> p_store, attention_dims const& d, std::int32_t const* lengths = nullptr) {
  std::size_t const rows = static_cast<std::size_t>(d.batch * d.heads * d.tokens);
  std::size_t const total = rows * static_cast<std::size_t>(d.tokens);
  if (logits.size() != total || p.size() != total || p_store.size() != total)
    detail::fail<shape_error>("causal_softmax", "logits " + logits.shape().to_string() + ", probabilities " +
                                                    p.shape().to_string() + " and " + p_store.shape().to_string() +
                                                    " for [" + std::to_string(d.batch * d.heads) + ", " +
                                                    std::to_string(d.tokens) + ", " + std::to_string(d.tokens) + "]");
  if (total == 0) return;
  if constexpr (is_host_executor_v<Exec>) {
    for (std::size_t r = 0; r < rows; ++r) {
      auto const i = static_cast<std::int64_t>(r % static_cast<std::size_t>(d.tokens));
      auto const b = static_cast<std::int64_t>(r / static_cast<std::size_t>(d.tokens)) / d.heads;
      std::size_t const at = r * static_cast<std::size_t>(d.tokens);
      detail::causal_softmax_row(logits.data() + at, p.data() + at, i, d.tokens, lengths ? lengths[b] : d.tokens);
      for (std::int64_t j = 0; j < d.tokens; ++j) p_store.data()[at + j] = cast<P>(p.data()[at + j]);
    }
  } else {
#if MPX_HAS_CUDA
    detail::causal_softmax_kernel<<<detail::grid_for(rows * 32), detail::block_size, 0, exec.stream()>>>(
        logits.data(), p.data(), p_store.data(), rows, d.tokens, d.heads, lengths);
    MPX_CUDA_CHECK_LAUNCH("mpx::causal_softmax_kernel");
#else
    detail::kernels_need_nvcc<Exec>();
#endif
  }
}

//! The gradient of the logits from p (causal_softmax's float output) and dp = dL/dp:
//! ds = scale * p * (dp - sum_j p_j dp_j), rounded once to G (masked entries are 0).
template <executor Exec, class G, class Space>
void causal_softmax_backward([[maybe_unused]] Exec const& exec, tensor_view<float const, Space> p,
                             tensor_view<float const, Space> dp, tensor_view<G, Space> ds, attention_dims const& d,
                             float scale) {
  std::size_t const rows = static_cast<std::size_t>(d.batch * d.heads * d.tokens);
  std::size_t const total = rows * static_cast<std::size_t>(d.tokens);
  if (p.size() != total || dp.size() != total || ds.size() != total)
    detail::fail<shape_error>("causal_softmax_backward", "p " + p.shape().to_string() + ", dp " + dp.shape().to_string() +
                                                             " and ds " + ds.shape().to_string() + " differ in size");
  if (total == 0) return;
  if constexpr (is_host_executor_v<Exec>) {
    auto const T = static_cast<std::size_t>(d.tokens);
    for (std::size_t r = 0; r < rows; ++r) {
      float const* pr = p.data() + r * T;
      float const* dpr = dp.data() + r * T;
      float lanes[32] = {};
      for (std::size_t j = 0; j < T; ++j) lanes[j % 32] += pr[j] * dpr[j];
      float dot = 0.0f;
      for (float l : lanes) dot += l;
      for (std::size_t j = 0; j < T; ++j) ds.data()[r * T + j] = cast<G>(scale * pr[j] * (dpr[j] - dot));
    }
  } else {
#if MPX_HAS_CUDA
    detail::causal_softmax_backward_kernel<<<detail::grid_for(rows * 32), detail::block_size, 0, exec.stream()>>>(
        p.data(), dp.data(), ds.data(), rows, d.tokens, scale);
    MPX_CUDA_CHECK_LAUNCH("mpx::causal_softmax_backward_kernel");
#else
    detail::kernels_need_nvcc<Exec>();
#endif
  }
}

}  // namespace mpx

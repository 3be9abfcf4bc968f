// The pieces of causal multi-head self-attention that are not matrix products (those
// go through mpx::gemm): moving projections between the token-major layout a dense
// layer writes and the head-major layout batched products read, and the causal softmax
// of the attention logits with its backward pass, in float.
//
// Layouts: tokens [B*T, parts*H*dh] (a row per token; `parts` = 3 for packed Q, K, V)
// and heads [parts, B*H, T, dh] (each head's T x dh matrix contiguous).
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/elementary.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/math.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/for_each.hpp>
#include <mpx/exec/tensor.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace mpx {

//! The sizes of one attention: batch, tokens, heads, width per head.
struct attention_dims {
  std::int64_t batch = 0, tokens = 0, heads = 0, head_width = 0;
  [[nodiscard]] std::int64_t width() const noexcept { return heads * head_width; }
  [[nodiscard]] std::int64_t rows() const noexcept { return batch * tokens; }
};

namespace detail {

//! Where row r of the heads layout [parts, B*H, T, dh] (its dh elements, contiguous in
//! both layouts) starts in the tokens layout [B*T, parts*H*dh].
MPX_HD inline std::size_t token_row_start(std::size_t r, std::size_t B, std::size_t T, std::size_t H, std::size_t dh,
                                          std::size_t parts) {
  std::size_t const t = r % T;
  r /= T;
  std::size_t const h = r % H;
  r /= H;
  std::size_t const b = r % B;
  std::size_t const p = r / B;
  return ((b * T + t) * parts + p) * (H * dh) + h * dh;
}

//! Copies between the tokens and heads layouts, one row of a head's dh values at a time:
//! the index arithmetic once per row, the copy contiguous (a warp's lanes side by side
//! on the GPU; a loop the compiler vectorises on the host).
template <class T>
struct permute_heads_row {
  T const* from;
  T* to;
  std::size_t B, T_, H, dh, parts;
  bool to_heads;
  template <class Lanes>
  MPX_HD void operator()(Lanes const& lanes, std::size_t r) const {
    std::size_t const in_tokens = token_row_start(r, B, T_, H, dh, parts), in_heads = r * dh;
    T const* src = from + (to_heads ? in_tokens : in_heads);
    T* dst = to + (to_heads ? in_heads : in_tokens);
    lanes.for_each(dh, [&](std::size_t j) { dst[j] = src[j]; });
  }
};

//! One row of the causal softmax of logits [rows, T]: row r is query (r % T) of
//! batch-head r / T, and keys 0..i (and below the batch's length) take part; every
//! other probability is 0. A row with no key (length 0) is all zeros, never NaN. NaN
//! and inf logits propagate (an overflowed logit must be seen, not hidden).
template <class S, class P>
struct causal_softmax_row {
  S const* logits;
  float* p;       // kept for the backward pass
  P* p_store;     // what the next product reads
  std::int64_t T;
  std::int64_t heads;
  std::int32_t const* lengths;  // [batch], or null: every key
  template <class Lanes>
  MPX_HD void operator()(Lanes const& lanes, std::size_t r) const {
    auto const keys = static_cast<std::size_t>(T);
    auto const i = static_cast<std::int64_t>(r % keys);
    std::int64_t const b = static_cast<std::int64_t>(r / keys) / heads;
    std::int64_t const length = lengths ? lengths[b] : T;
    auto const valid = static_cast<std::size_t>(i + 1 < length ? i + 1 : (length > 0 ? length : 0));
    S const* x = logits + r * keys;
    float const m = lanes.reduce(valid, max_float{}, [&](std::size_t j) { return cast<float>(x[j]); });
    float const s = lanes.reduce(valid, sum_float{}, [&](std::size_t j) { return exp_float(cast<float>(x[j]) - m); });
    lanes.for_each(keys, [&](std::size_t j) {
      float const v = j < valid ? exp_float(cast<float>(x[j]) - m) / s : 0.0f;
      p[r * keys + j] = v;
      p_store[r * keys + j] = cast<P>(v);
    });
  }
};

//! ds = scale * p * (dp - sum_j p_j dp_j) for one row.
template <class G>
struct causal_softmax_backward_row {
  float const* p;
  float const* dp;
  G* ds;
  std::size_t T;
  float scale;
  template <class Lanes>
  MPX_HD void operator()(Lanes const& lanes, std::size_t r) const {
    std::size_t const at = r * T;
    float const dot = lanes.reduce(T, sum_float{}, [&](std::size_t j) { return p[at + j] * dp[at + j]; });
    lanes.for_each(T, [&](std::size_t j) { ds[at + j] = cast<G>(scale * p[at + j] * (dp[at + j] - dot)); });
  }
};

//! Refuses an output that overlaps an input other than element for element (the same
//! address and element size): the row kernels below read a row's inputs before writing
//! any of its outputs, so in place is safe, but an output shifted into another row's
//! inputs would overwrite them before they are read.
template <class Out, class In, class Space>
void require_rowwise_in_place_or_disjoint(std::string_view op, std::string_view out_name, tensor_view<Out, Space> out,
                                          std::string_view in_name, tensor_view<In, Space> in) {
  if (static_cast<void const*>(out.data()) == static_cast<void const*>(in.data()) && sizeof(Out) == sizeof(In)) return;
  require_disjoint(op, out_name, out, in_name, in);
}

}  // namespace detail

//! Copies tokens [B*T, parts*H*dh] into heads [parts*B*H, T, dh] (to_heads) or back.
template <executor Exec, class T, class Space>
void permute_heads(Exec const& exec, tensor_view<T, Space> tokens, tensor_view<T, Space> heads,
                   attention_dims const& d, std::int64_t parts, bool to_heads) {
  std::size_t const total = static_cast<std::size_t>(parts * d.rows() * d.width());
  if (tokens.size() != total || heads.size() != total)
    detail::fail<shape_error>("permute_heads", "tokens " + tokens.shape().to_string() + " and heads " +
                                                   heads.shape().to_string() + " for " + std::to_string(parts) +
                                                   " part(s) of [" + std::to_string(d.batch) + ", " +
                                                   std::to_string(d.tokens) + ", " + std::to_string(d.width()) + "]");
  // A permutation cannot run in place: any overlap would overwrite elements before they move.
  detail::require_disjoint("permute_heads", "tokens", tokens, "heads", heads);
  auto const B = static_cast<std::size_t>(d.batch), Tn = static_cast<std::size_t>(d.tokens),
             H = static_cast<std::size_t>(d.heads), dh = static_cast<std::size_t>(d.head_width),
             P = static_cast<std::size_t>(parts);
  if (total == 0) return;
  T const* from = to_heads ? tokens.data() : heads.data();
  T* to = to_heads ? heads.data() : tokens.data();
  for_each_row(exec, total / dh, dh, detail::permute_heads_row<T>{from, to, B, Tn, H, dh, P, to_heads});
}

//! The causal softmax of logits [B*H, T, T] (query rows, key columns) in float: p (float,
//! kept for the backward pass) and p_store (the dtype the next product reads). Key j
//! takes part in query i's row when j <= i and j < lengths[b] (lengths: int32 [B] in the
//! executor's memory, or null for all T); other entries are 0, and a row with no key is
//! all zeros, never NaN.
template <executor Exec, class S, class P, class Space>
void causal_softmax(Exec const& exec, tensor_view<S const, Space> logits, tensor_view<float, Space> p,
                    tensor_view<P, Space> p_store, attention_dims const& d, std::int32_t const* lengths = nullptr) {
  std::size_t const rows = static_cast<std::size_t>(d.batch * d.heads * d.tokens);
  std::size_t const total = rows * static_cast<std::size_t>(d.tokens);
  if (logits.size() != total || p.size() != total || p_store.size() != total)
    detail::fail<shape_error>("causal_softmax", "logits " + logits.shape().to_string() + ", probabilities " +
                                                    p.shape().to_string() + " and " + p_store.shape().to_string() +
                                                    " for [" + std::to_string(d.batch * d.heads) + ", " +
                                                    std::to_string(d.tokens) + ", " + std::to_string(d.tokens) + "]");
  detail::require_rowwise_in_place_or_disjoint("causal_softmax", "probabilities", p, "logits", logits);
  detail::require_rowwise_in_place_or_disjoint("causal_softmax", "p_store", p_store, "logits", logits);
  detail::require_rowwise_in_place_or_disjoint("causal_softmax", "p_store", p_store, "probabilities", p);
  if (total == 0) return;
  for_each_row(exec, rows, static_cast<std::size_t>(d.tokens),
                       detail::causal_softmax_row<S, P>{logits.data(), p.data(), p_store.data(), d.tokens, d.heads,
                                                        lengths});
}

//! The gradient of the logits from p (causal_softmax's float output) and dp = dL/dp:
//! ds = scale * p * (dp - sum_j p_j dp_j), rounded once to G (masked entries are 0).
template <executor Exec, class G, class Space>
void causal_softmax_backward(Exec const& exec, tensor_view<float const, Space> p,
                             tensor_view<float const, Space> dp, tensor_view<G, Space> ds, attention_dims const& d,
                             float scale) {
  std::size_t const rows = static_cast<std::size_t>(d.batch * d.heads * d.tokens);
  std::size_t const total = rows * static_cast<std::size_t>(d.tokens);
  if (p.size() != total || dp.size() != total || ds.size() != total)
    detail::fail<shape_error>("causal_softmax_backward", "p " + p.shape().to_string() + ", dp " + dp.shape().to_string() +
                                                             " and ds " + ds.shape().to_string() + " differ in size");
  detail::require_rowwise_in_place_or_disjoint("causal_softmax_backward", "ds", ds, "p", p);
  detail::require_rowwise_in_place_or_disjoint("causal_softmax_backward", "ds", ds, "dp", dp);
  if (total == 0) return;
  for_each_row(exec, rows, static_cast<std::size_t>(d.tokens),
                       detail::causal_softmax_backward_row<G>{p.data(), dp.data(), ds.data(),
                                                              static_cast<std::size_t>(d.tokens), scale});
}

}  // namespace mpx

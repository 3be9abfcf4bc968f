// The causal attention core in fp8, as cuDNN's fp8 SDPA computes it (Transformer
// Engine's fp8 dot-product attention, per-tensor scales), written once for both
// executors: the reference of the fused fp8 path, and the path itself where no fused
// one runs (the host executor always).
//
// One scale per tensor, the amax of each recorded where its values are made:
//   Q, K, V   e4m3, one scale for the three (they leave one projection together)
//   S = Q Kᵀ  float: the product of the fp8 values times both inverse scales and the
//             logit scale; softmax in float, its log-sum-exp kept per row (stats)
//   P         the probabilities (after dropout), cast to e4m3 with the scale of S
//   O = P V   e4m3, from the fp8 product times P's and V's inverse scales
//   dO        e5m2 (the caller casts it)
//   dP        dS = P (dP·mask - D) · logit scale, D = rowsum(dO·O), cast to e5m2
//   dQ dK dV  e5m2, one scale for the three
// Each pass is one thread per row of [batch * heads, tokens]: the row's products are
// sums in float over the fp8 values, so memory stays linear in the tokens, as on the
// fused path; the work is O(tokens² · head width) per head, the fused kernels' count,
// without their speed. Heads of up to fp8_attention_max_head_width values.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/elementary.hpp>
#include <mpx/exec/for_each.hpp>
#include <mpx/kernels/attention.hpp>
#include <mpx/kernels/dropout.hpp>
#include <mpx/kernels/fp8_cast.hpp>
#include <mpx/kernels/fused_attention.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>

namespace mpx {

//! The widest head the fp8 attention core takes (cuDNN's fp8 attention takes up to 256).
inline constexpr std::int64_t fp8_attention_max_head_width = 256;

//! The six per-tensor scale states of the fp8 attention core, where the executor
//! computes (each an fp8_tensor_scale's data()).
struct fp8_attention_scales {
  fp8_scale_values* qkv = nullptr;   //!< Q, K, V (e4m3)
  fp8_scale_values* s = nullptr;     //!< the probabilities P (e4m3)
  fp8_scale_values* o = nullptr;     //!< O (e4m3)
  fp8_scale_values* d_o = nullptr;   //!< dO (e5m2)
  fp8_scale_values* dp = nullptr;    //!< dS, the gradient of the logits (e5m2)
  fp8_scale_values* dqkv = nullptr;  //!< dQ, dK, dV (e5m2)
};

namespace detail {

//! Where a head's values are in the layer's token-major buffers: Q, K and V of token t
//! of sequence b at row b * tokens + t of [batch * tokens, 3 * width], O and dO at the
//! same row of [batch * tokens, width]; head h's head_width values from h * head_width.
struct fp8_attention_layout {
  std::size_t batch, tokens, heads, head_width;
  [[nodiscard]] MPX_HD std::size_t width() const noexcept { return heads * head_width; }
  //! Row r of [batch * heads, tokens]: its head-row (b * heads + h) and token.
  [[nodiscard]] MPX_HD std::size_t head_row(std::size_t r) const noexcept { return r / tokens; }
  //! The first of token t's values of head-row bh in a buffer of `parts` * width columns,
  //! part 0 (Q, O), 1 (K) or 2 (V).
  [[nodiscard]] MPX_HD std::size_t at(std::size_t bh, std::size_t t, std::size_t parts, std::size_t part) const noexcept {
    std::size_t const b = bh / heads, h = bh % heads;
    return (b * tokens + t) * parts * width() + part * width() + h * head_width;
  }
};

//! The logits S[i, j] = scale * sum of a[i, :] * b[j, :] over the fp8 values.
template <class A, class B>
MPX_HD inline float fp8_row_dot(A const* a, B const* b, std::size_t n) noexcept {
  float sum = 0.0f;
  for (std::size_t d = 0; d < n; ++d) sum += cast<float>(a[d]) * cast<float>(b[d]);
  return sum;
}

//! What the forward and backward rows share: the layout, Q K V, the softmax statistics,
//! the scales, the logit scale, and the dropout (keep_scale 0: none).
struct fp8_attention_common {
  fp8_attention_layout layout;
  float8_e4m3 const* qkv;
  float* stats;  // [batch * heads, tokens]: each row's log-sum-exp
  fp8_attention_scales scales;
  float logit_scale;
  dropout_mask_source mask;  // resolved where the row runs
  float keep_scale;          // 1 / (1 - rate) where dropping, else 0

  //! S[i, j] of head-row bh, from the fp8 Q and K.
  [[nodiscard]] MPX_HD float logit(std::size_t bh, std::size_t i, std::size_t j) const noexcept {
    float const qk = scales.qkv->inverse_scale;
    float const dot = fp8_row_dot(qkv + layout.at(bh, i, 3, 0), qkv + layout.at(bh, j, 3, 1), layout.head_width);
    return dot * qk * qk * logit_scale;
  }
  //! What weight (i, j) of head-row bh is multiplied by after the softmax: 1 without
  //! dropout, else 0 or 1 / (1 - rate) by the mask at index (bh * T + i) * T + j, as the
  //! unfused path draws it.
  [[nodiscard]] MPX_HD float kept(dropout_mask_source const& src, std::size_t bh, std::size_t i, std::size_t j) const noexcept {
    if (keep_scale == 0.0f) return 1.0f;
    std::uint64_t const e = (static_cast<std::uint64_t>(bh) * layout.tokens + i) * layout.tokens + j;
    return src.keep(src.draw(e / 4).word(e % 4)) ? keep_scale : 0.0f;
  }
};

//! Adds |x|'s bits to a running amax (a NaN lies above every number and stays).
MPX_HD inline void fold_amax(std::uint32_t& bits, float x) noexcept {
  std::uint32_t const b = magnitude_bits(x);
  bits = bits > b ? bits : b;
}

//! Forward, one row i of head-row bh: stats, then O[i] = P[i, :] V in e4m3.
struct fp8_attention_forward_row {
  fp8_attention_common c;
  float8_e4m3* o;
  MPX_HD void operator()(std::size_t r) const {
    fp8_attention_layout const& L = c.layout;
    std::size_t const bh = L.head_row(r), i = r % L.tokens, hw = L.head_width;
    dropout_mask_source const src = c.mask.resolved();
    float m = c.logit(bh, i, 0);  // every row has a key: itself and those before it
    for (std::size_t j = 1; j <= i; ++j) {
      float const s = c.logit(bh, i, j);
      m = s > m || s != s ? s : m;  // a NaN logit stays
    }
    float l = 0.0f;
    for (std::size_t j = 0; j <= i; ++j) l += exp_float(c.logit(bh, i, j) - m);
    float const lse = m + std::log(l);  // (the host's log and the GPU's may differ in the last bit)
    c.stats[r] = lse;
    float const scale_s = c.scales.s->scale;
    float acc[fp8_attention_max_head_width] = {};
    std::uint32_t amax_s = 0, amax_o = 0;
    for (std::size_t j = 0; j <= i; ++j) {
      float const p = exp_float(c.logit(bh, i, j) - lse) * c.kept(src, bh, i, j);
      fold_amax(amax_s, p);
      float const p8 = cast<float>(saturate_cast<float8_e4m3>(p * scale_s));
      float8_e4m3 const* v = c.qkv + L.at(bh, j, 3, 2);
      for (std::size_t d = 0; d < hw; ++d) acc[d] += p8 * cast<float>(v[d]);
    }
    float const descale = c.scales.s->inverse_scale * c.scales.qkv->inverse_scale, scale_o = c.scales.o->scale;
    float8_e4m3* out = o + L.at(bh, i, 1, 0);
    for (std::size_t d = 0; d < hw; ++d) {
      float const y = acc[d] * descale;
      fold_amax(amax_o, y);
      out[d] = saturate_cast<float8_e4m3>(y * scale_o);
    }
    max_into(&c.scales.s->step_amax_bits, amax_s);
    max_into(&c.scales.o->step_amax_bits, amax_o);
  }
};

//! What the backward rows add: O, dO, D and dQ dK dV.
struct fp8_attention_gradients {
  float8_e4m3 const* o;
  float8_e5m2 const* d_o;
  float* delta;  // [batch * heads, tokens]: rowsum(dO · O), dequantised
  float8_e5m2* dqkv;
};

//! Backward, first pass: D[i] = sum of dO[i, :] · O[i, :] of row r.
struct fp8_attention_delta_row {
  fp8_attention_common c;
  fp8_attention_gradients g;
  MPX_HD void operator()(std::size_t r) const {
    fp8_attention_layout const& L = c.layout;
    std::size_t const at = L.at(L.head_row(r), r % L.tokens, 1, 0);
    g.delta[r] = fp8_row_dot(g.d_o + at, g.o + at, L.head_width) * c.scales.d_o->inverse_scale *
                 c.scales.o->inverse_scale;
  }
};

//! dS[i, j] in float: P[i, j] (dP[i, j] · mask - D[i]) · logit scale, dP = dO[i] V[j]ᵀ.
MPX_HD inline float fp8_attention_ds(fp8_attention_common const& c, fp8_attention_gradients const& g, std::size_t bh,
                                     std::size_t i, std::size_t j, float p, float kept) {
  fp8_attention_layout const& L = c.layout;
  float const dp = fp8_row_dot(g.d_o + L.at(bh, i, 1, 0), c.qkv + L.at(bh, j, 3, 2), L.head_width) *
                   c.scales.d_o->inverse_scale * c.scales.qkv->inverse_scale;
  return p * (dp * kept - g.delta[bh * L.tokens + i]) * c.logit_scale;
}

//! Stores a row of dQ, dK or dV (acc times its descale) in e5m2, folding its amax.
MPX_HD inline void fp8_attention_store_gradient(float const* acc, float descale, float scale, float8_e5m2* out,
                                                std::size_t n, std::uint32_t& amax) {
  for (std::size_t d = 0; d < n; ++d) {
    float const y = acc[d] * descale;
    fold_amax(amax, y);
    out[d] = saturate_cast<float8_e5m2>(y * scale);
  }
}

//! Backward, row i: dQ[i] = dS[i, :] K, with dS in e5m2 (its amax recorded here).
struct fp8_attention_dq_row {
  fp8_attention_common c;
  fp8_attention_gradients g;
  MPX_HD void operator()(std::size_t r) const {
    fp8_attention_layout const& L = c.layout;
    std::size_t const bh = L.head_row(r), i = r % L.tokens, hw = L.head_width;
    dropout_mask_source const src = c.mask.resolved();
    float const lse = c.stats[r], scale_dp = c.scales.dp->scale;
    float acc[fp8_attention_max_head_width] = {};
    std::uint32_t amax_dp = 0, amax_dqkv = 0;
    for (std::size_t j = 0; j <= i; ++j) {
      float const p = exp_float(c.logit(bh, i, j) - lse);
      float const ds = fp8_attention_ds(c, g, bh, i, j, p, c.kept(src, bh, i, j));
      fold_amax(amax_dp, ds);
      float const ds8 = cast<float>(saturate_cast<float8_e5m2>(ds * scale_dp));
      float8_e4m3 const* k = c.qkv + L.at(bh, j, 3, 1);
      for (std::size_t d = 0; d < hw; ++d) acc[d] += ds8 * cast<float>(k[d]);
    }
    fp8_attention_store_gradient(acc, c.scales.dp->inverse_scale * c.scales.qkv->inverse_scale, c.scales.dqkv->scale,
                                 g.dqkv + L.at(bh, i, 3, 0), hw, amax_dqkv);
    max_into(&c.scales.dp->step_amax_bits, amax_dp);
    max_into(&c.scales.dqkv->step_amax_bits, amax_dqkv);
  }
};

//! Backward, row j: dK[j] = dS[:, j]ᵀ Q and dV[j] = P[:, j]ᵀ dO, P in e4m3 as the
//! forward cast it and dS in e5m2 as the dQ rows cast it.
struct fp8_attention_dkv_row {
  fp8_attention_common c;
  fp8_attention_gradients g;
  MPX_HD void operator()(std::size_t r) const {
    fp8_attention_layout const& L = c.layout;
    std::size_t const bh = L.head_row(r), j = r % L.tokens, hw = L.head_width;
    dropout_mask_source const src = c.mask.resolved();
    float const scale_s = c.scales.s->scale, scale_dp = c.scales.dp->scale;
    float dk[fp8_attention_max_head_width] = {}, dv[fp8_attention_max_head_width] = {};
    for (std::size_t i = j; i < L.tokens; ++i) {
      float const p = exp_float(c.logit(bh, i, j) - c.stats[bh * L.tokens + i]);
      float const kept = c.kept(src, bh, i, j);
      float const p8 = cast<float>(saturate_cast<float8_e4m3>(p * kept * scale_s));
      float const ds8 = cast<float>(saturate_cast<float8_e5m2>(fp8_attention_ds(c, g, bh, i, j, p, kept) * scale_dp));
      float8_e5m2 const* d_o = g.d_o + L.at(bh, i, 1, 0);
      float8_e4m3 const* q = c.qkv + L.at(bh, i, 3, 0);
      for (std::size_t d = 0; d < hw; ++d) {
        dv[d] += p8 * cast<float>(d_o[d]);
        dk[d] += ds8 * cast<float>(q[d]);
      }
    }
    std::uint32_t amax = 0;
    float const qkv_descale = c.scales.qkv->inverse_scale, scale = c.scales.dqkv->scale;
    fp8_attention_store_gradient(dk, c.scales.dp->inverse_scale * qkv_descale, scale, g.dqkv + L.at(bh, j, 3, 1), hw, amax);
    fp8_attention_store_gradient(dv, c.scales.s->inverse_scale * c.scales.d_o->inverse_scale, scale,
                                 g.dqkv + L.at(bh, j, 3, 2), hw, amax);
    max_into(&c.scales.dqkv->step_amax_bits, amax);
  }
};

//! out[i] = x[i] · the state's inverse scale, rounded to Out: an fp8 tensor dequantised.
template <class In, class Out>
struct fp8_dequantize_element {
  In const* x;
  Out* out;
  fp8_scale_values const* state;
  MPX_HD void operator()(std::size_t i) const { out[i] = cast<Out>(cast<float>(x[i]) * state->inverse_scale); }
};

//! Before a fused fp8 pass: the scales and inverses it reads, copied from the states
//! into their slots (see fused_fp8_slot), and the amax slots cleared.
struct gather_fused_fp8_scalars {
  fp8_attention_scales s;
  float* slots;
  MPX_HD void operator()() const {
    auto put = [&](fused_fp8_slot k, float v) { slots[fused_fp8_offset(k)] = v; };
    put(fused_fp8_slot::descale_qkv, s.qkv->inverse_scale);
    put(fused_fp8_slot::descale_s, s.s->inverse_scale);
    put(fused_fp8_slot::scale_s, s.s->scale);
    put(fused_fp8_slot::scale_o, s.o->scale);
    put(fused_fp8_slot::descale_o, s.o->inverse_scale);
    put(fused_fp8_slot::descale_d_o, s.d_o->inverse_scale);
    put(fused_fp8_slot::descale_dp, s.dp->inverse_scale);
    put(fused_fp8_slot::scale_dqkv, s.dqkv->scale);
    put(fused_fp8_slot::scale_dp, s.dp->scale);
    for (int k = static_cast<int>(fused_fp8_slot::amax_s); k < static_cast<int>(fused_fp8_slot::count); ++k)
      slots[4 * k] = 0.0f;
  }
};

//! After a fused fp8 pass: the amaxes it wrote folded into the step amaxes of their
//! states (dQ, dK and dV into the one of the three).
struct fold_fused_fp8_amaxes {
  fp8_attention_scales s;
  float const* slots;
  MPX_HD void operator()() const {
    auto fold = [&](fp8_scale_values* state, fused_fp8_slot k) {
      max_into(&state->step_amax_bits, magnitude_bits(slots[fused_fp8_offset(k)]));
    };
    fold(s.s, fused_fp8_slot::amax_s);
    fold(s.o, fused_fp8_slot::amax_o);
    fold(s.dqkv, fused_fp8_slot::amax_dq);
    fold(s.dqkv, fused_fp8_slot::amax_dk);
    fold(s.dqkv, fused_fp8_slot::amax_dv);
    fold(s.dp, fused_fp8_slot::amax_dp);
  }
};

}  // namespace detail

//! The core's inputs: the fp8 Q K V, the layout, the logit scale and the dropout (rate 0:
//! none; its options as the unfused path's, the count read where the rows run).
struct fp8_attention_problem {
  attention_dims dims;
  float8_e4m3 const* qkv = nullptr;  //!< [batch * tokens, 3 * width]
  float* stats = nullptr;            //!< [batch * heads, tokens]
  fp8_attention_scales scales;
  float logit_scale = 1.0f;
  dropout_options dropout{0.0f};
};

namespace detail {
inline fp8_attention_common fp8_attention_rows_of(fp8_attention_problem const& p) {
  attention_dims const& d = p.dims;
  return {{static_cast<std::size_t>(d.batch), static_cast<std::size_t>(d.tokens), static_cast<std::size_t>(d.heads),
           static_cast<std::size_t>(d.head_width)},
          p.qkv,
          p.stats,
          p.scales,
          p.logit_scale,
          make_mask_source("fp8 attention (dropout)", p.dropout),
          p.dropout.rate > 0.0f ? dropout_scale(p.dropout.rate) : 0.0f};
}
inline std::size_t fp8_attention_rows(attention_dims const& d) {
  if (d.head_width < 1 || d.head_width > fp8_attention_max_head_width)
    fail<invalid_argument>("fp8 attention", "takes heads of 1 to " + std::to_string(fp8_attention_max_head_width) +
                                                " values, got " + std::to_string(d.head_width));
  return static_cast<std::size_t>(d.batch * d.heads * d.tokens);
}
}  // namespace detail

//! O (e4m3, [batch * tokens, width]) and the softmax statistics from the fp8 Q K V,
//! recording the amaxes of P and O. Asynchronous on a cuda_executor.
template <executor Exec>
void fp8_attention_forward(Exec const& exec, fp8_attention_problem const& p, float8_e4m3* o) {
  for_each_index(exec, detail::fp8_attention_rows(p.dims), detail::fp8_attention_forward_row{detail::fp8_attention_rows_of(p), o});
}

//! dQ dK dV (e5m2, [batch * tokens, 3 * width]) from dO (e5m2), the forward's O and
//! statistics, recording the amaxes of dS and of the three gradients; `delta` is
//! scratch of [batch * heads, tokens] floats. Asynchronous on a cuda_executor.
template <executor Exec>
void fp8_attention_backward(Exec const& exec, fp8_attention_problem const& p, float8_e4m3 const* o,
                            float8_e5m2 const* d_o, float* delta, float8_e5m2* dqkv) {
  std::size_t const rows = detail::fp8_attention_rows(p.dims);
  detail::fp8_attention_common const c = detail::fp8_attention_rows_of(p);
  detail::fp8_attention_gradients const g{o, d_o, delta, dqkv};
  for_each_index(exec, rows, detail::fp8_attention_delta_row{c, g});
  for_each_index(exec, rows, detail::fp8_attention_dq_row{c, g});
  for_each_index(exec, rows, detail::fp8_attention_dkv_row{c, g});
}

//! out = x · inverse scale, for n elements (an fp8 tensor back to the storage type).
template <executor Exec, class In, class Out>
void fp8_dequantize(Exec const& exec, In const* x, fp8_scale_values const* state, Out* out, std::size_t n) {
  for_each_index(exec, n, detail::fp8_dequantize_element<In, Out>{x, out, state});
}

}  // namespace mpx

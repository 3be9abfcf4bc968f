// mpx::quantize_nvfp4: an operand cast to NVFP4, NVIDIA's 4-bit training format, in the
// layout cuBLASLt's VEC16_UE4M3 products read. Two levels of scale:
//   a tensor scale      S = 448 * 6 / amax(x), a float (its inverse, the decode factor,
//                       multiplies the product: mpx::fp8_block_gemm passes it as alpha);
//   a scale per block   of 16 values along K (or of 16x16 values), an unsigned e4m3:
//                       d = e4m3(amax(block) / 6 * S), the block's values rounded to
//                       e2m1 after multiplying by S / d.
// A dequantised value is e2m1 * d / S. Optional, as NVIDIA's recipe uses them: 16x16
// blocks (a weight then quantizes to the same values read either way), stochastic
// rounding (gradients), and a random 16-point Hadamard transform along K (the weight
// gradient's two inputs: the product is unchanged, outliers are spread over 16 values).
// Every pass is one body for both executors.
#pragma once

#include <mpx/core/block_formats.hpp>
#include <mpx/core/cast.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/philox.hpp>
#include <mpx/core/splitmix64.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/for_each.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/kernels/fp8_block_layout.hpp>
#include <mpx/kernels/fp8_block_quantize.hpp>
#include <mpx/kernels/fp8_cast.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

namespace mpx {

//! How quantize_nvfp4 groups, rounds and transforms (NVIDIA's NVFP4 recipe: 16x16
//! blocks for weights, stochastic rounding for gradients, the Hadamard transform for
//! the weight gradient's inputs; none of them by default).
struct nvfp4_quantize_options {
  //! 16x16 blocks: 16 rows of the operand by 16 values of K share one scale (each row's
  //! slot holds it). A weight quantized so holds the same values read either way.
  bool square_blocks = false;
  //! Stochastic rounding of the values, from Philox keyed by `seed` at the count
  //! `*draw` (a std::uint64_t in the executor's memory, which the caller advances
  //! between draws); null: round to nearest even.
  std::uint64_t const* draw = nullptr;
  std::uint64_t seed = 0;
  //! Each block of 16 along K becomes H diag(s) x / 4 before anything else: H the
  //! 16-point Walsh-Hadamard matrix, s signs drawn from `hadamard_seed`. Orthogonal, so
  //! a product of two operands transformed with the same signs is unchanged (in exact
  //! arithmetic). Computed with additions only: the same bits on both executors.
  bool hadamard = false;
  std::uint64_t hadamard_seed = 0x4E56'4650'3452'4854ull;
};

//! What quantize_nvfp4 writes into `tensor_scale`: [0] the largest finite |x| (after
//! the transform), [1] the decode factor 1 / S the product multiplies by.
inline constexpr std::int64_t nvfp4_tensor_scale_slots = 2;

//! The smallest block scale: a block whose scale would round to zero in e4m3 (it is
//! under 2^-10 of the tensor's largest value) gets 2^-9, e4m3's smallest, and its values
//! round to zero: a scale is never 0, inf or NaN for finite data.
inline constexpr float nvfp4_block_scale_floor = 0x1p-9f;

namespace detail {

//! S = 448 * 6 / amax, amax floored at fp8_block_amax_floor (an all-zero tensor).
MPX_HD inline float nvfp4_tensor_encode(float finite_amax) noexcept {
  float const a = finite_amax > fp8_block_amax_floor ? finite_amax : fp8_block_amax_floor;
  return 448.0f * e2m1_max / a;
}

//! A block's e4m3 scale d = e4m3(amax / 6 * S) (at least the floor), and the factor
//! S / d its values are multiplied by before rounding (at most FLT_MAX). Rounded to
//! nearest, d can be up to 1/16 below amax / 6 * S, and the block's largest value then
//! saturates at 6 (NVIDIA's recipe); `round_up` (under stochastic rounding, whose
//! average must not be clipped) takes the e4m3 at or above instead.
struct nvfp4_block_scale {
  float8_e4m3 stored;
  float encode;
};
MPX_HD inline nvfp4_block_scale nvfp4_scale_of_block(float finite_amax, float tensor_encode, bool round_up) noexcept {
  // At most 448 but for float rounding (the tensor's own largest block can come out a
  // few ulps above): 448 stays 448, never the next code, 0x7F, which is NaN.
  float const wanted = finite_amax / e2m1_max * tensor_encode;
  float8_e4m3 d = saturate_cast<float8_e4m3>(wanted);
  if (round_up && cast<float>(d) < wanted && bits(d) < 0x7Eu)
    d = from_bits<float8_e4m3>(static_cast<std::uint8_t>(bits(d) + 1u));
  if (bits(d) == 0) d = from_bits<float8_e4m3>(std::uint8_t{1});  // 2^-9
  float const e = tensor_encode / cast<float>(d);
  return {d, is_finite(e) ? e : dtype_traits<float>::max()};
}

//! The 16 signs of the Hadamard transform, bit j set: value j negated.
constexpr std::uint32_t nvfp4_hadamard_signs(std::uint64_t seed) noexcept {
  return static_cast<std::uint32_t>(splitmix64(seed)() & 0xFFFFu);
}

//! v <- H diag(signs) v / 4 in place: four butterfly stages (sums and differences) and
//! an exact division by 4.
MPX_HD inline void hadamard16(float (&v)[16], std::uint32_t signs) noexcept {
  for (int j = 0; j < 16; ++j)
    if ((signs >> j) & 1u) v[j] = -v[j];
  for (int h = 1; h < 16; h *= 2)
    for (int i = 0; i < 16; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        float const a = v[j], b = v[j + h];
        v[j] = a + b;
        v[j + h] = a - b;
      }
  for (float& x : v) x *= 0.25f;
}

//! The 16 values of row o from K index k0 (zeros past k), transformed when asked; the
//! count of NaN and inf among them (after the transform: one NaN spreads over its
//! block, and sums of huge finite values can overflow).
template <class In>
struct nvfp4_block_reader {
  block_operand_reader<In> read;
  bool hadamard;
  std::uint32_t signs;
  MPX_HD unsigned operator()(std::size_t o, std::size_t k0, float (&v)[16]) const noexcept {
    MPX_UNROLL
    for (std::size_t j = 0; j < 16; ++j) v[j] = k0 + j < read.k ? read(o, k0 + j) : 0.0f;
    if (hadamard) hadamard16(v, signs);
    unsigned nonfinite = 0;
    for (float x : v) nonfinite += is_finite(x) ? 0u : 1u;
    return nonfinite;
  }
};

//! Which rows of outer a work item covers: one row (1x16 blocks) or 16 (16x16).
struct nvfp4_rows {
  std::size_t first, end;
};

//! Work items: one per block (a row's 16 values along K) or per 16x16 tile, K blocks
//! fastest.
struct nvfp4_items {
  fp8_block_scale_layout layout;
  bool square;
  MPX_HD std::size_t row_groups() const noexcept {
    std::size_t const outer = static_cast<std::size_t>(layout.outer);
    return square ? (outer + 15) / 16 : outer;
  }
  MPX_HD std::size_t count() const noexcept { return row_groups() * static_cast<std::size_t>(layout.k_blocks()); }
  MPX_HD nvfp4_rows rows(std::size_t item) const noexcept {
    std::size_t const g = item / static_cast<std::size_t>(layout.k_blocks());
    std::size_t const outer = static_cast<std::size_t>(layout.outer);
    if (!square) return {g, g + 1};
    return {g * 16, g * 16 + 16 < outer ? g * 16 + 16 : outer};
  }
  MPX_HD std::size_t k0(std::size_t item) const noexcept {
    return item % static_cast<std::size_t>(layout.k_blocks()) * 16;
  }
};

//! Pass 1's body: a work item's largest finite |value| as a float's bits.
template <class In>
struct nvfp4_item_amax {
  nvfp4_block_reader<In> block;
  nvfp4_items items;
  MPX_HD std::uint32_t operator()(std::size_t item) const noexcept {
    nvfp4_rows const r = items.rows(item);
    std::uint32_t m = 0;
    float v[16];
    for (std::size_t o = r.first; o < r.end; ++o) {
      block(o, items.k0(item), v);
      for (float x : v) {
        std::uint32_t const b = is_finite(x) ? magnitude_bits(x) : 0u;
        m = b > m ? b : m;
      }
    }
    return m;
  }
};

//! Pass 1's combine: the tensor's amax slot, a float holding bits while folded.
struct nvfp4_fold_amax {
  float* slot;
  MPX_HD void operator()(std::uint32_t bits) const noexcept { max_bits_into(slot, bits); }
};

//! Before pass 1: the amax slot 0; every scale slot an all-zero block's scale (the
//! padding's, which no block writes).
struct nvfp4_clear {
  float* tensor_scale;
  float8_e4m3* scales;
  std::size_t count;
  MPX_HD void operator()(std::size_t i) const noexcept {
    if (i == 0) tensor_scale[0] = 0.0f;
    if (i < count) scales[i] = from_bits<float8_e4m3>(std::uint8_t{1});
  }
};

//! After pass 1: the decode factor 1 / S.
struct nvfp4_decode_factor {
  float* tensor_scale;
  MPX_HD void operator()() const noexcept { tensor_scale[1] = 1.0f / nvfp4_tensor_encode(tensor_scale[0]); }
};

//! Pass 2: a work item's scale into its rows' slots and its values, rounded (to nearest
//! even, or stochastically) and packed two to a byte. A block with a NaN or inf in x
//! gets the NaN scale (e4m3 0x7F) and zero values, so its dequantised values are NaN
//! and the product shows them (e2m1 itself has no NaN); its non-finite values are
//! counted.
template <class In>
struct nvfp4_quantize_items {
  nvfp4_block_reader<In> block;
  nvfp4_items items;
  float const* tensor_scale;
  float8_e4m3* scales;
  std::uint8_t* out;  // [outer, padded k / 2]
  unsigned* nonfinite;
  std::uint64_t const* draw;
  std::uint64_t seed;
  MPX_HD void operator()(std::size_t item) const noexcept {
    nvfp4_rows const r = items.rows(item);
    std::size_t const k0 = items.k0(item);
    float v[16];
    std::uint32_t m = 0;
    unsigned bad = 0;
    for (std::size_t o = r.first; o < r.end; ++o) {
      bad += block(o, k0, v);
      for (float x : v) {
        std::uint32_t const b = is_finite(x) ? magnitude_bits(x) : 0u;
        m = b > m ? b : m;
      }
    }
    nvfp4_block_scale const s =
        nvfp4_scale_of_block(bit_cast<float>(m), nvfp4_tensor_encode(tensor_scale[0]), draw != nullptr);
    std::size_t const pitch = static_cast<std::size_t>(items.layout.padded_k()) / 2;
    for (std::size_t o = r.first; o < r.end; ++o) {
      block(o, k0, v);
      scales[items.layout.slot(o, k0)] = bad != 0 ? dtype_traits<float8_e4m3>::quiet_nan() : s.stored;
      // Stochastic rounding: four random words per four values, drawn as they are used (16
      // words held at once spilled registers on the GPU).
      std::uint64_t const group = (o * pitch * 2 + k0) / 4;
      philox_key const key{{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)}};
      philox_counter random{};
      MPX_UNROLL
      for (std::size_t j = 0; j < 16; j += 2) {
        if (draw != nullptr && j % 4 == 0) {
          std::uint64_t const g = group + j / 4, d = *draw;
          random = philox4x32_10(philox_counter{{static_cast<std::uint32_t>(g), static_cast<std::uint32_t>(g >> 32),
                                                 static_cast<std::uint32_t>(d), static_cast<std::uint32_t>(d >> 32)}},
                                 key);
        }
        std::uint8_t lo = 0, hi = 0;
        if (bad == 0) {
          float const x0 = v[j] * s.encode, x1 = v[j + 1] * s.encode;
          lo = draw != nullptr ? e2m1_stochastic_round(x0, random.word(j % 4)) : e2m1_round(x0);
          hi = draw != nullptr ? e2m1_stochastic_round(x1, random.word(j % 4 + 1)) : e2m1_round(x1);
        }
        out[o * pitch + (k0 + j) / 2] = static_cast<std::uint8_t>(lo | hi << 4);
      }
    }
    if (bad != 0 && nonfinite != nullptr) add_to_count(nonfinite, bad);
  }
};

}  // namespace detail

//! Casts the matrix x to NVFP4 into `values`, `block_scales` and `tensor_scale`, in the
//! layout mpx::fp8_block_gemm (and cuBLASLt's VEC16_UE4M3 mode) reads.
//!
//! x is [rows, cols] of half, bfloat16 or float. With k_contiguous the operand is x
//! itself (outer = rows, K = cols), else its transpose. With layout =
//! fp8_block_scale_layout{fp8_block_kind::vec16, outer, K}: `values` must be
//! float4_e2m1x2 [outer, layout.padded_k() / 2] (K padded with zeros to a multiple of
//! 32), `block_scales` float8_e4m3 [layout.count()] (cuBLASLt's swizzled 128x4 tiles;
//! padding slots hold 2^-9), `tensor_scale` float [nvfp4_tensor_scale_slots], all in
//! the executor's memory and not overlapping.
//!
//! The tensor's amax is its largest finite |x| (after the transform, if asked), floored
//! at fp8_block_amax_floor; S = 2688 / amax. A block's scale is e4m3(amax_b / 6 * S)
//! rounded to nearest even (up, under stochastic rounding, so that no value saturates
//! and the rounding stays unbiased), at least nvfp4_block_scale_floor; its values
//! x * S / d rounded to e2m1 (nearest even, or stochastically), saturating at 6. A block holding
//! a NaN or inf (after the transform, which spreads one over its 16 values) gets the
//! NaN scale and adds its non-finite values to *nonfinite_count (when not null). Asynchronous on a cuda_executor. Shapes that do not fit are
//! mpx::shape_error, naming the tensor; overlapping outputs an mpx::invalid_argument.
template <executor Exec, tensor_like X, tensor_like Values, tensor_like Scales, tensor_like TensorScale>
void quantize_nvfp4(Exec const& exec, X&& x, bool k_contiguous, nvfp4_quantize_options const& options,
                    Values&& values, Scales&& block_scales, TensorScale&& tensor_scale,
                    unsigned* nonfinite_count = nullptr,
                    mpx::source_location loc = mpx::source_location::current()) {
  static_assert(std::is_same_v<value_t<Values>, float4_e2m1x2>,
                "mpx::quantize_nvfp4: values hold float4_e2m1x2 (two e2m1 values a byte)");
  static_assert(std::is_same_v<value_t<Scales>, float8_e4m3>,
                "mpx::quantize_nvfp4: the block scales are unsigned e4m3: float8_e4m3");
  static_assert(std::is_same_v<value_t<TensorScale>, float>, "mpx::quantize_nvfp4: the tensor scale is float");
  static_assert(!dtype8<value_t<X>>, "mpx::quantize_nvfp4: x holds half, bfloat16 or float");
  auto const [xv, vv, sv, tv] = detail::views_for<Exec>(x, values, block_scales, tensor_scale);
  fp8_block_scale_layout const layout =
      detail::checked_block_layout("quantize_nvfp4", fp8_block_kind::vec16, xv, k_contiguous, vv, 2,
                                   " pairs of e2m1 (K padded to a multiple of 32)", "block_scales", sv, loc);
  if (tv.shape() != shape{nvfp4_tensor_scale_slots})
    detail::fail<shape_error>("quantize_nvfp4",
                              "tensor_scale has shape " + tv.shape().to_string() + " but holds [" +
                                  std::to_string(nvfp4_tensor_scale_slots) + "] floats (amax, decode factor)",
                              loc);
  detail::require_disjoint("quantize_nvfp4", "tensor_scale", tv, "x", xv);
  detail::require_disjoint("quantize_nvfp4", "tensor_scale", tv, "values", vv);
  detail::require_disjoint("quantize_nvfp4", "tensor_scale", tv, "block_scales", sv);
  using In = value_t<X>;
  detail::nvfp4_block_reader<In> const block{
      {xv.data(), static_cast<std::size_t>(layout.outer), static_cast<std::size_t>(layout.k), k_contiguous},
      options.hadamard,
      detail::nvfp4_hadamard_signs(options.hadamard_seed)};
  detail::nvfp4_items const items{layout, options.square_blocks};
  std::size_t const count = static_cast<std::size_t>(layout.count());
  for_each_index(exec, count > 0 ? count : 1, detail::nvfp4_clear{tv.data(), sv.data(), count});
  for_each_index_into(exec, items.count(), detail::max_magnitude_bits{}, detail::nvfp4_item_amax<In>{block, items},
                      detail::nvfp4_fold_amax{tv.data()});
  run_once(exec, detail::nvfp4_decode_factor{tv.data()});
  for_each_index(exec, items.count(),
                 detail::nvfp4_quantize_items<In>{block, items, tv.data(), sv.data(),
                                                  reinterpret_cast<std::uint8_t*>(vv.data()), nonfinite_count,
                                                  options.draw, options.seed});
}

}  // namespace mpx

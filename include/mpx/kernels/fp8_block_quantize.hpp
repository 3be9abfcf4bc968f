// mpx::quantize_fp8_blocks: an operand cast to fp8 with one scale per block (rowwise,
// 1x128, 128x128 or MXFP8's 1x32; scaling/fp8_block_scaling.hpp), in the layout
// cuBLASLt's block-scaled products read: values [outer, K padded] with K contiguous, and
// the blocks' inverse scales (dequantised value = fp8 value * inverse scale). Each pass
// is one body for both executors: one pass for blocks along K (each block's maximum, its
// scale, its values), four for 128x128 tiles, whose maxima span rows.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/for_each.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/kernels/fp8_block_layout.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>

namespace mpx {
namespace detail {

//! *slot = max(*slot, bits) on a float slot that holds a magnitude's bits while the
//! maxima are folded: an atomic max on the GPU and on the host (exec/for_each.hpp's
//! max_into: GCC's atomics act on the slot's bytes, whatever its declared type).
MPX_HD inline void max_bits_into(float* slot, std::uint32_t bits) noexcept {
#if MPX_DEVICE_PASS
  atomicMax(reinterpret_cast<unsigned*>(slot), bits);
#else
  max_into(reinterpret_cast<unsigned*>(slot), bits);
#endif
}

//! Element (o, kk) of the operand seen as [outer, k]: x [outer, k] itself when K is
//! contiguous, else x [k, outer] read down its columns.
template <class In>
struct block_operand_reader {
  In const* x;
  std::size_t outer, k;
  bool k_contiguous;
  MPX_HD float operator()(std::size_t o, std::size_t kk) const noexcept {
    return cast<float>(k_contiguous ? x[o * k + kk] : x[kk * outer + o]);
  }
};

//! Every slot first holds the inverse scale of an all-zero block, which the padding
//! slots (that no block writes) keep.
template <class Format, class Scale>
struct fill_zero_block_scales {
  Scale* slots;
  bool power_of_two;
  MPX_HD void operator()(std::size_t i) const noexcept {
    slots[i] = block_scale_from_amax<Format, Scale>(0.0f, power_of_two).inverse;
  }
};

//! Row, 1x128 and 1x32 blocks in one pass, one index per block: its largest finite |x|,
//! its scale into its slot, its values cast, and the zeros of the K padding after the
//! last block of a row. With K contiguous an index's neighbours are the next blocks of
//! the same row (contiguous memory); transposed, the same block of the next rows (the
//! GPU's reads coalesce).
template <class Format, class In, class Scale>
struct quantize_block_runs {
  block_operand_reader<In> read;
  fp8_block_scale_layout layout;
  Scale* slots;
  Format* out;
  unsigned* nonfinite;  // may be null
  bool power_of_two;
  MPX_HD void operator()(std::size_t i) const noexcept {
    std::size_t const blocks = static_cast<std::size_t>(layout.k_blocks());
    std::size_t o, kb;
    if (read.k_contiguous) {
      o = i / blocks;
      kb = i - o * blocks;
    } else {
      kb = i / read.outer;
      o = i - kb * read.outer;
    }
    std::size_t const length = static_cast<std::size_t>(layout.block_length());
    std::size_t const k0 = kb * length, end = k0 + length;  // end <= padded k
    std::size_t const k1 = end < read.k ? end : read.k;
    std::uint32_t m = 0;
    for (std::size_t kk = k0; kk < k1; ++kk) {
      float const v = read(o, kk);
      std::uint32_t const b = is_finite(v) ? bit_cast<std::uint32_t>(v) & 0x7FFF'FFFFu : 0u;
      m = b > m ? b : m;
    }
    auto const s = block_scale_from_amax<Format, Scale>(bit_cast<float>(m), power_of_two);
    slots[layout.slot(o, k0)] = s.inverse;
    Format* const row = out + o * static_cast<std::size_t>(layout.padded_k());
    for (std::size_t kk = k0; kk < k1; ++kk) {
      float const v = read(o, kk);
      if (is_finite(v)) {
        row[kk] = saturate_cast<Format>(v * s.scale);
      } else {
        row[kk] = dtype_traits<Format>::quiet_nan();
        if (nonfinite) add_to_count(nonfinite, 1u);
      }
    }
    for (std::size_t kk = k1; kk < end; ++kk) row[kk] = Format{};
  }
};

// 128x128 tiles, whose maxima span 128 rows, in four more passes: clear the slots, fold
// each tile's largest finite |x| into its slot, scale, cast, invert.

//! Tile pass 1: each tile's slot holds 0 (the bits of +0, below every magnitude).
struct clear_slots {
  float* slots;
  MPX_HD void operator()(std::size_t i) const noexcept { slots[i] = 0.0f; }
};

//! Tile pass 2: the largest finite |x| of up to 128 rows down one column of K, as bits,
//! into its tile's slot.
template <class In>
struct fold_tile_maxima {
  block_operand_reader<In> read;
  fp8_block_scale_layout layout;
  float* slots;
  MPX_HD void operator()(std::size_t i) const noexcept {
    std::size_t const k = read.k, outer = read.outer;
    std::size_t const ob = i / k, kk = i - ob * k;
    std::size_t const o0 = ob * fp8_block_length;
    std::size_t const o1 = o0 + fp8_block_length < outer ? o0 + fp8_block_length : outer;
    std::uint32_t m = 0;
    for (std::size_t o = o0; o < o1; ++o) {
      float const v = read(o, kk);
      std::uint32_t const b = is_finite(v) ? bit_cast<std::uint32_t>(v) & 0x7FFF'FFFFu : 0u;
      m = b > m ? b : m;
    }
    max_bits_into(slots + layout.slot(o0, kk), m);
  }
};

//! Tile pass 3: each slot's maximum becomes its tile's scale.
template <class Format>
struct scales_from_maxima {
  float* slots;
  bool power_of_two;
  MPX_HD void operator()(std::size_t i) const noexcept {
    std::uint32_t bits = 0;
#if MPX_DEVICE_PASS
    bits = *reinterpret_cast<unsigned const*>(slots + i);
#else
    std::memcpy(&bits, slots + i, sizeof bits);
#endif
    slots[i] = fp8_block_scale<Format>(bit_cast<float>(bits), power_of_two);
  }
};

//! Tile pass 4: out [outer, padded k] = saturate_cast(x * its tile's scale), zeros in
//! the padding, NaN (counted) where x is NaN or inf: a block recipe never turns an
//! overflow into a finite value, so the product shows it and the step's finite check
//! sees it.
template <class Format, class In>
struct cast_tiles {
  block_operand_reader<In> read;
  fp8_block_scale_layout layout;
  float const* scales;
  Format* out;
  unsigned* nonfinite;  // may be null
  MPX_HD void operator()(std::size_t i) const noexcept {
    std::size_t const pitch = static_cast<std::size_t>(layout.padded_k());
    std::size_t const o = i / pitch, kk = i - o * pitch;
    if (kk >= read.k) {
      out[i] = Format{};
      return;
    }
    float const v = read(o, kk);
    if (!is_finite(v)) {
      out[i] = dtype_traits<Format>::quiet_nan();
      if (nonfinite) add_to_count(nonfinite, 1u);
      return;
    }
    out[i] = saturate_cast<Format>(v * scales[layout.slot(o, kk)]);
  }
};

//! Tile pass 5: each scale becomes its inverse, the factor cuBLASLt dequantises by.
struct invert_scales {
  float* slots;
  MPX_HD void operator()(std::size_t i) const noexcept { slots[i] = 1.0f / slots[i]; }
};

//! What every block quantizer checks of its operands, `op` naming it: x is a matrix, and
//! `values` holds its quantized [outer, padded K / values_per_element] (`values_unit`
//! says in what), `scales` one per block; no output overlaps x or the other. Returns
//! the blocks' layout, K running along x's rows when `k_contiguous`.
template <class XV, class VV, class SV>
fp8_block_scale_layout checked_block_layout(std::string_view op, fp8_block_kind kind, XV const& xv, bool k_contiguous,
                                            VV const& vv, std::int64_t values_per_element,
                                            std::string_view values_unit, std::string_view scales_name,
                                            SV const& sv, mpx::source_location loc) {
  if (xv.shape().rank() != 2) fail<shape_error>(op, "x must be a matrix, got shape " + xv.shape().to_string(), loc);
  std::int64_t const rows = xv.shape()[0], cols = xv.shape()[1];
  fp8_block_scale_layout const layout{kind, k_contiguous ? rows : cols, k_contiguous ? cols : rows};
  shape const want_values{layout.outer, layout.padded_k() / values_per_element};
  if (vv.shape() != want_values)
    fail<shape_error>(op,
                      "values has shape " + vv.shape().to_string() + " but x " + xv.shape().to_string() +
                          (k_contiguous ? "" : " transposed") + " quantizes to " + want_values.to_string() +
                          std::string(values_unit),
                      loc);
  if (sv.shape() != shape{layout.count()})
    fail<shape_error>(op,
                      std::string(scales_name) + " has shape " + sv.shape().to_string() + " but these blocks need [" +
                          std::to_string(layout.count()) + "]",
                      loc);
  require_disjoint(op, "values", vv, "x", xv);
  require_disjoint(op, scales_name, sv, "x", xv);
  require_disjoint(op, scales_name, sv, "values", vv);
  return layout;
}

}  // namespace detail

//! Casts the matrix x to Format with one scale per block, into `values` and
//! `inverse_scales`, in the layout mpx::fp8_block_gemm (and cuBLASLt) reads.
//!
//! x is [rows, cols] of half, bfloat16 or float. With k_contiguous the operand is x
//! itself (outer = rows, K = cols), else its transpose (outer = cols, K = rows; the
//! layout of a weight [in, out] read as B [N, K] = [out, in]). `values` must be
//! Format [outer, layout.padded_k()] (K padded with zeros to a multiple of the block
//! length, or of 16 for rowwise blocks) and `inverse_scales` [layout.count()] of float,
//! or of float8_e8m0 for vec32 blocks (MXFP8), both in the executor's memory; layout =
//! fp8_block_scale_layout{kind, outer, K}.
//!
//! Each block's scale is max(Format) / amax, amax its largest finite |x| (at least
//! fp8_block_amax_floor), rounded down to a power of two with `power_of_two_scales`; a
//! vec32 block's is always the power of two 2^-e of mx_block_exponent, under which no
//! value saturates. Values are multiplied by the scale and rounded to nearest even,
//! saturating. A NaN or inf in x becomes NaN in `values` and adds one to
//! *nonfinite_count (when not null; a counter in the executor's memory): its block's
//! scale comes from the block's finite values. Slots of the padding hold an all-zero
//! block's inverse scale.
//!
//! Row, 1x128 and 1x32 blocks are quantized in one pass over x (each block's maximum,
//! then its values, from the cache), 128x128 tiles in four. Asynchronous on a
//! cuda_executor. Shapes that do not fit are mpx::shape_error, naming the tensor; scales
//! of the wrong format and overlapping outputs an mpx::invalid_argument.
template <dtype8 Format, executor Exec, tensor_like X, tensor_like Values, tensor_like Scales>
void quantize_fp8_blocks(Exec const& exec, X&& x, bool k_contiguous, fp8_block_kind kind, bool power_of_two_scales,
                         Values&& values, Scales&& inverse_scales, unsigned* nonfinite_count = nullptr,
                         mpx::source_location loc = mpx::source_location::current()) {
  using Scale = std::remove_const_t<value_t<Scales>>;
  static_assert(std::is_same_v<value_t<Values>, Format>, "mpx::quantize_fp8_blocks: values must hold Format");
  static_assert(std::is_same_v<Scale, float> || std::is_same_v<Scale, float8_e8m0>,
                "mpx::quantize_fp8_blocks: the inverse scales are floats (float8_e8m0 for vec32 blocks)");
  static_assert(!dtype8<value_t<X>>, "mpx::quantize_fp8_blocks: x holds half, bfloat16 or float");
  auto const [xv, vv, sv] = detail::views_for<Exec>(x, values, inverse_scales);
  if (kind == fp8_block_kind::vec16)
    detail::fail<invalid_argument>("quantize_fp8_blocks",
                                   "1x16 blocks are NVFP4's (e2m1 values, two scales): quantize them with "
                                   "mpx::quantize_nvfp4",
                                   loc);
  fp8_block_scale_layout const layout =
      detail::checked_block_layout("quantize_fp8_blocks", kind, xv, k_contiguous, vv, 1, " (K padded)",
                                   "inverse_scales", sv, loc);
  if (layout.e8m0_scales() != std::is_same_v<Scale, float8_e8m0>)
    detail::fail<invalid_argument>("quantize_fp8_blocks",
                                   layout.e8m0_scales()
                                       ? "vec32 blocks (MXFP8) keep E8M0 scales: inverse_scales must hold float8_e8m0"
                                       : "these blocks keep float scales: inverse_scales must hold float",
                                   loc);
  using In = value_t<X>;
  detail::block_operand_reader<In> const read{xv.data(), static_cast<std::size_t>(layout.outer),
                                              static_cast<std::size_t>(layout.k), k_contiguous};
  if constexpr (std::is_same_v<Scale, float>) {
    if (kind == fp8_block_kind::tile128) {
      for_each_index(exec, sv.size(), detail::clear_slots{sv.data()});
      if (!vv.empty())
        for_each_index(exec, static_cast<std::size_t>(layout.outer_blocks() * layout.k),
                       detail::fold_tile_maxima<In>{read, layout, sv.data()});
      for_each_index(exec, sv.size(), detail::scales_from_maxima<Format>{sv.data(), power_of_two_scales});
      for_each_index(exec, vv.size(),
                     detail::cast_tiles<Format, In>{read, layout, sv.data(), vv.data(), nonfinite_count});
      for_each_index(exec, sv.size(), detail::invert_scales{sv.data()});
      return;
    }
  }
  for_each_index(exec, sv.size(), detail::fill_zero_block_scales<Format, Scale>{sv.data(), power_of_two_scales});
  if (vv.empty()) return;
  for_each_index(exec, static_cast<std::size_t>(layout.outer * layout.k_blocks()),
                 detail::quantize_block_runs<Format, In, Scale>{read, layout, sv.data(), vv.data(), nonfinite_count,
                                                               power_of_two_scales});
}

}  // namespace mpx

// mpx::quantize_fp8_blocks: an operand cast to fp8 with one scale per block (rowwise,
// 1x128 or 128x128; scaling/fp8_block_scaling.hpp), in the layout cuBLASLt's
// block-scaled products read: values [outer, K padded] with K contiguous, and the
// blocks' inverse scales (dequantised value = fp8 value * inverse scale). Five passes,
// each one body for both executors: clear the block maxima, fold each block's largest
// finite |x|, turn the maxima into scales, cast, invert the scales.
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
#include <type_traits>

namespace mpx {
namespace detail {

//! *slot = max(*slot, bits) on a float slot that holds a magnitude's bits while the
//! maxima are folded: an atomic max on the GPU, a plain one (through memcpy: the slot
//! is a float) on the host.
MPX_HD inline void max_bits_into(float* slot, std::uint32_t bits) noexcept {
#if MPX_DEVICE_PASS
  atomicMax(reinterpret_cast<unsigned*>(slot), bits);
#else
  std::uint32_t current = 0;
  std::memcpy(&current, slot, sizeof current);
  if (bits > current) std::memcpy(slot, &bits, sizeof bits);
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

//! Pass 1: each block's slot holds 0 (the bits of +0, below every magnitude).
struct clear_slots {
  float* slots;
  MPX_HD void operator()(std::size_t i) const noexcept { slots[i] = 0.0f; }
};

//! Pass 2: the largest finite |x| of each block, as bits, into its slot. One index per
//! segment: a run of up to 128 values along K (row: all of K) for row and vec128
//! blocks, a run of up to 128 rows down one column of K for tile128.
template <class In>
struct fold_block_maxima {
  block_operand_reader<In> read;
  fp8_block_scale_layout layout;
  float* slots;
  MPX_HD void operator()(std::size_t i) const noexcept {
    std::size_t const k = read.k, outer = read.outer;
    std::size_t o0, o1, k0, k1;
    if (layout.kind == fp8_block_kind::tile128) {
      std::size_t const ob = i / k;
      k0 = i - ob * k;
      k1 = k0 + 1;
      o0 = ob * fp8_block_length;
      o1 = o0 + fp8_block_length < outer ? o0 + fp8_block_length : outer;
    } else {
      std::size_t const blocks = static_cast<std::size_t>(layout.k_blocks());
      std::size_t const o = i / blocks, kb = i - o * blocks;
      o0 = o;
      o1 = o + 1;
      k0 = layout.kind == fp8_block_kind::row ? 0 : kb * fp8_block_length;
      k1 = layout.kind == fp8_block_kind::row || k0 + fp8_block_length > k ? k : k0 + fp8_block_length;
    }
    std::uint32_t m = 0;
    for (std::size_t o = o0; o < o1; ++o)
      for (std::size_t kk = k0; kk < k1; ++kk) {
        float const v = read(o, kk);
        std::uint32_t const b = is_finite(v) ? bit_cast<std::uint32_t>(v) & 0x7FFF'FFFFu : 0u;
        m = b > m ? b : m;
      }
    if (k0 < k1) max_bits_into(slots + layout.slot(o0, k0), m);
  }
};

//! Pass 3: each slot's maximum becomes its block's scale.
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

//! Pass 4: out [outer, padded k] = saturate_cast(x * its block's scale), zeros in the
//! padding, NaN (counted) where x is NaN or inf: a block recipe never turns an overflow
//! into a finite value, so the product shows it and the step's finite check sees it.
template <class Format, class In>
struct cast_blocks {
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

//! Pass 5: each scale becomes its inverse, the factor cuBLASLt dequantises by.
struct invert_scales {
  float* slots;
  MPX_HD void operator()(std::size_t i) const noexcept { slots[i] = 1.0f / slots[i]; }
};

}  // namespace detail

//! Casts the matrix x to Format with one scale per block, into `values` and
//! `inverse_scales`, in the layout mpx::fp8_block_gemm (and cuBLASLt) reads.
//!
//! x is [rows, cols] of half, bfloat16 or float. With k_contiguous the operand is x
//! itself (outer = rows, K = cols), else its transpose (outer = cols, K = rows; the
//! layout of a weight [in, out] read as B [N, K] = [out, in]). `values` must be
//! Format [outer, layout.padded_k()] (K padded with zeros to a multiple of 128, or 16
//! for rowwise blocks) and `inverse_scales` float [layout.count()], both in the
//! executor's memory; layout = fp8_block_scale_layout{kind, outer, K}.
//!
//! Each block's scale is max(Format) / amax, amax its largest finite |x| (at least
//! fp8_block_amax_floor), rounded down to a power of two with `power_of_two_scales`;
//! values are multiplied by it and rounded to nearest even, saturating. A NaN or inf in
//! x becomes NaN in `values` and adds one to *nonfinite_count (when not null; a counter
//! in the executor's memory): its block's scale comes from the block's finite values.
//! Asynchronous on a cuda_executor. Shapes that do not fit are mpx::shape_error, naming
//! the tensor; overlapping outputs an mpx::invalid_argument.
template <dtype8 Format, executor Exec, tensor_like X, tensor_like Values, tensor_like Scales>
void quantize_fp8_blocks(Exec const& exec, X&& x, bool k_contiguous, fp8_block_kind kind, bool power_of_two_scales,
                         Values&& values, Scales&& inverse_scales, unsigned* nonfinite_count = nullptr,
                         mpx::source_location loc = mpx::source_location::current()) {
  static_assert(std::is_same_v<value_t<Values>, Format>, "mpx::quantize_fp8_blocks: values must hold Format");
  static_assert(std::is_same_v<value_t<Scales>, float>, "mpx::quantize_fp8_blocks: the inverse scales are floats");
  static_assert(!dtype8<value_t<X>>, "mpx::quantize_fp8_blocks: x holds half, bfloat16 or float");
  detail::require_access<Exec, space_t<X>, space_t<Values>, space_t<Scales>>();
  auto const xv = mpx::view(x);
  auto const vv = mpx::view(values);
  auto const sv = mpx::view(inverse_scales);
  if (xv.shape().rank() != 2)
    detail::fail<shape_error>("quantize_fp8_blocks", "x must be a matrix, got shape " + xv.shape().to_string(), loc);
  std::int64_t const rows = xv.shape()[0], cols = xv.shape()[1];
  fp8_block_scale_layout const layout{kind, k_contiguous ? rows : cols, k_contiguous ? cols : rows};
  shape const want_values{layout.outer, layout.padded_k()};
  if (vv.shape() != want_values)
    detail::fail<shape_error>("quantize_fp8_blocks",
                              "values has shape " + vv.shape().to_string() + " but x " + xv.shape().to_string() +
                                  (k_contiguous ? "" : " transposed") + " quantizes to " + want_values.to_string() +
                                  " (K padded)",
                              loc);
  if (sv.shape() != shape{layout.count()})
    detail::fail<shape_error>("quantize_fp8_blocks",
                              "inverse_scales has shape " + sv.shape().to_string() + " but these blocks need [" +
                                  std::to_string(layout.count()) + "]",
                              loc);
  detail::require_disjoint("quantize_fp8_blocks", "values", vv, "x", xv);
  detail::require_disjoint("quantize_fp8_blocks", "inverse_scales", sv, "x", xv);
  detail::require_disjoint("quantize_fp8_blocks", "inverse_scales", sv, "values", vv);
  if (vv.empty()) {
    for_each_index(exec, sv.size(), detail::clear_slots{sv.data()});
    for_each_index(exec, sv.size(), detail::scales_from_maxima<Format>{sv.data(), power_of_two_scales});
    for_each_index(exec, sv.size(), detail::invert_scales{sv.data()});
    return;
  }
  using In = value_t<X>;
  detail::block_operand_reader<In> const read{xv.data(), static_cast<std::size_t>(layout.outer),
                                              static_cast<std::size_t>(layout.k), k_contiguous};
  std::size_t const segments = kind == fp8_block_kind::tile128
                                   ? static_cast<std::size_t>(layout.outer_blocks() * layout.k)
                                   : static_cast<std::size_t>(layout.outer * layout.k_blocks());
  for_each_index(exec, sv.size(), detail::clear_slots{sv.data()});
  for_each_index(exec, segments, detail::fold_block_maxima<In>{read, layout, sv.data()});
  for_each_index(exec, sv.size(), detail::scales_from_maxima<Format>{sv.data(), power_of_two_scales});
  for_each_index(exec, vv.size(), detail::cast_blocks<Format, In>{read, layout, sv.data(), vv.data(), nonfinite_count});
  for_each_index(exec, sv.size(), detail::invert_scales{sv.data()});
}

}  // namespace mpx

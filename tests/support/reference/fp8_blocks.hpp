// The float64-side reference of block-scaled fp8 (mpx::quantize_fp8_blocks): each
// block's amax, scale and rounding computed straight from the definition, independent of
// the kernel's passes. Shared by the kernel and layer tests.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/kernels/fp8_block_layout.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace mpx_test::reference {

//! What quantize_fp8_blocks must write, computed block by block from the definition:
//! the inverse scales as floats (the factor each slot dequantises by) and, for vec32
//! blocks, as the E8M0 bytes the slots hold.
struct expected_blocks {
  std::vector<mpx::float8_e4m3> values;
  std::vector<float> inverse_scales;
  std::vector<std::uint8_t> e8m0;
  unsigned nonfinite = 0;
};

//! The MX block exponent from its definition: the smallest e with amax <= 448 * 2^e,
//! found by stepping through powers of two in double (exact).
inline int reference_mx_exponent(double amax, double format_max = 448.0) {
  int e = std::ilogb(amax) - std::ilogb(format_max) - 2;
  while (amax > std::ldexp(format_max, e)) ++e;
  return e;
}

//! x [rows, cols] (as floats) quantized as the operand [outer, k]: the block of each
//! value by its coordinates, the scale 448 / max(finite amax, floor) in float, rounded
//! down to a power of two when asked (vec32: 2^-e, e = reference_mx_exponent), the value
//! saturate_cast(x * scale) (vec32: rounded once from the exact double product), NaN for
//! NaN or inf, zeros in the padding.
inline expected_blocks reference_quantize(std::vector<float> const& x, std::int64_t rows, std::int64_t cols,
                                   bool k_contiguous, mpx::fp8_block_kind kind, bool pow2) {
  mpx::fp8_block_scale_layout const layout{kind, k_contiguous ? rows : cols, k_contiguous ? cols : rows};
  auto const at = [&](std::int64_t o, std::int64_t kk) {
    return k_contiguous ? x[static_cast<std::size_t>(o * cols + kk)] : x[static_cast<std::size_t>(kk * cols + o)];
  };
  std::int64_t const kp = layout.padded_k();
  expected_blocks e;
  e.inverse_scales.assign(static_cast<std::size_t>(layout.count()), 0.0f);
  // Each slot's scale: from the finite values of the block it belongs to (a padding
  // slot has none, so it gets the floor's).
  std::vector<float> amax(e.inverse_scales.size(), 0.0f);
  for (std::int64_t o = 0; o < layout.outer; ++o)
    for (std::int64_t kk = 0; kk < layout.k; ++kk) {
      float const v = at(o, kk);
      auto const slot = layout.slot(static_cast<std::size_t>(o), static_cast<std::size_t>(kk));
      if (std::isfinite(v)) amax[slot] = std::max(amax[slot], std::fabs(v));
    }
  std::vector<float> scale(amax.size());
  bool const mx = kind == mpx::fp8_block_kind::vec32;
  if (mx) e.e8m0.assign(amax.size(), 0);
  for (std::size_t s = 0; s < amax.size(); ++s) {
    float const a = std::max(amax[s], 0x1p-110f);
    if (mx) {
      int const x = reference_mx_exponent(a);
      scale[s] = std::ldexp(1.0f, -x);
      e.inverse_scales[s] = std::ldexp(1.0f, x);
      e.e8m0[s] = static_cast<std::uint8_t>(x + 127);
      continue;
    }
    float sc = 448.0f / a;
    if (pow2) sc = std::ldexp(1.0f, std::ilogb(sc));
    scale[s] = sc;
    e.inverse_scales[s] = 1.0f / sc;
  }
  e.values.assign(static_cast<std::size_t>(layout.outer * kp), mpx::float8_e4m3{});
  for (std::int64_t o = 0; o < layout.outer; ++o)
    for (std::int64_t kk = 0; kk < layout.k; ++kk) {
      float const v = at(o, kk);
      auto& out = e.values[static_cast<std::size_t>(o * kp + kk)];
      if (!std::isfinite(v)) {
        out = mpx::dtype_traits<mpx::float8_e4m3>::quiet_nan();
        ++e.nonfinite;
      } else {
        float const sc = scale[layout.slot(static_cast<std::size_t>(o), static_cast<std::size_t>(kk))];
        out = mx ? mpx::saturate_cast<mpx::float8_e4m3>(static_cast<double>(v) * static_cast<double>(sc))
                 : mpx::saturate_cast<mpx::float8_e4m3>(v * sc);
      }
    }
  return e;
}

//! The operand [outer, padded k] that reference_quantize describes, dequantised as both
//! executors' products see it: each value times its block's inverse scale, a float
//! product (exact with power-of-two scales, unless a value within e4m3's rounding of
//! float's largest rounds past it: then ±inf, as in float).
inline std::vector<double> dequantised_blocks(expected_blocks const& q, mpx::fp8_block_scale_layout const& layout) {
  std::int64_t const kp = layout.padded_k();
  std::vector<double> out(q.values.size());
  for (std::int64_t o = 0; o < layout.outer; ++o)
    for (std::int64_t kk = 0; kk < kp; ++kk) {
      auto const i = static_cast<std::size_t>(o * kp + kk);
      out[i] = static_cast<double>(
          mpx::cast<float>(q.values[i]) *
          q.inverse_scales[layout.slot(static_cast<std::size_t>(o), static_cast<std::size_t>(kk))]);
    }
  return out;
}

}  // namespace mpx_test::reference

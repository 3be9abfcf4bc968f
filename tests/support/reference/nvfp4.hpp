// The float64-side reference of NVFP4 (mpx::quantize_nvfp4): the Hadamard transform as
// a matrix product in double, the tensor's and each block's amax, the two scales and
// each value's rounding computed straight from the definition, value by value,
// independent of the kernel's work items. Shared by the kernel and layer tests.
#pragma once

#include <mpx/core/block_formats.hpp>
#include <mpx/core/cast.hpp>
#include <mpx/kernels/fp8_block_layout.hpp>
#include <mpx/kernels/nvfp4_quantize.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace mpx_test::reference {

//! The e2m1 code nearest x, by search in double, ties to the even code, saturating at 6.
inline std::uint8_t nearest_e2m1_code(double x) {
  double const a = std::fabs(x);
  int best = 0;
  for (int c = 1; c < 8; ++c) {
    double const d = std::fabs(a - mpx::e2m1_to_float(static_cast<std::uint8_t>(c)));
    double const db = std::fabs(a - mpx::e2m1_to_float(static_cast<std::uint8_t>(best)));
    if (d < db || (d == db && c % 2 == 0)) best = c;
  }
  if (a >= 6.0) best = 7;
  return static_cast<std::uint8_t>((std::signbit(x) ? 8 : 0) | best);
}

//! What quantize_nvfp4 must write: one e2m1 code per value of the operand [outer,
//! padded k] (unpacked), the scale bytes in their slots, the tensor's amax and decode
//! factor, the count of non-finite values; and the transformed operand itself.
struct expected_nvfp4 {
  std::vector<std::uint8_t> codes;
  std::vector<std::uint8_t> scales;
  float amax = 0.0f;
  float decode = 0.0f;
  unsigned nonfinite = 0;
  std::vector<float> operand;  // [outer, padded k], after the transform
};

//! The transform of 16 values from its definition, H diag(signs) x / 4 with H[i][j] =
//! (-1)^popcount(i & j), in double: what the kernel's butterflies must give where the
//! float sums are exact (the kernel test checks it).
inline std::vector<double> hadamard_by_matrix(std::vector<float> const& x, std::uint32_t signs) {
  std::vector<double> y(16, 0.0);
  for (int i = 0; i < 16; ++i) {
    for (int j = 0; j < 16; ++j) {
      double const h = std::popcount(static_cast<unsigned>(i & j)) % 2 ? -1.0 : 1.0;
      double const s = (signs >> j) & 1u ? -1.0 : 1.0;
      y[static_cast<std::size_t>(i)] += h * s * x[static_cast<std::size_t>(j)];
    }
    y[static_cast<std::size_t>(i)] /= 4.0;
  }
  return y;
}

//! x [rows, cols] (as floats) quantized to NVFP4 as the operand [outer, k]: transformed
//! (each 16 along K by the kernel's float butterflies, mpx::detail::hadamard16, whose
//! sums can round: the reference must round them alike; hadamard_by_matrix checks them),
//! then S = 2688 / max(amax, 2^-110), a block's d = e4m3(amax_b / 6 * S) (at least
//! 2^-9; the e4m3 at or above under stochastic rounding, whose codes the reference
//! does not draw; NaN if the block holds a NaN or inf after the transform), its values' codes nearest to the
//! float x * (S / d). Blocks are 1x16, or 16x16 with `square`.
inline expected_nvfp4 reference_nvfp4(std::vector<float> const& x, std::int64_t rows, std::int64_t cols,
                                      bool k_contiguous, bool square, bool hadamard, std::uint32_t signs,
                                      bool stochastic = false) {
  mpx::fp8_block_scale_layout const layout{mpx::fp8_block_kind::vec16, k_contiguous ? rows : cols,
                                           k_contiguous ? cols : rows};
  std::int64_t const kp = layout.padded_k(), outer = layout.outer;
  auto const at = [&](std::int64_t o, std::int64_t kk) -> float {
    if (kk >= layout.k) return 0.0f;
    return k_contiguous ? x[static_cast<std::size_t>(o * cols + kk)] : x[static_cast<std::size_t>(kk * cols + o)];
  };
  expected_nvfp4 e;
  e.operand.assign(static_cast<std::size_t>(outer * kp), 0.0f);
  std::vector<bool> bad_block(static_cast<std::size_t>(outer * (kp / 16)), false);
  for (std::int64_t o = 0; o < outer; ++o)
    for (std::int64_t k0 = 0; k0 < kp; k0 += 16) {
      float block[16];
      for (std::int64_t i = 0; i < 16; ++i) block[i] = at(o, k0 + i);
      if (hadamard) mpx::detail::hadamard16(block, signs);
      for (std::int64_t i = 0; i < 16; ++i) {
        e.operand[static_cast<std::size_t>(o * kp + k0 + i)] = block[i];
        if (!std::isfinite(block[i])) {  // counted as quantized: after the transform
          ++e.nonfinite;
          bad_block[static_cast<std::size_t>(o * (kp / 16) + k0 / 16)] = true;
        }
      }
    }
  for (float v : e.operand)
    if (std::isfinite(v)) e.amax = std::max(e.amax, std::fabs(v));
  float const s_enc = 448.0f * 6.0f / std::max(e.amax, 0x1p-110f);
  e.decode = 1.0f / s_enc;
  e.scales.assign(static_cast<std::size_t>(layout.count()), 1u);
  e.codes.assign(e.operand.size(), 0u);
  std::int64_t const edge = square ? 16 : 1;
  for (std::int64_t o0 = 0; o0 < outer; o0 += edge)
    for (std::int64_t k0 = 0; k0 < kp; k0 += 16) {
      std::int64_t const o1 = std::min(o0 + edge, outer);
      float amax_b = 0.0f;
      bool bad = false;
      for (std::int64_t o = o0; o < o1; ++o) {
        bad = bad || bad_block[static_cast<std::size_t>(o * (kp / 16) + k0 / 16)];
        for (std::int64_t i = 0; i < 16; ++i) {
          float const v = e.operand[static_cast<std::size_t>(o * kp + k0 + i)];
          if (std::isfinite(v)) amax_b = std::max(amax_b, std::fabs(v));
        }
      }
      float const wanted = amax_b / 6.0f * s_enc;
      auto d = mpx::saturate_cast<mpx::float8_e4m3>(wanted);
      if (stochastic) {  // the e4m3 at or above: the smallest whose value is not below
        for (int b = 0; b < 0x7F; ++b) {
          auto const c = mpx::detail::from_bits<mpx::float8_e4m3>(static_cast<std::uint8_t>(b));
          if (mpx::cast<float>(c) >= wanted) {
            d = c;
            break;
          }
        }
      }
      if (mpx::bits(d) == 0) d = mpx::detail::from_bits<mpx::float8_e4m3>(std::uint8_t{1});
      float encode = s_enc / mpx::cast<float>(d);
      if (!std::isfinite(encode)) encode = std::numeric_limits<float>::max();
      for (std::int64_t o = o0; o < o1; ++o) {
        e.scales[layout.slot(static_cast<std::size_t>(o), static_cast<std::size_t>(k0))] =
            bad ? std::uint8_t{0x7F} : mpx::bits(d);
        for (std::int64_t i = 0; i < 16; ++i) {
          auto const idx = static_cast<std::size_t>(o * kp + k0 + i);
          e.codes[idx] = bad ? 0u : nearest_e2m1_code(static_cast<double>(e.operand[idx] * encode));
        }
      }
    }
  return e;
}

//! The dequantised operand [outer, padded k] in double: code * d * decode (NaN for a NaN
//! scale).
inline std::vector<double> dequantised_nvfp4(std::vector<std::uint8_t> const& codes,
                                             std::vector<std::uint8_t> const& scales, float decode,
                                             mpx::fp8_block_scale_layout const& layout) {
  std::int64_t const kp = layout.padded_k();
  std::vector<double> out(codes.size());
  for (std::int64_t o = 0; o < layout.outer; ++o)
    for (std::int64_t kk = 0; kk < kp; ++kk) {
      auto const d = mpx::detail::from_bits<mpx::float8_e4m3>(
          scales[layout.slot(static_cast<std::size_t>(o), static_cast<std::size_t>(kk))]);
      out[static_cast<std::size_t>(o * kp + kk)] = static_cast<double>(mpx::e2m1_to_float(codes[static_cast<std::size_t>(o * kp + kk)])) *
                                                   static_cast<double>(mpx::cast<float>(d)) * static_cast<double>(decode);
    }
  return out;
}

//! Unpacks NVFP4 pairs into one code per value.
inline std::vector<std::uint8_t> unpacked_codes(std::vector<mpx::float4_e2m1x2> const& pairs) {
  std::vector<std::uint8_t> out;
  out.reserve(pairs.size() * 2);
  for (auto p : pairs) {
    out.push_back(mpx::fp4x2_bits(p) & 0xFu);
    out.push_back(static_cast<std::uint8_t>(mpx::fp4x2_bits(p) >> 4));
  }
  return out;
}

}  // namespace mpx_test::reference

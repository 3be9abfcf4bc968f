// The formats of block-scaled operands that are not dtypes (no tensor computes in them):
// mpx::float8_e8m0, the power-of-two scale of MXFP8 (OCP's Microscaling formats: 8
// exponent bits, no sign, no mantissa), read with mpx::e8m0_to_float; and
// mpx::float4_e2m1x2, two 4-bit e2m1 values in a byte, NVFP4's values, read with
// mpx::e2m1_to_float. (NVFP4's block scales are unsigned e4m3: mpx::float8_e4m3.)
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/config.hpp>
#include <mpx/core/dtype.hpp>

#include <cstdint>

#include <cuda_fp4.h>
#include <cuda_fp8.h>

namespace mpx {

//! OCP's E8M0 scale (CUDA's __nv_fp8_e8m0, "float8_e8m0fnu" in PyTorch): the byte b
//! stands for 2^(b - 127), from 2^-127 (b = 0) to 2^127 (b = 254); b = 255 is NaN. No
//! sign, no zero, no infinity.
using float8_e8m0 = __nv_fp8_e8m0;

//! The pattern of an E8M0 value, and the value of a pattern.
MPX_HD constexpr std::uint8_t e8m0_bits(float8_e8m0 x) noexcept { return detail::bit_cast<std::uint8_t>(x); }
MPX_HD constexpr float8_e8m0 e8m0_from_bits(std::uint8_t b) noexcept { return detail::bit_cast<float8_e8m0>(b); }

//! The value of x exactly, as a float: 2^(b - 127) (2^-127 is a float subnormal), NaN
//! for b = 255.
MPX_HD constexpr float e8m0_to_float(float8_e8m0 x) noexcept {
  std::uint32_t const b = e8m0_bits(x);
  if (b == 255u) return detail::bit_cast<float>(0x7FC0'0000u);
  if (b == 0u) return detail::bit_cast<float>(0x0040'0000u);  // 2^-127
  return detail::bit_cast<float>(b << 23);
}

//! Two e2m1 values (CUDA's __nv_fp4x2_e2m1, cuBLASLt's CUDA_R_4F_E2M1 packed): the
//! element of even index in the low four bits, the next in the high four. Each is a
//! sign, two exponent bits and one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4 and 6, and
//! their negatives; no infinity, no NaN.
using float4_e2m1x2 = __nv_fp4x2_e2m1;

//! The byte of a pair, and the pair of a byte.
MPX_HD constexpr std::uint8_t fp4x2_bits(float4_e2m1x2 x) noexcept { return detail::bit_cast<std::uint8_t>(x); }
MPX_HD constexpr float4_e2m1x2 fp4x2_from_bits(std::uint8_t b) noexcept {
  return detail::bit_cast<float4_e2m1x2>(b);
}

//! The largest e2m1 magnitude.
inline constexpr float e2m1_max = 6.0f;

//! The value of an e2m1 code (its low four bits), exactly.
MPX_HD constexpr float e2m1_to_float(std::uint8_t code) noexcept {
  constexpr float magnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  float const m = magnitude[code & 7u];
  return (code & 8u) != 0 ? -m : m;
}

//! x rounded to the nearest e2m1 code, ties to the even code, saturating: |x| beyond 6
//! (inf included) becomes ±6, as CUDA's cvt.rn.satfinite does; NaN becomes +6, as it
//! does too (the block quantizers never round a NaN: they mark its block instead). The
//! thresholds are the midpoints between neighbours, each tie going to the even code.
MPX_HD constexpr std::uint8_t e2m1_round(float x) noexcept {
  if (!(x == x)) return 7u;
  std::uint8_t const sign = x < 0.0f || (x == 0.0f && detail::bit_cast<std::uint32_t>(x) != 0u) ? 8u : 0u;
  float const a = x < 0.0f ? -x : x;
  std::uint8_t const m = a <= 0.25f ? 0u
                         : a < 0.75f ? 1u
                         : a <= 1.25f ? 2u
                         : a < 1.75f ? 3u
                         : a <= 2.5f ? 4u
                         : a < 3.5f ? 5u
                         : a <= 5.0f ? 6u
                                     : 7u;
  return static_cast<std::uint8_t>(sign | m);
}

//! x rounded to e2m1 stochastically: to the neighbour further from zero with
//! probability equal to its distance to the nearer-to-zero neighbour over the gap, so
//! that the rounding is unbiased on average; `random` is 32 uniform bits, of which the
//! top 24 make u = (k + 1/2) / 2^24, centred in its step so that the probability is p
//! to within 2^-25 either way. |x| of 6 and beyond (inf included) becomes ±6; NaN +6.
MPX_HD constexpr std::uint8_t e2m1_stochastic_round(float x, std::uint32_t random) noexcept {
  if (!(x == x)) return 7u;
  std::uint8_t const sign = x < 0.0f || (x == 0.0f && detail::bit_cast<std::uint32_t>(x) != 0u) ? 8u : 0u;
  float const a = x < 0.0f ? -x : x;
  if (a >= e2m1_max) return static_cast<std::uint8_t>(sign | 7u);
  std::uint8_t const low = a < 0.5f ? 0u : a < 1.0f ? 1u : a < 1.5f ? 2u : a < 2.0f ? 3u : a < 3.0f ? 4u : a < 4.0f ? 5u : 6u;
  float const lo = e2m1_to_float(low), hi = e2m1_to_float(static_cast<std::uint8_t>(low + 1u));
  float const p_up = (a - lo) / (hi - lo);  // exact: the gaps are powers of two
  float const u = (static_cast<float>(random >> 8) + 0.5f) * 0x1p-24f;  // exact: 25 bits
  return static_cast<std::uint8_t>(sign | (u < p_up ? low + 1u : low));
}

namespace detail {

//! The MX block exponent of a block whose largest magnitude is `amax` (a positive normal
//! float): the smallest e with amax <= max(Format) * 2^e, so that every value of the
//! block divided by 2^e lies within Format and nothing saturates. Found from the fields
//! alone, exactly: with amax = a * 2^E and max(Format) = m * 2^M (a, m in [1, 2)),
//! e = E - M, plus one when a > m. (NVIDIA's MXFP8 recipe rounds amax / max(Format) up to
//! a power of two, which is the same e; OCP's specification rounds down and saturates.)
template <class Format>
MPX_HD constexpr int mx_block_exponent(float amax) noexcept {
  constexpr std::uint32_t max_bits = bit_cast<std::uint32_t>(widen_to_float(dtype_traits<Format>::max()));
  std::uint32_t const a = bit_cast<std::uint32_t>(amax) & 0x7FFF'FFFFu;
  int const e = static_cast<int>(a >> 23) - static_cast<int>(max_bits >> 23);
  return e + ((a & 0x7F'FFFFu) > (max_bits & 0x7F'FFFFu) ? 1 : 0);
}

}  // namespace detail
}  // namespace mpx

// e^x and erfc(x) in float, written once in branch-free arithmetic for every executor:
// the activations, softmax and the losses call these, not libm's expf and erfcf.
#pragma once

#include <mpx/core/config.hpp>
#include <mpx/core/dtype.hpp>

#include <cmath>
#include <cstdint>

// Why not libm: the host's expf and erfcf are scalar calls that a loop cannot vectorise
// (a third of char_lm's host step went to them), and they are other formulas than the
// GPU's. These are selects, multiplies and adds, so the compiler vectorises a loop
// around them, and every executor evaluates the same formulas (the last bits can still
// differ where one compiler fuses a multiply and an add and another does not: nvcc
// always may, g++ where the target has FMA).
//
// Accuracy against float64 (the tests sweep every 4099th float; an exhaustive sweep of
// the ranges found no more): exp_float within 1.2 ulp, exp_neg_half_square within 1.3,
// erfc_float within 8 ulp (7.8 at x = 0.032 without FMA; relative, also down its tail
// to 1e-38), beside CUDA's expf (2 ulp) and erfcf (4 ulp). NaN gives NaN; e^x overflows
// to inf and underflows through the subnormals to 0 as expf does.

// One exception: a host build for plain x86-64 (SSE2, no AVX2, the compiler's default
// target) vectorises these 4 lanes wide without FMA, which is slower than libm's scalar
// expf and erfcf; there exp_float(x) and erfc_float(x) are libm's (also within 2 ulp).
#if !MPX_DEVICE_PASS && defined(__x86_64__) && !defined(__AVX2__)
#define MPX_ELEMENTARY_FROM_LIBM 1
#else
#define MPX_ELEMENTARY_FROM_LIBM 0
#endif

namespace mpx {

//! e^(hi + lo), where lo carries bits of the argument that float cannot hold beside hi
//! (the low part of -x^2, a fit's correction).
MPX_HD inline float exp_float(float hi, float lo) noexcept {
  constexpr float log2e = 1.44269504088896341f;
  constexpr float ln2_hi = 0.693145751953125f;         // 15 bits: n * ln2_hi is exact
  constexpr float ln2_lo = 1.42860682030941723e-06f;   // ln 2 - ln2_hi
  constexpr float round_magic = 12582912.0f;           // 1.5 * 2^23: adding it rounds to an integer
  // Past these bounds e^x is inf or 0 in float; clamping keeps 2^n in range, and the
  // result is chosen at the end. NaN stays NaN (every comparison is false).
  float const v = hi + lo;
  float const vc = v > 88.8f ? 88.8f : (v < -104.0f ? -104.0f : v);
  float const n = (vc * log2e + round_magic) - round_magic;  // in [-150, 128]
  float const r = (hi - n * ln2_hi) - n * ln2_lo + lo;        // |r| <= ln2 / 2, about
  // e^r by its Taylor series to r^7 (the remainder is below 0.05 ulp for |r| <= ln2 / 2).
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // 2^n as two normal powers of two, so a subnormal result is rounded once, at the end.
  std::int32_t const k = n == n ? static_cast<std::int32_t>(n) : 0;
  std::int32_t const k1 = k / 2;
  std::int32_t const k2 = k - k1;
  float const s1 = detail::bit_cast<float>(static_cast<std::uint32_t>(k1 + 127) << 23);
  float const s2 = detail::bit_cast<float>(static_cast<std::uint32_t>(k2 + 127) << 23);
  float const e = (p * s1) * s2;
  return v > 88.8f ? detail::bit_cast<float>(0x7F80'0000u) : (v < -104.0f ? 0.0f : e);
}

//! e^x.
MPX_HD inline float exp_float(float x) noexcept {
#if MPX_ELEMENTARY_FROM_LIBM
  return ::expf(x);
#else
  return exp_float(x, 0.0f);
#endif
}

//! erfc(x) = 1 - erf(x), with its relative accuracy kept in the tail (erfc(9) = 4.1e-37,
//! where 1 - erf(x) would be 0). A Chebyshev fit of erfc(z) e^(z^2) in t = 1 / (1 + z/2)
//! (Press et al., Numerical Recipes, 2nd ed., section 6.2: relative error below 1.2e-7
//! for every z >= 0), with e^(-z^2) taken from z^2 split exactly into two floats.
MPX_HD inline float erfc_float(float x) noexcept {
#if MPX_ELEMENTARY_FROM_LIBM
  return ::erfcf(x);
#else
  float const a = x < 0.0f ? -x : x;
  float const z = a > 10.5f ? 10.5f : a;  // erfc(10.5) rounds to 0; NaN stays NaN
  float const t = 1.0f / (1.0f + 0.5f * z);
  float q = 0.17087277f;
  q = q * t - 0.82215223f;
  q = q * t + 1.48851587f;
  q = q * t - 1.13520398f;
  q = q * t + 0.27886807f;
  q = q * t - 0.18628806f;
  q = q * t + 0.09678418f;
  q = q * t + 0.37409196f;
  q = q * t + 1.00002368f;
  q = q * t - 1.26551223f;
  // z = z_hi + z_lo with z_hi's 12 leading bits: z_hi^2 is exact in float, and
  // z^2 = z_hi^2 + z_lo (z + z_hi).
  float const z_hi = detail::bit_cast<float>(detail::bit_cast<std::uint32_t>(z) & 0xFFFF'F000u);
  float const z_lo = z - z_hi;
  float const tail = t * exp_float(-(z_hi * z_hi), q - z_lo * (z + z_hi));
  return x < 0.0f ? 2.0f - tail : tail;
#endif
}

//! e^(-x^2 / 2) (the normal density without its constant), with x^2 taken exactly, so
//! the result keeps float's relative accuracy where the exponent is large.
MPX_HD inline float exp_neg_half_square(float x) noexcept {
  float const a = x < 0.0f ? -x : x;
  float const z = a > 15.0f ? 15.0f : a;  // e^(-112.5) rounds to 0; NaN stays NaN
  float const z_hi = detail::bit_cast<float>(detail::bit_cast<std::uint32_t>(z) & 0xFFFF'F000u);
  float const z_lo = z - z_hi;
  return exp_float(-0.5f * (z_hi * z_hi), -0.5f * (z_lo * (z + z_hi)));
}

}  // namespace mpx

// The formats block scales are stored in, which are not dtypes (no tensor computes in
// them; they hold the factors a block of values is multiplied by): mpx::float8_e8m0,
// the power-of-two scale of MXFP8 (OCP's Microscaling formats: 8 exponent bits, no sign,
// no mantissa). A user reads one with mpx::e8m0_to_float.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/config.hpp>
#include <mpx/core/dtype.hpp>

#include <cstdint>

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

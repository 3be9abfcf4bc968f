// Conversions between mpx's types: mpx::cast rounds to nearest even, overflows to ±inf
// and keeps NaN NaN; mpx::saturate_cast clamps to ±max instead. The host path is a
// bit-exact software rounding; the device path uses the hardware conversions, and the
// tests prove both agree bit for bit on every 16-bit pattern and 10^7 random floats.
#pragma once

#include <mpx/core/config.hpp>
#include <mpx/core/dtype.hpp>

#include <type_traits>

namespace mpx {
namespace detail {

// Rounds a double to the binary format with E exponent and M mantissa bits (round to
// nearest, ties to even; overflow to ±inf; gradual underflow to subnormals and ±0) and
// returns the pattern. One rounding from double: floats are exact in double, so this
// is also the correctly rounded float -> 16-bit conversion. NaN becomes the canonical
// quiet NaN (all mantissa bits set), as the CUDA conversions produce it.
template <int E, int M>
MPX_HD constexpr std::uint32_t round_double_to_format(double x) noexcept {
  constexpr int bias = (1 << (E - 1)) - 1;
  constexpr std::uint32_t exponent_mask = ((1u << E) - 1u) << M;
  std::uint64_t const b = bit_cast<std::uint64_t>(x);
  std::uint32_t const sign = static_cast<std::uint32_t>(b >> 63) << (E + M);
  std::uint64_t const magnitude = b & 0x7FFF'FFFF'FFFF'FFFFull;
  if (magnitude > 0x7FF0'0000'0000'0000ull) return exponent_mask | ((1u << M) - 1u);  // NaN
  if (magnitude == 0x7FF0'0000'0000'0000ull) return sign | exponent_mask;              // inf
  int const double_exponent = static_cast<int>(magnitude >> 52);
  if (double_exponent == 0) return sign;  // double subnormal: < 2^-1022, below every target
  std::uint64_t const significand = (magnitude & 0x000F'FFFF'FFFF'FFFFull) | (1ull << 52);
  int const target_exponent = double_exponent - 1023 + bias;  // biased, in the target format
  // Bits of the 53-bit significand that do not fit; more when the result is subnormal.
  int const shift = 52 - M + (target_exponent >= 1 ? 0 : 1 - target_exponent);
  if (shift > 54) return sign;  // below half the smallest subnormal: rounds to zero
  std::uint64_t quotient = significand >> shift;
  std::uint64_t const remainder = significand & ((1ull << shift) - 1);
  std::uint64_t const halfway = 1ull << (shift - 1);
  if (remainder > halfway || (remainder == halfway && (quotient & 1u))) ++quotient;
  // For normals the implicit bit of `quotient` adds one to the exponent field, and a
  // mantissa that rounds up past all ones carries into the exponent: both by addition.
  std::uint64_t const pattern =
      target_exponent >= 1 ? (static_cast<std::uint64_t>(target_exponent - 1) << M) + quotient : quotient;
  if (pattern >= exponent_mask) return sign | exponent_mask;
  return sign | static_cast<std::uint32_t>(pattern);
}

// Exact widening of a 16-bit pattern to float (every half and bfloat16 is a float);
// half's subnormals are normalised by one float subtraction, not a loop (F. Giesen's
// half_to_float).
template <class T>
MPX_HD constexpr float widen_16_to_float(T x) noexcept {
  if constexpr (std::is_same_v<T, bfloat16>) {
    return bit_cast<float>(static_cast<std::uint32_t>(bits(x)) << 16);
  } else {
    constexpr std::uint32_t shifted_exponent = 0x7C00u << 13;
    std::uint32_t const h = bits(x);
    std::uint32_t u = (h & 0x7FFFu) << 13;
    std::uint32_t const exponent = u & shifted_exponent;
    u += (127u - 15u) << 23;
    if (exponent == shifted_exponent) {
      u += (128u - 16u) << 23;  // inf, NaN (payload kept)
    } else if (exponent == 0) {  // zero, subnormal: let a float subtraction normalise
      u += 1u << 23;
      u = bit_cast<std::uint32_t>(bit_cast<float>(u) - bit_cast<float>(113u << 23));
    }
    return bit_cast<float>(u | ((h & 0x8000u) << 16));
  }
}
template <class T>
MPX_HD constexpr float widen_to_float(T x) noexcept {
  return widen_16_to_float(x);
}

template <class T>
MPX_HD constexpr double to_double(T x) noexcept {
  if constexpr (dtype16<T>) {
    return static_cast<double>(widen_to_float(x));
  } else {
    return static_cast<double>(x);
  }
}

// float -> 16 bits rounded to nearest even, bit for bit what the double-based rounding
// gives (overflow to inf, subnormals kept, NaN to the canonical quiet NaN), in a few
// integer and float operations: the host kernels round every element they write.
// (For half: F. Giesen's float_to_half_fast3_rtne.) tests/core/test_cast checks it on
// every pattern and 10^7 random floats, and tests/kernels/test_gemm again.
template <class T>
MPX_HD inline T round_float_to_16(float x) noexcept {
  std::uint32_t u = bit_cast<std::uint32_t>(x);
  if ((u & 0x7FFF'FFFFu) > 0x7F80'0000u) return dtype_traits<T>::quiet_nan();
  if constexpr (std::is_same_v<T, bfloat16>) {
    u += 0x7FFFu + ((u >> 16) & 1u);  // carries into the exponent, up to inf, as it should
    return from_bits<bfloat16>(static_cast<std::uint16_t>(u >> 16));
  } else {
    std::uint32_t const sign = u & 0x8000'0000u;
    u ^= sign;
    std::uint32_t h;
    if (u >= (127u + 16u) << 23) {  // >= 65536: inf (a NaN was handled above)
      h = 0x7C00u;
    } else if (u < 113u << 23) {  // below half's smallest normal: let a float addition round
      constexpr std::uint32_t magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
      h = bit_cast<std::uint32_t>(bit_cast<float>(u) + bit_cast<float>(magic)) - magic;
    } else {  // rebias the exponent and round the 13 dropped bits to nearest even
      u += ((15u - 127u) << 23) + 0xFFFu + ((u >> 13) & 1u);
      h = u >> 13;
    }
    return from_bits<half>(static_cast<std::uint16_t>(h | (sign >> 16)));
  }
}

template <class To, class From>
MPX_HD constexpr To narrow_to_16(From x) noexcept {
#if MPX_DEVICE_PASS
  // The hardware conversion, except in constant expressions where only the software
  // rounding can run; the two agree bit for bit (tests/core/test_cast).
  if (!__builtin_is_constant_evaluated()) {
    if constexpr (std::is_same_v<To, half>) {
      if constexpr (std::is_same_v<From, double>) return __double2half(x);
      else return __float2half_rn(static_cast<float>(x));
    } else {
      if constexpr (std::is_same_v<From, double>) return __double2bfloat16(x);
      else return __float2bfloat16_rn(static_cast<float>(x));
    }
  }
#else
  if constexpr (std::is_same_v<From, float>)
    if (!__builtin_is_constant_evaluated()) return round_float_to_16<To>(x);
#endif
  using tr = dtype_traits<To>;
  return from_bits<To>(static_cast<bits_t<To>>(
      round_double_to_format<tr::exponent_bits, tr::mantissa_bits>(static_cast<double>(x))));
}

template <class T>
inline constexpr bool is_castable_v = dtype<T> || std::is_same_v<T, double> || std::is_integral_v<T>;

}  // namespace detail

//! Converts x to To, rounding to nearest even. Overflow gives ±inf, NaN stays NaN
//! (the canonical quiet NaN for 16-bit results), subnormals are kept. Widening
//! (half/bfloat16 -> float -> double) is exact. Host and device agree bit for bit.
template <class To, class From>
MPX_HD constexpr To cast(From x) noexcept {
  static_assert(detail::is_castable_v<To> && detail::is_castable_v<From>,
                "mpx::cast converts between half, bfloat16, float, double and integers");
  if constexpr (std::is_same_v<To, From>) {
    return x;
  } else if constexpr (std::is_integral_v<From>) {
    return cast<To>(static_cast<double>(x));
  } else if constexpr (dtype16<From>) {
    // Via float: exact, so a 16-bit -> 16-bit conversion rounds once.
    float wide = detail::widen_to_float(x);
#if MPX_DEVICE_PASS
    if (!__builtin_is_constant_evaluated()) {
      if constexpr (std::is_same_v<From, half>) wide = __half2float(x);
      else wide = __bfloat162float(x);
    }
#endif
    if constexpr (std::is_same_v<To, float>) return wide;
    else return cast<To>(wide);
  } else if constexpr (dtype16<To>) {
    return detail::narrow_to_16<To>(x);
  } else {
    return static_cast<To>(x);  // among float, double and integers: the language's rounding
  }
}

//! Like cast, but values beyond ±max, infinities included, become ±max: the
//! conversion for data that must stay finite. NaN stays NaN.
template <class To, class From>
MPX_HD constexpr To saturate_cast(From x) noexcept {
  To const y = cast<To>(x);
  if constexpr (std::is_integral_v<To>) {
    return y;
  } else {
    if (!is_inf(y)) return y;
    return (bits(y) & dtype_traits<To>::sign_mask) ? dtype_traits<To>::lowest() : dtype_traits<To>::max();
  }
}

}  // namespace mpx

// Conversions between mpx's types: mpx::cast rounds to nearest even, overflows to ±inf
// (to NaN for float8_e4m3, which has no inf) and keeps NaN NaN; mpx::saturate_cast clamps
// to ±max instead. The host path is a bit-exact software rounding; the device path uses
// the hardware conversions (cuda_fp16.h, cuda_bf16.h, cuda_fp8.h), and the tests prove
// both agree bit for bit on every 16- and 8-bit pattern and 10^7 random floats.
#pragma once

#include <mpx/core/config.hpp>
#include <mpx/core/dtype.hpp>

#include <type_traits>

namespace mpx {
namespace detail {

// Rounds a double to the binary format with E exponent and M mantissa bits (round to
// nearest, ties to even; gradual underflow to subnormals and ±0) and returns the
// pattern. One rounding from double: floats are exact in double, so this is also the
// correctly rounded float -> 16- or 8-bit conversion. A value that rounds above the
// largest finite value (and ±inf) overflows: to ±inf, or, in a format without infinity
// (HasInfinity false: e4m3, whose only non-finite patterns are S.1111.111), to the NaN of
// the value's sign, as cuda_fp8.h's __NV_NOSAT conversion gives it. NaN becomes the
// canonical quiet NaN (all mantissa bits set, sign clear), as the CUDA conversions give it.
template <int E, int M, bool HasInfinity = true>
MPX_HD constexpr std::uint32_t round_double_to_format(double x) noexcept {
  constexpr int bias = (1 << (E - 1)) - 1;
  constexpr std::uint32_t exponent_mask = ((1u << E) - 1u) << M;
  constexpr std::uint32_t nan = exponent_mask | ((1u << M) - 1u);
  // What an overflow gives, which is also the first pattern past max.
  constexpr std::uint32_t overflow = HasInfinity ? exponent_mask : nan;
  std::uint64_t const b = bit_cast<std::uint64_t>(x);
  std::uint32_t const sign = static_cast<std::uint32_t>(b >> 63) << (E + M);
  std::uint64_t const magnitude = b & 0x7FFF'FFFF'FFFF'FFFFull;
  if (magnitude > 0x7FF0'0000'0000'0000ull) return nan;                      // NaN
  if (magnitude == 0x7FF0'0000'0000'0000ull) return sign | overflow;         // inf
  int const double_exponent = static_cast<int>(magnitude >> 52);
  if (double_exponent == 0) return sign;  // double subnormal: < 2^-1022, below every target
  std::uint64_t const significand = (magnitude & 0x000F'FFFF'FFFF'FFFFull) | (1ull << 52);
  int const target_exponent = double_exponent - 1023 + bias;  // biased, in the target format
  if (target_exponent > (1 << E)) return sign | overflow;     // far beyond: keeps the pattern arithmetic small
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
  if (pattern >= overflow) return sign | overflow;
  return sign | static_cast<std::uint32_t>(pattern);
}

// Exact widening of an 8-bit pattern to float (every fp8 value is a float): the fields
// rebiased into float's, subnormals by one exact float multiplication. A NaN keeps its
// sign and its mantissa bits at the top of float's mantissa (so it is quiet), as the
// host's widening of half does; e5m2's ±inf becomes float's.
template <class T>
MPX_HD constexpr float widen_8_to_float(T x) noexcept {
  using tr = dtype_traits<T>;
  constexpr int m_bits = tr::mantissa_bits;
  std::uint32_t const b = bits(x);
  std::uint32_t const sign = (b & tr::sign_mask) << 24;
  std::uint32_t const exponent = (b & tr::exponent_mask) >> m_bits;
  std::uint32_t const mantissa = b & tr::mantissa_mask;
  if (is_nan(x) || is_inf(x)) return bit_cast<float>(sign | 0x7F80'0000u | (mantissa << (23 - m_bits)));
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^(1 - bias - m_bits), exact
    constexpr float unit = bit_cast<float>(static_cast<std::uint32_t>(127 + 1 - tr::exponent_bias - m_bits) << 23);
    return bit_cast<float>(bit_cast<std::uint32_t>(static_cast<float>(mantissa) * unit) | sign);
  }
  return bit_cast<float>(sign | ((exponent - tr::exponent_bias + 127u) << 23) | (mantissa << (23 - m_bits)));
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
  if constexpr (dtype8<T>) return widen_8_to_float(x);
  else return widen_16_to_float(x);
}

// A dtype narrower than float: what cast widens exactly and narrows by rounding.
template <class T>
concept narrow_dtype = dtype16<T> || dtype8<T>;

template <class T>
MPX_HD constexpr double to_double(T x) noexcept {
  if constexpr (narrow_dtype<T>) {
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

// The midpoint between T's max and the value its exponent would give next, as float
// bits, and whether a tie there overflows (it does when max's pattern is odd: the even
// neighbour is the next pattern). 464 for e4m3 (a tie stays 448), 61440 for e5m2 (a tie
// is inf). The overflow threshold of both 8-bit roundings, host and device.
template <class T>
struct fp8_overflow_threshold {
  using tr = dtype_traits<T>;
  static constexpr float max = widen_8_to_float(tr::max());
  static constexpr float half_ulp_of_max =
      bit_cast<float>(((bit_cast<std::uint32_t>(max) >> 23) - std::uint32_t{tr::mantissa_bits} - 1u) << 23);
  static constexpr std::uint32_t bits = bit_cast<std::uint32_t>(max + half_ulp_of_max);
  static constexpr bool tie_overflows = (tr::max_bits & 1u) != 0;
  MPX_HD static constexpr bool overflows(std::uint32_t magnitude_bits) noexcept {
    return tie_overflows ? magnitude_bits >= bits : magnitude_bits > bits;
  }
};

// float -> 8 bits rounded to nearest even, bit for bit what the double-based rounding
// gives (overflow to inf, or e4m3's NaN of the sign; subnormals kept; NaN to the
// canonical NaN), in a few integer and float operations, as round_float_to_16 does:
// normals rebias the exponent and round the 20 or 21 dropped bits with one addition;
// values below the smallest normal are rounded by a float addition whose ulp is the
// format's subnormal step. tests/core/test_fp8 checks it on every midpoint.
template <class T>
MPX_HD inline T round_float_to_8(float x) noexcept {
  using tr = dtype_traits<T>;
  constexpr int m = tr::mantissa_bits, bias = tr::exponent_bias;
  std::uint32_t u = bit_cast<std::uint32_t>(x);
  std::uint32_t const sign = (u >> 24) & 0x80u;
  u &= 0x7FFF'FFFFu;
  if (u > 0x7F80'0000u) return tr::quiet_nan();
  constexpr std::uint32_t overflow = tr::has_infinity ? tr::exponent_mask : tr::nan_bits;
  if (fp8_overflow_threshold<T>::overflows(u)) return from_bits<T>(static_cast<std::uint8_t>(sign | overflow));
  std::uint32_t h;
  constexpr std::uint32_t min_normal = static_cast<std::uint32_t>(127 + 1 - bias) << 23;
  if (u < min_normal) {
    constexpr std::uint32_t magic = static_cast<std::uint32_t>(127 + 1 - bias + 23 - m) << 23;
    h = bit_cast<std::uint32_t>(bit_cast<float>(u) + bit_cast<float>(magic)) - magic;
  } else {
    u += (static_cast<std::uint32_t>(bias - 127) << 23) + ((1u << (22 - m)) - 1u) + ((u >> (23 - m)) & 1u);
    h = u >> (23 - m);
  }
  return from_bits<T>(static_cast<std::uint8_t>(h | sign));
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

#if MPX_HAS_CUDA
// float -> fp8 with cuda_fp8.h's conversion (cvt.rn.satfinite on sm_89 and newer, the
// header's software rounding elsewhere). Its __NV_SATFINITE mode is what saturate_cast
// means. A NaN is answered here with the canonical pattern, so the result does not
// depend on what the instruction makes of one. mpx::cast's overflow (beyond the midpoint
// above max, a tie going to the even pattern as if the exponent went on) is decided from
// |x|, the threshold __NV_NOSAT and the host's rounding use: this keeps the one fast
// saturating instruction (__NV_NOSAT has none) and gives bit for bit what the host
// gives (tests/core/test_fp8.cpp).
template <class To, bool Saturate>
MPX_DEVICE inline To device_float_to_fp8(float x) noexcept {
  using tr = dtype_traits<To>;
  if (is_nan(x)) return tr::quiet_nan();
  constexpr __nv_fp8_interpretation_t kind = tr::has_infinity ? __NV_E5M2 : __NV_E4M3;
  auto const r = static_cast<bits_t<To>>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, kind));
  if constexpr (!Saturate) {
    std::uint32_t const magnitude = bit_cast<std::uint32_t>(x) & 0x7FFF'FFFFu;
    constexpr unsigned overflow = tr::has_infinity ? tr::exponent_mask : tr::nan_bits;  // ±inf, or e4m3's ±NaN
    if (fp8_overflow_threshold<To>::overflows(magnitude))
      return from_bits<To>(static_cast<bits_t<To>>((r & tr::sign_mask) | overflow));
  }
  return from_bits<To>(r);
}
#endif

// Narrowing to fp8: one rounding from double (floats are exact in double) on the host
// and in constant expressions; on the device, floats through cuda_fp8.h (above).
template <class To, class From>
MPX_HD constexpr To narrow_to_8(From x) noexcept {
#if MPX_DEVICE_PASS
  if constexpr (std::is_same_v<From, float>)
    if (!__builtin_is_constant_evaluated()) return device_float_to_fp8<To, false>(x);
#else
  if constexpr (std::is_same_v<From, float>)
    if (!__builtin_is_constant_evaluated()) return round_float_to_8<To>(x);
#endif
  using tr = dtype_traits<To>;
  return from_bits<To>(static_cast<bits_t<To>>(
      round_double_to_format<tr::exponent_bits, tr::mantissa_bits, tr::has_infinity>(static_cast<double>(x))));
}

template <class T>
inline constexpr bool is_castable_v = dtype<T> || std::is_same_v<T, double> || std::is_integral_v<T>;

template <class T>
MPX_HD constexpr bool sign_bit(T x) noexcept {
  return (bits(x) & dtype_traits<T>::sign_mask) != 0;
}

}  // namespace detail

//! Converts x to To, rounding to nearest even. A value that rounds beyond ±max gives ±inf,
//! or for float8_e4m3 (no inf) the NaN of its sign; NaN stays NaN (the canonical quiet NaN
//! for 16- and 8-bit results); subnormals are kept. Widening (fp8 -> half/bfloat16 ->
//! float -> double) is exact. Host and device agree bit for bit on every value but a NaN,
//! which is NaN on both: widening a half or bfloat16 NaN keeps its sign and payload on
//! the host, while the GPU's conversion instructions may give the canonical NaN.
template <class To, class From>
MPX_HD constexpr To cast(From x) noexcept {
  static_assert(detail::is_castable_v<To> && detail::is_castable_v<From>,
                "mpx::cast converts between the dtypes of mpx::dtype_list (half, bfloat16, float, float8_e4m3, "
                "float8_e5m2), double and integers");
  if constexpr (std::is_same_v<To, From>) {
    return x;
  } else if constexpr (std::is_integral_v<From>) {
    return cast<To>(static_cast<double>(x));
  } else if constexpr (detail::narrow_dtype<From>) {
    // Via float: exact, so a narrow -> narrow conversion rounds once. fp8 widens by the
    // same integer decoding on host and device (exact, so nothing to gain from hardware).
    float wide = detail::widen_to_float(x);
#if MPX_DEVICE_PASS
    if (!__builtin_is_constant_evaluated()) {
      if constexpr (std::is_same_v<From, half>) wide = __half2float(x);
      else if constexpr (std::is_same_v<From, bfloat16>) wide = __bfloat162float(x);
    }
#endif
    if constexpr (std::is_same_v<To, float>) return wide;
    else return cast<To>(wide);
  } else if constexpr (dtype16<To>) {
    return detail::narrow_to_16<To>(x);
  } else if constexpr (dtype8<To>) {
    return detail::narrow_to_8<To>(x);
  } else {
    return static_cast<To>(x);  // among float, double and integers: the language's rounding
  }
}

//! Like cast, but values beyond ±max, infinities included, become ±max: the
//! conversion for data that must stay finite. NaN stays NaN.
template <class To, class From>
MPX_HD constexpr To saturate_cast(From x) noexcept {
  if constexpr (std::is_integral_v<To>) {
    return cast<To>(x);
  } else if constexpr (std::is_integral_v<From>) {
    return saturate_cast<To>(static_cast<double>(x));
  } else if constexpr (std::is_same_v<To, From>) {
    if (!is_inf(x)) return x;
    return detail::sign_bit(x) ? dtype_traits<To>::lowest() : dtype_traits<To>::max();
  } else {
#if MPX_DEVICE_PASS
    if constexpr (dtype8<To> && std::is_same_v<From, float>)
      if (!__builtin_is_constant_evaluated()) return detail::device_float_to_fp8<To, true>(x);
#endif
    To const y = cast<To>(x);
    if (is_finite(y) || is_nan(x)) return y;  // e4m3's overflow is a NaN: told apart by the input
    return detail::sign_bit(x) ? dtype_traits<To>::lowest() : dtype_traits<To>::max();
  }
}

}  // namespace mpx

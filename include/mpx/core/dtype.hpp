// The numeric types mpx computes in: mpx::half, mpx::bfloat16 and float, their
// limits (dtype_traits) and bit-exact classification (is_finite/is_nan/is_inf) that
// gives the same answer on host and device, even under -ffast-math.
#pragma once

#include <mpx/core/config.hpp>

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace mpx {

using half = __half;             //!< IEEE 754 binary16: 5 exponent bits, 10 mantissa bits.
using bfloat16 = __nv_bfloat16;  //!< bfloat16: float's 8 exponent bits, 7 mantissa bits.

//! The element types mpx's kernels, policies and layers are instantiated for.
template <class T>
concept dtype = std::is_same_v<T, half> || std::is_same_v<T, bfloat16> || std::is_same_v<T, float>;

//! A 16-bit floating type (half or bfloat16).
template <class T>
concept dtype16 = std::is_same_v<T, half> || std::is_same_v<T, bfloat16>;

namespace detail {

template <class T>
struct bits_of_size;
template <>
struct bits_of_size<half> { using type = std::uint16_t; };
template <>
struct bits_of_size<bfloat16> { using type = std::uint16_t; };
template <>
struct bits_of_size<float> { using type = std::uint32_t; };
template <>
struct bits_of_size<double> { using type = std::uint64_t; };

template <class T>
using bits_t = typename bits_of_size<T>::type;

// __builtin_bit_cast works in constant expressions and in device code alike, where
// std::bit_cast would need --expt-relaxed-constexpr from every user.
template <class To, class From>
MPX_HD constexpr To bit_cast(From const& from) noexcept {
  static_assert(sizeof(To) == sizeof(From), "mpx::detail::bit_cast: sizes differ");
  return __builtin_bit_cast(To, from);
}

template <class T>
MPX_HD constexpr T from_bits(bits_t<T> bits) noexcept {
  return bit_cast<T>(bits);
}

}  // namespace detail

//! The raw bit pattern of x (uint16_t for half and bfloat16, uint32_t for float).
template <class T>
MPX_HD constexpr detail::bits_t<T> bits(T x) noexcept {
  return detail::bit_cast<detail::bits_t<T>>(x);
}

//! Limits and layout of a floating type. Every value is usable in device code and,
//! for half and bfloat16 too, in constant expressions.
template <class T>
struct dtype_traits;

namespace detail {
// One definition of the IEEE layout, instantiated for each type: what differs between
// half, bfloat16 and float is only the number of exponent and mantissa bits.
template <class T, int ExponentBits, int MantissaBits>
struct ieee_layout {
  using bits_type = bits_t<T>;
  static constexpr int bits = 1 + ExponentBits + MantissaBits;
  static constexpr int exponent_bits = ExponentBits;
  static constexpr int mantissa_bits = MantissaBits;
  static constexpr int exponent_bias = (1 << (ExponentBits - 1)) - 1;
  static constexpr bits_type sign_mask = bits_type(bits_type(1) << (bits - 1));
  static constexpr bits_type exponent_mask = bits_type(((bits_type(1) << ExponentBits) - 1) << MantissaBits);
  static constexpr bits_type mantissa_mask = bits_type((bits_type(1) << MantissaBits) - 1);

  //! Largest finite value (65504 for half, about 3.39e38 for bfloat16).
  MPX_HD static constexpr T max() noexcept { return from_bits<T>(bits_type(exponent_mask - 1)); }
  //! Most negative finite value, -max().
  MPX_HD static constexpr T lowest() noexcept { return from_bits<T>(bits_type(sign_mask | (exponent_mask - 1))); }
  //! Smallest positive normal value, 2^(1 - bias).
  MPX_HD static constexpr T min_normal() noexcept { return from_bits<T>(bits_type(bits_type(1) << MantissaBits)); }
  //! Smallest positive subnormal value, 2^(1 - bias - mantissa_bits).
  MPX_HD static constexpr T min_subnormal() noexcept { return from_bits<T>(bits_type(1)); }
  //! Distance from 1 to the next larger value, 2^-mantissa_bits.
  MPX_HD static constexpr T epsilon() noexcept {
    return from_bits<T>(bits_type(bits_type(exponent_bias - MantissaBits) << MantissaBits));
  }
  MPX_HD static constexpr T infinity() noexcept { return from_bits<T>(exponent_mask); }
  //! The canonical quiet NaN the CUDA conversions produce (all mantissa bits set).
  MPX_HD static constexpr T quiet_nan() noexcept { return from_bits<T>(bits_type(exponent_mask | mantissa_mask)); }
};
}  // namespace detail

template <>
struct dtype_traits<half> : detail::ieee_layout<half, 5, 10> {
  static constexpr std::string_view name = "float16";
};
template <>
struct dtype_traits<bfloat16> : detail::ieee_layout<bfloat16, 8, 7> {
  static constexpr std::string_view name = "bfloat16";
};
template <>
struct dtype_traits<float> : detail::ieee_layout<float, 8, 23> {
  static constexpr std::string_view name = "float32";
};
template <>
struct dtype_traits<double> : detail::ieee_layout<double, 11, 52> {
  static constexpr std::string_view name = "float64";
};

//! The name of T as Keras and NumPy spell it: "float16", "bfloat16", "float32".
template <class T>
inline constexpr std::string_view dtype_name = dtype_traits<T>::name;

//! A dtype as a runtime value, for lists that hold tensors of several dtypes (a model's
//! parameters: half weights beside float norm scales).
enum class dtype_id : std::uint8_t { float16, bfloat16, float32 };

template <dtype T>
inline constexpr dtype_id dtype_id_of = std::is_same_v<T, half>       ? dtype_id::float16
                                        : std::is_same_v<T, bfloat16> ? dtype_id::bfloat16
                                                                      : dtype_id::float32;

//! "float16", "bfloat16" or "float32".
constexpr std::string_view to_string(dtype_id id) noexcept {
  switch (id) {
    case dtype_id::float16: return "float16";
    case dtype_id::bfloat16: return "bfloat16";
    case dtype_id::float32: return "float32";
  }
  return "unknown";
}

//! Bytes per element of a dtype.
constexpr std::size_t size_of(dtype_id id) noexcept { return id == dtype_id::float32 ? 4 : 2; }

//! Calls f(T{}) with the static type behind a runtime dtype: where a runtime list meets
//! a kernel template.
template <class F>
decltype(auto) visit_dtype(dtype_id id, F&& f) {
  switch (id) {
    case dtype_id::float16: return f(half{});
    case dtype_id::bfloat16: return f(bfloat16{});
    case dtype_id::float32: break;
  }
  return f(float{});
}

// Classification reads the bits, so it cannot be optimised away by fast-math flags and
// answers identically on host and device.

//! True for every value that is neither NaN nor ±inf.
template <class T>
MPX_HD constexpr bool is_finite(T x) noexcept {
  using tr = dtype_traits<T>;
  return (bits(x) & tr::exponent_mask) != tr::exponent_mask;
}

//! True for ±inf.
template <class T>
MPX_HD constexpr bool is_inf(T x) noexcept {
  using tr = dtype_traits<T>;
  return (bits(x) & ~tr::sign_mask) == tr::exponent_mask;
}

//! True for every NaN, quiet or signalling, whatever its sign or payload.
template <class T>
MPX_HD constexpr bool is_nan(T x) noexcept {
  using tr = dtype_traits<T>;
  return (bits(x) & ~tr::sign_mask) > tr::exponent_mask;
}

//! True for nonzero values below min_normal() in magnitude.
template <class T>
MPX_HD constexpr bool is_subnormal(T x) noexcept {
  using tr = dtype_traits<T>;
  return (bits(x) & tr::exponent_mask) == 0 && (bits(x) & tr::mantissa_mask) != 0;
}

//! True for +0 and -0.
template <class T>
MPX_HD constexpr bool is_zero(T x) noexcept {
  using tr = dtype_traits<T>;
  return (bits(x) & ~tr::sign_mask) == 0;
}

}  // namespace mpx

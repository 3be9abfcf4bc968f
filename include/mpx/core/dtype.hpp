// The numeric types mpx computes in: mpx::half, mpx::bfloat16, float and the fp8 formats
// mpx::float8_e4m3 and mpx::float8_e5m2; the one list naming them (dtype_list), their
// limits (dtype_traits), and bit-exact classification (is_finite/is_nan/is_inf) that
// gives the same answer on host and device, even under -ffast-math.
#pragma once

#include <mpx/core/config.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <library_types.h>

namespace mpx {

using half = __half;             //!< IEEE 754 binary16: 5 exponent bits, 10 mantissa bits.
using bfloat16 = __nv_bfloat16;  //!< bfloat16: float's 8 exponent bits, 7 mantissa bits.
//! OCP FP8 E4M3 as Hopper implements it ("float8_e4m3fn"): 4 exponent bits, 3 mantissa
//! bits, bias 7, no infinity, one NaN per sign (S.1111.111), largest finite 448.
using float8_e4m3 = __nv_fp8_e4m3;
//! OCP FP8 E5M2: IEEE-like (half's top byte), bias 15, ±inf and NaNs, largest finite 57344.
using float8_e5m2 = __nv_fp8_e5m2;

//! A list of types, for compile-time enumeration.
template <class... Ts>
struct type_list {
  static constexpr std::size_t size = sizeof...(Ts);
};

//! Every dtype mpx's tensors, kernels and policies are instantiated for, in the order of
//! mpx::dtype_id. The one list: ids, names, visitors and per-dtype tables derive from it,
//! so a new dtype is this entry, its dtype_traits below and its conversions in cast.hpp.
using dtype_list = type_list<half, bfloat16, float, float8_e4m3, float8_e5m2>;

namespace detail {
// The position of T in a type_list; the list's size when T is not in it.
template <class T, class List>
struct index_in;
template <class T, class... Ts>
struct index_in<T, type_list<Ts...>> {
  static constexpr std::size_t value = [] {
    std::size_t i = 0;
    (void)((std::is_same_v<T, Ts> ? true : (++i, false)) || ...);
    return i;
  }();
};
}  // namespace detail

//! The element types mpx's kernels, policies and layers are instantiated for: the
//! members of dtype_list.
template <class T>
concept dtype = detail::index_in<T, dtype_list>::value < dtype_list::size;

//! A 16-bit floating type (half or bfloat16).
template <class T>
concept dtype16 = dtype<T> && sizeof(T) == 2;

//! An 8-bit floating type (float8_e4m3 or float8_e5m2).
template <class T>
concept dtype8 = dtype<T> && sizeof(T) == 1;

namespace detail {

// The unsigned integer as wide as T.
template <std::size_t Bytes>
struct unsigned_of_size;
template <>
struct unsigned_of_size<1> { using type = std::uint8_t; };
template <>
struct unsigned_of_size<2> { using type = std::uint16_t; };
template <>
struct unsigned_of_size<4> { using type = std::uint32_t; };
template <>
struct unsigned_of_size<8> { using type = std::uint64_t; };

template <class T>
using bits_t = typename unsigned_of_size<sizeof(T)>::type;

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

//! The raw bit pattern of x (uint8_t for fp8, uint16_t for half and bfloat16, uint32_t
//! for float).
template <class T>
MPX_HD constexpr detail::bits_t<T> bits(T x) noexcept {
  return detail::bit_cast<detail::bits_t<T>>(x);
}

//! Limits and layout of a floating type. Every value is usable in device code and in
//! constant expressions.
template <class T>
struct dtype_traits;

namespace detail {
// One definition of a binary floating-point layout, instantiated for each type: what
// differs between the formats is the number of exponent and mantissa bits, and whether
// the all-ones exponent holds ±inf and NaNs (IEEE 754: half, bfloat16, float, e5m2) or
// ordinary values with only all-ones S.1111.111 as NaN (OCP's e4m3, "fn": finite + NaN).
template <class T, int ExponentBits, int MantissaBits, bool HasInfinity = true>
struct float_layout {
  using bits_type = bits_t<T>;
  static_assert(sizeof(T) * 8 == 1 + ExponentBits + MantissaBits, "mpx::dtype_traits: widths do not add up");
  static constexpr int bits = 1 + ExponentBits + MantissaBits;
  static constexpr int exponent_bits = ExponentBits;
  static constexpr int mantissa_bits = MantissaBits;
  static constexpr int exponent_bias = (1 << (ExponentBits - 1)) - 1;
  static constexpr bool has_infinity = HasInfinity;
  static constexpr bool has_nan = true;
  static constexpr bits_type sign_mask = bits_type(bits_type(1) << (bits - 1));
  static constexpr bits_type exponent_mask = bits_type(((bits_type(1) << ExponentBits) - 1) << MantissaBits);
  static constexpr bits_type mantissa_mask = bits_type((bits_type(1) << MantissaBits) - 1);
  //! The pattern of the canonical NaN (all exponent and mantissa bits set, sign clear):
  //! what the CUDA conversions produce from a NaN.
  static constexpr bits_type nan_bits = bits_type(exponent_mask | mantissa_mask);
  //! The pattern of max(): below the all-ones exponent, or below the NaN pattern without inf.
  static constexpr bits_type max_bits = HasInfinity ? bits_type(exponent_mask - 1) : bits_type(nan_bits - 1);

  //! Largest finite value (65504 for half, about 3.39e38 for bfloat16, 448 for e4m3).
  MPX_HD static constexpr T max() noexcept { return from_bits<T>(max_bits); }
  //! Most negative finite value, -max().
  MPX_HD static constexpr T lowest() noexcept { return from_bits<T>(bits_type(sign_mask | max_bits)); }
  //! Smallest positive normal value, 2^(1 - bias).
  MPX_HD static constexpr T min_normal() noexcept { return from_bits<T>(bits_type(bits_type(1) << MantissaBits)); }
  //! Smallest positive subnormal value, 2^(1 - bias - mantissa_bits).
  MPX_HD static constexpr T min_subnormal() noexcept { return from_bits<T>(bits_type(1)); }
  //! Distance from 1 to the next larger value, 2^-mantissa_bits.
  MPX_HD static constexpr T epsilon() noexcept {
    return from_bits<T>(bits_type(bits_type(exponent_bias - MantissaBits) << MantissaBits));
  }
  //! +inf; only for formats that have one (not e4m3).
  MPX_HD static constexpr T infinity() noexcept
    requires HasInfinity
  {
    return from_bits<T>(exponent_mask);
  }
  //! The canonical quiet NaN the CUDA conversions produce (all mantissa bits set).
  MPX_HD static constexpr T quiet_nan() noexcept { return from_bits<T>(nan_bits); }
};
}  // namespace detail

template <>
struct dtype_traits<half> : detail::float_layout<half, 5, 10> {
  static constexpr std::string_view name = "float16";
  static constexpr cudaDataType_t cuda_data_type = CUDA_R_16F;
};
template <>
struct dtype_traits<bfloat16> : detail::float_layout<bfloat16, 8, 7> {
  static constexpr std::string_view name = "bfloat16";
  static constexpr cudaDataType_t cuda_data_type = CUDA_R_16BF;
};
template <>
struct dtype_traits<float> : detail::float_layout<float, 8, 23> {
  static constexpr std::string_view name = "float32";
  static constexpr cudaDataType_t cuda_data_type = CUDA_R_32F;
};
template <>
struct dtype_traits<float8_e4m3> : detail::float_layout<float8_e4m3, 4, 3, false> {
  static constexpr std::string_view name = "float8_e4m3fn";  // as PyTorch, JAX and ml_dtypes spell it
  static constexpr cudaDataType_t cuda_data_type = CUDA_R_8F_E4M3;
};
template <>
struct dtype_traits<float8_e5m2> : detail::float_layout<float8_e5m2, 5, 2> {
  static constexpr std::string_view name = "float8_e5m2";
  static constexpr cudaDataType_t cuda_data_type = CUDA_R_8F_E5M2;
};
// Not a dtype (no tensor holds it): the references' format, described the same way.
template <>
struct dtype_traits<double> : detail::float_layout<double, 11, 52> {
  static constexpr std::string_view name = "float64";
  static constexpr cudaDataType_t cuda_data_type = CUDA_R_64F;
};

//! The name of T as Keras, NumPy and PyTorch spell it: "float16", "bfloat16", "float32",
//! "float8_e4m3fn", "float8_e5m2".
template <class T>
inline constexpr std::string_view dtype_name = dtype_traits<T>::name;

//! The number of dtypes in dtype_list.
inline constexpr std::size_t dtype_count = dtype_list::size;

//! A dtype as a runtime value, for lists that hold tensors of several dtypes (a model's
//! parameters: half weights beside float norm scales). Its value is the dtype's position
//! in dtype_list; the enumerators name them for code that tests for one.
enum class dtype_id : std::uint8_t {
  float16 = detail::index_in<half, dtype_list>::value,
  bfloat16 = detail::index_in<bfloat16, dtype_list>::value,
  float32 = detail::index_in<float, dtype_list>::value,
  float8_e4m3 = detail::index_in<float8_e4m3, dtype_list>::value,
  float8_e5m2 = detail::index_in<float8_e5m2, dtype_list>::value,
};

template <dtype T>
inline constexpr dtype_id dtype_id_of = static_cast<dtype_id>(detail::index_in<T, dtype_list>::value);

namespace detail {
template <class... Ts>
constexpr auto dtype_table(type_list<Ts...>) noexcept {
  struct entry {
    std::string_view name;
    std::size_t bytes;
    cudaDataType_t cuda_data_type;
  };
  return std::array<entry, sizeof...(Ts)>{
      entry{dtype_traits<Ts>::name, sizeof(Ts), dtype_traits<Ts>::cuda_data_type}...};
}
//! Per dtype_id: name, bytes, CUDA data type.
inline constexpr auto dtype_table_v = dtype_table(dtype_list{});
}  // namespace detail

//! Every dtype_id, in list order: for per-dtype tables (one multi-tensor plan per dtype).
inline constexpr std::array<dtype_id, dtype_count> all_dtype_ids = [] {
  std::array<dtype_id, dtype_count> out{};
  for (std::size_t i = 0; i < dtype_count; ++i) out[i] = static_cast<dtype_id>(i);
  return out;
}();

//! "float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2"; "unknown" for a
//! value that names no dtype.
constexpr std::string_view to_string(dtype_id id) noexcept {
  auto const i = static_cast<std::size_t>(id);
  return i < dtype_count ? detail::dtype_table_v[i].name : std::string_view("unknown");
}

//! Bytes per element of a dtype.
constexpr std::size_t size_of(dtype_id id) noexcept {
  auto const i = static_cast<std::size_t>(id);
  return i < dtype_count ? detail::dtype_table_v[i].bytes : 0;
}

namespace detail {
template <class F, class T, class... Rest>
decltype(auto) visit_dtype_in(type_list<T, Rest...>, dtype_id id, F& f) {
  if constexpr (sizeof...(Rest) == 0) {
    return f(T{});  // the last one, or an id that names no dtype (never made by mpx)
  } else {
    if (id == dtype_id_of<T>) return f(T{});
    return visit_dtype_in(type_list<Rest...>{}, id, f);
  }
}
}  // namespace detail

//! Calls f(T{}) with the static type behind a runtime dtype: where a runtime list meets
//! a kernel template. f is instantiated for every dtype of dtype_list.
template <class F>
decltype(auto) visit_dtype(dtype_id id, F&& f) {
  return detail::visit_dtype_in(dtype_list{}, id, f);
}

// Classification reads the bits, so it cannot be optimised away by fast-math flags and
// answers identically on host and device. Formats without infinity (e4m3) have NaN as
// their only non-finite value.

//! True for every value that is neither NaN nor ±inf.
template <class T>
MPX_HD constexpr bool is_finite(T x) noexcept {
  using tr = dtype_traits<T>;
  if constexpr (tr::has_infinity) return (bits(x) & tr::exponent_mask) != tr::exponent_mask;
  else return (bits(x) & ~tr::sign_mask) != tr::nan_bits;
}

//! True for ±inf (never for a format without infinity).
template <class T>
MPX_HD constexpr bool is_inf(T x) noexcept {
  using tr = dtype_traits<T>;
  if constexpr (tr::has_infinity) return (bits(x) & ~tr::sign_mask) == tr::exponent_mask;
  else return false;
}

//! True for every NaN, quiet or signalling, whatever its sign or payload.
template <class T>
MPX_HD constexpr bool is_nan(T x) noexcept {
  using tr = dtype_traits<T>;
  if constexpr (tr::has_infinity) return (bits(x) & ~tr::sign_mask) > tr::exponent_mask;
  else return (bits(x) & ~tr::sign_mask) == tr::nan_bits;
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

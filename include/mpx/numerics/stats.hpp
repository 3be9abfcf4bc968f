// mpx::stats: one pass over a tensor that answers "why is my gradient zero / inf?":
// counts of NaN, inf, zero and subnormal values, the finite magnitude range, how many
// values sit at the dtype's ±max (an fp8 saturation), and how many would underflow to
// zero or overflow to inf if stored in half. Any dtype of mpx::dtype_list.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/exec/reduce.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <ostream>
#include <string>

namespace mpx {

//! What one pass over a tensor found. Magnitudes are of finite values only (NaN and inf
//! are counted, not measured).
struct numerics_stats {
  std::size_t size = 0;       //!< Elements examined.
  std::size_t nan = 0;        //!< NaN values.
  std::size_t inf = 0;        //!< +inf or -inf values.
  std::size_t zero = 0;       //!< +0 or -0 values.
  std::size_t subnormal = 0;  //!< Nonzero values below the tensor type's min_normal.
  float absmax = 0;           //!< Largest finite |x|; 0 if there is none.
  float min_abs_nonzero = 0;  //!< Smallest nonzero finite |x|; 0 if there is none.
  //! Nonzero finite values that cast to half become ±0 (|x| <= 2^-25): gradients that a
  //! loss scale would have saved.
  std::size_t underflow_in_half = 0;
  //! Finite values that cast to half become ±inf (|x| >= 65520): activations or scaled
  //! gradients too large for float16.
  std::size_t overflow_in_half = 0;
  //! Values at ±max of the tensor's dtype (448 for float8_e4m3). An overflow shows as inf
  //! in a format with infinity; float8_e4m3 has none, so its overflows are NaN (mpx::cast)
  //! or ±448 (mpx::saturate_cast): `nan` counts the first, this the second (with any value
  //! that was exactly ±448).
  std::size_t at_max = 0;

  [[nodiscard]] std::size_t nonfinite() const noexcept { return nan + inf; }
  [[nodiscard]] bool all_finite() const noexcept { return nonfinite() == 0; }
  //! Fraction of elements that would underflow in half, in [0, 1].
  [[nodiscard]] double underflow_in_half_share() const noexcept {
    return size ? static_cast<double>(underflow_in_half) / static_cast<double>(size) : 0.0;
  }
  [[nodiscard]] double overflow_in_half_share() const noexcept {
    return size ? static_cast<double>(overflow_in_half) / static_cast<double>(size) : 0.0;
  }
  friend bool operator==(numerics_stats const&, numerics_stats const&) = default;
};

//! One line: "size=… nan=… inf=… zero=… subnormal=… absmax=… min_abs_nonzero=…
//! underflow_in_half=… overflow_in_half=… at_max=…".
std::string to_string(numerics_stats const& s);
inline std::ostream& operator<<(std::ostream& os, numerics_stats const& s) { return os << to_string(s); }

namespace detail {
inline std::string shortest(float x) {
  char text[32];
  std::snprintf(text, sizeof text, "%.6g", static_cast<double>(x));
  return text;
}
}  // namespace detail

inline std::string to_string(numerics_stats const& s) {
  return "size=" + std::to_string(s.size) + " nan=" + std::to_string(s.nan) + " inf=" + std::to_string(s.inf) +
         " zero=" + std::to_string(s.zero) + " subnormal=" + std::to_string(s.subnormal) +
         " absmax=" + detail::shortest(s.absmax) + " min_abs_nonzero=" + detail::shortest(s.min_abs_nonzero) +
         " underflow_in_half=" + std::to_string(s.underflow_in_half) +
         " overflow_in_half=" + std::to_string(s.overflow_in_half) + " at_max=" + std::to_string(s.at_max);
}

namespace detail {

// The device-side accumulator: fixed-width counts and magnitudes, combined by an
// associative, commutative operation (sums, max, min), so the result is exact and
// independent of the reduction order.
struct stats_accumulator {
  unsigned long long size, nan, inf, zero, subnormal, underflow_in_half, overflow_in_half, at_max;
  float absmax;
  float min_abs_nonzero;  // +inf while no nonzero finite value was seen
};

struct stats_of_element {
  template <class T>
  MPX_HD stats_accumulator operator()(T x) const noexcept {
    stats_accumulator a{1, 0, 0, 0, 0, 0, 0, 0, 0.0f, dtype_traits<float>::infinity()};
    if (is_nan(x)) {
      a.nan = 1;
    } else if (is_inf(x)) {
      a.inf = 1;
    } else if (is_zero(x)) {
      a.zero = 1;
    } else {
      float const magnitude = cast<float>(x) < 0 ? -cast<float>(x) : cast<float>(x);
      a.absmax = magnitude;
      a.min_abs_nonzero = magnitude;
      a.subnormal = is_subnormal(x) ? 1 : 0;
      half const as_half = cast<half>(x);
      a.underflow_in_half = is_zero(as_half) ? 1 : 0;
      a.overflow_in_half = is_inf(as_half) ? 1 : 0;
      a.at_max = (bits(x) & ~dtype_traits<T>::sign_mask) == dtype_traits<T>::max_bits ? 1 : 0;
    }
    return a;
  }
};

struct combine_stats {
  MPX_HD stats_accumulator operator()(stats_accumulator const& a, stats_accumulator const& b) const noexcept {
    return {a.size + b.size,
            a.nan + b.nan,
            a.inf + b.inf,
            a.zero + b.zero,
            a.subnormal + b.subnormal,
            a.underflow_in_half + b.underflow_in_half,
            a.overflow_in_half + b.overflow_in_half,
            a.at_max + b.at_max,
            a.absmax > b.absmax ? a.absmax : b.absmax,
            a.min_abs_nonzero < b.min_abs_nonzero ? a.min_abs_nonzero : b.min_abs_nonzero};
  }
};

}  // namespace detail

namespace detail {

inline constexpr stats_accumulator stats_identity{0, 0, 0, 0, 0, 0, 0, 0, 0.0f, dtype_traits<float>::infinity()};

inline numerics_stats to_numerics_stats(stats_accumulator const& a) {
  numerics_stats s;
  s.size = a.size;
  s.nan = a.nan;
  s.inf = a.inf;
  s.zero = a.zero;
  s.subnormal = a.subnormal;
  s.absmax = a.absmax;
  s.min_abs_nonzero = is_inf(a.min_abs_nonzero) ? 0.0f : a.min_abs_nonzero;
  s.underflow_in_half = a.underflow_in_half;
  s.overflow_in_half = a.overflow_in_half;
  s.at_max = a.at_max;
  return s;
}

}  // namespace detail

//! The numerics of x in one pass. Synchronises a cuda_executor's stream.
template <executor Exec, tensor_like X>
numerics_stats stats(Exec const& exec, X&& x) {
  return detail::to_numerics_stats(
      transform_reduce(exec, x, detail::stats_identity, detail::stats_of_element{}, detail::combine_stats{}));
}

}  // namespace mpx

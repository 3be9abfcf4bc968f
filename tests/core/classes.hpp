// For the tests of every bit pattern (test_dtype, test_fp8): all patterns of a type, the
// five classification functions as one set of flags per value, and the flags a value
// decoded in double must have.
#pragma once

#include <mpx/core/dtype.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

namespace core_classes {

enum flag : std::uint8_t { finite = 1, nan = 2, inf = 4, subnormal = 8, zero = 16 };

//! mpx's classification of x, on the executor.
struct classify {
  template <class T>
  MPX_HD std::uint8_t operator()(T x) const {
    return static_cast<std::uint8_t>((mpx::is_finite(x) ? finite : 0) | (mpx::is_nan(x) ? nan : 0) |
                                     (mpx::is_inf(x) ? inf : 0) | (mpx::is_subnormal(x) ? subnormal : 0) |
                                     (mpx::is_zero(x) ? zero : 0));
  }
};

//! The flags of a value decoded independently in double; min_normal: the format's.
inline std::uint8_t expected(double v, double min_normal) {
  return static_cast<std::uint8_t>((std::isfinite(v) ? finite : 0) | (std::isnan(v) ? nan : 0) |
                                   (std::isinf(v) ? inf : 0) |
                                   (v != 0 && std::fabs(v) < min_normal ? subnormal : 0) | (v == 0 ? zero : 0));
}

//! Every bit pattern of T, in order (256 for fp8, 65536 for the 16-bit types).
template <class T>
std::vector<T> all_patterns() {
  std::vector<T> out(std::size_t{1} << (8 * sizeof(T)));
  for (std::size_t p = 0; p < out.size(); ++p) out[p] = mpx::detail::from_bits<T>(static_cast<mpx::detail::bits_t<T>>(p));
  return out;
}

}  // namespace core_classes

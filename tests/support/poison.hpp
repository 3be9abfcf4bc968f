// The value an output element is poisoned with before a call (the tests' poisoned
// tensors, the fuzzers' guard bands): NaN with a payload no arithmetic produces where the
// format has room for one, so an element a call forgot to write fails every comparison
// with a number. fp8 formats: their NaN pattern from the dtype traits (e4m3 has only
// S.1111.111; e5m2's is S.11111.11); E8M0: its NaN; e2m1 pairs, which have no NaN: -3
// and -1.5; integers: 0x5A.
#pragma once

#include <mpx/core/block_formats.hpp>
#include <mpx/core/cast.hpp>
#include <mpx/core/dtype.hpp>

#include <cstdint>
#include <type_traits>

namespace mpx_test {

template <class T>
T poison() {
  if constexpr (std::is_same_v<T, float>) return mpx::detail::from_bits<float>(0x7FC0'DEADu);
  else if constexpr (mpx::dtype16<T>) return mpx::detail::from_bits<T>(std::uint16_t{0x7FAB});
  else if constexpr (mpx::dtype8<T>) return mpx::dtype_traits<T>::quiet_nan();
  else if constexpr (std::is_same_v<T, mpx::float8_e8m0>) return mpx::e8m0_from_bits(0xFF);
  else if constexpr (std::is_same_v<T, mpx::float4_e2m1x2>) return mpx::fp4x2_from_bits(0xDB);
  else return T(0x5A);
}

}  // namespace mpx_test

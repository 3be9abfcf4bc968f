// Stochastic rounding of a float to bfloat16 or half: up (in magnitude) with
// probability equal to the distance to the lower neighbour over the gap, so that an
// update below half an ulp still moves a 16-bit weight on average. The caller supplies
// the random bits (the optimizers draw them from Philox, core/philox.hpp).
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/config.hpp>
#include <mpx/core/dtype.hpp>

#include <cstdint>
#include <type_traits>

namespace mpx::detail {

//! Rounds x to bfloat16 or half, up (in magnitude) with probability equal to its
//! distance to the lower-magnitude neighbour over the gap between the neighbours;
//! `random` is 32 uniform bits. Non-finite values and overflow round as cast does.
template <class T>
MPX_HD inline T stochastic_round(float x, std::uint32_t random) noexcept {
  static_assert(std::is_same_v<T, bfloat16> || std::is_same_v<T, half>,
                "mpx: stochastic rounding is defined for bfloat16 and half");
  if constexpr (std::is_same_v<T, bfloat16>) {
    std::uint32_t const u = bit_cast<std::uint32_t>(x);
    if ((u & 0x7F80'0000u) == 0x7F80'0000u) return cast<bfloat16>(x);
    // Adding r < 2^16 to the 16 bits dropped carries into the kept ones exactly when
    // r >= 2^16 - dropped: probability dropped / 2^16. Carries reach inf only past max.
    return from_bits<bfloat16>(static_cast<std::uint16_t>((u + (random & 0xFFFFu)) >> 16));
  } else {
    T const nearest = cast<T>(x);
    float const n = cast<float>(nearest);
    if (n == x || !(n - n == 0)) return nearest;  // exact, or overflowed to inf, or NaN
    // The other neighbour is one code further from zero when |x| > |n|, one closer otherwise.
    bool const beyond = (x < 0 ? -x : x) > (n < 0 ? -n : n);
    T const other = from_bits<T>(static_cast<bits_t<T>>(beyond ? bits(nearest) + 1u : bits(nearest) - 1u));
    float const o = cast<float>(other);
    if (!(o - o == 0)) return nearest;  // the next code up is inf: x lies between max and the overflow threshold
    float const lo = beyond ? n : o, hi = beyond ? o : n;  // lower and higher magnitude
    float const p_up = (x - lo) / (hi - lo);               // both same sign: a ratio in (0, 1)
    float const u = static_cast<float>(random >> 8) * 0x1p-24f;
    return u < p_up ? (beyond ? other : nearest) : (beyond ? nearest : other);
  }
}

}  // namespace mpx::detail

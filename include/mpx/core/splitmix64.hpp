// SplitMix64 (Steele, Lea and Flood, 2014): a tiny generator defined by its integer
// arithmetic alone, so a seed gives the same numbers on every compiler and platform.
// The layers' initialisers use its mix as a counter-based hash; the batch loader's
// shuffle uses it as a sequential generator.
#pragma once

#include <mpx/core/config.hpp>

#include <cstdint>

namespace mpx {

class splitmix64 {
 public:
  constexpr explicit splitmix64(std::uint64_t seed) noexcept : state_(seed) {}

  //! The output for state x: x advanced by the golden-ratio increment, then mixed. Alone
  //! it is a strong 64-bit hash of x (draw i of a stream: mix(seed ^ f(i))).
  MPX_HD static constexpr std::uint64_t mix(std::uint64_t x) noexcept {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
  }

  constexpr std::uint64_t operator()() noexcept {
    std::uint64_t const x = state_;
    state_ += 0x9E3779B97F4A7C15ull;
    return mix(x);
  }
  //! A uniform integer in [0, n), n > 0, without modulo bias (draws below 2^64 mod n
  //! are rejected).
  constexpr std::uint64_t below(std::uint64_t n) noexcept {
    std::uint64_t const reject = (0 - n) % n;
    for (;;)
      if (std::uint64_t const r = (*this)(); r >= reject) return r % n;
  }

 private:
  std::uint64_t state_;
};

// The published first outputs for seed 1234567 (the reference implementation's test).
static_assert(splitmix64(1234567)() == 6457827717110365317ull);

}  // namespace mpx

// Weight initialisers as Keras names them (glorot_uniform, glorot_normal, he_uniform,
// he_normal, zeros, ones), reproducible from a seed on every platform and executor:
// the values are drawn on the host from a counter-based generator (splitmix64 of
// seed and element index, Box-Muller for normals), rounded once to the storage type,
// then copied to where the layer lives. std::mt19937 and std::normal_distribution are
// avoided because the standard leaves the distributions' algorithms unspecified.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/splitmix64.hpp>
#include <mpx/exec/copy.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/tensor.hpp>

#include <cmath>
#include <cstdint>
#include <string_view>

namespace mpx {

//! random_uniform: Keras's RandomUniform(-0.05, 0.05), the default of its Embedding.
enum class initializer { zeros, ones, glorot_uniform, glorot_normal, he_uniform, he_normal, random_uniform };

[[nodiscard]] constexpr std::string_view to_string(initializer i) noexcept {
  switch (i) {
    case initializer::zeros: return "zeros";
    case initializer::ones: return "ones";
    case initializer::glorot_uniform: return "glorot_uniform";
    case initializer::glorot_normal: return "glorot_normal";
    case initializer::he_uniform: return "he_uniform";
    case initializer::he_normal: return "he_normal";
    case initializer::random_uniform: return "random_uniform";
  }
  return "?";
}

namespace detail {

//! A uniform double in (0, 1) from 53 random bits of draw `i` of stream `seed`.
inline double uniform_open01(std::uint64_t seed, std::uint64_t i) noexcept {
  std::uint64_t const bits = splitmix64::mix(splitmix64::mix(seed) ^ (i * 0xD1342543DE82EF95ull + 1));
  return (static_cast<double>(bits >> 11) + 0.5) * 0x1.0p-53;
}

//! Keras's truncated normal would need rejection; like Keras's *_normal initialisers
//! (truncated at two standard deviations, stddev corrected by 0.8796), so do we.
inline double truncated_normal(std::uint64_t seed, std::uint64_t i) noexcept {
  constexpr double two_pi = 6.283185307179586476925;
  for (std::uint64_t attempt = 0;; ++attempt) {
    std::uint64_t const k = 2 * (i + (attempt << 40));
    double const z = std::sqrt(-2.0 * std::log(uniform_open01(seed, k))) * std::cos(two_pi * uniform_open01(seed, k + 1));
    if (std::fabs(z) <= 2.0) return z / 0.87962566103423978;
  }
}

}  // namespace detail

//! Fills x with `init` for a weight of fan_in inputs and fan_out outputs per unit
//! (Keras: dense [in, out] has fan_in = in; a conv kernel [kh, kw, cin, cout] has
//! fan_in = kh*kw*cin, fan_out = kh*kw*cout). Same seed, same values, everywhere.
template <executor Exec, tensor_like X>
void initialize(Exec const& exec, X&& x, initializer init, std::int64_t fan_in, std::int64_t fan_out,
                std::uint64_t seed) {
  using T = value_t<X>;
  auto v = mpx::view(x);
  tensor<T, host_space> values(v.shape());
  double const fi = static_cast<double>(fan_in > 0 ? fan_in : 1);
  double const fo = static_cast<double>(fan_out > 0 ? fan_out : 1);
  for (std::size_t i = 0; i < values.size(); ++i) {
    double r = 0;
    switch (init) {
      case initializer::zeros: r = 0; break;
      case initializer::ones: r = 1; break;
      case initializer::glorot_uniform: r = std::sqrt(6.0 / (fi + fo)) * (2 * detail::uniform_open01(seed, i) - 1); break;
      case initializer::he_uniform: r = std::sqrt(6.0 / fi) * (2 * detail::uniform_open01(seed, i) - 1); break;
      case initializer::glorot_normal: r = std::sqrt(2.0 / (fi + fo)) * detail::truncated_normal(seed, i); break;
      case initializer::he_normal: r = std::sqrt(2.0 / fi) * detail::truncated_normal(seed, i); break;
      case initializer::random_uniform: r = 0.05 * (2 * detail::uniform_open01(seed, i) - 1); break;
    }
    values[i] = cast<T>(static_cast<float>(r));
  }
  copy(exec, values, v);
  exec.synchronize();  // `values` is freed on return
}

}  // namespace mpx

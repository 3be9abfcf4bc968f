// What the benchmarks share about their tensors: the policy a storage type trains under,
// seeded random inputs on either executor, a check that an output is worth timing (finite,
// not all zero: a benchmark of a broken result measures nothing), and how a shape prints.
#pragma once

#include <mpx/mpx.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace mpx_bench {

//! The mixed policy that stores T (float: float32).
template <class T>
struct policy_for;
template <>
struct policy_for<float> {
  using type = mpx::float32;
};
template <>
struct policy_for<mpx::half> {
  using type = mpx::mixed_float16;
};
template <>
struct policy_for<mpx::bfloat16> {
  using type = mpx::mixed_bfloat16;
};

//! A tensor of T in the executor's space, seeded values in [-scale, scale): generated on
//! the host in float, copied over and rounded by mpx::cast.
template <class T, class Exec>
auto random_tensor(Exec const& exec, mpx::shape const& shape, std::uint64_t seed, float scale = 1.0f) {
  std::vector<float> host(shape.size());
  std::uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
  for (float& v : host) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    v = scale * static_cast<float>(static_cast<std::int64_t>(s >> 40) - (1 << 23)) * 0x1p-23f;
  }
  auto out = mpx::make_tensor<T>(exec, shape);
  if constexpr (std::is_same_v<T, float>) {
    mpx::copy(exec, mpx::tensor_view<float const>(host.data(), shape), out);
  } else {
    auto staged = mpx::make_tensor<float>(exec, shape);
    mpx::copy(exec, mpx::tensor_view<float const>(host.data(), shape), staged);
    mpx::cast(exec, staged, out);
  }
  exec.synchronize();  // the host vector goes out of scope
  return out;
}

//! Throws mpx::error unless x (up to 2^20 elements sampled evenly) is finite and not all
//! zero.
template <class Exec, class X>
void check_output(Exec const& exec, X const& x, std::string_view what) {
  auto const host = mpx::to_host(exec, x);
  std::size_t const n = host.size(), step = std::max<std::size_t>(1, n / (1u << 20));
  bool nonzero = false;
  for (std::size_t i = 0; i < n; i += step) {
    float const v = mpx::cast<float>(host.data()[i]);
    if (!std::isfinite(v))
      throw mpx::error(std::string(what) + " holds " + std::to_string(v) + " at " + std::to_string(i));
    nonzero |= v != 0.0f;
  }
  if (!nonzero && n > 0) throw mpx::error(std::string(what) + " is all zero");
}

//! "4x128x256".
inline std::string shape_text(std::initializer_list<std::int64_t> extents) {
  std::string out;
  for (auto e : extents) {
    if (!out.empty()) out.push_back('x');
    out.append(std::to_string(e));
  }
  return out;
}

}  // namespace mpx_bench

// Seeded inputs whose sums a test can know exactly: small multiples of a power of two,
// exact in half, bfloat16 and float, so float sums of them are exact while they stay
// below 2^24 units and a kernel's only rounding is the one to its output's dtype.
#pragma once

#include "testing.hpp"

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

namespace mpx_test {

//! n values k / denominator, k uniform in [-k_max, k_max] (k_max <= 256, denominator a
//! power of two), from a seeded generator.
template <class T>
std::vector<T> random_multiples(std::size_t n, int k_max, double denominator, std::uint64_t stream) {
  std::mt19937_64 gen(seed + stream);
  std::uniform_int_distribution<int> k(-k_max, k_max);
  std::vector<T> out(n);
  for (auto& v : out) v = mpx::cast<T>(k(gen) / denominator);
  return out;
}

}  // namespace mpx_test

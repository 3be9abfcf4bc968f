// The host's whole-array conversions (detail::widen_span, detail::round_span) against the
// element-wise casts they replace, bit for bit: every 16-bit pattern (NaNs and
// subnormals included) widened, and random floats rounded (ties, overflow, subnormals,
// NaNs with payloads), at sizes that are not a multiple of the eight-wide loop and from
// starts that are not 16-byte aligned. On an x86-64 CPU with F16C this tests the
// hardware path; elsewhere the element-wise loop.
#include "../support/testing.hpp"

#include <mpx/core/convert_span.hpp>

#include <cstring>
#include <limits>
#include <random>
#include <vector>

using mpx::bfloat16;
using mpx::half;

namespace {

std::uint32_t float_bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

//! A float drawn to hit every path of the rounding: ties and near-ties, values past the
//! 16-bit type's range, its subnormals, zeros, infinities and NaNs with payloads.
float awkward_float(std::mt19937& rng) {
  std::uint32_t u = rng();
  switch (rng() % 8) {
    case 0: u = (u & 0x8000'0000u) | 0x7F80'0000u | (rng() % 2 ? (u & 0x007F'FFFFu) : 0u); break;  // inf or NaN
    case 1: u = (u & 0x807F'FFFFu) | ((100u + rng() % 14) << 23); break;  // half's subnormal range
    case 2: u = (u & 0xFFFF'E000u) | 0x1000u; break;                      // half ties
    case 3: u = (u & 0xFFFF'0000u) | 0x8000u; break;                      // bfloat16 ties
    case 4: u = (u & 0x807F'FFFFu) | ((127u + 15u + rng() % 3) << 23); break;  // around half's max
    default: break;                                                              // any pattern
  }
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("widen_span gives every 16-bit pattern exactly as the element-wise cast", "[cast][span]",
                        mpx_test::dtypes16) {
  std::vector<TestType> all(65536 + 3);
  for (std::uint32_t p = 0; p < all.size(); ++p) all[p] = mpx::detail::from_bits<TestType>(static_cast<std::uint16_t>(p));
  for (std::size_t offset : {std::size_t{0}, std::size_t{1}, std::size_t{3}}) {
    std::size_t const n = 65536 - offset;
    std::vector<float> out(n + 1, 12345.0f);  // poisoned, and one past the end must stay so
    mpx::detail::widen_span(all.data() + offset, out.data(), n);
    for (std::size_t i = 0; i < n; ++i) {
      float const expected = mpx::detail::widen_16_to_float(all[offset + i]);
      INFO("pattern 0x" << std::hex << mpx::bits(all[offset + i]));
      REQUIRE(float_bits(out[i]) == float_bits(expected));
    }
    REQUIRE(out[n] == 12345.0f);
  }
}

TEMPLATE_LIST_TEST_CASE("widen_span gives every 8-bit pattern exactly as the element-wise cast", "[cast][span]",
                        mpx_test::dtypes8) {
  std::vector<TestType> all(256);
  for (std::uint32_t p = 0; p < all.size(); ++p) all[p] = mpx::detail::bit_cast<TestType>(static_cast<std::uint8_t>(p));
  std::vector<float> out(all.size() + 1, 12345.0f);
  mpx::detail::widen_span(all.data(), out.data(), all.size());
  for (std::size_t i = 0; i < all.size(); ++i) {
    INFO("pattern 0x" << std::hex << i);
    REQUIRE(float_bits(out[i]) == float_bits(mpx::detail::widen_8_to_float(all[i])));
  }
  REQUIRE(out[all.size()] == 12345.0f);
}

TEMPLATE_LIST_TEST_CASE("round_span rounds random floats exactly as the element-wise cast", "[cast][span]",
                        mpx_test::dtypes16) {
  std::mt19937 rng(20261123);
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{8}, std::size_t{9},
                        std::size_t{1000003}}) {
    std::vector<float> in(n + 1);
    for (float& x : in) x = awkward_float(rng);
    std::vector<TestType> out(n + 1, mpx::detail::from_bits<TestType>(0x1234));
    mpx::detail::round_span(in.data() + 1, out.data(), n);  // a start 4 bytes past alignment
    for (std::size_t i = 0; i < n; ++i) {
      TestType const expected = mpx::detail::round_float_to_16<TestType>(in[i + 1]);
      INFO("float bits 0x" << std::hex << float_bits(in[i + 1]));
      REQUIRE(mpx::bits(out[i]) == mpx::bits(expected));
    }
    REQUIRE(mpx::bits(out[n]) == 0x1234);
  }
}

TEST_CASE("widen_span and round_span copy float unchanged", "[cast][span]") {
  std::vector<float> in{1.0f, -0.0f, std::numeric_limits<float>::quiet_NaN(), 3.4e38f, 1e-45f};
  std::vector<float> out(in.size(), 7.0f), back(in.size(), 7.0f);
  mpx::detail::widen_span(in.data(), out.data(), in.size());
  mpx::detail::round_span(out.data(), back.data(), out.size());
  REQUIRE(std::memcmp(in.data(), back.data(), in.size() * sizeof(float)) == 0);
}

// mpx::cast on the host executor goes through the whole-array conversions for these pairs.
static_assert(mpx::detail::is_span_cast<mpx::ops::cast_to<half>, half, float>);
static_assert(mpx::detail::is_span_cast<mpx::ops::cast_to<float>, float, bfloat16>);
static_assert(!mpx::detail::is_span_cast<mpx::ops::cast_to<half>, half, bfloat16>);

// The block-scale formats (core/block_formats.hpp): every E8M0 pattern decoded against
// its definition (2^(b - 127), 255 NaN) and against cuda_fp8.h's own decoding; and the
// MX block exponent (the smallest e with amax <= max(Format) * 2^e) on every float
// exponent with the mantissas that decide it (just below, at and above max's) and
// random ones, for e4m3 and e5m2, against a search in double and against cuda_fp8.h's
// round-up conversion of amax / max(Format) to E8M0, which NVIDIA's recipe uses. And
// NVFP4's e2m1: every code decoded against its definition and cuda_fp4.h; rounding to
// nearest even on every representable value, every midpoint and its neighbours, random
// floats over every binade and the specials, against a search in double and against
// cuda_fp4.h's conversion; stochastic rounding's probabilities exactly, on a grid of
// random words.
#include "../support/reference/fp8_blocks.hpp"
#include "../support/reference/nvfp4.hpp"
#include "../support/testing.hpp"

#include <cuda_fp4.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

TEST_CASE("every E8M0 pattern is 2^(b - 127), and 255 is NaN, as cuda_fp8.h decodes it", "[fp8][block_formats]") {
  for (int b = 0; b < 256; ++b) {
    CAPTURE(b);
    auto const x = mpx::e8m0_from_bits(static_cast<std::uint8_t>(b));
    CHECK(mpx::e8m0_bits(x) == b);
    float const v = mpx::e8m0_to_float(x);
    float const cuda = mpx::cast<float>(
        mpx::detail::bit_cast<mpx::bfloat16>(__nv_cvt_e8m0_to_bf16raw(static_cast<__nv_fp8_storage_t>(b))));
    if (b == 255) {
      CHECK(std::isnan(v));
      CHECK(std::isnan(cuda));
    } else {
      CHECK(static_cast<double>(v) == std::ldexp(1.0, b - 127));
      CHECK(v == cuda);
    }
  }
}

namespace scale_format_cases {

//! Floats of every exponent with the mantissas that decide an MX exponent: zero, one,
//! max's mantissa and its neighbours, all ones, and a few random ones.
std::vector<float> deciding_floats(std::uint32_t max_mantissa) {
  std::vector<std::uint32_t> mantissas{0u, 1u, max_mantissa - 1u, max_mantissa, max_mantissa + 1u, 0x7F'FFFFu};
  std::mt19937 gen(20261128);
  for (int i = 0; i < 6; ++i) mantissas.push_back(gen() & 0x7F'FFFFu);
  std::vector<float> out;
  for (std::uint32_t e = 1; e < 255; ++e)
    for (std::uint32_t m : mantissas) out.push_back(mpx::detail::bit_cast<float>(e << 23 | m));
  return out;
}

template <class Format>
void check_mx_exponents() {
  double const max = mpx::detail::to_double(mpx::dtype_traits<Format>::max());
  std::uint32_t const max_mantissa = mpx::detail::bit_cast<std::uint32_t>(static_cast<float>(max)) & 0x7F'FFFFu;
  std::size_t checked = 0;
  for (float const a : deciding_floats(max_mantissa)) {
    int const e = mpx::detail::mx_block_exponent<Format>(a);
    int const want = mpx_test::reference::reference_mx_exponent(a, max);
    if (e != want) FAIL_CHECK("amax " << a << ": e = " << e << ", expected " << want);
    // cuda_fp8.h's round-up to E8M0 of amax / max: the double quotient crosses no power
    // of two (max is 7 * 2^n and amax has 24 bits), so it rounds up exactly; in E8M0's
    // range (what it saturates at is beyond the formats' blocks).
    if (want >= -127 && want <= 127) {
      auto const cuda = __nv_cvt_double_to_e8m0(static_cast<double>(a) / max, __NV_SATFINITE, cudaRoundPosInf);
      if (static_cast<int>(cuda) != want + 127)
        FAIL_CHECK("amax " << a << ": cuda_fp8.h gives byte " << int(cuda) << ", mpx " << want + 127);
    }
    ++checked;
  }
  CHECK(checked == 254u * 12u);
}

}  // namespace scale_format_cases

TEST_CASE("the MX block exponent is the smallest power of two that brings amax within the format",
          "[fp8][block_formats]") {
  scale_format_cases::check_mx_exponents<mpx::float8_e4m3>();
  scale_format_cases::check_mx_exponents<mpx::float8_e5m2>();
  // And what it means for a block: its largest value lands in (max / 2, max], never
  // past max, so nothing saturates.
  for (float const a : {1.0f, 448.0f, 449.0f, 3.0e38f, 0x1p-110f, 0.3f}) {
    int const e = mpx::detail::mx_block_exponent<mpx::float8_e4m3>(a);
    double const scaled = std::ldexp(static_cast<double>(a), -e);
    CAPTURE(a, e, scaled);
    CHECK(scaled <= 448.0);
    CHECK(scaled > 224.0);
  }
}

namespace e2m1_cases {

std::vector<float> rounding_cases() {
  std::vector<float> out;
  float const grid[] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  auto const around = [&](float v) {
    for (float s : {1.0f, -1.0f}) {
      out.push_back(s * v);
      out.push_back(s * std::nextafter(v, 0.0f));
      out.push_back(s * std::nextafter(v, 100.0f));
    }
  };
  for (int i = 0; i < 8; ++i) {
    around(grid[i]);
    if (i < 7) around((grid[i] + grid[i + 1]) / 2);  // every midpoint
  }
  for (float v : {0x1p-149f, 0x1p-126f, 7.0f, 6.5f, 1e30f, std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::infinity()})
    around(v);
  std::mt19937 gen(42);
  std::uniform_real_distribution<float> near(-8.0f, 8.0f);
  for (int i = 0; i < 50000; ++i) out.push_back(near(gen));
  for (int i = 0; i < 50000; ++i) {  // every binade, both signs
    std::uint32_t const b = gen() & 0xFF7F'FFFFu;
    out.push_back(mpx::detail::bit_cast<float>(b));
  }
  return out;
}

}  // namespace e2m1_cases

TEST_CASE("every e2m1 code decodes as defined and as cuda_fp4.h decodes it, and pairs pack low nibble first",
          "[nvfp4][block_formats]") {
  float const magnitudes[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int c = 0; c < 16; ++c) {
    CAPTURE(c);
    float const v = mpx::e2m1_to_float(static_cast<std::uint8_t>(c));
    float const want = (c & 8) ? -magnitudes[c & 7] : magnitudes[c & 7];
    CHECK(v == want);
    CHECK(std::signbit(v) == ((c & 8) != 0));
    float const cuda = mpx::cast<float>(mpx::detail::bit_cast<mpx::half>(
        __nv_cvt_fp4_to_halfraw(static_cast<__nv_fp4_storage_t>(c), __NV_E2M1).x));
    CHECK(v == cuda);
  }
  // cuda_fp4.h's pair: the first of two floats in the low four bits.
  auto const pair = __nv_cvt_float2_to_fp4x2(float2{1.0f, -6.0f}, __NV_E2M1, cudaRoundNearest);
  CHECK(pair == 0xF2);
  CHECK(mpx::fp4x2_bits(mpx::fp4x2_from_bits(0xF2)) == 0xF2);
}

TEST_CASE("float -> e2m1 rounds to nearest even and saturates, as a search in double and cuda_fp4.h do",
          "[nvfp4][block_formats]") {
  std::size_t mismatches = 0;
  for (float x : e2m1_cases::rounding_cases()) {
    std::uint8_t const got = mpx::e2m1_round(x);
    std::uint8_t const search = mpx_test::reference::nearest_e2m1_code(static_cast<double>(x));
    std::uint8_t const cuda = __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest);
    if (got != search || got != cuda) {
      if (++mismatches <= 5) {
        CAPTURE(x, int(got), int(search), int(cuda));
        CHECK(got == search);
        CHECK(got == cuda);
      }
    }
  }
  CHECK(mismatches == 0);
  // NaN becomes +6, as cuda_fp4.h's satfinite conversion makes it, whatever its sign.
  CHECK(mpx::e2m1_round(std::numeric_limits<float>::quiet_NaN()) == 7u);
  CHECK(mpx::e2m1_round(-std::numeric_limits<float>::quiet_NaN()) == 7u);
  CHECK(__nv_cvt_float_to_fp4(std::numeric_limits<float>::quiet_NaN(), __NV_E2M1, cudaRoundNearest) == 7u);
}

TEST_CASE("float -> e2m1 stochastically: up with probability (x - lower) / gap, exact values stay, 6 saturates",
          "[nvfp4][block_formats]") {
  // The top 24 bits of the random word decide: u = ((random >> 8) + 1/2) / 2^24. On the
  // grid of words i << 20 the count that round up is that of i with u_i < p, counted in
  // double; and it is p * 4096 to within one.
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> below_six(0.0f, 6.0f);
  std::vector<float> xs{0.0f, 0.1f, 0.25f, 0.5f, 0.75f, 1.2f, 2.5f, 3.999f, 5.0f, 5.999f, 0x1p-140f};
  for (int i = 0; i < 200; ++i) xs.push_back(below_six(gen));
  for (float x : xs)
    for (float sign : {1.0f, -1.0f}) {
      float const v = sign * x;
      CAPTURE(v);
      std::uint8_t const exact = mpx::e2m1_round(v);
      if (static_cast<double>(mpx::e2m1_to_float(exact)) == static_cast<double>(v)) {
        for (std::uint32_t i = 0; i < 4096; i += 7) CHECK(mpx::e2m1_stochastic_round(v, i << 20) == exact);
        continue;
      }
      // The neighbours, by search: the largest magnitude below |x| and the next code.
      int low = 0;
      for (int c = 0; c < 8; ++c)
        if (mpx::e2m1_to_float(static_cast<std::uint8_t>(c)) <= x) low = c;
      double const lo = mpx::e2m1_to_float(static_cast<std::uint8_t>(low));
      double const hi = mpx::e2m1_to_float(static_cast<std::uint8_t>(low + 1));
      double const p = (static_cast<double>(x) - lo) / (hi - lo);
      std::uint32_t ups = 0;
      for (std::uint32_t i = 0; i < 4096; ++i) {
        std::uint8_t const got = mpx::e2m1_stochastic_round(v, i << 20);
        std::uint8_t const magnitude = got & 7u;
        REQUIRE((magnitude == low || magnitude == low + 1));
        REQUIRE(((got & 8u) != 0) == std::signbit(v));
        ups += magnitude == low + 1 ? 1u : 0u;
      }
      std::uint32_t want = 0;
      for (std::uint32_t i = 0; i < 4096; ++i) want += (std::ldexp(static_cast<double>(i << 12) + 0.5, -24) < p) ? 1u : 0u;
      CHECK(ups == want);
      CHECK(std::fabs(static_cast<double>(ups) - p * 4096.0) <= 1.0);
    }
  for (float big : {6.0f, 6.5f, 1e20f, std::numeric_limits<float>::infinity()})
    for (std::uint32_t r : {0u, 0x8000'0000u, 0xFFFF'FFFFu}) {
      CHECK(mpx::e2m1_stochastic_round(big, r) == 7u);
      CHECK(mpx::e2m1_stochastic_round(-big, r) == 15u);
    }
}

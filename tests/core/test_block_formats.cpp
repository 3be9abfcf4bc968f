// The block-scale formats (core/block_formats.hpp): every E8M0 pattern decoded against
// its definition (2^(b - 127), 255 NaN) and against cuda_fp8.h's own decoding; and the
// MX block exponent (the smallest e with amax <= max(Format) * 2^e) on every float
// exponent with the mantissas that decide it (just below, at and above max's) and
// random ones, for e4m3 and e5m2, against a search in double and against cuda_fp8.h's
// round-up conversion of amax / max(Format) to E8M0, which NVIDIA's recipe uses.
#include "../support/reference/fp8_blocks.hpp"
#include "../support/testing.hpp"

#include <cmath>
#include <cstdint>
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

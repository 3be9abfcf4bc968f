// float -> half and float -> bfloat16 checked against an independent reference: the
// nearest representable value found by search in a table of every finite 16-bit value
// (decoded in double), ties to the even pattern, overflow past max + ulp/2 to inf.
// Boundary cases, every tie point, and 10^7 random floats per type, on each executor.
#include "../support/testing.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

using mpx::bfloat16;
using mpx::half;

namespace {

template <class T>
struct reference_rounding {
  std::vector<double> values;           // every finite non-negative value, ascending
  std::vector<std::uint16_t> patterns;  // their bit patterns

  reference_rounding() {
    using tr = mpx::dtype_traits<T>;
    for (std::uint32_t p = 0; p < tr::exponent_mask; ++p) {  // 0 .. max, in order
      int const exponent = static_cast<int>(p >> tr::mantissa_bits);
      double const mantissa = static_cast<double>(p & tr::mantissa_mask);
      double const v = exponent == 0 ? std::ldexp(mantissa, 1 - tr::exponent_bias - tr::mantissa_bits)
                                     : std::ldexp(1.0 + std::ldexp(mantissa, -tr::mantissa_bits),
                                                  exponent - tr::exponent_bias);
      values.push_back(v);
      patterns.push_back(static_cast<std::uint16_t>(p));
    }
  }

  //! Expected pattern of cast<T>(x), or nullopt-like 0xFFFF... for NaN (checked apart).
  std::uint16_t operator()(double x, bool saturate = false) const {
    using tr = mpx::dtype_traits<T>;
    std::uint16_t const sign = std::signbit(x) ? static_cast<std::uint16_t>(tr::sign_mask) : 0;
    double const a = std::fabs(x);
    double const max = values.back();
    double const half_ulp_of_max = (max - values[values.size() - 2]) / 2;
    if (a >= max + half_ulp_of_max)  // includes inf; max's pattern is odd, so the tie goes up
      return sign | static_cast<std::uint16_t>(saturate ? tr::exponent_mask - 1 : tr::exponent_mask);
    if (a >= max) return sign | patterns.back();
    auto const hi = std::upper_bound(values.begin(), values.end(), a);  // first value > a
    std::size_t const i_hi = static_cast<std::size_t>(hi - values.begin());
    std::size_t const i_lo = i_hi - 1;
    double const below = a - values[i_lo];
    double const above = values[i_hi] - a;
    std::size_t pick = below < above ? i_lo : above < below ? i_hi : (patterns[i_lo] % 2 == 0 ? i_lo : i_hi);
    return sign | patterns[pick];
  }
};

template <class T>
reference_rounding<T> const& reference() {
  static reference_rounding<T> const r;
  return r;
}

template <class T>
std::vector<float> boundary_inputs() {
  using tr = mpx::dtype_traits<T>;
  double const max = mpx::detail::to_double(tr::max());
  double const ulp_max = std::ldexp(1.0, std::ilogb(max) - tr::mantissa_bits);
  double const min_sub = mpx::detail::to_double(tr::min_subnormal());
  double const min_norm = mpx::detail::to_double(tr::min_normal());
  std::vector<double> const magnitudes = {
      0.0, min_sub, min_sub / 2, min_sub / 2 * 1.0000001, min_sub * 1.5, min_sub * 2.5, min_norm,
      min_norm - min_sub / 2, min_norm - min_sub, max, max + ulp_max / 4, max + ulp_max / 2, 1.0, 1.0 + std::ldexp(1.0, -tr::mantissa_bits - 1),
      static_cast<double>(std::numeric_limits<float>::max()), static_cast<double>(std::numeric_limits<float>::denorm_min()),
      static_cast<double>(std::numeric_limits<float>::min()), 1e-8, 1e8, 65504.0, 65519.0, 65520.0, 65536.0};
  std::vector<float> out;
  for (double m : magnitudes) {
    out.push_back(static_cast<float>(m));
    out.push_back(-static_cast<float>(m));
  }
  out.push_back(std::numeric_limits<float>::infinity());
  out.push_back(-std::numeric_limits<float>::infinity());
  out.push_back(std::numeric_limits<float>::quiet_NaN());
  out.push_back(-std::numeric_limits<float>::quiet_NaN());
  out.push_back(std::numeric_limits<float>::signaling_NaN());
  return out;
}

//! Every midpoint between neighbouring finite values of T (ties), both signs; exact in float.
template <class T>
std::vector<float> tie_inputs() {
  auto const& r = reference<T>();
  std::vector<float> out;
  for (std::size_t i = 0; i + 1 < r.values.size(); ++i) {
    float const mid = static_cast<float>((r.values[i] + r.values[i + 1]) / 2);
    REQUIRE(static_cast<double>(mid) == (r.values[i] + r.values[i + 1]) / 2);
    out.push_back(mid);
    out.push_back(-mid);
  }
  return out;
}

//! Half random bit patterns (every float class), half log-uniform magnitudes across
//! T's range and beyond, random signs.
template <class T>
std::vector<float> random_inputs(std::size_t n) {
  std::mt19937_64 gen(mpx_test::seed + sizeof(T) + mpx::dtype_traits<T>::mantissa_bits);
  using tr = mpx::dtype_traits<T>;
  double const lo = std::log2(mpx::detail::to_double(tr::min_subnormal())) - 2;
  double const hi = std::log2(mpx::detail::to_double(tr::max())) + 1;
  std::uniform_real_distribution<double> exponent(lo, std::min(hi, 127.9));
  std::vector<float> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    std::uint64_t const r = gen();
    if (i % 2) {
      out[i] = mpx::detail::from_bits<float>(static_cast<std::uint32_t>(r));
    } else {
      float const m = static_cast<float>(std::exp2(exponent(gen)));
      out[i] = (r & 1) ? -m : m;
    }
  }
  return out;
}

template <class Exec, class T>
void check_against_reference(std::vector<float> const& inputs) {
  Exec exec;
  auto const in = mpx_test::upload(exec, inputs);
  auto out = mpx::make_tensor<T>(exec, in.shape());
  mpx::fill(exec, out, mpx_test::poison<T>());
  mpx::cast(exec, in, out);
  auto const got = mpx_test::download(exec, out);
  auto const& ref = reference<T>();
  std::size_t mismatches = 0, checked_finite = 0;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    float const x = inputs[i];
    if (std::isnan(x)) {
      if (!mpx::is_nan(got[i]) && mismatches++ == 0) FAIL_CHECK("NaN input " << i << " gave " << mpx_test::describe(got[i]));
      continue;
    }
    checked_finite += std::isfinite(x);
    std::uint16_t const expected = ref(static_cast<double>(x));
    if (mpx::bits(got[i]) != expected && mismatches++ == 0)
      FAIL_CHECK("cast<" << mpx::dtype_name<T> << ">(" << x << " = 0x" << std::hex << mpx::bits(x) << ") gave 0x"
                         << mpx::bits(got[i]) << ", reference 0x" << expected);
  }
  CHECK(mismatches == 0);
  CHECK(checked_finite > 0);
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("float to half and bfloat16: boundary cases", "[cast]", mpx_test::executors) {
  check_against_reference<TestType, half>(boundary_inputs<half>());
  check_against_reference<TestType, bfloat16>(boundary_inputs<bfloat16>());
}

TEMPLATE_LIST_TEST_CASE("float to half and bfloat16: every tie rounds to even", "[cast]", mpx_test::executors) {
  check_against_reference<TestType, half>(tie_inputs<half>());
  check_against_reference<TestType, bfloat16>(tie_inputs<bfloat16>());
}

TEMPLATE_LIST_TEST_CASE("float to half and bfloat16: 10^7 random floats each", "[cast][slow]", mpx_test::executors) {
  check_against_reference<TestType, half>(random_inputs<half>(10'000'000));
  check_against_reference<TestType, bfloat16>(random_inputs<bfloat16>(10'000'000));
}

TEST_CASE("the reference itself rounds the textbook cases", "[cast]") {
  auto const& h = reference<half>();
  CHECK(h(65504.0) == 0x7BFF);
  CHECK(h(65519.99) == 0x7BFF);
  CHECK(h(65520.0) == 0x7C00);
  CHECK(h(1e-8) == 0x0000);        // below half the smallest subnormal
  CHECK(h(0x1p-25) == 0x0000);     // exactly half of it: ties to even (zero)
  CHECK(h(0x1.8p-24) == 0x0002);   // 1.5 subnormals: ties to even (two)
  CHECK(h(-1.0) == 0xBC00);
  CHECK(reference<bfloat16>()(1.0 + 0x1p-8) == 0x3F80);  // tie, stays even
}

TEST_CASE("constant-expression casts agree with the rules", "[cast]") {
  static_assert(mpx::bits(mpx::cast<half>(65520.0f)) == 0x7C00);
  static_assert(mpx::bits(mpx::cast<half>(1e-8)) == 0x0000);
  static_assert(mpx::bits(mpx::cast<bfloat16>(1.0f)) == 0x3F80);
  static_assert(mpx::cast<float>(mpx::cast<half>(0.1f)) == 0.0999755859375f);
  SUCCEED();
}

TEST_CASE("saturate_cast clamps to the finite range and keeps NaN", "[cast]") {
  using ht = mpx::dtype_traits<half>;
  CHECK(mpx::bits(mpx::saturate_cast<half>(1e6f)) == mpx::bits(ht::max()));
  CHECK(mpx::bits(mpx::saturate_cast<half>(-1e6f)) == mpx::bits(ht::lowest()));
  CHECK(mpx::bits(mpx::saturate_cast<half>(INFINITY)) == mpx::bits(ht::max()));
  CHECK(mpx::bits(mpx::saturate_cast<bfloat16>(-INFINITY)) == mpx::bits(mpx::dtype_traits<bfloat16>::lowest()));
  CHECK(mpx::is_nan(mpx::saturate_cast<half>(NAN)));
  CHECK(mpx::bits(mpx::saturate_cast<half>(1.0f)) == 0x3C00);
  auto const& ref = reference<half>();
  for (float x : random_inputs<half>(100000)) {
    if (std::isnan(x)) continue;
    INFO("x = " << x);
    REQUIRE(mpx::bits(mpx::saturate_cast<half>(x)) == ref(x, true));
  }
}

TEMPLATE_LIST_TEST_CASE("bfloat16 to half and double to 16 bits round once", "[cast]", mpx_test::executors) {
  TestType exec;
  // Every bfloat16 pattern into half.
  std::vector<bfloat16> all(65536);
  for (std::uint32_t p = 0; p < 65536; ++p) all[p] = mpx::detail::from_bits<bfloat16>(static_cast<std::uint16_t>(p));
  auto const in = mpx_test::upload(exec, all);
  auto out = mpx::make_tensor<half>(exec, in.shape());
  mpx::fill(exec, out, mpx_test::poison<half>());
  mpx::cast(exec, in, out);
  auto const got = mpx_test::download(exec, out);
  for (std::uint32_t p = 0; p < 65536; ++p) {
    double const x = mpx::detail::to_double(all[p]);
    INFO("bfloat16 pattern 0x" << std::hex << p);
    if (std::isnan(x)) REQUIRE(mpx::is_nan(got[p]));
    else REQUIRE(mpx::bits(got[p]) == reference<half>()(x));
  }
  // Doubles that a detour through float would round twice: just above a half tie.
  std::mt19937_64 gen(mpx_test::seed);
  std::vector<double> doubles;
  auto const& r = reference<half>();
  for (std::size_t i = 0; i + 1 < r.values.size(); i += 7) {
    double const mid = (r.values[i] + r.values[i + 1]) / 2;
    doubles.push_back(mid + mid * 0x1p-40);  // rounds up; via float it would tie to even
    doubles.push_back(-(mid - mid * 0x1p-40));
  }
  auto const din = mpx_test::upload(exec, doubles);
  auto dout = mpx::make_tensor<half>(exec, din.shape());
  mpx::fill(exec, dout, mpx_test::poison<half>());
  mpx::cast(exec, din, dout);
  auto const dgot = mpx_test::download(exec, dout);
  for (std::size_t i = 0; i < doubles.size(); ++i) {
    INFO("double " << doubles[i]);
    REQUIRE(mpx::bits(dgot[i]) == r(doubles[i]));
  }
}

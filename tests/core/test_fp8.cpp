// float8_e4m3 and float8_e5m2: every one of the 256 patterns of each classified and
// widened, checked against a decoding in double written here from the OCP definition;
// then float -> fp8 by mpx::cast and mpx::saturate_cast checked against a reference
// rounding in double (nearest of the finite magnitudes, ties to the even pattern,
// overflow decided against the value the exponent would give next) on every midpoint,
// the floats just beside each, the edges and 10^7 random floats, on each executor; and
// against cuda_fp8.h's own conversion, which the device path uses.
#include "../support/testing.hpp"
#include "classes.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

namespace fp8_cases {

using mpx::float8_e4m3;
using mpx::float8_e5m2;

// ---- the formats, from the OCP 8-bit floating point specification -------------------

struct format {
  int exponent_bits, mantissa_bits, bias;
  bool has_infinity;  // e5m2: IEEE's all-ones exponent; e4m3: only S.1111.111 is special (NaN)
};
template <class T>
constexpr format format_of = std::is_same_v<T, float8_e4m3> ? format{4, 3, 7, false} : format{5, 2, 15, true};

// The value of a pattern, independent of mpx.
template <class T>
double decode(std::uint32_t p) {
  constexpr format f = format_of<T>;
  double const sign = (p & 0x80u) ? -1.0 : 1.0;
  int const e = static_cast<int>((p >> f.mantissa_bits) & ((1u << f.exponent_bits) - 1));
  std::uint32_t const m = p & ((1u << f.mantissa_bits) - 1);
  int const e_all_ones = (1 << f.exponent_bits) - 1;
  if (f.has_infinity && e == e_all_ones) return m == 0 ? sign * INFINITY : NAN;
  if (!f.has_infinity && e == e_all_ones && m == (1u << f.mantissa_bits) - 1) return NAN;
  if (e == 0) return sign * std::ldexp(static_cast<double>(m), 1 - f.bias - f.mantissa_bits);
  return sign * std::ldexp(1.0 + std::ldexp(static_cast<double>(m), -f.mantissa_bits), e - f.bias);
}

static_assert(mpx::dtype_traits<float8_e4m3>::bits == 8 && mpx::dtype_traits<float8_e4m3>::exponent_bits == 4 &&
              mpx::dtype_traits<float8_e4m3>::mantissa_bits == 3 && mpx::dtype_traits<float8_e4m3>::exponent_bias == 7);
static_assert(mpx::dtype_traits<float8_e5m2>::exponent_bits == 5 && mpx::dtype_traits<float8_e5m2>::exponent_bias == 15);
static_assert(!mpx::dtype_traits<float8_e4m3>::has_infinity && mpx::dtype_traits<float8_e5m2>::has_infinity);
static_assert(mpx::dtype_traits<float8_e4m3>::has_nan && mpx::dtype_traits<float8_e5m2>::has_nan);
static_assert(mpx::cast<float>(mpx::dtype_traits<float8_e4m3>::max()) == 448.0f);
static_assert(mpx::cast<float>(mpx::dtype_traits<float8_e4m3>::lowest()) == -448.0f);
static_assert(mpx::cast<float>(mpx::dtype_traits<float8_e4m3>::min_normal()) == 0x1p-6f);
static_assert(mpx::cast<float>(mpx::dtype_traits<float8_e4m3>::min_subnormal()) == 0x1p-9f);
static_assert(mpx::cast<float>(mpx::dtype_traits<float8_e4m3>::epsilon()) == 0x1p-3f);
static_assert(mpx::cast<float>(mpx::dtype_traits<float8_e5m2>::max()) == 57344.0f);
static_assert(mpx::cast<float>(mpx::dtype_traits<float8_e5m2>::min_normal()) == 0x1p-14f);
static_assert(mpx::cast<float>(mpx::dtype_traits<float8_e5m2>::min_subnormal()) == 0x1p-16f);
static_assert(mpx::is_inf(mpx::dtype_traits<float8_e5m2>::infinity()));
static_assert(mpx::bits(mpx::dtype_traits<float8_e4m3>::quiet_nan()) == 0x7F);
static_assert(mpx::dtype_traits<float8_e4m3>::cuda_data_type == CUDA_R_8F_E4M3 &&
              mpx::dtype_traits<float8_e5m2>::cuda_data_type == CUDA_R_8F_E5M2);
static_assert(mpx::dtype_name<float8_e4m3> == "float8_e4m3fn" && mpx::dtype_name<float8_e5m2> == "float8_e5m2");
// Constant expressions follow the same rules: 464 is the tie between 448 and the 480
// e4m3 does not have (448's pattern is even), 61440 the one between 57344 and 65536.
static_assert(mpx::bits(mpx::cast<float8_e4m3>(464.0f)) == 0x7E);
static_assert(mpx::bits(mpx::cast<float8_e4m3>(-464.00003f)) == 0xFF);
static_assert(mpx::bits(mpx::cast<float8_e5m2>(61439.996f)) == 0x7B);
static_assert(mpx::bits(mpx::cast<float8_e5m2>(-61440.0f)) == 0xFC);
static_assert(mpx::bits(mpx::saturate_cast<float8_e4m3>(1e30)) == 0x7E);
static_assert(mpx::bits(mpx::cast<float8_e5m2>(mpx::cast<mpx::half>(-0.25f))) == 0xB4);
static_assert(mpx::cast<double>(mpx::cast<float8_e4m3>(0.1f)) == 0.1015625);

// ---- every pattern ------------------------------------------------------------------

template <class Exec, class T>
void check_every_fp8_pattern() {
  Exec exec;
  auto const input = mpx_test::upload(exec, core_classes::all_patterns<T>());
  auto classes = mpx::make_tensor<std::uint8_t>(exec, input.shape());
  mpx::fill(exec, classes, std::uint8_t{0xFF});
  mpx::transform(exec, classes, core_classes::classify{}, input);
  auto const got_classes = mpx_test::download(exec, classes);
  auto widened = mpx::make_tensor<float>(exec, input.shape());
  mpx::fill(exec, widened, mpx_test::poison<float>());
  mpx::cast(exec, input, widened);
  auto const floats = mpx_test::download(exec, widened);
  auto as_half = mpx::make_tensor<mpx::half>(exec, input.shape());
  mpx::cast(exec, input, as_half);
  auto const halves = mpx_test::download(exec, as_half);
  auto as_bf16 = mpx::make_tensor<mpx::bfloat16>(exec, input.shape());
  mpx::cast(exec, input, as_bf16);
  auto const bf16s = mpx_test::download(exec, as_bf16);
  auto back = mpx::make_tensor<T>(exec, input.shape());
  mpx::fill(exec, back, mpx::detail::from_bits<T>(0x5A));
  mpx::cast(exec, widened, back);
  auto const narrowed = mpx_test::download(exec, back);

  double const min_normal = std::ldexp(1.0, 1 - format_of<T>.bias);
  std::size_t nans = 0, infs = 0, subnormals = 0, zeros = 0;
  for (std::uint32_t p = 0; p < 256; ++p) {
    double const v = decode<T>(p);
    std::uint8_t const expected = core_classes::expected(v, min_normal);
    nans += std::isnan(v);
    infs += std::isinf(v);
    subnormals += (expected & core_classes::subnormal) != 0;
    zeros += v == 0;
    INFO(mpx::dtype_name<T> << " pattern 0x" << std::hex << p);
    REQUIRE(int(got_classes[p]) == int(expected));
    REQUIRE(std::signbit(floats[p]) == ((p & 0x80u) != 0));  // NaN keeps its sign too
    if (std::isnan(v)) {
      REQUIRE(std::isnan(floats[p]));
      REQUIRE(mpx::is_nan(halves[p]));
      REQUIRE(mpx::is_nan(bf16s[p]));
      REQUIRE(int(mpx::bits(narrowed[p])) == 0x7F);  // the canonical NaN
    } else {
      REQUIRE(static_cast<double>(floats[p]) == v);
      REQUIRE(mpx::detail::to_double(halves[p]) == v);
      REQUIRE(mpx::detail::to_double(bf16s[p]) == v);
      REQUIRE(int(mpx::bits(narrowed[p])) == int(p));
    }
  }
  // Guards against a decoding that agrees with a broken classifier.
  if constexpr (std::is_same_v<T, float8_e4m3>) {
    CHECK(nans == 2);  // S.1111.111 only
    CHECK(infs == 0);
  } else {
    CHECK(nans == 6);
    CHECK(infs == 2);
  }
  CHECK(subnormals == 2 * ((1u << format_of<T>.mantissa_bits) - 1));
  CHECK(zeros == 2);
}

// ---- the reference rounding -----------------------------------------------------------

template <class T>
struct fp8_reference {
  std::vector<double> values;  // every finite non-negative value, ascending (127 of them for e4m3)
  std::vector<std::uint8_t> patterns;
  double beyond = 0;           // the value after max if the exponent went on: the overflow side
  std::uint8_t max_pattern = 0;
  std::vector<double> padded;  // values, then +inf up to 128 entries

  fp8_reference() {
    for (std::uint32_t p = 0; p < 0x80; ++p) {
      double const v = decode<T>(p);
      if (!std::isfinite(v)) break;  // the patterns of non-negative finite values come first, in order
      REQUIRE((values.empty() || v > values.back()));
      values.push_back(v);
      patterns.push_back(static_cast<std::uint8_t>(p));
    }
    max_pattern = patterns.back();
    padded = values;
    padded.resize(128, INFINITY);
    beyond = values.back() + (values.back() - values[values.size() - 2]);  // max and the one below share a binade
  }

  //! The expected patterns of cast<T>(x) and of saturate_cast<T>(x).
  struct expected_pair {
    std::uint8_t cast, saturated;
  };
  expected_pair both(double x) const {
    if (std::isnan(x)) return {0x7F, 0x7F};
    std::uint8_t const sign = std::signbit(x) ? 0x80 : 0;
    double const a = std::fabs(x);
    std::uint8_t const overflow = format_of<T>.has_infinity ? 0x7C : 0x7F;
    expected_pair const overflowed{static_cast<std::uint8_t>(sign | overflow), static_cast<std::uint8_t>(sign | max_pattern)};
    if (a >= beyond) return overflowed;  // includes inf
    if (a >= values.back()) {  // between max and `beyond`: nearest, a tie to the even pattern
      double const below = a - values.back(), above = beyond - a;
      bool const up = above < below || (above == below && max_pattern % 2 == 1);
      return up ? overflowed : expected_pair{static_cast<std::uint8_t>(sign | max_pattern),
                                             static_cast<std::uint8_t>(sign | max_pattern)};
    }
    // The first value > a, by a binary search without branches (the magnitudes are
    // padded with +inf to 128).
    std::size_t i_hi = 0;
    for (std::size_t step = 64; step > 0; step /= 2) i_hi += padded[i_hi + step - 1] <= a ? step : 0;
    std::size_t const i_lo = i_hi - 1;
    double const below = a - values[i_lo], above = values[i_hi] - a;
    std::size_t const pick = below < above ? i_lo : above < below ? i_hi : (patterns[i_lo] % 2 == 0 ? i_lo : i_hi);
    auto const p = static_cast<std::uint8_t>(sign | patterns[pick]);
    return {p, p};
  }
  std::uint8_t operator()(double x, bool saturate) const {
    auto const e = both(x);
    return saturate ? e.saturated : e.cast;
  }
};

template <class T>
fp8_reference<T> const& fp8_ref() {
  static fp8_reference<T> const r;
  return r;
}

//! Every midpoint between neighbouring magnitudes (0 and the smallest subnormal, max and
//! the overflow side included), the floats just below and above each, both signs; and
//! the edges: zeros, infinities, NaNs, float's extremes.
template <class T>
std::vector<float> fp8_edge_inputs() {
  auto const& r = fp8_ref<T>();
  std::vector<double> points = r.values;
  points.push_back(r.beyond);
  std::vector<float> out;
  for (std::size_t i = 0; i + 1 < points.size(); ++i) {
    double const mid = (points[i] + points[i + 1]) / 2;
    auto const f = static_cast<float>(mid);
    REQUIRE(static_cast<double>(f) == mid);
    for (float x : {f, std::nextafter(f, 0.0f), std::nextafter(f, INFINITY), static_cast<float>(points[i])}) {
      out.push_back(x);
      out.push_back(-x);
    }
  }
  float const inf = std::numeric_limits<float>::infinity();
  for (float x : {0.0f, inf, std::numeric_limits<float>::max(), std::numeric_limits<float>::min(),
                  std::numeric_limits<float>::denorm_min(), static_cast<float>(r.beyond) * 4, 1e-30f, 1.0f}) {
    out.push_back(x);
    out.push_back(-x);
  }
  out.push_back(std::numeric_limits<float>::quiet_NaN());
  out.push_back(-std::numeric_limits<float>::quiet_NaN());
  out.push_back(std::numeric_limits<float>::signaling_NaN());
  out.push_back(mpx::detail::from_bits<float>(0xFFC0'1234u));
  return out;
}

//! n floats: half of them any bit pattern at all (every class, every binade), half with
//! an exponent where fp8 lives (from below half the smallest subnormal of e5m2 to past
//! the overflow of e5m2), random mantissa and sign.
inline std::vector<float> fp8_random_inputs(std::size_t n) {
  std::mt19937_64 gen(mpx_test::seed + 8);
  std::vector<float> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    std::uint64_t const r = gen();
    auto bits = static_cast<std::uint32_t>(r);
    if (i % 2 == 0) {
      std::uint32_t const exponent = 127u - 20u + static_cast<std::uint32_t>((r >> 32) % 40u);  // 2^-20 ... 2^19
      bits = (bits & 0x807F'FFFFu) | (exponent << 23);
    }
    out[i] = mpx::detail::from_bits<float>(bits);
  }
  return out;
}

//! saturate_cast as an elementwise op, for the executors.
template <class T>
struct saturate_to {
  MPX_HD T operator()(float x) const noexcept { return mpx::saturate_cast<T>(x); }
};

template <class T>
std::string fp8_text(std::uint8_t p) {
  std::ostringstream os;
  os << "0x" << std::hex << int(p) << " (" << decode<T>(p) << ")";
  return os.str();
}

//! cast and saturate_cast of `inputs` on the executor, compared bit for bit with the
//! reference; the first mismatch is printed.
template <class Exec, class T>
void check_fp8_rounding(std::vector<float> const& inputs) {
  Exec exec;
  auto const in = mpx_test::upload(exec, inputs);
  auto rounded = mpx::make_tensor<T>(exec, in.shape());
  auto saturated = mpx::make_tensor<T>(exec, in.shape());
  mpx::fill(exec, rounded, mpx::detail::from_bits<T>(0x5A));
  mpx::fill(exec, saturated, mpx::detail::from_bits<T>(0x5A));
  mpx::cast(exec, in, rounded);
  mpx::transform(exec, saturated, saturate_to<T>{}, in);
  auto const got = mpx_test::download(exec, rounded);
  auto const got_saturated = mpx_test::download(exec, saturated);
  auto const& ref = fp8_ref<T>();
  std::size_t mismatches = 0, in_range = 0;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    auto const x = static_cast<double>(inputs[i]);
    in_range += std::fabs(x) > ref.values[1] / 2 && std::fabs(x) < ref.beyond;
    auto const pair = ref.both(x);
    for (bool saturate : {false, true}) {
      std::uint8_t const expected = saturate ? pair.saturated : pair.cast;
      std::uint8_t const actual = mpx::bits(saturate ? got_saturated[i] : got[i]);
      if (actual != expected && mismatches++ == 0)
        FAIL_CHECK((saturate ? "saturate_cast<" : "cast<") << mpx::dtype_name<T> << ">(" << inputs[i] << " = 0x"
                                                           << std::hex << mpx::bits(inputs[i]) << ") gave "
                                                           << fp8_text<T>(actual) << ", reference "
                                                           << fp8_text<T>(expected) << " (input " << std::dec << i
                                                           << ")");
    }
  }
  CHECK(mismatches == 0);
  CHECK(in_range * 4 > inputs.size() / 10);  // guard: the inputs exercise the rounding, not only its edges
}

}  // namespace fp8_cases

TEMPLATE_LIST_TEST_CASE("every float8_e4m3 and float8_e5m2 pattern classifies, widens exactly and round-trips",
                        "[dtype][fp8]", mpx_test::executors) {
  fp8_cases::check_every_fp8_pattern<TestType, mpx::float8_e4m3>();
  fp8_cases::check_every_fp8_pattern<TestType, mpx::float8_e5m2>();
}

TEST_CASE("the fp8 reference rounds the textbook cases", "[cast][fp8]") {
  auto const& e4 = fp8_cases::fp8_ref<mpx::float8_e4m3>();
  auto const& e5 = fp8_cases::fp8_ref<mpx::float8_e5m2>();
  CHECK(e4.values.size() == 127);
  CHECK(e4.values.back() == 448);
  CHECK(e4.beyond == 480);
  CHECK(e5.values.size() == 124);
  CHECK(e5.values.back() == 57344);
  CHECK(e4(464, false) == 0x7E);      // tie, 448's pattern is even
  CHECK(e4(464.001, false) == 0x7F);  // past the tie: NaN, e4m3's only overflow
  CHECK(e4(-1e9, false) == 0xFF);
  CHECK(e4(-1e9, true) == 0xFE);
  CHECK(e5(61440, false) == 0x7C);  // tie, 57344's pattern is odd: up, to inf
  CHECK(e5(61439.9, true) == 0x7B);
  CHECK(e4(0x1p-10, false) == 0x00);    // half the smallest subnormal: tie to zero
  CHECK(e4(0x1.8p-9, false) == 0x02);   // 1.5 subnormals: tie to two
  CHECK(e5(-0x1p-17, false) == 0x80);
  CHECK(e4(1.0625, false) == 0x38);     // 1 + ulp/2: tie, stays at 1
  CHECK(e4(1.1875, false) == 0x3A);     // 1 + 3 ulp/2: up to even
}

TEMPLATE_LIST_TEST_CASE("float to fp8: every midpoint, the floats beside it and the edges", "[cast][fp8]",
                        mpx_test::executors) {
  fp8_cases::check_fp8_rounding<TestType, mpx::float8_e4m3>(fp8_cases::fp8_edge_inputs<mpx::float8_e4m3>());
  fp8_cases::check_fp8_rounding<TestType, mpx::float8_e5m2>(fp8_cases::fp8_edge_inputs<mpx::float8_e5m2>());
}

TEMPLATE_LIST_TEST_CASE("float to fp8: 10^7 random floats, cast and saturate_cast, both formats", "[cast][fp8]",
                        mpx_test::executors) {
  auto const inputs = fp8_cases::fp8_random_inputs(10'000'000);
  fp8_cases::check_fp8_rounding<TestType, mpx::float8_e4m3>(inputs);
  fp8_cases::check_fp8_rounding<TestType, mpx::float8_e5m2>(inputs);
}

TEST_CASE("mpx's fp8 rounding is cuda_fp8.h's: __NV_NOSAT for cast, __NV_SATFINITE for saturate_cast", "[cast][fp8]") {
  // The device path rounds with the header's conversion; its software form runs here.
  std::vector<float> inputs = fp8_cases::fp8_random_inputs(1'000'000);
  for (float x : fp8_cases::fp8_edge_inputs<mpx::float8_e4m3>()) inputs.push_back(x);
  for (float x : fp8_cases::fp8_edge_inputs<mpx::float8_e5m2>()) inputs.push_back(x);
  std::size_t mismatches = 0;
  for (float x : inputs) {
    auto check = [&](auto t, __nv_fp8_interpretation_t kind) {
      using T = decltype(t);
      auto const nosat = static_cast<std::uint8_t>(__nv_cvt_float_to_fp8(x, __NV_NOSAT, kind));
      auto const satfinite = static_cast<std::uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, kind));
      if ((mpx::bits(mpx::cast<T>(x)) != nosat || mpx::bits(mpx::saturate_cast<T>(x)) != satfinite) &&
          mismatches++ == 0)
        FAIL_CHECK(mpx::dtype_name<T> << " of " << x << ": mpx 0x" << std::hex << int(mpx::bits(mpx::cast<T>(x)))
                                      << "/0x" << int(mpx::bits(mpx::saturate_cast<T>(x))) << ", cuda_fp8.h 0x"
                                      << int(nosat) << "/0x" << int(satfinite));
    };
    check(mpx::float8_e4m3{}, __NV_E4M3);
    check(mpx::float8_e5m2{}, __NV_E5M2);
  }
  CHECK(mismatches == 0);
}

TEMPLATE_LIST_TEST_CASE("half and double to fp8 round once", "[cast][fp8]", mpx_test::executors) {
  TestType exec;
  std::vector<mpx::half> halves(65536);
  for (std::uint32_t p = 0; p < 65536; ++p) halves[p] = mpx::detail::from_bits<mpx::half>(static_cast<std::uint16_t>(p));
  auto const in = mpx_test::upload(exec, halves);
  auto check = [&](auto t) {
    using T = decltype(t);
    auto out = mpx::make_tensor<T>(exec, in.shape());
    mpx::cast(exec, in, out);
    auto const got = mpx_test::download(exec, out);
    for (std::uint32_t p = 0; p < 65536; ++p) {
      INFO(mpx::dtype_name<T> << " from half pattern 0x" << std::hex << p);
      REQUIRE(int(mpx::bits(got[p])) == int(fp8_cases::fp8_ref<T>()(mpx::detail::to_double(halves[p]), false)));
    }
    // Doubles just beside a midpoint, which a detour through float would turn into ties.
    std::vector<double> doubles;
    auto const& r = fp8_cases::fp8_ref<T>();
    for (std::size_t i = 0; i + 1 < r.values.size(); ++i) {
      double const mid = (r.values[i] + r.values[i + 1]) / 2;
      doubles.push_back(mid + mid * 0x1p-40);
      doubles.push_back(-(mid - mid * 0x1p-40));
    }
    auto const din = mpx_test::upload(exec, doubles);
    auto dout = mpx::make_tensor<T>(exec, din.shape());
    mpx::cast(exec, din, dout);
    auto const dgot = mpx_test::download(exec, dout);
    for (std::size_t i = 0; i < doubles.size(); ++i) {
      INFO(mpx::dtype_name<T> << " from double " << doubles[i]);
      REQUIRE(int(mpx::bits(dgot[i])) == int(r(doubles[i], false)));
    }
  };
  mpx_test::for_each_dtype_in<mpx_test::dtypes8>(check);
}

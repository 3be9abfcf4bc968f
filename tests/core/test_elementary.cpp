// exp_float, exp_neg_half_square and erfc_float (core/elementary.hpp), run by each
// executor over a sweep of float bit patterns and the special values, against float64's
// std::exp and std::erfc, outputs poisoned first. Errors are counted in ulps of the
// float64 reference (below the smallest normal, in units of the smallest subnormal).
// Bounds asserted: exp_float and exp_neg_half_square 2 ulp, erfc_float 8 ulp.
#include "../support/testing.hpp"

#include <mpx/core/elementary.hpp>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

namespace {

enum class elementary_fn : int { exp, exp_neg_half_square, erfc };

struct elementary_body {
  float const* x;
  float* y;
  elementary_fn fn;
  MPX_HD void operator()(std::size_t i) const {
    float const v = x[i];
    y[i] = fn == elementary_fn::exp ? mpx::exp_float(v)
           : fn == elementary_fn::erfc ? mpx::erfc_float(v)
                                       : mpx::exp_neg_half_square(v);
  }
};

double elementary_reference(elementary_fn fn, double x) {
  switch (fn) {
    case elementary_fn::exp: return std::exp(x);
    case elementary_fn::erfc: return std::erfc(x);
    default: return std::exp(-0.5 * x * x);
  }
}

// |got - ref| in units of float's ulp at ref (2^-149 at the least); a reference that
// rounds to inf in float must give inf exactly.
double ulps_off(float got, double ref) {
  float const rounded = static_cast<float>(ref);
  if (std::isinf(rounded)) return got == rounded ? 0 : std::numeric_limits<double>::infinity();
  if (std::isnan(got) || std::isinf(got)) return std::numeric_limits<double>::infinity();
  double const a = std::fabs(ref) < FLT_MIN ? FLT_MIN : std::fabs(ref);
  int e = 0;
  std::frexp(a, &e);
  return std::fabs(static_cast<double>(got) - ref) / std::ldexp(1.0, e - 24);
}

// Every `stride`-th float bit pattern in [lo, hi] (lo < 0 <= hi or lo >= 0), and the
// values where the functions change form or stop being finite.
std::vector<float> sweep(float lo, float hi, std::uint32_t stride) {
  std::vector<float> out;
  for (std::uint32_t b = mpx::bits(std::fabs(lo)); lo < 0 && b > stride; b -= stride)
    out.push_back(-mpx::detail::from_bits<float>(b));
  for (std::uint32_t b = lo < 0 ? 0u : mpx::bits(lo); mpx::detail::from_bits<float>(b) <= hi; b += stride)
    out.push_back(mpx::detail::from_bits<float>(b));
  for (float v : {0.0f, -0.0f, 0.5f, -0.5f, 1e-30f, -1e-30f, 10.5f, -10.5f, 15.0f, 88.72f, 88.73f, 88.8f, -87.33f,
                  -103.0f, -103.97f, -104.0f, -104.5f, 9.19f, 9.3f})
    out.push_back(v);
  return out;
}

template <class Exec>
void check_elementary(elementary_fn fn, char const* name, float lo, float hi, double bound) {
  Exec exec;
  std::vector<float> inputs = sweep(lo, hi, 4099);
  INFO(name << " over " << inputs.size() << " inputs in [" << lo << ", " << hi << "]");
  auto const x = mpx_test::upload(exec, inputs);
  auto y = mpx::make_tensor<float>(exec, x.shape());
  mpx::fill(exec, y, mpx_test::poison<float>());
  mpx::for_each_index(exec, inputs.size(), elementary_body{x.data(), y.data(), fn});
  auto const got = mpx_test::download(exec, y);
  double worst = 0;
  float worst_at = 0;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    double const e = ulps_off(got[i], elementary_reference(fn, inputs[i]));
    if (e > worst) worst = e, worst_at = inputs[i];
  }
  INFO("worst: " << worst << " ulp at x = " << worst_at);
  CHECK(worst <= bound);
  // Special values: NaN stays NaN, the limits are exact.
  std::vector<float> const special = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                                      -std::numeric_limits<float>::infinity(), 1e30f, -1e30f};
  auto const xs = mpx_test::upload(exec, special);
  auto ys = mpx::make_tensor<float>(exec, xs.shape());
  mpx::fill(exec, ys, mpx_test::poison<float>());
  mpx::for_each_index(exec, special.size(), elementary_body{xs.data(), ys.data(), fn});
  auto const s = mpx_test::download(exec, ys);
  CHECK(std::isnan(s[0]));
  for (std::size_t i = 1; i < special.size(); ++i) {
    INFO("x = " << special[i] << " gave " << s[i]);
    CHECK(s[i] == static_cast<float>(elementary_reference(fn, special[i])));
  }
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("exp_float is within 2 ulp of e^x, overflowing and underflowing as expf does",
                        "[elementary]", mpx_test::executors) {
  check_elementary<TestType>(elementary_fn::exp, "exp_float", -110.0f, 90.0f, 2.0);
}

TEMPLATE_LIST_TEST_CASE("exp_neg_half_square is within 2 ulp of e^(-x^2/2), also where x^2 is large",
                        "[elementary]", mpx_test::executors) {
  check_elementary<TestType>(elementary_fn::exp_neg_half_square, "exp_neg_half_square", -16.0f, 16.0f, 2.0);
}

TEMPLATE_LIST_TEST_CASE("erfc_float is within 8 ulp of erfc, in relative terms down its tail", "[elementary]",
                        mpx_test::executors) {
  check_elementary<TestType>(elementary_fn::erfc, "erfc_float", -11.0f, 11.0f, 8.0);
}

TEST_CASE("exp_float takes a low part: e^(hi + lo) keeps the bits float cannot hold in hi + lo", "[elementary]") {
  // e^(-z^2) for z = 9.1 with z^2 split exactly (the use erfc_float makes of it).
  float const z = 9.1f;
  float const z_hi = mpx::detail::from_bits<float>(mpx::bits(z) & 0xFFFF'F000u);
  float const z_lo = z - z_hi;
  float const got = mpx::exp_float(-(z_hi * z_hi), -(z_lo * (z + z_hi)));
  double const zd = z;
  CHECK(ulps_off(got, std::exp(-zd * zd)) <= 2.0);
  // The one-float argument loses about 2^-24 * 83 of it: many ulps of the result.
  CHECK(ulps_off(mpx::exp_float(-(z * z)), std::exp(-zd * zd)) > 8.0);
}

TEST_CASE("add_rn adds a float and a double as a double, rounded once", "[elementary]") {
  STATIC_REQUIRE(std::is_same_v<decltype(mpx::add_rn(1.0f, 2.0)), double>);
  STATIC_REQUIRE(std::is_same_v<decltype(mpx::add_rn(2.0, 1.0f)), double>);
  STATIC_REQUIRE(std::is_same_v<decltype(mpx::add_rn(1.0f, 2.0f)), float>);
  // 2^-30 is lost in a float sum with 1 and kept in a double one.
  CHECK(mpx::add_rn(1.0f, 0x1p-30) == 1.0 + 0x1p-30);
  CHECK(mpx::add_rn(0x1p-30, 1.0f) == 1.0 + 0x1p-30);
  CHECK(mpx::add_rn(1.0f, static_cast<float>(0x1p-30)) == 1.0f);
  // The float widens exactly: its low bits survive.
  float const third = 1.0f / 3.0f;
  CHECK(mpx::add_rn(third, 0.0) == static_cast<double>(third));
  CHECK(std::isnan(mpx::add_rn(std::numeric_limits<float>::quiet_NaN(), 1.0)));
}

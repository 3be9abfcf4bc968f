// dtype_traits values, and every one of the 65536 half and bfloat16 bit patterns
// classified and widened to float, checked against an independent decoding in double,
// then narrowed back to the same bits, on each executor.
#include "../support/testing.hpp"
#include "classes.hpp"

#include <cmath>

using mpx::bfloat16;
using mpx::half;

// The limits are constant expressions for every type.
static_assert(mpx::cast<float>(mpx::dtype_traits<half>::max()) == 65504.0f);
static_assert(mpx::cast<float>(mpx::dtype_traits<half>::lowest()) == -65504.0f);
static_assert(mpx::cast<float>(mpx::dtype_traits<half>::min_normal()) == 0x1p-14f);
static_assert(mpx::cast<float>(mpx::dtype_traits<half>::min_subnormal()) == 0x1p-24f);
static_assert(mpx::cast<float>(mpx::dtype_traits<half>::epsilon()) == 0x1p-10f);
static_assert(mpx::cast<float>(mpx::dtype_traits<bfloat16>::max()) == 0x1.FEp127f);
static_assert(mpx::cast<float>(mpx::dtype_traits<bfloat16>::min_normal()) == 0x1p-126f);
static_assert(mpx::cast<float>(mpx::dtype_traits<bfloat16>::min_subnormal()) == 0x1p-133f);
static_assert(mpx::cast<float>(mpx::dtype_traits<bfloat16>::epsilon()) == 0x1p-7f);
static_assert(mpx::dtype_traits<float>::max() == 0x1.FFFFFEp127f);
static_assert(mpx::dtype_traits<float>::min_subnormal() == 0x1p-149f);
static_assert(mpx::dtype_traits<float>::epsilon() == 0x1p-23f);
static_assert(mpx::dtype_traits<half>::bits == 16 && mpx::dtype_traits<float>::bits == 32);
static_assert(mpx::dtype_name<half> == "float16" && mpx::dtype_name<bfloat16> == "bfloat16" &&
              mpx::dtype_name<float> == "float32");
static_assert(mpx::is_inf(mpx::dtype_traits<bfloat16>::infinity()) && mpx::is_nan(mpx::dtype_traits<half>::quiet_nan()));

namespace {

// Independent of mpx: the IEEE definition of a pattern's value, evaluated in double.
template <class T>
double decode(std::uint32_t pattern) {
  using tr = mpx::dtype_traits<T>;
  int const m_bits = tr::mantissa_bits;
  int const e_max = (1 << tr::exponent_bits) - 1;
  double const sign = (pattern >> (tr::bits - 1)) & 1 ? -1.0 : 1.0;
  int const exponent = static_cast<int>((pattern >> m_bits) & static_cast<std::uint32_t>(e_max));
  double const mantissa = static_cast<double>(pattern & ((1u << m_bits) - 1));
  if (exponent == e_max) return mantissa == 0 ? sign * INFINITY : NAN;
  if (exponent == 0) return sign * std::ldexp(mantissa, 1 - tr::exponent_bias - m_bits);
  return sign * std::ldexp(1.0 + std::ldexp(mantissa, -m_bits), exponent - tr::exponent_bias);
}

template <class Exec, class T>
void check_every_pattern() {
  Exec exec;
  auto patterns = core_classes::all_patterns<T>();
  auto const input = mpx_test::upload(exec, patterns);

  auto classes = mpx::make_tensor<std::uint8_t>(exec, input.shape());
  mpx::fill(exec, classes, std::uint8_t{0xFF});  // poison: no valid combination of flags
  mpx::transform(exec, classes, core_classes::classify{}, input);
  auto const got_classes = mpx_test::download(exec, classes);

  auto widened = mpx::make_tensor<float>(exec, input.shape());
  mpx::fill(exec, widened, mpx_test::poison<float>());
  mpx::cast(exec, input, widened);
  auto const got_floats = mpx_test::download(exec, widened);

  auto narrowed = mpx::make_tensor<T>(exec, input.shape());
  mpx::fill(exec, narrowed, mpx_test::poison<T>());
  mpx::cast(exec, widened, narrowed);
  auto const got_back = mpx_test::download(exec, narrowed);

  std::size_t nan_count = 0, inf_count = 0, subnormal_count = 0, zero_count = 0;
  for (std::uint32_t p = 0; p < 65536; ++p) {
    double const value = decode<T>(p);
    std::uint8_t const expected =
        core_classes::expected(value, mpx::detail::to_double(mpx::dtype_traits<T>::min_normal()));
    nan_count += std::isnan(value);
    inf_count += std::isinf(value);
    subnormal_count += (expected & core_classes::subnormal) != 0;
    zero_count += value == 0;
    INFO("pattern 0x" << std::hex << p);
    REQUIRE(int(got_classes[p]) == int(expected));
    if (std::isnan(value)) {
      REQUIRE(std::isnan(got_floats[p]));
      REQUIRE(mpx::is_nan(got_back[p]));
    } else {
      REQUIRE(static_cast<double>(got_floats[p]) == value);
      REQUIRE(std::signbit(got_floats[p]) == std::signbit(value));
      REQUIRE(mpx::bits(got_back[p]) == p);
    }
  }
  // Guard against a decoder that agrees with a broken classifier by saying "finite" to all.
  constexpr int m = mpx::dtype_traits<T>::mantissa_bits;
  CHECK(nan_count == 2 * ((1u << m) - 1));
  CHECK(inf_count == 2);
  CHECK(subnormal_count == 2 * ((1u << m) - 1));
  CHECK(zero_count == 2);
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("every half pattern classifies and round-trips through float", "[dtype]",
                        mpx_test::executors) {
  check_every_pattern<TestType, half>();
}

TEMPLATE_LIST_TEST_CASE("every bfloat16 pattern classifies and round-trips through float", "[dtype]",
                        mpx_test::executors) {
  check_every_pattern<TestType, bfloat16>();
}

TEST_CASE("float classification at the edges", "[dtype]") {
  using tr = mpx::dtype_traits<float>;
  CHECK(mpx::is_finite(tr::max()));
  CHECK(mpx::is_inf(tr::infinity()));
  CHECK(mpx::is_inf(-tr::infinity()));
  CHECK(mpx::is_nan(tr::quiet_nan()));
  CHECK(!mpx::is_finite(tr::quiet_nan()));
  CHECK(mpx::is_subnormal(tr::min_subnormal()));
  CHECK(!mpx::is_subnormal(tr::min_normal()));
  CHECK(mpx::is_zero(-0.0f));
}

TEST_CASE("ids, names, sizes and the visitor derive from the one dtype list", "[dtype]") {
  static_assert(mpx::dtype_count == 5);
  static_assert(mpx::dtype_id_of<half> == mpx::dtype_id::float16 && mpx::dtype_id_of<float> == mpx::dtype_id::float32);
  static_assert(mpx::dtype_id_of<mpx::float8_e4m3> == mpx::dtype_id::float8_e4m3 &&
                mpx::dtype_id_of<mpx::float8_e5m2> == mpx::dtype_id::float8_e5m2);
  static_assert(mpx::dtype<mpx::float8_e4m3> && mpx::dtype8<mpx::float8_e5m2> && !mpx::dtype16<mpx::float8_e5m2>);
  static_assert(!mpx::dtype<double> && !mpx::dtype<int> && mpx::dtype16<bfloat16>);
  std::vector<std::string> seen;
  for (mpx::dtype_id id : mpx::all_dtype_ids) {
    mpx::visit_dtype(id, [&](auto t) {
      using T = decltype(t);
      CHECK(mpx::dtype_id_of<T> == id);
      CHECK(mpx::to_string(id) == mpx::dtype_name<T>);
      CHECK(mpx::size_of(id) == sizeof(T));
      CHECK(mpx::dtype_traits<T>::bits == 8 * static_cast<int>(sizeof(T)));
    });
    seen.emplace_back(mpx::to_string(id));
  }
  CHECK(seen == std::vector<std::string>{"float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2"});
  CHECK(mpx::to_string(static_cast<mpx::dtype_id>(mpx::dtype_count)) == "unknown");
  CHECK(mpx::size_of(static_cast<mpx::dtype_id>(200)) == 0);
}

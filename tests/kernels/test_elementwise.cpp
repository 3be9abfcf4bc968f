// fill, cast, scale, axpy and transform for every dtype on each executor, over awkward
// sizes and misaligned views, against float64 references, outputs poisoned first.
#include "../support/testing.hpp"

#include <cmath>

namespace {

// Distance in representable values between two finite values of T (0 = identical).
template <class T>
std::int64_t ulp_distance(T a, T b) {
  auto ordered = [](T x) {
    auto const b = static_cast<std::int64_t>(mpx::bits(x));
    std::int64_t const sign = static_cast<std::int64_t>(mpx::dtype_traits<T>::sign_mask);
    return (b & sign) ? -(b & (sign - 1)) : b;
  };
  return std::llabs(ordered(a) - ordered(b));
}

template <class T>
void require_within_one_ulp(std::vector<T> const& got, std::vector<double> const& exact) {
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    T const expected = mpx::cast<T>(exact[i]);
    bool const ok = !mpx::is_nan(got[i]) && (mpx::bits(got[i]) == mpx::bits(expected) ||
                                             (mpx::is_finite(expected) && ulp_distance(got[i], expected) <= 1));
    if (!ok && bad++ == 0) first = i;
  }
  INFO(bad << " elements off by more than one ulp; first at " << first << ": got "
            << (got.empty() ? std::string() : mpx_test::describe(got[first])) << ", exact "
            << (exact.empty() ? 0.0 : exact[first]));
  REQUIRE(bad == 0);
}

struct weighted_sum {  // a user-style functor with inputs of two types
  MPX_HD float operator()(mpx::half a, float b) const { return 2.0f * mpx::cast<float>(a) - b; }
};

}  // namespace

TEMPLATE_LIST_TEST_CASE("fill writes every element, whatever the size and alignment", "[elementwise]",
                        mpx_test::executors) {
  TestType exec;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    for (std::size_t n : mpx_test::awkward_sizes()) {
      for (std::size_t offset : {0, 1, 3}) {
        auto storage = mpx::make_tensor<T>(exec, {static_cast<std::int64_t>(n + offset)});
        mpx::fill(exec, storage, mpx_test::poison<T>());
        auto v = mpx::view(storage).flat(offset, n);
        T const value = mpx::cast<T>(-1.5f);
        mpx::fill(exec, v, value);
        auto const got = mpx_test::download(exec, storage);
        std::vector<T> expected(n + offset, value);
        for (std::size_t i = 0; i < offset; ++i) expected[i] = mpx_test::poison<T>();  // untouched before the view
        INFO(mpx::dtype_name<T> << " n=" << n << " offset=" << offset);
        REQUIRE(mpx_test::first_mismatch(got, expected).empty());
      }
    }
  };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("cast between every pair of dtypes matches the float64 reference", "[elementwise]",
                        mpx_test::executors) {
  TestType exec;
  auto for_pair = [&](auto from_tag, auto to_tag) {
    using From = decltype(from_tag);
    using To = decltype(to_tag);
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{13}, std::size_t{4099}, std::size_t{100003}}) {
      for (std::size_t offset : {0, 1}) {
        // Magnitudes from far below half's subnormals to beyond its max: every regime.
        std::vector<From> values(n + offset);
        std::mt19937_64 gen(mpx_test::seed + n);
        std::uniform_real_distribution<double> exponent(-30, 20);
        for (auto& v : values) v = mpx::cast<From>((gen() & 1 ? -1 : 1) * std::exp2(exponent(gen)));
        auto const in = mpx_test::upload(exec, values);
        auto out = mpx::make_tensor<To>(exec, {static_cast<std::int64_t>(n)});
        mpx::fill(exec, out, mpx_test::poison<To>());
        mpx::cast(exec, mpx::view(in).flat(offset, n), out);
        std::vector<To> expected(n);
        for (std::size_t i = 0; i < n; ++i) expected[i] = mpx::cast<To>(mpx::detail::to_double(values[offset + i]));
        INFO(mpx::dtype_name<From> << " -> " << mpx::dtype_name<To> << " n=" << n << " offset=" << offset);
        REQUIRE(mpx_test::first_mismatch(mpx_test::download(exec, out), expected).empty());
      }
    }
  };
  auto for_target = [&](auto from_tag) { mpx_test::for_each_dtype([&](auto to_tag) { for_pair(from_tag, to_tag); }); };
  mpx_test::for_each_dtype(for_target);
}

TEMPLATE_LIST_TEST_CASE("scale and axpy are within one rounding of float64", "[elementwise]", mpx_test::executors) {
  TestType exec;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    for (std::size_t n : mpx_test::awkward_sizes()) {
      auto const x = mpx_test::random_values<T>(n, -100, 100, 1);
      auto const y = mpx_test::random_values<T>(n, -100, 100, 2);
      float const factor = 0.3f, alpha = -1.7f;

      auto xs = mpx_test::upload(exec, x);
      mpx::scale(exec, xs, factor);
      std::vector<double> scaled(n), axpy(n);
      for (std::size_t i = 0; i < n; ++i) {
        scaled[i] = mpx::detail::to_double(x[i]) * factor;
        axpy[i] = static_cast<double>(alpha) * mpx::detail::to_double(x[i]) + mpx::detail::to_double(y[i]);
      }
      INFO(mpx::dtype_name<T> << " n=" << n);
      require_within_one_ulp(mpx_test::download(exec, xs), scaled);

      auto const xd = mpx_test::upload(exec, x);
      auto yd = mpx_test::upload(exec, y);
      mpx::axpy(exec, alpha, xd, yd);
      require_within_one_ulp(mpx_test::download(exec, yd), axpy);

      // A reference that is all zeros would pass anything: make sure it is not.
      if (n > 8) REQUIRE(std::any_of(scaled.begin(), scaled.end(), [](double v) { return v != 0; }));
    }
  };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("transform applies a user functor to mixed input types", "[elementwise]",
                        mpx_test::executors) {
  TestType exec;
  for (std::size_t n : mpx_test::awkward_sizes()) {
    auto const a = mpx_test::random_values<mpx::half>(n + 1, -4, 4, 3);
    auto const b = mpx_test::random_values<float>(n + 1, -4, 4, 4);
    auto const ad = mpx_test::upload(exec, a);
    auto const bd = mpx_test::upload(exec, b);
    auto out = mpx::make_tensor<float>(exec, {static_cast<std::int64_t>(n)});
    mpx::fill(exec, out, mpx_test::poison<float>());
    // a at offset 1 and b at offset 0: misaligned relative to each other, scalar path.
    auto a1 = mpx::view(ad).flat(1, n);
    auto b0 = mpx::view(bd).flat(0, n);
    mpx::transform(exec, out, weighted_sum{}, a1, b0);
    std::vector<float> expected(n);
    for (std::size_t i = 0; i < n; ++i) expected[i] = static_cast<float>(2.0 * mpx::detail::to_double(a[i + 1]) - b[i]);
    INFO("n=" << n);
    REQUIRE(mpx_test::first_mismatch(mpx_test::download(exec, out), expected).empty());
  }
}

TEMPLATE_LIST_TEST_CASE("transform runs in place but refuses an output that overlaps an input otherwise",
                        "[elementwise]", mpx_test::executors) {
  TestType exec;
  auto buffer = mpx_test::upload(exec, std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8});
  auto const whole = mpx::view(buffer);
  mpx::scale(exec, whole, 2.0f);  // in place: fine
  REQUIRE(mpx_test::download(exec, buffer) == std::vector<float>{2, 4, 6, 8, 10, 12, 14, 16});
  // Shifted by one element: on a GPU a thread would read what another writes.
  REQUIRE_THROWS_AS(mpx::cast(exec, whole.flat(1, 7), whole.flat(0, 7)), mpx::invalid_argument);
  // The same bytes seen as another element size (a narrowing cast in place).
  auto as_half = mpx::tensor_view<mpx::half, mpx::memory_space_t<TestType>>(
      reinterpret_cast<mpx::half*>(buffer.data()), mpx::shape{8});
  REQUIRE_THROWS_AS(mpx::cast(exec, whole, as_half), mpx::invalid_argument);
  REQUIRE(mpx_test::download(exec, buffer) == std::vector<float>{2, 4, 6, 8, 10, 12, 14, 16});  // nothing written
}

TEMPLATE_LIST_TEST_CASE("NaN and inf pass through elementwise ops and are never hidden", "[elementwise]",
                        mpx_test::executors) {
  TestType exec;
  std::vector<float> const x = {1.0f, NAN, INFINITY, -INFINITY, 70000.0f, 1e-9f, -0.0f, 3.0f, 5.0f};
  auto xd = mpx_test::upload(exec, x);
  auto h = mpx::make_tensor<mpx::half>(exec, xd.shape());
  mpx::cast(exec, xd, h);
  auto const got = mpx_test::download(exec, h);
  CHECK(mpx::is_nan(got[1]));
  CHECK(mpx::bits(got[2]) == 0x7C00);
  CHECK(mpx::bits(got[3]) == 0xFC00);
  CHECK(mpx::bits(got[4]) == 0x7C00);  // overflow: inf, not a clamp
  CHECK(mpx::bits(got[5]) == 0x0000);  // underflow: zero
  CHECK(mpx::bits(got[6]) == 0x8000);  // -0 keeps its sign
  mpx::scale(exec, xd, 0.0f);
  auto const scaled = mpx_test::download(exec, xd);
  CHECK(std::isnan(scaled[1]));
  CHECK(std::isnan(scaled[2]));  // inf * 0 is NaN, as IEEE says
}

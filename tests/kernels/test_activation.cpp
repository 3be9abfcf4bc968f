// Activations (every one in mpx::activations), alone and fused with a bias add,
// forward and backward with the bias gradient, for every dtype on each executor, against
// float64 references (themselves checked by finite differences), outputs poisoned first.
//
// Error bound asserted per element (u_T: storage's unit roundoff, 2^-11 half, 2^-8
// bfloat16, 2^-24 float; u_f = 2^-24):
//   forward   |y - ref|  <= (u_T + 32 u_f) |ref| + 8 u_f |x f'(x)| + min_subnormal_T
//   backward  |dx - ref| <= (u_T + 32 u_f) |ref| + 32 u_f |dy| + min_subnormal_T
// (8 u_f |x f'(x)|: float's rounding of the argument, amplified by f's conditioning;
// 32 u_f |dy|: float's absolute error near a zero of f', as gelu' has at x = -0.75).
// Bias gradient: |db - ref| <= u_T |ref| + (4 sqrt(rows) + 64) u_f sum_i |dz_i| + the sum
// of the float part of each dz_i's bound (x + b is rounded to float before f' sees it).
#include "../support/reference/activation.hpp"
#include "../support/nn_reference.hpp"

#include <cmath>

namespace {

using mpx_test::to_d;
using mpx_test::uf;

// Calls f(Act{}, its float64 reference) for every activation in mpx::activations (the
// references: tests/support/reference/activation.hpp).
template <class F>
void for_each_activation(F&& f) {
  mpx_test::reference::for_each_listed_activation([&](auto a) { f(a, mpx_test::reference::activation_of(a)); });
}

template <class T>
double bound(double ref, double s) {
  return (mpx_test::unit_roundoff<T>() + 32 * uf) * std::fabs(ref) + 32 * uf * s + mpx_test::min_subnormal<T>();
}

}  // namespace

TEST_CASE("the float64 activation references agree with their finite differences", "[activation]") {
  for_each_activation([](auto, mpx_test::reference::activation ref) {
    for (double x = -7.93; x < 8; x += 0.37) {  // never within 1e-6 of relu's kink
      double const fd = mpx_test::finite_difference([&](double v) { return ref.f(v); }, x);
      INFO("x=" << x);
      REQUIRE(std::fabs(fd - ref.df(x)) <= 1e-7 * (1 + std::fabs(ref.df(x))));
    }
  });
}

TEMPLATE_LIST_TEST_CASE("activation forward and backward are within the documented bound of float64",
                        "[activation]", mpx_test::executors) {
  TestType exec;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    for_each_activation([&](auto a, auto ref) {
      using A = decltype(a);
        for (auto [rows, cols] : mpx_test::awkward_matrices()) {
        mpx::shape const s{static_cast<std::int64_t>(rows), static_cast<std::int64_t>(cols)};
        std::size_t const n = rows * cols;
        auto const x = mpx_test::random_values<T>(n, -8, 8, 11 + n);
        auto const dy = mpx_test::random_values<T>(n, -2, 2, 12 + n);
        auto const xd = mpx_test::upload(exec, x, s);
        auto const dyd = mpx_test::upload(exec, dy, s);
        auto y = mpx::make_tensor<T>(exec, s);
        auto dx = mpx::make_tensor<T>(exec, s);
        mpx::fill(exec, y, mpx_test::poison<T>());
        mpx::fill(exec, dx, mpx_test::poison<T>());
        mpx::activation_forward(exec, a, xd, y);
        mpx::activation_backward(exec, a, xd, dyd, dx);
        auto const got_y = mpx_test::download(exec, y);
        auto const got_dx = mpx_test::download(exec, dx);
        mpx_test::bound_checker fwd(std::string(A::name) + " forward " + std::string(mpx::dtype_name<T>));
        mpx_test::bound_checker bwd(std::string(A::name) + " backward " + std::string(mpx::dtype_name<T>));
        bool nonzero = false;
        for (std::size_t i = 0; i < n; ++i) {
          double const r = ref.f(to_d(x[i]));
          double const g = to_d(dy[i]) * ref.df(to_d(x[i]));
          nonzero |= r != 0 && g != 0;
          fwd.check(i, to_d(got_y[i]), r, bound<T>(r, 0) + 8 * uf * std::fabs(ref.df(to_d(x[i])) * to_d(x[i])));
          bwd.check(i, to_d(got_dx[i]), g, bound<T>(g, std::fabs(to_d(dy[i]))));
        }
        INFO("rows=" << rows << " cols=" << cols);
        MPX_REQUIRE_WITHIN(fwd);
        MPX_REQUIRE_WITHIN(bwd);
        if (n > 8) REQUIRE(nonzero);
      }
    });
  };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("bias + activation forward, backward and the bias gradient match float64", "[activation]",
                        mpx_test::executors) {
  TestType exec;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    for_each_activation([&](auto a, auto ref) {
      using A = decltype(a);
        for (auto [rows, cols] : mpx_test::awkward_matrices()) {
        mpx::shape const s{static_cast<std::int64_t>(rows), static_cast<std::int64_t>(cols)};
        mpx::shape const sb{static_cast<std::int64_t>(cols)};
        std::size_t const n = rows * cols;
        auto const x = mpx_test::random_values<T>(n, -6, 6, 21 + n);
        auto const b = mpx_test::random_values<T>(cols, -2, 2, 22 + n);
        auto const dy = mpx_test::random_values<T>(n, -2, 2, 23 + n);
        auto const xd = mpx_test::upload(exec, x, s);
        auto const bd = mpx_test::upload(exec, b, sb);
        auto const dyd = mpx_test::upload(exec, dy, s);
        auto y = mpx::make_tensor<T>(exec, s);
        auto dx = mpx::make_tensor<T>(exec, s);
        auto db = mpx::make_tensor<float>(exec, sb);  // a float bias gradient, as for float master weights
        auto db16 = mpx::make_tensor<T>(exec, sb);
        mpx::fill(exec, y, mpx_test::poison<T>());
        mpx::fill(exec, dx, mpx_test::poison<T>());
        mpx::fill(exec, db, mpx_test::poison<float>());
        mpx::fill(exec, db16, mpx_test::poison<T>());
        mpx::bias_activation_forward(exec, a, xd, bd, y);
        mpx::bias_activation_backward(exec, a, xd, bd, dyd, dx, db);
        mpx::bias_gradient(exec, dyd, db16);
        auto const got_y = mpx_test::download(exec, y);
        auto const got_dx = mpx_test::download(exec, dx);
        auto const got_db = mpx_test::download(exec, db);
        auto const got_db16 = mpx_test::download(exec, db16);

        std::string const name = std::string(A::name) + " " + std::string(mpx::dtype_name<T>);
        mpx_test::bound_checker fwd(name + " bias forward"), bwd(name + " bias backward");
        mpx_test::bound_checker dbc(name + " bias gradient"), db16c(name + " bias_gradient alone");
        std::vector<double> ref_db(cols, 0), abs_db(cols, 0), err_db(cols, 0), ref_sum(cols, 0), abs_sum(cols, 0);
        for (std::size_t i = 0; i < n; ++i) {
          std::size_t const j = i % cols;
          double const z = to_d(x[i]) + to_d(b[j]);
          double const r = ref.f(z);
          double const g = to_d(dy[i]) * ref.df(z);
          // x + b is rounded to float in the kernel: one more float rounding in f's argument.
          double const arg = std::fabs(ref.df(z)) * std::fabs(z) * uf;
          fwd.check(i, to_d(got_y[i]), r, bound<T>(r, 0) + 9 * arg);
          // The float part of dz's own bound (its rounding to T does not reach db).
          double const dz_err = 32 * uf * (std::fabs(g) + std::fabs(to_d(dy[i]))) + 4 * arg * std::fabs(to_d(dy[i]));
          bwd.check(i, to_d(got_dx[i]), g, bound<T>(g, std::fabs(to_d(dy[i]))) + 4 * arg * std::fabs(to_d(dy[i])));
          ref_db[j] += g;
          err_db[j] += dz_err;
          abs_db[j] += std::fabs(g);
          ref_sum[j] += to_d(dy[i]);
          abs_sum[j] += std::fabs(to_d(dy[i]));
        }
        double const sum_bound = 4 * std::sqrt(static_cast<double>(rows)) + 64;
        for (std::size_t j = 0; j < cols; ++j) {
          dbc.check(j, got_db[j], ref_db[j], uf * std::fabs(ref_db[j]) + sum_bound * uf * abs_db[j] + err_db[j]);
          db16c.check(j, to_d(got_db16[j]), ref_sum[j],
                      mpx_test::unit_roundoff<T>() * std::fabs(ref_sum[j]) + sum_bound * uf * abs_sum[j] +
                          mpx_test::min_subnormal<T>());
        }
        INFO("rows=" << rows << " cols=" << cols);
        MPX_REQUIRE_WITHIN(fwd);
        MPX_REQUIRE_WITHIN(bwd);
        MPX_REQUIRE_WITHIN(dbc);
        MPX_REQUIRE_WITHIN(db16c);
      }
    });
  };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("activations keep NaN, stay finite at +-1e4 and refuse bad shapes", "[activation]",
                        mpx_test::executors) {
  TestType exec;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    for_each_activation([&](auto a, auto) {
      using A = decltype(a);
      if constexpr (std::is_same_v<A, mpx::act::identity>) return;  // its dx is dy, whatever x holds
      INFO(A::name << " " << mpx::dtype_name<T>);
      // [2, 4]: a NaN in x at (0, 1); extremes elsewhere; a NaN in the bias at column 3.
      std::vector<float> const xf = {1e4f, NAN, -1e4f, 0.5f, -1e4f, 1e4f, 0.0f, -3.0f};
      std::vector<T> x;
      for (float v : xf) x.push_back(mpx::cast<T>(v));
      std::vector<T> const b = {mpx::cast<T>(0.0f), mpx::cast<T>(0.0f), mpx::cast<T>(0.0f), mpx::cast<T>(NAN)};
      std::vector<T> const dy(8, mpx::cast<T>(1.0f));
      auto const xd = mpx_test::upload(exec, x, {2, 4});
      auto const bd = mpx_test::upload(exec, b, {4});
      auto const dyd = mpx_test::upload(exec, dy, {2, 4});
      auto y = mpx::make_tensor<T>(exec, {2, 4});
      auto dx = mpx::make_tensor<T>(exec, {2, 4});
      auto db = mpx::make_tensor<float>(exec, {4});
      mpx::fill(exec, y, mpx_test::poison<T>());
      mpx::fill(exec, dx, mpx_test::poison<T>());
      mpx::activation_forward(exec, a, xd, y);
      mpx::activation_backward(exec, a, xd, dyd, dx);
      auto got_y = mpx_test::download(exec, y);
      auto got_dx = mpx_test::download(exec, dx);
      for (std::size_t i = 0; i < 8; ++i) {
        INFO("i=" << i);
        CHECK(mpx::is_nan(got_y[i]) == (i == 1));  // never a poison left, NaN only from NaN
        CHECK(mpx::is_nan(got_dx[i]) == (i == 1));
        if (i != 1) CHECK(mpx::is_finite(got_y[i]));
        if (i != 1) CHECK(mpx::is_finite(got_dx[i]));
      }
      mpx::bias_activation_forward(exec, a, xd, bd, y);
      mpx::bias_activation_backward(exec, a, xd, bd, dyd, dx, db);
      got_y = mpx_test::download(exec, y);
      got_dx = mpx_test::download(exec, dx);
      auto const got_db = mpx_test::download(exec, db);
      for (std::size_t i = 0; i < 8; ++i) {
        INFO("bias i=" << i);
        bool const nan_expected = i == 1 || i % 4 == 3;
        CHECK(mpx::is_nan(got_y[i]) == nan_expected);
        CHECK(mpx::is_nan(got_dx[i]) == nan_expected);
      }
      CHECK(!std::isnan(got_db[0]));
      CHECK(std::isnan(got_db[1]));
      CHECK(!std::isnan(got_db[2]));
      CHECK(std::isnan(got_db[3]));
    });

    auto x = mpx::make_tensor<T>(exec, {3, 4});
    auto bad_bias = mpx::make_tensor<T>(exec, {5});
    auto y = mpx::make_tensor<T>(exec, {3, 4});
    auto y_bad = mpx::make_tensor<T>(exec, {4, 3});
    auto db = mpx::make_tensor<T>(exec, {5});
    CHECK_THROWS_TYPE_WITH(mpx::bias_activation_forward(exec, mpx::act::relu{}, x, bad_bias, y), mpx::shape_error,
                           Catch::Contains("[5]") && Catch::Contains("[3, 4]"));
    CHECK_THROWS_TYPE_WITH(mpx::bias_activation_backward(exec, mpx::act::relu{}, x, bad_bias, y, y, db),
                           mpx::shape_error, Catch::Contains("[5]") && Catch::Contains("[3, 4]"));
    CHECK_THROWS_TYPE_WITH(mpx::activation_forward(exec, mpx::act::gelu{}, x, y_bad), mpx::shape_error,
                           Catch::Contains("[3, 4]") && Catch::Contains("[4, 3]"));
    CHECK_THROWS_TYPE_WITH(mpx::bias_gradient(exec, y_bad, db), mpx::shape_error,
                           Catch::Contains("[5]") && Catch::Contains("[4, 3]"));
  };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("the bias gradient of an empty batch is zero", "[activation]", mpx_test::executors) {
  TestType exec;
  auto dy = mpx::make_tensor<float>(exec, {0, 5});
  auto db = mpx::make_tensor<float>(exec, {5});
  mpx::fill(exec, db, mpx_test::poison<float>());
  mpx::bias_gradient(exec, dy, db);
  REQUIRE(mpx_test::first_mismatch(mpx_test::download(exec, db), std::vector<float>(5, 0.0f)).empty());
}

TEST_CASE("mpx::activation selects every activation of the one list, by value and by name", "[activation]") {
  std::size_t count = 0;
  mpx_test::reference::for_each_listed_activation([&](auto a) {
    using A = decltype(a);
    mpx::activation const sel = a;
    INFO(A::name);
    CHECK(sel.index() == count++);
    CHECK(sel.name() == A::name);
    CHECK(mpx::to_string(sel) == A::name);
    CHECK(mpx::activation::from_name(A::name) == sel);
    bool right_functor = false;
    mpx::with_activation(sel, [&](auto b) { right_functor = std::is_same_v<decltype(b), A>; });
    CHECK(right_functor);
  });
  CHECK(count == mpx::activations::size);
  CHECK(mpx::activation{} == mpx::activation::linear);
  CHECK(mpx::activation(mpx::activation::gelu_tanh).name() == "gelu_tanh");
  CHECK(mpx::activation(mpx::activation::gelu).name() == "gelu");
  CHECK(mpx::activation::gelu != mpx::activation(mpx::activation::gelu_tanh));
  CHECK_THROWS_TYPE_WITH(mpx::activation::from_name("swish"), mpx::invalid_argument,
                         Catch::Contains("swish") && Catch::Contains("gelu_tanh"));
  static_assert(mpx::listed_activation<mpx::act::gelu_tanh>);
  static_assert(mpx::activation(mpx::activation::gelu_tanh).name() == "gelu_tanh");  // docs/transformers.md
  static_assert(!mpx::listed_activation<float>);
}

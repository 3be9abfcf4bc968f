// Sparse categorical cross-entropy, binary cross-entropy from logits and mean squared
// error: the mean loss and its (optionally loss-scaled) gradient for every dtype on each
// executor, against float64 references whose gradients are checked by finite
// differences; bad labels, bad shapes, NaN and extreme logits.
//
// Bounds asserted (u_T storage's unit roundoff, u_f = 2^-24, n the elements or rows
// summed, k = classes/32 + 64):
//   loss      |L - ref| <= (4 sqrt(n) + k) u_f (|ref| + mean |term magnitudes|)
//   gradient  |g - ref| <= u_T |ref| + k u_f (scale / n) + min_subnormal_T
#include "../support/nn_reference.hpp"
#include "../support/reference/softmax.hpp"

#include <algorithm>
#include <array>
#include <cmath>

namespace {

using mpx_test::to_d;
using mpx_test::uf;

// float64 references.
double ref_bce(double x, double z) { return std::max(x, 0.0) - x * z + std::log1p(std::exp(-std::fabs(x))); }
double ref_bce_grad(double x, double z) { return 1 / (1 + std::exp(-x)) - z; }
// Cross-entropy and softmax: tests/support/reference/softmax.hpp.
using mpx_test::reference::cross_entropy_row;
using mpx_test::reference::softmax_row;

template <class Exec>
auto scale_in(Exec const& exec, float value) {
  return mpx::resident<float, mpx::memory_space_t<Exec>>(exec, value);
}

}  // namespace

TEST_CASE("the float64 loss references agree with finite differences", "[losses]") {
  for (double x = -9.7; x < 10; x += 0.61)
    for (double z : {0.0, 0.3, 1.0}) {
      INFO("x=" << x << " z=" << z);
      REQUIRE(std::fabs(mpx_test::finite_difference([&](double v) { return ref_bce(v, z); }, x) - ref_bce_grad(x, z)) <=
              1e-8);
    }
  auto const x = mpx_test::random_values<double>(9, -4, 4, 5);
  for (std::size_t i = 0; i < x.size(); ++i) {
    double const analytic = softmax_row(x)[i] - (i == 4 ? 1 : 0);
    auto f = [&](double v) {
      auto xs = x;
      xs[i] = v;
      return cross_entropy_row(xs, 4);
    };
    INFO("i=" << i);
    REQUIRE(std::fabs(mpx_test::finite_difference(f, x[i]) - analytic) <= 1e-8);
  }
}

TEMPLATE_LIST_TEST_CASE("sparse categorical cross-entropy matches float64, with and without a loss scale",
                        "[losses]", mpx_test::executors) {
  TestType exec;
  mpx::loss_value loss(exec);
  auto const scale = scale_in(exec, 1024.0f);
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    for (auto [rows, classes] : mpx_test::awkward_matrices()) {
      mpx::shape const s{static_cast<std::int64_t>(rows), static_cast<std::int64_t>(classes)};
      std::size_t const n = rows * classes;
      auto const x = mpx_test::random_values<T>(n, -8, 8, 41 + n);
      std::vector<std::int32_t> labels(rows);
      std::mt19937 gen(static_cast<unsigned>(mpx_test::seed + n));
      for (auto& l : labels) l = static_cast<std::int32_t>(gen() % classes);
      auto const xd = mpx_test::upload(exec, x, s);
      auto const ld = mpx_test::upload(exec, labels);
      for (bool scaled : {false, true}) {
        auto grad = mpx::make_tensor<T>(exec, s);
        mpx::fill(exec, grad, mpx_test::poison<T>());
        mpx::sparse_categorical_cross_entropy<mpx::mixed_float16>(exec, xd, ld, grad, loss,
                                                                  scaled ? scale.get() : nullptr);
        float const got = loss.read(exec);
        auto const g = mpx_test::download(exec, grad);
        double const factor = (scaled ? 1024.0 : 1.0) / static_cast<double>(rows);
        double const k = static_cast<double>(classes) / 32 + 64;
        double total = 0;
        mpx_test::bound_checker gc(std::string("cross-entropy gradient ") + std::string(mpx::dtype_name<T>));
        for (std::size_t r = 0; r < rows; ++r) {
          std::vector<double> row(classes);
          for (std::size_t c = 0; c < classes; ++c) row[c] = to_d(x[r * classes + c]);
          total += cross_entropy_row(row, labels[r]);
          auto const probabilities = softmax_row(row);
          double const m = mpx_test::reference::softmax_statistics_of(row).max;
          for (std::size_t c = 0; c < classes; ++c) {
            double const ref = mpx_test::representable_in<T>(
                (probabilities[c] - (static_cast<std::int32_t>(c) == labels[r] ? 1 : 0)) * factor);
            gc.check(r * classes + c, to_d(g[r * classes + c]), ref,
                     mpx_test::unit_roundoff<T>() * std::fabs(ref) + (k + 2 * std::fabs(row[c] - m)) * uf * factor +
                         mpx_test::min_subnormal<T>());
          }
        }
        double const ref_loss = total / static_cast<double>(rows);
        INFO(mpx::dtype_name<T> << " rows=" << rows << " classes=" << classes << " scaled=" << scaled);
        MPX_REQUIRE_WITHIN(gc);
        // The loss is the mean, unscaled whatever the gradient's scale.
        double const tol = (4 * std::sqrt(static_cast<double>(rows)) + k) * uf * (std::fabs(ref_loss) + 16);
        INFO("loss " << got << " reference " << ref_loss);
        REQUIRE(std::fabs(got - ref_loss) <= tol);
        if (classes > 1) REQUIRE(ref_loss > 0);
      }
    }
  };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("per-token cross-entropy over sequences is the mean over every token", "[losses]",
                        mpx_test::executors) {
  TestType exec;
  mpx::loss_value loss(exec);
  auto const scale = scale_in(exec, 4096.0f);
  mpx_test::for_each_dtype([&](auto tag) {
    using T = decltype(tag);
    for (auto [batch, tokens, classes] : {std::array<std::size_t, 3>{1, 1, 2}, std::array<std::size_t, 3>{3, 7, 65},
                                          std::array<std::size_t, 3>{2, 64, 97}, std::array<std::size_t, 3>{5, 13, 256}}) {
      INFO(mpx::dtype_name<T> << " [" << batch << ", " << tokens << ", " << classes << "]");
      auto const b = static_cast<std::int64_t>(batch), t = static_cast<std::int64_t>(tokens),
                 v = static_cast<std::int64_t>(classes);
      std::size_t const rows = batch * tokens;
      auto const x = mpx_test::random_values<T>(rows * classes, -6, 6, 77 + rows);
      std::vector<std::int32_t> labels(rows);
      std::mt19937 gen(static_cast<unsigned>(mpx_test::seed + rows));
      for (auto& l : labels) l = static_cast<std::int32_t>(gen() % classes);
      auto const xd = mpx_test::upload(exec, x, {b, t, v});
      auto const ld = mpx_test::upload(exec, labels, {b, t});
      auto grad = mpx_test::poisoned<T>(exec, {b, t, v});
      mpx::sparse_categorical_cross_entropy<mpx::mixed_float16>(exec, xd, ld, grad, loss, scale.get());
      float const per_token = loss.read(exec);
      // The same rows flattened to [batch * tokens, classes]: the same bits.
      auto flat_grad = mpx_test::poisoned<T>(exec, {b * t, v});
      mpx::sparse_categorical_cross_entropy<mpx::mixed_float16>(exec, xd.view().reshape({b * t, v}),
                                                                ld.view().reshape({b * t}), flat_grad, loss, scale.get());
      CHECK(loss.read(exec) == per_token);
      auto const g = mpx_test::download(exec, grad);
      auto const fg = mpx_test::download(exec, flat_grad);
      CHECK(mpx_test::first_mismatch(g, fg).empty());
      double total = 0;
      for (std::size_t r = 0; r < rows; ++r) {
        std::vector<double> row(classes);
        for (std::size_t c = 0; c < classes; ++c) row[c] = to_d(x[r * classes + c]);
        total += cross_entropy_row(row, labels[r]);
      }
      double const ref_loss = total / static_cast<double>(rows);  // the mean over tokens, not over sequences
      double const k = static_cast<double>(classes) / 32 + 64;
      CHECK(std::fabs(per_token - ref_loss) <= (4 * std::sqrt(static_cast<double>(rows)) + k) * uf * (std::fabs(ref_loss) + 16));
    }
  });
  auto x = mpx::make_tensor<float>(exec, {2, 3, 4});
  auto g = mpx::make_tensor<float>(exec, {2, 3, 4});
  auto flat_labels = mpx::make_tensor<std::int32_t>(exec, {6});
  CHECK_THROWS_TYPE_WITH(mpx::sparse_categorical_cross_entropy(exec, x, flat_labels, g, loss), mpx::shape_error,
                         Catch::Contains("expected [2, 3]"));
}

TEMPLATE_LIST_TEST_CASE("binary cross-entropy and mean squared error match float64", "[losses]",
                        mpx_test::executors) {
  TestType exec;
  mpx::loss_value loss(exec);
  auto const scale = scale_in(exec, 32768.0f);
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    for (auto [rows, cols] : mpx_test::awkward_matrices()) {
      mpx::shape const s{static_cast<std::int64_t>(rows), static_cast<std::int64_t>(cols)};
      std::size_t const n = rows * cols;
      auto const x = mpx_test::random_values<T>(n, -12, 12, 51 + n);
      auto const z = mpx_test::random_values<T>(n, 0, 1, 52 + n);
      auto const xd = mpx_test::upload(exec, x, s);
      auto const zd = mpx_test::upload(exec, z, s);
      for (bool mse : {false, true}) {
        for (bool scaled : {false, true}) {
          auto grad = mpx::make_tensor<T>(exec, s);
          mpx::fill(exec, grad, mpx_test::poison<T>());
          float const* sp = scaled ? scale.get() : nullptr;
          if (mse) mpx::mean_squared_error(exec, xd, zd, grad, loss, sp);
          else mpx::binary_cross_entropy<mpx::mixed_bfloat16>(exec, xd, zd, grad, loss, sp);
          float const got = loss.read(exec);
          auto const g = mpx_test::download(exec, grad);
          double const factor = (scaled ? 32768.0 : 1.0) / static_cast<double>(n);
          double total = 0, magnitude = 0;
          mpx_test::bound_checker gc(std::string(mse ? "mse" : "bce") + " gradient " + std::string(mpx::dtype_name<T>));
          for (std::size_t i = 0; i < n; ++i) {
            double const xv = to_d(x[i]), zv = to_d(z[i]);
            total += mse ? (xv - zv) * (xv - zv) : ref_bce(xv, zv);
            magnitude += mse ? (xv - zv) * (xv - zv) : std::fabs(xv) + 1;
            double const ref = mpx_test::representable_in<T>((mse ? 2 * (xv - zv) : ref_bce_grad(xv, zv)) * factor);
            gc.check(i, to_d(g[i]), ref,
                     mpx_test::unit_roundoff<T>() * std::fabs(ref) + 64 * uf * factor * (mse ? 1 + std::fabs(xv - zv) : 1) +
                         mpx_test::min_subnormal<T>());
          }
          double const ref_loss = total / static_cast<double>(n);
          INFO((mse ? "mse " : "bce ") << mpx::dtype_name<T> << " rows=" << rows << " cols=" << cols
                                       << " scaled=" << scaled << " loss " << got << " reference " << ref_loss);
          MPX_REQUIRE_WITHIN(gc);
          double const tol = (4 * std::sqrt(static_cast<double>(n)) + 64) * uf * (magnitude / static_cast<double>(n));
          REQUIRE(std::fabs(got - ref_loss) <= tol);
          REQUIRE(ref_loss > 0);
        }
      }
    }
  };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("losses stay finite at extreme logits and keep NaN", "[losses]", mpx_test::executors) {
  TestType exec;
  mpx::loss_value loss(exec);
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    INFO(mpx::dtype_name<T>);
    // Cross-entropy: rows of +-1e4, a row of equal logits, a masked row.
    std::vector<float> const xf = {1e4f, -1e4f, 0.0f,   // label 1: loss 2e4
                                   -1e4f, 1e4f, -1e4f,  // label 1: loss 0
                                   7.0f, 7.0f, 7.0f,    // label 2: loss log 3
                                   -INFINITY, 2.0f, 2.0f};  // label 2: loss log 2
    std::vector<T> x;
    for (float v : xf) x.push_back(mpx::cast<T>(v));
    std::vector<std::int32_t> const labels = {1, 1, 2, 2};
    auto const xd = mpx_test::upload(exec, x, {4, 3});
    auto const ld = mpx_test::upload(exec, labels);
    auto grad = mpx::make_tensor<T>(exec, {4, 3});
    mpx::fill(exec, grad, mpx_test::poison<T>());
    mpx::sparse_categorical_cross_entropy(exec, xd, ld, grad, loss);
    // Row 0 is [a, -a, 0] with label 1 and a = 1e4 as T holds it: loss 2a.
    double const expected = (2 * to_d(x[0]) + 0 + std::log(3.0) + std::log(2.0)) / 4;
    REQUIRE(std::fabs(loss.read(exec) - expected) <= 1e-6 * expected);
    auto g = mpx_test::download(exec, grad);
    for (auto v : g) REQUIRE(mpx::is_finite(v));
    CHECK(to_d(g[1]) == -0.25);  // (0 - 1) / 4
    CHECK(to_d(g[0]) == 0.25);
    CHECK(to_d(g[9]) == 0.0);  // the masked logit

    // A NaN logit: that sample's loss and gradient row are NaN, the others are not.
    x[4] = mpx::cast<T>(NAN);
    auto const xn = mpx_test::upload(exec, x, {4, 3});
    mpx::sparse_categorical_cross_entropy(exec, xn, ld, grad, loss);
    CHECK(std::isnan(loss.read(exec)));
    g = mpx_test::download(exec, grad);
    for (std::size_t i = 0; i < g.size(); ++i) CHECK(mpx::is_nan(g[i]) == (i / 3 == 1));

    // Binary cross-entropy at +-1e4: finite loss (1e4 for the wrong side), finite gradients.
    std::vector<T> const bx = {mpx::cast<T>(1e4f), mpx::cast<T>(-1e4f), mpx::cast<T>(1e4f), mpx::cast<T>(NAN)};
    std::vector<T> const bz = {mpx::cast<T>(1.0f), mpx::cast<T>(0.0f), mpx::cast<T>(0.0f), mpx::cast<T>(1.0f)};
    auto const bxd = mpx_test::upload(exec, bx, {2, 2});
    auto const bzd = mpx_test::upload(exec, bz, {2, 2});
    auto bg = mpx::make_tensor<T>(exec, {2, 2});
    mpx::fill(exec, bg, mpx_test::poison<T>());
    mpx::binary_cross_entropy(exec, mpx::view(bxd).flat(0, 3), mpx::view(bzd).flat(0, 3), mpx::view(bg).flat(0, 3), loss);
    REQUIRE(std::fabs(loss.read(exec) - to_d(bx[2]) / 3) <= 1e-6 * 1e4);  // only x = 1e4, z = 0 costs: 1e4
    auto const bgot = mpx_test::download(exec, bg);
    CHECK(to_d(bgot[0]) == 0.0);
    CHECK(to_d(bgot[1]) == 0.0);
    CHECK(std::fabs(to_d(bgot[2]) - 1.0 / 3) <= 2 * mpx_test::unit_roundoff<T>() / 3);
    CHECK(mpx::is_nan(bgot[3]));  // untouched: outside the view
    mpx::binary_cross_entropy(exec, bxd, bzd, bg, loss);
    CHECK(std::isnan(loss.read(exec)));
    CHECK(mpx::is_nan(mpx_test::download(exec, bg)[3]));
    mpx::mean_squared_error(exec, bxd, bzd, bg, loss);
    CHECK(std::isnan(loss.read(exec)));
  };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("a label outside [0, classes) is an invalid_argument naming the sample and the label",
                        "[losses]", mpx_test::executors) {
  TestType exec;
  mpx::loss_value loss(exec);
  auto const x = mpx_test::upload(exec, mpx_test::random_values<float>(40, -1, 1, 7), {8, 5});
  auto grad = mpx::make_tensor<float>(exec, {8, 5});
  for (std::int32_t bad : {5, -1, 1000}) {
    std::vector<std::int32_t> labels = {0, 1, 2, 3, 4, 0, 1, 2};
    labels[3] = bad;
    labels[6] = 7;  // a later bad one: the first is reported
    auto const ld = mpx_test::upload(exec, labels);
    std::string const expected = "sample 3 has label " + std::to_string(bad) + ", outside [0, 5)";
    if constexpr (mpx::is_host_executor_v<TestType>) {
      CHECK_THROWS_TYPE_WITH(mpx::sparse_categorical_cross_entropy(exec, x, ld, grad, loss), mpx::invalid_argument,
                             Catch::Contains(expected));
    } else {
      mpx::sparse_categorical_cross_entropy(exec, x, ld, grad, loss);  // enqueued: found on the device
      CHECK_THROWS_TYPE_WITH(
          [&] {
            mpx::sparse_categorical_cross_entropy(exec, x, ld, grad, loss);
            (void)loss.read(exec);
          }(),
          mpx::invalid_argument, Catch::Contains(expected));
      auto const g = mpx_test::download(exec, grad);
      CHECK(mpx::is_nan(g[3 * 5]));
      CHECK(!mpx::is_nan(g[0]));
    }
  }
  // After a report the loss reads normally again.
  std::vector<std::int32_t> const good = {0, 1, 2, 3, 4, 0, 1, 2};
  auto const gd = mpx_test::upload(exec, good);
  mpx::sparse_categorical_cross_entropy(exec, x, gd, grad, loss);
  REQUIRE(std::isfinite(loss.read(exec)));
}

TEMPLATE_LIST_TEST_CASE("losses refuse mismatched shapes, naming both, and average an empty batch to 0", "[losses]",
                        mpx_test::executors) {
  TestType exec;
  mpx::loss_value loss(exec);
  auto x = mpx::make_tensor<float>(exec, {4, 3});
  auto g = mpx::make_tensor<float>(exec, {4, 3});
  auto labels = mpx::make_tensor<std::int32_t>(exec, {5});
  auto t = mpx::make_tensor<float>(exec, {3, 4});
  CHECK_THROWS_TYPE_WITH(mpx::sparse_categorical_cross_entropy(exec, x, labels, g, loss), mpx::shape_error,
                         Catch::Contains("[5]") && Catch::Contains("[4, 3]"));
  CHECK_THROWS_TYPE_WITH(mpx::binary_cross_entropy(exec, x, t, g, loss), mpx::shape_error,
                         Catch::Contains("[4, 3]") && Catch::Contains("[3, 4]"));
  CHECK_THROWS_TYPE_WITH(mpx::mean_squared_error(exec, x, g, t, loss), mpx::shape_error,
                         Catch::Contains("[4, 3]") && Catch::Contains("[3, 4]"));
  // The gradient written over the logits would be read back as logits.
  auto four = mpx::make_tensor<std::int32_t>(exec, {4});
  mpx::fill(exec, four, std::int32_t{1});
  CHECK_THROWS_TYPE_WITH(mpx::sparse_categorical_cross_entropy(exec, x, four, x, loss), mpx::invalid_argument,
                         Catch::Contains("the gradient and the logits overlap in memory"));
  auto wide = mpx::make_tensor<float>(exec, {5, 3});
  auto const rows_1_to_4 = mpx::tensor_view<float, mpx::memory_space_t<TestType>>(wide.data() + 3, {4, 3});
  auto const rows_0_to_3 = mpx::tensor_view<float, mpx::memory_space_t<TestType>>(wide.data(), {4, 3});
  CHECK_THROWS_TYPE_WITH(mpx::sparse_categorical_cross_entropy(exec, rows_1_to_4, four, rows_0_to_3, loss),
                         mpx::invalid_argument, Catch::Contains("overlap"));
  auto none = mpx::make_tensor<float>(exec, {0, 3});
  auto no_labels = mpx::make_tensor<std::int32_t>(exec, {0});
  mpx::sparse_categorical_cross_entropy(exec, none, no_labels, none, loss);
  CHECK(loss.read(exec) == 0.0f);
  mpx::mean_squared_error(exec, none, none, none, loss);
  CHECK(loss.read(exec) == 0.0f);
}

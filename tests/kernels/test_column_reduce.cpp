// The column reduction (kernels/column_reduce.hpp): mpx::column_sum for every dtype on
// each executor against float64, exact where the float sums are exact; the same bits
// from the bias gradient and layer norm's dbeta, which run on the same engine; several
// sums per column; deterministic from run to run; outputs poisoned first.
#include "../support/exact_values.hpp"
#include "../support/nn_reference.hpp"
#include "../support/reference/matmul.hpp"

#include <cmath>
#include <utility>
#include <vector>

namespace {

// Shapes with one row, one column, more rows than a host chunk (256) or a GPU tile
// column (8 rows per thread), more columns than a tile (32), and no rows at all.
std::vector<std::pair<std::size_t, std::size_t>> column_shapes() {
  return {{1, 1},   {1, 7},   {7, 1},     {0, 5},     {1000, 3}, {3, 1000}, {257, 33},
          {4099, 31}, {31, 4099}, {2, 12000}, {20000, 2}, {513, 65}};
}

// Multiples of 1/8 in [-4, 4]: every float partial sum below is exact (at most 20000 x 4
// = 2^16.3 in steps of 2^-3 needs 20 bits), and the values are exact in half and bfloat16.
template <class T>
std::vector<T> eighths(std::size_t n, std::uint64_t stream) {
  return mpx_test::random_multiples<T>(n, 32, 8, stream);
}

// The float64 column sums: tests/support/reference/matmul.hpp.
using mpx_test::reference::column_sums;

// Three sums per column at once: x, x^2 and 1 (the row count), in float.
template <class X>
struct three_terms {
  X const* x;
  std::size_t cols;
  MPX_HD void operator()(std::size_t r, std::size_t j, float (&t)[3]) const {
    float const v = mpx::cast<float>(x[r * cols + j]);
    t[0] = v;
    t[1] = v * v;
    t[2] = 1.0f;
  }
};
struct store_three {
  float* out;  // [3, cols]
  std::size_t cols;
  MPX_HD void operator()(std::size_t j, float const (&s)[3]) const {
    out[j] = s[0];
    out[cols + j] = s[1];
    out[2 * cols + j] = s[2];
  }
};

}  // namespace

TEMPLATE_LIST_TEST_CASE("column_sum is exact where the float sums are exact, for every dtype", "[column_reduce]",
                        mpx_test::executors) {
  TestType exec;
  mpx_test::for_each_dtype([&](auto tag) {
    using T = decltype(tag);
    for (auto [rows, cols] : column_shapes()) {
      std::size_t const n = rows * cols;
      auto const x = eighths<T>(n, 31 + n);
      auto const xd = mpx_test::upload(exec, x, {static_cast<std::int64_t>(rows), static_cast<std::int64_t>(cols)});
      auto y = mpx_test::poisoned<T>(exec, {static_cast<std::int64_t>(cols)});
      auto yf = mpx_test::poisoned<float>(exec, {static_cast<std::int64_t>(cols)});
      mpx::column_sum(exec, xd, y);
      mpx::column_sum<mpx::mixed_float16>(exec, xd, yf);
      auto const ref = column_sums(mpx_test::widen(x), cols);
      auto const got = mpx_test::download(exec, y);
      auto const got_f = mpx_test::download(exec, yf);
      std::vector<T> expected(cols);
      std::vector<float> expected_f(cols);
      bool nonzero = rows == 0;
      for (std::size_t j = 0; j < cols; ++j) {
        expected[j] = mpx::cast<T>(ref[j]);  // one rounding, of the exact sum
        expected_f[j] = static_cast<float>(ref[j]);
        nonzero |= ref[j] != 0;
      }
      INFO(mpx::dtype_name<T> << " rows=" << rows << " cols=" << cols);
      REQUIRE(nonzero);
      REQUIRE(mpx_test::first_mismatch(got, expected).empty());
      REQUIRE(mpx_test::first_mismatch(got_f, expected_f).empty());
    }
  });
}

TEMPLATE_LIST_TEST_CASE("column_sum of random values is within the float bound of float64, the same bits each run",
                        "[column_reduce]", mpx_test::executors) {
  TestType exec;
  using mpx_test::uf;
  for (auto [rows, cols] : column_shapes()) {
    std::size_t const n = rows * cols;
    auto const x = mpx_test::random_values<float>(n, -1, 3, 41 + n);
    mpx::shape const s{static_cast<std::int64_t>(rows), static_cast<std::int64_t>(cols)};
    auto const xd = mpx_test::upload(exec, x, s);
    auto y = mpx_test::poisoned<float>(exec, {static_cast<std::int64_t>(cols)});
    mpx::column_sum(exec, xd, y);
    auto const got = mpx_test::download(exec, y);
    auto const ref = column_sums(mpx_test::widen(x), cols);
    std::vector<double> abs_x(n);
    for (std::size_t i = 0; i < n; ++i) abs_x[i] = std::fabs(static_cast<double>(x[i]));
    auto const abs_sum = column_sums(abs_x, cols);
    // Additions along the longest path: rows per thread (at most rows / 8 on the GPU, 256
    // per host chunk), 8 row-threads, at most 256 chunks (rows / 256 on the host).
    double const depth = static_cast<double>(rows) / 8 + 8 + 256 + static_cast<double>(rows) / 256 + 1;
    mpx_test::bound_checker check("column_sum float");
    for (std::size_t j = 0; j < cols; ++j) check.check(j, got[j], ref[j], depth * uf * abs_sum[j]);
    INFO("rows=" << rows << " cols=" << cols);
    MPX_REQUIRE_WITHIN(check);

    // Again, into a freshly poisoned output: the same bits.
    auto again = mpx_test::poisoned<float>(exec, {static_cast<std::int64_t>(cols)});
    mpx::column_sum(exec, xd, again);
    REQUIRE(mpx_test::first_mismatch(mpx_test::download(exec, again), got).empty());

    // A rank-3 view of the same data sums the same columns.
    if (rows % 3 == 0 && rows > 0) {
      auto again3 = mpx_test::poisoned<float>(exec, {static_cast<std::int64_t>(cols)});
      mpx::column_sum(exec, mpx::view(xd).reshape({3, static_cast<std::int64_t>(rows / 3), static_cast<std::int64_t>(cols)}),
                      again3);
      REQUIRE(mpx_test::first_mismatch(mpx_test::download(exec, again3), got).empty());
    }
  }
}

TEMPLATE_LIST_TEST_CASE("the bias gradient and layer norm's dbeta are the same column reduction", "[column_reduce]",
                        mpx_test::executors) {
  TestType exec;
  for (auto [rows, cols] : column_shapes()) {
    if (rows == 0) continue;
    std::size_t const n = rows * cols;
    mpx::shape const s{static_cast<std::int64_t>(rows), static_cast<std::int64_t>(cols)};
    mpx::shape const sc{static_cast<std::int64_t>(cols)};
    mpx::shape const sr{static_cast<std::int64_t>(rows)};
    auto const dy = mpx_test::upload(exec, mpx_test::random_values<mpx::half>(n, -2, 2, 51 + n), s);
    auto const x = mpx_test::upload(exec, mpx_test::random_values<mpx::half>(n, -2, 2, 52 + n), s);
    auto sum = mpx_test::poisoned<float>(exec, sc);
    auto db = mpx_test::poisoned<float>(exec, sc);
    mpx::column_sum(exec, dy, sum);
    mpx::bias_gradient(exec, dy, db);
    auto const expected = mpx_test::download(exec, sum);
    INFO("rows=" << rows << " cols=" << cols);
    REQUIRE(mpx_test::first_mismatch(mpx_test::download(exec, db), expected).empty());

    auto const gamma = mpx_test::upload(exec, std::vector<float>(cols, 1.0f), sc);
    auto const beta = mpx_test::upload(exec, std::vector<float>(cols, 0.0f), sc);
    auto y = mpx::make_tensor<mpx::half>(exec, s);
    auto mean = mpx::make_tensor<float>(exec, sr);
    auto rstd = mpx::make_tensor<float>(exec, sr);
    auto dx = mpx::make_tensor<mpx::half>(exec, s);
    auto dgamma = mpx_test::poisoned<float>(exec, sc);
    auto dbeta = mpx_test::poisoned<float>(exec, sc);
    mpx::layer_norm_forward<mpx::mixed_float16>(exec, x, gamma, beta, y, mean, rstd);
    mpx::layer_norm_backward<mpx::mixed_float16>(exec, x, dy, gamma, mean, rstd, dx, dgamma, dbeta);
    REQUIRE(mpx_test::first_mismatch(mpx_test::download(exec, dbeta), expected).empty());
  }
}

TEMPLATE_LIST_TEST_CASE("a column reduction with three sums per column", "[column_reduce]", mpx_test::executors) {
  TestType exec;
  for (auto [rows, cols] : column_shapes()) {
    std::size_t const n = rows * cols;
    auto const x = eighths<mpx::bfloat16>(n, 61 + n);
    auto const xd = mpx_test::upload(exec, x, {static_cast<std::int64_t>(rows), static_cast<std::int64_t>(cols)});
    auto out = mpx_test::poisoned<float>(exec, {3, static_cast<std::int64_t>(cols)});
    mpx::detail::column_reduce<3, float>(exec, three_terms<mpx::bfloat16>{xd.data(), cols},
                                         store_three{out.data(), cols}, rows, cols);
    auto const got = mpx_test::download(exec, out);
    auto const xs = mpx_test::widen(x);
    std::vector<double> sq(n);
    for (std::size_t i = 0; i < n; ++i) sq[i] = xs[i] * xs[i];
    auto const s1 = column_sums(xs, cols);
    auto const s2 = column_sums(sq, cols);
    std::vector<float> expected(3 * cols);
    for (std::size_t j = 0; j < cols; ++j) {
      expected[j] = static_cast<float>(s1[j]);
      expected[cols + j] = static_cast<float>(s2[j]);  // squares are multiples of 1/64, at most 16: exact too
      expected[2 * cols + j] = static_cast<float>(rows);
    }
    INFO("rows=" << rows << " cols=" << cols);
    REQUIRE(mpx_test::first_mismatch(got, expected).empty());
  }
}

TEST_CASE("column_sum refuses shapes that do not meet", "[column_reduce]") {
  mpx::host_executor exec;
  auto x = mpx::make_tensor<float>(exec, {4, 5});
  mpx::fill(exec, x, 1.0f);
  auto wrong = mpx::make_tensor<float>(exec, {4});
  auto rank2 = mpx::make_tensor<float>(exec, {1, 5});
  CHECK_THROWS_TYPE_WITH(mpx::column_sum(exec, x, wrong), mpx::shape_error,
                         Catch::Contains("[4]") && Catch::Contains("[4, 5]"));
  CHECK_THROWS_AS(mpx::column_sum(exec, x, rank2), mpx::shape_error);
}

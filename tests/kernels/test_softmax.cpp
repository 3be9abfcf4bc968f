// softmax and log_softmax over the last axis, forward and backward, for every dtype on
// each executor, against float64 (the reference's backward checked by finite
// differences), over row lengths that take every kernel path; outputs poisoned first.
//
// Bounds asserted per element (u_T storage's unit roundoff, u_f = 2^-24, k = cols/32 + 48
// for the float row sums, d = |x - max|):
//   softmax      |y - ref| <= (u_T + (k + 2d) u_f) |ref| + min_subnormal_T
//   log_softmax  |y - ref| <= u_T |ref| + (k + 2d + |log S|) u_f
//   backward     |dx - ref| <= u_T |ref| + k u_f (terms of the formula in absolute value)
#include "../support/nn_reference.hpp"
#include "../support/reference/softmax.hpp"

#include <algorithm>
#include <cmath>

namespace {

using mpx_test::to_d;
using mpx_test::uf;

// The float64 references: tests/support/reference/softmax.hpp.
using mpx_test::reference::softmax_row;
using mpx_test::reference::softmax_statistics_of;

//! Row `base / cols` of v in float64.
template <class T>
std::vector<double> widen_row(std::vector<T> const& v, std::size_t base, std::size_t cols) {
  std::vector<double> out(cols);
  for (std::size_t c = 0; c < cols; ++c) out[c] = to_d(v[base + c]);
  return out;
}

//! The backward reference of row `base / cols` from the stored output y and dy, with the
//! sum of magnitudes each element's error bound scales.
struct backward_row_reference {
  std::vector<double> dx, terms;
};
template <class T>
backward_row_reference ref_backward_row(std::vector<T> const& y, std::vector<T> const& dy, std::size_t base,
                                        std::size_t cols, bool log) {
  auto const yr = widen_row(y, base, cols), gr = widen_row(dy, base, cols);
  auto const back = mpx_test::reference::softmax_backward_row(yr, gr, log);
  backward_row_reference r{back.dx, std::vector<double>(cols)};
  for (std::size_t c = 0; c < cols; ++c)
    r.terms[c] = log ? std::fabs(gr[c]) + std::exp(yr[c]) * (std::fabs(back.dot) + back.abs_dot)
                     : std::fabs(yr[c]) * (std::fabs(gr[c]) + std::fabs(back.dot) + back.abs_dot);
  return r;
}

}  // namespace

TEST_CASE("the float64 softmax backward references agree with finite differences", "[softmax]") {
  auto const x = mpx_test::random_values<double>(7, -3, 3, 1);
  auto const dy = mpx_test::random_values<double>(7, -1, 1, 2);
  for (bool log : {false, true}) {
    auto const dx = mpx_test::reference::softmax_backward_row(softmax_row(x, log), dy, log).dx;
    for (std::size_t i = 0; i < x.size(); ++i) {
      // L(x) = sum_k dy_k y_k(x); dL/dx_i by central differences.
      auto loss = [&](double xi) {
        auto xs = x;
        xs[i] = xi;
        auto const y = softmax_row(xs, log);
        double l = 0;
        for (std::size_t k = 0; k < y.size(); ++k) l += dy[k] * y[k];
        return l;
      };
      INFO("log=" << log << " i=" << i);
      REQUIRE(std::fabs(mpx_test::finite_difference(loss, x[i]) - dx[i]) <= 1e-8);
    }
  }
}

TEMPLATE_LIST_TEST_CASE("softmax and log_softmax forward and backward are within the bound of float64",
                        "[softmax]", mpx_test::executors) {
  TestType exec;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    double const uT = mpx_test::unit_roundoff<T>();
    for (auto [rows, cols] : mpx_test::awkward_matrices()) {
      mpx::shape const s{static_cast<std::int64_t>(rows), static_cast<std::int64_t>(cols)};
      std::size_t const n = rows * cols;
      auto const x = mpx_test::random_values<T>(n, -8, 8, 31 + n);
      auto const dy = mpx_test::random_values<T>(n, -1, 1, 32 + n);
      auto const xd = mpx_test::upload(exec, x, s);
      auto const dyd = mpx_test::upload(exec, dy, s);
      double const k = static_cast<double>(cols) / 32 + 48;
      for (bool log : {false, true}) {
        auto y = mpx::make_tensor<T>(exec, s);
        auto dx = mpx::make_tensor<T>(exec, s);
        mpx::fill(exec, y, mpx_test::poison<T>());
        mpx::fill(exec, dx, mpx_test::poison<T>());
        if (log) mpx::log_softmax<mpx::mixed_float16>(exec, xd, y);
        else mpx::softmax<mpx::mixed_bfloat16>(exec, xd, y);
        // The backward pass from the output the forward pass stored, as a layer runs it.
        if (log) mpx::log_softmax_backward(exec, y, dyd, dx);
        else mpx::softmax_backward(exec, y, dyd, dx);
        auto const got_y = mpx_test::download(exec, y);
        auto const got_dx = mpx_test::download(exec, dx);

        std::string const name = std::string(log ? "log_softmax " : "softmax ") + std::string(mpx::dtype_name<T>);
        mpx_test::bound_checker fwd(name + " forward"), bwd(name + " backward");
        double row_total = 0;
        for (std::size_t r = 0; r < rows; ++r) {
          std::size_t const base = r * cols;
          auto const xr = widen_row(x, base, cols);
          auto const st = softmax_statistics_of(xr);
          double const log_s = std::log(st.sum);
          auto const y_ref = softmax_row(xr, log);
          auto const back = ref_backward_row(got_y, dy, base, cols, log);
          for (std::size_t c = 0; c < cols; ++c) {
            std::size_t const i = base + c;
            double const d = std::fabs(xr[c] - st.max);
            double const ref = y_ref[c];
            double const tol = log ? uT * std::fabs(ref) + (k + 2 * d + std::fabs(log_s)) * uf
                                   : (uT + (k + 2 * d) * uf) * std::fabs(ref) + mpx_test::min_subnormal<T>();
            fwd.check(i, to_d(got_y[i]), ref, tol);
            if (!log) row_total += ref;
            double const ref_dx = back.dx[c];
            bwd.check(i, to_d(got_dx[i]), ref_dx,
                      uT * std::fabs(ref_dx) + k * uf * back.terms[c] + mpx_test::min_subnormal<T>());
          }
        }
        INFO("rows=" << rows << " cols=" << cols);
        MPX_REQUIRE_WITHIN(fwd);
        MPX_REQUIRE_WITHIN(bwd);
        if (!log) REQUIRE(std::fabs(row_total - static_cast<double>(rows)) < 1e-9 * static_cast<double>(rows));
      }
    }
  };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("softmax stays finite for extreme and masked logits and keeps NaN", "[softmax]",
                        mpx_test::executors) {
  TestType exec;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    for (std::size_t cols : {std::size_t{5}, std::size_t{1000}, std::size_t{4099}, std::size_t{12000}}) {
      // Rows: 0 extremes +-1e4; 1 all equal; 2 masked (-inf) but for two entries;
      // 3 a NaN; 4 all masked (undefined: NaN).
      std::size_t const rows = 5;
      std::vector<T> x(rows * cols);
      for (std::size_t c = 0; c < cols; ++c) {
        x[c] = mpx::cast<T>(c % 2 ? 1e4f : -1e4f);
        x[cols + c] = mpx::cast<T>(3.25f);
        x[2 * cols + c] = mpx::cast<T>(c == 1 ? 2.0f : c == cols - 1 ? 1.0f : -INFINITY);
        x[3 * cols + c] = mpx::cast<T>(c == cols / 2 ? NAN : 0.5f);
        x[4 * cols + c] = mpx::cast<T>(-INFINITY);
      }
      mpx::shape const s{static_cast<std::int64_t>(rows), static_cast<std::int64_t>(cols)};
      auto const xd = mpx_test::upload(exec, x, s);
      auto y = mpx::make_tensor<T>(exec, s);
      auto ly = mpx::make_tensor<T>(exec, s);
      mpx::fill(exec, y, mpx_test::poison<T>());
      mpx::fill(exec, ly, mpx_test::poison<T>());
      mpx::softmax(exec, xd, y);
      mpx::log_softmax(exec, xd, ly);
      auto const p = mpx_test::download(exec, y);
      auto const lp = mpx_test::download(exec, ly);
      INFO(mpx::dtype_name<T> << " cols=" << cols);
      std::size_t const highs = cols / 2;  // entries at +1e4 in row 0
      double const e = std::exp(-1.0);     // row 2: exp(1 - 2)
      for (std::size_t c = 0; c < cols; ++c) {
        INFO("c=" << c);
        double const p0 = c % 2 ? 1.0 / static_cast<double>(highs) : 0.0;
        REQUIRE(std::fabs(to_d(p[c]) - p0) <= 2 * mpx_test::unit_roundoff<T>() * p0 + 1e-6 * p0);
        REQUIRE(mpx::is_finite(lp[c]));
        REQUIRE(std::fabs(to_d(p[cols + c]) * static_cast<double>(cols) - 1.0) <= 2 * mpx_test::unit_roundoff<T>() + 1e-5);
        double const p2 = c == 1 ? 1 / (1 + e) : c == cols - 1 && cols > 1 ? e / (1 + e) : 0.0;
        REQUIRE(std::fabs(to_d(p[2 * cols + c]) - p2) <= 2 * mpx_test::unit_roundoff<T>() * p2 + 1e-6);
        if (p2 == 0) REQUIRE(to_d(lp[2 * cols + c]) == -INFINITY);
        else REQUIRE(mpx::is_finite(lp[2 * cols + c]));
        REQUIRE(mpx::is_nan(p[3 * cols + c]));
        REQUIRE(mpx::is_nan(lp[3 * cols + c]));
        REQUIRE(mpx::is_nan(p[4 * cols + c]));
      }
      // The backward pass through the masked row stays finite and gives the masked entries 0.
      auto dy = mpx::make_tensor<T>(exec, s);
      mpx::fill(exec, dy, mpx::cast<T>(0.5f));
      auto dx = mpx::make_tensor<T>(exec, s);
      mpx::fill(exec, dx, mpx_test::poison<T>());
      mpx::softmax_backward(exec, y, dy, dx);
      auto const g = mpx_test::download(exec, dx);
      for (std::size_t c = 0; c < cols; ++c) {
        REQUIRE(mpx::is_finite(g[2 * cols + c]));
        REQUIRE(mpx::is_nan(g[3 * cols + c]));
      }
    }
  };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("softmax refuses mismatched shapes, naming both", "[softmax]", mpx_test::executors) {
  TestType exec;
  auto x = mpx::make_tensor<float>(exec, {3, 4});
  auto y = mpx::make_tensor<mpx::half>(exec, {4, 3});
  auto dy = mpx::make_tensor<float>(exec, {3, 5});
  CHECK_THROWS_TYPE_WITH(mpx::softmax(exec, x, y), mpx::shape_error,
                         Catch::Contains("[3, 4]") && Catch::Contains("[4, 3]"));
  CHECK_THROWS_TYPE_WITH(mpx::log_softmax_backward(exec, x, dy, x), mpx::shape_error,
                         Catch::Contains("[3, 4]") && Catch::Contains("[3, 5]"));
  auto empty = mpx::make_tensor<float>(exec, {0, 4});
  mpx::softmax(exec, empty, empty);  // nothing to do, no error
}

// A row's write pass would clobber inputs of later columns or rows that it has not read
// yet (found by the API fuzzer, fuzz/regressions/api_rows/softmax-backward-dx-overlapping-dy).
TEMPLATE_LIST_TEST_CASE("softmax runs in place but refuses an output shifted over its input", "[softmax]",
                        mpx_test::executors) {
  TestType exec;
  auto buffer = mpx::make_tensor<float>(exec, {32});
  auto const at = [&](std::int64_t offset) {
    auto v = mpx::view(buffer);
    return decltype(v)(v.data() + offset, mpx::shape{3, 5});
  };
  mpx::fill(exec, buffer, 0.5f);
  auto y = mpx::make_tensor<float>(exec, {3, 5});
  mpx::softmax(exec, at(0), at(0));
  mpx::softmax_backward(exec, at(0), at(16), at(16));
  mpx::softmax_backward(exec, at(0), at(16), at(0));
  CHECK_THROWS_TYPE_WITH(mpx::softmax(exec, at(0), at(3)), mpx::invalid_argument,
                         Catch::Contains("y and x overlap"));
  CHECK_THROWS_TYPE_WITH(mpx::log_softmax(exec, at(3), at(0)), mpx::invalid_argument,
                         Catch::Contains("y and x overlap"));
  CHECK_THROWS_TYPE_WITH(mpx::softmax_backward(exec, y, at(0), at(3)), mpx::invalid_argument,
                         Catch::Contains("dx and dy overlap"));
  CHECK_THROWS_TYPE_WITH(mpx::log_softmax_backward(exec, at(3), y, at(0)), mpx::invalid_argument,
                         Catch::Contains("dx and y overlap"));
}

// The kernels count a row's columns in int steps of up to a block; a row so long that
// the last step would pass 2^31 is refused before anything is read. (The views cover one
// real element: a check that let them through would read far out of bounds.)
TEMPLATE_LIST_TEST_CASE("rows too long for the kernels' column counters are refused", "[softmax][norm]",
                        mpx_test::executors) {
  TestType exec;
  using space = mpx::memory_space_t<TestType>;
  auto one = mpx::make_tensor<float>(exec, {1});
  auto labels = mpx::make_tensor<std::int32_t>(exec, {1});
  std::int64_t const too_long = 0x7FFF'FFFF - 1000;  // fits an int, but not with a block's step added
  mpx::tensor_view<float, space> const row(one.data(), mpx::shape{1, too_long});
  mpx::tensor_view<float, space> const per_row(one.data(), mpx::shape{1});
  CHECK_THROWS_TYPE_WITH(mpx::softmax<mpx::float32>(exec, row, row), mpx::invalid_argument, Catch::Contains("2^31 - 1025"));
  auto const gamma = row.flat(0, static_cast<std::size_t>(too_long));
  CHECK_THROWS_TYPE_WITH(mpx::layer_norm_forward<mpx::float32>(exec, row, gamma, gamma, row, per_row, per_row),
                         mpx::invalid_argument, Catch::Contains("2^31 - 1025"));
  mpx::loss_value<space> loss(exec);
  auto gradient = mpx::make_tensor<float>(exec, {1});
  mpx::tensor_view<float, space> const gradient_row(gradient.data(), mpx::shape{1, too_long});
  CHECK_THROWS_TYPE_WITH(
      mpx::sparse_categorical_cross_entropy<mpx::float32>(exec, row, mpx::view(labels), gradient_row, loss),
      mpx::invalid_argument, Catch::Contains("2^31 - 1025"));
}

// The warp kernels keep a row in registers, PerLane = 4, 8, 16 (or 32) values per lane
// for rows of 65 to 1024 columns: widths on both sides of each switch, 11 rows (a block
// holds 8: a full block and a partial one), and rows that are masked in part (-inf),
// masked entirely (NaN by definition), or hold a NaN or a +inf (NaN rows).
TEMPLATE_LIST_TEST_CASE("softmax warp kernels for rows of 65 to 513 columns match float64, edge rows included",
                        "[softmax]", mpx_test::executors) {
  TestType exec;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    double const uT = mpx_test::unit_roundoff<T>();
    std::size_t const rows = 11;
    for (std::size_t cols : {65, 127, 128, 129, 255, 256, 257, 511, 512, 513}) {
      mpx::shape const s{static_cast<std::int64_t>(rows), static_cast<std::int64_t>(cols)};
      auto x = mpx_test::random_values<T>(rows * cols, -8, 8, 500 + cols);
      auto const dy = mpx_test::random_values<T>(rows * cols, -1, 1, 600 + cols);
      for (std::size_t c = 0; c < cols; ++c) {
        if (c % 3 != 1) x[2 * cols + c] = mpx::cast<T>(-INFINITY);  // row 2: masked but every third
        x[5 * cols + c] = mpx::cast<T>(-INFINITY);                  // row 5: masked entirely
      }
      x[3 * cols] = mpx::cast<T>(-INFINITY);                // row 3: only its first entry masked
      x[7 * cols + cols - 1] = mpx::cast<T>(NAN);           // row 7: a NaN in the last column
      x[9 * cols + cols / 2] = mpx::cast<T>(INFINITY);      // row 9: a +inf
      x[10 * cols + cols - 1] = mpx::cast<T>(40.0f);        // row 10: the maximum in the last column
      auto const xd = mpx_test::upload(exec, x, s);
      auto const dyd = mpx_test::upload(exec, dy, s);
      double const k = static_cast<double>(cols) / 32 + 48;
      for (bool log : {false, true}) {
        auto y = mpx_test::poisoned<T>(exec, s);
        auto dx = mpx_test::poisoned<T>(exec, s);
        if (log) mpx::log_softmax(exec, xd, y);
        else mpx::softmax(exec, xd, y);
        if (log) mpx::log_softmax_backward(exec, y, dyd, dx);
        else mpx::softmax_backward(exec, y, dyd, dx);
        // In place (y may be x): the same values, bit for bit.
        auto inplace = mpx_test::upload(exec, x, s);
        if (log) mpx::log_softmax(exec, inplace, inplace);
        else mpx::softmax(exec, inplace, inplace);
        auto const got_y = mpx_test::download(exec, y);
        auto const got_dx = mpx_test::download(exec, dx);
        std::string const name = std::string(log ? "log_softmax " : "softmax ") + std::string(mpx::dtype_name<T>) +
                                 " cols=" + std::to_string(cols);
        INFO(name);
        REQUIRE(mpx_test::first_mismatch(mpx_test::download(exec, inplace), got_y).empty());
        mpx_test::bound_checker fwd(name + " forward"), bwd(name + " backward");
        std::size_t nan_rows = 0;
        for (std::size_t r = 0; r < rows; ++r) {
          std::size_t const base = r * cols;
          auto const xr = widen_row(x, base, cols);
          auto const ref = softmax_row(xr, log);
          nan_rows += std::isnan(ref[0]);
          auto const st = softmax_statistics_of(xr);
          auto const back = ref_backward_row(got_y, dy, base, cols, log);
          for (std::size_t c = 0; c < cols; ++c) {
            std::size_t const i = base + c;
            double tol = 0;  // a masked entry is exactly 0 (log: -inf, which must match exactly)
            if (std::isfinite(xr[c]) && std::isfinite(ref[c])) {
              double const d = std::fabs(xr[c] - st.max);
              tol = log ? uT * std::fabs(ref[c]) + (k + 2 * d + std::fabs(std::log(st.sum))) * mpx_test::uf
                        : (uT + (k + 2 * d) * mpx_test::uf) * std::fabs(ref[c]) + mpx_test::min_subnormal<T>();
            }
            fwd.check(i, to_d(got_y[i]), ref[c], tol);
            double const dx_tol =
                uT * std::fabs(back.dx[c]) + k * mpx_test::uf * back.terms[c] + mpx_test::min_subnormal<T>();
            bwd.check(i, to_d(got_dx[i]), back.dx[c], std::isfinite(dx_tol) ? dx_tol : 0.0);
          }
        }
        REQUIRE(nan_rows == 3);  // rows 5, 7 and 9: the reference is not all numbers, nor all NaN
        MPX_REQUIRE_WITHIN(fwd);
        MPX_REQUIRE_WITHIN(bwd);
      }
    }
  };
  mpx_test::for_each_dtype(for_type);
}
